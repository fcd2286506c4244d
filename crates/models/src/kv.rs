//! The KV cache protocol a model's attention layers go through, over kv-pool's
//! paged storage.
//!
//! [`PagedKv`] owns the storage: one `weft_kv_pool::storage::KvStorage` per
//! layer group (full-attention layers are one group; a model with
//! sliding-window layers, Gemma 3, has a second group whose tables drop the
//! blocks behind the window),
//! sized from a memory budget, and the [`KvGroups`] the scheduler's pool must
//! mirror so that every block it accounts for exists. The scheduler hands each
//! row's block tables down with the step; [`PagedKv::step`] turns one forward's
//! rows into a [`KvStep`], the one object a layer talks to:
//! [`KvStep::attend`] writes the layer's new K/V into the rows' slots and
//! returns attention over each row's context, and [`KvStep::offsets`] gives
//! the per-row RoPE positions. How attention reads the pool is the step's
//! business, chosen once per forward:
//!
//! * decode rows on a CUDA GPU: Weft's paged decode kernel reads K/V in place
//!   through the block table ([`crate::paged_attention`]);
//! * every row on the CPU with an f32 pool (decode, and prefill with the
//!   CPU-tuned kernels): the same in Rust over the evaluated pool
//!   ([`crate::host_attention`]); MLX's CPU ops took 5-10x its time to score
//!   a prefill chunk (`chunk_attention_timing`);
//! * a prefill group whose rows all start at 0, elsewhere: causal attention
//!   over the forward's own K/V (nothing older exists), while the pool is
//!   written for later steps;
//! * anything else (chunks continuing a row on a GPU, quantized pools on the
//!   CPU, sliding layers past a fresh start): the rows' blocks gathered into a
//!   padded layout with a mask.
//!
//! A new layer kind (sliding window, SSM rows) is a new group and a new arm
//! here; `BatchRunner` never sees it.

use std::cell::RefCell;

use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};
use weft_kv_pool::storage::{
    AffineQuant, KvStorage, KvStorageConfig, RowStep as RowWrite, StateSpec, StateStorage,
    StepLayout,
};
use weft_kv_pool::{AttentionKind, GroupSpec, KvGroups, RowBlocks, SlotBatch, StorageOp};

use crate::composed_attention::{self, PrefillAttention, Visible};
use crate::cpu_kernels::{self, Kernels};
use crate::error::{ModelError, Result};
use crate::gated_delta::DeltaShape;
use crate::mamba2::Mamba2Shape;
use crate::paged_attention::{PagedAttention, Pools};

/// How much memory the KV pool takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvMemory {
    /// Exactly this many bytes (rounded down to whole blocks).
    Bytes(u64),
    /// This fraction of the device memory still free after the weights are
    /// loaded (MLX's memory limit minus what it has allocated).
    FreeFraction(f64),
    /// Exactly this many blocks.
    Blocks(u32),
}

/// How the server will use the KV pool, so that a sliding-window group gets only
/// what it can hold at once (see [`KvSplit::plan`]): the most rows a step
/// holds and the most tokens a step feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvUse {
    pub max_rows: usize,
    pub max_step_tokens: usize,
}

impl KvUse {
    /// Sliding-window blocks the pool can ever hold at once for `window`-token
    /// windows in `block_size`-token blocks: every row its window (whose first
    /// block is partly behind it and last partly filled: `ceil(window / bs) + 1`)
    /// plus the block a step's tokens may start (one more per row), and a
    /// step's tokens beyond that (`ceil(max_step_tokens / bs)`). Rows keep no
    /// block behind their window once they append (the pool drops them), so
    /// blocks past this number would never be used.
    pub fn sliding_blocks(&self, window: u32, block_size: u32) -> u64 {
        let bs = u64::from(block_size.max(1));
        let rows = self.max_rows.max(1) as u64;
        rows.saturating_mul(u64::from(window).div_ceil(bs) + 2)
            .saturating_add((self.max_step_tokens as u64).div_ceil(bs))
    }
}

/// Blocks per KV group: how a memory budget is split between full-attention
/// layers and sliding-window ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSplit {
    /// Blocks of the full-attention group (every group when no layer slides).
    pub full: u64,
    /// Blocks of the sliding-window group (0 when no layer slides).
    pub sliding: u64,
}

impl KvSplit {
    /// Splits a budget for `shape` (full and sliding layers both present):
    /// `bytes` of storage (null blocks included), or exactly `blocks` blocks
    /// for the full group. Without `usage` both groups get the same count (the
    /// budget splits by layers). With it the sliding group gets at most
    /// [`KvUse::sliding_blocks`] and, from a byte budget, the bytes it leaves go
    /// to the full group, which holds every row's whole context; with a block
    /// count the full group keeps exactly that many and the sliding group's
    /// unusable blocks are simply not allocated.
    pub fn plan(shape: &KvShape, block_size: u32, budget: KvBudget, usage: Option<KvUse>) -> Self {
        let (full_layers, sliding_layers) = shape.layer_counts();
        let per_layer_block = shape.bytes_per_layer_token() * u64::from(block_size);
        let layers = (full_layers + sliding_layers) as u64;
        let equal = match budget {
            KvBudget::Blocks(n) => n,
            KvBudget::Bytes(b) => b / (per_layer_block * layers).max(1),
        };
        let (Some(s), Some(u), true) =
            (shape.sliding, usage, full_layers > 0 && sliding_layers > 0)
        else {
            return Self {
                full: equal,
                sliding: if sliding_layers > 0 && full_layers > 0 {
                    equal
                } else {
                    0
                },
            };
        };
        let sliding = u.sliding_blocks(s.window, block_size);
        if sliding >= equal {
            return Self {
                full: equal,
                sliding: equal,
            };
        }
        let full = match budget {
            KvBudget::Blocks(n) => n,
            KvBudget::Bytes(b) => {
                // Each group's storage also holds its null block.
                let sliding_bytes = (sliding + 1) * sliding_layers as u64 * per_layer_block;
                let full_bytes = b.saturating_sub(sliding_bytes);
                (full_bytes / (full_layers as u64 * per_layer_block).max(1)).saturating_sub(1)
            }
        };
        Self { full, sliding }
    }

    /// Bytes of storage this split allocates for `shape` (null blocks included).
    pub fn bytes(&self, shape: &KvShape, block_size: u32) -> u64 {
        let (full_layers, sliding_layers) = shape.layer_counts();
        let per_layer_block = shape.bytes_per_layer_token() * u64::from(block_size);
        let group = |blocks: u64, layers: usize| {
            if layers == 0 {
                0
            } else {
                (blocks + 1) * layers as u64 * per_layer_block
            }
        };
        if sliding_layers > 0 && full_layers > 0 {
            group(self.full, full_layers) + group(self.sliding, sliding_layers)
        } else {
            group(self.full, full_layers + sliding_layers)
        }
    }
}

/// A KV budget once the device has been asked: bytes, or a block count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvBudget {
    Bytes(u64),
    Blocks(u64),
}

