//! Composition root: the real MLX model behind the scheduler's `Model` trait,
//! and the engine started on it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;

use crate::adapters::{AdapterCatalog, StartedAdapters};
pub use crate::adapters::{AdapterPoolSpec, AdapterSpec, ServedAdapter};
use weft_models::{
    BatchRunner, KvMemory, LoadOptions, RowBlocks, RowStep, SampleRow, StorageOp, Tokenizer,
};
use weft_scheduler::sampling::{uniform, HostSampler};
use weft_scheduler::{
    Detokenizer, Engine, Model, ModelError, ModelInfo, RowId, RowInput, SchedulerConfig,
    StepOutput, TokenLogprob, TokenMask,
};

/// Where a step's tokens are picked from its logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleOn {
    /// On the device, by MLX ops over the logits where they were computed:
    /// only ids and requested logprobs are transferred (the GPU default).
    Device,
    /// On the host, by the scheduler's sampler over logits copied out as f32
    /// (the CPU default: there the copy is a memcpy and the host sampler's
    /// candidate pruning beats a full sort).
    Host,
}

impl SampleOn {
    /// `WEFT_SAMPLE_ON` (`device`, `host` or `auto`/unset: device on a GPU).
    pub fn from_env(gpu: bool) -> anyhow::Result<Self> {
        match std::env::var("WEFT_SAMPLE_ON").ok().as_deref() {
            None | Some("") | Some("auto") => Ok(if gpu { Self::Device } else { Self::Host }),
            Some("device") => Ok(Self::Device),
            Some("host") => Ok(Self::Host),
            Some(other) => {
                anyhow::bail!("WEFT_SAMPLE_ON={other:?}: expected device, host or auto")
            }
        }
    }
}

/// Where the engine's forward calls spent their time, summed over the
/// process (all models): `weft bench-engine` reports per-step means from
/// two snapshots, and the same split goes to the
/// `weft_forward_{build,eval,other}_seconds` histograms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForwardTimes {
    pub calls: u64,
    /// Host time building the step's graph (inputs, layers, sampler).
    pub build_ns: u64,
    /// Waiting for the evaluation (device time the build did not hide).
    pub eval_ns: u64,
    /// The whole `Model::forward`, conversions and host sampling included.
    pub total_ns: u64,
}

static FORWARD: [std::sync::atomic::AtomicU64; 4] = [
    std::sync::atomic::AtomicU64::new(0),
    std::sync::atomic::AtomicU64::new(0),
    std::sync::atomic::AtomicU64::new(0),
    std::sync::atomic::AtomicU64::new(0),
];

/// A snapshot of the process's [`ForwardTimes`].
pub fn forward_times() -> ForwardTimes {
    let r = |i: usize| FORWARD[i].load(std::sync::atomic::Ordering::Relaxed);
    ForwardTimes {
        calls: r(0),
        build_ns: r(1),
        eval_ns: r(2),
        total_ns: r(3),
    }
}

/// Context up to which compiled steps are traced at startup: one row's
/// prefill chunks, and every decode batch size's block tables (a long
/// prompt's chunks, and the decode steps of rows that grew past the
/// narrowest table, then meet no trace until past it; a first-use trace is a
/// stall of every decoding row, ~12 ms per decode bucket on an H100).
const WARM_CONTEXT: usize = 8192;

fn record_forward(t: weft_models::StepTiming, total: std::time::Duration) {
    use std::sync::atomic::Ordering::Relaxed;
    FORWARD[0].fetch_add(1, Relaxed);
    FORWARD[1].fetch_add(t.build.as_nanos() as u64, Relaxed);
    FORWARD[2].fetch_add(t.eval.as_nanos() as u64, Relaxed);
    FORWARD[3].fetch_add(total.as_nanos() as u64, Relaxed);
    metrics::histogram!("weft_forward_build_seconds").record(t.build.as_secs_f64());
    metrics::histogram!("weft_forward_eval_seconds").record(t.eval.as_secs_f64());
    metrics::histogram!("weft_forward_other_seconds")
        .record(total.saturating_sub(t.build + t.eval).as_secs_f64());
    // The engine thread's compiled-function traces (retraces recompile).
    metrics::counter!("weft_compile_traces_total").absolute(weft_models::compile_traces());
}

/// `weft_models::BatchRunner` as the scheduler sees it.
pub struct MlxModel {
    runner: BatchRunner,
    info: ModelInfo,
    /// The step's rows in the runner's form, reused across steps.
    steps: Vec<RowStep>,
    sample_on: SampleOn,
    host: HostSampler,
    /// Device sampling parameters of the rows that want logits, reused.
    sampling: Vec<SampleRow>,
    /// Per step row: whether it follows the previous submitted step's pick.
    follows: Vec<bool>,
    faults: ModelFaults,
    /// Forward and submit calls so far (for `faults`).
    calls: u64,
    /// Steps that raised MLX's peak, logged at debug level.
    peaks: crate::memory_plan::PeakWatch,
}

