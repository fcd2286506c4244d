//! A deterministic fake model and detokenizer for tests and benchmarks.
//!
//! The logits of a row are a hash of its whole token history (ids and positions), so any
//! state corruption — a lost or duplicated token, a wrong position, a chunk applied twice
//! — changes every later output. The fake also checks the [`Model`] contract itself and
//! records violations instead of panicking.
//!
//! # KV storage
//! Like the real model, the fake keeps its KV in blocks the scheduler's pool hands out:
//! a shadow storage keyed by (group, block, offset) holding `(token, position, chain)`,
//! where `chain` is the history hash after that token. A forward first applies the
//! step's [`StorageOp::CopyBlock`]s, then writes every fed token into the slot its row's
//! table names (directly, not staged, as the MLX storage does), and takes a row's
//! history from the chain stored at `start_pos - 1` through the row's table. So a prefix
//! hit continues exactly like a cold prefill, and a wrong, stale or foreign block
//! changes the outputs. With [`FakeConfig::verify_kv`] every forward also re-walks each
//! row's slots `0..start_pos` through its table and records a violation if one is
//! missing or its chain does not follow from the one before.

use std::collections::{HashMap, VecDeque};

use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

use crate::model::{
    Detokenizer, KvGroups, Model, ModelError, ModelInfo, RowId, RowInput, StepOutput, StorageOp,
};
use crate::sampling::HostSampler;
use crate::step_cost::ShortPrompts;
use crate::util::{mix64, IdBuild, IdMap};

const HISTORY_SEED: u64 = 0x243f_6a88_85a3_08d3;
/// XORed into the chains a failed forward writes: KV of a step that never committed
/// (some layers written, others not) is garbage to anyone who reads it later.
const TORN_WRITE: u64 = 0xdead_beef_0bad_f00d;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeLogits {
    /// Every logit is a hash of (history, vocab id): outputs depend on exact state.
    Hash,
    /// One-hot at a hashed id; the cheapest forward, for scheduler-overhead benchmarks.
    Trivial,
    /// Every logit is a hash of (last token, vocab id): greedy output is a walk on a
    /// fixed graph that soon loops, the kind of text prompt-lookup drafts predict.
    LastToken,
}

#[derive(Debug, Clone)]
pub struct FakeConfig {
    pub vocab_size: usize,
    pub max_context: usize,
    pub eos_token_ids: Vec<u32>,
    /// Simulated layers (mid-forward faults fire after one of them).
    pub layers: usize,
    pub logits: FakeLogits,
    /// Tokens per KV block (a power of two), reported in `ModelInfo::kv`.
    pub kv_block_size: u32,
    /// KV blocks of the fake's storage (one full-attention group).
    pub kv_blocks: u32,
    /// A second KV group whose tables slide over this many tokens (Gemma 3's local
    /// layers): every fed token is written through both tables, and each row's
    /// window is re-read through the sliding one.
    pub sliding_window: Option<u32>,
    /// Blocks of that sliding-window group (None: `kv_blocks`, as many as the full
    /// group). Fewer is what a real model sizes it to: only the windows are held.
    pub sliding_blocks: Option<u32>,
    /// Re-walk every row's context through its table in every forward (O(context) per
    /// row; benchmarks turn it off).
    pub verify_kv: bool,
    /// A simulated cost per forward, reported as [`Model::last_step_seconds`] (None:
    /// the scheduler times the fake's real, near-zero, forwards).
    pub step_cost: Option<FakeStepCost>,
    /// Whether the fake takes a step's sampling after its forward
    /// ([`Model::defers_sampling`]); without it a pipelined scheduler runs rows with
    /// penalties or a constraint one step at a time.
    pub defer_sampling: bool,
    /// LoRA adapters resident at once ([`ModelInfo::adapter_slots`]; 0: none served).
    /// With slots, every adapter a row names must be registered
    /// ([`Model::add_adapter`]) and a forward may name at most this many; residency is
    /// simulated (least recently used evicted) for [`Model::adapter_counters`].
    pub adapter_slots: usize,
    /// Recurrent-state slots (an SSM / linear-attention hybrid; 0: none): every row
    /// names one ([`RowInput::state_slot`]), whose state must be the row's history
    /// hash at `start_pos` (a new row, at 0, starts from a zero state); the forward
    /// leaves the state after its tokens there, staged until commit. Such a model
    /// takes no drafts.
    pub state_slots: u32,
    /// With a `step_cost`: a decode-only step collected after `submit` (pipelined)
    /// reports no seconds, as a real model reports none: the scheduler times it
    /// itself (here: the fake's real, near-zero, time; steps with a prompt chunk keep
    /// their simulated cost, so the cost model still sees what chunks cost).
    pub unmeasured_pipelined: bool,
    /// With a `step_cost`: seconds added to a step with a prompt chunk of a length
    /// the fake has not run before (a GPU's first call of a new shape: MLX's CUDA
    /// backend plans every new one). 0: none.
    pub new_shape_cost: f64,
    /// A step that paid `new_shape_cost` says so ([`Model::last_build_traced`]),
    /// as a real model reports the traces of its compiled forms.
    pub reports_traces: bool,
    /// Runs a step's prompt chunks as decoding rows where these limits cover them
    /// ([`Model::short_prompts`], a GPU's compiled decode step): with a `step_cost`,
    /// each of their tokens then costs `per_decode_row` and the step no
    /// `per_mixed_step`.
    pub short_prompts: Option<ShortPrompts>,
}

/// Seconds a fake forward "takes": `base + per_decode_row * rows feeding one token +
/// per_prefill_token * other tokens + per_attention * sum n * (start + n / 2)` over
/// the rows feeding more than one, `+ per_mixed_step` if there is any such row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FakeStepCost {
    pub base: f64,
    pub per_decode_row: f64,
    pub per_prefill_token: f64,
    pub per_attention: f64,
    /// Per context key a prefill chunk reads, whatever its length (a chunk gathers
    /// its whole context out of the pool before attending).
    pub per_context_key: f64,
    /// Each forward's cost times `1 + jitter * u`, `u` in [-1, 1) from a hash of the
    /// forward's number: a device shared with other work (0: none).
    pub jitter: f64,
    /// Decoding rows and prefill run side by side (a CPU's two lanes): a step costs
    /// `base` plus the larger of its decode and its prefill parts, not their sum.
    pub overlap: bool,
    /// Added to a step with any row feeding more than one token (a GPU runs plain
    /// decode steps compiled, the others op by op).
    pub per_mixed_step: f64,
}

impl FakeStepCost {
    pub fn of(&self, batch: &[RowInput]) -> f64 {
        self.of_with(batch, None)
    }