/// The storage's shape: what `PagedKv::new` needs of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub layers: usize,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype: Dtype,
    /// The layers that attend over a sliding window, if any.
    pub sliding: Option<SlidingLayers>,
    /// K/V stored affine-quantized (`--kv-bits`), with scales and biases in
    /// `dtype`; `None` stores them in `dtype`.
    pub quant: Option<AffineQuant>,
    /// The layers that keep recurrent state instead of K/V, if any.
    pub recurrent: Option<RecurrentLayers>,
    /// Bit `i` set: layer `i` keeps neither K/V nor state (Nemotron-H's MLP
    /// blocks).
    pub stateless: u128,
}

/// One recurrent layer's state per row: the causal convolution's last
/// `conv_keep` inputs of `conv_dim` channels (model dtype) and an f32 matrix
/// per head (`matrix`: Gated DeltaNet's `[v_heads, v_dim, k_dim]`, Mamba-2's
/// `[heads, head_dim, state]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecurrentState {
    pub conv_keep: i32,
    pub conv_dim: i32,
    pub matrix: [i32; 3],
}

impl From<DeltaShape> for RecurrentState {
    fn from(s: DeltaShape) -> Self {
        Self {
            conv_keep: s.kernel - 1,
            conv_dim: s.conv_dim(),
            matrix: [s.v_heads, s.v_dim, s.k_dim],
        }
    }
}

impl From<Mamba2Shape> for RecurrentState {
    fn from(s: Mamba2Shape) -> Self {
        Self {
            conv_keep: s.kernel - 1,
            conv_dim: s.conv_dim(),
            matrix: [s.heads, s.head_dim, s.state],
        }
    }
}

/// Which layers are recurrent (Gated DeltaNet, Mamba-2: per-row state in
/// slots, no K/V) and the shape of their state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecurrentLayers {
    /// Bit `i` set: layer `i` is recurrent (models of up to 128 layers).
    pub layers: u128,
    pub shape: RecurrentState,
}

impl RecurrentLayers {
    /// From per-layer flags; None when no layer is recurrent.
    pub fn from_flags(shape: Option<RecurrentState>, flags: &[bool]) -> Result<Option<Self>> {
        if !flags.iter().any(|&f| f) {
            return Ok(None);
        }
        let shape = shape
            .ok_or_else(|| ModelError::Invalid("recurrent layers without a state shape".into()))?;
        Ok(Some(Self {
            layers: layer_bits(flags, "recurrent")?,
            shape,
        }))
    }

    pub fn is_recurrent(&self, layer: usize) -> bool {
        layer < 128 && self.layers & (1u128 << layer) != 0
    }

    pub fn count(&self) -> usize {
        self.layers.count_ones() as usize
    }

    /// The state components of one slot: the convolution's last inputs in
    /// the model dtype, the delta rule's matrices in f32.
    pub fn specs(&self, dtype: Dtype) -> Vec<StateSpec> {
        let s = self.shape;
        vec![
            StateSpec::new(&[s.conv_keep, s.conv_dim], dtype),
            StateSpec::new(&s.matrix, Dtype::Float32),
        ]
    }

    /// Bytes of one row's state over every recurrent layer.
    pub fn bytes_per_slot(&self, dtype: Dtype) -> u64 {
        let el = |d: Dtype| if d == Dtype::Float32 { 4u64 } else { 2 };
        let per_layer: u64 = self
            .specs(dtype)
            .iter()
            .map(|c| c.shape.iter().map(|&d| d.max(0) as u64).product::<u64>() * el(c.dtype))
            .sum();
        per_layer * self.count() as u64
    }
}

/// State slots of a recurrent model's pool when the server's row count is
/// not known ([`KvUse`] absent): tests and tools.
pub const DEFAULT_STATE_SLOTS: u32 = 32;

/// What a KV pool of `dtype` stores per element, for people: the dtype, or
/// `q{bits}g{group}/` before it when quantized (`bfloat16`, `q4g64/bfloat16`).
pub fn kv_dtype_label(dtype: Dtype, quant: Option<AffineQuant>) -> String {
    let d = match dtype {
        Dtype::Float32 => "float32",
        Dtype::Float16 => "float16",
        _ => "bfloat16",
    };
    match quant {
        Some(q) => format!("q{}g{}/{d}", q.bits, q.group_size),
        None => d.to_string(),
    }
}

/// Per-layer flags as a bit set (bit `i`: layer `i`); `kind` names the
/// layers for the error of a model of more than 128.
pub fn layer_bits(flags: &[bool], kind: &str) -> Result<u128> {
    if flags.len() > 128 {
        return Err(ModelError::Invalid(format!(
            "{kind} models of {} layers are not supported (at most 128)",
            flags.len()
        )));
    }
    Ok(flags
        .iter()
        .enumerate()
        .filter(|(_, &f)| f)
        .fold(0u128, |m, (i, _)| m | (1u128 << i)))
}

/// Which layers attend over a sliding window, and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingLayers {
    /// Tokens a query sees, itself included.
    pub window: u32,
    /// Bit `i` set: layer `i` slides (models of up to 128 layers).
    pub layers: u128,
}

impl SlidingLayers {
    /// From per-layer flags; None when no layer slides.
    pub fn from_flags(window: u32, flags: &[bool]) -> Result<Option<Self>> {
        if !flags.iter().any(|&f| f) {
            return Ok(None);
        }
        Ok(Some(Self {
            window,
            layers: layer_bits(flags, "sliding-window")?,
        }))
    }

    pub fn slides(&self, layer: usize) -> bool {
        layer < 128 && self.layers & (1u128 << layer) != 0
    }
}

impl KvShape {
    /// Bytes of K plus V of one token over all attention layers.
    pub fn bytes_per_token(&self) -> u64 {
        let (full, sliding) = self.layer_counts();
        (full + sliding) as u64 * self.bytes_per_layer_token()
    }

    /// Whether layer `i` keeps recurrent state instead of K/V.
    pub fn is_recurrent(&self, i: usize) -> bool {
        self.recurrent.is_some_and(|r| r.is_recurrent(i))
    }

    /// Whether layer `i` attends (keeps K/V in a group).
    pub fn attends(&self, i: usize) -> bool {
        let stateless = i < 128 && self.stateless & (1u128 << i) != 0;
        !(self.is_recurrent(i) || stateless)
    }

    /// Bytes of K plus V of one token in one layer (packed values, scales
    /// and biases when quantized).
    pub fn bytes_per_layer_token(&self) -> u64 {
        self.storage_config(0, 1, 1, 1).bytes_per_layer()
    }

    /// The same shape with K/V stored quantized (or not).
    pub fn with_quant(mut self, quant: Option<AffineQuant>) -> Self {
        self.quant = quant;
        self
    }

    /// What the KV stores per element, for people ([`kv_dtype_label`]).
    pub fn kv_dtype(&self) -> String {
        kv_dtype_label(self.dtype, self.quant)
    }

    /// Storage of group `g`: `layers` layers of `blocks` blocks.
    fn storage_config(
        &self,
        g: usize,
        layers: usize,
        blocks: u32,
        block_size: u32,
    ) -> KvStorageConfig {
        let cfg = KvStorageConfig::dense(
            g,
            layers,
            blocks,
            block_size,
            self.kv_heads,
            self.head_dim,
            self.dtype,
        );
        match self.quant {
            Some(q) => cfg.quantized(q),
            None => cfg,
        }
    }

