//! The server's memory plan (issue 17 item 3): what the weights, the KV pool,
//! the largest step and MLX's buffer cache may take, computed once the model
//! is loaded, logged at startup and exported as gauges beside what MLX and the
//! process hold now, so an operator (and the soak benchmark) can check that
//! memory stays inside what the server says.

use metrics::{describe_gauge, gauge};
use weft_models::memory::{self, StepMemory, StepShape};
use weft_models::{BatchRunner, ModelConfig};

pub const PLAN_BYTES: &str = "weft_memory_plan_bytes";
pub const MLX_ACTIVE: &str = "weft_mlx_active_memory_bytes";
pub const MLX_CACHE: &str = "weft_mlx_cache_memory_bytes";
pub const MLX_PEAK: &str = "weft_mlx_peak_memory_bytes";
pub const RESIDENT: &str = "weft_process_resident_memory_bytes";

/// `--mlx-cache-limit`: how many bytes of freed buffers MLX keeps for reuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub enum CacheLimit {
    /// What the steady decode steps free and allocate again (every row
    /// decoding with its longest draft; [`decode_shape`]), so they reuse
    /// buffers and a prefill's larger ones go back to the system allocator.
    /// On the CPU one step's bound (MLX frees each layer's intermediates as
    /// the next layer runs). On a GPU a step's buffers are all released when
    /// the device completes it, and two steps are in flight (the pipelined
    /// loop), so twice every layer's activations and the logits
    /// ([`auto_cache_limit`]). (Measured on the CPU: capped at the largest
    /// step's bound, the cache filled to it with buffers of the many prefill
    /// shapes and RSS grew 59% over a 90 s mixed run.)
    Auto,
    Bytes(u64),
    /// MLX's own default (up to its memory limit: not bounded by the plan).
    Off,
}

impl TryFrom<String> for CacheLimit {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl std::str::FromStr for CacheLimit {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        if t.eq_ignore_ascii_case("off") {
            return Ok(Self::Off);
        }
        crate::server::config::parse_bytes(t)
            .map(Self::Bytes)
            .map_err(|e| format!("--mlx-cache-limit {s:?}: {e:#} (or auto, off)"))
    }
}

/// What the server plans to hold, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryPlan {
    /// Weights (MLX's active bytes once the model is loaded).
    pub weights: u64,
    /// The paged KV pool, allocated at startup.
    pub kv: u64,
    /// The LoRA adapter pool (`--adapter`), allocated at startup.
    pub adapters: u64,
    /// Bound of the largest step's allocations ([`StepMemory`]).
    pub step_activations: u64,
    pub step_attention: u64,
    pub step_logits: u64,
    pub step_gather: u64,
    /// Recurrent layers' state the step reads, writes and journals (hybrids).
    pub step_recurrent: u64,
    /// MLX's buffer-cache cap; `None` when left to MLX (unbounded by the plan).
    pub cache_limit: Option<u64>,
    /// MLX's memory limit where the server sets it ([`mlx_limit`]): on a GPU,
    /// the point past which MLX's evaluation waits for the device.
    pub mlx_limit: Option<u64>,
}

impl MemoryPlan {
    pub fn step(&self) -> u64 {
        self.step_activations
            + self.step_attention
            + self.step_logits
            + self.step_gather
            + self.step_recurrent
    }

    /// Everything MLX may hold at once under the plan; `None` when the cache
    /// is not capped.
    pub fn total(&self) -> Option<u64> {
        self.cache_limit
            .map(|c| self.weights + self.kv + self.adapters + self.step() + c)
    }

    /// Sets the plan gauges (`weft_memory_plan_bytes{part=...}`).
    pub fn export(&self) {
        let parts = [
            ("weights", Some(self.weights)),
            ("kv", Some(self.kv)),
            ("adapters", Some(self.adapters)),
            ("step", Some(self.step())),
            ("cache_limit", self.cache_limit),
            ("mlx_limit", self.mlx_limit),
            ("total", self.total()),
        ];
        for (part, v) in parts {
            if let Some(v) = v {
                gauge!(PLAN_BYTES, "part" => part).set(v as f64);
            }
        }
    }
}