    /// [`of`](Self::of) on a model that runs prompt chunks `short` covers as
    /// decoding rows.
    pub fn of_with(&self, batch: &[RowInput], short: Option<ShortPrompts>) -> f64 {
        let as_rows = short.is_some_and(|sp| {
            batch.iter().all(|r| r.draft == 0)
                && sp.covers(
                    batch
                        .iter()
                        .filter(|r| r.tokens.len() > 1)
                        .map(|r| (r.start_pos, r.tokens.len())),
                )
        });
        if as_rows {
            let rows: usize = batch.iter().map(|r| r.tokens.len()).sum();
            return self.base + self.per_decode_row * rows as f64;
        }
        let (mut decode, mut prefill) = (0.0, 0.0);
        for r in batch {
            let n = r.tokens.len();
            if n == 1 {
                decode += self.per_decode_row;
            } else {
                prefill += self.per_prefill_token * n as f64
                    + self.per_attention * n as f64 * (r.start_pos as f64 + n as f64 / 2.0)
                    + self.per_context_key * r.start_pos as f64;
            }
        }
        let mixed = if batch.iter().any(|r| r.tokens.len() > 1) {
            self.per_mixed_step
        } else {
            0.0
        };
        if self.overlap {
            self.base + mixed + f64::max(decode, prefill)
        } else {
            self.base + mixed + decode + prefill
        }
    }
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            vocab_size: 64,
            max_context: 4096,
            eos_token_ids: vec![0],
            layers: 4,
            logits: FakeLogits::Hash,
            kv_block_size: 16,
            kv_blocks: 4096,
            sliding_window: None,
            sliding_blocks: None,
            verify_kv: true,
            step_cost: None,
            defer_sampling: true,
            adapter_slots: 0,
            state_slots: 0,
            unmeasured_pipelined: false,
            new_shape_cost: 0.0,
            reports_traces: false,
            short_prompts: None,
        }
    }
}

/// Faults the fake model injects into itself.
#[derive(Debug, Clone, Default)]
pub struct FakeFaults {
    /// 1-based forward calls that fail after layer `fail_after_layer`, leaving partial
    /// staged state and torn KV writes behind (the caller must roll back).
    pub forward_fail_calls: Vec<u64>,
    pub fail_after_layer: usize,
    /// 1-based commit calls that fail (the staged state stays until rollback).
    pub commit_fail_calls: Vec<u64>,
    /// Fail forward and commit each with this probability (seeded, deterministic).
    pub random: Option<(u64, f64)>,
    /// 1-based `collect` calls that fail (a device error surfacing when a pipelined
    /// step's results are read): the step's KV writes turn to garbage and it stays
    /// staged until rolled back.
    pub collect_fail_calls: Vec<u64>,
    /// Every forward containing a new row (start_pos 0) whose first token is this one
    /// fails: a request that can never be served, to exercise isolation of persistent
    /// failures without hitting rows that merely generate the token.
    pub poison_token: Option<u32>,
    /// 1-based forward calls that run out of memory (`ModelError::OutOfMemory`), torn
    /// after layer `fail_after_layer` like other forward faults.
    pub oom_calls: Vec<u64>,
    /// Device memory for this many fed tokens: a forward feeding more runs out of
    /// memory (a batch too large for what is left; its halves fit).
    pub memory_tokens: Option<usize>,
    /// 1-based `submit_sampling` calls that fail (the step stays open, unsampled,
    /// until rolled back).
    pub sampling_fail_calls: Vec<u64>,
}

/// What the fake knows of a row between steps: the lengths its committed KV may have.
/// After a step with a draft, the scheduler keeps the decoded token and any prefix of
/// the draft, so the next `start_pos` may be anywhere in `lo..=hi`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowState {
    lo: usize,
    hi: usize,
}

/// One step between forward/submit and commit/rollback.
#[derive(Debug, Default)]
struct Staged {
    rows: HashMap<RowId, RowState>,
    /// What a submitted step picked, until `collect` takes it (None: forwarded, or
    /// collected).
    out: Option<StepOutput>,
    /// Its last position's pick per row, for a next step's `follows` rows.
    picks: HashMap<RowId, u32>,
    /// Shadow slots it wrote (a failing collect tears them).
    written: Vec<u64>,
    /// Its forward or collect failed: only a rollback may drop it.
    failed: bool,
    /// The logits of a step queued by `submit_unsampled`, until `submit_sampling`
    /// samples them.
    unsampled: Option<Vec<f32>>,
    /// (decoding rows, other tokens, simulated seconds) under `FakeConfig::step_cost`.
    cost: Option<(usize, usize, f64)>,
    /// State slots it wrote (resets, copies, rows' new state), applied at commit.
    slots: HashMap<u32, SlotState>,
}

/// One recurrent-state slot: the history hash after `len` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SlotState {
    chain: u64,
    len: usize,
}

/// One KV slot of the shadow storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    token: u32,
    pos: usize,
    /// History hash after this token.
    chain: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeStats {
    pub forwards: u64,
    /// Steps queued by `submit` (pipelined), and collected.
    pub submits: u64,
    pub collects: u64,
    pub failed_collects: u64,
    /// Steps queued without their sampling (`submit_unsampled`), their
    /// `submit_sampling` calls, and those that failed.
    pub deferred: u64,
    pub sampling_calls: u64,
    pub failed_samplings: u64,
    /// Most steps staged at once (2: a step was queued behind an outstanding one).
    pub max_staged: usize,
    pub commits: u64,
    pub rollbacks: u64,
    pub failed_forwards: u64,
    pub failed_commits: u64,
    /// Forwards that ran out of memory, and `release_memory` calls.
    pub out_of_memory: u64,
    pub memory_releases: u64,
    /// Forwards of exactly the rows of the forward just before, which ran out of
    /// memory (a batch of several rows retried as it was).
    pub repeated_after_oom: u64,
    pub tokens: u64,
    pub max_batch_rows: usize,
    /// Storage ops applied (copy-on-write block copies).
    pub copies: u64,
    /// Rows that started past position 0 without the fake having seen them (prefix
    /// hits), and slots re-verified through tables.
    pub prefix_rows: u64,
    pub verified_slots: u64,
    /// Every adapter a row of a forward named (None: a row without one).
    pub adapters: std::collections::BTreeSet<Option<u32>>,
    /// Most distinct adapters in one forward.
    pub max_step_adapters: usize,
    /// Rows whose recurrent state was read from their slot and checked, and rows
    /// that started from a zero state (at position 0).
    pub state_reads: u64,
    pub slot_resets: u64,
}