    /// (full-attention layers, sliding-window layers); recurrent layers are
    /// neither.
    pub fn layer_counts(&self) -> (usize, usize) {
        let sliding = (0..self.layers)
            .filter(|&i| self.sliding.is_some_and(|s| s.slides(i)))
            .count();
        let attending = (0..self.layers).filter(|&i| self.attends(i)).count();
        (attending - sliding, sliding)
    }
}

/// Device memory MLX may still allocate: its memory limit (on a CUDA GPU at
/// most the device's total memory) minus what it holds now.
pub fn free_device_memory() -> Result<u64> {
    let mut limit = 0usize;
    let mut active = 0usize;
    let mut cache = 0usize;
    // SAFETY: plain out-parameter calls.
    let rc = unsafe {
        mlx_sys::mlx_get_memory_limit(&mut limit)
            | mlx_sys::mlx_get_active_memory(&mut active)
            | mlx_sys::mlx_get_cache_memory(&mut cache)
    };
    if rc != 0 {
        return Err(ModelError::Invalid("MLX memory queries failed".into()));
    }
    Ok(limit.saturating_sub(active + cache) as u64)
}

/// Decode over quantized pools reads them in place with the paged kernel
/// (checked against gather + dequantize + SDPA on the H200: within 7.8e-3 at
/// 4 and 8 bits; 3.1-3.4x the gathered path's throughput at 128 rows,
/// benches/RESULTS.md); `WEFT_KV_QUANT_KERNEL=0` gathers and dequantizes
/// instead.
fn quant_kernel_enabled() -> bool {
    std::env::var("WEFT_KV_QUANT_KERNEL").map_or(true, |v| v != "0")
}

/// One forward's attention mode (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Kernel,
    Host,
    Fresh,
    Gather,
}

/// The model's KV storage and the layout its pool must mirror.
pub struct PagedKv {
    groups: KvGroups,
    /// One storage per group; a `RefCell` because the lockstep forwards of
    /// one step (see `LlamaModel::forward_interleaved`) each write it between
    /// their awaits.
    storage: Vec<RefCell<KvStorage>>,
    /// Group of each layer, and its index among that group's layers.
    layer_group: Vec<usize>,
    layer_index: Vec<usize>,
    kernel: Option<std::rc::Rc<PagedAttention>>,
    kernels: Kernels,
    /// How multi-token queries attend (composed on the GPU: no per-shape plan).
    prefill: PrefillAttention,
    shape: KvShape,
    /// Recurrent layers' state slots (the pool hands out `0..slots`; slot
    /// `slots` is the null slot padding rows read), and each model layer's
    /// index among the recurrent ones.
    state: Option<RefCell<StateStorage>>,
    state_slots: u32,
    state_index: Vec<Option<usize>>,
}

impl PagedKv {
    /// Allocates (and materializes, so the memory is really taken) storage of
    /// `memory` for a model of `shape` in `block_size`-token blocks; with
    /// `gpu_kernel`, decode attention runs Weft's CUDA kernel. Every group
    /// gets the same block count (see [`Self::with_use`]).
    pub fn new(
        shape: KvShape,
        block_size: u32,
        memory: KvMemory,
        kernels: Kernels,
        gpu_kernel: bool,
    ) -> Result<Self> {
        Self::with_use(shape, block_size, memory, None, kernels, gpu_kernel)
    }

    /// [`Self::new`], with the sliding-window group (if the model has one)
    /// sized by `usage` ([`KvSplit::plan`]): it holds only what that many rows
    /// can use, and the rest of the budget goes to the full-attention group.
    pub fn with_use(
        shape: KvShape,
        block_size: u32,
        memory: KvMemory,
        usage: Option<KvUse>,
        kernels: Kernels,
        gpu_kernel: bool,
    ) -> Result<Self> {
        let per_block = shape.bytes_per_token() * u64::from(block_size);
        // Recurrent layers: one state slot per row a step can hold, plus the
        // null slot, taken from a byte budget before it is split into blocks.
        let state_slots = match (shape.recurrent, usage) {
            (None, _) => 0,
            (Some(_), Some(u)) => u32::try_from(u.max_rows.max(1)).unwrap_or(u32::MAX),
            (Some(_), None) => DEFAULT_STATE_SLOTS,
        };
        let state_bytes = shape.recurrent.map_or(0, |r| {
            r.bytes_per_slot(shape.dtype) * (u64::from(state_slots) + 1)
        });
        let budget = match memory {
            KvMemory::Blocks(n) => KvBudget::Blocks(u64::from(n)),
            KvMemory::Bytes(b) => KvBudget::Bytes(b.saturating_sub(state_bytes)),
            KvMemory::FreeFraction(f) => {
                if !(f > 0.0 && f < 1.0) {
                    return Err(ModelError::Invalid(format!(
                        "KV memory fraction {f} must be in (0, 1)"
                    )));
                }
                KvBudget::Bytes(
                    ((free_device_memory()? as f64 * f) as u64).saturating_sub(state_bytes),
                )
            }
        };
        let split = KvSplit::plan(&shape, block_size, budget, usage);
        // The flat slot count, null block included, must fit MLX's i32 shapes.
        let max_blocks = (i32::MAX as u64) / u64::from(block_size.max(1)) - 1;
        let blocks = split.full.min(max_blocks) as u32;
        let sliding_blocks = split.sliding.min(max_blocks) as u32;
        if blocks < 2 {
            return Err(ModelError::Invalid(format!(
                "KV memory {memory:?} holds {blocks} blocks of {block_size} tokens ({per_block} bytes each); \
                 at least 2 are needed"
            )));
        }
        // Full-attention layers are group 0 (when there are any), sliding ones
        // the next. Without a usage hint each group gets the same block count
        // (the budget splits by layers); with one the sliding group gets what
        // its windows can use and the full group the rest (`KvSplit`).
        let slides = |i: usize| shape.sliding.is_some_and(|s| s.slides(i));
        let attends = |i: usize| shape.attends(i);
        let mut kinds: Vec<AttentionKind> = Vec::new();
        if (0..shape.layers).any(|i| attends(i) && !slides(i)) {
            kinds.push(AttentionKind::Full);
        }
        if let Some(s) = shape.sliding.filter(|_| (0..shape.layers).any(slides)) {
            kinds.push(AttentionKind::SlidingWindow { window: s.window });
        }
        let mut groups = KvGroups::new(block_size).state_slots(state_slots);
        for (g, k) in kinds.iter().enumerate() {
            let n = if g == 1 { sliding_blocks } else { blocks };
            groups = groups.group(GroupSpec::new(*k, n));
        }
        // Recurrent layers have no group: `usize::MAX` (never indexed, see
        // `KvStep::attend`).
        let group_of = |i: usize| {
            if attends(i) {
                usize::from(slides(i) && kinds.len() == 2)
            } else {
                usize::MAX
            }
        };
        let layer_group: Vec<usize> = (0..shape.layers).map(group_of).collect();
        let mut counts = vec![0usize; kinds.len()];
        let layer_index: Vec<usize> = layer_group
            .iter()
            .map(|&g| match counts.get_mut(g) {
                Some(c) => {
                    *c += 1;
                    *c - 1
                }
                None => usize::MAX,
            })
            .collect();
        let mut recurrent_seen = 0usize;
        let state_index: Vec<Option<usize>> = (0..shape.layers)
            .map(|i| {
                shape.is_recurrent(i).then(|| {
                    recurrent_seen += 1;
                    recurrent_seen - 1
                })
            })
            .collect();
        let state = match shape.recurrent {
            Some(r) => {
                let st = StateStorage::new(state_slots + 1, r.count(), r.specs(shape.dtype))
                    .map_err(storage_err)?;
                mlx_rs::transforms::eval(st.arrays())?;
                Some(RefCell::new(st))
            }
            None => None,
        };
        let mut storage = Vec::with_capacity(kinds.len());
        for (g, &layers) in counts.iter().enumerate() {
            // One block more than the pool hands out: the null block, which
            // padding rows of a bucketed step write and read (never a real row's).
            let cfg = shape.storage_config(g, layers, groups.groups[g].num_blocks + 1, block_size);
            let st = KvStorage::new(cfg).map_err(storage_err)?;
            mlx_rs::transforms::eval(st.arrays())?;
            storage.push(RefCell::new(st));
        }
        Ok(Self {
            groups,
            storage,
            layer_group,
            layer_index,
            // The kernel keeps 8 elements of a head per lane: head_dim 64,
            // 128 or 256; other shapes attend by gather + SDPA, and so do
            // quantized pools with `WEFT_KV_QUANT_KERNEL=0`.
            kernel: if gpu_kernel
                && (shape.quant.is_none() || quant_kernel_enabled())
                && matches!(shape.head_dim, 64 | 128 | 256)
            {
                Some(std::rc::Rc::new(PagedAttention::new()?))
            } else {
                None
            },
            kernels,
            prefill: PrefillAttention::for_device(crate::loader::cuda_available()),
            shape,
            state,
            state_slots,
            state_index,
        })
    }