impl MlxModel {
    pub fn new(runner: BatchRunner, eos_token_ids: Vec<u32>) -> Self {
        let gpu = runner.kv().uses_kernel();
        Self::with_sampling(
            runner,
            eos_token_ids,
            if gpu {
                SampleOn::Device
            } else {
                SampleOn::Host
            },
        )
    }

    pub fn with_sampling(
        runner: BatchRunner,
        eos_token_ids: Vec<u32>,
        sample_on: SampleOn,
    ) -> Self {
        let c = &runner.model().config;
        let info = ModelInfo {
            vocab_size: c.vocab_size as usize,
            max_context: c.max_position_embeddings as usize,
            eos_token_ids,
            kv: runner.kv_groups().clone(),
            adapter_slots: runner.adapters().map_or(0, |p| p.config().slots),
        };
        Self {
            runner,
            info,
            steps: Vec::new(),
            sample_on,
            host: HostSampler::default(),
            sampling: Vec::new(),
            follows: Vec::new(),
            faults: ModelFaults::default(),
            calls: 0,
            peaks: Default::default(),
        }
    }

    /// Test-only fault injection (see [`ModelFaults`]).
    pub fn with_faults(mut self, faults: ModelFaults) -> Self {
        self.faults = faults;
        self
    }

    /// Counts a forward or submit; Err when it is one to fail to allocate.
    fn injected(&mut self) -> Result<(), ModelError> {
        self.calls += 1;
        if self.faults.alloc_calls.contains(&self.calls) {
            let e = failed(weft_models::ModelError::Weights(
                INJECTED_ALLOCATION_FAILURE.into(),
            ));
            tracing::warn!(call = self.calls, error = %e, "injected allocation failure (testing only)");
            return Err(e);
        }
        Ok(())
    }

    pub fn sample_on(&self) -> SampleOn {
        self.sample_on
    }
}

/// The contract's sampling parameters of a row as the device sampler takes them.
fn fill_sample_row(r: &RowInput, out: &mut SampleRow) {
    let s = &r.sampling;
    let p = &s.params;
    out.temperature = p.temperature;
    out.top_k = p.top_k;
    out.top_p = p.top_p;
    out.min_p = p.min_p;
    out.repetition_penalty = p.repetition_penalty;
    out.presence_penalty = p.presence_penalty;
    out.frequency_penalty = p.frequency_penalty;
    out.seen.clear();
    if p.has_penalties() {
        out.seen.extend(s.seen.iter().map(|t| (t.id, t.generated)));
    }
    out.uniforms.clear();
    let n = r.positions() as u64;
    if p.is_greedy() {
        out.uniforms.extend((0..n).map(|_| 0.0));
    } else {
        out.uniforms
            .extend((0..n).map(|j| uniform(s.seed, s.index + j)));
    }
    out.logprobs = s.logprobs;
    out.allowed.clear();
    out.allowed.extend(s.allowed.iter().map(TokenMask::shared));
}

/// How the KV pool is sized and what its startup log reports.
#[derive(Debug, Clone, Copy)]
pub struct KvSpec {
    pub block_size: u32,
    pub memory: KvMemory,
    /// K/V stored affine-quantized (`--kv-bits`, `--kv-group-size`).
    pub quant: Option<weft_models::AffineQuant>,
    /// Rows a step may hold: the log says how much context each gets when
    /// that many share the pool.
    pub max_batch_rows: usize,
    /// MLX's buffer-cache cap (part of the memory plan).
    pub cache_limit: crate::memory_plan::CacheLimit,
}

fn failed(e: weft_models::ModelError) -> ModelError {
    match e {
        weft_models::ModelError::Invalid(m) => ModelError::Contract(m),
        other => {
            let msg = other.to_string();
            if is_allocation_failure(&msg) {
                ModelError::OutOfMemory(msg)
            } else {
                ModelError::Failed(msg)
            }
        }
    }
}

/// Whether an MLX error is an allocation failure: MLX's allocators throw
/// `[malloc] Unable to allocate N bytes.` (CPU), `[metal::malloc] ...` or a
/// CUDA out-of-memory error, which mlx-c hands back as the message. The
/// scheduler splits a batch that failed so instead of retrying it whole.
pub fn is_allocation_failure(msg: &str) -> bool {
    let m = msg.to_ascii_lowercase();
    m.contains("unable to allocate")
        || m.contains("out of memory")
        || m.contains("bad_alloc")
        || m.contains("cudaerrormemoryallocation")
        || (m.contains("malloc]") && m.contains("allocat"))
}

/// Test-only allocation failures (`WEFT_TEST_FAULTS=alloc:N`): the `N`th
/// forward (or submitted step) of the served model fails with the error MLX's
/// CPU allocator raises when memory runs out (provoking a real one is not an
/// option: MLX's CPU backend does not survive an allocation no machine can
/// satisfy), classified by [`is_allocation_failure`] like a real one.
#[derive(Debug, Clone, Default)]
pub struct ModelFaults {
    /// 1-based forward/submit calls that fail to allocate.
    pub alloc_calls: Vec<u64>,
}

/// The message of MLX's CPU allocator when `malloc` fails.
pub const INJECTED_ALLOCATION_FAILURE: &str =
    "[malloc_or_wait] Unable to allocate 68719476736 bytes. (injected: WEFT_TEST_FAULTS)";

