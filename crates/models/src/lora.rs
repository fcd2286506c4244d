//! The adapters resident on the device and their batched low-rank apply.
//!
//! An [`AdapterPool`] holds every resident adapter stacked per layer and
//! projection group (the groups are Weft's fused projections: q/k/v, o,
//! gate/up, down): per adapted part `b` `[slots, rank, out]` with the
//! adapter's scale folded in, and the parts' `A`s, each zero-padded to the
//! pool's rank, in one of two layouts ([`StackLayout`]):
//!
//! - **dense** `[in, parts * slots * rank]` (part, slot, rank order): the
//!   shrink is one plain matmul of every row by every slot's `A`,
//!   `z = x @ A`; row `i` then keeps its own slot's block of `z`. On the GPU
//!   one kernel does that and the expand, `y + z[slot] @ B[slot]`, per
//!   fused projection (`crate::decode_kernels`), so an adapted projection
//!   costs two primitives; elsewhere `z` is masked to the row's slot and
//!   multiplied by `B` viewed as `[slots * rank, out]`. The shrink's work
//!   grows with the slots, so this is the layout of small pools on a GPU.
//! - **gathered** `[slots, in, parts * rank]`: each delta is two gathered
//!   matmuls (`gather_mm`: row `i` multiplies by slot `slots[i]`'s matrices
//!   without copying them per row), `((x @ A[slot]) split per part) @
//!   B_part[slot]`, whose work does not grow with the slots.
//!
//! Slot 0 is no adapter and stays zero, as does every free slot, so a row
//! without an adapter adds an exact zero. A forward gets a [`LoraStep`]: the
//! per-row slot index as a `[B]` uint32 array and the stacks; the deltas are
//! added to the base projection's output (dense, quantized or packed
//! alike). The pool's shapes are fixed when it is made (slots, rank,
//! targets, layout), so loading or unloading an adapter changes values
//! only: a compiled decode step takes the stacks and the slot indices as
//! inputs and never retraces for it.

use std::collections::BTreeSet;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{ops, Array, Dtype};

use crate::adapter::{Adapter, Target};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// Names an adapter resident in a pool (the caller's id, e.g. a tenant's
/// adapter registry key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AdapterId(pub u64);

/// A projection group of a layer: the projections one (fused) matmul computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Group {
    Qkv = 0,
    O = 1,
    GateUp = 2,
    Down = 3,
}

const GROUPS: [(Group, &[Target]); 4] = [
    (Group::Qkv, &[Target::Q, Target::K, Target::V]),
    (Group::O, &[Target::O]),
    (Group::GateUp, &[Target::Gate, Target::Up]),
    (Group::Down, &[Target::Down]),
];

/// How a pool lays out its `A` stacks (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StackLayout {
    /// Dense on a GPU while `(slots + 1) * max_rank` is at most
    /// [`DENSE_MAX_COLUMNS`], gathered above and on the CPU (where the
    /// dense expand's work over every slot costs more than the gathered
    /// matmuls save: 100-130 vs 127-163 tok/s measured, 16 rows over 8
    /// adapters on the 135M model); `WEFT_LORA_LAYOUT=dense` or `gathered`
    /// overrides it.
    #[default]
    Auto,
    Dense,
    Gathered,
}

/// The widest per-part shrink (`(slots + 1) * rank` columns) an automatic
/// pool computes densely: at 1024 the dense shrink of a 2048-wide model
/// is half the size of its output projection, still small next to the
/// whole layer.
pub const DENSE_MAX_COLUMNS: usize = 1024;

impl StackLayout {
    /// Whether a pool of this layout and size stacks its `A`s densely.
    fn dense(self, slots: usize, max_rank: usize) -> bool {
        let auto = || {
            crate::loader::Device::detect() == crate::loader::Device::Gpu
                && (slots + 1) * max_rank <= DENSE_MAX_COLUMNS
        };
        match self {
            StackLayout::Dense => true,
            StackLayout::Gathered => false,
            StackLayout::Auto => match std::env::var("WEFT_LORA_LAYOUT").as_deref() {
                Ok("dense") => true,
                Ok("gathered") => false,
                _ => auto(),
            },
        }
    }
}