    /// The block layout the scheduler's pool must be built from.
    pub fn groups(&self) -> &KvGroups {
        &self.groups
    }

    /// What the storage holds per token and in all.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Bytes of all storage (recurrent state slots included).
    pub fn bytes(&self) -> u64 {
        let kv: u64 = self
            .storage
            .iter()
            .map(|s| s.borrow().config().bytes_per_layer() * s.borrow().config().layers as u64)
            .sum();
        kv + self.state_bytes()
    }

    /// Bytes of the recurrent state slots (the null slot included).
    pub fn state_bytes(&self) -> u64 {
        self.state.as_ref().map_or(0, |s| {
            let s = s.borrow();
            s.bytes_per_slot() * u64::from(s.num_slots())
        })
    }

    /// Whether the model keeps recurrent state: every row of a step needs a
    /// state slot ([`KvStep::with_slots`]).
    pub fn has_state(&self) -> bool {
        self.state.is_some()
    }

    /// State slots the pool hands out (0 without recurrent layers).
    pub fn state_slots(&self) -> u32 {
        self.state_slots
    }

    /// Opens a step's state journal (see `StateStorage`): its writes until
    /// the next `state_begin` undo together.
    pub fn state_begin(&self) {
        if let Some(s) = &self.state {
            s.borrow_mut().begin();
        }
    }

    /// Steps with an open state journal.
    pub fn state_open(&self) -> usize {
        self.state.as_ref().map_or(0, |s| s.borrow().open_steps())
    }

    /// Keeps the oldest open step's state.
    pub fn state_commit(&self) -> Result<()> {
        match &self.state {
            Some(s) => s.borrow_mut().commit().map_err(storage_err),
            None => Ok(()),
        }
    }

    /// Writes back the state the newest open step replaced.
    pub fn state_rollback(&self) -> Result<()> {
        match &self.state {
            Some(s) => s.borrow_mut().rollback().map_err(storage_err),
            None => Ok(()),
        }
    }

    /// The reserved block padding rows point at in group 0: the storage's
    /// last, which the pool (sized by [`groups`](Self::groups)) never hands out.
    pub fn null_block(&self) -> u32 {
        self.null_block_of(0)
    }

    /// The null block of group `g` (groups may hold different block counts).
    pub fn null_block_of(&self, g: usize) -> u32 {
        self.groups.groups.get(g).map_or(0, |g| g.num_blocks)
    }

    /// Whether a compiled decode step can serve this KV: one full-attention
    /// group (its pool arrays are the step's inputs; sliding-window layers
    /// gather, which the trace does not).
    pub fn compilable(&self) -> bool {
        self.state.is_none()
            && matches!(self.groups.groups.as_slice(), [g] if g.kind == AttentionKind::Full)
    }

    /// How a compiled prefill's trace attends.
    pub(crate) fn traced_attention(&self) -> TracedAttention {
        TracedAttention {
            kernels: self.kernels,
            prefill: self.prefill,
            quant: self.shape.quant,
        }
    }

    /// Whether decode attention runs the paged GPU kernel.
    pub fn uses_kernel(&self) -> bool {
        self.kernel.is_some()
    }

    /// Whether decode rows gather their context into a padded layout (no
    /// paged kernel, and no host attention: that needs a dense f32 pool).
    pub fn decode_gathers(&self) -> bool {
        self.kernel.is_none() && !(self.shape.dtype == Dtype::Float32 && self.shape.quant.is_none())
    }

    /// Bytes one token of one layer takes once gathered: K and V in the
    /// compute dtype, plus a quantized pool's packed values, scales and
    /// biases gathered before they are dequantized.
    pub fn gather_bytes_per_token(&self) -> u64 {
        let dense = self.shape.with_quant(None).bytes_per_layer_token();
        match self.shape.quant {
            Some(_) => dense + self.shape.bytes_per_layer_token(),
            None => dense,
        }
    }

    /// The paged decode kernel, when decode attention runs it.
    pub fn kernel(&self) -> Option<std::rc::Rc<PagedAttention>> {
        self.kernel.clone()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.groups.block_size
    }

    /// Every layer's K/V pool arrays for a compiled step (see
    /// `KvStorage::pool_arrays`: per layer its K arrays then its V arrays, one
    /// each dense, three quantized; drop them before the step is evaluated).
    /// Only single-group storage has them.
    pub fn pool_arrays(&self) -> Result<Vec<Array>> {
        match self.storage.as_slice() {
            [one] => Ok(one.borrow().pool_arrays()),
            _ => Err(ModelError::Invalid(
                "compiled steps need one KV group".into(),
            )),
        }
    }

    /// Pool arrays per layer in [`pool_arrays`](Self::pool_arrays): K's then
    /// V's, one each dense, three each quantized.
    pub fn pool_arrays_per_layer(&self) -> usize {
        self.storage
            .first()
            .map_or(2, |s| 2 * s.borrow().arrays_per_pool())
    }

    /// Installs the pool arrays a compiled step wrote (`pool_arrays` order).
    pub fn replace_pools(&self, pools: Vec<Array>) -> Result<()> {
        match self.storage.as_slice() {
            [one] => one.borrow_mut().replace_pools(pools).map_err(storage_err),
            _ => Err(ModelError::Invalid(
                "compiled steps need one KV group".into(),
            )),
        }
    }