impl Model for MlxModel {
    fn info(&self) -> ModelInfo {
        self.info.clone()
    }

    fn forward(&mut self, ops: &[StorageOp], batch: &[RowInput]) -> Result<StepOutput, ModelError> {
        self.injected()?;
        let t0 = std::time::Instant::now();
        self.fill_steps(batch);
        self.peaks.submitted(batch);
        let out = self.forward_steps(ops, batch);
        if out.is_ok() {
            record_forward(self.runner.last_timing(), t0.elapsed());
        }
        self.peaks.collected();
        out
    }

    /// Device sampling pipelines: the next step is queued with this one's picks
    /// as its inputs before this one is read.
    fn pipelines(&self) -> bool {
        self.sample_on == SampleOn::Device
    }

    fn submit(&mut self, ops: &[StorageOp], batch: &[RowInput]) -> Result<(), ModelError> {
        if self.sample_on != SampleOn::Device {
            return Err(ModelError::Contract(
                "pipelined steps need device sampling".into(),
            ));
        }
        self.injected()?;
        self.fill_steps(batch);
        self.peaks.submitted(batch);
        let n = self.fill_sampling(batch);
        self.follows.clear();
        self.follows.extend(batch.iter().map(|r| r.follows));
        self.runner
            .submit_sampled(
                ops,
                &self.steps[..batch.len()],
                &self.sampling[..n],
                &self.follows,
            )
            .map_err(failed)
    }

    /// Whatever pipelines defers sampling: penalized and constrained rows
    /// pipeline too.
    fn defers_sampling(&self) -> bool {
        self.pipelines()
    }

    fn submit_unsampled(
        &mut self,
        ops: &[StorageOp],
        batch: &[RowInput],
    ) -> Result<(), ModelError> {
        if self.sample_on != SampleOn::Device {
            return Err(ModelError::Contract(
                "pipelined steps need device sampling".into(),
            ));
        }
        self.injected()?;
        self.fill_steps(batch);
        self.peaks.submitted(batch);
        self.follows.clear();
        self.follows.extend(batch.iter().map(|r| r.follows));
        self.runner
            .submit_unsampled(ops, &self.steps[..batch.len()], &self.follows)
            .map_err(failed)
    }

    fn last_submit_blocked_seconds(&self) -> Option<f64> {
        Some(self.runner.last_submit_blocked().as_secs_f64())
    }

    fn last_build_traced(&self) -> bool {
        self.runner.last_build_traced()
    }

    fn submit_sampling(&mut self, batch: &[RowInput]) -> Result<(), ModelError> {
        let n = self.fill_sampling(batch);
        self.runner
            .submit_sampling(&self.sampling[..n])
            .map_err(failed)
    }

    fn collect(&mut self) -> Result<StepOutput, ModelError> {
        let out = self.runner.collect().map_err(failed)?;
        self.peaks.collected();
        // The step's build, and the wait for its picks: what its evaluation did
        // not overlap with the host's work in between.
        let t = self.runner.last_timing();
        record_forward(t, t.build + t.eval);
        Ok(step_output(out))
    }

    fn commit(&mut self) -> Result<(), ModelError> {
        self.runner.commit().map_err(failed)
    }

    /// Not for recurrent models: a draft's rejected tokens would need the
    /// state as it was at each position (per-position checkpoints), which the
    /// state slots do not keep; their rows decode one token per step.
    fn supports_drafts(&self) -> bool {
        !self.runner.kv().has_state()
    }

    /// The runner's short chunks ([`BatchRunner::set_short_chunks`]): a step's
    /// prompt chunks within these limits run as decoding rows (where their decode
    /// bucket is traced, which startup sees to).
    fn short_prompts(&self) -> Option<weft_scheduler::step_cost::ShortPrompts> {
        let tokens = self.runner.short_chunks();
        (tokens > 0).then_some(weft_scheduler::step_cost::ShortPrompts {
            tokens,
            keys: weft_models::runner::SHORT_CHUNK_KEYS,
        })
    }

    fn rollback(&mut self) {
        self.runner.rollback();
    }

    /// Attention rows keep nothing beyond their KV blocks, which the
    /// scheduler's pool releases.
    fn release_row(&mut self, _row: RowId) {}

    /// `source` is the adapter's files read into host memory
    /// ([`weft_models::AdapterFiles`]).
    fn add_adapter(
        &mut self,
        id: u32,
        source: weft_scheduler::AdapterSource,
    ) -> Result<weft_scheduler::AdapterDesc, ModelError> {
        let files = source
            .downcast::<weft_models::AdapterFiles>()
            .map_err(|_| {
                ModelError::Contract("an adapter source that is not AdapterFiles".into())
            })?;
        let host_bytes = files.bytes();
        let a = self
            .runner
            .register_adapter(weft_models::AdapterId(u64::from(id)), *files)
            .map_err(|e| ModelError::Failed(e.to_string()))?;
        Ok(describe(&a, host_bytes))
    }

