//! Runs one engine step over rows that join, decode and leave independently.
//!
//! The KV lives in kv-pool's paged storage ([`PagedKv`]); the scheduler's pool
//! decides which blocks each row holds and hands the tables down with the
//! step ([`RowStep::blocks`]). So there is no batch cache to recompose: a row
//! joins or leaves by being in a step or not, and nothing is copied when it
//! does. A step's decoding rows run as one forward; prefilling rows (fresh
//! prompts, chunks of long ones, rows continuing after a prefix hit) are
//! grouped by length into right-padded forwards, spread over CPU lanes when
//! that pays.
//!
//! A step is a transaction with little to undo here: its K/V writes land in
//! slots past each row's committed length or in blocks the step allocated,
//! which the scheduler's rollback returns to the pool as dead data. Only the
//! scheduler's pool says what is committed. Recurrent layers replace their
//! rows' state in place, so each open step journals the rows it replaced
//! ([`PagedKv::state_begin`]); [`BatchRunner::rollback`] writes them back.

use std::collections::{HashMap, HashSet, VecDeque};

use mlx_rs::{Array, Dtype};
use weft_kv_pool::{KvGroups, RowBlocks, StorageOp};

use crate::error::{ModelError, Result};
use crate::kv::{KvMemory, KvStep, PagedKv};
use crate::lanes::{self, Lanes};
use crate::llama::LlamaModel;
use crate::lora::{AdapterId, AdapterPool, AdapterPoolConfig, LoraStep};
use crate::sampler::{self, Picked, SampleRow};

pub type RowId = u64;

/// One row's work in a step.
#[derive(Debug, Clone, Default)]
pub struct RowStep {
    pub row: RowId,
    /// A prefill chunk, or the token to decode followed by a draft.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`: the row's committed length.
    pub start_pos: usize,
    pub want_logits: bool,
    /// How many trailing `tokens` are a speculative draft (0: none). A row
    /// with a draft decodes `tokens[0]` and verifies the rest in the same
    /// forward; its logits come back for every position.
    pub draft: usize,
    /// The row's block table per KV group ([`PagedKv::groups`]), holding
    /// slots `start_pos .. start_pos + tokens.len()`.
    pub blocks: Vec<RowBlocks>,
    /// The LoRA adapter this row runs with (resident in the runner's
    /// [`AdapterPool`]; None: the base model).
    pub adapter: Option<AdapterId>,
    /// The row's recurrent-state slot (models with recurrent layers: every
    /// row has one; [`PagedKv::state_slots`] of them). A row at position 0
    /// starts from a zero state whatever its slot holds.
    pub state_slot: Option<u32>,
}

impl RowStep {
    fn decodes(&self) -> bool {
        self.start_pos > 0 && (self.tokens.len() == 1 || self.draft > 0)
    }
}

/// Logits of the rows that asked for them, in step order: the last position
/// of a row without a draft, every position of a row with one.
#[derive(Debug, Clone)]
pub struct StepLogits {
    pub rows: Vec<RowId>,
    /// Positions each of `rows` has in `data` (1 + its draft).
    pub counts: Vec<usize>,
    pub vocab: usize,
    /// `[sum(counts), vocab]`, row-major.
    pub data: Vec<f32>,
}

impl StepLogits {
    /// The `i`-th logits vector (the `i`-th row's when no row has a draft).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// Picked tokens of the rows that asked for logits, in step order, sampled
/// on the device ([`BatchRunner::forward_sampled`]).
#[derive(Debug, Clone)]
pub struct StepPicks {
    pub rows: Vec<RowId>,
    /// Positions each of `rows` has in `picked` (1 + its draft).
    pub counts: Vec<usize>,
    pub picked: Picked,
}

/// A step submitted and not yet collected: its picks are being computed.
struct Queued {
    rows: Vec<RowId>,
    counts: Vec<usize>,
    picks: Option<sampler::PendingPicks>,
    /// Submitted by [`BatchRunner::submit_unsampled`] and not sampled yet: its
    /// logits (None: no row wants any) wait for
    /// [`BatchRunner::submit_sampling`].
    unsampled: Option<Option<Array>>,
    /// Index in `picks.tokens` of each row's last pick (what a following step feeds).
    last: HashMap<RowId, usize>,
    build: std::time::Duration,
    encode: std::time::Duration,
}

/// A step between its forward (or submit) and `commit` / `rollback`.
struct OpenStep {
    /// Some until a submitted step is collected.
    queued: Option<Queued>,
}

/// The previous submitted step's picks, as the next step's decode inputs.
struct Follow<'a> {
    tokens: &'a Array,
    last: &'a HashMap<RowId, usize>,
    /// Per step row: whether its token is that step's pick.
    rows: &'a [bool],
}

/// A step's wanted logits on the device, with the arrays its evaluation must
/// also produce (the pool's updated storage).
struct Wanted {
    rows: Vec<RowId>,
    counts: Vec<usize>,
    /// `[sum(counts), vocab]`; None when no row wants logits.
    logits: Option<Array>,
    pending: Vec<Array>,
}

pub struct BatchRunner {
    model: std::rc::Rc<LlamaModel>,
    kv: PagedKv,
    /// The compiled form of plain decode steps, when on (see
    /// [`set_compiled_decode`](Self::set_compiled_decode)).
    compiled: Option<crate::compiled_decode::CompiledDecode>,
    /// The compiled prefill of prompt chunks, when on (see
    /// [`set_compiled_prefill`](Self::set_compiled_prefill)).
    compiled_prefill: Option<crate::compiled_prefill::CompiledPrefill>,
    /// The compiled forward of a chunk group beside decoding rows, when on
    /// (see [`set_compiled_mixed`](Self::set_compiled_mixed)).
    compiled_mixed: Option<crate::compiled_mixed::CompiledMixed>,
    /// Most prompt tokens a step runs as decoding rows of the compiled decode
    /// step (see [`set_short_chunks`](Self::set_short_chunks)); 0: none.
    short_chunks: usize,
    /// Rows the last step built ran its short chunks as (0: none).
    last_short: usize,
    /// The forwards of one step are queued one after the other without the
    /// host waiting for each (`WEFT_FORWARD_SYNC=async`, an experiment: whether
    /// MLX then still writes the pool in place is measured on a GPU, not
    /// known); by default each is evaluated before the next is built.
    async_between: bool,
    /// Called after each layer of each forward: fault injection in tests.
    layer_hook: Option<Box<dyn FnMut(usize) -> Result<()>>>,
    /// CPU streams a step's independent forwards are spread over.
    lanes: Lanes,
    /// Lanes the last `forward` built graphs on.
    lanes_used: usize,
    /// Steps forwarded or submitted and neither committed nor rolled back yet,
    /// oldest first (at most two, the second only when pipelined).
    open: VecDeque<OpenStep>,
    timing: StepTiming,
    /// Time the last step built waited on the device for its own earlier
    /// forwards (see [`last_submit_blocked`](Self::last_submit_blocked)).
    submit_blocked: std::time::Duration,
    /// Whether the last step built traced a compiled form first.
    build_traced: bool,
    /// Whether the next sampled step records its graph's census.
    census_next: bool,
    census: Option<std::collections::BTreeMap<String, usize>>,
    /// The LoRA adapters rows may run with, when set up.
    adapters: Option<AdapterPool>,
    /// Registered adapters' files in host memory: a row may name any of
    /// them, and each forward makes its rows' adapters resident from here.
    adapter_files: std::collections::BTreeMap<AdapterId, crate::adapter::AdapterFiles>,
}

/// Where the last forward's wall time went: building the graph on the host
/// (everything before the evaluation was requested), MLX encoding it (the
/// host dispatching its kernels to the device; part of `build` for a
/// submitted step) and waiting for the evaluation (device work not
/// overlapped by the host, plus transfers).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTiming {
    pub build: std::time::Duration,
    pub encode: std::time::Duration,
    pub eval: std::time::Duration,
}

/// Tokens per KV block unless configured otherwise.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

impl BatchRunner {
    /// A runner; plain decode steps run compiled where decode attention runs
    /// the paged GPU kernel and the KV is one full-attention group, unless
    /// `WEFT_COMPILE=off`.
    pub fn new(model: LlamaModel, kv: PagedKv) -> Self {
        let model = std::rc::Rc::new(model);
        let compiled = (kv.uses_kernel() && kv.compilable() && compile_from_env()).then(|| {
            crate::compiled_decode::CompiledDecode::new(
                model.clone(),
                &kv,
                fused_kernels(),
                compiled_min_width(&kv),
                None,
            )
        });
        let compiled_prefill = (kv.uses_kernel()
            && kv.compilable()
            && compile_from_env()
            && compile_prefill_from_env())
        .then(|| crate::compiled_prefill::CompiledPrefill::new(model.clone(), &kv));
        let mixed = mixed_from_env();
        let compiled_mixed = (compiled.is_some()
            && compiled_prefill.is_some()
            && mixed != MixedSteps::Off)
            .then(|| {
                crate::compiled_mixed::CompiledMixed::new(
                    model.clone(),
                    &kv,
                    fused_kernels(),
                    compiled_min_width(&kv),
                )
                .trace_on_demand(mixed == MixedSteps::OnDemand)
            });
        let short_chunks = if compiled.is_some() {
            short_chunks_from_env()
        } else {
            0
        };
        Self {
            model,
            kv,
            compiled,
            compiled_prefill,
            compiled_mixed,
            short_chunks,
            last_short: 0,
            async_between: std::env::var("WEFT_FORWARD_SYNC").is_ok_and(|v| v == "async"),
            layer_hook: None,
            lanes: Lanes::single(),
            lanes_used: 0,
            open: VecDeque::new(),
            timing: StepTiming::default(),
            submit_blocked: std::time::Duration::ZERO,
            build_traced: false,
            census_next: false,
            census: None,
            adapters: None,
            adapter_files: Default::default(),
        }
    }