    /// Applies a step's storage operations (copy-on-write copies) before its
    /// forward writes anything.
    pub fn apply(&self, ops: &[StorageOp]) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        for s in &self.storage {
            s.borrow_mut().apply(ops).map_err(storage_err)?;
        }
        if let Some(st) = &self.state {
            st.borrow_mut().apply(ops).map_err(storage_err)?;
        } else if let Some(StorageOp::CopySlot { src: slot, .. } | StorageOp::ResetSlot(slot)) = ops
            .iter()
            .find(|o| matches!(o, StorageOp::CopySlot { .. } | StorageOp::ResetSlot(_)))
        {
            return Err(ModelError::Invalid(format!(
                "a state slot operation (slot {slot}) for a model without recurrent layers"
            )));
        }
        Ok(())
    }

    /// Every pool array (state slots and their open journals included), to
    /// evaluate with a step's outputs.
    pub fn arrays(&self) -> Vec<Array> {
        // Handles are reference-counted views of the same buffers; they are
        // dropped right after evaluation, before the next write.
        let mut out: Vec<Array> = self
            .storage
            .iter()
            .flat_map(|s| s.borrow().arrays().cloned().collect::<Vec<_>>())
            .collect();
        if let Some(st) = &self.state {
            let st = st.borrow();
            out.extend(st.arrays().cloned());
            out.extend(st.journal_arrays().cloned());
        }
        out
    }

    /// Plans one forward over `rows`: `(block tables per group, start, new
    /// tokens)` in batch order. `decode` says the rows decode (one token and a
    /// short draft each) rather than prefill.
    pub fn step(&self, rows: &[(&[RowBlocks], usize, usize)], decode: bool) -> Result<KvStep<'_>> {
        let bs = self.groups.block_size as usize;
        let mut layouts = Vec::with_capacity(self.groups.groups.len());
        for (g, spec) in self.groups.groups.iter().enumerate() {
            let writes = rows
                .iter()
                .map(|(tables, start, tokens)| {
                    let t = tables.get(g).ok_or_else(|| {
                        ModelError::Invalid(format!("a row has no block table for KV group {g}"))
                    })?;
                    Ok(RowWrite {
                        table: t.as_table(bs),
                        start: *start,
                        tokens: *tokens,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            layouts.push(StepLayout::new(&writes, spec.kind, 1).map_err(storage_err)?);
        }
        let starts: Vec<i32> = rows.iter().map(|r| r.1 as i32).collect();
        let ntok: Vec<i32> = rows.iter().map(|r| r.2 as i32).collect();
        let b = rows.len() as i32;
        let t = ntok.iter().copied().max().unwrap_or(1);
        let host_reads = self.kernel.is_none()
            && self.shape.dtype == Dtype::Float32
            && self.shape.quant.is_none();
        let fresh = rows.iter().all(|r| r.1 == 0);
        let mode = if decode && self.kernel.is_some() {
            Mode::Kernel
        } else if host_reads && (decode || self.kernels == Kernels::CpuTuned) {
            Mode::Host
        } else if fresh {
            Mode::Fresh
        } else {
            Mode::Gather
        };
        let kernel_inputs = if mode == Mode::Kernel {
            // The paged kernel reads full-attention tables (group 0 when the
            // model has full layers; sliding layers gather, see `attend`).
            let l = &layouts[0];
            let nb = l.blocks_per_row() as i32;
            Some(KernelInputs {
                table: Array::from_slice(l.block_table(), &[b, nb]),
                start: Array::from_slice(&starts, &[b]),
                ntok: Array::from_slice(&ntok, &[b]),
                max_keys: rows.iter().map(|r| r.1 + r.2).max().unwrap_or(1),
            })
        } else {
            None
        };
        let uniform = ntok.iter().all(|&n| n == t);
        Ok(KvStep {
            kv: self,
            offsets: Array::from_slice(&starts, &[b]),
            last: (!uniform).then(|| {
                let idx: Vec<i32> = ntok.iter().map(|n| n - 1).collect();
                Array::from_slice(&idx, &[b, 1, 1])
            }),
            masks: layouts.iter().map(|_| None).collect(),
            fresh_mask: None,
            fresh_window_mask: None,
            layouts,
            mode,
            fresh,
            t,
            kernel_inputs,
            slots: None,
        })
    }
}

/// The state slots of one forward's rows.
struct StepSlots {
    /// Every row's slot, padding rows' the null slot.
    read: SlotBatch,
    /// The rows whose new state is kept: the first `write.len()`.
    write: SlotBatch,
    /// `[B, 1, 1, 1]`: the row starts at position 0 (its state is zero).
    fresh: Array,
}

struct KernelInputs {
    table: Array,
    start: Array,
    ntok: Array,
    max_keys: usize,
}

/// One forward's view of the KV cache (see the module docs).
pub struct KvStep<'a> {
    kv: &'a PagedKv,
    layouts: Vec<StepLayout>,
    offsets: Array,
    /// Per row, the index of its last token when rows have different token
    /// counts (right padding); `None` when all have `t`.
    last: Option<Array>,
    /// Per group, the gather-mode mask in the form the kernels take, built at
    /// the first layer that needs it.
    masks: Vec<Option<Mask>>,
    fresh_mask: Option<Mask>,
    /// Fresh rows' causal mask within a sliding window (prompts longer than
    /// the window).
    fresh_window_mask: Option<Mask>,
    mode: Mode,
    /// Every row starts at position 0 (nothing older in the pool).
    fresh: bool,
    t: i32,
    kernel_inputs: Option<KernelInputs>,
    slots: Option<StepSlots>,
}

#[derive(Clone)]
enum Mask {
    /// Boolean, for MLX's SDPA.
    Bool(Array),
    /// Additive 0 / -inf, for Weft's CPU attention.
    Additive(Array),
    Causal,
}

/// What a forward asks of its KV cache: the batch's shape and RoPE offsets,
/// and per layer the write of the new K/V and attention over each row's
/// context. [`KvStep`] serves a step planned on the host; a compiled decode
/// step serves the same forward from array inputs
/// ([`crate::compiled_decode`]).
pub trait LayerKv {
    /// Rows in the forward.
    fn batch(&self) -> usize;
    /// Tokens per row in the forward's input.
    fn step_tokens(&self) -> i32;
    /// `[B]` RoPE offset of each row's first new token.
    fn offsets(&self) -> &Array;
    /// `[B, 1, 1]` index of each row's last token, when rows are ragged.
    fn last_index(&self) -> Option<&Array>;
    /// `[R]` the rows whose logits the forward returns, in this order (`[R,
    /// 1, vocab]`), where not every row's are wanted: a mixed step's
    /// decoding rows and each chunk's last token. `None`: every row's.
    fn logit_rows(&self) -> Option<&Array> {
        None
    }
    /// Writes layer `layer`'s new K/V and attends `q` over each row's context
    /// (shapes as [`KvStep::attend`]).
    fn attend(
        &mut self,
        layer: usize,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
    ) -> Result<Array>;
    /// Recurrent layer `layer`'s state of the forward's rows (per component,
    /// `[B, ...]`), zero for rows starting at position 0.
    fn state(&mut self, layer: usize) -> Result<Vec<Array>> {
        Err(ModelError::Invalid(format!(
            "layer {layer}: this KV keeps no recurrent state"
        )))
    }
    /// Replaces layer `layer`'s state of the forward's rows with `new` (as
    /// [`state`](Self::state) returns it), undone if the step rolls back.
    fn set_state(&mut self, layer: usize, _new: Vec<Array>) -> Result<()> {
        Err(ModelError::Invalid(format!(
            "layer {layer}: this KV keeps no recurrent state"
        )))
    }
    /// The fused one-token decode kernels, where this KV runs them (a
    /// compiled GPU decode step); `None` keeps the op-by-op layer.
    fn fused(&self) -> Option<std::rc::Rc<crate::decode_kernels::DecodeKernels>> {
        None
    }
    /// The fused layer's write and attention: stores layer `layer`'s new K/V
    /// rows `[B, 1, kv_heads, 1, head_dim]` (as the fused RoPE kernel returns
    /// them) and attends the rotated one-token queries `q` `[B, heads, 1,
    /// head_dim]`, returning `[B, heads * head_dim]`. Only called where
    /// [`fused`](Self::fused) is `Some`.
    fn attend_rows(
        &mut self,
        layer: usize,
        _q: &Array,
        _k: &Array,
        _v: &Array,
        _scale: f32,
    ) -> Result<Array> {
        Err(ModelError::Invalid(format!(
            "layer {layer}: this KV has no fused decode path"
        )))
    }
}

impl LayerKv for KvStep<'_> {
    fn state(&mut self, layer: usize) -> Result<Vec<Array>> {
        KvStep::state(self, layer)
    }
    fn set_state(&mut self, layer: usize, new: Vec<Array>) -> Result<()> {
        KvStep::set_state(self, layer, new)
    }
    fn batch(&self) -> usize {
        KvStep::batch(self)
    }
    fn step_tokens(&self) -> i32 {
        KvStep::step_tokens(self)
    }
    fn offsets(&self) -> &Array {
        KvStep::offsets(self)
    }
    fn last_index(&self) -> Option<&Array> {
        KvStep::last_index(self)
    }
    fn attend(
        &mut self,
        layer: usize,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
    ) -> Result<Array> {
        KvStep::attend(self, layer, q, k, v, scale)
    }
}