/// The largest step the scheduler may plan for `config` on this runner.
pub fn step_shape(
    model: &ModelConfig,
    runner: &BatchRunner,
    max_step_tokens: usize,
    max_rows: usize,
    speculate: usize,
) -> StepShape {
    let g = runner.kv_groups();
    let pool_tokens = g
        .groups
        .first()
        .map_or(0, |s| u64::from(s.num_blocks) * u64::from(g.block_size));
    let tokens = max_step_tokens as u64;
    let gpu = runner.kv().uses_kernel();
    StepShape {
        tokens,
        // Every row with its longest draft, or a decode step's padded rows with
        // its short chunks beside them (each a row of its logits).
        sampled: ((max_rows * (1 + speculate)).max(runner.largest_decode_rows(max_rows)) as u64)
            .min(tokens),
        context: (model.max_position_embeddings.max(1) as u64).min(pool_tokens.max(1)),
        act_bytes: match runner.kv().shape().dtype {
            mlx_rs::Dtype::Float32 => 4,
            _ => 2,
        },
        chunked: gpu,
        // Rows continuing a prompt (chunks, prefix hits) gather their
        // context: at most one per token of the step, and max_rows.
        gathered_rows: (max_rows as u64).min(tokens),
        gather_bytes_per_token: runner.kv().gather_bytes_per_token(),
        rows: max_rows as u64,
        adapter_per_token: runner.adapters().map_or(0, |p| p.step_elements_per_token()),
    }
}

/// A step of `shape`'s rows all decoding: one token and the longest draft
/// each, no attention scores kept (the paged kernels and the CPU's host
/// attention read the pool in place), and their contexts gathered only where
/// decode gathers (`decode_gathers`: a quantized pool without the paged
/// kernel; a CPU pool in another dtype than f32).
pub fn decode_shape(shape: StepShape, decode_gathers: bool) -> StepShape {
    StepShape {
        tokens: shape.sampled,
        context: if decode_gathers { shape.context } else { 0 },
        gathered_rows: if decode_gathers {
            shape.gathered_rows
        } else {
            0
        },
        ..shape
    }
}

/// [`CacheLimit::Auto`]'s bytes for the decode step bound `decode` of a
/// model of `layers` layers: the bound itself on the CPU; on a GPU
/// (`gpu`), where a step's intermediates live until the device completes
/// it and the next step is built meanwhile, two steps of every layer's
/// activations, logits, gathers and recurrent state. Below that, freed
/// buffers go back to the device allocator every step and the next step
/// allocates them again, a host cost per buffer on the step's critical path.
pub fn auto_cache_limit(decode: StepMemory, layers: i32, gpu: bool) -> u64 {
    if !gpu {
        return decode.total();
    }
    let layers = u64::try_from(layers.max(1)).unwrap_or(1);
    let step = decode
        .activations
        .saturating_mul(layers)
        .saturating_add(decode.total() - decode.activations);
    step.saturating_mul(2)
}

/// `WEFT_MLX_MEMORY_LIMIT`: `off` leaves MLX's memory limit as MLX set it; a
/// size (`72GiB`, bytes) sets it; unset, [`mlx_limit`] on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitSetting {
    Planned,
    Off,
    Bytes(u64),
}

impl LimitSetting {
    pub fn from_env() -> anyhow::Result<Self> {
        Self::parse(std::env::var("WEFT_MLX_MEMORY_LIMIT").ok().as_deref())
    }

    /// The setting `WEFT_MLX_MEMORY_LIMIT`'s value (`None`: unset) says.
    pub fn parse(v: Option<&str>) -> anyhow::Result<Self> {
        match v.map(str::trim) {
            None | Some("") => Ok(Self::Planned),
            Some(t) if t.eq_ignore_ascii_case("off") => Ok(Self::Off),
            Some(t) => crate::server::config::parse_bytes(t)
                .map(Self::Bytes)
                .map_err(|e| anyhow::anyhow!("WEFT_MLX_MEMORY_LIMIT {t:?}: {e:#} (or off)")),
        }
    }
}

/// MLX's memory limit for a GPU plan whose parts sum to `total` (the cache cap
/// included), `base` of it held for good (weights, KV pool, adapters) and `step`
/// the largest step's bound. MLX keeps every input of a committed command buffer
/// alive until the device completes it, so a GPU step's intermediates are not
/// freed layer by layer as on the CPU: while the host runs ahead of the device,
/// the buffers of many layers, and of the two steps in flight, live at once, far
/// more than the one layer the step bound counts. What holds them is MLX's memory
/// limit: past it MLX's evaluation waits, between two operations, for committed
/// work to complete. Left at MLX's own (95% of the device), an H100's soak
/// (2026-12-07) peaked at 77.6 GB, 1.5 GiB over its plan, the peak climbing in
/// steps to that limit and stopping ~0.1 GiB past it (what the wait cannot hold
/// back: the operation being evaluated, each evaluation's last command buffer).
/// So the limit sits one step bound below the plan's total (the in-flight
/// buffers share the cache's room), and at least one step bound above what is
/// held for good, so that a step alone never waits.
pub fn mlx_limit(total: u64, base: u64, step: u64) -> u64 {
    total.saturating_sub(step).max(base.saturating_add(step))
}