    /// Sets up (or, with None, removes) the pool of LoRA adapters rows may
    /// run with ([`RowStep::adapter`]); a new pool is empty. Refused while a
    /// step is open. Compiled decode steps (when on) are rebuilt for the
    /// pool's layout: its arrays are their inputs.
    pub fn set_adapter_pool(&mut self, config: Option<AdapterPoolConfig>) -> Result<()> {
        if !self.open.is_empty() {
            return Err(ModelError::Invalid(
                "adapter pool changed inside an open step".into(),
            ));
        }
        self.adapters = match config {
            Some(c) => Some(AdapterPool::new(
                &self.model.config,
                self.model.policy.dtype,
                c,
            )?),
            None => None,
        };
        if self.compiled.is_some() {
            self.compiled = Some(self.new_compiled());
        }
        Ok(())
    }

    /// Makes `adapter` resident as `id` (see [`AdapterPool::insert`]);
    /// returns its slot. Refused while a step is open or without a pool.
    pub fn load_adapter(
        &mut self,
        id: AdapterId,
        adapter: &crate::adapter::Adapter,
    ) -> Result<u32> {
        if !self.open.is_empty() {
            return Err(ModelError::Invalid(
                "adapter loaded inside an open step".into(),
            ));
        }
        self.adapters
            .as_mut()
            .ok_or_else(|| ModelError::Invalid("no adapter pool set up".into()))?
            .insert(id, adapter)
    }