/// How big a pool is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterPoolConfig {
    /// Adapters resident at once (slot 0, no adapter, comes on top).
    pub slots: usize,
    /// Largest rank a resident adapter may have (at most
    /// [`crate::adapter::MAX_RANK`]); smaller ranks are zero-padded.
    pub max_rank: usize,
    /// Projections adapters may adapt.
    pub targets: BTreeSet<Target>,
    /// How the `A` stacks are laid out.
    pub layout: StackLayout,
}

impl AdapterPoolConfig {
    /// `slots` adapters of rank up to `max_rank` over every projection.
    pub fn new(slots: usize, max_rank: usize) -> Self {
        Self {
            slots,
            max_rank,
            targets: Target::ALL.into_iter().collect(),
            layout: StackLayout::Auto,
        }
    }
}

/// One projection group's stacks in one layer.
#[derive(Debug, Clone)]
pub(crate) struct GroupStack {
    /// Dense `[in, parts.len() * slots * rank]` or gathered `[slots, in,
    /// parts.len() * rank]` (told apart by rank: 2 or 3 dimensions).
    a: Array,
    /// `[slots, rank, out]` of each adapted part, in `parts` order.
    b: Vec<Array>,
    /// Indices (into the group's targets) of the parts the pool adapts.
    parts: Vec<usize>,
}

impl GroupStack {
    fn dense(&self) -> bool {
        self.a.ndim() == 2
    }

    /// Slots, no-adapter slot 0 included.
    fn slots(&self) -> i32 {
        self.b[0].dim(0)
    }

    fn rank(&self) -> i32 {
        self.b[0].dim(1)
    }

    fn input(&self) -> i32 {
        if self.dense() {
            self.a.dim(0)
        } else {
            self.a.dim(1)
        }
    }

    /// `a` with slot `slot`'s `A`s set to `parts_a` `[in, parts * rank]`
    /// (each part's block in order).
    fn with_a(&self, slot: usize, parts_a: &Array) -> Result<Array> {
        if !self.dense() {
            return put_slot(&self.a, 0, slot, parts_a);
        }
        let (input, p, s, r) = (
            self.input(),
            self.parts.len() as i32,
            self.slots(),
            self.rank(),
        );
        let a = self.a.reshape(&[input, p, s, r])?;
        let v = parts_a.reshape(&[input, p, r])?;
        Ok(put_slot(&a, 2, slot, &v)?.reshape(&[input, p * s * r])?)
    }
}

/// The arrays of a pool, per layer and group (None: the group is not adapted).
pub(crate) type Stacks = Vec<[Option<GroupStack>; 4]>;

/// The adapters resident on the device.
pub struct AdapterPool {
    config: AdapterPoolConfig,
    dtype: Dtype,
    /// `(in, out)` per target in the base model.
    dims: Vec<(Target, (i32, i32))>,
    stacks: Stacks,
    /// Who holds each slot (index 0 is never held).
    resident: Vec<Option<AdapterId>>,
    /// Per slot, the [`make_resident`](Self::make_resident) call that last
    /// named its adapter (the eviction order: least recently used first).
    last_used: Vec<u64>,
    /// Calls of [`make_resident`](Self::make_resident) so far.
    tick: u64,
    counters: AdapterCounters,
}

/// What a pool has done since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdapterCounters {
    /// Adapters made resident (copied into a slot).
    pub loads: u64,
    /// Resident adapters whose slot another adapter took.
    pub evictions: u64,
}

