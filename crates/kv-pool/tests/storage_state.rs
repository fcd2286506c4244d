//! SSM state storage against a host reference: gather by slot batch
//! (merge/filter/extract), written-through steps with bit-identical rollback
//! (two open at once, as a pipelined engine keeps them), slot copies and
//! resets driven by the accounting.

#![cfg(feature = "mlx")]
// Index loops mirror the tensor layouts the references are checked against.
#![allow(clippy::needless_range_loop)]

use mlx_rs::{transforms::eval, Array, Dtype};
use weft_kv_pool::storage::*;
use weft_kv_pool::*;

const SLOTS: u32 = 6;
const LAYERS: usize = 2;

fn specs() -> Vec<StateSpec> {
    vec![
        StateSpec::new(&[3, 8], Dtype::Float32),
        StateSpec::new(&[2, 4, 4], Dtype::Float32),
    ]
}

fn per_slot(c: usize) -> usize {
    specs()[c].shape.iter().product::<i32>() as usize
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

/// Raw bytes of every committed array (bit-identity checks).
fn bits(st: &StateStorage) -> Vec<Vec<u32>> {
    let arrays: Vec<&Array> = st.arrays().collect();
    eval(arrays.iter().copied()).unwrap();
    arrays
        .iter()
        .map(|a| a.as_slice::<f32>().iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// `reference[layer][component][slot]`.
type Reference = Vec<Vec<Vec<Vec<f32>>>>;

fn check_against(st: &StateStorage, reference: &Reference, slots: &[SlotId]) {
    let batch = SlotBatch::from_slots(slots.to_vec());
    for (l, layer) in reference.iter().enumerate() {
        let got = st.gather(l, &batch).unwrap();
        for (c, comp) in layer.iter().enumerate() {
            got[c].eval().unwrap();
            let mut want_shape = vec![slots.len() as i32];
            want_shape.extend_from_slice(&specs()[c].shape);
            assert_eq!(got[c].shape(), want_shape.as_slice());
            let want: Vec<f32> = slots
                .iter()
                .flat_map(|&s| comp[s as usize].clone())
                .collect();
            assert_eq!(
                got[c].as_slice::<f32>(),
                want.as_slice(),
                "layer {l} comp {c}"
            );
        }
    }
}

/// One step over `batch`: per layer and component, `0.5 * state + noise`,
/// written in a newly opened step. Returns the reference after it.
fn run_step(
    st: &mut StateStorage,
    batch: &SlotBatch,
    reference: &Reference,
    rng: &mut Rng,
) -> Reference {
    let rows = batch.rows().to_vec();
    let mut new_ref = reference.clone();
    st.begin();
    for l in 0..LAYERS {
        let old = st.gather(l, batch).unwrap();
        let mut new = Vec::new();
        for (c, o) in old.iter().enumerate() {
            let noise: Vec<f32> = (0..rows.len() * per_slot(c)).map(|_| rng.f32()).collect();
            let noise_a = Array::from_slice(&noise, o.shape());
            let x = o
                .multiply(Array::from_f32(0.5))
                .unwrap()
                .add(&noise_a)
                .unwrap();
            for (i, &s) in rows.iter().enumerate() {
                let r = &mut new_ref[l][c][s as usize];
                for (j, v) in r.iter_mut().enumerate() {
                    *v = *v * 0.5 + noise[i * per_slot(c) + j];
                }
            }
            new.push(x);
        }
        st.write(l, batch, new).unwrap();
    }
    new_ref
}

#[test]
fn steps_commit_or_roll_back_exactly() {
    let mut rng = Rng(0x5eed);
    let mut pool = KvPool::new(KvGroups::new(16).full(64).state_slots(SLOTS)).unwrap();
    let mut st = StateStorage::new(SLOTS, LAYERS, specs()).unwrap();
    // Host reference, and "garbage" already in the slots before any reset:
    // fill the storage through a committed step so resets have work to do.
    let all: Vec<SlotId> = (0..SLOTS).collect();
    let mut reference: Reference = (0..LAYERS)
        .map(|_| {
            (0..2)
                .map(|c| {
                    (0..SLOTS)
                        .map(|_| (0..per_slot(c)).map(|_| rng.f32()).collect())
                        .collect()
                })
                .collect()
        })
        .collect();
    st.begin();
    for l in 0..LAYERS {
        let new = (0..2)
            .map(|c| {
                let flat: Vec<f32> = reference[l][c].iter().flatten().copied().collect();
                let mut shape = vec![SLOTS as i32];
                shape.extend_from_slice(&specs()[c].shape);
                Array::from_slice(&flat, &shape)
            })
            .collect();
        st.write(l, &SlotBatch::from_slots(all.clone()), new)
            .unwrap();
    }
    st.commit().unwrap();
    check_against(&st, &reference, &all);

    let mut seqs: Vec<SeqId> = Vec::new();
    let (mut commits, mut rollbacks, mut resets, mut copies) = (0, 0, 0, 0);
    for step in 0..200 {
        // Admissions / forks / releases through the accounting.
        let r = rng.below(10);
        if r < 3 && pool.slots().free() > 0 {
            seqs.push(
                pool.allocate(SeqSpec::new(OwnerId(0)).with_state_slot())
                    .unwrap(),
            );
        } else if r < 4 && !seqs.is_empty() && pool.slots().free() > 0 {
            let p = seqs[rng.below(seqs.len())];
            seqs.push(pool.fork(p).unwrap());
        } else if r < 5 && seqs.len() > 1 {
            let i = rng.below(seqs.len());
            pool.release(seqs.remove(i)).unwrap();
        }
        let ops = pool.take_ops();
        for op in &ops {
            match *op {
                StorageOp::ResetSlot(s) => {
                    resets += 1;
                    for l in 0..LAYERS {
                        for c in 0..2 {
                            reference[l][c][s as usize].fill(0.0);
                        }
                    }
                }
                StorageOp::CopySlot { src, dst } => {
                    copies += 1;
                    for l in 0..LAYERS {
                        for c in 0..2 {
                            reference[l][c][dst as usize] = reference[l][c][src as usize].clone();
                        }
                    }
                }
                StorageOp::CopyBlock { .. } => {}
            }
        }
        apply_storage_ops(&ops, &mut [], Some(&mut st)).unwrap();
        check_against(&st, &reference, &all);
        if seqs.is_empty() {
            continue;
        }

        // The batch: all rows, then a random filter / extract / merge.
        let mut batch = pool.slot_batch(&seqs).unwrap();
        match rng.below(3) {
            0 => {
                let mut keep: Vec<usize> = (0..batch.len()).filter(|_| rng.below(3) > 0).collect();
                if keep.is_empty() {
                    keep.push(0);
                }
                keep.reverse();
                batch.filter(&keep).unwrap();
            }
            1 if batch.len() > 1 => {
                let row = rng.below(batch.len());
                let slot = batch.extract(row).unwrap();
                batch.merge(SlotBatch::from_slots(vec![slot]));
            }
            _ => {}
        }

        // The step: new state = f(gathered state) + noise, written per
        // layer; every fourth step a second one follows while it is open
        // (pipelined) and reads its state.
        let before = bits(&st);
        let pipelined = step % 4 == 1;
        let new_ref = run_step(&mut st, &batch, &reference, &mut rng);
        assert_eq!(st.open_steps(), 1);
        // Written state is visible at once (a following step reads it).
        check_against(&st, &new_ref, &all);
        if pipelined {
            let mid = bits(&st);
            let newer = run_step(&mut st, &batch, &new_ref, &mut rng);
            check_against(&st, &newer, &all);
            assert_eq!(st.open_steps(), 2);
            if step % 8 == 1 {
                // Both undone, newest first.
                st.rollback().unwrap();
                assert_eq!(bits(&st), mid, "rollback of the newer step at {step}");
                st.rollback().unwrap();
                rollbacks += 2;
                assert_eq!(bits(&st), before, "rollback of both steps at {step}");
            } else {
                // The older commits, the newer rolls back.
                st.commit().unwrap();
                st.rollback().unwrap();
                commits += 1;
                rollbacks += 1;
                assert_eq!(bits(&st), mid, "rollback after a commit at {step}");
                reference = new_ref;
            }
        } else if step % 3 == 0 {
            st.rollback().unwrap();
            rollbacks += 1;
            assert_eq!(
                bits(&st),
                before,
                "rollback changed the state at step {step}"
            );
        } else {
            st.commit().unwrap();
            commits += 1;
            reference = new_ref;
        }
        assert_eq!(st.open_steps(), 0);
        check_against(&st, &reference, &all);
    }
    assert!(
        commits > 50 && rollbacks > 20 && resets > 5 && copies > 2,
        "coverage: {commits} commits, {rollbacks} rollbacks, {resets} resets, {copies} copies"
    );
}

#[test]
fn misuse_is_rejected_and_changes_nothing() {
    let mut st = StateStorage::new(4, 1, specs()).unwrap();
    let before = bits(&st);
    let batch = SlotBatch::from_slots(vec![1, 2]);
    let good = || {
        vec![
            Array::from_slice(&[1f32; 48], &[2, 3, 8]),
            Array::from_slice(&[1f32; 64], &[2, 2, 4, 4]),
        ]
    };
    // No step open.
    assert!(matches!(
        st.write(0, &batch, good()),
        Err(StorageError::NoOpenStep)
    ));
    assert!(matches!(st.commit(), Err(StorageError::NoOpenStep)));
    assert!(matches!(st.rollback(), Err(StorageError::NoOpenStep)));
    st.begin();
    // Wrong shape, wrong component count, unknown layer, slot out of range,
    // duplicate slot.
    let bad_shape = vec![
        Array::from_slice(&[1f32; 48], &[2, 8, 3]),
        Array::from_slice(&[1f32; 64], &[2, 2, 4, 4]),
    ];
    assert!(matches!(
        st.write(0, &batch, bad_shape),
        Err(StorageError::Shape { .. })
    ));
    assert!(matches!(
        st.write(0, &batch, good()[..1].to_vec()),
        Err(StorageError::Shape { .. })
    ));
    assert!(matches!(
        st.write(1, &batch, good()),
        Err(StorageError::UnknownLayer { .. })
    ));
    assert!(matches!(
        st.write(0, &SlotBatch::from_slots(vec![1, 9]), good()),
        Err(StorageError::SlotOutOfRange { slot: 9, .. })
    ));
    assert!(matches!(
        st.write(0, &SlotBatch::from_slots(vec![1, 1]), good()),
        Err(StorageError::BadRow(_))
    ));
    assert_eq!(bits(&st), before, "a refused write changed the state");
    // Two writes of one layer in one step (two forwards of a step) undo
    // together.
    st.write(0, &batch, good()).unwrap();
    st.write(0, &SlotBatch::from_slots(vec![0, 3]), good())
        .unwrap();
    assert_ne!(bits(&st), before);
    st.rollback().unwrap();
    assert_eq!(bits(&st), before);
    assert!(matches!(
        st.apply(&[
            StorageOp::ResetSlot(0),
            StorageOp::CopySlot { src: 0, dst: 7 }
        ]),
        Err(StorageError::SlotOutOfRange { slot: 7, .. })
    ));
    assert_eq!(bits(&st), before);
    assert!(matches!(
        StateStorage::new(0, 1, specs()),
        Err(StorageError::InvalidConfig(_))
    ));
}