    /// Registers an adapter rows may name as `id`: its files stay in host
    /// memory and it becomes resident in the pool when a forward's row names
    /// it, evicting the least recently used adapter that forward does not
    /// need when every slot is taken (see [`AdapterPool::make_resident`]).
    /// Checked now against the model and the pool (an error names the
    /// tensor, or the rank or projection the pool lacks); returns the parsed
    /// adapter (what it is: rank, scale, targets). Refused for an `id`
    /// registered already, or without a pool.
    pub fn register_adapter(
        &mut self,
        id: AdapterId,
        files: crate::adapter::AdapterFiles,
    ) -> Result<crate::adapter::Adapter> {
        let pool = self
            .adapters
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("no adapter pool set up".into()))?;
        if self.adapter_files.contains_key(&id) {
            return Err(ModelError::Invalid(format!(
                "adapter {} is registered already",
                id.0
            )));
        }
        let adapter = files.parse(&self.model.config)?;
        pool.check(&files.dir.display().to_string(), &adapter)?;
        self.adapter_files.insert(id, files);
        Ok(adapter)
    }

    /// Forgets a registered adapter: its host files go, and its slot when it
    /// is resident. Returns whether it was registered. Rows must no longer
    /// name it; a step already built keeps the arrays it was built with.
    pub fn forget_adapter(&mut self, id: AdapterId) -> Result<bool> {
        let known = self.adapter_files.remove(&id).is_some();
        if let Some(p) = self.adapters.as_mut() {
            p.remove(id)?;
        }
        Ok(known)
    }

    /// What the adapter pool has loaded and evicted (zeros without a pool).
    pub fn adapter_counters(&self) -> crate::lora::AdapterCounters {
        self.adapters
            .as_ref()
            .map(AdapterPool::counters)
            .unwrap_or_default()
    }

    /// Host bytes of the registered adapters' files.
    pub fn adapter_host_bytes(&self) -> u64 {
        self.adapter_files.values().map(|f| f.bytes()).sum()
    }

    /// Makes the registered adapters `ids` resident now (at most the
    /// pool's slots), e.g. before serving.
    pub fn preload_adapters(&mut self, ids: &[AdapterId]) -> Result<()> {
        let ids: std::collections::BTreeSet<AdapterId> = ids.iter().copied().collect();
        self.make_resident(&ids)
    }

    fn make_resident(&mut self, ids: &std::collections::BTreeSet<AdapterId>) -> Result<()> {
        let Some(pool) = self.adapters.as_mut() else {
            return Ok(());
        };
        let files = &self.adapter_files;
        let base = &self.model.config;
        pool.make_resident(ids, &mut |id| {
            files
                .get(&id)
                .ok_or_else(|| ModelError::Invalid(format!("adapter {} is not registered", id.0)))?
                .parse(base)
        })
    }

    /// Frees `id`'s slot; returns whether it was resident. Refused while a
    /// step is open.
    pub fn unload_adapter(&mut self, id: AdapterId) -> Result<bool> {
        if !self.open.is_empty() {
            return Err(ModelError::Invalid(
                "adapter unloaded inside an open step".into(),
            ));
        }
        match self.adapters.as_mut() {
            Some(p) => p.remove(id),
            None => Ok(false),
        }
    }

    /// The adapter pool, when set up.
    pub fn adapters(&self) -> Option<&AdapterPool> {
        self.adapters.as_ref()
    }

    fn new_compiled(&self) -> crate::compiled_decode::CompiledDecode {
        crate::compiled_decode::CompiledDecode::new(
            self.model.clone(),
            &self.kv,
            fused_kernels(),
            compiled_min_width(&self.kv),
            self.adapters.as_ref().map(AdapterPool::layout),
        )
    }

    /// A runner whose KV storage takes `memory` in `block_size`-token blocks,
    /// with Weft's paged decode kernel when MLX runs on a CUDA GPU.
    pub fn with_memory(model: LlamaModel, block_size: u32, memory: KvMemory) -> Result<Self> {
        Self::with_memory_use(model, block_size, memory, None, None)
    }

    /// [`Self::with_memory`], with a sliding-window group sized by how the
    /// server uses the pool ([`PagedKv::with_use`]) and K/V stored
    /// quantized when `quant` says.
    pub fn with_memory_use(
        model: LlamaModel,
        block_size: u32,
        memory: KvMemory,
        usage: Option<crate::kv::KvUse>,
        quant: Option<weft_kv_pool::storage::AffineQuant>,
    ) -> Result<Self> {
        let kv = PagedKv::with_use(
            model.kv_shape().with_quant(quant),
            block_size,
            memory,
            usage,
            model.policy.kernels,
            crate::loader::cuda_available(),
        )?;
        Ok(Self::new(model, kv))
    }

    /// Spreads each step's independent forwards over these lanes (see
    /// [`Lanes`]); a runner starts with one.
    pub fn set_lanes(&mut self, lanes: Lanes) {
        self.lanes = lanes;
    }

    /// Turns compiled decode steps on or off. On, every step whose rows all
    /// decode one token (no drafts, no prefill) runs the traced forward of
    /// [`crate::compiled_decode`]; on the CPU its attention gathers each
    /// row's blocks (the default CPU path is not compiled). Refused while a
    /// step is open, and for models whose linears run on the host GEMM.
    pub fn set_compiled_decode(&mut self, on: bool) -> Result<()> {
        if !self.open.is_empty() {
            return Err(ModelError::Invalid(
                "compiled decode switched inside an open step".into(),
            ));
        }
        if on && self.model.policy.host_gemm {
            return Err(ModelError::Invalid(
                "compiled decode needs MLX linears (the packed host GEMM cannot be traced)".into(),
            ));
        }
        if on && !self.kv.compilable() {
            return Err(ModelError::Invalid(
                "compiled decode needs one full-attention KV group and no recurrent layers \
                 (this model has sliding-window or recurrent layers)"
                    .into(),
            ));
        }
        self.compiled = on.then(|| self.new_compiled());
        Ok(())
    }

    /// Turns the compiled prefill on or off ([`crate::compiled_prefill`]):
    /// on, a prefill group whose rows have no adapter and fit its buckets
    /// runs a traced forward. Refused while a step is open, or where decode steps
    /// could not compile either.
    pub fn set_compiled_prefill(&mut self, on: bool) -> Result<()> {
        if !self.open.is_empty() {
            return Err(ModelError::Invalid(
                "compiled prefill switched inside an open step".into(),
            ));
        }
        if on && !self.kv.compilable() {
            return Err(ModelError::Invalid(
                "compiled prefill needs one full-attention KV group and no recurrent layers".into(),
            ));
        }
        self.compiled_prefill =
            on.then(|| crate::compiled_prefill::CompiledPrefill::new(self.model.clone(), &self.kv));
        Ok(())
    }

    /// Sets how compiled mixed steps run ([`crate::compiled_mixed`],
    /// [`MixedSteps`]): a step whose prefill is one group the compiled
    /// prefill would run, beside decoding rows the compiled decode would run
    /// (no adapters, no drafts), runs as one traced forward instead of two.
    /// It takes effect only while both of those are on. On a GPU the default
    /// is `WEFT_MIXED`'s ([`MixedSteps::Warmed`] unless it says `off` or
    /// `lazy`). Refused while a step is open.
    pub fn set_compiled_mixed(&mut self, mode: MixedSteps) -> Result<()> {
        let on = mode != MixedSteps::Off;
        if !self.open.is_empty() {
            return Err(ModelError::Invalid(
                "compiled mixed steps switched inside an open step".into(),
            ));
        }
        if on && (self.model.policy.host_gemm || !self.kv.compilable()) {
            return Err(ModelError::Invalid(
                "compiled mixed steps need what compiled decode and prefill need: MLX linears, \
                 one full-attention KV group and no recurrent layers"
                    .into(),
            ));
        }
        self.compiled_mixed = on.then(|| {
            crate::compiled_mixed::CompiledMixed::new(
                self.model.clone(),
                &self.kv,
                fused_kernels(),
                compiled_min_width(&self.kv),
            )
            .trace_on_demand(mode == MixedSteps::OnDemand)
        });
        Ok(())
    }

    /// Sets the most prompt tokens a step runs as decoding rows (0: none).
    /// Where decode steps compile, a step whose prompt chunks are short (at
    /// most `tokens` in all, each over little context, no adapter) and whose
    /// decoding rows are plain runs as one compiled decode step: each chunk
    /// token one row at its own position over its chunk's table, so the
    /// paged attention of a token reads the chunk's earlier tokens (written
    /// by the same layer's K/V write before it) and the context before them
    /// — the causal prefill, as decode rows. Only the chunk's last token's
    /// logits come back. Such a step is the decode step's kernels and
    /// dispatch (a short prompt joining 48 decoding rows took one ~10 ms
    /// compiled mixed forward on an H100, 7.7 ms of it MLX's dispatch),
    /// and needs no trace of its own: it runs only where its decode bucket
    /// is traced already. The default is `WEFT_SHORT_CHUNKS`' (tokens;
    /// [`SHORT_CHUNK_TOKENS`] unless it says otherwise) where decode steps
    /// compile, else 0.
    /// Refused while a step is open.
    pub fn set_short_chunks(&mut self, tokens: usize) -> Result<()> {
        if !self.open.is_empty() {
            return Err(ModelError::Invalid(
                "short chunks switched inside an open step".into(),
            ));
        }
        self.short_chunks = tokens;
        Ok(())
    }

    /// The most prompt tokens a step runs as decoding rows (0: none; see
    /// [`set_short_chunks`](Self::set_short_chunks)).
    pub fn short_chunks(&self) -> usize {
        if self.compiled.is_some() {
            self.short_chunks
        } else {
            0
        }
    }

    /// How many decoding rows the last step built ran its prompt chunks as
    /// ([`set_short_chunks`](Self::set_short_chunks); 0: none, its chunks
    /// ran as prefill forwards or it had none).
    pub fn last_short_chunk_rows(&self) -> usize {
        self.last_short
    }

    /// The rows a step's prompt chunks run as where they are short
    /// ([`set_short_chunks`](Self::set_short_chunks)): each chunk token one
    /// row, the last carrying the chunk's row id and logits wish (the others
    /// [`RowId::MAX`], no logits). Empty where the step does not qualify:
    /// no chunk, or one past the limits, with an adapter, a draft or a
    /// table the compiled decode cannot read, or a decoding row it cannot
    /// run, or a decode bucket not traced yet.
    fn short_chunk_rows(&self, steps: &[RowStep]) -> Vec<RowStep> {
        let Some(c) = self.compiled.as_ref() else {
            return Vec::new();
        };
        if self.short_chunks == 0 {
            return Vec::new();
        }
        let plain_table = |s: &RowStep| s.blocks.len() == 1 && s.blocks[0].offset == 0;
        let (mut decoding, mut tokens, mut keys) = (0usize, 0usize, 0usize);
        for s in steps {
            if s.decodes() {
                if s.draft > 0 || !plain_table(s) {
                    return Vec::new();
                }
                decoding += 1;
                continue;
            }
            if s.draft > 0 || s.adapter.is_some() || s.state_slot.is_some() || !plain_table(s) {
                return Vec::new();
            }
            let n = s.tokens.len();
            tokens += n;
            // Keys the chunk's rows read: position + 1 each (the scheduler's cost
            // model applies the same limits: `weft_scheduler::step_cost::ShortPrompts`).
            keys += n * (s.start_pos + 1) + n * (n - 1) / 2;
        }
        if tokens == 0 || tokens > self.short_chunks || keys > SHORT_CHUNK_KEYS {
            return Vec::new();
        }
        let rows = self.padded_rows(decoding + tokens);
        // Each row's last position (a chunk's last token's is its deepest).
        let starts = steps.iter().map(|s| {
            if s.decodes() {
                s.start_pos
            } else {
                s.start_pos + s.tokens.len() - 1
            }
        });
        let bucket = (rows as i32, c.width_of(starts) as i32);
        if !c.buckets().contains(&bucket) {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(tokens);
        for s in steps.iter().filter(|s| !s.decodes()) {
            let n = s.tokens.len();
            for (i, &t) in s.tokens.iter().enumerate() {
                let last = i + 1 == n;
                out.push(RowStep {
                    row: if last { s.row } else { RowId::MAX },
                    tokens: vec![t],
                    start_pos: s.start_pos + i,
                    want_logits: last && s.want_logits,
                    draft: 0,
                    blocks: s.blocks.clone(),
                    adapter: None,
                    state_slot: None,
                });
            }
        }
        out
    }

    /// Traces the compiled mixed buckets up front (rows reading and writing
    /// only the null block): decoding batches of up to `max_rows` rows
    /// padded to each decode bucket up to [`mixed_warm_rows`] (8 unless
    /// `WEFT_MIXED_WARM_ROWS` says more; every batch of up to 8 shares one)
    /// beside one chunk of every compiled length over tables up to `context`
    /// tokens, decoding rows' tables padded to `context` (rows up to that deep
    /// add no shape); where decode batches are bucketed (the GPU), every
    /// wider bucket up to `max_rows` beside a short fresh prompt of each
    /// compiled length up to [`mixed_wide_tokens`] (128 unless
    /// `WEFT_MIXED_WIDE_TOKENS` says otherwise; 0: none). Steps of other
    /// shapes run as two forwards unless the mixed step traces on demand.
    /// Returns how many it traced (0 where mixed steps are off). Refused
    /// while a step is open.
    pub fn warm_mixed(&mut self, max_rows: usize, context: usize) -> Result<usize> {
        if !self.open.is_empty() {
            return Err(ModelError::Invalid(
                "mixed buckets warmed inside an open step".into(),
            ));
        }
        let top = max_rows.min(mixed_warm_rows()).max(1);
        let rows: Vec<usize> = (1..=top).map(|r| self.padded_rows(r)).collect();
        let wide: std::collections::BTreeSet<usize> = if self.kv.uses_kernel() {
            (top + 1..=max_rows).map(|r| self.padded_rows(r)).collect()
        } else {
            Default::default()
        };
        let Some(c) = self.compiled_mixed.as_mut() else {
            return Ok(0);
        };
        c.cover_decode(context);
        let mut buckets = c.warm_buckets(rows.into_iter(), context);
        buckets.extend(c.fresh_buckets(wide.into_iter(), mixed_wide_tokens()));
        let mut traced = 0;
        for bucket in buckets {
            traced += usize::from(c.warm(&self.kv, bucket)?);
        }
        Ok(traced)
    }

    /// The compiled mixed step, when on: its trace count and buckets.
    pub fn compiled_mixed(&self) -> Option<&crate::compiled_mixed::CompiledMixed> {
        self.compiled_mixed.as_ref()
    }

    /// Traces the compiled prefill buckets up front (rows reading and writing
    /// only the null block): every fresh one, and one row's chunks over tables
    /// up to `context` tokens (wider ones trace on first use), so few requests
    /// pay a trace while serving. Returns how
    /// many buckets it traced (0 where prefill is not compiled). Refused
    /// while a step is open.
    pub fn warm_prefill(&mut self, context: usize) -> Result<usize> {
        if !self.open.is_empty() {
            return Err(ModelError::Invalid(
                "prefill buckets warmed inside an open step".into(),
            ));
        }
        let Some(c) = self.compiled_prefill.as_mut() else {
            return Ok(0);
        };
        let bs = self.kv.block_size() as usize;
        let mut traced = 0;
        for bucket in crate::compiled_prefill::CompiledPrefill::warm_buckets(context, bs) {
            traced += usize::from(c.warm(&self.kv, bucket)?);
        }
        Ok(traced)
    }

    /// The compiled prefill, when on: its trace count and buckets.
    pub fn compiled_prefill(&self) -> Option<&crate::compiled_prefill::CompiledPrefill> {
        self.compiled_prefill.as_ref()
    }

    /// Rows a decode batch of `n` rows is padded to (GPU buckets, see
    /// [`decode_bucket`]; the CPU runs the batch as it is).
    /// The most rows a decode step of a batch of up to `max_rows` rows runs:
    /// the batch, padded to its bucket, or with a step's short chunks beside
    /// it ([`set_short_chunks`](Self::set_short_chunks)) that many more (each
    /// a row of the step's logits).
    pub fn largest_decode_rows(&self, max_rows: usize) -> usize {
        self.padded_rows(max_rows + self.short_chunks())
    }

    fn padded_rows(&self, n: usize) -> usize {
        if self.kv.uses_kernel() {
            decode_bucket(n)
        } else {
            n
        }
    }

    /// Traces every compiled decode bucket a batch of up to `max_rows` rows
    /// meets while its rows hold up to `context` tokens (each row count the
    /// batch is padded to, at every table width from the narrowest up to
    /// `context`'s), so no request pays a trace while serving; the batch's
    /// rows plus a step's short chunks' ([`set_short_chunks`](Self::set_short_chunks)) rows, which
    /// run only in traced buckets. Returns how
    /// many buckets it traced (0 where decode steps are not compiled).
    /// Refused while a step is open.
    pub fn warm_decode(&mut self, max_rows: usize, context: usize) -> Result<usize> {
        if !self.open.is_empty() {
            return Err(ModelError::Invalid(
                "decode buckets warmed inside an open step".into(),
            ));
        }
        // A step's short chunks run as more decoding rows beside the batch.
        let top = max_rows + self.short_chunks;
        let sizes: std::collections::BTreeSet<usize> =
            (1..=top).map(|n| self.padded_rows(n)).collect();
        let bs = self.kv.block_size() as usize;
        let Some(c) = self.compiled.as_mut() else {
            return Ok(0);
        };
        // A row holding `context` tokens has written position `context - 1`.
        let top = context.max(1).div_ceil(bs.max(1)).next_power_of_two();
        let mut traced = 0;
        for rows in sizes {
            let mut width = c.min_width();
            while width <= top.max(c.min_width()) {
                traced += usize::from(c.warm(&self.kv, rows, width)?);
                width *= 2;
            }
        }
        Ok(traced)
    }

    /// The compiled decode steps, when on: their trace count and buckets.
    pub fn compiled_decode(&self) -> Option<&crate::compiled_decode::CompiledDecode> {
        self.compiled.as_ref()
    }

    /// Makes the next sampled step (`forward_sampled` or `submit_sampled`)
    /// count its graph's primitives ([`crate::graph_census`]) before it is
    /// evaluated; [`take_census`](Self::take_census) returns the count.
    pub fn census_next_step(&mut self) {
        self.census_next = true;
    }

    /// The census the last requested step recorded.
    pub fn take_census(&mut self) -> Option<std::collections::BTreeMap<String, usize>> {
        self.census.take()
    }

    fn record_census(&mut self, pending: &[Array]) -> Result<()> {
        if std::mem::take(&mut self.census_next) {
            self.census = Some(crate::graph_census::census(pending)?);
        }
        Ok(())
    }

    /// Whether the last step built (submitted or forwarded) traced a compiled
    /// form of one of its forwards for the first time (MLX then also builds
    /// its kernels at the first run): its time is not what its shape costs.
    pub fn last_build_traced(&self) -> bool {
        self.build_traced
    }

    /// How long the last step built ([`submit_sampled`](Self::submit_sampled),
    /// [`submit_unsampled`](Self::submit_unsampled), or a forward) waited for
    /// the device to finish forwards of its own step: a step of several
    /// forwards (prompt chunks beside decoding rows on the GPU) evaluates each
    /// but the last before building the next, inside the submit. The wait for the step
    /// queued before it comes first and is not counted, so a pipelined
    /// scheduler can charge this to the submitted step rather than to the
    /// period of the step it queued behind. Zero for a one-forward step.
    pub fn last_submit_blocked(&self) -> std::time::Duration {
        self.submit_blocked
    }

    /// Build and evaluation time of the last forward.
    pub fn last_timing(&self) -> StepTiming {
        self.timing
    }

    /// How many lanes the last step ran on (1 unless it was split).
    pub fn lanes_used(&self) -> usize {
        self.lanes_used
    }

    pub fn model(&self) -> &LlamaModel {
        &self.model
    }

    /// The KV storage.
    pub fn kv(&self) -> &PagedKv {
        &self.kv
    }

    /// The block layout the scheduler's pool must mirror.
    pub fn kv_groups(&self) -> &KvGroups {
        self.kv.groups()
    }

    pub fn set_layer_hook(&mut self, hook: Option<Box<dyn FnMut(usize) -> Result<()>>>) {
        self.layer_hook = hook;
    }

    /// Runs one step: `ops` (the step's copy-on-write copies) first, then every
    /// row's tokens, their K/V written where their tables say. On error the
    /// step is closed again before returning.
    pub fn forward(&mut self, ops: &[StorageOp], steps: &[RowStep]) -> Result<StepLogits> {
        self.guarded(|r| {
            let t0 = std::time::Instant::now();
            let w = r.forward_wanted(ops, steps, None)?;
            let mut pending = w.pending;
            let logits = match w.logits {
                Some(l) => Some(l.as_dtype(Dtype::Float32)?),
                None => None,
            };
            pending.extend(logits.iter().cloned());
            let t1 = std::time::Instant::now();
            mlx_rs::transforms::eval(pending.iter())?;
            r.timing = StepTiming {
                build: t1 - t0,
                encode: std::time::Duration::ZERO,
                eval: t1.elapsed(),
            };
            drop(pending);
            let data = logits.map_or_else(Vec::new, |p| p.as_slice::<f32>().to_vec());
            Ok(StepLogits {
                rows: w.rows,
                counts: w.counts,
                vocab: r.model.config.vocab_size as usize,
                data,
            })
        })
    }

    /// Runs one step like [`forward`](Self::forward) and samples the wanted
    /// positions on the device: `sampling` has one entry per row with
    /// `want_logits`, in step order, covering its `1 + draft` positions. One
    /// evaluation produces the pool's writes and the picks; only the picked
    /// ids (and requested logprobs) are transferred.
    pub fn forward_sampled(
        &mut self,
        ops: &[StorageOp],
        steps: &[RowStep],
        sampling: &[SampleRow],
    ) -> Result<StepPicks> {
        self.guarded(|r| {
            let t0 = std::time::Instant::now();
            let (w, picks) = r.sampled_graph(ops, steps, sampling, None)?;
            let mut pending = w.pending;
            pending.extend(picks.iter().flat_map(|p| p.arrays()));
            r.record_census(&pending)?;
            let t1 = std::time::Instant::now();
            mlx_rs::transforms::async_eval(pending.iter())?;
            let t2 = std::time::Instant::now();
            mlx_rs::transforms::eval(pending.iter())?;
            drop(pending);
            let picked = match picks {
                Some(p) => p.read()?,
                None => Picked::default(),
            };
            r.timing = StepTiming {
                build: t1 - t0,
                encode: t2 - t1,
                eval: t2.elapsed(),
            };
            Ok(StepPicks {
                rows: w.rows,
                counts: w.counts,
                picked,
            })
        })
    }

    /// Queues a step like [`forward_sampled`](Self::forward_sampled) without
    /// waiting for it: its graph is built and handed to the device, and
    /// [`collect`](Self::collect) reads its picks later. At most two steps are
    /// open; a step submitted while another is outstanding may feed that one's
    /// picks as inputs: rows with `follows[i]` (`follows` empty: none) decode
    /// the token the previous step picks at their last position, whatever
    /// `tokens[0]` says. A failed submit is still open: roll it back.
    pub fn submit_sampled(
        &mut self,
        ops: &[StorageOp],
        steps: &[RowStep],
        sampling: &[SampleRow],
        follows: &[bool],
    ) -> Result<()> {
        self.submit_step(ops, steps, Some(sampling), follows)
    }

    /// Queues a step like [`submit_sampled`](Self::submit_sampled) up to its
    /// logits, without sampling them: [`submit_sampling`](Self::submit_sampling)
    /// must follow before another step is submitted or this one collected. The
    /// device computes the forward meanwhile, while the host works out how to
    /// sample it (penalty counts or constraint masks that depend on the step
    /// before, which it reads in between).
    pub fn submit_unsampled(
        &mut self,
        ops: &[StorageOp],
        steps: &[RowStep],
        follows: &[bool],
    ) -> Result<()> {
        self.submit_step(ops, steps, None, follows)
    }

    /// Queues the sampling of the step [`submit_unsampled`](Self::submit_unsampled)
    /// queued, as [`submit_sampled`](Self::submit_sampled) would have sampled it.
    /// On error the step stays open, unsampled: roll it back.
    pub fn submit_sampling(&mut self, sampling: &[SampleRow]) -> Result<()> {
        let t0 = std::time::Instant::now();
        let q = self
            .open
            .back_mut()
            .and_then(|o| o.queued.as_mut())
            .filter(|q| q.unsampled.is_some())
            .ok_or_else(|| ModelError::Invalid("sampling without an unsampled step".into()))?;
        check_sampling(sampling, &q.rows, &q.counts)?;
        let picks = match q.unsampled.as_ref().and_then(Option::as_ref) {
            Some(l) => Some(sampler::sample(l, sampling)?),
            None => None,
        };
        let pending: Vec<Array> = picks.iter().flat_map(|p| p.arrays()).collect();
        let t1 = std::time::Instant::now();
        mlx_rs::transforms::async_eval(pending.iter())?;
        q.encode += t1.elapsed();
        q.build += t0.elapsed();
        q.picks = picks;
        q.unsampled = None;
        Ok(())
    }

    fn submit_step(
        &mut self,
        ops: &[StorageOp],
        steps: &[RowStep],
        sampling: Option<&[SampleRow]>,
        follows: &[bool],
    ) -> Result<()> {
        let t0 = std::time::Instant::now();
        let refused = if self.open.len() >= 2 {
            Some("a third step submitted")
        } else if self
            .open
            .back()
            .is_some_and(|o| o.queued.as_ref().is_none_or(|q| q.unsampled.is_some()))
        {
            Some("submit after a step that is already read but not committed, or not sampled yet")
        } else {
            None
        };
        if let Some(why) = refused {
            // Open all the same: every submit is one step to commit or roll back.
            self.kv.state_begin();
            self.open.push_back(OpenStep { queued: None });
            return Err(ModelError::Invalid(why.into()));
        }
        let built = {
            let prev = self
                .open
                .back()
                .and_then(|o| o.queued.as_ref())
                .and_then(|q| q.picks.as_ref().map(|p| (&p.tokens, &q.last)));
            let follow = match (follows.iter().any(|&f| f), prev) {
                (false, _) => None,
                (true, Some((tokens, last))) => Some(Follow {
                    tokens,
                    last,
                    rows: follows,
                }),
                (true, None) => {
                    return Err(ModelError::Invalid(
                        "rows follow a step that picked nothing".into(),
                    ))
                }
            };
            // Borrows of the previous step end with the graph: clone what it holds.
            let follow = follow.map(|f| (f.tokens.clone(), f.last.clone(), f.rows.to_vec()));
            let f = follow
                .as_ref()
                .map(|(tokens, last, rows)| Follow { tokens, last, rows });
            match sampling {
                Some(sampling) => self.sampled_graph(ops, steps, sampling, f),
                None => self.forward_wanted(ops, steps, f).map(|w| (w, None)),
            }
        };
        self.open.push_back(OpenStep { queued: None });
        let (mut w, picks) = built?;
        let unsampled = sampling.is_none().then(|| w.logits.take());
        let mut pending = w.pending;
        pending.extend(picks.iter().flat_map(|p| p.arrays()));
        pending.extend(unsampled.iter().flatten().cloned());
        self.record_census(&pending)?;
        let t1 = std::time::Instant::now();
        mlx_rs::transforms::async_eval(pending.iter())?;
        let encode = t1.elapsed();
        let mut last = HashMap::with_capacity(w.rows.len());
        let mut at = 0;
        for (&row, &n) in w.rows.iter().zip(&w.counts) {
            at += n;
            last.insert(row, at - 1);
        }
        if let Some(o) = self.open.back_mut() {
            o.queued = Some(Queued {
                rows: w.rows,
                counts: w.counts,
                picks,
                unsampled,
                last,
                build: t0.elapsed(),
                encode,
            });
        }
        Ok(())
    }

    /// Waits for the oldest submitted step and reads its picks; it stays open
    /// until [`commit`](Self::commit) or [`rollback`](Self::rollback).
    pub fn collect(&mut self) -> Result<StepPicks> {
        let q = self
            .open
            .iter_mut()
            .find_map(|o| o.queued.take_if(|q| q.unsampled.is_none()))
            .ok_or_else(|| {
                ModelError::Invalid("collect without a submitted, sampled step".into())
            })?;
        let t1 = std::time::Instant::now();
        let picked = match q.picks {
            Some(p) => {
                mlx_rs::transforms::eval(p.arrays().iter())?;
                p.read()?
            }
            None => Picked::default(),
        };
        self.timing = StepTiming {
            build: q.build,
            encode: q.encode,
            eval: t1.elapsed(),
        };
        Ok(StepPicks {
            rows: q.rows,
            counts: q.counts,
            picked,
        })
    }

    /// The graph of a sampled step: its forward and the sampler over its logits.
    fn sampled_graph(
        &mut self,
        ops: &[StorageOp],
        steps: &[RowStep],
        sampling: &[SampleRow],
        follow: Option<Follow<'_>>,
    ) -> Result<(Wanted, Option<sampler::PendingPicks>)> {
        let w = self.forward_wanted(ops, steps, follow)?;
        check_sampling(sampling, &w.rows, &w.counts)?;
        let picks = match &w.logits {
            Some(l) => Some(sampler::sample(l, sampling)?),
            None => None,
        };
        Ok((w, picks))
    }

    /// Runs `f` as the step's forward: refused inside an open step; on error
    /// the step is closed again.
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if !self.open.is_empty() {
            return Err(ModelError::Invalid(
                "forward called inside an open step".into(),
            ));
        }
        let result = f(self);
        if result.is_ok() {
            self.open.push_back(OpenStep { queued: None });
        } else {
            self.close_state_steps();
        }
        result
    }

    /// Rolls back state journals no open step owns (a forward that failed
    /// after writing some layers' state).
    fn close_state_steps(&mut self) {
        while self.kv.state_open() > self.open.len() {
            if let Err(e) = self.kv.state_rollback() {
                tracing::error!(error = %e, "rolling back a failed step's recurrent state failed");
                break;
            }
        }
    }

    fn forward_wanted(
        &mut self,
        ops: &[StorageOp],
        steps: &[RowStep],
        follow: Option<Follow<'_>>,
    ) -> Result<Wanted> {
        self.submit_blocked = std::time::Duration::ZERO;
        let traces = self.traces();
        let w = self.build_wanted(ops, steps, follow);
        // A failed build may have traced too; the flag is read after successes.
        self.build_traced = self.traces() > traces;
        w
    }

    /// This runner's compiled forms' traces so far.
    fn traces(&self) -> u64 {
        self.compiled.as_ref().map_or(0, |c| c.traces())
            + self.compiled_prefill.as_ref().map_or(0, |c| c.traces())
            + self.compiled_mixed.as_ref().map_or(0, |c| c.traces())
    }

    fn build_wanted(
        &mut self,
        ops: &[StorageOp],
        steps: &[RowStep],
        follow: Option<Follow<'_>>,
    ) -> Result<Wanted> {
        // Every step gets a state journal, closed by commit or rollback.
        self.kv.state_begin();
        let groups_needed = self.kv.groups().groups.len();
        let ids: std::collections::BTreeSet<AdapterId> =
            steps.iter().filter_map(|s| s.adapter).collect();
        if !ids.is_empty() {
            self.make_resident(&ids)?;
        }
        let mut seen = HashSet::new();
        for s in steps {
            if !seen.insert(s.row) {
                return Err(ModelError::Invalid(format!(
                    "row {} appears twice in one step",
                    s.row
                )));
            }
            if s.tokens.is_empty() {
                return Err(ModelError::Invalid(format!("row {} has no tokens", s.row)));
            }
            if s.draft > 0 && (s.draft + 1 != s.tokens.len() || s.start_pos == 0) {
                return Err(ModelError::Invalid(format!(
                    "row {}: a draft of {} must follow exactly one decoded token of a started row \
                     ({} tokens at {})",
                    s.row,
                    s.draft,
                    s.tokens.len(),
                    s.start_pos
                )));
            }
            if s.state_slot.is_some() != self.kv.has_state() {
                return Err(ModelError::Invalid(if self.kv.has_state() {
                    format!(
                        "row {} has no state slot (this model has recurrent layers)",
                        s.row
                    )
                } else {
                    format!(
                        "row {} has a state slot (this model keeps no recurrent state)",
                        s.row
                    )
                }));
            }
            if s.blocks.len() != groups_needed {
                return Err(ModelError::Invalid(format!(
                    "row {} has {} block tables for {groups_needed} KV groups",
                    s.row,
                    s.blocks.len()
                )));
            }
            if let Some(id) = s.adapter {
                if self
                    .adapters
                    .as_ref()
                    .is_none_or(|p| p.slot_of(id).is_none())
                {
                    return Err(ModelError::Invalid(format!(
                        "row {} runs with adapter {}, which is not resident",
                        s.row, id.0
                    )));
                }
            }
        }
        self.kv.apply(ops)?;
        // Short prompt chunks as decoding rows of the compiled decode step,
        // where the step qualifies; else chunks run as prefill forwards.
        let short = self.short_chunk_rows(steps);
        self.last_short = short.len();
        let decode: Vec<&RowStep> = steps
            .iter()
            .filter(|s| s.decodes())
            .chain(short.iter())
            .collect();
        let prefill: Vec<&RowStep> = if short.is_empty() {
            steps.iter().filter(|s| !s.decodes()).collect()
        } else {
            Vec::new()
        };
        // Fresh prompts go in compiled prefill buckets where that is on; the
        // rest in groups of little padding, op by op.
        let (mut groups, rest): (Vec<Vec<&RowStep>>, Vec<&RowStep>) = match &self.compiled_prefill {
            Some(_) => bucket_groups(prefill),
            None => (Vec::new(), prefill),
        };
        groups.extend(ragged_groups(rest));
        let plan = plan_lanes(
            groups,
            Vec::new(),
            decode.len(),
            self.lanes.count(),
            self.lanes.min_tokens(),
        );
        self.lanes_used = plan.lanes_used(!decode.is_empty());
        // Held until the step is evaluated, at the end of this function.
        let _blas = if plan.parallel {
            self.lanes.single_threaded_blas()
        } else {
            None
        };
        // Every forward: (rows, lane, tokens, decode?).
        let mut jobs: Vec<(Vec<&RowStep>, usize, Array, bool)> = Vec::new();
        let singles = plan.singles.into_iter().map(|(s, l)| (vec![s], l));
        for (g, lane) in plan.groups.into_iter().chain(singles) {
            let tokens = right_padded(&g);
            jobs.push((g, lane, tokens, false));
        }
        // On the GPU a decode batch is padded to a bucket of sizes with rows
        // that read and write only the null block: a batch that shrinks or
        // grows by a row then reuses the shapes (and the matmul plans MLX's
        // CUDA backend builds per shape) of the steps before it.
        let padding: Vec<RowStep> = if self.kv.uses_kernel() && !decode.is_empty() {
            // Each group's own null block (groups may hold different counts).
            let nulls: Vec<RowBlocks> = (0..groups_needed)
                .map(|g| RowBlocks {
                    offset: 0,
                    blocks: vec![self.kv.null_block_of(g)],
                })
                .collect();
            (decode.len()..self.padded_rows(decode.len()))
                .map(|_| RowStep {
                    row: RowId::MAX,
                    tokens: vec![0],
                    start_pos: 0,
                    want_logits: false,
                    draft: 0,
                    blocks: nulls.clone(),
                    adapter: None,
                    state_slot: None,
                })
                .collect()
        } else {
            Vec::new()
        };
        if let Some(f) = &follow {
            if f.rows.len() != steps.len() {
                return Err(ModelError::Invalid(format!(
                    "{} follow flags for {} rows",
                    f.rows.len(),
                    steps.len()
                )));
            }
        }
        let following: HashSet<RowId> = match &follow {
            Some(f) => steps
                .iter()
                .zip(f.rows)
                .filter(|(_, &on)| on)
                .map(|(s, _)| s.row)
                .collect(),
            None => HashSet::new(),
        };
        if let Some(s) = steps
            .iter()
            .find(|s| following.contains(&s.row) && (!s.decodes() || s.draft > 0))
        {
            return Err(ModelError::Invalid(format!(
                "row {} follows the previous step's pick but does not decode one token",
                s.row
            )));
        }
        if !decode.is_empty() {
            let mut rows = decode;
            rows.extend(padding.iter());
            let mut tokens = right_padded(&rows);
            if let (Some(f), false) = (&follow, following.is_empty()) {
                // Rows that follow take the previous step's pick (still on the
                // device); the rest their host token: one gather over both.
                let prev = f.tokens.as_dtype(Dtype::Int32)?;
                let base = prev.dim(0);
                let mut idx: Vec<i32> = Vec::with_capacity(rows.len());
                for (i, s) in rows.iter().enumerate() {
                    if following.contains(&s.row) {
                        let at = f.last.get(&s.row).ok_or_else(|| {
                            ModelError::Invalid(format!(
                                "row {} follows a step that did not pick for it",
                                s.row
                            ))
                        })?;
                        idx.push(*at as i32);
                    } else {
                        idx.push(base + i as i32);
                    }
                }
                let all = mlx_rs::ops::concatenate(&[prev, tokens.reshape(&[-1])?], 0)?;
                let idx = Array::from_slice(&idx, &[rows.len() as i32]);
                tokens = all.take_axis(&idx, 0)?.reshape(&[rows.len() as i32, 1])?;
            }
            jobs.push((rows, plan.decode_lane, tokens, true));
        }
        // Each forward's rows' adapters (None: no row of it has one).
        let loras: Vec<Option<LoraStep>> = match &self.adapters {
            Some(pool) => jobs
                .iter()
                .map(|(rows, _, _, _)| {
                    let ids: Vec<Option<AdapterId>> = rows.iter().map(|s| s.adapter).collect();
                    pool.step(&ids)
                })
                .collect::<Result<_>>()?,
            None => jobs.iter().map(|_| None).collect(),
        };
        let mut no_hook = |_: usize| Ok(());
        let hook: &mut dyn FnMut(usize) -> Result<()> = match &mut self.layer_hook {
            Some(h) => h.as_mut(),
            None => &mut no_hook,
        };
        // How each forward runs: the decode batch (always the last job)
        // compiled where it can, beside prefill forwards too; a group of
        // fresh prompts compiled where it fits a bucket; the rest op by op.
        let last = jobs.len().saturating_sub(1);
        let bs = (self.kv.block_size() as usize).max(1);
        let how: Vec<Run> = jobs
            .iter()
            .zip(&loras)
            .enumerate()
            .map(|(i, ((rows, _, _, dec), lora))| {
                let one_block = rows.iter().all(|s| s.blocks.len() == 1);
                if *dec {
                    let plain = rows.iter().all(|s| s.tokens.len() == 1);
                    if i == last && self.compiled.is_some() && plain && one_block {
                        return Run::CompiledDecode;
                    }
                } else if self.compiled_prefill.is_some()
                    && lora.is_none()
                    && one_block
                    && rows.iter().all(|s| s.blocks[0].offset == 0)
                {
                    let shape = rows.iter().map(|s| (s.start_pos, s.tokens.len()));
                    if crate::compiled_prefill::CompiledPrefill::bucket_of(shape, bs).is_some() {
                        return Run::CompiledPrefill;
                    }
                }
                Run::Ops
            })
            .collect();
        let kv = &self.kv;
        let kv_step = |rows: &[&RowStep], dec: bool| -> Result<KvStep<'_>> {
            let r: Vec<(&[RowBlocks], usize, usize)> = rows
                .iter()
                .map(|s| (s.blocks.as_slice(), s.start_pos, s.tokens.len()))
                .collect();
            let step = kv.step(&r, dec)?;
            if !kv.has_state() {
                return Ok(step);
            }
            // Padding rows (the decode bucket's) come last and have no slot.
            let slots: Vec<u32> = rows.iter().filter_map(|s| s.state_slot).collect();
            let real = slots.len();
            step.with_slots(&slots, real)
        };
        let mut outs: Vec<Array> = Vec::with_capacity(jobs.len());
        // A compiled chunk group beside a compiled decode batch: one forward
        // ([`crate::compiled_mixed`]) where its bucket exists.
        let mixed = match (&self.compiled_mixed, jobs.as_slice(), how.as_slice()) {
            (
                Some(c),
                [(chunks, _, _, false), (rows, _, _, true)],
                [Run::CompiledPrefill, Run::CompiledDecode],
            ) if loras.iter().all(Option::is_none) => c
                .bucket(
                    rows.iter().map(|s| s.start_pos),
                    rows.len(),
                    chunks.iter().map(|s| (s.start_pos, s.tokens.len())),
                )
                .is_some_and(|b| c.runs(&b)),
            _ => false,
        };
        if jobs.len() > 1 || how.contains(&Run::CompiledPrefill) || !short.is_empty() {
            // Which path a step with prompt chunks took (the scheduler's "step
            // cost" line that follows says what it cost).
            tracing::trace!(
                mixed,
                forwards = if mixed { 1 } else { jobs.len() },
                how = ?how,
                short_chunk_rows = short.len(),
                chunk_rows = jobs.iter().filter(|j| !j.3).map(|j| j.0.len()).sum::<usize>(),
                decode_rows = jobs.iter().filter(|j| j.3).map(|j| j.0.len()).sum::<usize>(),
                "step forwards"
            );
        }
        if mixed {
            let c = self
                .compiled_mixed
                .as_mut()
                .ok_or_else(|| ModelError::Invalid("compiled mixed step missing".into()))?;
            let (chunks, rows, tokens) = (&jobs[0].0, &jobs[1].0, &jobs[1].2);
            let d: Vec<(&RowBlocks, usize)> =
                rows.iter().map(|s| (&s.blocks[0], s.start_pos)).collect();
            let ch: Vec<(&RowBlocks, usize, &[u32])> = chunks
                .iter()
                .map(|s| (&s.blocks[0], s.start_pos, s.tokens.as_slice()))
                .collect();
            let (dec, chunk) = c.step(kv, tokens, &d, &ch)?;
            // Fault injection sees a compiled forward layer by layer too.
            for layer in 0..self.model.num_layers() {
                hook(layer)?;
            }
            outs = vec![chunk, dec];
        } else if (kv.uses_kernel() && jobs.len() > 1) || how.iter().any(|h| *h != Run::Ops) {
            // One forward after the other, each evaluated before the next: on
            // the GPU a pool array still referenced by an earlier forward's
            // pending attention cannot be updated in place by the next
            // forward's write (MLX copies the whole pool instead), and a
            // compiled forward reads and writes the pool the ones before it
            // wrote. The step's last forward is left pending like a single
            // one's.
            for (i, ((rows, lane, tokens, dec), lora)) in jobs.iter().zip(&loras).enumerate() {
                let o = match how[i] {
                    Run::CompiledDecode => {
                        let c = self
                            .compiled
                            .as_mut()
                            .ok_or_else(|| ModelError::Invalid("compiled decode missing".into()))?;
                        let r: Vec<(&RowBlocks, usize)> =
                            rows.iter().map(|s| (&s.blocks[0], s.start_pos)).collect();
                        c.step(kv, tokens, &r, lora.as_ref())?
                    }
                    Run::CompiledPrefill => {
                        let c = self.compiled_prefill.as_mut().ok_or_else(|| {
                            ModelError::Invalid("compiled prefill missing".into())
                        })?;
                        let r: Vec<(&RowBlocks, usize, &[u32])> = rows
                            .iter()
                            .map(|s| (&s.blocks[0], s.start_pos, s.tokens.as_slice()))
                            .collect();
                        c.step(kv, &r)?
                    }
                    Run::Ops => {
                        let mut kvs = kv_step(rows, *dec)?;
                        let last_only = !*dec || tokens.dim(1) == 1;
                        let mut one = self.model.forward_interleaved(
                            vec![(*lane, tokens, &mut kvs, last_only, lora.as_ref())],
                            &self.lanes,
                            hook,
                        )?;
                        one.pop().ok_or_else(|| {
                            ModelError::Invalid("a forward returned no logits".into())
                        })?
                    }
                };
                if how[i] != Run::Ops {
                    // Fault injection sees a compiled forward layer by layer too.
                    for layer in 0..self.model.num_layers() {
                        hook(layer)?;
                    }
                }
                if i < last {
                    let mut pending = kv.arrays();
                    pending.push(o.clone());
                    if self.async_between {
                        mlx_rs::transforms::async_eval(pending.iter())?;
                    } else {
                        // The step queued before this one (pipelined) is ahead
                        // of this forward on the device: wait for it first, so
                        // that what is timed after is this step's own work.
                        if let (Some(f), 0) = (&follow, i) {
                            mlx_rs::transforms::eval([f.tokens])?;
                        }
                        let t = std::time::Instant::now();
                        mlx_rs::transforms::eval(pending.iter())?;
                        self.submit_blocked += t.elapsed();
                    }
                }
                outs.push(o);
            }
        } else {
            let mut steps_kv: Vec<KvStep<'_>> = jobs
                .iter()
                .map(|(rows, _, _, dec)| kv_step(rows, *dec))
                .collect::<Result<_>>()?;
            let batch: Vec<(usize, &Array, &mut KvStep<'_>, bool, Option<&LoraStep>)> = jobs
                .iter()
                .zip(steps_kv.iter_mut())
                .zip(&loras)
                .map(|(((_, lane, tokens, dec), kvs), lora)| {
                    (
                        *lane,
                        tokens,
                        kvs,
                        !*dec || tokens.dim(1) == 1,
                        lora.as_ref(),
                    )
                })
                .collect();
            outs = self.model.forward_interleaved(batch, &self.lanes, hook)?;
        }
        self.wanted(steps, &jobs, outs)
    }

    /// The wanted rows' logits out of every forward's output (`outs`, one
    /// per job), and the pool arrays to evaluate with them.
    fn wanted(
        &self,
        steps: &[RowStep],
        jobs: &[(Vec<&RowStep>, usize, Array, bool)],
        outs: Vec<Array>,
    ) -> Result<Wanted> {
        let kv = &self.kv;
        if outs.len() != jobs.len() {
            return Err(ModelError::Invalid("a forward returned no logits".into()));
        }
        let vocab = self.model.config.vocab_size as usize;
        // Flat position of each wanted row's first logits vector in the
        // concatenation of every forward's `[rows x T', V]` logits.
        let mut at: HashMap<RowId, usize> = HashMap::new();
        let mut base = 0;
        for ((rows, _, _, _), l) in jobs.iter().zip(&outs) {
            let per_row = l.dim(1) as usize;
            for (i, s) in rows.iter().enumerate() {
                if s.want_logits {
                    at.insert(s.row, base + i * per_row);
                }
            }
            base += rows.len() * per_row;
        }
        let mut rows = Vec::new();
        let mut counts = Vec::new();
        let mut picks: Vec<i32> = Vec::new();
        for s in steps.iter().filter(|s| s.want_logits) {
            let first = *at
                .get(&s.row)
                .ok_or_else(|| ModelError::Invalid("missing logits".into()))?;
            let n = if s.decodes() { 1 + s.draft } else { 1 };
            picks.extend((first..first + n).map(|p| p as i32));
            rows.push(s.row);
            counts.push(n);
        }
        // One gather of the wanted positions on the device and one transfer
        // of exactly those (padding rows and unwanted chunks stay behind);
        // per-row slices would be an MLX op per row.
        let flat: Vec<Array> = outs
            .iter()
            .map(|l| l.reshape(&[-1, vocab as i32]))
            .collect::<std::result::Result<_, _>>()?;
        let all = match flat.as_slice() {
            [one] => one.clone(),
            many => mlx_rs::ops::concatenate(many, 0)?,
        };
        let logits = if picks.is_empty() {
            None
        } else if picks.len() as i32 == all.dim(0)
            && picks.iter().enumerate().all(|(i, &p)| i as i32 == p)
        {
            // Every position is wanted, in order (a decode step without
            // padding): no gather.
            Some(all)
        } else {
            let idx = Array::from_slice(&picks, &[picks.len() as i32]);
            Some(all.take_axis(&idx, 0)?)
        };
        Ok(Wanted {
            rows,
            counts,
            logits,
            pending: kv.arrays(),
        })
    }

    /// Closes the step. Nothing is staged here (see the module docs); the
    /// scheduler's pool commits the step.
    pub fn commit(&mut self) -> Result<()> {
        match self.open.front() {
            None => Err(ModelError::Invalid("commit without an open step".into())),
            Some(o) if o.queued.is_some() => Err(ModelError::Invalid(
                "commit of a submitted step not collected yet".into(),
            )),
            Some(_) => {
                self.kv.state_commit()?;
                self.open.pop_front();
                Ok(())
            }
        }
    }

    /// Closes the newest open step without keeping it: its writes are dead
    /// data once the scheduler's pool rolls back. A submitted step still
    /// computing is abandoned (its results are never read).
    pub fn rollback(&mut self) {
        if self.open.pop_back().is_some() {
            if let Err(e) = self.kv.state_rollback() {
                tracing::error!(error = %e, "rolling back a step's recurrent state failed");
            }
        }
        self.close_state_steps();
    }
}