#[derive(Debug)]
pub struct FakeModel {
    cfg: FakeConfig,
    faults: FakeFaults,
    rng: Option<ChaCha8Rng>,
    rows: HashMap<RowId, RowState>,
    /// Steps forwarded or submitted and not yet committed or rolled back, oldest first
    /// (at most two); the newest may be partial after a failed forward.
    staged: VecDeque<Staged>,
    /// The shadow KV storage, keyed by [`slot_key`] of (group, block, offset).
    kv: IdMap<u64, Slot>,
    /// Committed recurrent-state slots.
    state: HashMap<u32, SlotState>,
    /// Per-forward scratch: history hash after each position that needs logits, and
    /// the slots written (conflict check).
    states: Vec<(u64, u32)>,
    written: HashMap<u64, RowId, IdBuild>,
    stats: FakeStats,
    violations: Vec<String>,
    sampler: HostSampler,
    /// The logits the last successful forward sampled from.
    last_logits: Vec<f32>,
    /// The rows of the previous forward if it ran out of memory.
    last_oom_rows: Option<Vec<RowId>>,
    /// Every successful forward's and collect's (decoding rows, other tokens,
    /// simulated seconds) under [`FakeConfig::step_cost`], in the order returned.
    step_costs: Vec<(usize, usize, f64)>,
    /// The last step was a decode-only one collected after `submit` (not run by
    /// `forward`).
    last_unmeasured: bool,
    /// Chunk lengths run so far (for `new_shape_cost`).
    shapes_seen: std::collections::HashSet<usize>,
    /// The last step built paid a first call ([`FakeConfig::reports_traces`]).
    last_traced: bool,
    /// Steps that paid a first call.
    traced_steps: u64,
    /// Registered adapters, and the resident ones with the forward that last used each.
    adapters: std::collections::BTreeSet<u32>,
    resident: Vec<(u32, u64)>,
    adapter_counters: crate::model::AdapterCounters,
}

/// Packs (group, block, offset) into one map key: offsets stay below the block size
/// (at most 1024, 10 bits) and block ids are `u32`.
#[inline]
fn slot_key(group: usize, block: u32, offset: usize) -> u64 {
    ((group as u64) << 42) | (u64::from(block) << 10) | offset as u64
}

impl FakeModel {
    pub fn new(cfg: FakeConfig) -> Self {
        Self::with_faults(cfg, FakeFaults::default())
    }

    pub fn with_faults(cfg: FakeConfig, faults: FakeFaults) -> Self {
        let rng = faults.random.map(|(s, _)| ChaCha8Rng::seed_from_u64(s));
        Self {
            cfg,
            faults,
            rng,
            rows: HashMap::new(),
            staged: VecDeque::new(),
            kv: IdMap::default(),
            state: HashMap::new(),
            states: Vec::new(),
            written: HashMap::default(),
            stats: FakeStats::default(),
            violations: Vec::new(),
            sampler: HostSampler::default(),
            last_logits: Vec::new(),
            last_oom_rows: None,
            step_costs: Vec::new(),
            last_unmeasured: false,
            shapes_seen: Default::default(),
            last_traced: false,
            traced_steps: 0,
            adapters: Default::default(),
            resident: Vec::new(),
            adapter_counters: Default::default(),
        }
    }

    /// (decoding rows, other tokens, simulated seconds) of every step whose picks a
    /// forward or collect returned, under [`FakeConfig::step_cost`], oldest first.
    /// Steps that paid `new_shape_cost` (a first call of a chunk length).
    pub fn traced_steps(&self) -> u64 {
        self.traced_steps
    }

    pub fn step_costs(&self) -> &[(usize, usize, f64)] {
        &self.step_costs
    }

    pub fn stats(&self) -> &FakeStats {
        &self.stats
    }

    /// Contract violations seen so far (should stay empty).
    pub fn violations(&self) -> &[String] {
        &self.violations
    }

    /// Rows with committed state (0 once every request is done: no leaks).
    pub fn live_rows(&self) -> usize {
        self.rows.len()
    }

    /// The adapters registered and not removed.
    pub fn registered_adapters(&self) -> Vec<u32> {
        self.adapters.iter().copied().collect()
    }

    pub fn has_staged(&self) -> bool {
        !self.staged.is_empty()
    }

    /// The logits this model gives after `history` — for oracles in tests.
    pub fn logits_for_history(&self, history: &[u32]) -> Vec<f32> {
        let h = history
            .iter()
            .enumerate()
            .fold(HISTORY_SEED, |h, (p, &t)| step_hash(h, t, p));
        let mut out = vec![0.0; self.cfg.vocab_size];
        self.fill(h, history.last().copied().unwrap_or(0), &mut out);
        out
    }

