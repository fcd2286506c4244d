//! The synchronous scheduler core: queues, fair share, step planning, preemption, the
//! step transaction and sampling. It runs on whatever thread owns it (the engine thread
//! in production, the test thread in simulations) and takes `now` from the caller, so
//! simulations are deterministic.
//!
//! KV memory is the paged pool of `weft-kv-pool`, built from the model's
//! [`ModelInfo::kv`]: every running request holds one pool sequence next to its model
//! row, planning counts the pool's real free and evictable blocks, a step's appends,
//! draft truncations and prefix-cache registrations are one pool transaction, and a
//! request that leaves gives its blocks back (full ones stay as evictable prefix-cache
//! blocks, salted per tenant).

use std::cmp::Reverse;
use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, error, trace, warn};

use crate::admission::Admission;
use crate::anticipation::Anticipation;
use crate::chan;
use crate::config::{ItlTarget, SchedulerConfig, StartingStep};
use crate::constraint::{Constraint, MaskTime};
use crate::detok::{TextState, TextUpdate};
use crate::draft::{self, Seq};
use crate::fault::{FaultPlan, FaultPoint};
use crate::metrics::{EngineMetrics, KindMetrics, SlotMetrics, TenantMetrics};
use crate::model::{Detokenizer, Model, ModelError, ModelInfo, RowId, RowInput};
use crate::model::{RowSampling, StepOutput};
use crate::request::TokenLogprob;
use crate::request::{
    EventStream, FinishReason, Finished, Msg, Request, RequestKey, StopMatch, SubmitError, Usage,
};
use crate::sampling::PenaltyState;
use crate::step_cost::{largest_fitting, ShortPrompts, StepCost, StepShape};
use crate::util::{mix64, IdMap};
use weft_kv_pool::{
    AttentionKind, GroupSpec, KvError, KvPool, OwnerId, PrefixStats, Salt, SeqId, SeqSpec,
};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    #[error("invalid scheduler config: {0}")]
    Config(String),
    /// The model's KV layout ([`ModelInfo::kv`]) is one the scheduler cannot plan for
    /// yet (today: exactly one full-attention group and no state slots).
    #[error("unsupported KV layout: {0}")]
    UnsupportedKv(String),
    /// The pool rejected the model's KV layout.
    #[error("KV pool: {0}")]
    Kv(#[from] KvError),
}

#[derive(Debug, Clone, PartialEq)]
pub struct TenantStats {
    pub tenant: String,
    pub weight: f64,
    pub running: usize,
    pub waiting: usize,
    /// The tenant's virtual token counter (weighted service received).
    pub virtual_counter: f64,
}

/// Requests of one LoRA adapter ([`crate::Request::adapter`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterStats {
    pub adapter: u32,
    pub running: usize,
    pub waiting: usize,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Stats {
    pub running: usize,
    pub waiting: usize,
    pub tenants: Vec<TenantStats>,
    /// Live requests per adapter, by adapter id (adapters without any left out).
    pub adapters: Vec<AdapterStats>,
    /// What the model's adapter residency has done ([`Model::adapter_counters`]).
    pub adapter_loads: u64,
    pub adapter_evictions: u64,
    /// KV blocks of the pool (one full-attention group): `used` are referenced by a
    /// running row, `free` hold nothing, `cached` hold a finished or preempted row's
    /// full blocks for prefix reuse and are evicted (LRU) when `free` runs out.
    /// `used + free + cached == total`.
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_free: usize,
    pub kv_blocks_cached: usize,
    pub steps: u64,
    /// Steps queued behind the step they follow, before it was read (pipelined).
    pub pipelined_steps: u64,
    /// Requests admitted into a step queued behind the one in flight (a rolled-back
    /// admission counts again when the request is admitted again).
    pub pipelined_admissions: u64,
    /// Of those, admissions undone because their step rolled back (the request
    /// waited again).
    pub admissions_undone: u64,
    pub rollbacks: u64,
    pub preemptions: u64,
    /// Steps that failed every retry (their rows were bisected or failed).
    pub failed_steps: u64,
    /// Requests finished with `FinishReason::Error` because their step kept failing.
    pub failed_requests: u64,
    /// Step attempts that failed with `ModelError::OutOfMemory` (each rolled back; a
    /// batch of several rows is then split in two at once).
    pub out_of_memory: u64,
    /// With `verify_rollback`: rolled-back attempts whose state differed from the
    /// pre-step state. Must stay 0.
    pub rollback_mismatches: u64,
    /// Speculative draft tokens verified in committed steps, and those accepted.
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    /// Seconds: the inter-token latency target of the latest step planned under one
    /// (`SchedulerConfig::itl_target`; with `ItlTarget::Auto`, what it came to).
    pub itl_target: Option<f64>,
    /// Output-constraint masks computed (one per constrained row per step; a retried
    /// step reuses its masks) and the host seconds they took.
    pub constraint_masks: u64,
    pub constraint_mask_seconds: f64,
    /// Anticipatory waits before steps ([`SchedulerConfig::anticipation`]).
    pub anticipation: crate::AnticipationCounts,
}

/// Why one attempt of a step failed.
struct StepFault {
    msg: String,
    /// The model ran out of memory ([`ModelError::OutOfMemory`]): retrying the same
    /// batch asks for the same memory, so it is split instead.
    out_of_memory: bool,
}

impl StepFault {
    fn model(e: ModelError) -> Self {
        Self {
            out_of_memory: matches!(e, ModelError::OutOfMemory(_)),
            msg: e.to_string(),
        }
    }
}

impl From<String> for StepFault {
    fn from(msg: String) -> Self {
        Self {
            msg,
            out_of_memory: false,
        }
    }
}

/// What one call to [`Scheduler::step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepReport {
    pub rows: usize,
    pub tokens: usize,
    pub sampled: usize,
    pub attempts: u32,
    pub committed: bool,
}

struct Tenant {
    name: String,
    weight: f64,
    counter: f64,
    queue: BTreeMap<(Reverse<i32>, u64), RequestKey>,
    running: usize,
    max_running: usize,
    label: usize,
    /// Prefix-cache domain: unique per tenant (from its index, which is never reused),
    /// so one tenant never hits another's blocks.
    salt: Salt,
    /// The last step planned while the tenant had requests running or queued.
    last_active: Option<Instant>,
}

impl Tenant {
    /// Nothing of it running or queued.
    fn idle(&self) -> bool {
        self.running == 0 && self.queue.is_empty()
    }
}

struct Req {
    key: RequestKey,
    tenant: usize,
    seq: u64,
    r: Request,
    tx: chan::Sender<Msg>,
    /// The model row and pool sequence while running.
    row: Option<Resident>,
    generated: Vec<u32>,
    /// Tokens of prompt ++ generated that the model has committed for `row`.
    computed: usize,
    text: TextState,
    penalties: Option<PenaltyState>,
    seed: u64,
    arrival: Instant,
    scheduled_at: Option<Instant>,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    /// Input tokens are charged to the tenant's counter once, not again on recompute
    /// after preemption (that is the engine's choice, not the tenant's use).
    charged: bool,
    preemptions: u32,
    /// Prompt tokens served from the pool's prefix cache at first admission.
    cached: usize,
    /// The draft planned for this step (scratch, rebuilt by every plan).
    draft: Vec<u32>,
}

impl Req {
    fn seq_len(&self) -> usize {
        self.r.prompt.len() + self.generated.len()
    }

    /// Appends `n` tokens of prompt ++ generated from `start` (clamped to what exists)
    /// to `v`, so a step can refill buffers it keeps.
    fn extend_tokens(&self, start: usize, n: usize, v: &mut Vec<u32>) {
        let (p, g) = (&self.r.prompt, &self.generated);
        if n == 1 {
            // A decoding row feeds one token; a push is much cheaper than the memcpy call
            // that copying a one-element slice becomes.
            let t = match start.checked_sub(p.len()) {
                None => p.get(start),
                Some(i) => g.get(i),
            };
            v.extend(t);
            return;
        }
        let end = start + n;
        if start < p.len() {
            v.extend_from_slice(&p[start..end.min(p.len())]);
        }
        let (gs, ge) = (
            start.saturating_sub(p.len()),
            end.saturating_sub(p.len()).min(g.len()),
        );
        if gs < ge {
            v.extend_from_slice(&g[gs..ge]);
        }
    }

    fn queue_slot(&self) -> (Reverse<i32>, u64) {
        (Reverse(self.r.priority), self.seq)
    }

    /// Whether drafts can speed this request up without changing its tokens: greedy
    /// picks are checked position by position, and none of penalties (which would need
    /// the draft in their counts) or stop strings (matched on staged text) is involved.
    /// A constrained row's draft is checked against its constraint when planned: cut
    /// where the constraint rejects it, each position picking under the mask of the
    /// constraint's state after the draft tokens before it.
    fn speculates(&self) -> bool {
        let s = &self.r.sampling;
        s.is_greedy() && !s.has_penalties() && self.r.stop_strings.is_empty()
    }

    /// Fills `s` with how this request's next tokens are picked (its first position
    /// is the generated token after those already committed).
    fn fill_sampling(&self, s: &mut RowSampling) {
        s.params.clone_from(&self.r.sampling);
        s.seed = self.seed;
        s.index = self.generated.len() as u64;
        s.logprobs = self.r.logprobs;
        match &self.penalties {
            Some(p) => s.seen.clone_from(&p.seen),
            None => s.seen.clear(),
        }
        s.allowed.clear();
    }

    /// Whether generated token `t` ends the request by EOS, a stop token id or length
    /// (`last`: it is the max_tokens-th); stop strings are matched on staged text.
    fn token_finish(
        &self,
        t: u32,
        last: bool,
        eos: &[u32],
    ) -> Option<(FinishReason, Option<StopMatch>)> {
        if !self.r.ignore_eos && eos.contains(&t) {
            Some((FinishReason::Eos, None))
        } else if self.r.stop_token_ids.contains(&t) {
            Some((FinishReason::Stop, Some(StopMatch::TokenId(t))))
        } else {
            last.then_some((FinishReason::Length, None))
        }
    }
}

/// Whether a request's last token ends it without text of its own (EOS, a stop token
/// id, the EOS that completed its constraint).
fn silent_end(finish: &Option<(FinishReason, Option<StopMatch>)>) -> bool {
    matches!(
        finish,
        Some((FinishReason::Eos, _))
            | Some((FinishReason::Stop, Some(StopMatch::TokenId(_))))
            | Some((FinishReason::Stop, Some(StopMatch::Constraint(Some(_)))))
    )
}

/// Live requests: a slab, so the per-row hot path (plan, forward inputs, sampling, apply)
/// reaches a request by slot index instead of hashing its key; the key index serves the
/// rest (cancel, reap, finish).
#[derive(Default)]
struct Slab {
    slots: Vec<Option<Req>>,
    free: Vec<u32>,
    index: IdMap<RequestKey, u32>,
}

impl Slab {
    fn insert(&mut self, key: RequestKey, r: Req) -> u32 {
        let slot = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(r);
                i
            }
            None => {
                self.slots.push(Some(r));
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(key, slot);
        slot
    }

    fn remove(&mut self, key: &RequestKey) -> Option<Req> {
        let slot = self.index.remove(key)?;
        let r = self.slots.get_mut(slot as usize)?.take();
        self.free.push(slot);
        r
    }

    fn slot(&self, key: &RequestKey) -> Option<u32> {
        self.index.get(key).copied()
    }

    fn get(&self, key: &RequestKey) -> Option<&Req> {
        self.at(self.slot(key)?)
    }

    fn get_mut(&mut self, key: &RequestKey) -> Option<&mut Req> {
        let slot = self.slot(key)?;
        self.at_mut(slot)
    }

    fn at(&self, slot: u32) -> Option<&Req> {
        self.slots.get(slot as usize)?.as_ref()
    }

    fn at_mut(&mut self, slot: u32) -> Option<&mut Req> {
        self.slots.get_mut(slot as usize)?.as_mut()
    }

    fn len(&self) -> usize {
        self.index.len()
    }

    fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    fn keys(&self) -> impl Iterator<Item = &RequestKey> {
        self.index.keys()
    }

    fn values(&self) -> impl Iterator<Item = &Req> {
        self.slots.iter().flatten()
    }
}

impl std::ops::Index<&RequestKey> for Slab {
    type Output = Req;
    fn index(&self, key: &RequestKey) -> &Req {
        // Callers index only keys they just took from the scheduler's own structures.
        match self.get(key) {
            Some(r) => r,
            None => panic!("request {} is not live", key.0),
        }
    }
}

/// Where a running request lives: its model row and its pool sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Resident {
    row: RowId,
    seq: SeqId,
}

/// A running row: its request key and slab slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct RunSlot {
    key: RequestKey,
    slot: u32,
}

#[derive(Debug, Clone, Copy)]
struct Planned {
    key: RequestKey,
    slot: u32,
    row: RowId,
    seq: SeqId,
    start: usize,
    n: usize,
    want_logits: bool,
    /// Draft tokens after the decoded one (`n == 1 + draft` when > 0).
    draft: usize,
    /// A chunk of a prompt (even of one token), not a decoding row.
    prefill: bool,
}

impl Planned {
    /// A decoding row of running row `x` (`res` its residence) feeding one token
    /// after `start` committed ones.
    fn decode(x: RunSlot, res: Resident, start: usize) -> Self {
        Self {
            key: x.key,
            slot: x.slot,
            row: res.row,
            seq: res.seq,
            start,
            n: 1,
            want_logits: true,
            draft: 0,
            prefill: false,
        }
    }
}

struct Plan {
    rows: Vec<Planned>,
    probation: bool,
}

/// A request's place in a step's prefill order (see [`Scheduler::prefill_key`]).
type FairKey = (Reverse<i32>, u64, usize);

/// What is left of a step's time under an inter-token latency target, as its
/// prefill chunks are added (see [`Scheduler::time_fit`]).
/// Which waiting requests [`Scheduler::admit_joiners`] may admit.
#[derive(Debug, Clone, Copy)]
enum Joiners {
    /// Any, in fair order.
    All,
    /// Only those ahead of a running row of this tenant with this
    /// [`Scheduler::prefill_key`] (a tenant's own wait for its running rows).
    AheadOf(usize, FairKey),
    /// Only of starting tenants ([`Scheduler::starting`]: one request each).
    Starting,
}

/// Which waiting requests join the step that follows the in-flight one
/// ([`Scheduler::follow_plan`]): what the plain plan of that step would admit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FollowJoiners {
    /// Nobody waits (or nobody can join).
    None,
    /// Any, in fair order ([`Scheduler::close_plan`]'s joiners).
    All,
    /// Starting tenants' requests, beside the decoding rows
    /// ([`Scheduler::plan_starting`] with [`StartingStep::BesideRows`]); if none of
    /// them gets in, any, in fair order.
    StartingFirst,
}

/// What the scheduler did while a pool step was open that the pool's rollback of
/// that step undoes on its side, so the scheduler must act again on its own.
#[derive(Debug, Clone, Copy)]
enum OpenEffect {
    /// A sequence released (its request ended or was preempted): released again.
    Released(Resident),
    /// A request admitted ([`Scheduler::admit_following`]), its sequence allocated
    /// in the step: the request waits again ([`Scheduler::unadmit`]).
    Admitted {
        res: Resident,
        key: RequestKey,
        /// Its first admission (it had never been scheduled).
        fresh: bool,
    },
}

/// The step that follows the in-flight one ([`Scheduler::follow_plan`]).
struct Follow {
    rows: Vec<Planned>,
    /// Its sampling waits for the in-flight step's picks.
    deferred: bool,
    /// Waiting requests that join it.
    admit: FollowJoiners,
    /// Blocks its rows' appends take.
    need: Blocks,
    /// Where its rows carry prompt chunks: the time fit and token budget they left,
    /// for the joiners admitted after them (as the plain plan's `close_plan` has
    /// them after its `plan_prefills`).
    left: Option<(TimeFit, usize)>,
}

impl Follow {
    /// No step follows: the plain plan runs once the step in flight is read, for
    /// `why` (traced: what keeps a server's steps from queueing).
    fn none(why: &'static str) -> Self {
        trace!(why, "no step queued behind the one in flight");
        Self {
            rows: Vec::new(),
            deferred: false,
            admit: FollowJoiners::None,
            need: Blocks::default(),
            left: None,
        }
    }
}

struct TimeFit {
    /// The inter-token latency target in effect (None: none).
    itl: Option<f64>,
    /// Seconds the step is to stay within; None: no time bound.
    target: Option<f64>,
    /// The step so far.
    shape: StepShape,
    /// Tokens the first chunk gets when none fits the target (a block).
    min: usize,
    prefilled: bool,
    /// A chunk was cut to fit: nothing more goes in.
    full: bool,
    /// The first chunk takes at least two tokens ([`CHUNK_PROBE_EVERY`]).
    probe: bool,
    /// [`SchedulerConfig::prefill_granule`] (at least 1).
    granule: usize,
    /// Where the model runs short prompt chunks as decoding rows
    /// ([`Model::short_prompts`]).
    short: Option<ShortStep>,
}

/// A step being planned where the model runs short prompt chunks as decoding rows.
struct ShortStep {
    limits: ShortPrompts,
    /// The step's rows other than prompt chunks.
    others: StepShape,
    /// Its prompt chunks so far, `(start, n)`.
    chunks: Vec<(usize, usize)>,
}