    fn remove_adapter(&mut self, id: u32) -> Result<(), ModelError> {
        self.runner
            .forget_adapter(weft_models::AdapterId(u64::from(id)))
            .map(|_| ())
            .map_err(failed)
    }

    fn adapter_counters(&self) -> weft_scheduler::AdapterCounters {
        let c = self.runner.adapter_counters();
        weft_scheduler::AdapterCounters {
            loads: c.loads,
            evictions: c.evictions,
        }
    }

    /// After an allocation failure: MLX's buffer cache gives back what it holds.
    fn release_memory(&mut self) {
        if let Err(e) = mlx_rs::memory::clear_cache() {
            tracing::warn!(error = %e, "clearing MLX's buffer cache failed");
        }
    }
}

/// What an adapter is, as the scheduler's contract says it.
pub(crate) fn describe(a: &weft_models::Adapter, host_bytes: u64) -> weft_scheduler::AdapterDesc {
    weft_scheduler::AdapterDesc {
        rank: a.rank as u32,
        scale: a.scale,
        targets: a.targets().iter().map(|t| t.short().to_string()).collect(),
        format: match a.format {
            weft_models::AdapterFormat::MlxLm => "mlx-lm",
            weft_models::AdapterFormat::Peft => "peft",
        }
        .to_string(),
        host_bytes,
    }
}

/// The device sampler's picks as the contract's output.
fn step_output(out: weft_models::StepPicks) -> StepOutput {
    let logprobs = out
        .picked
        .logprobs
        .into_iter()
        .zip(&out.picked.tokens)
        .map(|(lp, &id)| {
            lp.map(|lp| TokenLogprob {
                id,
                logprob: lp.logprob,
                top: lp.top,
            })
        })
        .collect();
    StepOutput {
        rows: out.rows,
        tokens: out.picked.tokens,
        logprobs,
    }
}

impl MlxModel {
    /// Copies the batch into the runner's row form.
    fn fill_steps(&mut self, batch: &[RowInput]) {
        let steps = &mut self.steps;
        if steps.len() < batch.len() {
            steps.resize_with(batch.len(), RowStep::default);
        }
        for (s, r) in steps.iter_mut().zip(batch) {
            s.row = r.row;
            s.tokens.clone_from(&r.tokens);
            s.start_pos = r.start_pos;
            s.want_logits = r.want_logits;
            s.draft = r.draft;
            s.blocks.clone_from(&r.blocks);
            s.adapter = r.adapter.map(|a| weft_models::AdapterId(u64::from(a)));
            s.state_slot = r.state_slot;
        }
    }

    /// The device sampler's rows for the batch's rows that want logits; returns
    /// how many.
    fn fill_sampling(&mut self, batch: &[RowInput]) -> usize {
        let wanted = batch.iter().filter(|r| r.want_logits);
        let n = wanted.clone().count();
        if self.sampling.len() < n {
            self.sampling.resize_with(n, SampleRow::default);
        }
        for (r, s) in wanted.zip(self.sampling.iter_mut()) {
            fill_sample_row(r, s);
        }
        n
    }

    /// The forward of [`Model::forward`] once `self.steps` holds the batch.
    fn forward_steps(
        &mut self,
        ops: &[StorageOp],
        batch: &[RowInput],
    ) -> Result<StepOutput, ModelError> {
        let steps = &self.steps[..batch.len()];
        match self.sample_on {
            SampleOn::Host => {
                let out = self.runner.forward(ops, steps).map_err(failed)?;
                self.host.sample(&out.data, out.vocab, batch)
            }
            SampleOn::Device => {
                let n = self.fill_sampling(batch);
                let out = self
                    .runner
                    .forward_sampled(ops, &self.steps[..batch.len()], &self.sampling[..n])
                    .map_err(failed)?;
                Ok(step_output(out))
            }
        }
    }
}

/// The tokenizer as the scheduler's detokenizer.
pub struct TokenizerDetok(pub Arc<Tokenizer>);

impl Detokenizer for TokenizerDetok {
    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.0.decode(ids).map_err(|e| e.to_string())
    }
}

/// Facts about the served model, read once at startup.
#[derive(Debug, Clone)]
pub struct ServedModel {
    pub name: String,
    pub dir: PathBuf,
    pub architecture: String,
    pub context_length: usize,
    pub vocab_size: usize,
    pub dtype: String,
    pub quantization: String,
    /// Tokens a sliding-window layer attends (None: no such layers).
    pub sliding_window: Option<u32>,
    /// Per layer: "full_attention", "sliding_attention", "linear_attention"
    /// (recurrent) or "mlp" (a block of only an MLP).
    pub layer_kinds: Vec<String>,
    /// Rows that can hold recurrent state at once (0: no recurrent layers).
    pub state_slots: u32,
    /// Bytes of one row's recurrent state.
    pub state_bytes_per_row: u64,
    /// What the KV pool stores per element (`bfloat16`, `q4g64/bfloat16`).
    pub kv_dtype: String,
    pub eos_token_ids: Vec<u32>,
    /// What the server plans to hold (set once the engine has started).
    pub memory: crate::memory_plan::MemoryPlan,
    /// The LoRA adapters served beside the model (set once the engine has
    /// started; mounted and unmounted at run time).
    pub adapters: Arc<AdapterCatalog>,
}