impl AdapterPool {
    /// An empty pool for `model`'s layers, arrays in `dtype`.
    pub fn new(model: &ModelConfig, dtype: Dtype, config: AdapterPoolConfig) -> Result<Self> {
        if config.slots == 0 {
            return Err(ModelError::Invalid("an adapter pool needs a slot".into()));
        }
        if config.max_rank == 0 || config.max_rank > crate::adapter::MAX_RANK {
            return Err(ModelError::Invalid(format!(
                "adapter pool rank {}: 1..={} are served",
                config.max_rank,
                crate::adapter::MAX_RANK
            )));
        }
        if config.targets.is_empty() {
            return Err(ModelError::Invalid(
                "an adapter pool needs a target projection".into(),
            ));
        }
        let dims: Vec<(Target, (i32, i32))> =
            Target::ALL.iter().map(|&t| (t, t.dims(model))).collect();
        let dim = |t: Target| t.dims(model);
        let s = (config.slots + 1) as i32;
        let r = config.max_rank as i32;
        let dense = config.layout.dense(config.slots, config.max_rank);
        let mut stacks: Stacks = Vec::with_capacity(model.num_layers.max(0) as usize);
        for _ in 0..model.num_layers.max(0) {
            let mut layer: [Option<GroupStack>; 4] = Default::default();
            for (g, targets) in GROUPS {
                let parts: Vec<usize> = (0..targets.len())
                    .filter(|&j| config.targets.contains(&targets[j]))
                    .collect();
                if parts.is_empty() {
                    continue;
                }
                let input = dim(targets[0]).0;
                let p = parts.len() as i32;
                let shape = if dense {
                    vec![input, p * s * r]
                } else {
                    vec![s, input, p * r]
                };
                let a = Array::zeros::<f32>(&shape)?.as_dtype(dtype)?;
                let b = parts
                    .iter()
                    .map(|&j| Ok(Array::zeros::<f32>(&[s, r, dim(targets[j]).1])?.as_dtype(dtype)?))
                    .collect::<Result<Vec<_>>>()?;
                layer[g as usize] = Some(GroupStack { a, b, parts });
            }
            stacks.push(layer);
        }
        let pool = Self {
            resident: vec![None; config.slots + 1],
            last_used: vec![0; config.slots + 1],
            tick: 0,
            counters: AdapterCounters::default(),
            config,
            dtype,
            dims,
            stacks,
        };
        pool.eval()?;
        Ok(pool)
    }

    fn eval(&self) -> Result<()> {
        let all: Vec<&Array> = self
            .stacks
            .iter()
            .flat_map(|l| l.iter().flatten())
            .flat_map(|g| std::iter::once(&g.a).chain(g.b.iter()))
            .collect();
        mlx_rs::transforms::eval(all)?;
        Ok(())
    }

    pub fn config(&self) -> &AdapterPoolConfig {
        &self.config
    }

    /// Device bytes of the pool's stacks (every slot, resident or not).
    pub fn bytes(&self) -> u64 {
        self.stacks
            .iter()
            .flat_map(|l| l.iter().flatten())
            .flat_map(|g| std::iter::once(&g.a).chain(g.b.iter()))
            .map(|a| a.nbytes() as u64)
            .sum()
    }

    /// Elements per token of one layer that a forward's adapter deltas may
    /// hold at once, the bound a step's memory plan adds to its
    /// activations: per adapted group three of its shrink's width (every
    /// slot's shrink, dense, or the row's own, gathered; its masked copy and
    /// its split parts) and three of the group's output width (each part's
    /// delta, their concatenation, the sum).
    pub fn step_elements_per_token(&self) -> u64 {
        let Some(layer) = self
            .stacks
            .iter()
            .max_by_key(|l| l.iter().flatten().count())
        else {
            return 0;
        };
        layer
            .iter()
            .flatten()
            .map(|g| {
                let z = if g.dense() { g.a.dim(1) } else { g.a.dim(2) };
                let out: i32 = g.b.iter().map(|b| b.dim(2)).sum();
                3 * z.max(0) as u64 + 3 * out.max(0) as u64
            })
            .sum()
    }

    /// The slot `id` is resident in.
    pub fn slot_of(&self, id: AdapterId) -> Option<u32> {
        self.resident
            .iter()
            .position(|r| *r == Some(id))
            .map(|s| s as u32)
    }

