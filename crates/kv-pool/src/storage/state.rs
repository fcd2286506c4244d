//! SSM state rows: per layer, one or more tensors `[num_slots, ...]` indexed
//! by the accounting's [`SlotId`](crate::SlotId)s, written through with an
//! undo journal per open step.

use std::collections::{HashSet, VecDeque};

use mlx_rs::ops::indexing::TryIndexMutOp;
use mlx_rs::{ops, Array, Dtype};

use crate::storage::kv::dtype_bytes;
use crate::storage::step::to_i32;
use crate::storage::StorageError;
use crate::{SlotBatch, SlotId, StorageOp};

/// One component of a layer's recurrent state (e.g. the convolution window or
/// the SSM hidden state), per slot.
#[derive(Debug, Clone, PartialEq)]
pub struct StateSpec {
    /// Shape of one slot's state (without the leading slot axis).
    pub shape: Vec<i32>,
    /// Element type.
    pub dtype: Dtype,
}

impl StateSpec {
    /// A component of the given per-slot shape and dtype.
    pub fn new(shape: &[i32], dtype: Dtype) -> Self {
        Self {
            shape: shape.to_vec(),
            dtype,
        }
    }
}

/// One write of a step: the rows and their state before it.
#[derive(Debug)]
struct Undo {
    layer: usize,
    rows: Array,
    old: Vec<Array>,
}

/// State-slot storage of every SSM layer.
///
/// A batched step [`gather`](Self::gather)s its rows' state (`[B, ...]` per
/// component, rows in [`SlotBatch`] order, so batch merge/filter/extract are
/// index edits on the `SlotBatch`), runs the recurrence, and
/// [`write`](Self::write)s the new state. Writes go straight into the slot
/// arrays, so a step submitted while the one before it is still open (a
/// pipelined engine) reads that step's state; each write journals the rows it
/// replaced under the step [`begin`](Self::begin) opened.
/// [`commit`](Self::commit) forgets the oldest open step's journal;
/// [`rollback`](Self::rollback) writes the newest one's old rows back, newest
/// write first, which leaves the storage bit-identical to before the step.
/// This is the shape of the block pool's undo (a journal per open step), not
/// a staged copy of the state.
///
/// Slot operations ([`apply`](Self::apply)) are not journaled: they only ever
/// target slots the step's admissions acquired, which the accounting's
/// rollback frees again (a freed slot's contents are stale by contract).
#[derive(Debug)]
pub struct StateStorage {
    num_slots: u32,
    specs: Vec<StateSpec>,
    layers: Vec<Vec<Array>>,
    /// Per open step, oldest first, its writes in order.
    open: VecDeque<Vec<Undo>>,
}