    /// Checks the batch's adapters against the slots and simulates their residency.
    fn make_resident(&mut self, batch: &[RowInput], call: u64) -> Result<(), ModelError> {
        let named: std::collections::BTreeSet<u32> =
            batch.iter().filter_map(|r| r.adapter).collect();
        self.stats.max_step_adapters = self.stats.max_step_adapters.max(named.len());
        if self.cfg.adapter_slots == 0 {
            return Ok(());
        }
        if named.len() > self.cfg.adapter_slots {
            return Err(self.violation(format!(
                "a forward names {} adapters, {} are resident at once",
                named.len(),
                self.cfg.adapter_slots
            )));
        }
        if let Some(a) = named.iter().find(|a| !self.adapters.contains(a)) {
            return Err(self.violation(format!("adapter {a} is not registered")));
        }
        for &a in &named {
            if let Some(r) = self.resident.iter_mut().find(|r| r.0 == a) {
                r.1 = call;
                continue;
            }
            if self.resident.len() == self.cfg.adapter_slots {
                let victim = self
                    .resident
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| !named.contains(&r.0))
                    .min_by_key(|(_, r)| r.1)
                    .map(|(i, _)| i);
                if let Some(i) = victim {
                    self.resident.swap_remove(i);
                    self.adapter_counters.evictions += 1;
                }
            }
            self.resident.push((a, call));
            self.adapter_counters.loads += 1;
        }
        Ok(())
    }

    fn violation(&mut self, msg: String) -> ModelError {
        self.violations.push(msg.clone());
        ModelError::Contract(msg)
    }

    fn random_fault(&mut self) -> bool {
        match (self.faults.random, self.rng.as_mut()) {
            (Some((_, p)), Some(rng)) => ((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p,
            _ => false,
        }
    }

    fn fill(&self, hash: u64, last: u32, out: &mut [f32]) {
        let v = out.len() as u64;
        match self.cfg.logits {
            FakeLogits::LastToken => {
                let h = mix64(u64::from(last) ^ HISTORY_SEED);
                for (i, o) in out.iter_mut().enumerate() {
                    let x = mix64(h ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    *o = (x >> 40) as f32 / (1u32 << 24) as f32 * 8.0 - 4.0;
                }
            }
            FakeLogits::Hash => {
                for (i, o) in out.iter_mut().enumerate() {
                    let x = mix64(hash ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    *o = (x >> 40) as f32 / (1u32 << 24) as f32 * 8.0 - 4.0;
                }
            }
            FakeLogits::Trivial => {
                if v > 0 {
                    out[(hash % v) as usize] = 1.0;
                }
            }
        }
    }

    fn bs(&self) -> usize {
        self.cfg.kv_block_size.max(1) as usize
    }

    /// The slot holding position `pos` of `r` (through its table in group 0).
    fn locate(&self, r: &RowInput, pos: usize) -> Option<u64> {
        self.locate_in(r, 0, pos)
    }

    /// The slot holding position `pos` of `r` through its table in `group`.
    fn locate_in(&self, r: &RowInput, group: usize, pos: usize) -> Option<u64> {
        let t = r.blocks.get(group)?.as_table(self.bs());
        t.locate(pos).map(|(b, o)| slot_key(group, b, o))
    }

    /// KV groups: full attention, and the sliding window when configured.
    fn groups(&self) -> usize {
        1 + usize::from(self.cfg.sliding_window.is_some())
    }

    /// Blocks of the storage of `group`.
    fn blocks_in(&self, group: usize) -> u32 {
        match group {
            0 => self.cfg.kv_blocks,
            _ => self.cfg.sliding_blocks.unwrap_or(self.cfg.kv_blocks),
        }
    }

    fn apply_ops(
        &mut self,
        ops: &[StorageOp],
        slots: &mut HashMap<u32, SlotState>,
    ) -> Result<(), ModelError> {
        let bs = self.bs();
        for op in ops {
            match *op {
                StorageOp::CopyBlock { group, src, dst } => {
                    if group >= self.groups()
                        || src >= self.blocks_in(group)
                        || dst >= self.blocks_in(group)
                    {
                        return Err(self.violation(format!("storage op out of range: {op:?}")));
                    }
                    for o in 0..bs {
                        match self.kv.get(&slot_key(group, src, o)).copied() {
                            Some(s) => self.kv.insert(slot_key(group, dst, o), s),
                            None => self.kv.remove(&slot_key(group, dst, o)),
                        };
                    }
                    self.stats.copies += 1;
                }
                StorageOp::ResetSlot(s) if s < self.cfg.state_slots => {
                    slots.insert(
                        s,
                        SlotState {
                            chain: HISTORY_SEED,
                            len: 0,
                        },
                    );
                }
                StorageOp::CopySlot { src, dst }
                    if src < self.cfg.state_slots && dst < self.cfg.state_slots =>
                {
                    match self.slot_state(src, slots) {
                        Some(st) => slots.insert(dst, st),
                        None => slots.remove(&dst),
                    };
                }
                StorageOp::CopySlot { .. } | StorageOp::ResetSlot(_) => {
                    return Err(self.violation(format!(
                        "state-slot op {op:?} outside the model's {} state slots",
                        self.cfg.state_slots
                    )));
                }
            }
        }
        Ok(())
    }

    /// Slot `s` as a step sees it: this step's writes (`local`), else the newest
    /// staged step's, else the committed state (None: never written).
    fn slot_state(&self, s: u32, local: &HashMap<u32, SlotState>) -> Option<SlotState> {
        local
            .get(&s)
            .or_else(|| self.staged.iter().rev().find_map(|st| st.slots.get(&s)))
            .or_else(|| self.state.get(&s))
            .copied()
    }

    /// Checks a row's recurrent-state slot: present exactly for a model with state
    /// slots, and holding the row's history `chain` at `start_pos`.
    fn check_state(
        &mut self,
        r: &RowInput,
        chain: u64,
        local: &HashMap<u32, SlotState>,
    ) -> Result<(), ModelError> {
        let s = match (r.state_slot, self.cfg.state_slots) {
            (None, 0) => return Ok(()),
            (Some(s), n) if s < n => s,
            (slot, n) => {
                return Err(self.violation(format!(
                    "row {}: state slot {slot:?} for a model of {n} state slots",
                    r.row
                )))
            }
        };
        if r.draft > 0 {
            return Err(self.violation(format!(
                "row {}: a draft for a model with recurrent state",
                r.row
            )));
        }
        if r.start_pos == 0 {
            // A new row starts from a zero state, whatever its slot held.
            self.stats.slot_resets += 1;
            return Ok(());
        }
        let want = SlotState {
            chain,
            len: r.start_pos,
        };
        match self.slot_state(s, local) {
            Some(st) if st == want => {
                self.stats.state_reads += 1;
                Ok(())
            }
            other => Err(self.violation(format!(
                "row {}: state slot {s} holds {other:?}, not its state at {} ({want:?})",
                r.row, r.start_pos
            ))),
        }
    }

    /// Checks one row's input against the contract and what the fake knows of it, and
    /// returns the history hash and last token before `tokens[0]`, read through the
    /// row's table.
    fn check_row(&mut self, r: &RowInput) -> Result<(u64, u32), ModelError> {
        if r.tokens.is_empty() {
            return Err(self.violation(format!("row {} has no tokens", r.row)));
        }
        let known = self
            .staged
            .iter()
            .rev()
            .find_map(|st| st.rows.get(&r.row))
            .or_else(|| self.rows.get(&r.row));
        match known {
            Some(s) if !(s.lo..=s.hi).contains(&r.start_pos) => {
                return Err(self.violation(format!(
                    "row {}: start_pos {} but committed length is in {}..={}",
                    r.row, r.start_pos, s.lo, s.hi
                )));
            }
            Some(_) => {}
            None if r.start_pos > 0 => self.stats.prefix_rows += 1,
            None => {}
        }
        let end = r.start_pos + r.tokens.len();
        if end > self.cfg.max_context {
            return Err(self.violation(format!("row {} grows past max_context", r.row)));
        }
        if let Some(&t) = r
            .tokens
            .iter()
            .find(|&&t| t as usize >= self.cfg.vocab_size)
        {
            return Err(self.violation(format!("row {}: token {t} outside vocabulary", r.row)));
        }
        if r.draft > 0 && (r.draft + 1 != r.tokens.len() || r.start_pos == 0) {
            return Err(self.violation(format!(
                "row {}: draft of {} with {} tokens at {}",
                r.row,
                r.draft,
                r.tokens.len(),
                r.start_pos
            )));
        }
        if r.blocks.len() != self.groups() {
            return Err(self.violation(format!(
                "row {}: {} block tables for {} KV groups",
                r.row,
                r.blocks.len(),
                self.groups()
            )));
        }
        for (g, t) in r.blocks.iter().enumerate() {
            if let Some(&b) = t.blocks.iter().find(|&&b| b >= self.blocks_in(g)) {
                return Err(self.violation(format!(
                    "row {}: block {b} of group {g} outside storage",
                    r.row
                )));
            }
            let held = (t.offset + t.blocks.len()) * self.bs();
            if held < end || held >= end + self.bs() {
                return Err(self.violation(format!(
                    "row {}: group {g} table holds {held} slots for {end} tokens",
                    r.row
                )));
            }
        }
        // The first new token sees keys from `start - window + 1`: the sliding
        // table must still hold that block (and, checked below, its content).
        let window_from = self
            .cfg
            .sliding_window
            .map(|w| (r.start_pos + 1).saturating_sub(w as usize));
        if let (Some(from), Some(t)) = (window_from, r.blocks.get(1)) {
            if t.offset * self.bs() > from {
                return Err(self.violation(format!(
                    "row {}: sliding table starts at slot {} but position {from} is in the window",
                    r.row,
                    t.offset * self.bs()
                )));
            }
        }
        if self.cfg.verify_kv {
            let mut prev = HISTORY_SEED;
            for pos in 0..r.start_pos {
                let slot = self.locate(r, pos).and_then(|k| self.kv.get(&k)).copied();
                match slot {
                    Some(s) if s.pos == pos && s.chain == step_hash(prev, s.token, pos) => {
                        prev = s.chain;
                    }
                    other => {
                        return Err(self.violation(format!(
                            "row {}: KV slot of position {pos} (of {}) through its table is \
                             {other:?}",
                            r.row, r.start_pos
                        )));
                    }
                }
            }
            self.stats.verified_slots += r.start_pos as u64;
            if let Some(from) = window_from {
                for pos in from..r.start_pos {
                    let full = self.locate(r, pos).and_then(|k| self.kv.get(&k)).copied();
                    let slid = self
                        .locate_in(r, 1, pos)
                        .and_then(|k| self.kv.get(&k))
                        .copied();
                    if slid.is_none() || slid != full {
                        return Err(self.violation(format!(
                            "row {}: sliding-window KV of position {pos} is {slid:?}, the full \
                             table's {full:?}",
                            r.row
                        )));
                    }
                }
            }
        }
        if r.start_pos == 0 {
            return Ok((HISTORY_SEED, 0));
        }
        let pos = r.start_pos - 1;
        match self.locate(r, pos).and_then(|k| self.kv.get(&k)).copied() {
            Some(s) if s.pos == pos => Ok((s.chain, s.token)),
            other => Err(self.violation(format!(
                "row {}: no KV for position {pos} through its table ({other:?})",
                r.row
            ))),
        }
    }

    /// One step's work, forwarded or submitted: staged as the newest step.
    /// Without `sample`, the step's logits stay staged for `submit_sampling` and the
    /// output is empty.
    fn run(
        &mut self,
        ops: &[StorageOp],
        batch: &[RowInput],
        sample: bool,
    ) -> Result<StepOutput, ModelError> {
        self.stats.forwards += 1;
        let call = self.stats.forwards;
        self.make_resident(batch, call)?;
        let mut slots = HashMap::new();
        self.apply_ops(ops, &mut slots)?;
        let mut staged: HashMap<RowId, RowState> = HashMap::with_capacity(batch.len());
        let mut heads = Vec::with_capacity(batch.len());
        for r in batch {
            if staged.contains_key(&r.row) {
                return Err(self.violation(format!("row {} appears twice in one batch", r.row)));
            }
            let head = self.check_row(r)?;
            self.check_state(r, head.0, &slots)?;
            heads.push(head);
            let end = r.start_pos + r.tokens.len();
            let lo = if r.draft > 0 { r.start_pos + 1 } else { end };
            staged.insert(r.row, RowState { lo, hi: end });
        }
        let fed: usize = batch.iter().map(|r| r.tokens.len()).sum();
        let rows: Vec<RowId> = batch.iter().map(|r| r.row).collect();
        if rows.len() > 1 && self.last_oom_rows.as_ref() == Some(&rows) {
            self.stats.repeated_after_oom += 1;
        }
        self.last_oom_rows = None;
        let oom_here = self.faults.oom_calls.contains(&call)
            || self.faults.memory_tokens.is_some_and(|m| fed > m);
        let fail_here =
            oom_here || self.faults.forward_fail_calls.contains(&call) || self.random_fault();
        let poisoned = self.faults.poison_token.is_some_and(|p| {
            batch
                .iter()
                .any(|r| r.start_pos == 0 && r.tokens.first() == Some(&p))
        });
        let torn = (0..self.cfg.layers.max(1)).find(|&layer| {
            (fail_here && layer == self.faults.fail_after_layer) || (poisoned && layer == 0)
        });
        // Write every fed token's KV where the row's table says, and keep the history
        // hash after each position that gets logits.
        self.written.clear();
        self.states.clear();
        let mut conflict = None;
        let mut step_written = Vec::new();
        let mut picks_in = Vec::new();
        for r in batch.iter().filter(|r| r.follows) {
            let prev = self
                .staged
                .back()
                .and_then(|st| st.picks.get(&r.row))
                .copied();
            match prev {
                Some(t) if r.draft == 0 => picks_in.push(t),
                _ => {
                    return Err(self.violation(format!(
                        "row {} follows a step that did not pick for it",
                        r.row
                    )))
                }
            }
        }
        let mut follows = picks_in.into_iter();
        for (r, &(mut h, _)) in batch.iter().zip(&heads) {
            let first = if r.follows { follows.next() } else { None };
            for (j, &t) in r.tokens.iter().enumerate() {
                let t = if j == 0 { first.unwrap_or(t) } else { t };
                let pos = r.start_pos + j;
                h = step_hash(h, t, pos);
                let chain = if torn.is_some() { h ^ TORN_WRITE } else { h };
                for g in 0..self.groups() {
                    let Some(key) = self.locate_in(r, g, pos) else {
                        conflict = Some(format!(
                            "row {}: no slot for position {pos} in group {g}",
                            r.row
                        ));
                        continue;
                    };
                    self.kv.insert(
                        key,
                        Slot {
                            token: t,
                            pos,
                            chain,
                        },
                    );
                    step_written.push(key);
                    if self.cfg.verify_kv {
                        if let Some(other) = self.written.insert(key, r.row) {
                            conflict = Some(format!(
                                "rows {other} and {} write the same KV slot in one step",
                                r.row
                            ));
                        }
                    }
                }
                if r.want_logits && (r.draft > 0 || j + 1 == r.tokens.len()) {
                    self.states.push((h, t));
                }
            }
            if let Some(s) = r.state_slot {
                let chain = if torn.is_some() { h ^ TORN_WRITE } else { h };
                let len = r.start_pos + r.tokens.len();
                slots.insert(s, SlotState { chain, len });
            }
        }
        if let Some(msg) = conflict {
            return Err(self.violation(msg));
        }
        if let Some(layer) = torn {
            // Leave half the rows' state staged, as a real model would after writing
            // KV for some layers: only rollback may clear it.
            let keep = staged.len() / 2;
            self.staged.push_back(Staged {
                rows: staged.into_iter().take(keep).collect(),
                failed: true,
                slots,
                ..Default::default()
            });
            self.stats.failed_forwards += 1;
            if oom_here && !poisoned {
                self.stats.out_of_memory += 1;
                self.last_oom_rows = Some(rows);
                return Err(ModelError::OutOfMemory(format!(
                    "injected: {fed} tokens do not fit (after layer {layer})"
                )));
            }
            return Err(ModelError::Failed(format!(
                "injected fault after layer {layer}"
            )));
        }
        let vocab = self.cfg.vocab_size;
        let mut data = vec![0.0f32; self.states.len() * vocab];
        for (i, &(h, last)) in self.states.iter().enumerate() {
            self.fill(h, last, &mut data[i * vocab..(i + 1) * vocab]);
        }
        self.stats.tokens += batch.iter().map(|r| r.tokens.len() as u64).sum::<u64>();
        self.stats.adapters.extend(batch.iter().map(|r| r.adapter));
        self.stats.max_batch_rows = self.stats.max_batch_rows.max(batch.len());
        let (out, picks, unsampled) = if sample {
            let (out, picks) = self.sample(data, batch)?;
            (out, picks, None)
        } else {
            (StepOutput::default(), HashMap::new(), Some(data))
        };
        let mut first_calls = 0;
        if self.cfg.step_cost.is_some() && self.cfg.new_shape_cost > 0.0 {
            for r in batch.iter().filter(|r| r.tokens.len() > 1) {
                first_calls += usize::from(self.shapes_seen.insert(r.tokens.len()));
            }
        }
        self.last_traced = self.cfg.reports_traces && first_calls > 0;
        self.traced_steps += u64::from(first_calls > 0);
        let first_calls = first_calls as f64 * self.cfg.new_shape_cost;
        let cost = self.cfg.step_cost.map(|c| {
            let decode = batch.iter().filter(|r| r.tokens.len() == 1).count();
            let other = batch
                .iter()
                .filter(|r| r.tokens.len() > 1)
                .map(|r| r.tokens.len())
                .sum();
            let u = (mix64(0x5eed_c057 ^ self.stats.forwards) >> 11) as f64 / (1u64 << 53) as f64
                * 2.0
                - 1.0;
            (
                decode,
                other,
                c.of_with(batch, self.cfg.short_prompts) * (1.0 + c.jitter * u) + first_calls,
            )
        });
        self.staged.push_back(Staged {
            rows: staged,
            out: None,
            picks,
            written: step_written,
            failed: false,
            unsampled,
            cost,
            slots,
        });
        Ok(out)
    }

    /// Samples a step's logits through the contract's host implementation, as any
    /// model whose logits live in host memory does: its output, and each row's last
    /// pick (what a following step's row feeds).
    fn sample(
        &mut self,
        data: Vec<f32>,
        batch: &[RowInput],
    ) -> Result<(StepOutput, HashMap<RowId, u32>), ModelError> {
        let out = self.sampler.sample(&data, self.cfg.vocab_size, batch)?;
        self.last_logits = data;
        let mut picks = HashMap::with_capacity(out.rows.len());
        let mut at = 0;
        for r in batch.iter().filter(|r| r.want_logits) {
            at += r.positions();
            if let Some(&t) = out.tokens.get(at - 1) {
                picks.insert(r.row, t);
            }
        }
        Ok((out, picks))
    }

    /// Queues a step (`submit`, `submit_unsampled`) behind at most one outstanding.
    fn queue(
        &mut self,
        ops: &[StorageOp],
        batch: &[RowInput],
        sample: bool,
    ) -> Result<(), ModelError> {
        self.stats.submits += 1;
        if self.staged.len() >= 2 {
            self.stats.forwards += 1;
            return Err(self.violation("a third step submitted".into()));
        }
        if self
            .staged
            .back()
            .is_some_and(|st| st.out.is_none() || st.unsampled.is_some())
        {
            self.stats.forwards += 1;
            return Err(self.violation(
                "submit after a forward or collect left uncommitted, or before the last step's sampling"
                    .into(),
            ));
        }
        let out = self.run(ops, batch, sample)?;
        if let Some(st) = self.staged.back_mut().filter(|_| sample) {
            st.out = Some(out);
        }
        self.stats.max_staged = self.stats.max_staged.max(self.staged.len());
        Ok(())
    }
}

#[inline]
fn step_hash(h: u64, token: u32, pos: usize) -> u64 {
    mix64(h.rotate_left(17) ^ u64::from(token) ^ ((pos as u64) << 32))
}

impl Model for FakeModel {
    fn short_prompts(&self) -> Option<ShortPrompts> {
        self.cfg.short_prompts
    }

    fn info(&self) -> ModelInfo {
        ModelInfo {
            vocab_size: self.cfg.vocab_size,
            max_context: self.cfg.max_context,
            eos_token_ids: self.cfg.eos_token_ids.clone(),
            kv: match self.cfg.sliding_window {
                None => KvGroups::new(self.cfg.kv_block_size).full(self.cfg.kv_blocks),
                Some(w) => KvGroups::new(self.cfg.kv_block_size)
                    .full(self.cfg.kv_blocks)
                    .sliding(w, self.blocks_in(1)),
            }
            .state_slots(self.cfg.state_slots),
            adapter_slots: self.cfg.adapter_slots,
        }
    }

    fn add_adapter(
        &mut self,
        id: u32,
        _source: crate::model::AdapterSource,
    ) -> Result<crate::model::AdapterDesc, ModelError> {
        if self.cfg.adapter_slots == 0 {
            return Err(ModelError::Contract("this model serves no adapters".into()));
        }
        if !self.adapters.insert(id) {
            return Err(self.violation(format!("adapter {id} registered twice")));
        }
        Ok(crate::model::AdapterDesc {
            rank: 8,
            scale: 1.0,
            targets: vec!["q_proj".into(), "v_proj".into()],
            format: "fake".into(),
            host_bytes: 0,
        })
    }

    fn remove_adapter(&mut self, id: u32) -> Result<(), ModelError> {
        if !self.adapters.remove(&id) {
            return Err(self.violation(format!("adapter {id} removed but not registered")));
        }
        self.resident.retain(|r| r.0 != id);
        Ok(())
    }

    fn adapter_counters(&self) -> crate::model::AdapterCounters {
        self.adapter_counters
    }

    fn forward(&mut self, ops: &[StorageOp], batch: &[RowInput]) -> Result<StepOutput, ModelError> {
        if !self.staged.is_empty() {
            self.stats.forwards += 1;
            return Err(self.violation("forward called while a step is staged".into()));
        }
        let out = self.run(ops, batch, true)?;
        if let Some(c) = self.staged.back().and_then(|st| st.cost) {
            self.step_costs.push(c);
        }
        self.last_unmeasured = false;
        Ok(out)
    }

    fn last_build_traced(&self) -> bool {
        self.last_traced
    }

    fn last_step_seconds(&self) -> Option<f64> {
        self.cfg.step_cost?;
        if self.cfg.unmeasured_pipelined && self.last_unmeasured {
            return None;
        }
        self.step_costs.last().map(|c| c.2)
    }

    fn commit(&mut self) -> Result<(), ModelError> {
        let call = self.stats.commits + self.stats.failed_commits + 1;
        match self.staged.front() {
            None => return Err(self.violation("commit without a staged step".into())),
            Some(st) if st.out.is_some() || st.unsampled.is_some() => {
                return Err(self.violation("commit of a step not collected yet".into()))
            }
            Some(st) if st.failed => return Err(self.violation("commit of a failed step".into())),
            Some(_) => {}
        }
        if self.faults.commit_fail_calls.contains(&call) || self.random_fault() {
            self.stats.failed_commits += 1;
            return Err(ModelError::Failed("injected commit fault".into()));
        }
        if let Some(st) = self.staged.pop_front() {
            self.rows.extend(st.rows);
            self.state.extend(st.slots);
        }
        self.stats.commits += 1;
        Ok(())
    }

    fn supports_drafts(&self) -> bool {
        // Rejected draft tokens cannot be taken back out of a recurrent state.
        self.cfg.state_slots == 0
    }

    fn rollback(&mut self) {
        self.stats.rollbacks += 1;
        self.staged.pop_back();
    }

    fn pipelines(&self) -> bool {
        true
    }

    fn release_memory(&mut self) {
        self.stats.memory_releases += 1;
    }

    fn submit(&mut self, ops: &[StorageOp], batch: &[RowInput]) -> Result<(), ModelError> {
        self.queue(ops, batch, true)
    }

    fn defers_sampling(&self) -> bool {
        self.cfg.defer_sampling
    }

    fn submit_unsampled(
        &mut self,
        ops: &[StorageOp],
        batch: &[RowInput],
    ) -> Result<(), ModelError> {
        if !self.cfg.defer_sampling {
            self.stats.forwards += 1;
            return Err(self.violation("submit_unsampled to a fake that does not defer".into()));
        }
        self.stats.deferred += 1;
        self.queue(ops, batch, false)
    }

    fn submit_sampling(&mut self, batch: &[RowInput]) -> Result<(), ModelError> {
        self.stats.sampling_calls += 1;
        let call = self.stats.sampling_calls;
        let Some(data) = self.staged.back_mut().and_then(|st| st.unsampled.take()) else {
            return Err(self.violation("submit_sampling without an unsampled step".into()));
        };
        let fail = self.faults.sampling_fail_calls.contains(&call);
        let sampled = if fail {
            Err(ModelError::Failed("injected fault while sampling".into()))
        } else {
            self.sample(data, batch)
        };
        match sampled {
            Ok((out, picks)) => {
                if let Some(st) = self.staged.back_mut() {
                    st.out = Some(out);
                    st.picks = picks;
                }
                Ok(())
            }
            Err(e) => {
                self.stats.failed_samplings += 1;
                if let Some(st) = self.staged.back_mut() {
                    st.failed = true;
                }
                Err(e)
            }
        }
    }

    fn collect(&mut self) -> Result<StepOutput, ModelError> {
        let call = self.stats.collects + self.stats.failed_collects + 1;
        let Some(i) = self.staged.iter().position(|st| st.out.is_some()) else {
            return Err(self.violation("collect without a submitted step".into()));
        };
        if self.faults.collect_fail_calls.contains(&call) {
            self.stats.failed_collects += 1;
            let st = &mut self.staged[i];
            st.out = None;
            st.failed = true;
            for k in std::mem::take(&mut st.written) {
                if let Some(slot) = self.kv.get_mut(&k) {
                    slot.chain ^= TORN_WRITE;
                }
            }
            return Err(ModelError::Failed("injected fault while collecting".into()));
        }
        self.stats.collects += 1;
        if let Some(c) = self.staged[i].cost {
            self.step_costs.push(c);
        }
        // (Decode-only: every row feeds one token.)
        self.last_unmeasured = self.staged[i].cost.is_some_and(|c| c.1 == 0);
        self.staged[i]
            .out
            .take()
            .ok_or_else(|| ModelError::Failed("collected twice".into()))
    }

    fn release_row(&mut self, row: RowId) {
        // A pipelined scheduler releases rows that finished while the next step,
        // which carries them, is outstanding: that step keeps nothing of them.
        for st in &mut self.staged {
            st.rows.remove(&row);
        }
        self.rows.remove(&row);
    }
}

/// Byte-level fake detokenizer over the fake vocabulary: most ids are ASCII, some are
/// the two halves of "é", so multi-token characters and U+FFFD hold-back are exercised.
#[derive(Debug, Clone, Default)]
pub struct FakeDetokenizer;

const ASCII: &[u8; 48] = b"abcdefghijklmnopqrstuvwxyz  ABCDEFGH.,;!?-\n0123 ";

impl FakeDetokenizer {
    pub fn bytes(id: u32) -> &'static [u8] {
        match id % 64 {
            b @ 0..=47 => std::slice::from_ref(&ASCII[b as usize]),
            48..=55 => &[0xC3],
            _ => &[0xA9],
        }
    }
}

impl Detokenizer for FakeDetokenizer {
    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        let mut b = Vec::with_capacity(ids.len());
        for &i in ids {
            b.extend_from_slice(Self::bytes(i));
        }
        // Valid UTF-8 (the common case) reuses the buffer; only invalid bytes pay for the
        // lossy copy.
        Ok(String::from_utf8(b)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RowBlocks;

    fn row(row: RowId, tokens: Vec<u32>, start_pos: usize, blocks: Vec<u32>) -> RowInput {
        RowInput {
            row,
            tokens,
            start_pos,
            want_logits: true,
            draft: 0,
            blocks: vec![RowBlocks { offset: 0, blocks }],
            sampling: Default::default(),
            follows: false,
            adapter: None,
            state_slot: None,
        }
    }

    /// A forward's logits (what it sampled from).
    struct Out {
        data: Vec<f32>,
    }

    impl FakeModel {
        fn fwd(&mut self, ops: &[StorageOp], batch: &[RowInput]) -> Result<Out, ModelError> {
            self.forward(ops, batch)?;
            Ok(Out {
                data: self.last_logits.clone(),
            })
        }
    }

    /// Blocks of 2 tokens, so tables have several blocks.
    fn small() -> FakeConfig {
        FakeConfig {
            kv_block_size: 2,
            kv_blocks: 16,
            ..FakeConfig::default()
        }
    }

    #[test]
    fn logits_depend_on_exact_history_not_chunking() {
        let mut m = FakeModel::new(FakeConfig::default());
        let a = m.fwd(&[], &[row(1, vec![1, 2, 3], 0, vec![0])]).unwrap();
        m.commit().unwrap();
        let b = m.fwd(&[], &[row(1, vec![4], 3, vec![0])]).unwrap();
        m.commit().unwrap();
        let mut m2 = FakeModel::new(FakeConfig::default());
        let c = m2
            .fwd(&[], &[row(9, vec![1, 2, 3, 4], 0, vec![5])])
            .unwrap();
        assert_eq!(b.data, c.data);
        assert_ne!(a.data, b.data);
        assert_eq!(m.logits_for_history(&[1, 2, 3, 4]), c.data);
        assert_ne!(m.logits_for_history(&[1, 2, 4, 3]), c.data);
        assert!(m.violations().is_empty() && m2.violations().is_empty());
    }

    #[test]
    fn staging_and_contract_checks() {
        let mut m = FakeModel::new(FakeConfig::default());
        m.fwd(&[], &[row(1, vec![1, 2], 0, vec![0])]).unwrap();
        m.rollback();
        // Position 2 was never committed: rolled back, the row is unknown, and its
        // table holds no KV for the context it claims.
        assert!(matches!(
            m.fwd(&[], &[row(2, vec![3], 2, vec![3])]),
            Err(ModelError::Contract(_))
        ));
        m.fwd(&[], &[row(1, vec![1, 2], 0, vec![0])]).unwrap();
        assert!(m.fwd(&[], &[row(1, vec![1, 2], 0, vec![0])]).is_err());
        m.commit().unwrap();
        assert!(m.commit().is_err());
        // A known row at the wrong position, and a table too short for its tokens.
        assert!(m.fwd(&[], &[row(1, vec![3], 1, vec![0])]).is_err());
        assert!(m.fwd(&[], &[row(1, vec![3; 20], 2, vec![0])]).is_err());
        assert_eq!(m.live_rows(), 1);
        m.release_row(1);
        assert_eq!(m.live_rows(), 0);
        assert_eq!(m.violations().len(), 5, "{:?}", m.violations());
    }

    /// A new row whose table starts with another row's full blocks continues exactly
    /// like a cold prefill; a table naming a stale or foreign block is caught.
    #[test]
    fn prefix_blocks_continue_like_a_cold_prefill() {
        let mut m = FakeModel::new(small());
        let cold = m
            .fwd(&[], &[row(1, vec![1, 2, 3, 4, 5], 0, vec![0, 1, 2])])
            .unwrap();
        m.commit().unwrap();
        // Row 2 shares blocks 0 and 1 (positions 0..4) and computes the rest itself.
        let hit = m.fwd(&[], &[row(2, vec![5], 4, vec![0, 1, 3])]).unwrap();
        m.commit().unwrap();
        assert_eq!(hit.data, cold.data);
        assert_eq!(m.stats().prefix_rows, 1);
        assert!(m.violations().is_empty(), "{:?}", m.violations());
        // Blocks in the wrong order: position 0 reads a slot holding position 2.
        assert!(m.fwd(&[], &[row(3, vec![5], 4, vec![1, 0, 4])]).is_err());
        // A block nobody wrote.
        assert!(m.fwd(&[], &[row(4, vec![5], 4, vec![0, 5, 4])]).is_err());
        assert_eq!(m.violations().len(), 2);
    }

    #[test]
    fn copy_block_ops_apply_before_writes() {
        let mut m = FakeModel::new(small());
        let a = m.fwd(&[], &[row(1, vec![1, 2, 3], 0, vec![0, 1])]).unwrap();
        m.commit().unwrap();
        // Copy-on-write of the partial block 1 into block 7, then row 2 (a fork of row
        // 1) writes position 3 there; row 1's block stays as it was.
        let op = StorageOp::CopyBlock {
            group: 0,
            src: 1,
            dst: 7,
        };
        let b = m.fwd(&[op], &[row(2, vec![9], 3, vec![0, 7])]).unwrap();
        m.commit().unwrap();
        assert_eq!(b.data, m.logits_for_history(&[1, 2, 3, 9]));
        let c = m.fwd(&[], &[row(1, vec![4], 3, vec![0, 1])]).unwrap();
        m.commit().unwrap();
        assert_eq!(c.data, m.logits_for_history(&[1, 2, 3, 4]));
        assert_ne!(a.data, c.data);
        assert_eq!(m.stats().copies, 1);
        assert!(m.violations().is_empty(), "{:?}", m.violations());
    }

    #[test]
    fn injected_faults_leave_partial_staging_and_torn_kv() {
        let faults = FakeFaults {
            forward_fail_calls: vec![1],
            fail_after_layer: 2,
            commit_fail_calls: vec![1],
            ..Default::default()
        };
        let mut m = FakeModel::with_faults(small(), faults);
        assert!(m
            .fwd(
                &[],
                &[row(1, vec![1, 2], 0, vec![0]), row(2, vec![1], 0, vec![1])]
            )
            .is_err());
        assert!(m.has_staged());
        m.rollback();
        // What the failed forward wrote is garbage: a row reading it as context fails.
        assert!(m.fwd(&[], &[row(3, vec![3], 2, vec![0, 2])]).is_err());
        assert_eq!(m.violations().len(), 1);
        m.fwd(&[], &[row(1, vec![1], 0, vec![0])]).unwrap();
        assert!(m.commit().is_err());
        m.rollback();
        assert_eq!(m.live_rows(), 0);
    }

    #[test]
    fn drafts_leave_the_committed_length_open_to_the_accepted_prefix() {
        let mut m = FakeModel::new(small());
        m.fwd(&[], &[row(1, vec![1, 2], 0, vec![0])]).unwrap();
        m.commit().unwrap();
        let mut r = row(1, vec![3, 4, 5], 2, vec![0, 1, 2]);
        r.draft = 2;
        let l = m.fwd(&[], &[r]).unwrap();
        assert_eq!(l.data.len(), 3 * 64);
        m.commit().unwrap();
        // The scheduler kept the decoded token and one draft token.
        let next = m.fwd(&[], &[row(1, vec![7], 4, vec![0, 1, 2])]).unwrap();
        m.commit().unwrap();
        assert_eq!(next.data, m.logits_for_history(&[1, 2, 3, 4, 7]));
        assert!(m.violations().is_empty(), "{:?}", m.violations());
    }
}