impl KvStep<'_> {
    /// Gives the forward's rows their state slots (a model with recurrent
    /// layers needs them): `slots[i]` is row `i`'s; the first `real` rows keep
    /// their new state, the rest are padding that reads the null slot.
    pub fn with_slots(mut self, slots: &[u32], real: usize) -> Result<Self> {
        let b = self.batch();
        if self.kv.state.is_none() {
            return Err(ModelError::Invalid(
                "state slots for a model without recurrent layers".into(),
            ));
        }
        if real > b || slots.len() != real {
            return Err(ModelError::Invalid(format!(
                "{} state slots for {real} of {b} rows",
                slots.len()
            )));
        }
        if let Some(&bad) = slots.iter().find(|&&s| s >= self.kv.state_slots) {
            return Err(ModelError::Invalid(format!(
                "state slot {bad} out of range ({} slots)",
                self.kv.state_slots
            )));
        }
        let mut read = slots.to_vec();
        read.resize(b, self.kv.state_slots);
        let fresh = ops::eq(&self.offsets, Array::from_int(0))?.reshape(&[b as i32, 1, 1, 1])?;
        self.slots = Some(StepSlots {
            read: SlotBatch::from_slots(read),
            write: SlotBatch::from_slots(slots.to_vec()),
            fresh,
        });
        Ok(self)
    }

    fn step_slots(&self, layer: usize) -> Result<(&StepSlots, usize, &RefCell<StateStorage>)> {
        let li = self
            .kv
            .state_index
            .get(layer)
            .copied()
            .flatten()
            .ok_or_else(|| ModelError::Invalid(format!("layer {layer} is not recurrent")))?;
        let st = self
            .kv
            .state
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("no recurrent state storage".into()))?;
        let slots = self.slots.as_ref().ok_or_else(|| {
            ModelError::Invalid("a step of a recurrent model without state slots".into())
        })?;
        Ok((slots, li, st))
    }

    /// See [`LayerKv::state`].
    pub fn state(&mut self, layer: usize) -> Result<Vec<Array>> {
        let (slots, li, st) = self.step_slots(layer)?;
        let got = st.borrow().gather(li, &slots.read).map_err(storage_err)?;
        got.into_iter()
            .map(|a| {
                let nd = a.ndim();
                let fresh = slots.fresh.reshape(&[-1, 1, 1, 1][..nd.max(1)])?;
                Ok(ops::select(&fresh, &ops::zeros_like(&a)?, &a)?)
            })
            .collect()
    }

    /// See [`LayerKv::set_state`].
    pub fn set_state(&mut self, layer: usize, new: Vec<Array>) -> Result<()> {
        let (slots, li, st) = self.step_slots(layer)?;
        let real = slots.write.len() as i32;
        let new = new
            .into_iter()
            .map(|a| {
                if a.dim(0) == real {
                    Ok(a)
                } else {
                    Ok(a.try_index(0..real)?)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        if real == 0 {
            return Ok(());
        }
        st.borrow_mut()
            .write(li, &slots.write, new)
            .map_err(storage_err)
    }

    /// Rows in the forward.
    pub fn batch(&self) -> usize {
        self.layouts.first().map_or(0, |l| l.batch())
    }

    /// Tokens per row in the forward's input (the longest row's).
    pub fn step_tokens(&self) -> i32 {
        self.t
    }

    /// `[B]` RoPE offset of each row's first new token (its committed length).
    pub fn offsets(&self) -> &Array {
        &self.offsets
    }

    /// `[B, 1, 1]` index of each row's last token, when rows are ragged.
    pub fn last_index(&self) -> Option<&Array> {
        self.last.as_ref()
    }

    /// Writes layer `layer`'s new K/V (`[B, kv_heads, T, head_dim]`, after
    /// RoPE) into the rows' slots and returns attention of `q`
    /// (`[B, heads, T, head_dim]`) over each row's context, `[B, heads, T,
    /// head_dim]`.
    pub fn attend(
        &mut self,
        layer: usize,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
    ) -> Result<Array> {
        let g = *self
            .kv
            .layer_group
            .get(layer)
            .ok_or_else(|| ModelError::Invalid(format!("layer {layer} has no KV group")))?;
        let li = self.kv.layer_index[layer];
        let layout = &self.layouts[g];
        let sliding = matches!(layout.kind(), AttentionKind::SlidingWindow { .. });
        let mut storage = self.kv.storage[g].borrow_mut();
        storage.write(li, layout, k, v).map_err(storage_err)?;
        // The paged kernel and the host attention walk whole rows: sliding
        // layers read their in-window blocks through the gathered layout (or
        // attend the forward's own K/V when every row starts fresh).
        let mode = match self.mode {
            Mode::Host if sliding && self.fresh => Mode::Fresh,
            Mode::Kernel | Mode::Host if sliding => Mode::Gather,
            m => m,
        };
        let layer = li;
        match mode {
            Mode::Kernel => {
                let ki = self
                    .kernel_inputs
                    .as_ref()
                    .ok_or_else(|| ModelError::Invalid("kernel inputs missing".into()))?;
                let kernel = self
                    .kv
                    .kernel
                    .as_ref()
                    .ok_or_else(|| ModelError::Invalid("paged kernel missing".into()))?;
                let scale = Array::from_slice(&[scale], &[1]);
                let pools = match self.kv.shape.quant {
                    Some(_) => {
                        let (kq, vq) = storage.quantized_arrays(layer).map_err(storage_err)?;
                        Pools::Quantized(kq, vq)
                    }
                    None => {
                        let (kp, vp) = storage.dense_arrays(layer).map_err(storage_err)?;
                        Pools::Dense(kp, vp)
                    }
                };
                kernel.decode(
                    q,
                    pools,
                    &ki.table,
                    &ki.start,
                    &ki.ntok,
                    &scale,
                    ki.max_keys,
                )
            }
            Mode::Host => {
                let (kp, vp) = storage.dense_arrays(layer).map_err(storage_err)?;
                let qs = ops::multiply(q, Array::from_f32(scale))?;
                // The layer's writes land, then the pool is read where it is.
                mlx_rs::transforms::eval([kp, vp, &qs])?;
                let (b, hq, t, hd) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
                let ps = kp.shape();
                let d = crate::host_attention::Dims {
                    rows: b as usize,
                    heads: hq as usize,
                    kv_heads: ps[1] as usize,
                    t: t as usize,
                    head_dim: hd as usize,
                    block_size: ps[2] as usize,
                    table_width: layout.blocks_per_row(),
                };
                let out = crate::host_attention::decode(
                    qs.as_slice::<f32>(),
                    kp.as_slice::<f32>(),
                    vp.as_slice::<f32>(),
                    layout.block_table(),
                    layout.starts(),
                    layout.tokens(),
                    d,
                )?;
                Ok(Array::from_slice(&out, &[b, hq, t, hd]))
            }
            Mode::Fresh => {
                drop(storage);
                let t = self.t;
                let kernels = self.kv.kernels;
                let window = match layout.kind() {
                    AttentionKind::SlidingWindow { window } if t > window as i32 => Some(window),
                    _ => None,
                };
                let mask = match window {
                    Some(w) => match &self.fresh_window_mask {
                        Some(m) => m.clone(),
                        None => {
                            let m = window_mask(kernels, t, w, q.dtype())?;
                            self.fresh_window_mask = Some(m.clone());
                            m
                        }
                    },
                    None => self
                        .fresh_mask
                        .get_or_insert_with(|| fresh_mask(kernels, t))
                        .clone(),
                };
                attend_fresh(
                    kernels,
                    self.kv.prefill,
                    self.kv.shape.quant,
                    q,
                    k,
                    v,
                    scale,
                    &mask,
                )
            }
            Mode::Gather => {
                let (kr, vr) = storage.read(layer, layout).map_err(storage_err)?;
                drop(storage);
                let kernels = self.kv.kernels;
                let mask = match &self.masks[g] {
                    Some(m) => m.clone(),
                    None => {
                        let m = gather_mask(kernels, self.layouts[g].mask(), q.dtype(), self.t)?;
                        self.masks[g] = Some(m.clone());
                        m
                    }
                };
                attention(kernels, self.kv.prefill, q, &kr, &vr, scale, &mask)
            }
        }
    }
}

/// Fresh rows' attention over their own new K/V under `mask`. Quantized K/V:
/// the rows' own tokens as stored, so that a token's attention does not
/// depend on whether its context came from this forward or from the pool.
#[allow(clippy::too_many_arguments)]
fn attend_fresh(
    kernels: Kernels,
    prefill: PrefillAttention,
    quant: Option<AffineQuant>,
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: &Mask,
) -> Result<Array> {
    match quant {
        Some(qt) => {
            let (k, v) = (qt.round_trip(k), qt.round_trip(v));
            let (k, v) = (k.map_err(storage_err)?, v.map_err(storage_err)?);
            attention(kernels, prefill, q, &k, &v, scale, mask)
        }
        None => attention(kernels, prefill, q, k, v, scale, mask),
    }
}

/// How a traced (compiled) prefill attends, as an op-by-op step of the same
/// rows would ([`crate::compiled_prefill`]); taken from a [`PagedKv`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct TracedAttention {
    kernels: Kernels,
    prefill: PrefillAttention,
    quant: Option<AffineQuant>,
}

impl TracedAttention {
    /// The causal attention of rows that all start at position 0 over their
    /// own new K/V `[B, kv_heads, T, head_dim]` (right-padded rows too: a real
    /// query sees no padding key, all of which come after it), as a step of
    /// such rows attends without a window.
    pub(crate) fn fresh(&self, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        let mask = fresh_mask(self.kernels, q.dim(2));
        attend_fresh(
            self.kernels,
            self.prefill,
            self.quant,
            q,
            k,
            v,
            scale,
            &mask,
        )
    }

    /// Attention over gathered context `kc`, `vc` `[B, kv_heads, L,
    /// head_dim]` (dequantized) where `visible` `[B, 1, T, L]` is true, as a
    /// gathering step attends.
    pub(crate) fn gathered(
        &self,
        q: &Array,
        kc: &Array,
        vc: &Array,
        scale: f32,
        visible: &Array,
    ) -> Result<Array> {
        let q = if q.dtype() == kc.dtype() {
            q.clone()
        } else {
            q.as_dtype(kc.dtype())?
        };
        attention(
            self.kernels,
            self.prefill,
            &q,
            kc,
            vc,
            scale,
            &Mask::Bool(visible.clone()),
        )
    }
}

fn fresh_mask(kernels: Kernels, t: i32) -> Mask {
    match kernels {
        Kernels::Stock => Mask::Causal,
        Kernels::CpuTuned => {
            let n = t as usize;
            let bias: Vec<f32> = (0..n * n)
                .map(|i| {
                    if i % n <= i / n {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            Mask::Additive(Array::from_slice(&bias, &[t, t]))
        }
    }
}

/// Causal attention within a window of `w` tokens over a fresh `[t, t]`
/// prefill: query `i` sees keys `j` with `i - w < j <= i`.
fn window_mask(kernels: Kernels, t: i32, w: u32, dtype: Dtype) -> Result<Mask> {
    let n = t as usize;
    let w = w as usize;
    let sees = |i: usize| {
        let (q, k) = (i / n, i % n);
        k <= q && q - k < w
    };
    let keep: Vec<bool> = (0..n * n).map(sees).collect();
    let m = Array::from_slice(&keep, &[t, t]);
    Ok(match kernels {
        Kernels::Stock => Mask::Bool(m),
        Kernels::CpuTuned => {
            let zero = Array::from_f32(0.0).as_dtype(dtype)?;
            let ninf = Array::from_f32(f32::NEG_INFINITY).as_dtype(dtype)?;
            // Additive `[T, T]`, as `fresh_mask` gives the CPU attention.
            Mask::Additive(ops::select(&m, &zero, &ninf)?)
        }
    })
}

/// Query runs this long go through Weft's CPU attention in blocks that assume
/// the queries are the last columns of the keys, which a gathered layout with
/// rows at different starts does not give; MLX's SDPA takes those.
const TUNED_GATHER_MAX_T: i32 = 128;

fn gather_mask(kernels: Kernels, m: &Array, dtype: Dtype, t: i32) -> Result<Mask> {
    Ok(match kernels {
        Kernels::Stock => Mask::Bool(m.clone()),
        Kernels::CpuTuned if t >= TUNED_GATHER_MAX_T => Mask::Bool(m.clone()),
        Kernels::CpuTuned => {
            // [B, 1, T, L] -> additive [B, 1, 1, T, L].
            let zero = Array::from_f32(0.0).as_dtype(dtype)?;
            let ninf = Array::from_f32(f32::NEG_INFINITY).as_dtype(dtype)?;
            let s = m.shape();
            let a = ops::select(m, &zero, &ninf)?.reshape(&[s[0], 1, 1, s[2], s[3]])?;
            Mask::Additive(a)
        }
    })
}

fn attention(
    kernels: Kernels,
    prefill: PrefillAttention,
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: &Mask,
) -> Result<Array> {
    let t = q.dim(2);
    if kernels == Kernels::Stock && prefill.composes(q) {
        let visible = match mask {
            Mask::Causal => Visible::Causal,
            Mask::Bool(m) => Visible::Bool(m),
            Mask::Additive(m) => Visible::Additive(m),
        };
        return composed_attention::attention(q, k, v, scale, visible);
    }
    Ok(match (kernels, mask) {
        (Kernels::CpuTuned, Mask::Additive(m)) => {
            // A single query of an unpadded fresh prefill needs no mask.
            let m = (t > 1 || m.ndim() != 2).then_some(m);
            cpu_kernels::attention(q, k, v, scale, m)?
        }
        (_, Mask::Causal) if t == 1 => {
            fast::scaled_dot_product_attention(q, k, v, scale, None, None)?
        }
        (_, Mask::Causal) => fast::scaled_dot_product_attention(
            q,
            k,
            v,
            scale,
            ScaledDotProductAttentionMask::Causal,
            None,
        )?,
        (_, Mask::Bool(m)) | (_, Mask::Additive(m)) => {
            fast::scaled_dot_product_attention(q, k, v, scale, m, None)?
        }
    })
}

/// Takes each row's last real position out of `[B, T, X]` hidden states.
pub fn last_positions(h: &Array, last: Option<&Array>) -> Result<Array> {
    let t = h.dim(1);
    match last {
        None if t > 1 => Ok(h.try_index((.., t - 1.., ..))?),
        None => Ok(h.clone()),
        Some(idx) => Ok(h.take_along_axis(idx, 1)?),
    }
}

pub(crate) fn storage_err(e: weft_kv_pool::storage::StorageError) -> ModelError {
    ModelError::Invalid(format!("KV storage: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gemma 3 270M: 18 layers, 5 local (512-token window) to 1 global.
    fn gemma3(dtype: Dtype) -> KvShape {
        let flags: Vec<bool> = (0..18).map(|i| i % 6 != 5).collect();
        KvShape {
            layers: 18,
            kv_heads: 1,
            head_dim: 256,
            dtype,
            sliding: SlidingLayers::from_flags(512, &flags).expect("flags"),
            quant: None,
            recurrent: None,
            stateless: 0,
        }
    }

    /// A quantized token costs its packed values plus a scale and a bias
    /// per group, in the storage dtype: mlx-lm's `QuantizedKVCache` layout.
    #[test]
    fn quantized_tokens_take_packed_bytes_plus_scales_and_biases() {
        let bf16 = gemma3(Dtype::Bfloat16);
        // 2 (K and V) x 1 head x 256 elements x 2 bytes.
        assert_eq!(bf16.bytes_per_layer_token(), 1024);
        let q4 = bf16.with_quant(Some(AffineQuant::new(4, 64)));
        // 2 x (256 / 2 bytes packed + 4 groups x (2 + 2) bytes).
        assert_eq!(q4.bytes_per_layer_token(), 2 * (128 + 16));
        let q8 = bf16.with_quant(Some(AffineQuant::new(8, 32)));
        assert_eq!(q8.bytes_per_layer_token(), 2 * (256 + 8 * 4));
        assert_eq!(q4.kv_dtype(), "q4g64/bfloat16");
        assert_eq!(bf16.kv_dtype(), "bfloat16");
        // The same budget holds more blocks.
        let budget = KvBudget::Bytes(64 << 20);
        let plain = KvSplit::plan(&bf16, 16, budget, None);
        let quant = KvSplit::plan(&q4, 16, budget, None);
        assert_eq!(plain.full, (64 << 20) / (1024 * 16 * 18));
        assert_eq!(quant.full, (64 << 20) / (288 * 16 * 18));
    }

    /// Without the paged kernel, decode reads a dense f32 pool in place (host
    /// attention) and gathers any other; a gathered quantized token costs its
    /// dequantized K/V plus the packed parts read before.
    #[test]
    fn decode_gathers_exactly_where_host_attention_cannot_read_the_pool() {
        let pool = |dtype, quant| {
            let shape = gemma3(dtype).with_quant(quant);
            PagedKv::new(shape, 16, KvMemory::Blocks(4), Kernels::Stock, false).expect("pool")
        };
        let q4 = Some(AffineQuant::new(4, 64));
        assert!(!pool(Dtype::Float32, None).decode_gathers());
        assert!(pool(Dtype::Float32, q4).decode_gathers());
        assert!(pool(Dtype::Bfloat16, None).decode_gathers());
        assert_eq!(
            pool(Dtype::Float32, None).gather_bytes_per_token(),
            2 * 256 * 4
        );
        // 2 x (256 / 2 packed bytes + 4 groups x 2 x 4 bytes) on top.
        assert_eq!(
            pool(Dtype::Float32, q4).gather_bytes_per_token(),
            2048 + 2 * (128 + 32)
        );
    }

    #[test]
    fn sliding_layers_get_only_what_their_windows_use() {
        let shape = gemma3(Dtype::Bfloat16);
        assert_eq!(shape.layer_counts(), (3, 15));
        let budget = 4u64 << 30;
        let equal = KvSplit::plan(&shape, 16, KvBudget::Bytes(budget), None);
        assert_eq!(equal.full, equal.sliding);
        assert_eq!(equal.full, budget / shape.bytes_per_token() / 16);

        let usage = KvUse {
            max_rows: 64,
            max_step_tokens: 2048 + 64,
        };
        let split = KvSplit::plan(&shape, 16, KvBudget::Bytes(budget), Some(usage));
        // 64 rows x (32 window blocks + 2) + ceil(2112 / 16) for a step's tokens.
        assert_eq!(split.sliding, 64 * 34 + 132);
        assert!(
            split.full > 5 * equal.full,
            "full group {} blocks against {} equal",
            split.full,
            equal.full
        );
        // Within the budget (null blocks included), and all of it used: one
        // more full-attention block would not fit.
        assert!(split.bytes(&shape, 16) <= budget);
        let more = KvSplit {
            full: split.full + 1,
            ..split
        };
        assert!(more.bytes(&shape, 16) > budget);

        // A budget the windows would fill anyway: equal counts.
        let small = KvSplit::plan(&shape, 16, KvBudget::Bytes(256 << 20), Some(usage));
        assert_eq!(small.full, small.sliding);
        // A block count is the full group's; the sliding group takes no more
        // than it can use.
        let blocks = KvSplit::plan(&shape, 16, KvBudget::Blocks(50_000), Some(usage));
        assert_eq!((blocks.full, blocks.sliding), (50_000, 64 * 34 + 132));
        let few = KvSplit::plan(&shape, 16, KvBudget::Blocks(100), Some(usage));
        assert_eq!((few.full, few.sliding), (100, 100));

        // No sliding layers: one group, sized as before.
        let dense = KvShape {
            sliding: None,
            ..shape
        };
        let d = KvSplit::plan(&dense, 16, KvBudget::Bytes(budget), Some(usage));
        assert_eq!(
            (d.full, d.sliding),
            (budget / dense.bytes_per_token() / 16, 0)
        );
    }
}