/// Whether `sampling` covers a step whose `rows` want logits at `counts`
/// positions each.
fn check_sampling(sampling: &[SampleRow], rows: &[RowId], counts: &[usize]) -> Result<()> {
    if sampling.len() != rows.len()
        || sampling
            .iter()
            .zip(counts)
            .any(|(s, &n)| s.uniforms.len() != n)
    {
        return Err(ModelError::Invalid(format!(
            "sampling for {} rows, {} rows want logits",
            sampling.len(),
            rows.len()
        )));
    }
    Ok(())
}

/// `WEFT_COMPILE` (`off` or `0` turns compiled decode steps off; anything
/// else, or unset, leaves them on where they apply).
fn compile_from_env() -> bool {
    !matches!(
        std::env::var("WEFT_COMPILE").ok().as_deref(),
        Some("off") | Some("0")
    )
}

/// How a step carrying a chunk group beside decoding rows runs where both
/// compile ([`BatchRunner::set_compiled_mixed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MixedSteps {
    /// Two forwards, the chunks' evaluated before the decoding rows' is built.
    Off,
    /// One forward where [`BatchRunner::warm_mixed`] traced its bucket, else two
    /// (no step pays a trace while serving).
    Warmed,
    /// One forward, each bucket traced by the first step that meets it.
    OnDemand,
}