    /// The adapters resident, by slot.
    pub fn resident(&self) -> impl Iterator<Item = (u32, AdapterId)> + '_ {
        self.resident
            .iter()
            .enumerate()
            .filter_map(|(s, r)| r.map(|id| (s as u32, id)))
    }

    /// What the pool has loaded and evicted so far.
    pub fn counters(&self) -> AdapterCounters {
        self.counters
    }

    /// Whether `adapter` fits the pool (rank, targets, layers); the error
    /// says why not, naming it `name`.
    pub fn check(&self, name: &str, adapter: &Adapter) -> Result<()> {
        if adapter.rank > self.config.max_rank {
            return Err(ModelError::Invalid(format!(
                "adapter {name} ({}) has rank {}, the pool at most {}",
                adapter.path.display(),
                adapter.rank,
                self.config.max_rank
            )));
        }
        if let Some(t) = adapter
            .targets()
            .into_iter()
            .find(|t| !self.config.targets.contains(t))
        {
            return Err(ModelError::Invalid(format!(
                "adapter {name} ({}) adapts {}, which the pool does not",
                adapter.path.display(),
                t.module()
            )));
        }
        if adapter.layers.len() != self.stacks.len() {
            return Err(ModelError::Invalid(format!(
                "adapter {name} is for {} layers, the model has {}",
                adapter.layers.len(),
                self.stacks.len()
            )));
        }
        Ok(())
    }

    /// Makes every adapter in `ids` resident: each that is not gets a free
    /// slot or, when none is free, the slot of the least recently used
    /// resident adapter `ids` does not name (evicted), filled from
    /// `load(id)`. Refused (nothing evicted) when `ids` names more adapters
    /// than the pool has slots. The stacks are new arrays, never written in
    /// place, so a step already built keeps the adapters it was built with.
    pub fn make_resident(
        &mut self,
        ids: &BTreeSet<AdapterId>,
        load: &mut dyn FnMut(AdapterId) -> Result<Adapter>,
    ) -> Result<()> {
        if ids.len() > self.config.slots {
            return Err(ModelError::Invalid(format!(
                "a step with {} adapters, the pool holds {} at once",
                ids.len(),
                self.config.slots
            )));
        }
        self.tick += 1;
        for &id in ids {
            if self.slot_of(id).is_none() {
                // Read before anything is evicted: an adapter that cannot be
                // loaded leaves the pool as it was.
                let adapter = load(id)?;
                let full = self.resident.iter().skip(1).all(Option::is_some);
                let victim = if full {
                    (1..self.resident.len())
                        .filter(|&s| self.resident[s].is_some_and(|r| !ids.contains(&r)))
                        .min_by_key(|&s| self.last_used[s])
                } else {
                    None
                };
                match victim {
                    // The victim's slot is overwritten in one pass.
                    Some(slot) => {
                        self.check(&id.0.to_string(), &adapter)?;
                        self.write(slot, id, &adapter, true)?;
                        self.counters.evictions += 1;
                    }
                    None => {
                        self.insert(id, &adapter)?;
                    }
                }
            }
            if let Some(s) = self.slot_of(id) {
                self.last_used[s as usize] = self.tick;
            }
        }
        Ok(())
    }

    /// Makes `adapter` resident as `id`; returns its slot. Refused (nothing
    /// changed) when `id` is resident already, the pool is full, or the
    /// adapter does not fit the pool (rank, targets, layers).
    pub fn insert(&mut self, id: AdapterId, adapter: &Adapter) -> Result<u32> {
        if self.slot_of(id).is_some() {
            return Err(ModelError::Invalid(format!(
                "adapter {} is resident already",
                id.0
            )));
        }
        self.check(&id.0.to_string(), adapter)?;
        let slot = (1..self.resident.len())
            .find(|&s| self.resident[s].is_none())
            .ok_or_else(|| {
                ModelError::Invalid(format!(
                    "adapter pool full ({} resident)",
                    self.config.slots
                ))
            })?;
        self.write(slot, id, adapter, false)?;
        Ok(slot as u32)
    }

    /// Writes `adapter` into slot `slot` as `id` (checked against the pool
    /// already). `held`: the slot holds another adapter, whose groups this
    /// one does not adapt are zeroed too; a free slot's are zero already.
    /// All or nothing: the stacks change only when they evaluate.
    fn write(&mut self, slot: usize, id: AdapterId, adapter: &Adapter, held: bool) -> Result<()> {
        let r = self.config.max_rank as i32;
        let dt = self.dtype;
        let mut next = self.stacks.clone();
        for (layer, groups) in next.iter_mut().enumerate() {
            let pairs = &adapter.layers[layer];
            for (g, targets) in GROUPS {
                let Some(st) = groups[g as usize].as_mut() else {
                    continue;
                };
                if !held && !st.parts.iter().any(|&j| pairs.contains_key(&targets[j])) {
                    continue;
                }
                let mut a_blocks = Vec::with_capacity(st.parts.len());
                for (k, &j) in st.parts.iter().enumerate() {
                    let t = targets[j];
                    let (input, out) = self.dim(t);
                    let (a, b) = match pairs.get(&t) {
                        Some(p) => {
                            let a = pad(&p.a.as_dtype(Dtype::Float32)?, 1, r)?;
                            let scale = Array::from_f32(adapter.scale);
                            let b = ops::multiply(&p.b.as_dtype(Dtype::Float32)?, &scale)?;
                            (a.as_dtype(dt)?, pad(&b, 0, r)?.as_dtype(dt)?)
                        }
                        None => (
                            Array::zeros::<f32>(&[input, r])?.as_dtype(dt)?,
                            Array::zeros::<f32>(&[r, out])?.as_dtype(dt)?,
                        ),
                    };
                    a_blocks.push(a);
                    st.b[k] = put_slot(&st.b[k], 0, slot, &b)?;
                }
                st.a = st.with_a(slot, &ops::concatenate(&a_blocks, 1)?)?;
            }
        }
        let old = std::mem::replace(&mut self.stacks, next);
        if let Err(e) = self.eval() {
            self.stacks = old;
            return Err(e);
        }
        self.resident[slot] = Some(id);
        self.last_used[slot] = self.tick;
        self.counters.loads += 1;
        Ok(())
    }

    /// Makes `id`'s slot free (zero) again. Returns whether it was resident.
    pub fn remove(&mut self, id: AdapterId) -> Result<bool> {
        let Some(slot) = self.slot_of(id) else {
            return Ok(false);
        };
        let slot = slot as usize;
        let mut next = self.stacks.clone();
        for st in next.iter_mut().flat_map(|l| l.iter_mut().flatten()) {
            let (input, width) = (st.input(), st.parts.len() as i32 * st.rank());
            let zero = Array::zeros::<f32>(&[input, width])?.as_dtype(st.a.dtype())?;
            st.a = st.with_a(slot, &zero)?;
            for b in &mut st.b {
                let z = Array::zeros::<f32>(&b.shape()[1..])?.as_dtype(b.dtype())?;
                *b = put_slot(b, 0, slot, &z)?;
            }
        }
        let old = std::mem::replace(&mut self.stacks, next);
        if let Err(e) = self.eval() {
            self.stacks = old;
            return Err(e);
        }
        self.resident[slot] = None;
        Ok(true)
    }

    fn dim(&self, t: Target) -> (i32, i32) {
        self.dims
            .iter()
            .find(|(x, _)| *x == t)
            .map(|(_, d)| *d)
            .unwrap_or((0, 0))
    }

    /// The step view for rows with these adapters (None: no adapter), or
    /// None when no row has one (the forward skips the low-rank work).
    /// Unknown ids are refused.
    pub fn step(&self, rows: &[Option<AdapterId>]) -> Result<Option<LoraStep>> {
        if rows.iter().all(Option::is_none) {
            return Ok(None);
        }
        let mut slots = Vec::with_capacity(rows.len());
        for r in rows {
            slots.push(match r {
                None => 0,
                Some(id) => self.slot_of(*id).ok_or_else(|| {
                    ModelError::Invalid(format!("adapter {} is not resident", id.0))
                })?,
            });
        }
        Ok(Some(LoraStep::new(
            Array::from_slice(&slots, &[slots.len() as i32]),
            self.stacks.clone(),
        )?))
    }

    /// The shape of the pool's arrays (how a compiled step's inputs map
    /// back to a [`LoraStep`]).
    pub fn layout(&self) -> Layout {
        Layout(
            self.stacks
                .iter()
                .map(|l| {
                    let mut out: [Option<Vec<usize>>; 4] = Default::default();
                    for (i, g) in l.iter().enumerate() {
                        out[i] = g.as_ref().map(|g| g.parts.clone());
                    }
                    out
                })
                .collect(),
        )
    }
}