/// Plans memory once the runner holds its KV pool: `weights` is what the
/// model took to load. Caps MLX's buffer cache as `limit` says (`decode`:
/// the full decode step's bound, for [`CacheLimit::Auto`]).
pub fn plan(
    weights: u64,
    runner: &BatchRunner,
    step: StepMemory,
    decode: StepMemory,
    limit: CacheLimit,
    mlx_limit_setting: LimitSetting,
) -> anyhow::Result<MemoryPlan> {
    let gpu = weft_models::loader::cuda_available();
    let cache_limit = match limit {
        CacheLimit::Auto => Some(auto_cache_limit(
            decode,
            runner.model().config.num_layers,
            gpu,
        )),
        CacheLimit::Bytes(b) => Some(b),
        CacheLimit::Off => None,
    };
    if let Some(c) = cache_limit {
        memory::set_cache_limit(c)?;
    }
    let mut plan = MemoryPlan {
        weights,
        kv: runner.kv().bytes(),
        adapters: runner.adapters().map_or(0, |p| p.bytes()),
        step_activations: step.activations,
        step_attention: step.attention,
        step_logits: step.logits,
        step_gather: step.gather,
        step_recurrent: step.recurrent,
        cache_limit,
        mlx_limit: None,
    };
    // The CPU evaluates synchronously and frees each intermediate as its last
    // reader runs: nothing is in flight for a limit to hold back.
    plan.mlx_limit = match (mlx_limit_setting, gpu, plan.total()) {
        (LimitSetting::Off, _, _) => None,
        (LimitSetting::Bytes(b), _, _) => Some(b),
        (LimitSetting::Planned, true, Some(total)) => Some(mlx_limit(
            total,
            plan.weights + plan.kv + plan.adapters,
            plan.step(),
        )),
        (LimitSetting::Planned, _, _) => None,
    };
    if let Some(l) = plan.mlx_limit {
        memory::set_memory_limit(l)?;
    }
    Ok(plan)
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// The startup line: every part of the plan and its total.
pub fn log(plan: &MemoryPlan, warm_up_peak: Option<u64>) {
    let total = plan
        .total()
        .map_or_else(|| "unbounded (--mlx-cache-limit off)".to_string(), mib);
    tracing::info!(
        weights_bytes = plan.weights,
        kv_bytes = plan.kv,
        adapter_bytes = plan.adapters,
        step_bytes = plan.step(),
        cache_limit_bytes = plan.cache_limit,
        total_bytes = plan.total(),
        warm_up_peak_bytes = warm_up_peak,
        mlx_limit_bytes = plan.mlx_limit,
        "memory plan: weights {} + KV pool {} + adapters {} + largest step {} (activations {}, attention scores {}, logits {}, gathered K/V {}, recurrent state {}) + MLX buffer cache {} = {total}; MLX's memory limit {}; the warm-up peaked at {}",
        mib(plan.weights),
        mib(plan.kv),
        mib(plan.adapters),
        mib(plan.step()),
        mib(plan.step_activations),
        mib(plan.step_attention),
        mib(plan.step_logits),
        mib(plan.step_gather),
        mib(plan.step_recurrent),
        plan.cache_limit.map_or_else(|| "uncapped".to_string(), mib),
        plan.mlx_limit
            .map_or_else(|| "MLX's own".to_string(), |l| format!("{} (MLX waits for the device past it)", mib(l))),
        warm_up_peak.map_or_else(|| "?".to_string(), mib),
    );
}

/// Describes the gauges (once, with the recorder installed).
pub fn describe() {
    describe_gauge!(
        PLAN_BYTES,
        "Memory plan in bytes by part (weights, kv, adapters, step, cache_limit, mlx_limit, total), set at startup"
    );
    describe_gauge!(
        MLX_ACTIVE,
        "Bytes MLX holds in live arrays; refreshed at each scrape"
    );
    describe_gauge!(
        MLX_CACHE,
        "Bytes of freed buffers MLX keeps for reuse; refreshed at each scrape"
    );
    describe_gauge!(
        MLX_PEAK,
        "Most bytes MLX held in live arrays since startup; refreshed at each scrape"
    );
    describe_gauge!(
        RESIDENT,
        "Resident set size of the server process in bytes; refreshed at each scrape"
    );
}

/// Refreshes the live gauges: MLX's counters and the process's RSS.
pub fn refresh() {
    if let Ok(m) = memory::mlx_memory() {
        gauge!(MLX_ACTIVE).set(m.active as f64);
        gauge!(MLX_CACHE).set(m.cache as f64);
        gauge!(MLX_PEAK).set(m.peak as f64);
    }
    if let Some(rss) = resident_bytes() {
        gauge!(RESIDENT).set(rss as f64);
    }
}

/// What loading the model took: MLX's active bytes, and on the CPU at least
/// the growth of RSS over the load (`rss_before`), which also counts weights
/// kept outside MLX (the packed CPU GEMM's).
pub fn weights_bytes(device: weft_models::Device, rss_before: Option<u64>) -> anyhow::Result<u64> {
    let active = memory::mlx_memory()?.active;
    let host = match (device, rss_before, resident_bytes()) {
        (weft_models::Device::Cpu, Some(a), Some(b)) => b.saturating_sub(a),
        _ => 0,
    };
    Ok(active.max(host))
}

/// The process's resident set size, from `/proc/self/statm` (Linux).
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().map(|p| pages * p)
}