impl StateStorage {
    /// Zeroed state for `layers` layers of `num_slots` slots, each with the
    /// components `specs`.
    pub fn new(num_slots: u32, layers: usize, specs: Vec<StateSpec>) -> Result<Self, StorageError> {
        if num_slots == 0 || layers == 0 || specs.is_empty() {
            return Err(StorageError::InvalidConfig(
                "state storage needs slots, layers and components",
            ));
        }
        let n = to_i32(num_slots as usize)?;
        let layers_v = (0..layers)
            .map(|_| {
                specs
                    .iter()
                    .map(|s| {
                        let mut shape = vec![n];
                        shape.extend_from_slice(&s.shape);
                        ops::zeros_dtype(&shape, s.dtype).map_err(StorageError::from)
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            num_slots,
            specs,
            layers: layers_v,
            open: VecDeque::new(),
        })
    }

    /// Slots per layer.
    pub fn num_slots(&self) -> u32 {
        self.num_slots
    }

    /// Layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Components per layer.
    pub fn specs(&self) -> &[StateSpec] {
        &self.specs
    }

    /// Bytes of one slot's state in every layer.
    pub fn bytes_per_slot(&self) -> u64 {
        let one: u64 = self
            .specs
            .iter()
            .map(|s| {
                s.shape.iter().map(|&d| d.max(0) as u64).product::<u64>() * dtype_bytes(s.dtype)
            })
            .sum();
        one * self.layers.len() as u64
    }

    /// Every state array, as it is now (open steps' writes included).
    pub fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.layers.iter().flatten()
    }

    /// The open steps' journaled rows: a step's evaluation produces them with
    /// [`arrays`](Self::arrays), so no journal keeps an unevaluated graph.
    pub fn journal_arrays(&self) -> impl Iterator<Item = &Array> {
        self.open.iter().flatten().flat_map(|u| u.old.iter())
    }

    /// Steps [`begin`](Self::begin) opened and neither committed nor rolled back.
    pub fn open_steps(&self) -> usize {
        self.open.len()
    }

    /// Opens a step: the writes until the next `begin` are its.
    pub fn begin(&mut self) {
        self.open.push_back(Vec::new());
    }

    /// The current state of `batch`'s rows in one layer (every open step's
    /// writes included): per component, `[B, ...]`.
    pub fn gather(&self, layer: usize, batch: &SlotBatch) -> Result<Vec<Array>, StorageError> {
        let arrays = self.layer(layer)?;
        let rows = self.rows_array(batch, false)?;
        Ok(arrays
            .iter()
            .map(|a| a.take_axis(&rows, 0))
            .collect::<Result<Vec<_>, _>>()?)
    }

    /// Writes one layer's new state for `batch`'s rows (per component,
    /// `[B, ...]`, rows distinct) in the newest open step, journaling the rows
    /// it replaces. Everything is checked before anything is written.
    pub fn write(
        &mut self,
        layer: usize,
        batch: &SlotBatch,
        new: Vec<Array>,
    ) -> Result<(), StorageError> {
        self.layer(layer)?;
        if self.open.is_empty() {
            return Err(StorageError::NoOpenStep);
        }
        if new.len() != self.specs.len() {
            return Err(StorageError::Shape {
                what: "state components",
                expected: vec![to_i32(self.specs.len())?],
                got: vec![to_i32(new.len())?],
            });
        }
        let b = to_i32(batch.len())?;
        for (x, spec) in new.iter().zip(&self.specs) {
            let mut want = vec![b];
            want.extend_from_slice(&spec.shape);
            if x.shape() != want.as_slice() {
                return Err(StorageError::Shape {
                    what: "new state",
                    expected: want,
                    got: x.shape().to_vec(),
                });
            }
        }
        let rows = self.rows_array(batch, true)?;
        let old = self.layers[layer]
            .iter()
            .map(|a| a.take_axis(&rows, 0))
            .collect::<Result<Vec<_>, _>>()?;
        let updated = self.layers[layer]
            .iter()
            .zip(new.iter().zip(&self.specs))
            .map(|(a, (x, spec))| {
                let x = if x.dtype() == spec.dtype {
                    x.clone()
                } else {
                    x.as_dtype(spec.dtype)?
                };
                scatter_rows(a, &rows, &x)
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Replacing the handles leaves the scatters as the arrays' only
        // users, so MLX can write in place.
        self.layers[layer] = updated;
        if let Some(step) = self.open.back_mut() {
            step.push(Undo { layer, rows, old });
        }
        Ok(())
    }

    /// Closes the oldest open step, keeping its writes.
    pub fn commit(&mut self) -> Result<(), StorageError> {
        self.open
            .pop_front()
            .map(|_| ())
            .ok_or(StorageError::NoOpenStep)
    }

    /// Closes the newest open step, writing back the rows it replaced (newest
    /// write first). The restoring scatters are built before any array is
    /// replaced, so an error leaves the step open and the storage as it was.
    pub fn rollback(&mut self) -> Result<(), StorageError> {
        let Some(step) = self.open.back() else {
            return Err(StorageError::NoOpenStep);
        };
        let mut layers: Vec<Option<Vec<Array>>> = self.layers.iter().map(|_| None).collect();
        for u in step.iter().rev() {
            let cur = layers[u.layer]
                .take()
                .unwrap_or_else(|| self.layers[u.layer].clone());
            let restored = cur
                .iter()
                .zip(&u.old)
                .map(|(a, o)| scatter_rows(a, &u.rows, o))
                .collect::<Result<Vec<_>, _>>()?;
            layers[u.layer] = Some(restored);
        }
        self.open.pop_back();
        for (l, a) in layers.into_iter().enumerate() {
            if let Some(a) = a {
                self.layers[l] = a;
            }
        }
        Ok(())
    }

    /// Applies [`StorageOp::CopySlot`] and [`StorageOp::ResetSlot`] in order;
    /// other operations are ignored. Slot ids are all checked before anything
    /// is written.
    pub fn apply(&mut self, ops: &[StorageOp]) -> Result<(), StorageError> {
        for op in ops {
            match *op {
                StorageOp::CopySlot { src, dst } => {
                    self.check_slot(src)?;
                    self.check_slot(dst)?;
                }
                StorageOp::ResetSlot(s) => self.check_slot(s)?,
                StorageOp::CopyBlock { .. } => {}
            }
        }
        for op in ops {
            match *op {
                StorageOp::CopySlot { src, dst } => {
                    let src = Array::from_slice(&[src as i32], &[1]);
                    let dst = Array::from_slice(&[dst as i32], &[1]);
                    for a in self.layers.iter_mut().flatten() {
                        let row = a.take_axis(&src, 0)?;
                        // Materialize the source row so the scatter below is
                        // the pool array's only user (in-place update).
                        row.eval()?;
                        a.try_index_mut((&dst, ..), &row)?;
                    }
                }
                StorageOp::ResetSlot(s) => {
                    let idx = Array::from_slice(&[s as i32], &[1]);
                    for a in self.layers.iter_mut().flatten() {
                        let mut shape = a.shape().to_vec();
                        shape[0] = 1;
                        let zeros = ops::zeros_dtype(&shape, a.dtype())?;
                        a.try_index_mut((&idx, ..), &zeros)?;
                    }
                }
                StorageOp::CopyBlock { .. } => {}
            }
        }
        Ok(())
    }

    fn layer(&self, layer: usize) -> Result<&[Array], StorageError> {
        self.layers
            .get(layer)
            .map(Vec::as_slice)
            .ok_or(StorageError::UnknownLayer {
                layer,
                layers: self.layers.len(),
            })
    }

    fn check_slot(&self, s: SlotId) -> Result<(), StorageError> {
        if s < self.num_slots {
            Ok(())
        } else {
            Err(StorageError::SlotOutOfRange {
                slot: s,
                num_slots: self.num_slots,
            })
        }
    }

    fn rows_array(&self, batch: &SlotBatch, distinct: bool) -> Result<Array, StorageError> {
        if batch.is_empty() {
            return Err(StorageError::BadRow("an empty slot batch"));
        }
        let mut seen = HashSet::new();
        let mut rows = Vec::with_capacity(batch.len());
        for &s in batch.rows() {
            self.check_slot(s)?;
            if distinct && !seen.insert(s) {
                return Err(StorageError::BadRow("a slot twice in one batch"));
            }
            rows.push(to_i32(s as usize)?);
        }
        Ok(Array::from_slice(&rows, &[to_i32(rows.len())?]))
    }
}

fn scatter_rows(a: &Array, rows: &Array, x: &Array) -> Result<Array, StorageError> {
    let mut out = a.clone();
    out.try_index_mut((rows, ..), x)?;
    Ok(out)
}