/// On the GPU's fused decode layer the kernels that make the QKV, gate/up
/// and down projections' inputs (add-norm, SwiGLU) also compute their LoRA
/// shrinks (`crate::decode_kernels::ShrinkIn`): 65 fewer matmuls per step
/// of a 22-layer model (the first layer's QKV and every output projection
/// keep theirs). The default; `WEFT_LORA_SHRINK=matmul` makes each shrink a
/// matmul instead. On an H100 at 64 rows over 8 adapters the fused shrinks
/// ran 2-20% faster than the matmuls in every pairing (benches/RESULTS.md);
/// their parity with mlx-lm passes on the GPU.
pub(crate) fn fused_shrink() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("WEFT_LORA_SHRINK").map_or(true, |v| v != "matmul"))
}

/// With [`fused_shrink`], the add-norm kernel after each output projection
/// computes that projection's shrink itself
/// (`crate::decode_kernels::add_norm_prologue_source`), so the 22
/// output-projection shrink matmuls of a 22-layer step go too and one
/// shrink matmul (the first layer's QKV) is left. The default;
/// `WEFT_LORA_O_SHRINK=matmul` keeps a matmul per output projection. Its
/// parity with mlx-lm passed on an H200; over three paired rounds each (64
/// rows, 8 adapters against none) it ran 0.824x on an H200 and 0.820x on an
/// H100, with the output projections' matmuls 0.795x on that H200 (benches/RESULTS.md).
pub(crate) fn o_prologue() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("WEFT_LORA_O_SHRINK").map_or(true, |v| v != "matmul"))
}