impl ServedModel {
    /// The served adapter called `name`.
    pub fn adapter(&self, name: &str) -> Option<ServedAdapter> {
        self.adapters.get(name)
    }
}

/// The names `--model` and `weft pull` accept (`weft_gguf::KNOWN_MODELS`,
/// the default first), for help and error texts.
pub fn known_model_names() -> String {
    weft_gguf::KNOWN_MODELS
        .iter()
        .map(|m| m.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Resolves `--model`: empty, `default` or the name of a known model
/// (`weft_gguf::KNOWN_MODELS`: SmolLM2-135M-Instruct, gemma3-270m) fetches
/// (once) and converts that model into the cache; anything else is a model
/// directory.
pub fn resolve_model(spec: &str, progress: bool) -> anyhow::Result<PathBuf> {
    if let Some(model) = weft_gguf::find_model(spec) {
        let cache = crate::paths::cache_dir();
        return Ok(model.pull(&cache, progress)?);
    }
    let p = PathBuf::from(spec);
    if p.is_dir() {
        return Ok(p);
    }
    anyhow::bail!(
        "--model {spec:?} is neither a known model ({}) nor a model directory (config.json, *.safetensors, tokenizer.json)",
        known_model_names()
    )
}

/// `WEFT_PIPELINE` (`on`/`1`, the default, or `off`/`0`): whether decode
/// steps pipeline where the model can (device sampling; see
/// `SchedulerConfig::pipeline`).
pub fn pipeline_from_env() -> anyhow::Result<bool> {
    match std::env::var("WEFT_PIPELINE").ok().as_deref() {
        None | Some("") | Some("on") | Some("1") => Ok(true),
        Some("off") | Some("0") => Ok(false),
        Some(other) => anyhow::bail!("WEFT_PIPELINE={other:?}: expected on or off"),
    }
}

/// Loads the tokenizer here and the model on the engine thread; returns once
/// the model is loaded and warm.
pub fn start_engine(
    dir: &Path,
    opts: LoadOptions,
    config: SchedulerConfig,
    kv: KvSpec,
) -> anyhow::Result<(Engine, Arc<Tokenizer>, ServedModel)> {
    start_engine_with(
        dir,
        opts,
        config,
        kv,
        ModelFaults::default(),
        &[],
        &AdapterPoolSpec::default(),
    )
}

/// [`start_engine`] with test-only model faults.
pub fn start_engine_with(
    dir: &Path,
    opts: LoadOptions,
    mut config: SchedulerConfig,
    kv: KvSpec,
    faults: ModelFaults,
    adapters: &[AdapterSpec],
    adapter_pool: &AdapterPoolSpec,
) -> anyhow::Result<(Engine, Arc<Tokenizer>, ServedModel)> {
    config.pipeline &= pipeline_from_env()?;
    let root = match &adapter_pool.root {
        Some(r) => Some(
            r.canonicalize()
                .with_context(|| format!("--adapter-root {}", r.display()))?,
        ),
        None => None,
    };
    let tokenizer = Arc::new(Tokenizer::load(dir)?);
    let model_config = weft_models::ModelConfig::load(dir)?;
    let mut eos = model_config.eos_token_ids.clone();
    if let Some(e) = tokenizer.eos_token_id() {
        if !eos.contains(&e) {
            eos.push(e);
        }
    }
    let policy = opts.policy();
    let quantization = match (&model_config.quantization, policy.dequantize) {
        (None, _) => "none".to_string(),
        (Some(q), deq) => format!(
            "affine q{} g{}{}",
            q.bits,
            q.group_size,
            if deq { " (dequantized at load)" } else { "" }
        ),
    };
    let recurrent = weft_models::kv::RecurrentLayers::from_flags(
        model_config.recurrent_state(),
        &model_config.recurrent_layers,
    )?;
    let served = ServedModel {
        name: dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        dir: dir.to_path_buf(),
        architecture: model_config.model_type.clone(),
        context_length: model_config.max_position_embeddings as usize,
        vocab_size: model_config.vocab_size as usize,
        dtype: format!("{:?}", policy.dtype).to_lowercase(),
        kv_dtype: weft_models::kv::kv_dtype_label(policy.dtype, kv.quant),
        quantization,
        sliding_window: model_config
            .sliding_layers
            .contains(&true)
            .then_some(model_config.sliding_window)
            .flatten()
            .and_then(|w| u32::try_from(w).ok()),
        layer_kinds: (0..model_config.num_layers as usize)
            .map(|i| {
                let sliding = model_config.sliding_layers.get(i).copied().unwrap_or(false);
                let recurrent = model_config
                    .recurrent_layers
                    .get(i)
                    .copied()
                    .unwrap_or(false);
                let mlp = model_config.mlp_layers.get(i).copied().unwrap_or(false);
                if recurrent {
                    "linear_attention"
                } else if mlp {
                    "mlp"
                } else if sliding {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
                .to_string()
            })
            .collect(),
        state_slots: if recurrent.is_some() {
            u32::try_from(config.max_batch_rows).unwrap_or(u32::MAX)
        } else {
            0
        },
        state_bytes_per_row: recurrent.map_or(0, |r| r.bytes_per_slot(policy.dtype)),
        eos_token_ids: eos.clone(),
        memory: Default::default(),
        adapters: Default::default(),
    };
    let dir_owned = dir.to_path_buf();
    // What the scheduler will hold at most: a sliding-window group (Gemma 3's
    // local layers) gets only the blocks that many rows' windows and a step's
    // tokens can use, the rest of the budget goes to the full-attention group.
    let usage = weft_models::KvUse {
        max_rows: config.max_batch_rows,
        max_step_tokens: config.max_step_tokens,
    };
    let speculate = config.speculate;
    let planned = Arc::new(std::sync::Mutex::new(None));
    let plan_out = planned.clone();
    let adapter_specs = adapters.to_vec();
    let pool_spec = adapter_pool.clone();
    let served_adapters = Arc::new(std::sync::Mutex::new(StartedAdapters::default()));
    let adapters_out = served_adapters.clone();
    let engine = Engine::start(
        config,
        move || -> anyhow::Result<MlxModel> {
            let rss_before = crate::memory_plan::resident_bytes();
            let loaded = weft_models::load(&dir_owned, opts)?;
            let weights = crate::memory_plan::weights_bytes(opts.device, rss_before)?;
            let model_config = loaded.model.config.clone();
            let context = model_config.max_position_embeddings as u64;
            let mut runner = BatchRunner::with_memory_use(
                loaded.model,
                kv.block_size,
                kv.memory,
                Some(usage),
                kv.quant,
            )?;
            runner.set_lanes(opts.lanes());
            // Before the memory plan, which counts the adapter pool.
            let resident =
                crate::adapters::start(&mut runner, &model_config, &adapter_specs, &pool_spec)?;
            if let Ok(mut a) = adapters_out.lock() {
                *a = resident;
            }
            log_kv(&runner, kv.max_batch_rows, context);
            let shape = crate::memory_plan::step_shape(
                &model_config,
                &runner,
                usage.max_step_tokens,
                usage.max_rows,
                speculate,
            );
            let step = weft_models::memory::step_memory(&model_config, shape);
            let decode = weft_models::memory::step_memory(
                &model_config,
                crate::memory_plan::decode_shape(shape, runner.kv().decode_gathers()),
            );
            let plan = crate::memory_plan::plan(
                weights,
                &runner,
                step,
                decode,
                kv.cache_limit,
                crate::memory_plan::LimitSetting::from_env()?,
            )?;
            weft_models::memory::reset_peak()?;
            let gpu = runner.kv().uses_kernel();
            let t = std::time::Instant::now();
            warm_up(&mut runner, gpu)?;
            tracing::info!(
                ms = t.elapsed().as_millis() as u64,
                "warm-up steps ran (first use of each step kind)"
            );
            let warm_peak = weft_models::memory::mlx_memory().ok().map(|m| m.peak);
            crate::memory_plan::log(&plan, warm_peak);
            if let Ok(mut p) = plan_out.lock() {
                *p = Some(plan);
            }
            let t = std::time::Instant::now();
            let warm_context = WARM_CONTEXT.min(context as usize);
            let traced = runner.warm_decode(kv.max_batch_rows, warm_context)?;
            if traced > 0 {
                tracing::info!(
                    buckets = traced,
                    ms = t.elapsed().as_millis() as u64,
                    short_prompt_tokens = runner.short_chunks(),
                    "compiled decode steps traced for every batch size up to {} rows (plus up to \
                     {} prompt tokens run as decoding rows) and tables up to {warm_context} tokens",
                    kv.max_batch_rows,
                    runner.short_chunks()
                );
            }
            let t = std::time::Instant::now();
            let traced = runner.warm_prefill(warm_context)?;
            if traced > 0 {
                tracing::info!(
                    buckets = traced,
                    ms = t.elapsed().as_millis() as u64,
                    "compiled prefill traced for every fresh bucket and one row's chunks up to \
                     {warm_context} tokens deep"
                );
            }
            let t = std::time::Instant::now();
            let traced = runner.warm_mixed(kv.max_batch_rows, warm_context)?;
            if traced > 0 {
                tracing::info!(
                    buckets = traced,
                    ms = t.elapsed().as_millis() as u64,
                    "compiled mixed steps traced: up to {} decoding rows beside one chunk up to \
                     {warm_context} tokens deep, up to {} beside a fresh prompt of up to {} tokens",
                    weft_models::runner::mixed_warm_rows().min(kv.max_batch_rows),
                    kv.max_batch_rows,
                    weft_models::runner::mixed_wide_tokens()
                );
            }
            let gpu = runner.kv().uses_kernel();
            Ok(MlxModel::with_sampling(runner, eos, SampleOn::from_env(gpu)?).with_faults(faults))
        },
        Arc::new(TokenizerDetok(tokenizer.clone())),
    )?;
    let mut served = served;
    if let Some(plan) = planned.lock().ok().and_then(|p| *p) {
        served.memory = plan;
    }
    let started = served_adapters
        .lock()
        .map(|mut a| std::mem::take(&mut *a))
        .unwrap_or_default();
    served.adapters = Arc::new(AdapterCatalog::new(started, root));
    Ok((engine, tokenizer, served))
}

/// The startup line operators size a deployment by: blocks, bytes, block
/// size and what that holds in rows x context. Context is what the
/// full-attention group holds (every row keeps its whole context there); a
/// sliding-window group, when the model has one, is reported beside it: its
/// blocks and bytes, sized to the rows' windows.
fn log_kv(runner: &BatchRunner, max_rows: usize, context: u64) {
    let g = runner.kv_groups();
    let blocks = g.groups.first().map_or(0, |s| u64::from(s.num_blocks));
    let sliding = g.groups.get(1).map_or(0, |s| u64::from(s.num_blocks));
    let shape = runner.kv().shape();
    let (full_layers, sliding_layers) = shape.layer_counts();
    let per_layer_block = shape.bytes_per_layer_token() * u64::from(g.block_size);
    let tokens = blocks * u64::from(g.block_size);
    let rows = max_rows.max(1) as u64;
    let split = if g.groups.len() == 2 {
        format!(
            "; full-attention layers {full_layers} x {blocks} blocks ({} bytes), sliding-window layers {sliding_layers} x {sliding} blocks ({} bytes, windows only)",
            (blocks + 1) * full_layers as u64 * per_layer_block,
            (sliding + 1) * sliding_layers as u64 * per_layer_block,
        )
    } else {
        String::new()
    };
    let state = if runner.kv().has_state() {
        format!(
            "; recurrent layers' state: {} slots ({} bytes, one per row a step holds)",
            runner.kv().state_slots(),
            runner.kv().state_bytes()
        )
    } else {
        String::new()
    };
    tracing::info!(
        kv_blocks = blocks,
        kv_sliding_blocks = sliding,
        kv_state_slots = runner.kv().state_slots(),
        kv_block_size = g.block_size,
        kv_bytes = runner.kv().bytes(),
        kv_bytes_per_token = shape.bytes_per_token(),
        kv_dtype = shape.kv_dtype(),
        kv_tokens = tokens,
        paged_decode_kernel = runner.kv().uses_kernel(),
        "KV pool: {tokens} tokens = {rows} rows x {} tokens each, or {} rows at the model's full context of {context}{split}{state}",
        tokens / rows,
        tokens / context.max(1),
    );
}

/// One throwaway prefill and decode (blocks from a private pool over the
/// same storage, given back after) so the first request does not pay for
/// MLX's first-use setup.
/// Runs one step of each kind the scheduler plans before the server says it
/// is ready, so MLX's one-time costs (NVRTC compiles of the kernels a step
/// kind needs, cuDNN plans, first allocations) are not paid by the first
/// requests: measured on the H200, a cold server's first batched prefill of
/// 16 rows took 6.2 s and a mixed step 2.7 s, the same steps ~90 ms once
/// warm (benches/RESULTS.md). Steps: one row, one decode token, a ragged
/// prefill of three fresh rows, a mixed step (decode rows beside a
/// continuation chunk), a decode step of four rows, and on the GPU a long
/// continuation and a ragged prefill of 16 fresh rows; rows sample greedily,
/// with temperature / top-k / top-p, and with logprobs. The blocks written here are the pool's own and are simply
/// overwritten once the scheduler hands them out.
/// `gpu` adds the GPU's steps. Each step fits the runner's pool, however small.
fn warm_up(runner: &mut BatchRunner, gpu: bool) -> anyhow::Result<()> {
    use weft_scheduler::kv_pool::{KvPool, OwnerId, SeqSpec};
    let mut pool = KvPool::new(runner.kv_groups().clone())?;
    // On the GPU, 16 more rows for a wide ragged prefill of ~128-token prompts: the
    // first one a cold H200 server met took 6.8 s with every other step kind
    // warmed, the same step ~25 ms after (benches/RESULTS.md).
    let wide = if gpu { 16 } else { 0 };
    // A recurrent model's rows each hold a state slot: as many rows as it has.
    let stateful = runner.kv().has_state();
    let slots = runner.kv().state_slots() as usize;
    if stateful && slots < 4 {
        return Ok(());
    }
    let wide = if stateful { wide.min(slots - 4) } else { wide };
    let spec = |i: usize| {
        let s = SeqSpec::new(OwnerId(i as u32));
        if stateful {
            s.with_state_slot()
        } else {
            s
        }
    };
    let seqs = (0..4 + wide)
        .map(|i| pool.allocate(spec(i)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut lens = vec![0usize; seqs.len()];
    let long = if gpu { 600 } else { 0 };
    let ragged: Vec<(usize, usize)> = (4..4 + wide).map(|i| (i, 120 + (i * 5) % 17)).collect();
    let plan: [&[(usize, usize)]; 7] = [
        &[(0, 4)],
        &[(0, 1)],
        &[(1, 37), (2, 9), (3, 130)],
        &[(0, 1), (1, 1), (2, 70), (3, 1)],
        &[(0, 1), (1, 1), (2, 1), (3, 1)],
        &[(3, long)],
        &ragged,
    ];
    let vocab = (runner.model().config.vocab_size as u32).max(2);
    let bs = pool.block_size();
    for (k, step) in plan.iter().enumerate() {
        if k + 1 == plan.len() {
            // The wide prefill's rows are fresh: the first rows' blocks go back first.
            for &s in &seqs[..4] {
                pool.release(s)?;
            }
        }
        let mut step: Vec<(usize, usize)> = step.iter().copied().filter(|&(_, n)| n > 0).collect();
        // Every step fits the pool it warms: a small pool (`bench-engine` of one
        // row sizes it to that row) loses the wide step's last rows and a shorter
        // long one, instead of failing the start.
        let free = (0..pool.num_groups())
            .map(|g| pool.group(g).map_or(0, |p| p.stats().free))
            .min()
            .unwrap_or(0);
        let need = |i: usize, n: usize| (lens[i] + n).div_ceil(bs) - lens[i].div_ceil(bs);
        while step.len() > 1 && step.iter().map(|&(i, n)| need(i, n)).sum::<usize>() > free {
            step.pop();
        }
        if let [(i, n)] = step.as_mut_slice() {
            // The most tokens this row can add: its last block's room plus free blocks.
            *n = (*n).min((lens[*i].div_ceil(bs) + free) * bs - lens[*i]);
        }
        step.retain(|&(_, n)| n > 0);
        if step.is_empty() {
            continue;
        }
        pool.begin()?;
        let mut rows = Vec::with_capacity(step.len());
        let mut sampling = Vec::with_capacity(step.len());
        for &(i, n) in &step {
            pool.append(seqs[i], n)?;
            let mut blocks = Vec::with_capacity(pool.num_groups());
            for g in 0..pool.num_groups() {
                let mut b = RowBlocks::default();
                b.copy_from(&pool.table(seqs[i], g)?);
                blocks.push(b);
            }
            rows.push(RowStep {
                row: u64::MAX - i as u64,
                start_pos: lens[i],
                want_logits: true,
                draft: 0,
                blocks,
                tokens: (0..n)
                    .map(|t| 1 + ((t * 7 + i * 13) as u32) % (vocab - 1))
                    .collect(),
                adapter: None,
                state_slot: pool.sequence(seqs[i])?.state_slot,
            });
            sampling.push(match i {
                1 => SampleRow {
                    temperature: 0.8,
                    top_k: 40,
                    top_p: 0.9,
                    uniforms: vec![0.5],
                    ..SampleRow::default()
                },
                2 => SampleRow {
                    logprobs: Some(2),
                    ..SampleRow::default()
                },
                _ => SampleRow::default(),
            });
        }
        runner.forward_sampled(pool.step_ops(), &rows, &sampling)?;
        runner.commit()?;
        pool.commit()?;
        for &(i, n) in &step {
            lens[i] += n;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The warm-up fits any pool: `bench-engine --streams 1` on the GPU sizes the
    /// pool to one row (75 blocks on the 1.2B model) and the GPU steps (a
    /// 600-token continuation, 16 fresh ~128-token rows) need ~200; the start
    /// failed with "KV pool exhausted". Here the GPU steps run on the CPU over
    /// pools of 12 and 75 blocks, and over one large enough for all of them.
    #[test]
    fn the_warm_up_fits_a_small_pool() {
        let dir = resolve_model("", false).expect("the default model");
        let opts = LoadOptions::default();
        for blocks in [12u32, 75, 400] {
            let loaded = weft_models::load(&dir, opts).expect("load");
            let mut runner =
                BatchRunner::with_memory(loaded.model, 16, weft_models::KvMemory::Blocks(blocks))
                    .expect("runner");
            warm_up(&mut runner, true).unwrap_or_else(|e| panic!("{blocks} blocks: {e:#}"));
        }
    }

    /// MLX's allocation failures are recognised as such (the scheduler then
    /// splits the batch instead of retrying it whole); other errors are not.
    #[test]
    fn allocation_failures_are_out_of_memory() {
        for oom in [
            INJECTED_ALLOCATION_FAILURE,
            "mlx: [malloc] Unable to allocate 4294967296 bytes.",
            "mlx: [metal::malloc] Attempting to allocate 9000000000 bytes which is greater than the maximum allowed buffer size",
            "mlx: [cuda::malloc] CUDA error: out of memory",
            "mlx: std::bad_alloc",
        ] {
            assert!(is_allocation_failure(oom), "{oom}");
            let e = failed(weft_models::ModelError::Weights(oom.into()));
            assert!(matches!(e, ModelError::OutOfMemory(_)), "{oom}");
        }
        for other in [
            "[reshape] Cannot reshape array of size 6 into shape (4)",
            "mlx: [matmul] Last dimension of first input with shape (2,3) must match",
        ] {
            assert!(!is_allocation_failure(other), "{other}");
            let e = failed(weft_models::ModelError::Weights(other.into()));
            assert!(matches!(e, ModelError::Failed(_)), "{other}");
        }
        assert!(matches!(
            failed(weft_models::ModelError::Invalid("x".into())),
            ModelError::Contract(_)
        ));
    }
}