/// Watches MLX's peak across steps and logs each step that raised it by more
/// than [`PeakWatch::STEP`]: what the steps in flight then were (rows, tokens,
/// prefill rows, longest context), to find which step kind takes memory the
/// plan does not count.
#[derive(Debug, Default)]
pub struct PeakWatch {
    last: u64,
    /// The steps submitted and not yet collected (at most two when pipelined).
    in_flight: std::collections::VecDeque<String>,
}

impl PeakWatch {
    /// Growth of the peak worth a line.
    pub const STEP: u64 = 64 << 20;

    /// Notes a submitted step.
    pub fn submitted(&mut self, batch: &[weft_scheduler::RowInput]) {
        let tokens: usize = batch.iter().map(|r| r.tokens.len()).sum();
        let prefill = batch
            .iter()
            .filter(|r| r.tokens.len() > 1 + r.draft)
            .count();
        let context = batch
            .iter()
            .map(|r| r.start_pos + r.tokens.len())
            .max()
            .unwrap_or(0);
        if self.in_flight.len() >= 2 {
            self.in_flight.pop_front();
        }
        self.in_flight.push_back(format!(
            "{} rows, {tokens} tokens, {prefill} prefilling, longest context {context}",
            batch.len()
        ));
    }

    /// After a step was read: logs if MLX's peak grew.
    pub fn collected(&mut self) {
        let Ok(m) = memory::mlx_memory() else {
            return;
        };
        if m.peak > self.last + Self::STEP {
            let steps: Vec<&str> = self.in_flight.iter().map(String::as_str).collect();
            tracing::debug!(
                peak_bytes = m.peak,
                active_bytes = m.active,
                grew_bytes = m.peak - self.last,
                "MLX peak grew by {:.1} MiB to {:.1} MiB with the steps in flight: {}",
                (m.peak - self.last) as f64 / (1u64 << 20) as f64,
                m.peak as f64 / (1u64 << 20) as f64,
                steps.join(" | ")
            );
        }
        self.last = self.last.max(m.peak);
        self.in_flight.pop_front();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mlx_limit_leaves_a_step_below_the_total_and_one_above_what_is_held() {
        const MIB: u64 = 1 << 20;
        // The H100 soak's plan (2026-12-07): weights 2232 + pool 66244 MiB held,
        // a step bound of 2273 MiB, a 5318 MiB cache cap.
        let (base, step, cache) = ((2232 + 66244) * MIB, 2273 * MIB, 5318 * MIB);
        let total = base + step + cache;
        let l = mlx_limit(total, base, step);
        assert_eq!(l, total - step);
        assert_eq!(l, base + cache);
        assert!(l >= base + step);
        // A small cache cap: the limit never drops below one step over what is
        // held, where every step would wait for the device.
        let total = base + step + 10 * MIB;
        assert_eq!(mlx_limit(total, base, step), base + step);
        assert_eq!(mlx_limit(0, 0, 0), 0);
    }

    #[test]
    fn the_mlx_limit_setting_reads_off_sizes_and_refuses_the_rest() {
        assert_eq!(LimitSetting::parse(None).unwrap(), LimitSetting::Planned);
        assert_eq!(
            LimitSetting::parse(Some(" ")).unwrap(),
            LimitSetting::Planned
        );
        assert_eq!(LimitSetting::parse(Some("OFF")).unwrap(), LimitSetting::Off);
        assert_eq!(
            LimitSetting::parse(Some("2GiB")).unwrap(),
            LimitSetting::Bytes(2 << 30)
        );
        let e = LimitSetting::parse(Some("lots")).unwrap_err().to_string();
        assert!(e.contains("WEFT_MLX_MEMORY_LIMIT"), "{e}");
    }

    #[test]
    fn the_auto_cache_limit_holds_two_whole_decode_steps_on_a_gpu() {
        let decode = StepMemory {
            activations: 4_620_288,
            logits: 37_748_736,
            gather: 1000,
            recurrent: 10,
            attention: 0,
        };
        // CPU: one step's bound (one layer's intermediates live at a time).
        assert_eq!(auto_cache_limit(decode, 22, false), decode.total());
        // GPU: every layer's activations and the rest, for two steps in flight.
        let step = 22 * 4_620_288 + 37_748_736 + 1000 + 10;
        assert_eq!(auto_cache_limit(decode, 22, true), 2 * step);
        assert!(auto_cache_limit(decode, 0, true) >= 2 * decode.total());
    }
}