impl TimeFit {
    /// Tokens of a chunk of `n` after `start` committed ones that fit what is left.
    fn allowed(&self, cost: &StepCost, start: usize, n: usize) -> usize {
        let Some(target) = self.target else { return n };
        if self.full {
            return 0;
        }
        if let Some(fit) = self.short_fit(cost, start, n, target) {
            return fit;
        }
        let min = if self.prefilled { 0 } else { self.min };
        let mut fit = cost.prefill_within(&self.shape, start, min, n, target);
        if fit < n && fit >= self.granule {
            fit -= fit % self.granule;
        }
        if self.probe && !self.prefilled {
            fit = fit.max(2.min(n));
        }
        // Why a chunk got the size it did (the "step cost" line after the step
        // says what it cost).
        trace!(
            start,
            wanted = n,
            fit,
            target_ms = target * 1e3,
            overhead_ms = cost.prefill_overhead().map(|f| f * 1e3),
            predicted_ms = {
                let mut s = self.shape;
                if fit > 0 {
                    s.add_prompt(start, fit);
                }
                cost.predict(&s).map(|t| t * 1e3)
            },
            "chunk sized"
        );
        fit
    }

    /// Where the model runs short prompt chunks as decoding rows, what a chunk of `n`
    /// after `start` gets when the step's chunks with it are short: the most of it
    /// that, priced as the decoding rows it runs as, fits `target` (None where not
    /// even a token does: then as a prefill, below). And 0 where this chunk would turn
    /// the step's short chunks into a prefill: it waits for the next step rather than
    /// make this one pay a prefill's fixed cost (a joining wave of short prompts on an
    /// H100: 12 prompts beside 169 rows ran as a 60-83 ms prefill step, where steps
    /// whose few prompts ran as decoding rows took 8-13 ms). None otherwise (no short
    /// chunks, or a step already prefilling).
    fn short_fit(&self, cost: &StepCost, start: usize, n: usize, target: f64) -> Option<usize> {
        let ShortStep {
            limits,
            others,
            chunks,
        } = self.short.as_ref()?;
        let covers = |m: usize| limits.covers(chunks.iter().copied().chain([(start, m)]));
        if !covers(n) {
            return (!chunks.is_empty() && limits.covers(chunks.iter().copied())).then_some(0);
        }
        let fits = |m: usize| {
            let mut s = *others;
            for &(a, k) in chunks.iter().chain([&(start, m)]) {
                s.add_as_rows(a, k);
            }
            cost.predict(&s).is_none_or(|t| t <= target)
        };
        let fit = largest_fitting(n, fits);
        trace!(
            start,
            wanted = n,
            fit,
            target_ms = target * 1e3,
            "chunk sized as decoding rows"
        );
        (fit > 0).then_some(fit)
    }

    /// Adds a chunk of `n` tokens (at most what [`Self::allowed`] gave for `wanted`).
    fn take(&mut self, start: usize, n: usize, wanted: usize) {
        if self.target.is_none() || n == 0 {
            return;
        }
        if let Some(s) = self.short.as_mut() {
            s.chunks.push((start, n));
        }
        self.shape.add_prompt(start, n);
        self.prefilled = true;
        self.full |= n < wanted;
    }
}

/// One picked token of a step, with its logprobs if the request asked.
#[derive(Debug, Clone, PartialEq)]
struct Sampled {
    token: u32,
    logprob: Option<TokenLogprob>,
}

/// Staged outcome of one row in one step, applied only after the model committed.
struct RowCommit {
    /// The request left while its step was in flight (cancelled, expired): nothing of
    /// the step is applied to it.
    gone: bool,
    /// The sampled token and, for requests the engine detokenizes, their text update.
    sampled: Option<(Sampled, Option<Box<TextUpdate>>)>,
    /// Tokens after `sampled` from an accepted draft (empty without one).
    more: Vec<Sampled>,
    finish: Option<(FinishReason, Option<StopMatch>)>,
}

/// Buffers one step fills and empties again, kept across steps: at large batches,
/// allocating them per step (and glibc consolidating the freed chunks) was a visible share
/// of the step.
#[derive(Default)]
struct StepBufs {
    order: Vec<RunSlot>,
    prefills: Vec<RunSlot>,
    rows: Vec<Planned>,
    /// Forward inputs. Only the first `rows.len()` go to the model; the rest keep their
    /// token buffers for later steps.
    inputs: Vec<RowInput>,
    /// Per input buffer: the row's committed length when the buffer was filled. Its
    /// table's first `ceil(held / bs)` blocks were committed then, and stay the row's
    /// for as long as the row lives, whatever rolls back since.
    held: Vec<usize>,
    wanted: Vec<RowId>,
    commits: Vec<RowCommit>,
    done: Vec<(RequestKey, FinishReason, Option<StopMatch>)>,
    per_label: Vec<u64>,
    label_sums: Vec<(usize, usize)>,
    /// Prompt ++ generated of a joiner (prefix lookup and allocation).
    joiner: Vec<u32>,
}

/// Decode-only steps whose seconds `ItlTarget::Auto` takes the median of.
const DECODE_TIMES: usize = 33;
/// Under an ITL target, after this many steps in a row that carried prompt chunks
/// beside decoding rows, one step decodes alone. While every step prefills, the
/// step cost's constant and its prefill flag are one direction of the data: the
/// cost of the decoding rows alone (what says whether any chunk fits) is then a
/// guess, and the auto target's decode median goes stale. One plain step in 33
/// keeps both measured, for ~3% of a long prompt's pace.
const DECODE_PROBE_EVERY: u32 = 32;
/// Under an ITL target, after this many steps in a row whose prompt chunks were
/// all of one token (the least that fits by the prediction, beside decoding rows),
/// the next step's first chunk takes two. The model runs a prompt's token after
/// others as a decoding row, so such steps teach the cost model nothing of
/// prefilling, and a prediction too high stays so: on an H100 one slow step (a
/// first call of a new shape) put 15 us a context key into the fit, no chunk of
/// the 7000-token prompt fitted the target after it, and the prompt went a token
/// a step for 2000 steps. Two tokens are a chunk (its fixed cost, its context
/// read) at the least cost of one.
const CHUNK_PROBE_EVERY: u32 = 32;

/// The token a pipelined step's row is appended with until the pick it follows is read
/// (any id inside every vocabulary; the model feeds the real pick).
const FOLLOW_PLACEHOLDER: u32 = 0;

/// Checks a constrained row's pick at position `j` of its step (`draft`: the row's
/// draft, checked against the constraint when planned) against the mask it was made
/// under, and ends the request with STOP where the pick ends the grammar: an
/// end-of-sequence token (allowed only where the grammar may end), or a token that
/// completes it.
fn constrain_pick(
    c: &mut Constraint,
    j: usize,
    t: u32,
    draft: &[u32],
    eos: &[u32],
    key: RequestKey,
    finish: &mut Option<(FinishReason, Option<StopMatch>)>,
) -> Result<(), String> {
    if !c.allows_at(j, t) {
        return Err(format!(
            "model picked token {t} at position {j} for request {}, which its output constraint does not allow",
            key.0
        ));
    }
    if eos.contains(&t) {
        *finish = Some((FinishReason::Stop, Some(StopMatch::Constraint(Some(t)))));
    } else if !matches!(finish, Some((FinishReason::Stop, _)))
        && c.completes_at(j, t, draft)
            .map_err(|e| format!("request {}: {e}", key.0))?
    {
        *finish = Some((FinishReason::Stop, Some(StopMatch::Constraint(None))));
    }
    Ok(())
}

/// Position `i` of a step's output as a staged token.
fn picked(out: &StepOutput, i: usize, key: RequestKey) -> Result<Sampled, String> {
    let token = *out
        .tokens
        .get(i)
        .ok_or_else(|| format!("no token for request {}", key.0))?;
    let logprob = out.logprobs.get(i).cloned().flatten();
    Ok(Sampled { token, logprob })
}

/// `ceil(tokens / 2^shift)`: blocks holding `tokens` tokens (block sizes are powers of
/// two; a shift is far cheaper than the division, taken several times per row per step).
#[inline]
fn blocks_of(tokens: usize, shift: u32) -> usize {
    (tokens >> shift) + usize::from(tokens & ((1usize << shift) - 1) != 0)
}

/// New blocks a row holding `start` tokens needs to grow by `n`.
#[inline]
fn need_of(start: usize, n: usize, shift: u32) -> usize {
    blocks_of(start + n, shift) - blocks_of(start, shift)
}

/// KV blocks per group, as the planner counts them: group 0 (full attention, which
/// every row holds whole) and, for models with one, group 1 (sliding window, whose
/// rows hold only the window's blocks; always 0 without that group). Free counts,
/// a row's growth and what a preemption gives back are all of this type, so the
/// sliding group may hold fewer blocks than the full one and bind first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Blocks {
    full: usize,
    sliding: usize,
}

impl Blocks {
    /// Whether `self` fits in `free` in every group.
    #[inline]
    fn fits(self, free: Blocks) -> bool {
        self.full <= free.full && self.sliding <= free.sliding
    }

    #[inline]
    fn plus(self, o: Blocks) -> Blocks {
        Blocks {
            full: self.full + o.full,
            sliding: self.sliding + o.sliding,
        }
    }

    /// `self - o` per group, at 0 at least.
    #[inline]
    fn minus(self, o: Blocks) -> Blocks {
        Blocks {
            full: self.full.saturating_sub(o.full),
            sliding: self.sliding.saturating_sub(o.sliding),
        }
    }
}

/// Sliding-window blocks one row may need at once, the most a layout must give that
/// group (unless it has as many as the full group): the window's blocks (its first
/// block partly behind the window, its last partly filled) plus a whole prefill
/// chunk appended at once (a chunk is at most `prefill_chunk` and the step's token
/// budget; a decode step with a draft is no longer than that or its draft is cut).
/// Counted before the append's drops, so it holds whether or not they are credited.
pub fn min_sliding_blocks(cfg: &SchedulerConfig, window: u32, block_size: u32) -> usize {
    let bs = block_size.max(1) as usize;
    let chunk = cfg.prefill_chunk.min(cfg.max_step_tokens).max(1);
    (window as usize).div_ceil(bs) + chunk.div_ceil(bs) + 2
}

/// The detokenizer a request's stream runs itself: requests without stop strings are
/// detokenized on the receiving side.
pub(crate) fn stream_detok(
    req: &Request,
    detok: &Arc<dyn Detokenizer>,
) -> Option<Arc<dyn Detokenizer>> {
    req.stop_strings.is_empty().then(|| detok.clone())
}

pub struct Scheduler<M: Model> {
    cfg: SchedulerConfig,
    info: ModelInfo,
    model: M,
    pool: KvPool,
    /// Tokens per KV block, and its log2 (block sizes are powers of two).
    bs: usize,
    bs_shift: u32,
    /// The pool has a sliding-window group (group 1) beside the full one.
    sliding: bool,
    /// Pool prefix counters already published as metrics.
    prefix_seen: PrefixStats,
    detok: Arc<dyn Detokenizer>,
    admission: Arc<Admission>,
    faults: FaultPlan,
    /// What steps cost, learned from the ones run (sizes prefill under an ITL target).
    cost: StepCost,
    /// Seconds of the latest steps that only decoded (at most `DECODE_TIMES`): their
    /// median is the base of `ItlTarget::Auto`. Not the fit of all steps: while
    /// prompts join every step carries the same rows and a similar prefill, so that
    /// fit cannot tell the rows' share, and on a CPU whose lanes overlap decoding and
    /// prefill a step's cost is not a sum. Not a fit of decode steps either: their
    /// context grows while prompts join (decode-only steps are then only the probe
    /// of [`DECODE_PROBE_EVERY`]), and a fit extrapolates it. A median also shrugs off a busy host's
    /// spikes.
    decode_times: VecDeque<f64>,
    /// Committed steps since the last that carried no prompt chunk.
    prefill_streak: u32,
    /// Committed steps in a row whose prompt chunks were all of one token (see
    /// [`CHUNK_PROBE_EVERY`]); steps without a prompt chunk leave it.
    starved_streak: u32,
    /// The last plan left the decoding rows out for a starting tenant's prefill
    /// ([`Self::plan_starting`]); the next one keeps them.
    decode_skipped: bool,
    /// When the in-flight pipelined step's time began: the collect of the step it
    /// was queued behind, or its own launch with nothing in flight.
    cost_since: Option<Instant>,
    /// Seconds the in-flight step's submit waited on the device for its own work
    /// while the step before it was in flight: counted in that step's period, owed
    /// to this one ([`pipelined_seconds`]).
    blocked_carry: f64,
    /// The in-flight step's build traced a compiled form first
    /// ([`Model::last_build_traced`]): its time is not its shape's cost.
    traced_carry: bool,
    /// Waits before a step for the next request of a tenant whose last one just
    /// ended ([`SchedulerConfig::anticipation`]).
    antic: Anticipation,
    /// When the step in progress began, by the clock (its `now` may be a
    /// simulation's): the time its tokens come out is that `now` plus the time
    /// since ([`Self::emitted`]).
    step_began: Instant,
    tenants: Vec<Tenant>,
    tenant_ix: HashMap<String, usize>,
    labels: Vec<(String, TenantMetrics)>,
    reqs: Slab,
    running: Vec<RunSlot>,
    by_client_id: HashMap<(usize, String), RequestKey>,
    next_row: RowId,
    next_seq: u64,
    /// Groups of rows under isolation after a step kept failing: only the front group
    /// runs until it succeeds, or is split again.
    probation: VecDeque<Vec<RequestKey>>,
    /// Counter of the tenant whose queue emptied last; lifts a tenant that becomes
    /// backlogged while nobody else is.
    last_departed: f64,
    bufs: StepBufs,
    stats: Stats,
    metrics: EngineMetrics,
    /// Per KV group (in group order), its blocks by state.
    kind_metrics: Vec<KindMetrics>,
    /// The recurrent-state slots' gauges, when the pool has slots.
    slot_metrics: Option<SlotMetrics>,
    /// A pipelined step submitted to the model and not yet collected.
    inflight: Option<Vec<Planned>>,
    /// Releases and admissions done while a pool step was open, each with the number
    /// of steps open then (it belongs to the newest): rolling that step back undoes
    /// their pool side ([`Self::pool_rollback`]).
    open_effects: Vec<(usize, OpenEffect)>,
    /// Adapters removed while live requests still named them: the model forgets
    /// each once its last request has ended.
    retiring: BTreeSet<u32>,
    /// Adapters removed (ids are never reused): a request naming one that arrives
    /// after its removal fails at once.
    removed: BTreeSet<u32>,
}

impl<M: Model> Scheduler<M> {
    /// A scheduler for `model`, with a KV pool built from exactly the storage the model
    /// reports in [`ModelInfo::kv`] (`cfg.kv_hash_key`, if set, fixes the prefix hash
    /// key). The layout must be one full-attention group, optionally with a
    /// sliding-window group beside it, and state slots (if any) for every row a step
    /// may hold.
    pub fn new(
        cfg: SchedulerConfig,
        model: M,
        detok: Arc<dyn Detokenizer>,
    ) -> Result<Self, SchedulerError> {
        cfg.validate().map_err(SchedulerError::Config)?;
        let info = model.info();
        if info.vocab_size == 0 {
            return Err(SchedulerError::Config(
                "model reports an empty vocabulary".into(),
            ));
        }
        let mut kv = info.kv.clone();
        // Group 0 is full attention and budgets every row's length; a sliding-window
        // group beside it is budgeted too (`Blocks`): it may hold fewer blocks, as long
        // as one row alone can always advance through it (`min_sliding_blocks`).
        // State slots (recurrent-state layers): one per running row, so there must
        // be one for every row a step may hold.
        if kv.state_slots > 0 && (kv.state_slots as usize) < cfg.max_batch_rows {
            return Err(SchedulerError::UnsupportedKv(format!(
                "the model has {} recurrent-state slots for up to {} rows a step: one per \
                 row is needed (lower max_batch_rows or give the model more slots)",
                kv.state_slots, cfg.max_batch_rows
            )));
        }
        match &kv.groups[..] {
            [g] if g.kind == AttentionKind::Full => {}
            [g, GroupSpec {
                kind: AttentionKind::SlidingWindow { window },
                num_blocks,
            }] if g.kind == AttentionKind::Full => {
                let min = min_sliding_blocks(&cfg, *window, kv.block_size);
                if (*num_blocks as usize) < min && *num_blocks < g.num_blocks {
                    return Err(SchedulerError::UnsupportedKv(format!(
                        "the sliding-window group (window {window}) has {} blocks of {} tokens: \
                         a row needs up to {min} of them (its window plus a prefill chunk of \
                         {} tokens) to advance, or give it as many blocks as the full group ({})",
                        num_blocks,
                        kv.block_size,
                        cfg.prefill_chunk.min(cfg.max_step_tokens),
                        g.num_blocks
                    )));
                }
            }
            groups => {
                return Err(SchedulerError::UnsupportedKv(format!(
                    "the scheduler plans one full-attention group, optionally with a \
                     sliding-window group beside it; the model reports groups {groups:?}"
                )))
            }
        }
        let sliding = kv.groups.len() == 2;
        if let Some(key) = cfg.kv_hash_key {
            kv.hash_key = Some(key);
        }
        let kind_metrics = kv
            .groups
            .iter()
            .map(|g| KindMetrics::new(g.kind.label()))
            .collect();
        let slot_metrics = (kv.state_slots > 0).then(SlotMetrics::new);
        let pool = KvPool::new(kv)?;
        let bs = pool.block_size();
        let total = pool.group(0)?.total();
        let capacity = total.saturating_mul(bs);
        let admission = Arc::new(Admission::new(cfg.clone(), info.clone(), capacity));
        let mut labels: Vec<(String, TenantMetrics)> = Vec::new();
        let mut named: Vec<&String> = cfg.tenants.keys().collect();
        named.sort();
        for n in named {
            labels.push((n.clone(), TenantMetrics::new(n)));
        }
        labels.push(("other".into(), TenantMetrics::new("other")));
        let mut s = Self {
            faults: cfg.faults.clone(),
            cost: StepCost::new()
                .with_amortized_bound(cfg.amortized_bound)
                .with_strict_bound(cfg.strict_bound),
            decode_times: VecDeque::new(),
            prefill_streak: 0,
            starved_streak: 0,
            decode_skipped: false,
            cost_since: None,
            blocked_carry: 0.0,
            traced_carry: false,
            antic: Anticipation::new(cfg.anticipation, cfg.isolation_window),
            step_began: Instant::now(),
            cfg,
            info,
            model,
            bs,
            bs_shift: bs.trailing_zeros(),
            sliding,
            prefix_seen: pool.prefix_stats(),
            pool,
            detok,
            admission,
            tenants: Vec::new(),
            tenant_ix: HashMap::new(),
            labels,
            reqs: Slab::default(),
            running: Vec::new(),
            by_client_id: HashMap::new(),
            next_row: 1,
            next_seq: 0,
            probation: VecDeque::new(),
            last_departed: 0.0,
            bufs: StepBufs::default(),
            stats: Stats::default(),
            metrics: EngineMetrics::new(),
            kind_metrics,
            slot_metrics,
            inflight: None,
            open_effects: Vec::new(),
            retiring: BTreeSet::new(),
            removed: BTreeSet::new(),
        };
        // The pool's gauges from the start, before any step.
        s.publish();
        Ok(s)
    }