/// Which groups and parts a pool's stacks have, per layer: how a compiled
/// step's flat inputs map back to a [`LoraStep`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout(Vec<[Option<Vec<usize>>; 4]>);

impl Layout {
    /// Inputs per step after the slot indices.
    pub(crate) fn len(&self) -> usize {
        self.0
            .iter()
            .flat_map(|l| l.iter().flatten())
            .map(|p| 1 + p.len())
            .sum()
    }

    /// The step view over `slots` and the stacks `arrays` (in
    /// [`LoraStep::arrays`] order).
    pub(crate) fn step(&self, slots: Array, arrays: &[Array]) -> Result<LoraStep> {
        if arrays.len() != self.len() {
            return Err(ModelError::Invalid(format!(
                "{} adapter arrays for a layout of {}",
                arrays.len(),
                self.len()
            )));
        }
        let mut it = arrays.iter().cloned();
        let mut next = || {
            it.next()
                .ok_or_else(|| ModelError::Invalid("adapter arrays".into()))
        };
        let mut stacks: Stacks = Vec::with_capacity(self.0.len());
        for l in &self.0 {
            let mut layer: [Option<GroupStack>; 4] = Default::default();
            for (i, parts) in l.iter().enumerate() {
                if let Some(parts) = parts {
                    let a = next()?;
                    let b = parts.iter().map(|_| next()).collect::<Result<Vec<_>>>()?;
                    layer[i] = Some(GroupStack {
                        a,
                        b,
                        parts: parts.clone(),
                    });
                }
            }
            stacks.push(layer);
        }
        LoraStep::new(slots, stacks)
    }
}