/// Most keys the rows of a step's short chunks read in all (each row its
/// position + 1; [`BatchRunner::set_short_chunks`]): a 128-token prompt
/// reads 8,256, two of them beside context of 100 ~43,000. Past it the
/// paged kernel's per-row walks cost more than the prefill's attention.
pub const SHORT_CHUNK_KEYS: usize = 65_536;

/// `WEFT_SHORT_CHUNKS`: the most prompt tokens a step runs as decoding rows
/// where decode steps compile (0: none; unset: [`SHORT_CHUNK_TOKENS`]).
pub fn short_chunks_from_env() -> usize {
    std::env::var("WEFT_SHORT_CHUNKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(SHORT_CHUNK_TOKENS)
}

/// The default of [`short_chunks_from_env`]: with [`SHORT_CHUNK_KEYS`], up to
/// seven fresh 128-token prompts in a step (a server's second wave of requests
/// joining 100-250 decoding rows: measured on H100s, 2026-12-07, 256 streams,
/// `weft serve` made 82-121% of `bench-engine` with it against 72-100% with
/// 256 tokens, ITL p99 12-44 ms against 29-54; see benches/RESULTS.md).
pub const SHORT_CHUNK_TOKENS: usize = 1024;

/// `WEFT_MIXED`: `off` or `0`, `lazy` (on demand), else warmed.
fn mixed_from_env() -> MixedSteps {
    match std::env::var("WEFT_MIXED").ok().as_deref() {
        Some("off" | "0") => MixedSteps::Off,
        Some("lazy") => MixedSteps::OnDemand,
        _ => MixedSteps::Warmed,
    }
}

/// Decoding batches [`BatchRunner::warm_mixed`] warms up to:
/// `WEFT_MIXED_WARM_ROWS`, else 8.
pub fn mixed_warm_rows() -> usize {
    std::env::var("WEFT_MIXED_WARM_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(crate::compiled_mixed::MIN_DECODE_ROWS)
}

/// Longest short fresh prompt [`BatchRunner::warm_mixed`] warms beside
/// decoding batches wider than [`mixed_warm_rows`]: `WEFT_MIXED_WIDE_TOKENS`,
/// else 128 (0: none).
pub fn mixed_wide_tokens() -> usize {
    std::env::var("WEFT_MIXED_WIDE_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128)
}

/// `WEFT_COMPILE_PREFILL` (`off` or `0` keeps prefill op by op where decode
/// steps compile; anything else, or unset, compiles prefill groups that fit
/// its buckets).
fn compile_prefill_from_env() -> bool {
    !matches!(
        std::env::var("WEFT_COMPILE_PREFILL").ok().as_deref(),
        Some("off" | "0")
    )
}

/// Tokens of context every compiled GPU decode step's tables cover at least
/// (one table width, so one trace per row bucket, for every row up to it).
/// The paged kernel walks each row only to its length, so a wider table
/// costs a few bytes of table per row, not attention work. The CPU's gather
/// attention reads the whole table: there tables start at one block.
pub const COMPILED_MIN_CONTEXT: usize = 512;

fn compiled_min_width(kv: &PagedKv) -> usize {
    if kv.uses_kernel() {
        COMPILED_MIN_CONTEXT.div_ceil(kv.block_size().max(1) as usize)
    } else {
        1
    }
}

/// The fused decode kernels for compiled GPU decode steps, unless
/// `WEFT_FUSED=off` (or `0`) keeps their layers op by op.
fn fused_kernels() -> Option<std::rc::Rc<crate::decode_kernels::DecodeKernels>> {
    if matches!(
        std::env::var("WEFT_FUSED").ok().as_deref(),
        Some("off") | Some("0")
    ) {
        return None;
    }
    match crate::decode_kernels::DecodeKernels::new() {
        Ok(k) => Some(std::rc::Rc::new(k)),
        Err(e) => {
            tracing::warn!(error = %e, "fused decode kernels unavailable; decode layers run op by op");
            None
        }
    }
}

/// Decode batch sizes on the GPU: powers of two up to 8, then four sizes per
/// doubling (10, 12, 14, 16, 20, 24, 28, 32, 40, ...), so padding costs at
/// most a quarter of a step and a changing batch meets few distinct shapes.
pub fn decode_bucket(rows: usize) -> usize {
    if rows <= 8 {
        return rows.next_power_of_two();
    }
    let step = (1usize << (usize::BITS - 1 - rows.leading_zeros())) / 4;
    rows.div_ceil(step) * step
}

/// `[rows, T]` token ids, each row right-padded with 0 to the longest (padding
/// is never written to the pool nor attended to).
fn right_padded(rows: &[&RowStep]) -> Array {
    let t = rows.iter().map(|s| s.tokens.len()).max().unwrap_or(1);
    let mut ids: Vec<i32> = Vec::with_capacity(rows.len() * t);
    for s in rows {
        ids.extend(s.tokens.iter().map(|&x| x as i32));
        ids.extend(std::iter::repeat_n(0, t - s.tokens.len()));
    }
    Array::from_slice(&ids, &[rows.len() as i32, t as i32])
}

/// How one forward of a step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    /// The compiled decode step ([`crate::compiled_decode`]).
    CompiledDecode,
    /// The compiled prefill of prompt chunks ([`crate::compiled_prefill`]).
    CompiledPrefill,
    /// Op by op.
    Ops,
}

/// Most padding a row may get in a prefill group, as a fraction (1/8) of the
/// group's length or an absolute floor of tokens, whichever is larger.
const PAD_FLOOR: usize = 16;

/// Splits prefilling rows into groups: longest first, each group taking
/// rows while their padding stays within `max(T / 8, PAD_FLOOR)` tokens.
/// Deterministic (ties by row id) so a retried step builds the same groups.
fn ragged_groups(mut rows: Vec<&RowStep>) -> Vec<Vec<&RowStep>> {
    rows.sort_by(|a, b| b.tokens.len().cmp(&a.tokens.len()).then(a.row.cmp(&b.row)));
    let mut groups: Vec<Vec<&RowStep>> = Vec::new();
    for s in rows {
        match groups.last_mut() {
            Some(g)
                if {
                    let t = g[0].tokens.len();
                    t - s.tokens.len() <= (t / 8).max(PAD_FLOOR)
                } =>
            {
                g.push(s)
            }
            _ => groups.push(vec![s]),
        }
    }
    groups
}

/// Splits prefilling rows into compiled prefill buckets
/// ([`crate::compiled_prefill`]) and the rest: rows that start fresh (position
/// 0), have no adapter and one block table are grouped by the length their
/// bucket pads them to (so none is padded to more than twice its tokens),
/// longest first, as many a group as the bucket's total allows.
/// Deterministic (ties by row id) so a retried step builds the same groups.
fn bucket_groups(rows: Vec<&RowStep>) -> (Vec<Vec<&RowStep>>, Vec<&RowStep>) {
    use crate::compiled_prefill::{CompiledPrefill, MAX_BUCKET_TOKENS};
    let (mut fresh, rest): (Vec<&RowStep>, Vec<&RowStep>) = rows.into_iter().partition(|s| {
        s.start_pos == 0
            && s.adapter.is_none()
            && s.blocks.len() == 1
            && CompiledPrefill::row_bucket(s.tokens.len()).is_some()
    });
    fresh.sort_by(|a, b| b.tokens.len().cmp(&a.tokens.len()).then(a.row.cmp(&b.row)));
    let mut groups: Vec<(usize, Vec<&RowStep>)> = Vec::new();
    for s in fresh {
        let t = CompiledPrefill::row_bucket(s.tokens.len()).unwrap_or(MAX_BUCKET_TOKENS);
        match groups.last_mut() {
            // A bucket pads its rows to a power of two.
            Some((gt, g))
                if *gt == t && (g.len() + 1).next_power_of_two() * t <= MAX_BUCKET_TOKENS =>
            {
                g.push(s)
            }
            _ => groups.push((t, vec![s])),
        }
    }
    (groups.into_iter().map(|(_, g)| g).collect(), rest)
}

/// Which lane builds each forward of a step.
struct LanePlan<'a> {
    groups: Vec<(Vec<&'a RowStep>, usize)>,
    singles: Vec<(&'a RowStep, usize)>,
    decode_lane: usize,
    /// More than one lane has work: BLAS goes single-threaded for the step.
    parallel: bool,
}

impl LanePlan<'_> {
    /// Distinct lanes that build a forward (1 for an unsplit step).
    fn lanes_used(&self, decoding: bool) -> usize {
        if !self.parallel {
            return 1;
        }
        let mut used: Vec<usize> = self.groups.iter().map(|(_, l)| *l).collect();
        used.extend(self.singles.iter().map(|(_, l)| *l));
        used.extend(decoding.then_some(self.decode_lane));
        used.sort_unstable();
        used.dedup();
        used.len()
    }
}

/// A decode forward reads every weight once whatever its batch, which costs
/// about as much as this many prefill tokens.
const DECODE_PASS_TOKENS: usize = 64;

/// Spreads a step's forwards over `lanes`. With more than one lane, groups
/// big enough to feed two lanes are halved (halves that land on the same lane
/// are joined again); if in the end fewer than two lanes would carry
/// `min_tokens`, everything stays on lane 0 with the groups whole, as a
/// one-lane runner would build it. Deterministic.
fn plan_lanes<'a>(
    groups: Vec<Vec<&'a RowStep>>,
    singles: Vec<&'a RowStep>,
    decode_rows: usize,
    lanes: usize,
    min_tokens: usize,
) -> LanePlan<'a> {
    let width = |g: &[&RowStep]| g.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
    // Jobs: (origin group, rows); singles carry no origin.
    let mut jobs: Vec<(Option<usize>, Vec<&'a RowStep>)> = Vec::new();
    for (o, g) in groups.iter().enumerate() {
        if lanes > 1 && g.len() >= 2 && g.len() * width(g) >= 2 * min_tokens {
            let (a, b) = g.split_at(g.len() / 2);
            jobs.extend([(Some(o), a.to_vec()), (Some(o), b.to_vec())]);
        } else {
            jobs.push((Some(o), g.clone()));
        }
    }
    jobs.extend(singles.iter().map(|&s| (None, vec![s])));
    let mut costs: Vec<usize> = jobs.iter().map(|(_, g)| g.len() * width(g)).collect();
    if decode_rows > 0 {
        costs.push(decode_rows + DECODE_PASS_TOKENS);
    }
    let mut at = lanes::assign(&costs, lanes.max(1));
    let mut load = vec![0usize; lanes.max(1)];
    for (c, &l) in costs.iter().zip(&at) {
        load[l] += c;
    }
    let parallel = load.iter().filter(|&&l| l >= min_tokens).count() >= 2;
    if !parallel {
        at.iter_mut().for_each(|l| *l = 0);
    }
    let decode_lane = if decode_rows > 0 { at[jobs.len()] } else { 0 };
    // A group whose parts all share a lane runs whole.
    let mut plan = LanePlan {
        groups: Vec::new(),
        singles: Vec::new(),
        decode_lane,
        parallel,
    };
    let mut emit = |rows: Vec<&'a RowStep>, lane: usize| match rows.len() {
        1 => plan.singles.push((rows[0], lane)),
        _ => plan.groups.push((rows, lane)),
    };
    for (o, g) in groups.into_iter().enumerate() {
        let parts: Vec<usize> = (0..jobs.len()).filter(|&j| jobs[j].0 == Some(o)).collect();
        if parts.iter().all(|&j| at[j] == at[parts[0]]) {
            emit(g, at[parts[0]]);
        } else {
            for j in parts {
                emit(std::mem::take(&mut jobs[j].1), at[j]);
            }
        }
    }
    for (j, job) in jobs.iter().enumerate() {
        if job.0.is_none() {
            emit(job.1.clone(), at[j]);
        }
    }
    plan.singles.sort_by_key(|(s, _)| s.row);
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(rows: usize, tokens: usize) -> Vec<RowStep> {
        (0..rows)
            .map(|r| RowStep {
                row: r as RowId,
                tokens: vec![1; tokens],
                start_pos: 0,
                want_logits: true,
                draft: 0,
                blocks: Vec::new(),
                adapter: None,
                state_slot: None,
            })
            .collect()
    }

    fn rows_of(g: &[&RowStep]) -> Vec<RowId> {
        g.iter().map(|s| s.row).collect()
    }

    #[test]
    fn decode_buckets_pad_by_at_most_a_quarter() {
        let got: Vec<usize> = [1, 2, 3, 5, 8, 9, 12, 13, 16, 17, 33, 100, 128, 129, 255]
            .iter()
            .map(|&n| decode_bucket(n))
            .collect();
        assert_eq!(
            got,
            vec![1, 2, 4, 8, 8, 10, 12, 14, 16, 20, 40, 112, 128, 160, 256]
        );
        for n in 9..2000 {
            let b = decode_bucket(n);
            assert!(b >= n && (b - n) * 4 <= n, "{n} -> {b}");
        }
    }

    #[test]
    fn fresh_prompts_are_bucketed_by_padded_length() {
        let one_table = || vec![RowBlocks::default()];
        let mut s: Vec<RowStep> = [7, 1, 18, 100, 600, 20, 30]
            .iter()
            .enumerate()
            .map(|(i, &n)| RowStep {
                row: i as RowId,
                tokens: vec![1; n],
                blocks: one_table(),
                ..Default::default()
            })
            .collect();
        s[5].start_pos = 16; // a cached prefix: not fresh
        s[6].adapter = Some(AdapterId(1));
        let (groups, rest) = bucket_groups(s.iter().collect());
        let got: Vec<Vec<RowId>> = groups.iter().map(|g| rows_of(g)).collect();
        // 100 pads to 128, 18 to 32, 7 and 1 to 16; 600 is past the buckets.
        assert_eq!(got, vec![vec![3], vec![2], vec![0, 1]]);
        assert_eq!(rows_of(&rest), vec![4, 5, 6]);
        // 70 prompts of 16 tokens: buckets of 64 rows (1024 tokens) and 6.
        let mut many = steps(70, 16);
        many.iter_mut().for_each(|s| s.blocks = one_table());
        let (groups, rest) = bucket_groups(many.iter().collect());
        let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![64, 6]);
        assert!(rest.is_empty());
        // 5 of 190 tokens (padded to 192): 4 rows fill a bucket of 768
        // tokens, a fifth would make it 8 rows (1536).
        let mut five = steps(5, 190);
        five.iter_mut().for_each(|s| s.blocks = one_table());
        let (groups, _) = bucket_groups(five.iter().collect());
        let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![4, 1]);
        for g in &groups {
            assert!(crate::compiled_prefill::CompiledPrefill::bucket(g.len(), 190, 0).is_some());
        }
    }

    #[test]
    fn one_lane_keeps_groups_whole() {
        let s = steps(8, 128);
        let plan = plan_lanes(ragged_groups(s.iter().collect()), vec![], 4, 1, 256);
        assert!(!plan.parallel);
        assert_eq!(plan.groups.len(), 1);
        assert_eq!(plan.groups[0].1, 0);
        assert_eq!(plan.decode_lane, 0);
    }

    #[test]
    fn a_big_group_is_halved_over_two_lanes() {
        let s = steps(8, 128);
        let plan = plan_lanes(ragged_groups(s.iter().collect()), vec![], 0, 2, 256);
        assert!(plan.parallel);
        let got: Vec<(Vec<RowId>, usize)> =
            plan.groups.iter().map(|(g, l)| (rows_of(g), *l)).collect();
        assert_eq!(got, vec![(vec![0, 1, 2, 3], 0), (vec![4, 5, 6, 7], 1)]);
    }

    #[test]
    fn small_steps_and_pure_decode_stay_on_one_lane() {
        let s = steps(2, 16);
        let plan = plan_lanes(ragged_groups(s.iter().collect()), vec![], 8, 2, 256);
        assert!(!plan.parallel);
        assert_eq!(
            plan.groups.len(),
            1,
            "a group too small to split stays whole"
        );
        assert!(plan.groups.iter().all(|(_, l)| *l == 0));
        let plan = plan_lanes(vec![], vec![], 32, 2, 256);
        assert!(!plan.parallel);
        assert_eq!(plan.decode_lane, 0);
    }

    #[test]
    fn decode_and_chunks_balance_against_a_group() {
        // A 4 x 128 group (two halves of 256 token-rows), a 300-token chunk
        // and a 16-row decode (16 + 64): largest first, the chunk takes lane
        // 0, both halves lane 1 (256, then 512 against 300), so the group runs
        // whole there; the decode goes to lane 0.
        let g = steps(4, 128);
        let mut chunk = steps(1, 300);
        chunk[0].row = 9;
        chunk[0].start_pos = 100;
        let plan = plan_lanes(
            ragged_groups(g.iter().collect()),
            chunk.iter().collect(),
            16,
            2,
            256,
        );
        assert!(plan.parallel);
        let got: Vec<(Vec<RowId>, usize)> =
            plan.groups.iter().map(|(g, l)| (rows_of(g), *l)).collect();
        assert_eq!(got, vec![(vec![0, 1, 2, 3], 1)]);
        assert_eq!(plan.singles.len(), 1);
        assert_eq!(plan.singles[0].1, 0);
        assert_eq!(plan.decode_lane, 0);
    }
}