    pub(crate) fn detokenizer(&self) -> Arc<dyn Detokenizer> {
        self.detok.clone()
    }

    pub(crate) fn admission(&self) -> Arc<Admission> {
        self.admission.clone()
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn model(&self) -> &M {
        &self.model
    }

    /// The learned step cost model, read-only (tests and diagnostics).
    pub fn step_cost(&self) -> &StepCost {
        &self.cost
    }

    /// The KV pool, read-only (tests audit its tables; metrics read its counts).
    pub fn kv_pool(&self) -> &KvPool {
        &self.pool
    }

    /// Submit-time fault counters (tests read how many faults fired).
    pub fn faults(&self) -> &FaultPlan {
        &self.faults
    }

    /// Any request not yet finished?
    pub fn has_work(&self) -> bool {
        !self.reqs.is_empty() || self.inflight.is_some()
    }

    /// Requests queued while no row runs: the engine may wait for more of a
    /// burst before stepping (see `SchedulerConfig::coalesce_gap`).
    pub fn only_waiting(&self) -> bool {
        self.running.is_empty() && !self.reqs.is_empty()
    }

    /// Anticipation ([`SchedulerConfig::anticipation`]): how long the engine may
    /// still wait before its next step for the next request of a tenant whose last
    /// one just ended, while other work waits for that step. None: step now.
    pub fn anticipation(&mut self, now: Instant) -> Option<Duration> {
        if !self.has_work() {
            return None;
        }
        let tenants = &self.tenants;
        self.antic
            .wait(now, |t| tenants.get(t).is_some_and(Tenant::idle))
    }

    /// The burst-coalescing window, if on: (gap, cap).
    pub fn coalesce(&self) -> Option<(Duration, Duration)> {
        (!self.cfg.coalesce_gap.is_zero()).then_some((self.cfg.coalesce_gap, self.cfg.coalesce_max))
    }

    /// Validate, apply limits, and queue a request. Same checks as `Engine::submit`.
    pub fn submit(&mut self, req: Request, now: Instant) -> Result<EventStream, SubmitError> {
        let key = self.admission.admit(&req, now)?;
        let (tx, rx) = chan::channel();
        let local = stream_detok(&req, &self.detok);
        self.enqueue(key, req, tx, now);
        Ok(EventStream::new(key, rx, local))
    }

    /// Queue a request that already passed admission.
    pub(crate) fn enqueue(
        &mut self,
        key: RequestKey,
        r: Request,
        tx: chan::Sender<Msg>,
        arrival: Instant,
    ) {
        let tenant = self.tenant_index(&r.tenant, r.tenant_weight);
        if self.tenants[tenant].idle() {
            self.antic.arrived(tenant, arrival);
        }
        let seed = r.seed.unwrap_or_else(|| mix64(self.cfg.seed ^ key.0));
        if let Some(id) = &r.request_id {
            self.by_client_id.insert((tenant, id.clone()), key);
        }
        let penalties = r
            .sampling
            .has_penalties()
            .then(|| PenaltyState::new(&r.prompt, &[]));
        let seq = self.next_seq;
        self.next_seq += 1;
        self.reqs.insert(
            key,
            Req {
                key,
                tenant,
                seq,
                r,
                tx,
                row: None,
                generated: Vec::new(),
                computed: 0,
                cached: 0,
                text: TextState::default(),
                penalties,
                seed,
                arrival,
                scheduled_at: None,
                first_token_at: None,
                last_token_at: None,
                charged: false,
                preemptions: 0,
                draft: Vec::new(),
            },
        );
        self.push_waiting(key);
        if let Some(a) = self.reqs.get(&key).and_then(|r| r.r.adapter) {
            if self.removed.contains(&a) {
                let msg = format!("adapter {a} was unloaded before the request reached the engine");
                self.finish(key, FinishReason::Error, None, Some(msg), arrival);
            }
        }
    }

    /// Registers adapter `id` with the model (see [`Model::add_adapter`]); ids are
    /// never reused, so an id removed before is refused.
    pub fn add_adapter(
        &mut self,
        id: u32,
        source: crate::model::AdapterSource,
    ) -> Result<crate::model::AdapterDesc, ModelError> {
        if self.removed.contains(&id) {
            return Err(ModelError::Contract(format!(
                "adapter id {id} was removed and is not reused"
            )));
        }
        self.model.add_adapter(id, source)
    }

    /// Removes adapter `id`: requests already queued or running with it finish with
    /// it, a request naming it that arrives from now on fails, and the model forgets
    /// it once the last of them has ended. Returns how many live requests still name
    /// it.
    pub fn remove_adapter(&mut self, id: u32) -> usize {
        self.removed.insert(id);
        let live = self
            .reqs
            .values()
            .filter(|r| r.r.adapter == Some(id))
            .count();
        self.retiring.insert(id);
        self.retire_adapters();
        live
    }

    /// Has the model forget every retiring adapter no live request names any more.
    fn retire_adapters(&mut self) {
        if self.retiring.is_empty() {
            return;
        }
        let named: BTreeSet<u32> = self.reqs.values().filter_map(|r| r.r.adapter).collect();
        let done: Vec<u32> = self
            .retiring
            .iter()
            .copied()
            .filter(|a| !named.contains(a))
            .collect();
        for a in done {
            self.retiring.remove(&a);
            if let Err(e) = self.model.remove_adapter(a) {
                warn!(adapter = a, error = %e, "the model could not forget an adapter");
            }
        }
    }

    /// The adapters of the running rows.
    fn running_adapters(&self) -> BTreeSet<u32> {
        self.running
            .iter()
            .filter_map(|rs| self.reqs.at(rs.slot).and_then(|r| r.r.adapter))
            .collect()
    }

    fn tenant_index(&mut self, name: &str, weight: f64) -> usize {
        if let Some(&i) = self.tenant_ix.get(name) {
            // The front end is authoritative for weights; the newest one wins.
            self.tenants[i].weight = weight;
            return i;
        }
        let label = self
            .labels
            .iter()
            .position(|(l, _)| l == name)
            .unwrap_or(self.labels.len() - 1);
        let i = self.tenants.len();
        self.tenants.push(Tenant {
            name: name.to_string(),
            weight,
            counter: 0.0,
            queue: BTreeMap::new(),
            running: 0,
            max_running: self.cfg.limits(name).max_running,
            label,
            salt: Salt(i as u64 + 1),
            last_active: None,
        });
        self.tenant_ix.insert(name.to_string(), i);
        i
    }

    fn push_waiting(&mut self, key: RequestKey) {
        let Some(r) = self.reqs.get(&key) else { return };
        let (t, slot) = (r.tenant, r.queue_slot());
        if self.tenants[t].queue.is_empty() {
            // VTC: a tenant that becomes backlogged starts no lower than the least-served
            // backlogged tenant, so idle time is not banked as credit.
            let floor = self
                .tenants
                .iter()
                .enumerate()
                .filter(|(i, x)| *i != t && !x.queue.is_empty())
                .map(|(_, x)| x.counter)
                .min_by(f64::total_cmp)
                .unwrap_or(self.last_departed);
            let c = &mut self.tenants[t].counter;
            *c = c.max(floor);
        }
        self.tenants[t].queue.insert(slot, key);
    }

    fn remove_waiting(&mut self, t: usize, slot: (Reverse<i32>, u64)) {
        let tenant = &mut self.tenants[t];
        tenant.queue.remove(&slot);
        if tenant.queue.is_empty() {
            self.last_departed = tenant.counter;
        }
    }

    /// Cancel a live request by its client id. Returns whether it was found.
    pub fn cancel(&mut self, tenant: &str, request_id: &str, now: Instant) -> bool {
        let Some(&t) = self.tenant_ix.get(tenant) else {
            return false;
        };
        let Some(&key) = self.by_client_id.get(&(t, request_id.to_string())) else {
            return false;
        };
        self.finish(key, FinishReason::Cancelled, None, None, now);
        true
    }

    /// After a panic on the engine thread, when the scheduler's state may be torn
    /// mid-step: sends every live request its final event (`FinishReason::Error` with
    /// `error`) without touching the pool or the model, and closes admission. The
    /// scheduler must not step again.
    pub fn abandon_all(&mut self, error: &str) {
        self.admission.close();
        let mut live: Vec<&Req> = self.reqs.values().collect();
        live.sort_by_key(|r| r.key);
        for r in live {
            crate::metrics::finished(FinishReason::Error);
            let _ = r.tx.send(Msg::Finished(Box::new(Finished {
                reason: FinishReason::Error,
                stop: None,
                usage: Usage {
                    prompt_tokens: r.r.prompt.len(),
                    cached_prompt_tokens: r.cached,
                    generated_tokens: r.generated.len(),
                    queue_time: r
                        .scheduled_at
                        .unwrap_or(r.arrival)
                        .saturating_duration_since(r.arrival),
                    time_to_first_token: r
                        .first_token_at
                        .map(|f| f.saturating_duration_since(r.arrival)),
                    preemptions: r.preemptions,
                },
                error: Some(error.to_string()),
            })));
        }
    }

    /// Finish every live request with an error (engine shutdown).
    pub fn shutdown(&mut self, now: Instant) {
        if self.inflight.take().is_some() {
            self.undo_newest();
        }
        let mut keys: Vec<RequestKey> = self.reqs.keys().copied().collect();
        keys.sort();
        for k in keys {
            self.finish(
                k,
                FinishReason::Error,
                None,
                Some("engine shut down".into()),
                now,
            );
        }
        self.admission.close();
    }

    /// One engine step: reap cancelled and expired requests, plan (preempting and
    /// admitting as needed), then run the step as one transaction.
    pub fn step(&mut self, now: Instant) -> StepReport {
        let wall = Instant::now();
        self.step_began = wall;
        self.settle_anticipation(wall);
        self.reap(now);
        let report = if let Some(rows) = self.inflight.take() {
            self.injected_panic();
            self.resolve(rows, now)
        } else {
            let plan = self.plan(now);
            if !plan.rows.is_empty() {
                self.injected_panic();
            }
            if plan.rows.is_empty() {
                self.bufs.rows = plan.rows;
                StepReport::default()
            } else if self.pipelinable(&plan) {
                // The period from here covers the launch's own submit.
                self.cost_since = Some(Instant::now());
                self.blocked_carry = 0.0;
                self.traced_carry = false;
                match self.launch(plan.rows) {
                    // Queued: collected at once, after its successor is queued.
                    Ok(rows) => self.resolve(rows, now),
                    Err(rows) if rows.is_empty() => {
                        self.bufs.rows = rows;
                        StepReport::default()
                    }
                    Err(rows) => {
                        let plan = Plan {
                            rows,
                            probation: false,
                        };
                        let r = self.run(&plan, now);
                        self.bufs.rows = plan.rows;
                        r
                    }
                }
            } else {
                let r = self.run(&plan, now);
                self.bufs.rows = plan.rows;
                r
            }
        };
        if report.committed {
            self.stats.steps += 1;
            self.metrics
                .step_duration
                .record(wall.elapsed().as_secs_f64());
            self.metrics.batch_size.record(report.rows as f64);
        }
        self.retire_adapters();
        self.publish();
        report
    }

    /// Test-only ([`FaultPlan::panic_at_step`]): a panic outside the step transaction.
    fn injected_panic(&mut self) {
        if self.faults.step_panics() {
            panic!("injected engine-thread panic (test-only fault injection)");
        }
    }

    fn reap(&mut self, now: Instant) {
        let mut gone: Vec<(RequestKey, FinishReason)> = self
            .reqs
            .values()
            .filter_map(|r| {
                if r.tx.is_closed() {
                    Some((r.key, FinishReason::Cancelled))
                } else if r.r.deadline.is_some_and(|d| d <= now) {
                    Some((r.key, FinishReason::Deadline))
                } else {
                    None
                }
            })
            .collect();
        gone.sort_by_key(|g| g.0);
        for (k, why) in gone {
            self.finish(k, why, None, None, now);
        }
    }

    /// Preemption order, best kept first: higher priority, then the tenant least ahead
    /// in fair share, then older.
    fn keep_key(&self, slot: u32) -> (Reverse<i32>, u64, u64) {
        match self.reqs.at(slot) {
            Some(r) => {
                let c = self.tenants[r.tenant].counter;
                // Counters are >= 0, so the IEEE bit pattern orders like the value.
                (Reverse(r.r.priority), c.max(0.0).to_bits(), r.seq)
            }
            None => (Reverse(i32::MIN), u64::MAX, u64::MAX),
        }
    }

    /// Blocks a row of `tokens` tokens holds in the full-attention group:
    /// `ceil(tokens / bs)` (its table always has exactly that many blocks).
    #[inline]
    fn blocks(&self, tokens: usize) -> usize {
        blocks_of(tokens, self.bs_shift)
    }

    /// Blocks a new sequence (a joiner, holding `start` tokens of a prefix hit) takes
    /// to grow by `n`, per group: the same new blocks in both (a hit's sliding table
    /// already starts at the window, so its first append releases nothing).
    #[inline]
    fn need(&self, start: usize, n: usize) -> Blocks {
        let new = need_of(start, n, self.bs_shift);
        Blocks {
            full: new,
            sliding: if self.sliding { new } else { 0 },
        }
    }

    /// Sliding-window blocks running sequence `seq` gives back when it next appends
    /// in a step of its own (those behind the window of its length now that no other
    /// sequence shares; the pool releases them before it allocates). 0 without a
    /// sliding group.
    #[inline]
    fn released(&self, seq: SeqId) -> usize {
        if self.sliding {
            self.pool.releasable_on_append(seq, 1).unwrap_or(0)
        } else {
            0
        }
    }

    /// Blocks running sequence `seq`, holding `start` tokens (its length in the pool
    /// now), takes per group to grow by `n` in a step: its new blocks, less in the
    /// sliding group what the append releases first. Exact when the released blocks
    /// are only this sequence's; a block shared with another row that both release
    /// in one step is not counted (the plan is then short of what is really free,
    /// never over). Free counts are re-read from the pool every step.
    #[inline]
    fn grow(&self, seq: SeqId, start: usize, n: usize) -> Blocks {
        let new = need_of(start, n, self.bs_shift);
        Blocks {
            full: new,
            sliding: if self.sliding {
                new.saturating_sub(self.released(seq))
            } else {
                0
            },
        }
    }

    /// Blocks an allocation can take now, per group: free plus evictable cached ones.
    fn available(&self) -> Blocks {
        let of = |g: usize| self.pool.group(g).map_or(0, |g| g.available());
        Blocks {
            full: of(0),
            sliding: if self.sliding { of(1) } else { 0 },
        }
    }

    /// (resident, committed length, tokens left to feed) of a running request.
    fn progress(&self, slot: u32) -> Option<(Resident, usize, usize)> {
        let r = self.reqs.at(slot)?;
        Some((r.row?, r.computed, r.seq_len() - r.computed))
    }

    fn plan(&mut self, now: Instant) -> Plan {
        for t in &mut self.tenants {
            if t.running > 0 || !t.queue.is_empty() {
                t.last_active = Some(now);
            }
        }
        if self.probation.is_empty() {
            if let Some(k) = self.room_victim() {
                debug!(request = k.0, "preempting a row for a tenant holding none");
                self.preempt(k);
            }
        }
        if let Some(plan) = self.plan_starting(now) {
            self.decode_skipped = self.cfg.starting_step == StartingStep::Alone;
            return plan;
        }
        self.decode_skipped = false;
        let mut order = std::mem::take(&mut self.bufs.order);
        let mut prefills = std::mem::take(&mut self.bufs.prefills);
        let mut rows = std::mem::take(&mut self.bufs.rows);
        let probation = loop {
            order.clear();
            prefills.clear();
            rows.clear();
            let group: Option<HashSet<RequestKey, crate::util::IdBuild>> =
                self.probation.front().map(|g| {
                    g.iter()
                        .copied()
                        .filter(|k| self.reqs.get(k).is_some_and(|r| r.row.is_some()))
                        .collect()
                });
            if group.as_ref().is_some_and(|g| g.is_empty()) {
                self.probation.pop_front();
                continue;
            }
            order.extend(
                self.running
                    .iter()
                    .copied()
                    .filter(|x| group.as_ref().is_none_or(|g| g.contains(&x.key))),
            );
            // Real pool blocks an append can take: free plus evictable cached ones.
            let mut free = self.available();
            // One pass over the batch: decoding rows are planned right away; whether
            // memory suffices for all of them decides between the fast path and the
            // preempting one.
            let mut decode_need = Blocks::default();
            for &x in &order {
                let Some((res, start, rem)) = self.progress(x.slot) else {
                    continue;
                };
                if rem == 1 {
                    decode_need = decode_need.plus(self.grow(res.seq, start, 1));
                    rows.push(Planned::decode(x, res, start));
                } else if rem > 1 {
                    prefills.push(x);
                }
            }
            let decodes = rows.len();
            if decode_need.fits(free) {
                // No decoding row can be short of memory, so their order is irrelevant;
                // only prefill rows compete (for the token budget), in keep order. This
                // skips sorting the whole batch in the common case.
                free = free.minus(decode_need);
                let drafted = self.add_drafts(&mut rows, &mut free);
                prefills.sort_by_cached_key(|x| self.keep_key(x.slot));
                let mut budget = self.prefill_budget(decodes + drafted);
                let joiners = group.is_none();
                let mut fit = self.prefill_running(
                    now,
                    &prefills,
                    &mut rows,
                    &mut budget,
                    &mut free,
                    joiners,
                );
                if rows.is_empty() && !prefills.is_empty() {
                    // Every running row is stalled on memory: free the least-kept one so
                    // the others can move, then plan again.
                    if let Some(last) = prefills.last() {
                        self.preempt(last.key);
                    }
                    continue;
                }
                self.close_plan(now, &mut rows, &mut budget, &mut free, &mut fit, joiners);
                break group.is_some();
            }

            // Memory is short: go through the batch in keep order; decoding rows may
            // preempt the least-kept rows.
            rows.clear();
            order.sort_by_cached_key(|x| self.keep_key(x.slot));
            let mut budget = self.prefill_budget(decodes);
            let mut end = order.len();
            let mut i = 0;
            while i < end {
                let x = order[i];
                let Some((res, start, rem)) = self.progress(x.slot) else {
                    i += 1;
                    continue;
                };
                if rem != 1 {
                    i += 1;
                    continue;
                }
                let need = self.grow(res.seq, start, 1);
                let mut preempted_self = false;
                while !need.fits(free) {
                    end -= 1;
                    let v = order[end];
                    if v == x {
                        self.preempt(v.key);
                        preempted_self = true;
                        break;
                    }
                    if self.progress(v.slot).is_some_and(|(_, _, vrem)| vrem == 1) {
                        budget += 1;
                    }
                    // What the victim really gives back: blocks only it referenced
                    // (prefix blocks it shares with other rows stay in use).
                    free = free.plus(self.preempt(v.key));
                }
                if preempted_self {
                    break;
                }
                free = free.minus(need);
                rows.push(Planned::decode(x, res, start));
                i += 1;
            }

            // Then prefill chunks of running rows, shrunk to what memory allows.
            prefills.clear();
            prefills.extend(
                order[..end]
                    .iter()
                    .copied()
                    .filter(|x| self.progress(x.slot).is_some_and(|(_, _, rem)| rem > 1)),
            );
            let joiners = group.is_none();
            let mut fit =
                self.prefill_running(now, &prefills, &mut rows, &mut budget, &mut free, joiners);

            if rows.is_empty() && end > 0 {
                self.preempt(order[end - 1].key);
                continue;
            }

            self.close_plan(now, &mut rows, &mut budget, &mut free, &mut fit, joiners);
            break group.is_some();
        };
        self.bufs.order = order;
        self.bufs.prefills = prefills;
        Plan { rows, probation }
    }

    /// Gives the decoding rows in `rows` whose requests speculate a prompt-lookup draft,
    /// as far as `free` blocks allow; returns the draft tokens added.
    fn add_drafts(&mut self, rows: &mut [Planned], free: &mut Blocks) -> usize {
        let k = self.cfg.speculate;
        let mut budget = self.cfg.speculate_step_tokens.saturating_sub(rows.len());
        if k == 0 || budget == 0 || !self.model.supports_drafts() {
            return 0;
        }
        let shift = self.bs_shift;
        let sliding = self.sliding;
        let mut added = 0;
        let mut mask_time = MaskTime::default();
        for p in rows.iter_mut() {
            if budget == 0 {
                break;
            }
            let Some(r) = self.reqs.at_mut(p.slot) else {
                continue;
            };
            r.draft.clear();
            if !r.speculates() {
                continue;
            }
            // This step emits 1 + accepted tokens; never more than max_tokens allows.
            let max = k
                .min(budget)
                .min(r.r.max_tokens.saturating_sub(r.generated.len() + 1));
            let seq = Seq {
                head: &r.r.prompt,
                tail: &r.generated,
            };
            draft::propose(seq, max, &mut r.draft);
            if let Some(c) = r.r.constraint.as_mut().filter(|_| !r.draft.is_empty()) {
                let t = Instant::now();
                match c.check_draft(&mut r.draft) {
                    Ok(computed) => mask_time.add(t, computed),
                    // The row decodes plainly; its constraint's error surfaces as
                    // the step's inputs are filled.
                    Err(_) => r.draft.clear(),
                }
            }
            if r.draft.is_empty() {
                continue;
            }
            let n = 1 + r.draft.len();
            // The draft's blocks beyond the decoded token's, in every group (what the
            // append releases is the same either way and already counted).
            let more = need_of(p.start, n, shift) - need_of(p.start, 1, shift);
            let extra = Blocks {
                full: more,
                sliding: if sliding { more } else { 0 },
            };
            if !extra.fits(*free) {
                r.draft.clear();
                continue;
            }
            *free = free.minus(extra);
            p.draft = n - 1;
            p.n = n;
            added += n - 1;
            budget -= n - 1;
        }
        self.record_masks(mask_time);
        added
    }

    /// A plan's last part, once its running rows are in: waiting requests join (with
    /// `joiners`: not under probation) while the budgets allow, and the stats show the
    /// ITL target it planned under.
    fn close_plan(
        &mut self,
        now: Instant,
        rows: &mut Vec<Planned>,
        budget: &mut usize,
        free: &mut Blocks,
        fit: &mut TimeFit,
        joiners: bool,
    ) {
        if joiners {
            self.admit_joiners(now, rows, budget, free, fit, Joiners::All);
        }
        self.stats.itl_target = fit.itl.or(self.stats.itl_target);
    }

    /// Latency isolation between tenants: while tenants share the engine
    /// ([`Self::tenants_share`]), the prefill of starting tenants ([`Self::starting`]:
    /// one short request, no row) runs in a step of its own, in fair order, the
    /// decoding rows and other tenants' prompts left out of it
    /// ([`StartingStep::Alone`]; with [`StartingStep::BesideRows`] the decoding rows
    /// stay in it and only the others' prompts are left out). A mixed step would make it
    /// wait for every decoding row of the others besides its own prompt (on the CPU
    /// a 33-row decode doubles a short request's first step; on a GPU the rows run
    /// uncompiled beside a prefill), where the decoding rows wait one short step
    /// instead, which costs about what the mixed step would have cost them. Never
    /// twice in a row (decoding rows always advance every other step), not under
    /// probation, not with the batch full. None: plan as usual.
    ///
    /// Also before another tenant's burst of prompts, with no row decoding: a step
    /// with them would make the starting request wait for their prefill too (on the
    /// CPU a light request arriving with a 32-stream flood's first prompts waited
    /// ~505 ms for a 164-token step, against ~150 ms for its own 32 tokens).
    ///
    /// Only for a request whose prompt is one chunk (`prefill_chunk`): a longer
    /// one's first token is several steps away whatever its first step is, and a
    /// step of its own would only stretch the decoding rows' gap, which spans that
    /// step and their next one (on an H200 the skipped step and the mixed step after
    /// it made the long-prompts run's worst gaps, 56-76 ms under a 20 ms target).
    fn plan_starting(&mut self, now: Instant) -> Option<Plan> {
        let decoding = self
            .running
            .iter()
            .any(|x| self.progress(x.slot).is_some_and(|(_, _, rem)| rem == 1));
        if !self.starting_due(now, decoding) {
            return None;
        }
        let mut rows = std::mem::take(&mut self.bufs.rows);
        rows.clear();
        let mut free = self.available();
        let mut decodes = 0;
        if self.cfg.starting_step == StartingStep::BesideRows {
            // The decoding rows (and their drafts) as a plain step has them, when
            // memory holds them all; else the usual plan, which may preempt.
            let mut need = Blocks::default();
            for x in &self.running {
                let Some((res, start, 1)) = self.progress(x.slot) else {
                    continue;
                };
                need = need.plus(self.grow(res.seq, start, 1));
                rows.push(Planned::decode(*x, res, start));
            }
            if !need.fits(free) {
                rows.clear();
                self.bufs.rows = rows;
                return None;
            }
            free = free.minus(need);
            decodes = rows.len();
            decodes += self.add_drafts(&mut rows, &mut free);
        }
        let mut budget = self.prefill_budget(decodes);
        let mut fit = self.time_fit(&rows, now);
        self.admit_joiners(
            now,
            &mut rows,
            &mut budget,
            &mut free,
            &mut fit,
            Joiners::Starting,
        );
        if !rows.iter().any(|p| p.prefill) {
            // (Drafts proposed for rows that now plan as usual are proposed again.)
            self.bufs.rows = rows;
            return None;
        }
        self.stats.itl_target = fit.itl.or(self.stats.itl_target);
        Some(Plan {
            rows,
            probation: false,
        })
    }

    /// Whether a step's plan is [`Self::plan_starting`]'s, with rows `decoding` (or
    /// not) in the batch.
    fn starting_due(&self, now: Instant, decoding: bool) -> bool {
        if self.decode_skipped
            || !self.probation.is_empty()
            || self.running.len() >= self.cfg.max_batch_rows
            || !self.tenants_share(now)
        {
            return false;
        }
        let (mut any_starting, mut others_waiting) = (false, false);
        for (t, x) in self.tenants.iter().enumerate() {
            if self.starting(t) {
                any_starting = true;
            } else if !x.queue.is_empty() {
                others_waiting = true;
            }
        }
        // Only worth it beside decoding rows, or before another tenant's prompts.
        any_starting && (decoding || others_waiting)
    }

    /// The time budget of a step whose decoding rows (and their drafts) are `rows`:
    /// with an inter-token latency target and decoding rows, every prefill chunk
    /// added is sized by the learned step cost to keep the step predicted within the
    /// target, at its own depth; the first chunk gets a block's worth when nothing
    /// fits, so prompts always advance. Without decoding rows nobody waits on the step
    /// yet, but whoever arrives during it will: it is held to the target while another
    /// tenant was active lately ([`SchedulerConfig::isolation_window`]), and to
    /// [`SchedulerConfig::burst_step_factor`] targets otherwise.
    fn time_fit(&self, rows: &[Planned], now: Instant) -> TimeFit {
        let short_prompts = self.model.short_prompts();
        let shape = shape_of(rows, short_prompts);
        // Not beside a drafted row: the model runs no short chunks there.
        let drafts = rows.iter().any(|p| p.draft > 0);
        let short = short_prompts.filter(|_| !drafts).map(|limits| {
            let (mut others, mut chunks) = (StepShape::default(), Vec::new());
            for p in rows {
                if p.prefill {
                    chunks.push((p.start, p.n));
                } else {
                    others.add(p.start, p.n);
                }
            }
            ShortStep {
                limits,
                others,
                chunks,
            }
        });
        let itl = match self.cfg.itl_target {
            ItlTarget::Off => None,
            ItlTarget::Fixed(t) => Some(t.as_secs_f64()),
            ItlTarget::Auto { factor, min } => self
                .decode_median()
                .map(|d| (d.max(self.admitted_decode_cost()) * factor).max(min.as_secs_f64())),
        };
        let target = if rows.is_empty() && !self.tenants_share(now) {
            itl.map(|t| t * self.cfg.burst_step_factor)
                .filter(|t| t.is_finite())
        } else {
            itl
        };
        TimeFit {
            itl,
            target,
            shape,
            min: self.bs,
            prefilled: false,
            full: target.is_some()
                && shape.decode_rows > 0
                && self.prefill_streak >= DECODE_PROBE_EVERY,
            probe: self.starved_streak >= CHUNK_PROBE_EVERY,
            granule: self.cfg.prefill_granule.max(1),
            short,
        }
    }

    /// The predicted cost of a decode-only step of the batch once the waiting
    /// requests are in it: the decoding rows at their lengths and waiting requests
    /// (fair order aside) at theirs while rows and free blocks last; 0 with nothing
    /// waiting, or before the cost model predicts. The auto ITL target follows it
    /// when it is more than the decode steps' median: with a queue, the rows
    /// decoding now are not the batch, and a target of a few small steps would admit
    /// prompts a sliver per step, keeping the batch small (a fixed point: 1-3 rows
    /// decoding while 30 requests waited 5-40 s for their first token). Rows already
    /// admitted and still prefilling are left out: they advance either way, and a
    /// long one's depth would be priced by a context term fitted on short rows.
    fn admitted_decode_cost(&self) -> f64 {
        if self.tenants.iter().all(|t| t.queue.is_empty()) {
            return 0.0;
        }
        let mut shape = StepShape::default();
        for x in &self.running {
            if let Some((_, start, 1)) = self.progress(x.slot) {
                shape.add(start, 1);
            }
        }
        let mut free = self.available().full;
        let room = self.cfg.max_batch_rows.saturating_sub(self.running.len());
        let queued = self.tenants.iter().flat_map(|t| t.queue.values());
        for k in queued.take(room) {
            let Some(r) = self.reqs.get(k) else { continue };
            let need = blocks_of(r.seq_len() + 1, self.bs_shift);
            if need > free {
                break;
            }
            free -= need;
            shape.add(r.seq_len(), 1);
        }
        self.cost.predict(&shape).unwrap_or(0.0)
    }

    /// Whether more than one tenant has requests in the engine now or had them
    /// within the isolation window.
    fn tenants_share(&self, now: Instant) -> bool {
        let w = self.cfg.isolation_window;
        if w.is_zero() {
            return false;
        }
        self.tenants
            .iter()
            .filter(|t| !t.idle() || t.last_active.is_some_and(|a| now.duration_since(a) <= w))
            .nth(1)
            .is_some()
    }

    /// A starting tenant: it holds no row and waits with one request whose prompt is
    /// one chunk (an interactive client's next turn, not a batch of its own).
    fn starting(&self, t: usize) -> bool {
        let x = &self.tenants[t];
        x.running == 0
            && x.max_running > 0
            && x.queue.len() == 1
            && x.queue
                .values()
                .next()
                .and_then(|k| self.reqs.get(k))
                .is_some_and(|r| r.seq_len() <= self.cfg.prefill_chunk)
    }

    /// Where a request of tenant `t` at `priority` stands for a step's prefill:
    /// higher priority first, then the tenant least served so far (its virtual
    /// counter), then the tenant holding fewer rows (so a tenant lifted to the
    /// counter of a backlogged one goes before it).
    fn prefill_key(&self, t: usize, priority: i32) -> FairKey {
        let x = &self.tenants[t];
        // Counters are >= 0, so the IEEE bit pattern orders like the value.
        (Reverse(priority), x.counter.max(0.0).to_bits(), x.running)
    }

    /// With every row of the batch taken, a running row to preempt so that the
    /// tenant first in fair order can start although it holds no row: the least-kept
    /// row (lowest priority, youngest) of the tenant holding the most rows beyond its
    /// weighted share of the batch, if that tenant is no less served and the row's
    /// priority is no higher than the waiting request's. At most one row per tenant
    /// left without one, so two backlogged tenants never trade rows back and forth.
    fn room_victim(&self) -> Option<RequestKey> {
        if self.running.len() < self.cfg.max_batch_rows {
            return None;
        }
        let t = self.pick_tenant()?;
        let waiting = &self.tenants[t];
        if waiting.running > 0 {
            return None;
        }
        let (&(Reverse(priority), _), _) = waiting.queue.first_key_value()?;
        let active: f64 = self
            .tenants
            .iter()
            .filter(|x| x.running > 0 || !x.queue.is_empty())
            .map(|x| x.weight)
            .sum();
        let rows = self.cfg.max_batch_rows as f64;
        let (v, over) = self
            .tenants
            .iter()
            .enumerate()
            .filter(|(i, x)| *i != t && x.running > 0 && x.counter >= waiting.counter)
            .map(|(i, x)| (i, x.running as f64 - rows * x.weight / active))
            .max_by(|a, b| a.1.total_cmp(&b.1))?;
        if over < 1.0 {
            return None;
        }
        self.running
            .iter()
            .filter(|x| {
                self.reqs
                    .at(x.slot)
                    .is_some_and(|r| r.tenant == v && r.r.priority <= priority)
            })
            .max_by_key(|x| self.keep_key(x.slot))
            .map(|x| x.key)
    }

    /// Prefill tokens a step with `decodes` decoding rows may add.
    fn prefill_budget(&self, decodes: usize) -> usize {
        let left = self.cfg.max_step_tokens.saturating_sub(decodes);
        match self.cfg.decode_prefill_tokens {
            Some(cap) if decodes > 0 => left.min(cap),
            _ => left,
        }
    }

    /// The prefill of a step whose decoding rows are already in `rows`: the step's
    /// time budget from those rows ([`Self::time_fit`]), then the running rows `xs`'
    /// chunks ([`Self::plan_prefills`]). Returns what is left of the time budget, for
    /// the joiners admitted after.
    fn prefill_running(
        &mut self,
        now: Instant,
        xs: &[RunSlot],
        rows: &mut Vec<Planned>,
        budget: &mut usize,
        free: &mut Blocks,
        joiners: bool,
    ) -> TimeFit {
        let mut fit = self.time_fit(rows, now);
        self.plan_prefills(now, xs, rows, budget, free, &mut fit, joiners);
        fit
    }

    /// Prefill chunks for running rows (in keep order), each shrunk to the token budget,
    /// the step's time and the memory left; rows that get nothing wait for a later
    /// step. With `joiners`, waiting requests ahead of a row in fair order
    /// ([`Self::prefill_key`]) are admitted before it, so a tenant served less so far
    /// gets its prefill into this step although others' prompts are mid-prefill.
    #[allow(clippy::too_many_arguments)]
    fn plan_prefills(
        &mut self,
        now: Instant,
        xs: &[RunSlot],
        rows: &mut Vec<Planned>,
        budget: &mut usize,
        free: &mut Blocks,
        fit: &mut TimeFit,
        joiners: bool,
    ) {
        for &x in xs {
            if joiners {
                if let Some((t, p)) = self.reqs.at(x.slot).map(|r| (r.tenant, r.r.priority)) {
                    let key = self.prefill_key(t, p);
                    self.admit_joiners(now, rows, budget, free, fit, Joiners::AheadOf(t, key));
                }
            }
            if *budget == 0 || fit.full {
                break;
            }
            let Some((res, start, rem)) = self.progress(x.slot) else {
                continue;
            };
            // The longest this row can grow to with the blocks left: in the full group
            // its table's blocks plus the free ones; in the sliding group also what its
            // append releases first.
            let held = self.blocks(start);
            let mut cap = (held + free.full) * self.bs;
            if self.sliding {
                cap = cap.min((held + free.sliding + self.released(res.seq)) * self.bs);
            }
            let n = self
                .cfg
                .prefill_chunk
                .min(rem)
                .min(*budget)
                .min(cap.saturating_sub(start));
            if n == 0 {
                continue;
            }
            let wanted = n;
            let n = fit.allowed(&self.cost, start, wanted);
            if n == 0 {
                break;
            }
            fit.take(start, n, wanted);
            *free = free.minus(self.grow(res.seq, start, n));
            *budget -= n;
            rows.push(Planned {
                key: x.key,
                slot: x.slot,
                row: res.row,
                seq: res.seq,
                start,
                n,
                want_logits: n == rem,
                draft: 0,
                prefill: true,
            });
        }
    }

    fn pick_tenant(&self) -> Option<usize> {
        self.pick_tenant_except(&[])
    }

    /// [`pick_tenant`](Self::pick_tenant) among the tenants not in `skip`.
    fn pick_tenant_except(&self, skip: &[usize]) -> Option<usize> {
        self.tenants
            .iter()
            .enumerate()
            .filter(|(i, t)| !t.queue.is_empty() && t.running < t.max_running && !skip.contains(i))
            .min_by(|a, b| {
                a.1.counter
                    .total_cmp(&b.1.counter)
                    .then(a.1.running.cmp(&b.1.running))
                    .then(a.0.cmp(&b.0))
            })
            .map(|(i, _)| i)
    }

    /// The prefix-cache domain of a tenant's sequences running with `adapter`
    /// (None: caching off): the tenant's salt for the base model, and for each adapter
    /// a salt no other (tenant, adapter) pair has — tenant salts (`index + 1`) sit in
    /// the low 31 bits, bit 31 marks an adapter and the adapter id is the high 32 — so
    /// KV is shared only within one tenant and one adapter.
    fn salt_of(&self, t: usize, adapter: Option<u32>) -> Option<Salt> {
        self.cfg.prefix_cache.then(|| {
            let base = self.tenants[t].salt;
            match adapter {
                None => base,
                Some(a) => Salt((u64::from(a) << 32) | (1 << 31) | (base.0 & 0x7fff_ffff)),
            }
        })
    }

    /// Admits waiting requests in fair order while rows, the token budget, the step's
    /// time and memory allow, of the tenants `which` says.
    fn admit_joiners(
        &mut self,
        now: Instant,
        rows: &mut Vec<Planned>,
        budget: &mut usize,
        free: &mut Blocks,
        fit: &mut TimeFit,
        which: Joiners,
    ) {
        let mut prefilling = rows.iter().any(|r| r.n > 1);
        let mut toks = std::mem::take(&mut self.bufs.joiner);
        // Adapter slots: a joiner whose adapter no running row uses needs one of its
        // own. Once a tenant's next request waits for a slot, no joiner with an
        // adapter is admitted this step (requests of the running adapters would keep
        // their slots busy for ever), only base-model ones.
        let slots = self.info.adapter_slots;
        let mut active = if slots > 0 {
            self.running_adapters()
        } else {
            BTreeSet::new()
        };
        let mut slot_blocked = false;
        let mut skipped: Vec<usize> = Vec::new();
        while self.running.len() < self.cfg.max_batch_rows && *budget > 0 && !fit.full {
            let watermark = if self.running.is_empty() {
                0
            } else {
                self.cfg.kv_watermark_blocks
            };
            // A joiner always needs a block of its own (in every group): a prefix hit
            // covers whole blocks and leaves at least its last token to compute. The
            // watermark is kept back in every group for the running rows' growth.
            let watermark = Blocks {
                full: watermark,
                sliding: if self.sliding { watermark } else { 0 },
            };
            if !self.need(0, 1).plus(watermark).fits(*free) {
                break;
            }
            let Some(t) = self.pick_tenant_except(&skipped) else {
                break;
            };
            let Some((&(Reverse(priority), _), &k)) = self.tenants[t].queue.first_key_value()
            else {
                break;
            };
            if slots > 0 {
                if let Some(a) = self.reqs.get(&k).and_then(|r| r.r.adapter) {
                    if slot_blocked || (!active.contains(&a) && active.len() >= slots) {
                        slot_blocked = true;
                        skipped.push(t);
                        continue;
                    }
                }
            }
            match which {
                Joiners::All => {}
                // A tenant's own requests wait for its running rows.
                Joiners::AheadOf(bt, bkey) => {
                    if bt == t || self.prefill_key(t, priority) >= bkey {
                        break;
                    }
                }
                Joiners::Starting => {
                    if !self.starting(t) {
                        // Another tenant's batch waits for the usual plan.
                        skipped.push(t);
                        continue;
                    }
                }
            }
            toks.clear();
            let mut adapter = None;
            if let Some(r) = self.reqs.get(&k) {
                r.extend_tokens(0, r.seq_len(), &mut toks);
                adapter = r.r.adapter;
            }
            let total = toks.len();
            if total == 0 {
                break;
            }
            // What a hit would cover (all but the last token are offered, so the forward
            // computes at least one), and how many of its blocks sit evictable in the
            // cache: taking those leaves fewer blocks for everyone else.
            //
            // Sliding-window blocks of the hit that one running row holds alone are
            // pinned: that row's need may already count them as released by its
            // append (`grow`), which the joiner's reference now prevents, so they are
            // taken from what is left as if they were new.
            let (cached, revived, pinned) = match self.salt_of(t, adapter) {
                Some(salt) => {
                    let hit = self.pool.lookup(salt, &toks[..total - 1]);
                    let held_by =
                        |g: usize, refs: u32| match (self.pool.group(g), hit.groups.get(g)) {
                            (Ok(pool), Some(gh)) => gh
                                .blocks
                                .iter()
                                .filter(|&&b| pool.refcount(b).is_ok_and(|c| c == refs))
                                .count(),
                            _ => 0,
                        };
                    let revived = Blocks {
                        full: held_by(0, 0),
                        sliding: if self.sliding { held_by(1, 0) } else { 0 },
                    };
                    let pinned = Blocks {
                        full: 0,
                        sliding: if self.sliding { held_by(1, 1) } else { 0 },
                    };
                    (hit.tokens, revived, pinned)
                }
                None => (0, Blocks::default(), Blocks::default()),
            };
            let rest = total - cached;
            let wanted = self.cfg.prefill_chunk.min(rest).min(*budget);
            let n = fit.allowed(&self.cost, cached, wanted);
            if n == 0 {
                break;
            }
            if n < rest && rest <= self.cfg.prefill_chunk && prefilling {
                // A prompt that fits one chunk but not this step's leftover budget
                // starts whole next step: started now, its tail would run next step
                // as a lone single-row forward beside the batched prefill group.
                // Head-of-line, like a memory stall, to keep the fair order.
                break;
            }
            let need = self.need(cached, n).plus(pinned);
            if !need.plus(revived).plus(watermark).fits(*free) {
                // Head-of-line: admitting someone further back would break fair order.
                break;
            }
            let before = self.available();
            let Some((res, slot, cached)) = self.start(k, &toks, now) else {
                break;
            };
            // Cached blocks the hit took out of the evictable list, plus the chunk's
            // new blocks.
            let revived = before.minus(self.available());
            let n = self
                .cfg
                .prefill_chunk
                .min(total - cached)
                .min(*budget)
                .min(n);
            fit.take(cached, n, wanted);
            if let (true, Some(a)) = (slots > 0, adapter) {
                active.insert(a);
            }
            *free = free.minus(revived.plus(self.need(cached, n)).plus(pinned));
            *budget -= n;
            prefilling |= n > 1;
            rows.push(Planned {
                key: k,
                slot,
                row: res.row,
                seq: res.seq,
                start: cached,
                n,
                want_logits: cached + n == total,
                draft: 0,
                prefill: true,
            });
        }
        self.bufs.joiner = toks;
    }

    /// Move a waiting request into the running batch with a fresh row and a pool
    /// sequence that starts with the longest cached prefix of `toks` (its prompt ++
    /// generated; all but the last token are offered). Returns the resident, the
    /// request's slab slot and the tokens the hit covers; None (nothing changed) if the
    /// pool refused the sequence.
    fn start(
        &mut self,
        k: RequestKey,
        toks: &[u32],
        now: Instant,
    ) -> Option<(Resident, u32, usize)> {
        let req_slot = self.reqs.slot(&k)?;
        let (t, qslot, prompt_len, first, fresh, adapter) = {
            let r = self.reqs.at(req_slot)?;
            (
                r.tenant,
                r.queue_slot(),
                r.r.prompt.len(),
                !r.charged,
                r.scheduled_at.is_none(),
                r.r.adapter,
            )
        };
        let mut spec = SeqSpec::new(OwnerId(u32::try_from(t).unwrap_or(u32::MAX)));
        if let Some(salt) = self.salt_of(t, adapter) {
            spec = spec.salted(salt);
        }
        // A model with recurrent state: each row gets a state slot, and the pool
        // reuses no prefix for it (cached blocks hold attention K/V, not the state
        // after them), so a row — a resumed one too — computes its state from its
        // first token.
        let stateful = self.pool.slots().stats().total > 0;
        if stateful {
            spec = spec.with_state_slot();
        }
        let offered = &toks[..toks.len().saturating_sub(1)];
        let (seq, cached) = match self.pool.allocate_with_prefix(spec, offered) {
            Ok(x) => x,
            Err(e) => {
                warn!(request = k.0, error = %e, "KV pool refused a sequence");
                return None;
            }
        };
        if stateful && !self.pool.in_transaction() {
            // The slot's `ResetSlot`, committed with the admission: a row at position
            // 0 starts from a zero state by the model contract (`RowInput::state_slot`),
            // so the op needs no delivery (and a retried first step needs none again).
            let ops = self.pool.take_ops();
            debug_assert!(ops
                .iter()
                .all(|o| matches!(o, weft_kv_pool::StorageOp::ResetSlot(_))));
        }
        let row = self.next_row;
        self.next_row += 1;
        let res = Resident { row, seq };
        let open = self.pool.open_steps();
        if open > 0 {
            // Admitted inside a step (one that follows the step in flight): undone
            // with it.
            let admitted = OpenEffect::Admitted { res, key: k, fresh };
            self.open_effects.push((open, admitted));
        }
        self.remove_waiting(t, qslot);
        let w_in = self.cfg.vtc.input;
        let tenant = &mut self.tenants[t];
        tenant.running += 1;
        if first {
            tenant.counter += w_in * prompt_len as f64 / tenant.weight;
            self.labels[tenant.label]
                .1
                .prompt_tokens
                .increment(prompt_len as u64);
        }
        self.admission.started(&tenant.name);
        self.running.push(RunSlot {
            key: k,
            slot: req_slot,
        });
        if let Some(r) = self.reqs.at_mut(req_slot) {
            r.row = Some(res);
            r.computed = cached;
            r.charged = true;
            if fresh {
                r.cached = cached.min(prompt_len);
                r.scheduled_at = Some(now);
                self.metrics
                    .queue
                    .record(now.saturating_duration_since(r.arrival).as_secs_f64());
            }
        }
        Some((res, req_slot, cached))
    }

    /// Gives a resident's row and sequence back (model first, then pool). Returns the
    /// blocks that became available: those only this sequence referenced.
    fn release_resident(&mut self, res: Resident) -> Blocks {
        self.model.release_row(res.row);
        let before = self.available();
        if let Err(e) = self.pool.release(res.seq) {
            error!(row = res.row, error = %e, "KV pool refused to release a sequence");
        }
        let open = self.pool.open_steps();
        if open > 0 {
            self.open_effects.push((open, OpenEffect::Released(res)));
        }
        self.available().minus(before)
    }

    /// Recompute-style preemption: drop the row's state; the request waits again with
    /// its generated tokens and resumes by prefilling prompt ++ generated (normally
    /// from its own blocks, which stay in the prefix cache until evicted). Returns the
    /// blocks it freed.
    fn preempt(&mut self, k: RequestKey) -> Blocks {
        let Some(r) = self.reqs.get_mut(&k) else {
            return Blocks::default();
        };
        let Some(res) = r.row.take() else {
            return Blocks::default();
        };
        r.computed = 0;
        r.preemptions += 1;
        let t = r.tenant;
        debug!(
            request = k.0,
            row = res.row,
            generated = r.generated.len(),
            "preempting row"
        );
        let freed = self.release_resident(res);
        self.stats.preemptions += 1;
        self.metrics.preemptions.increment(1);
        self.requeue(k, t);
        freed
    }

    fn run(&mut self, plan: &Plan, now: Instant) -> StepReport {
        let before = self.cfg.verify_rollback.then(|| self.fingerprint());
        let mut last_err = String::new();
        let retries = self.cfg.max_step_retries.max(1);
        let mut tried = 0;
        let mut out_of_memory = false;
        while tried < retries {
            tried += 1;
            match self.attempt(&plan.rows, now) {
                Ok(mut rep) => {
                    rep.attempts = tried;
                    if plan.probation {
                        self.probation.pop_front();
                    }
                    return rep;
                }
                Err(e) => {
                    self.model.rollback();
                    // The forward may have written storage by now (even a failed one);
                    // cached blocks the step evicted must not come back as cache hits.
                    self.pool_rollback();
                    self.stats.rollbacks += 1;
                    self.metrics.rollbacks.increment(1);
                    if let Some(fp) = before {
                        if fp != self.fingerprint() {
                            self.stats.rollback_mismatches += 1;
                            error!("state after rollback differs from the pre-step state");
                        }
                    }
                    warn!(attempt = tried, rows = plan.rows.len(), out_of_memory = e.out_of_memory, error = %e.msg, "step rolled back");
                    last_err = e.msg;
                    if e.out_of_memory {
                        out_of_memory = true;
                        // The same batch would ask for the same memory again: split it
                        // at once. A row alone gets its retries (the memory freed, or
                        // other work finishing, may be enough for it).
                        let group = plan.probation.then(|| self.probation.pop_front());
                        if self.split_after_oom(&plan.rows) {
                            return StepReport {
                                rows: plan.rows.len(),
                                attempts: tried,
                                ..Default::default()
                            };
                        }
                        if let Some(Some(g)) = group {
                            self.probation.push_front(g);
                        }
                    }
                }
            }
        }
        if plan.probation {
            self.probation.pop_front();
        }
        let keys: Vec<RequestKey> = plan.rows.iter().map(|p| p.key).collect();
        if let [k] = keys[..] {
            self.stats.failed_steps += 1;
            self.stats.failed_requests += 1;
            let msg = if out_of_memory {
                format!("the device ran out of memory for this request alone ({tried} attempts): {last_err}")
            } else {
                format!("step failed {tried} times: {last_err}")
            };
            error!(request = k.0, error = %msg, "failing request");
            self.finish(k, FinishReason::Error, None, Some(msg), now);
        } else {
            if !out_of_memory {
                self.stats.failed_steps += 1;
            }
            // Bisect: some row may be poisoned, or the batch too large for the memory
            // left; isolate it without failing the others.
            let (a, b) = keys.split_at(keys.len() / 2);
            self.probation.push_front(b.to_vec());
            self.probation.push_front(a.to_vec());
        }
        StepReport {
            rows: plan.rows.len(),
            attempts: tried,
            ..Default::default()
        }
    }

    /// One try of the step, as one pool transaction: append every row's tokens, hand the
    /// model the step's storage ops, the rows' block tables and sampling, forward (the
    /// model returns picked ids), take rejected draft tokens back, commit model then
    /// pool. Touches nothing but the model's and the pool's staged state until the
    /// model has committed; after that nothing can fail.
    fn attempt(&mut self, rows: &[Planned], now: Instant) -> Result<StepReport, StepFault> {
        self.open_step(rows, false)?;
        let t = Instant::now();
        let out = self
            .model
            .forward(self.pool.step_ops(), &self.bufs.inputs[..rows.len()])
            .map_err(StepFault::model)?;
        let seconds = self
            .model
            .last_step_seconds()
            .unwrap_or_else(|| t.elapsed().as_secs_f64());
        // A step that traced a compiled form first took the trace's time too.
        let measured = (!self.model.last_build_traced()).then_some(seconds);
        self.cost_since = None;
        self.settle(rows, &out)?;
        self.model.commit().map_err(StepFault::model)?;
        self.pool_commit();
        self.observe_cost(rows, measured);
        let at = match self.model.last_step_seconds() {
            // A simulated model's own clock.
            Some(s) => now + Duration::from_secs_f64(s),
            None => self.emitted(now),
        };
        let mut commits = std::mem::take(&mut self.bufs.commits);
        let rep = self.apply(rows, &mut commits, at);
        self.bufs.commits = commits;
        Ok(rep)
    }

    /// Learns from a committed step of `rows` that took `seconds` (None: not
    /// measured). Every committed step counts toward the decode-only probe
    /// ([`DECODE_PROBE_EVERY`]), measured or not: a probe that went unmeasured
    /// must still end the streak, or no prompt chunk would run beside decoding rows
    /// again (on a GPU a lone decode step runs pipelined; before its launch was
    /// timed, none was measured, and a prompt waited for every stream to finish).
    fn observe_cost(&mut self, rows: &[Planned], seconds: Option<f64>) {
        // (A step whose prompt chunks are all of one token is not a decode step:
        // the ITL target, a multiple of the decode steps' median, must not follow
        // it, though the cost model prices such a chunk as a decoding row.)
        let decode_only = !rows.iter().any(|p| p.prefill);
        self.prefill_streak = if decode_only {
            0
        } else {
            self.prefill_streak.saturating_add(1)
        };
        if rows.iter().any(|p| p.prefill && p.n > 1) {
            self.starved_streak = 0;
        } else if !decode_only {
            self.starved_streak = self.starved_streak.saturating_add(1);
        }
        let Some(seconds) = seconds else { return };
        let shape = shape_of(rows, self.model.short_prompts());
        trace!(
            predicted_ms = self.cost.predict(&shape).map(|t| t * 1e3),
            ms = seconds * 1e3,
            decode_rows = shape.decode_rows,
            decode_context = shape.decode_context,
            prefill_tokens = shape.prefill_tokens,
            prefill_context = shape.prefill_context,
            "step cost"
        );
        self.cost.observe(&shape, seconds);
        if decode_only && seconds.is_finite() && seconds >= 0.0 {
            if self.decode_times.len() == DECODE_TIMES {
                self.decode_times.pop_front();
            }
            self.decode_times.push_back(seconds);
        }
    }

    /// The median of the latest decode-only steps' seconds (None before 8).
    fn decode_median(&self) -> Option<f64> {
        if self.decode_times.len() < 8 {
            return None;
        }
        let mut v: Vec<f64> = self.decode_times.iter().copied().collect();
        let mid = v.len() / 2;
        let (_, m, _) = v.select_nth_unstable_by(mid, f64::total_cmp);
        Some(*m)
    }

    /// Whether the plan may run pipelined: the model pipelines, and every row gets its
    /// next token from this step or feeds a prompt chunk, without a draft (so the next
    /// step can follow it).
    fn pipelinable(&self, plan: &Plan) -> bool {
        self.pipelining()
            && !plan.probation
            && self.probation.is_empty()
            && plan
                .rows
                .iter()
                .all(|p| p.draft == 0 && (p.want_logits || p.prefill))
    }

    /// Whether the next plain step of these `rows` could carry drafts: then it is
    /// planned plainly (a step that follows another cannot draft, its last token
    /// being unknown at planning time).
    fn would_draft(&self, rows: &[Planned]) -> bool {
        self.cfg.speculate > 0
            && self.model.supports_drafts()
            && self.cfg.speculate_step_tokens > rows.len()
            && rows.iter().any(|p| {
                self.reqs
                    .at(p.slot)
                    .is_some_and(|r| r.key == p.key && r.speculates())
            })
    }

    /// Whether steps may pipeline at all: configured, and the model can.
    fn pipelining(&self) -> bool {
        self.cfg.pipeline && self.model.pipelines()
    }

    /// Opens `rows` as a step and submits it without waiting for its tokens. On
    /// failure nothing of it stays and the rows come back to run as a plain step —
    /// unless the model ran out of memory: then they were split into probation groups
    /// and come back empty.
    fn launch(&mut self, rows: Vec<Planned>) -> Result<Vec<Planned>, Vec<Planned>> {
        if let Err(e) = self.open_step(&rows, false) {
            self.count_rollback(&e, "pipelined step not opened");
            return Err(rows);
        }
        match self
            .model
            .submit(self.pool.step_ops(), &self.bufs.inputs[..rows.len()])
        {
            Ok(()) => {
                self.traced_carry = self.model.last_build_traced();
                Ok(rows)
            }
            Err(e) => {
                self.undo_newest();
                self.count_rollback(&e.to_string(), "pipelined step not submitted");
                if matches!(e, ModelError::OutOfMemory(_)) && self.split_after_oom(&rows) {
                    let mut rows = rows;
                    rows.clear();
                    return Err(rows);
                }
                Err(rows)
            }
        }
    }

    /// The step that follows the in-flight `rows`: every row that picks there decodes
    /// the token it picks, and every row mid-prompt feeds its next chunk (its tokens
    /// are known; sized to the step's time like a plain plan's chunk) — what a plain
    /// plan would make of the next step — or empty when that plan could differ (a
    /// running request is not in `rows`, memory is short, a prompt's next chunk gets
    /// nothing or the decode-only probe is due), or nobody continues. With it, whether
    /// its sampling must wait for the in-flight step's picks (a row with penalties or
    /// an output constraint: their counts and mask follow from that pick); such a step
    /// is empty unless the model defers sampling. Chaining a step with a prompt chunk
    /// lets the host build it while the device runs the one before: on a GPU such a
    /// step runs op by op, its graph build most of its cost.
    ///
    /// Waiting requests join it as they would join the plain plan
    /// ([`FollowJoiners`], admitted in [`Self::open_step`], inside its pool step: undone
    /// with it), after the prompts' chunks, where that plan would be the same: nobody
    /// waiting ahead of a prompt mid-way in fair order (the plain plan admits such
    /// joiners before its chunk), no starting step due (of its own,
    /// [`StartingStep::Alone`], or beside the rows while a prompt is mid-way: it leaves
    /// that prompt out), no recurrent state (a joiner's state slot is reset outside
    /// the step). Otherwise the plain plan runs after the in-flight step is read, and
    /// the device waits for its build.
    fn follow_plan(&self, rows: &[Planned], now: Instant) -> Follow {
        let mut deferred = false;
        if !self.pipelining()
            || !self.probation.is_empty()
            || self.would_draft(rows)
            || self.room_victim().is_some()
        {
            return Follow::none("plain plan first (probation, drafts or a row to preempt)");
        }
        let waiting = self.running.len() < self.cfg.max_batch_rows && self.pick_tenant().is_some();
        if waiting && self.pool.slots().stats().total > 0 {
            return Follow::none("a request waits and rows hold recurrent state");
        }
        let mut need = Blocks::default();
        let mut live = 0;
        // Decoding rows in `rows` order (the in-flight step's picks are filed into
        // them in that order), then the prompts' next chunks, as a plain plan has it.
        let mut next = Vec::new();
        let mut chunks = Vec::new();
        for p in rows {
            let mid_prompt = p.prefill && !p.want_logits;
            if p.draft > 0 || !(p.want_logits || mid_prompt) {
                return Follow::none("a row drafts or picks nothing");
            }
            let Some(r) = self.reqs.at(p.slot).filter(|r| r.key == p.key) else {
                continue;
            };
            live += 1;
            if r.row.is_none_or(|x| x.row != p.row) {
                continue;
            }
            // The pool holds `start` tokens of this row now (the in-flight step
            // appended them), which is also the base of the next step's append.
            let start = p.start + p.n;
            if mid_prompt {
                // The plain plan admits joiners ahead of this row in fair order before
                // its chunk (`plan_prefills`); the queued step only where none is.
                if waiting && self.waiting_ahead_of(r.tenant, r.r.priority) {
                    return Follow::none("a request ahead of a prompt mid-way waits");
                }
                chunks.push((p, start, r.seq_len() - start));
                continue;
            }
            // Penalty counts and a constraint's mask both need this step's pick.
            if r.penalties.is_some() || r.r.constraint.is_some() {
                if !self.model.defers_sampling() {
                    return Follow::none("sampling needs the pick and is not deferred");
                }
                deferred = true;
            }
            if r.generated.len() + 1 >= r.r.max_tokens {
                continue;
            }
            need = need.plus(self.grow(p.seq, start, 1));
            next.push(Planned {
                start,
                n: 1,
                prefill: false,
                ..*p
            });
        }
        let mut left = None;
        if !chunks.is_empty() {
            if waiting && self.starting_due(now, true) {
                // The starting tenant's step leaves others' prompts out of it.
                return Follow::none("a starting tenant's step is due beside a prompt mid-way");
            }
            let mut fit = self.time_fit(&next, now);
            let mut budget = self.prefill_budget(next.len());
            for (p, start, rem) in chunks {
                let wanted = self.cfg.prefill_chunk.min(rem).min(budget);
                let n = if wanted == 0 {
                    0
                } else {
                    fit.allowed(&self.cost, start, wanted)
                };
                if n == 0 {
                    // The plain plan decides what this prompt gets (or the probe).
                    return Follow::none("a prompt's next chunk gets nothing");
                }
                fit.take(start, n, wanted);
                budget -= n;
                need = need.plus(self.grow(p.seq, start, n));
                next.push(Planned {
                    start,
                    n,
                    want_logits: n == rem,
                    ..*p
                });
            }
            left = Some((fit, budget));
        }
        // A running request this step left out (a prompt waiting for budget or
        // memory) would be planned by the next plain step: so plan that one.
        if !need.fits(self.available()) {
            return Follow::none("memory is short");
        }
        if live != self.running.len() {
            return Follow::none("a running request is not in the step");
        }
        let admit = if !waiting || next.is_empty() {
            FollowJoiners::None
        } else if self.starting_due(now, true) {
            if self.cfg.starting_step == StartingStep::Alone {
                return Follow::none("a starting tenant's step of its own is due");
            }
            FollowJoiners::StartingFirst
        } else {
            FollowJoiners::All
        };
        Follow {
            rows: next,
            deferred,
            admit,
            need,
            left,
        }
    }

    /// Whether a waiting request would join ahead of a running row of tenant `t` at
    /// `priority` in fair order ([`Joiners::AheadOf`]): another tenant that may start
    /// one, whose first waiting request's [`Self::prefill_key`] is lower.
    fn waiting_ahead_of(&self, t: usize, priority: i32) -> bool {
        let key = self.prefill_key(t, priority);
        self.tenants.iter().enumerate().any(|(i, x)| {
            i != t
                && x.running < x.max_running
                && x.queue
                    .first_key_value()
                    .is_some_and(|(&(Reverse(p), _), _)| self.prefill_key(i, p) < key)
        })
    }

    /// Collects the in-flight step `rows` — after queueing the step that follows it, so
    /// the device computes that one while the host streams this one's tokens — and
    /// commits it. A failure rolls back both and runs `rows` again as a plain step
    /// (retries, bisection). A following step whose sampling is deferred gets it once
    /// `rows` is applied ([`sample_deferred`](Self::sample_deferred)).
    fn resolve(&mut self, rows: Vec<Planned>, now: Instant) -> StepReport {
        let Follow {
            rows: mut next,
            deferred,
            admit,
            need,
            left,
        } = self.follow_plan(&rows, now);
        let mut chained = false;
        let mut blocked_next = 0.0;
        let mut traced_next = false;
        if !next.is_empty() {
            match self.open_follow(&mut next, admit, need, left, now) {
                Ok(()) => match if deferred {
                    self.model
                        .submit_unsampled(self.pool.step_ops(), &self.bufs.inputs[..next.len()])
                } else {
                    self.model
                        .submit(self.pool.step_ops(), &self.bufs.inputs[..next.len()])
                } {
                    Ok(()) => {
                        chained = true;
                        blocked_next = self.model.last_submit_blocked_seconds().unwrap_or(0.0);
                        traced_next = self.model.last_build_traced();
                    }
                    Err(e) => {
                        self.undo_newest();
                        self.count_rollback(&e.to_string(), "following step not submitted");
                        if matches!(e, ModelError::OutOfMemory(_)) {
                            self.split_after_oom(&next);
                        }
                    }
                },
                Err(e) => self.count_rollback(&e, "following step not opened"),
            }
        }
        let settled = self
            .model
            .collect()
            .map_err(StepFault::model)
            .and_then(|out| self.settle(&rows, &out).map_err(StepFault::from))
            .and_then(|()| self.model.commit().map_err(StepFault::model));
        if settled.is_ok() {
            // A pipelined step's cost: the model's measure, else the time since its
            // timing began (the collect of the step it queued behind: the step
            // period while steps queue back to back; or its own launch).
            // Not measured where this step's build or the next one's (inside this
            // step's period) traced a compiled form first.
            let now_i = Instant::now();
            let seconds = self.model.last_step_seconds().or_else(|| {
                self.cost_since.map(|t| {
                    pipelined_seconds((now_i - t).as_secs_f64(), blocked_next, self.blocked_carry)
                })
            });
            let traced = self.traced_carry || traced_next;
            self.observe_cost(&rows, seconds.filter(|_| !traced));
            self.cost_since = chained.then_some(now_i);
            self.blocked_carry = if chained { blocked_next } else { 0.0 };
            self.traced_carry = chained && traced_next;
        } else {
            self.cost_since = None;
            self.blocked_carry = 0.0;
            self.traced_carry = false;
        }
        if let Err(e) = settled {
            if chained {
                self.undo_newest();
            }
            self.undo_newest();
            self.count_rollback(&e.msg, "pipelined step rolled back");
            if e.out_of_memory && self.split_after_oom(&rows) {
                return StepReport::default();
            }
            let rows: Vec<Planned> = rows
                .into_iter()
                .filter(|p| {
                    self.reqs
                        .at(p.slot)
                        .is_some_and(|r| r.key == p.key && r.row.is_some_and(|x| x.row == p.row))
                })
                .collect();
            if rows.is_empty() {
                return StepReport::default();
            }
            let plan = Plan {
                rows,
                probation: false,
            };
            let rep = self.run(&plan, now);
            self.bufs.rows = plan.rows;
            return rep;
        }
        self.pool_commit();
        if chained {
            // The following step appended placeholders for this step's picks: file the
            // real tokens before it commits (prefix hashes read them).
            let mut ok = true;
            let mut j = 0;
            for (p, c) in rows.iter().zip(&self.bufs.commits) {
                if j == next.len() {
                    break;
                }
                if next[j].key != p.key {
                    continue;
                }
                let q = next[j];
                j += 1;
                let (Some((s, _)), false) = (&c.sampled, c.gone) else {
                    continue;
                };
                if let Err(e) = self.pool.set_tokens(q.seq, q.start, &[s.token]) {
                    error!(request = q.key.0, error = %e, "placeholder token not replaced");
                    ok = false;
                    break;
                }
            }
            if ok {
                self.inflight = Some(next);
                self.stats.pipelined_steps += 1;
                self.metrics.pipelined.increment(1);
            } else {
                self.undo_newest();
                self.count_rollback("placeholder not replaced", "following step rolled back");
            }
        }
        let mut commits = std::mem::take(&mut self.bufs.commits);
        let at = self.emitted(now);
        let mut rep = self.apply(&rows, &mut commits, at);
        self.bufs.commits = commits;
        self.bufs.rows = rows;
        rep.attempts = 1;
        if deferred && self.inflight.is_some() {
            self.sample_deferred(now);
        }
        rep
    }

    /// Queues the sampling of the in-flight step, whose forward went out before the
    /// step it follows was applied: each row's parameters from its committed state now
    /// (penalty counts and the constraint's mask after that step's pick). A request
    /// whose constraint fails to give a mask ends with an error; one that ended is
    /// sampled plainly (its pick is ignored). If the model refuses, the in-flight step
    /// is rolled back, and its rows run as the next plain step.
    fn sample_deferred(&mut self, now: Instant) {
        let Some(next) = self.inflight.take() else {
            return;
        };
        let mut mask_time = MaskTime::default();
        let mut broken = Vec::new();
        for (p, input) in next.iter().zip(self.bufs.inputs.iter_mut()) {
            input.sampling = RowSampling::default();
            let Some(r) = self.reqs.at_mut(p.slot).filter(|r| r.key == p.key) else {
                continue;
            };
            r.fill_sampling(&mut input.sampling);
            if let Some(c) = &mut r.r.constraint {
                let t = Instant::now();
                match c.mask() {
                    Ok((mask, computed)) => {
                        mask_time.add(t, computed);
                        input.sampling.allowed.push(mask);
                    }
                    Err(e) => broken.push((p.key, format!("request {}: {e}", p.key.0))),
                }
            }
        }
        self.record_masks(mask_time);
        for (k, e) in broken {
            error!(request = k.0, error = %e, "output constraint failed");
            self.finish(k, FinishReason::Error, None, Some(e), now);
        }
        match self.model.submit_sampling(&self.bufs.inputs[..next.len()]) {
            Ok(()) => self.inflight = Some(next),
            Err(e) => {
                self.undo_newest();
                self.count_rollback(&e.to_string(), "following step not sampled");
                self.cost_since = None;
                if matches!(e, ModelError::OutOfMemory(_)) {
                    self.split_after_oom(&next);
                }
            }
        }
    }

    /// Counts output-constraint masks computed for a step.
    fn record_masks(&mut self, t: MaskTime) {
        if t.computed > 0 {
            self.stats.constraint_masks += t.computed;
            self.stats.constraint_mask_seconds += t.seconds;
            self.metrics.constraint_masks.increment(t.computed);
            self.metrics.constraint_mask.record(t.seconds);
        }
    }

    /// Opens the pool step for `rows` (every row's tokens appended) and fills the
    /// forward inputs. With `follows`, every row decodes the token the in-flight step
    /// picks for it: a placeholder now, replaced once that step is read. On error the
    /// step is not open.
    fn open_step(&mut self, rows: &[Planned], follows: bool) -> Result<(), String> {
        if self.pool.in_transaction() {
            self.pool.begin_next()
        } else {
            self.pool.begin()
        }
        .map_err(|e| e.to_string())?;
        self.fill_or_undo(rows, follows)
    }

    /// Opens the step that follows the in-flight one ([`Self::follow_plan`]): the
    /// younger pool step, the waiting requests `admit` lets join admitted into it
    /// (their blocks on top of `need`, the rows' own), and every row's inputs. On
    /// error the step is not open and its admissions are undone.
    fn open_follow(
        &mut self,
        rows: &mut Vec<Planned>,
        admit: FollowJoiners,
        need: Blocks,
        left: Option<(TimeFit, usize)>,
        now: Instant,
    ) -> Result<(), String> {
        self.pool.begin_next().map_err(|e| e.to_string())?;
        self.admit_following(rows, admit, need, left, now);
        self.fill_or_undo(rows, true)
    }

    /// Fills the open step's inputs; on error undoes that step.
    fn fill_or_undo(&mut self, rows: &[Planned], follows: bool) -> Result<(), String> {
        let r = self.fill_inputs(rows, follows);
        if r.is_err() {
            self.pool_rollback();
        }
        r
    }

    /// Admits waiting requests into the step that follows the in-flight one, whose
    /// rows are `rows` (decoding, then prompt chunks that left `left`: time fit and
    /// token budget) and take `need` blocks: as the plain plan of that step would
    /// ([`Self::close_plan`], or [`Self::plan_starting`] beside the rows). The pool
    /// step is open: each admission is journaled in it, and its rollback sends the
    /// request back to wait ([`Self::pool_rollback`]).
    fn admit_following(
        &mut self,
        rows: &mut Vec<Planned>,
        admit: FollowJoiners,
        need: Blocks,
        left: Option<(TimeFit, usize)>,
        now: Instant,
    ) {
        if admit == FollowJoiners::None {
            return;
        }
        let before = rows.len();
        let (mut fit, mut budget) =
            left.unwrap_or_else(|| (self.time_fit(rows, now), self.prefill_budget(before)));
        let mut free = self.available().minus(need);
        if admit == FollowJoiners::StartingFirst {
            let starting = Joiners::Starting;
            self.admit_joiners(now, rows, &mut budget, &mut free, &mut fit, starting);
        }
        if rows.len() == before {
            self.close_plan(now, rows, &mut budget, &mut free, &mut fit, true);
        } else {
            self.stats.itl_target = fit.itl.or(self.stats.itl_target);
        }
        self.decode_skipped = false;
        let admitted = (rows.len() - before) as u64;
        self.stats.pipelined_admissions += admitted;
        self.metrics.admissions_pipelined.increment(admitted);
    }

    fn fill_inputs(&mut self, rows: &[Planned], follows: bool) -> Result<(), String> {
        let shift = self.bs_shift;
        let mut mask_time = MaskTime::default();
        let r = self.fill_rows(rows, follows, shift, &mut mask_time);
        self.record_masks(mask_time);
        r?;
        if self.faults.hit(FaultPoint::AfterPlan) {
            return Err("injected fault after planning".into());
        }
        Ok(())
    }

    fn fill_rows(
        &mut self,
        rows: &[Planned],
        follows: bool,
        shift: u32,
        mask_time: &mut MaskTime,
    ) -> Result<(), String> {
        let inputs = &mut self.bufs.inputs;
        let held = &mut self.bufs.held;
        if held.len() < rows.len() {
            held.resize(rows.len(), 0);
        }
        if inputs.len() < rows.len() {
            inputs.resize_with(rows.len(), || RowInput {
                row: 0,
                tokens: Vec::new(),
                start_pos: 0,
                want_logits: false,
                draft: 0,
                blocks: Vec::new(),
                sampling: RowSampling::default(),
                follows: false,
                adapter: None,
                state_slot: None,
            });
        }
        for ((p, input), held) in rows.iter().zip(inputs.iter_mut()).zip(held.iter_mut()) {
            // In a step that follows another, a row continuing its prompt feeds its
            // next chunk (known on the host); the others the pick they follow.
            let follows = follows && !p.prefill;
            // What this buffer last held: a table of the same row whose first
            // `ceil(held / bs)` blocks were committed then and are still the row's.
            // (Not `start_pos`: a step that follows another starts past what its
            // predecessor feeds — a whole last prefill chunk, not only one token —
            // and that predecessor may have rolled back since, its blocks reused.)
            let (held_row, held_committed) = (input.row, *held);
            input.row = p.row;
            input.start_pos = p.start;
            input.want_logits = p.want_logits;
            input.draft = p.draft;
            input.follows = follows;
            input.tokens.clear();
            *held = 0;
            input.adapter = None;
            if let Some(r) = self.reqs.at_mut(p.slot) {
                input.adapter = r.r.adapter;
                // Committed now: before this step, and before the one it follows.
                *held = r.computed.min(p.start);
                if follows {
                    input.tokens.push(FOLLOW_PLACEHOLDER);
                } else {
                    r.extend_tokens(p.start, p.n - p.draft, &mut input.tokens);
                    input.tokens.extend_from_slice(&r.draft[..p.draft]);
                }
                if p.want_logits {
                    r.fill_sampling(&mut input.sampling);
                    input.sampling.index += u64::from(follows);
                    if let Some(c) = r.r.constraint.as_mut().filter(|_| !follows) {
                        // The mask of the committed state (a row that follows a pick
                        // not read yet gets its mask once it is: its step's sampling
                        // is deferred), then those of its draft's positions (checked
                        // against the constraint when it was planned).
                        let t = Instant::now();
                        let (mask, computed) =
                            c.mask().map_err(|e| format!("request {}: {e}", p.key.0))?;
                        mask_time.add(t, computed);
                        input.sampling.allowed.push(mask);
                        let more = c
                            .draft_masks(p.draft)
                            .map_err(|e| format!("request {}: {e}", p.key.0))?;
                        input.sampling.allowed.extend_from_slice(more);
                    }
                }
            }
            // Exactly the tokens the row feeds; a draft's rejected tail is truncated
            // after sampling.
            let appended = self
                .pool
                .append_tokens(p.seq, &input.tokens)
                .map_err(|e| format!("KV append for request {}: {e}", p.key.0))?;
            // The row's table after its append (only its own appends change it). Blocks
            // of committed tokens never move (no copy-on-write happened: the append
            // says so), so a buffer that held this row's table keeps those and copies
            // only what follows: no O(context) copy per row per step.
            // One table per KV group (full attention; sliding window, whose table
            // starts at logical block `offset` once blocks behind the window left).
            input.state_slot = self
                .pool
                .sequence(p.seq)
                .map_err(|e| e.to_string())?
                .state_slot;
            let groups = self.pool.num_groups();
            input.blocks.resize_with(groups, Default::default);
            for (g, rb) in input.blocks.iter_mut().enumerate() {
                let t = self.pool.table(p.seq, g).map_err(|e| e.to_string())?;
                let keep = if held_row == p.row && appended.copies == 0 && rb.offset == t.offset {
                    blocks_of(held_committed, shift)
                        .saturating_sub(t.offset)
                        .min(rb.blocks.len())
                        .min(t.blocks.len())
                } else {
                    0
                };
                rb.offset = t.offset;
                rb.blocks.truncate(keep);
                rb.blocks.extend_from_slice(&t.blocks[keep..]);
            }
        }
        Ok(())
    }

    /// Checks a forward's output against `rows` and stages each row's outcome in
    /// `bufs.commits` (tokens, text, finish; rejected draft tokens leave the pool).
    fn settle(&mut self, rows: &[Planned], out: &StepOutput) -> Result<(), String> {
        let wanted = &mut self.bufs.wanted;
        wanted.clear();
        wanted.extend(rows.iter().filter(|p| p.want_logits).map(|p| p.row));
        let positions: usize = rows
            .iter()
            .filter(|p| p.want_logits)
            .map(|p| 1 + p.draft)
            .sum();
        // (A row whose request ended after the step was sampled was sampled plainly;
        // its slot may hold a new request by now.)
        let wants_logprobs = rows.iter().any(|p| {
            p.want_logits
                && self
                    .reqs
                    .at(p.slot)
                    .is_some_and(|r| r.key == p.key && r.r.logprobs.is_some())
        });
        if out.rows != *wanted
            || out.tokens.len() != positions
            || !(out.logprobs.len() == positions || (out.logprobs.is_empty() && !wants_logprobs))
            || out
                .tokens
                .iter()
                .any(|&t| t as usize >= self.info.vocab_size)
        {
            return Err(format!(
                "model returned {} tokens ({} logprobs) for rows {:?}, expected {positions} tokens for rows {:?} (vocab {})",
                out.tokens.len(),
                out.logprobs.len(),
                out.rows,
                wanted,
                self.info.vocab_size
            ));
        }
        if self.faults.hit(FaultPoint::AfterForward) {
            return Err("injected fault after forward".into());
        }

        // Sampling and commit bookkeeping in one pass over the rows (one request lookup
        // each); the two fault points still fire in their own phase of a row's work.
        let sample_fault_at = wanted.len() / 2;
        let book_fault_at = rows.len() / 2;
        let commits = &mut self.bufs.commits;
        commits.clear();
        let mut li = 0;
        for (i, p) in rows.iter().enumerate() {
            let live = self
                .reqs
                .at(p.slot)
                .is_some_and(|r| r.key == p.key && r.row.is_some_and(|x| x.row == p.row));
            if !p.want_logits || !live {
                if i == book_fault_at && self.faults.hit(FaultPoint::CommitBookkeeping) {
                    return Err("injected fault during commit bookkeeping".into());
                }
                if p.want_logits {
                    li += 1 + p.draft;
                }
                commits.push(RowCommit {
                    gone: !live,
                    sampled: None,
                    more: Vec::new(),
                    finish: None,
                });
                continue;
            }
            if li == sample_fault_at && self.faults.hit(FaultPoint::Sampling) {
                return Err("injected fault during sampling".into());
            }
            let Some(r) = self.reqs.at_mut(p.slot) else {
                return Err(format!("request {} vanished during the step", p.key.0));
            };
            let s = picked(out, li, p.key)?;

            if i == book_fault_at && self.faults.hit(FaultPoint::CommitBookkeeping) {
                return Err("injected fault during commit bookkeeping".into());
            }
            let t = s.token;
            let detok = self.detok.as_ref();
            let stops = &r.r.stop_strings;
            // Text is the engine's business only where stop strings must be matched;
            // otherwise the request's stream detokenizes on the front end's side.
            let engine_text = !stops.is_empty();
            let last = r.generated.len() + 1 >= r.r.max_tokens;
            // EOS or a stop token ends a request even at max_tokens; Length only if
            // nothing else matched.
            let eos = &self.info.eos_token_ids;
            let mut finish = r.token_finish(t, last, eos);
            if let Some(c) = &mut r.r.constraint {
                constrain_pick(c, 0, t, &r.draft[..p.draft], eos, p.key, &mut finish)?;
            }
            let update = if !engine_text {
                None
            } else if silent_end(&finish) {
                // The ending token's text is never emitted; flush what was held back.
                Some(r.text.stage(None, true, detok, stops)?)
            } else {
                let end = last || finish.is_some();
                let u = r.text.stage(Some(t), end, detok, stops)?;
                if let Some(s) = &u.stop {
                    finish = Some((FinishReason::Stop, Some(StopMatch::String(s.clone()))));
                }
                Some(u)
            };
            // Verify the draft: each accepted token is the model's own pick at its
            // position, so the next position's logits saw exactly plain decoding's input.
            let mut more = Vec::new();
            let mut prev = t;
            while finish.is_none() && more.len() < p.draft && r.draft[more.len()] == prev {
                let j = more.len() + 1;
                let s = picked(out, li + j, p.key)?;
                let last = r.generated.len() + j + 1 >= r.r.max_tokens;
                prev = s.token;
                finish = r.token_finish(s.token, last, eos);
                if let Some(c) = &mut r.r.constraint {
                    constrain_pick(c, j, prev, &r.draft[..p.draft], eos, p.key, &mut finish)?;
                }
                more.push(s);
            }
            if p.draft > 0 {
                // Rejected draft tokens leave the pool again (staged, like the append):
                // the row keeps the decoded token and the accepted draft.
                self.pool
                    .truncate(p.seq, p.start + 1 + more.len())
                    .map_err(|e| format!("KV truncate for request {}: {e}", p.key.0))?;
            }
            li += 1 + p.draft;
            commits.push(RowCommit {
                gone: false,
                sampled: Some((s, update.map(Box::new))),
                more,
                finish,
            });
        }
        Ok(())
    }

    /// Undoes the newest open step in the model and the pool alike.
    fn undo_newest(&mut self) {
        self.model.rollback();
        self.pool_rollback();
    }

    /// A pipelined step (or the one queued after it) that was undone.
    /// A step of `rows` ran out of memory and was rolled back: counted, the model
    /// frees what it can, and a batch of several rows is split in two probation
    /// groups (run next, one at a time) instead of being tried again as it was.
    /// Returns whether it split.
    fn split_after_oom(&mut self, rows: &[Planned]) -> bool {
        self.stats.out_of_memory += 1;
        self.metrics.out_of_memory.increment(1);
        self.model.release_memory();
        let keys: Vec<RequestKey> = rows
            .iter()
            .filter(|p| self.reqs.at(p.slot).is_some_and(|r| r.key == p.key))
            .map(|p| p.key)
            .collect();
        if keys.len() < 2 {
            return false;
        }
        let (a, b) = keys.split_at(keys.len() / 2);
        self.probation.push_front(b.to_vec());
        self.probation.push_front(a.to_vec());
        true
    }

    fn count_rollback(&mut self, error: &str, what: &str) {
        self.stats.rollbacks += 1;
        self.metrics.rollbacks.increment(1);
        warn!(error, "{what}");
    }

    /// Commits the oldest open pool step (the model has committed it). Releases done
    /// while it was the newest open step now stand.
    fn pool_commit(&mut self) {
        // Files the step's full blocks in the prefix cache. It cannot fail with the
        // step open; the model has committed, so the step stands either way.
        if let Err(e) = self.pool.commit() {
            error!(error = %e, "KV pool commit failed after the model committed");
        }
        self.open_effects.retain_mut(|(open, _)| {
            *open -= 1;
            *open > 0
        });
    }

    /// Undoes the newest open pool step after its forward may have written storage,
    /// releases again the sequences whose release it undid, and sends the requests
    /// it had admitted back to wait.
    fn pool_rollback(&mut self) {
        let open = self.pool.open_steps();
        if open == 0 {
            return;
        }
        if let Err(e) = self.pool.rollback_after_writes() {
            error!(error = %e, "KV pool rollback failed");
        }
        let mut undone = Vec::new();
        self.open_effects.retain(|&(o, e)| {
            if o == open {
                undone.push(e);
            }
            o != open
        });
        let admitted = |r: Resident| {
            undone
                .iter()
                .any(|e| matches!(e, OpenEffect::Admitted { res, .. } if *res == r))
        };
        for &e in &undone {
            match e {
                // A sequence this step allocated is gone with it: nothing to release.
                OpenEffect::Released(res) if !admitted(res) => {
                    self.release_resident(res);
                }
                OpenEffect::Released(_) => {}
                OpenEffect::Admitted { res, key, fresh } => self.unadmit(key, res, fresh),
            }
        }
    }

    /// A request admitted in a pool step that rolled back (its sequence gone with
    /// it) waits again, as before its admission; nothing if it no longer holds that
    /// row (it ended or was preempted since). Its prompt stays charged to its tenant
    /// (charged once, when admitted again).
    fn unadmit(&mut self, key: RequestKey, res: Resident, fresh: bool) {
        let Some(r) = self.reqs.get_mut(&key) else {
            return;
        };
        if r.row != Some(res) {
            return;
        }
        r.row = None;
        r.computed = 0;
        if fresh {
            r.cached = 0;
            r.scheduled_at = None;
        }
        let t = r.tenant;
        self.stats.admissions_undone += 1;
        self.metrics.admissions_undone.increment(1);
        self.model.release_row(res.row);
        self.requeue(key, t);
    }

    /// A running request of tenant `t` that lost its row waits again.
    fn requeue(&mut self, key: RequestKey, t: usize) {
        self.running.retain(|x| x.key != key);
        self.tenants[t].running -= 1;
        self.admission.preempted(&self.tenants[t].name);
        self.push_waiting(key);
    }

    /// When the step that began at `now` put its tokens out: `now` plus the time
    /// since it began. Time to first token, the inter-token gaps, a request's end
    /// and its usage are stamped with it, not with the step's start (which left the
    /// step itself out of every first token's time).
    fn emitted(&self, now: Instant) -> Instant {
        now + self.step_began.elapsed()
    }

    /// Applies (and drains) the staged `commits` of a committed step; `now` is
    /// when its tokens came out ([`Self::emitted`]).
    fn apply(
        &mut self,
        rows: &[Planned],
        commits: &mut Vec<RowCommit>,
        now: Instant,
    ) -> StepReport {
        let mut rep = StepReport {
            rows: rows.len(),
            committed: true,
            ..Default::default()
        };
        let w_out = self.cfg.vtc.output;
        let mut done = std::mem::take(&mut self.bufs.done);
        done.clear();
        let mut broken: Vec<(RequestKey, String)> = Vec::new();
        // Generated tokens per metrics label, recorded once per step.
        let mut per_label = std::mem::take(&mut self.bufs.per_label);
        per_label.clear();
        per_label.resize(self.labels.len(), 0);
        // Rows that last sampled in the same step share their inter-token latency (in
        // steady decoding, all of them): one histogram update per run of equal values.
        let mut itl: Option<(Instant, usize)> = None;
        // Tokens after the first of a row's step arrive with it: zero inter-token latency.
        let mut same_step = 0;
        for (p, c) in rows.iter().zip(commits.drain(..)) {
            // A row with a draft keeps its decoded token and the accepted draft tokens.
            let kept = if p.draft > 0 { 1 + c.more.len() } else { p.n };
            if c.gone {
                continue;
            }
            rep.tokens += kept;
            let Some(r) = self.reqs.at_mut(p.slot) else {
                continue;
            };
            r.computed += kept;
            let Some((s, update)) = c.sampled else {
                continue;
            };
            if p.draft > 0 {
                self.stats.draft_tokens += p.draft as u64;
                self.stats.accepted_tokens += c.more.len() as u64;
                self.metrics.spec_drafted.increment(p.draft as u64);
                self.metrics.spec_accepted.increment(c.more.len() as u64);
            }
            let n = 1 + c.more.len();
            rep.sampled += n;
            same_step += n - 1;
            let mut text = update.map(|u| {
                let mut u = *u;
                let emit = std::mem::take(&mut u.emit);
                r.text.apply(u);
                emit
            });
            let tenant = &mut self.tenants[r.tenant];
            tenant.counter += n as f64 * w_out / tenant.weight;
            per_label[tenant.label] += n as u64;
            match r.last_token_at {
                None => {
                    r.first_token_at = Some(now);
                    self.metrics
                        .ttft
                        .record(now.saturating_duration_since(r.arrival).as_secs_f64());
                }
                Some(prev) => match &mut itl {
                    Some((at, n)) if *at == prev => *n += 1,
                    run => {
                        if let Some((at, n)) = run.replace((prev, 1)) {
                            self.metrics
                                .itl
                                .record_many(now.saturating_duration_since(at).as_secs_f64(), n);
                        }
                    }
                },
            }
            r.last_token_at = Some(now);
            let textual_end = !silent_end(&c.finish);
            if c.finish.is_none() {
                if let Some(con) = &mut r.r.constraint {
                    // The step committed: its pick is the constraint's now (checked
                    // against its mask in `settle`, so this cannot fail but for an
                    // internal error of the matcher, which fails the request).
                    let done = std::iter::once(s.token)
                        .chain(c.more.iter().map(|m| m.token))
                        .try_for_each(|t| con.advance(&[t]).map(drop));
                    if let Err(e) = done {
                        broken.push((p.key, e));
                    }
                }
            }
            for (i, s) in std::iter::once(s).chain(c.more).enumerate() {
                let end = i + 1 == n;
                r.generated.push(s.token);
                if let Some(pen) = &mut r.penalties {
                    pen.push(s.token);
                }
                // A closed receiver is noticed by the next reap; nothing to do here.
                let _ = r.tx.send(Msg::Token {
                    id: s.token,
                    text: text.take(),
                    textual: !end || textual_end,
                    last: end && c.finish.is_some(),
                    logprob: s.logprob.map(Box::new),
                });
            }
            if let Some((reason, stop)) = c.finish {
                done.push((p.key, reason, stop));
            }
        }
        if let Some((at, n)) = itl {
            self.metrics
                .itl
                .record_many(now.saturating_duration_since(at).as_secs_f64(), n);
        }
        if same_step > 0 {
            self.metrics.itl.record_many(0.0, same_step);
        }
        for ((_, m), &n) in self.labels.iter().zip(&per_label) {
            if n > 0 {
                m.generation_tokens.increment(n);
            }
        }
        self.bufs.per_label = per_label;
        for (k, reason, stop) in done.drain(..) {
            self.finish(k, reason, stop, None, now);
        }
        for (k, e) in broken {
            error!(request = k.0, error = %e, "output constraint failed");
            self.finish(k, FinishReason::Error, None, Some(e), now);
        }
        self.bufs.done = done;
        rep
    }

    /// Remove a request wherever it is, return its memory, and send its final event.
    fn finish(
        &mut self,
        k: RequestKey,
        reason: FinishReason,
        stop: Option<StopMatch>,
        error: Option<String>,
        now: Instant,
    ) {
        let Some(r) = self.reqs.remove(&k) else {
            return;
        };
        let t = r.tenant;
        let was_waiting = match r.row {
            Some(res) => {
                // Its full blocks stay in the pool as evictable prefix-cache blocks.
                self.release_resident(res);
                self.running.retain(|x| x.key != k);
                self.tenants[t].running -= 1;
                false
            }
            None => {
                self.remove_waiting(t, r.queue_slot());
                true
            }
        };
        if let Some(id) = &r.r.request_id {
            self.by_client_id.remove(&(t, id.clone()));
        }
        if !was_waiting
            && matches!(
                reason,
                FinishReason::Length | FinishReason::Stop | FinishReason::Eos
            )
            && self.tenants[t].idle()
        {
            self.antic.finished(t, Instant::now());
        }
        let unused = r.r.max_tokens.saturating_sub(r.generated.len());
        self.admission
            .finished(&r.r.tenant, r.r.request_id.as_deref(), was_waiting, unused);
        let usage = Usage {
            prompt_tokens: r.r.prompt.len(),
            cached_prompt_tokens: r.cached,
            generated_tokens: r.generated.len(),
            queue_time: r
                .scheduled_at
                .unwrap_or(now)
                .saturating_duration_since(r.arrival),
            time_to_first_token: r
                .first_token_at
                .map(|f| f.saturating_duration_since(r.arrival)),
            preemptions: r.preemptions,
        };
        crate::metrics::finished(reason);
        self.metrics
            .e2e
            .record(now.saturating_duration_since(r.arrival).as_secs_f64());
        let _ = r.tx.send(Msg::Finished(Box::new(Finished {
            reason,
            stop,
            usage,
            error,
        })));
    }

    fn publish(&mut self) {
        for (g, m) in self.kind_metrics.iter().enumerate() {
            let b = self.pool.group(g).map(|p| p.stats()).unwrap_or_default();
            m.used.set(b.used as f64);
            m.free.set(b.free as f64);
            m.cached.set(b.cached as f64);
        }
        if let Some(m) = &self.slot_metrics {
            let s = self.pool.slots().stats();
            m.used.set(s.used as f64);
            m.free.set(s.free as f64);
        }
        let b = self.pool.group(0).map(|g| g.stats()).unwrap_or_default();
        self.metrics.kv_used.set(b.used as f64);
        self.metrics.kv_free.set(b.free as f64);
        self.metrics.kv_cached.set(b.cached as f64);
        self.metrics.kv_ratio.set(if b.total == 0 {
            0.0
        } else {
            b.used as f64 / b.total as f64
        });
        // Lookups of an admission inside an open step count once it commits.
        let p = self.pool.committed_prefix_stats();
        let seen = std::mem::replace(&mut self.prefix_seen, p);
        let queries = p.query_tokens.saturating_sub(seen.query_tokens);
        let hits = p.hit_tokens.saturating_sub(seen.hit_tokens);
        if queries > 0 {
            self.metrics.prefix_queries.increment(queries);
        }
        if hits > 0 {
            self.metrics.prefix_hits.increment(hits);
        }
        let sums = &mut self.bufs.label_sums;
        sums.clear();
        sums.resize(self.labels.len(), (0, 0));
        for t in &self.tenants {
            sums[t.label].0 += t.running;
            sums[t.label].1 += t.queue.len();
        }
        for ((_, m), &(run, wait)) in self.labels.iter().zip(sums.iter()) {
            m.running.set(run as f64);
            m.waiting.set(wait as f64);
        }
    }

    /// A step begins: an anticipatory wait before it is over ([`Anticipation`]).
    fn settle_anticipation(&mut self, now: Instant) {
        let tenants = &self.tenants;
        let ended = self
            .antic
            .settle(now, |t| tenants.get(t).is_some_and(Tenant::idle));
        if let Some((arrived, waited)) = ended {
            self.metrics.anticipation(arrived).increment(1);
            self.metrics.anticipation_wait.record(waited.as_secs_f64());
            trace!(
                arrived,
                waited_ms = waited.as_secs_f64() * 1e3,
                "anticipation"
            );
        }
    }

    pub fn stats(&self) -> Stats {
        let b = self.pool.group(0).map(|g| g.stats()).unwrap_or_default();
        let mut s = self.stats.clone();
        s.running = self.running.len();
        s.waiting = self.reqs.len() - self.running.len();
        s.kv_blocks_total = b.total;
        s.kv_blocks_free = b.free;
        s.kv_blocks_cached = b.cached;
        s.kv_blocks_used = b.used;
        s.anticipation = self.antic.counts();
        s.tenants = self
            .tenants
            .iter()
            .map(|t| TenantStats {
                tenant: t.name.clone(),
                weight: t.weight,
                running: t.running,
                waiting: t.queue.len(),
                virtual_counter: t.counter,
            })
            .collect();
        let c = self.model.adapter_counters();
        s.adapter_loads = c.loads;
        s.adapter_evictions = c.evictions;
        let mut by: std::collections::BTreeMap<u32, AdapterStats> = Default::default();
        // Only a model with adapter slots runs requests with adapters.
        if self.info.adapter_slots > 0 {
            for r in self.reqs.values() {
                if let Some(a) = r.r.adapter {
                    by.entry(a)
                        .or_insert(AdapterStats {
                            adapter: a,
                            running: 0,
                            waiting: 0,
                        })
                        .waiting += 1;
                }
            }
            for rs in &self.running {
                if let Some(a) = self.reqs.at(rs.slot).and_then(|r| r.r.adapter) {
                    if let Some(e) = by.get_mut(&a) {
                        e.running += 1;
                        e.waiting -= 1;
                    }
                }
            }
        }
        s.adapters = by.into_values().collect();
        s
    }

    /// Digest of all scheduler state a step may touch (tests compare it across rollbacks).
    pub fn fingerprint(&self) -> u64 {
        let mut h = DefaultHasher::new();
        let mut keys: Vec<&RequestKey> = self.reqs.keys().collect();
        keys.sort();
        for k in keys {
            let r = &self.reqs[k];
            (
                k.0,
                r.row,
                r.computed,
                &r.generated,
                &r.text,
                r.charged,
                r.preemptions,
                r.r.constraint.as_ref().map(|c| c.consumed()),
            )
                .hash(&mut h);
            r.penalties
                .as_ref()
                .map(|p| {
                    let mut g: Vec<_> = p
                        .seen
                        .iter()
                        .map(|t| (t.id, t.in_prompt, t.generated))
                        .collect();
                    g.sort();
                    g
                })
                .hash(&mut h);
        }
        self.running.hash(&mut h);
        for t in &self.tenants {
            (t.counter.to_bits(), t.running, t.weight.to_bits()).hash(&mut h);
            for (slot, k) in &t.queue {
                (slot.0 .0, slot.1, k.0).hash(&mut h);
            }
        }
        self.probation.hash(&mut h);
        self.hash_pool(&mut h);
        h.finish()
    }

    /// The pool's sequence state: every live sequence's table, length, position and
    /// token ids, the refcount of every block a table holds, and the used count. Not the
    /// order or content of the free and cached lists: a rollback after the forward wrote
    /// storage rightly drops cache entries of blocks the step evicted.
    fn hash_pool(&self, h: &mut DefaultHasher) {
        let p = &self.pool;
        p.in_transaction().hash(h);
        let groups: Vec<_> = (0..p.num_groups())
            .filter_map(|i| p.group(i).ok())
            .collect();
        for g in &groups {
            g.stats().used.hash(h);
        }
        let ps = p.prefix_stats();
        (ps.lookups, ps.query_tokens, ps.hit_tokens).hash(h);
        for seq in p.live_sequences() {
            seq.hash(h);
            if let Ok(info) = p.sequence(seq) {
                (info.owner, info.salt, info.len, info.position).hash(h);
            }
            for (i, g) in groups.iter().enumerate() {
                if let Ok(t) = p.table(seq, i) {
                    (t.offset, t.blocks).hash(h);
                    for &b in t.blocks {
                        g.refcount(b).ok().hash(h);
                    }
                }
            }
            p.tokens(seq).ok().hash(h);
        }
    }

    /// Time until the earliest deadline of a live request (the engine sleeps no longer).
    pub(crate) fn next_deadline(&self, now: Instant) -> Option<Duration> {
        self.reqs
            .values()
            .filter_map(|r| r.r.deadline)
            .min()
            .map(|d| d.saturating_duration_since(now))
    }
}

/// A pipelined step's cost from the `period` between its collect and the collect
/// before it (or its launch). The period holds the submit of the step queued
/// behind it, which may wait on the device for part of that step's own work
/// (`blocked_next`: a step of several forwards evaluates all but its last inside
/// the submit), and lacks the like wait of its own submit (`blocked_own`),
/// counted in the period before. Uncorrected, a decode step followed by a step
/// with a prompt chunk was charged the chunk's forward and that step only its
/// decoding rows: the cost model learned the two backwards, and sized chunks to
/// match.
fn pipelined_seconds(period: f64, blocked_next: f64, blocked_own: f64) -> f64 {
    (period - blocked_next).max(0.0) + blocked_own
}

/// The cost model's view of a step's planned rows: where the model runs the
/// step's prompt chunks as decoding rows (`short`, and no row drafts), each prompt
/// token one decoding row at its position.
fn shape_of(rows: &[Planned], short: Option<ShortPrompts>) -> StepShape {
    shape_of_rows(
        rows.iter().map(|p| (p.start, p.n, p.prefill, p.draft)),
        short,
    )
}

/// [`shape_of`] over rows given as `(start, n, prefill, draft)`.
fn shape_of_rows(
    rows: impl Iterator<Item = (usize, usize, bool, usize)> + Clone,
    short: Option<ShortPrompts>,
) -> StepShape {
    let mut s = StepShape::default();
    let as_rows = short.is_some_and(|sp| {
        rows.clone().all(|(_, _, _, draft)| draft == 0)
            && sp.covers(
                rows.clone()
                    .filter(|r| r.2)
                    .map(|(start, n, _, _)| (start, n)),
            )
    });
    for (start, n, prefill, _) in rows {
        if prefill && as_rows {
            s.add_as_rows(start, n);
        } else if prefill {
            s.add_prompt(start, n);
        } else {
            s.add(start, n);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::{pipelined_seconds, shape_of_rows, ShortPrompts, StepShape};

    fn shape(rows: &[(usize, usize, bool)], short: Option<ShortPrompts>) -> StepShape {
        shape_of_rows(rows.iter().map(|&(s, n, p)| (s, n, p, 0)), short)
    }

    /// Where the model runs short prompt chunks as decoding rows, the cost model
    /// sees such a step as that many more decoding rows (each at its position), and
    /// a step past the limits as a prefill.
    #[test]
    fn short_prompts_are_priced_as_the_decoding_rows_they_run_as() {
        let short = Some(ShortPrompts {
            tokens: 64,
            keys: 10_000,
        });
        let rows = [(100, 1, false), (200, 1, false), (0, 32, true)];
        let s = shape(&rows, short);
        assert_eq!((s.decode_rows, s.prefill_tokens), (34, 0));
        assert_eq!(s.decode_context, 100 + 200 + (0..32).sum::<usize>());
        let plain = shape(&rows, None);
        assert_eq!((plain.decode_rows, plain.prefill_tokens), (2, 32));
        // 65 prompt tokens: past the limit, priced as a prefill.
        let long = [(100, 1, false), (0, 33, true), (0, 32, true)];
        assert_eq!(shape(&long, short).prefill_tokens, 65);
        // Deep enough to read past the keys (32 x 400 + 496 > 10,000).
        let deep = [(100, 1, false), (400, 32, true)];
        assert_eq!(shape(&deep, short).prefill_tokens, 32);
        // Beside a drafting row (priced as a chunk of its 3 tokens) the model runs
        // the prompt as a prefill.
        let drafted = shape_of_rows([(100, 3, false, 2), (0, 8, true, 0)].into_iter(), short);
        assert_eq!(drafted.prefill_tokens, 3 + 8);
    }

    /// A decode step (device 5 ms) queued ahead of a step whose prompt chunk's
    /// forward the submit waits 25 ms for, then its decoding rows (8 ms more):
    /// the first period (30 ms) holds the chunk's wait, the second (8 ms) lacks it.
    #[test]
    fn a_submit_that_waits_for_its_own_forward_is_charged_to_its_step() {
        let decode = pipelined_seconds(0.030, 0.025, 0.0);
        let mixed = pipelined_seconds(0.008, 0.0, 0.025);
        assert!((decode - 0.005).abs() < 1e-12, "{decode}");
        assert!((mixed - 0.033).abs() < 1e-12, "{mixed}");
        // Queued back to back with no such waits, a step's cost is its period.
        assert_eq!(pipelined_seconds(0.004, 0.0, 0.0), 0.004);
        // Never negative, whatever the clocks say.
        assert_eq!(pipelined_seconds(0.001, 0.002, 0.0), 0.0);
    }
}