/// What one forward needs to add its rows' adapters: the slot of every row
/// and the pool's stacks.
#[derive(Debug, Clone)]
pub struct LoraStep {
    /// `[B]` uint32: each row's slot (0: no adapter).
    slots: Array,
    /// `[B]` uint32 `0..B`: each row's own input (gather_mm's lhs indices).
    rows: Array,
    /// Dense stacks: `[B, 1, 1, slots * rank]`, 1 where a column of a
    /// part's shrink belongs to the row's slot (in the stacks' dtype).
    mask: Option<Array>,
    stacks: Stacks,
}

/// One dense group's stacks, for the GPU's fused shrink-and-expand.
pub(crate) struct DenseGroup<'a> {
    /// `[in, parts * slots * rank]`.
    pub a: &'a Array,
    /// `[slots, rank, out]` per adapted part.
    pub b: &'a [Array],
    /// Indices of the adapted parts among the group's projections.
    pub parts: &'a [usize],
}

impl LoraStep {
    fn new(slots: Array, stacks: Stacks) -> Result<Self> {
        let b = slots.dim(0);
        let slots = if slots.dtype() == Dtype::Uint32 {
            slots
        } else {
            slots.as_dtype(Dtype::Uint32)?
        };
        let rows = ops::arange::<_, u32>(0, b as u32, 1)?;
        let dense = stacks
            .iter()
            .flat_map(|l| l.iter().flatten())
            .find(|g| g.dense());
        let mask = match dense {
            Some(g) => {
                let (s, r) = (g.slots(), g.rank());
                let ids = ops::arange::<_, u32>(0, s as u32, 1)?.reshape(&[1, s, 1])?;
                let hit = ops::eq(&slots.reshape(&[b, 1, 1])?, &ids)?;
                let m = ops::broadcast_to(&hit, &[b, s, r])?.as_dtype(g.a.dtype())?;
                Some(m.reshape(&[b, 1, 1, s * r])?)
            }
            None => None,
        };
        Ok(Self {
            slots,
            rows,
            mask,
            stacks,
        })
    }

    /// Layer `layer`'s group `g` when the pool stacks it densely.
    pub(crate) fn dense(&self, layer: usize, g: Group) -> Option<DenseGroup<'_>> {
        let st = self.stacks.get(layer)?[g as usize].as_ref()?;
        st.dense().then_some(DenseGroup {
            a: &st.a,
            b: &st.b,
            parts: &st.parts,
        })
    }

    /// Rows this step covers.
    pub fn rows(&self) -> usize {
        self.slots.dim(0) as usize
    }

    /// `[B]` slot indices.
    pub fn slots(&self) -> &Array {
        &self.slots
    }

    /// The stacks, flat: per layer, per group present, `a` then each part's `b`.
    pub(crate) fn arrays(&self) -> Vec<Array> {
        let mut out = Vec::new();
        for g in self.stacks.iter().flat_map(|l| l.iter().flatten()) {
            out.push(g.a.clone());
            out.extend(g.b.iter().cloned());
        }
        out
    }

    /// The low-rank deltas of layer `layer`'s group `g` for its input `x`
    /// `[B * T, in]` (rows of T tokens, in slot order): one `[B * T, out]`
    /// per part of the group (None where the pool does not adapt it), or
    /// None when the group is not adapted at all.
    pub(crate) fn deltas(
        &self,
        layer: usize,
        g: Group,
        x: &Array,
    ) -> Result<Option<Vec<Option<Array>>>> {
        let Some(st) = self.stacks.get(layer).and_then(|l| l[g as usize].as_ref()) else {
            return Ok(None);
        };
        let b = self.slots.dim(0);
        let n = x.dim(0);
        if x.ndim() != 2 || b == 0 || n % b != 0 {
            return Err(ModelError::Invalid(format!(
                "adapter delta: input {:?} for {b} rows",
                x.shape()
            )));
        }
        let t = n / b;
        let x3 = x.reshape(&[b, t, x.dim(1)])?;
        let cast = |w: &Array| -> Result<Array> {
            Ok(if w.dtype() == x.dtype() {
                w.clone()
            } else {
                w.as_dtype(x.dtype())?
            })
        };
        let group_parts = GROUPS[g as usize].1.len();
        let mut out: Vec<Option<Array>> = vec![None; group_parts];
        if let (true, Some(mask)) = (st.dense(), &self.mask) {
            // Every slot's shrink, masked to the row's own, times `B` of
            // every slot: the other slots' blocks add zeros.
            let (p, sr) = (st.parts.len() as i32, st.slots() * st.rank());
            let z = ops::matmul(x, &cast(&st.a)?)?.reshape(&[b, t, p, sr])?;
            let z = ops::multiply(&z, &cast(mask)?)?;
            for (k, (bm, &j)) in st.b.iter().zip(&st.parts).enumerate() {
                let zk = z.index((.., .., k as i32, ..)).reshape(&[n, sr])?;
                let bk = cast(bm)?.reshape(&[sr, -1])?;
                out[j] = Some(ops::matmul(&zk, &bk)?);
            }
            return Ok(Some(out));
        }
        let z = ops::gather_mm(&x3, &cast(&st.a)?, &self.rows, &self.slots, false)?;
        let r = z.dim(-1) / st.parts.len().max(1) as i32;
        let zs = if st.parts.len() > 1 {
            let at: Vec<i32> = (1..st.parts.len() as i32).map(|k| k * r).collect();
            z.split_at_indices(&at, -1)?
        } else {
            vec![z]
        };
        for ((z, bm), &j) in zs.iter().zip(&st.b).zip(&st.parts) {
            let d = ops::gather_mm(z, &cast(bm)?, &self.rows, &self.slots, false)?;
            out[j] = Some(d.reshape(&[n, -1])?);
        }
        Ok(Some(out))
    }

    /// As [`deltas`](Self::deltas), concatenated over the group's parts
    /// (zeros where a part is not adapted): what a fused projection's
    /// output `[B * T, sum(out)]` takes whole.
    pub(crate) fn fused_delta(
        &self,
        layer: usize,
        g: Group,
        x: &Array,
        outs: &[i32],
    ) -> Result<Option<Array>> {
        let Some(parts) = self.deltas(layer, g, x)? else {
            return Ok(None);
        };
        let n = x.dim(0);
        let mut cat = Vec::with_capacity(parts.len());
        for (p, &o) in parts.into_iter().zip(outs) {
            cat.push(match p {
                Some(d) => d,
                None => Array::zeros::<f32>(&[n, o])?.as_dtype(x.dtype())?,
            });
        }
        Ok(Some(if cat.len() == 1 {
            cat.remove(0)
        } else {
            ops::concatenate(&cat, 1)?
        }))
    }
}

/// `x` zero-padded along `axis` (0 or 1 of a matrix) to `to`.
fn pad(x: &Array, axis: i32, to: i32) -> Result<Array> {
    let have = x.dim(axis);
    if have == to {
        return Ok(x.clone());
    }
    let mut shape = x.shape().to_vec();
    shape[axis as usize] = to - have;
    let z = Array::zeros::<f32>(&shape)?.as_dtype(x.dtype())?;
    Ok(ops::concatenate(&[x.clone(), z], axis)?)
}

/// `stack` with index `slot` of axis `axis` replaced by `value` (the
/// stack's shape without that axis).
fn put_slot(stack: &Array, axis: i32, slot: usize, value: &Array) -> Result<Array> {
    let parts = stack.split_at_indices(&[slot as i32, slot as i32 + 1], axis)?;
    let v = ops::expand_dims(value, axis)?;
    Ok(ops::concatenate(
        &[parts[0].clone(), v, parts[2].clone()],
        axis,
    )?)
}
