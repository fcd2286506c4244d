//! Metric names and handles (through the `metrics` facade).
//!
//! Handles are resolved once, when the scheduler starts, so install the recorder (e.g.
//! `metrics-exporter-prometheus`) before `Engine::start`. The only label is `tenant`, whose
//! values are the tenants named in the config plus "other": bounded cardinality.

use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Counter,
    Gauge, Histogram, Unit,
};

pub const REQUESTS_RUNNING: &str = "weft_requests_running";
pub const REQUESTS_WAITING: &str = "weft_requests_waiting";
pub const KV_BLOCKS_USED: &str = "weft_kv_blocks_used";
pub const KV_BLOCKS_FREE: &str = "weft_kv_blocks_free";
pub const KV_BLOCKS_CACHED: &str = "weft_kv_blocks_cached";
pub const KV_USAGE_RATIO: &str = "weft_kv_usage_ratio";
/// Blocks per attention kind (`kind`: "full", "sliding_window") and `state`
/// ("used", "free", "cached"): the pool's groups one by one (the unlabelled
/// `weft_kv_blocks_*` gauges are the full-attention group's).
pub const KV_KIND_BLOCKS: &str = "weft_kv_kind_blocks";
/// Recurrent-state slots (models with recurrent layers) by `state`: "used"
/// (held by a running row) or "free". A row holds one from admission to
/// release, so these bound the rows that can run at once.
pub const STATE_SLOTS: &str = "weft_state_slots";
pub const PREEMPTIONS: &str = "weft_preemptions_total";
pub const STEP_ROLLBACKS: &str = "weft_step_rollbacks_total";
pub const STEP_OUT_OF_MEMORY: &str = "weft_step_out_of_memory_total";
pub const STEPS_PIPELINED: &str = "weft_steps_pipelined_total";
pub const ADMISSIONS_PIPELINED: &str = "weft_admissions_pipelined_total";
pub const ADMISSIONS_UNDONE: &str = "weft_admissions_undone_total";
pub const STEP_DURATION: &str = "weft_step_duration_seconds";
pub const BATCH_SIZE: &str = "weft_batch_size";
pub const TTFT: &str = "weft_time_to_first_token_seconds";
pub const ITL: &str = "weft_inter_token_latency_seconds";
pub const QUEUE_TIME: &str = "weft_request_queue_seconds";
pub const E2E: &str = "weft_request_e2e_seconds";
pub const PROMPT_TOKENS: &str = "weft_prompt_tokens_total";
pub const GENERATION_TOKENS: &str = "weft_generation_tokens_total";
pub const PREFIX_QUERIES: &str = "weft_prefix_cache_queries_total";
pub const PREFIX_HITS: &str = "weft_prefix_cache_hits_total";
pub const REQUESTS_FINISHED: &str = "weft_requests_finished_total";
pub const SPEC_DRAFT_TOKENS: &str = "weft_spec_draft_tokens_total";
pub const SPEC_ACCEPTED_TOKENS: &str = "weft_spec_accepted_tokens_total";
pub const CONSTRAINT_MASK: &str = "weft_constraint_mask_seconds";
pub const CONSTRAINT_MASKS: &str = "weft_constraint_masks_total";
/// Anticipatory waits before a step, by `outcome`: "arrived" (every tenant waited
/// for sent its next request in time) or "missed".
pub const ANTICIPATIONS: &str = "weft_anticipations_total";
pub const ANTICIPATION_WAIT: &str = "weft_anticipation_wait_seconds";

/// Suggested histogram buckets for the exporter; they include common SLO thresholds
/// (a 2 s TTFT bucket among them).
pub const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
];
pub const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0, 2.0,
];
pub const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

pub fn describe() {
    describe_gauge!(REQUESTS_RUNNING, "Requests with a row in the running batch");
    describe_gauge!(
        REQUESTS_WAITING,
        "Requests queued, including preempted ones"
    );
    describe_gauge!(KV_BLOCKS_USED, "KV pool blocks referenced by running rows");
    describe_gauge!(KV_BLOCKS_FREE, "KV pool blocks holding nothing");
    describe_gauge!(
        KV_BLOCKS_CACHED,
        "KV pool blocks holding prefix-cache contents, evictable (LRU) when none are free"
    );
    describe_gauge!(KV_USAGE_RATIO, "Used / total KV pool blocks");
    describe_gauge!(
        KV_KIND_BLOCKS,
        "KV pool blocks of each attention kind's group (kind), used / free / cached (state)"
    );
    describe_gauge!(
        STATE_SLOTS,
        "Recurrent-state slots (models with recurrent layers), used / free (state)"
    );
    describe_counter!(
        PREEMPTIONS,
        "Rows preempted (recomputed later) for lack of KV memory"
    );
    describe_counter!(
        STEPS_PIPELINED,
        "Decode steps queued on the device behind the step it follows, before that step was read"
    );
    describe_counter!(
        ADMISSIONS_PIPELINED,
        "Requests admitted into a step queued behind the step in flight (an undone admission counts again when repeated)"
    );
    describe_counter!(
        ADMISSIONS_UNDONE,
        "Admissions undone because their step rolled back (the request waited again)"
    );
    describe_counter!(STEP_ROLLBACKS, "Step attempts rolled back after a failure");
    describe_counter!(
        STEP_OUT_OF_MEMORY,
        "Step attempts that ran out of device memory (rolled back, then split)"
    );
    describe_histogram!(
        STEP_DURATION,
        Unit::Seconds,
        "Wall time of one committed step"
    );
    describe_histogram!(BATCH_SIZE, "Rows in one forward call");
    describe_histogram!(TTFT, Unit::Seconds, "Submit to first token");
    describe_histogram!(
        ITL,
        Unit::Seconds,
        "Time between consecutive tokens of a request"
    );
    describe_histogram!(QUEUE_TIME, Unit::Seconds, "Submit to first scheduled");
    describe_histogram!(E2E, Unit::Seconds, "Submit to final event");
    describe_counter!(PROMPT_TOKENS, "Prompt tokens of admitted requests");
    describe_counter!(GENERATION_TOKENS, "Generated tokens");
    describe_counter!(
        PREFIX_QUERIES,
        "Tokens offered to the KV pool's prefix cache at admission"
    );
    describe_counter!(
        PREFIX_HITS,
        "Tokens served from the KV pool's prefix cache at admission"
    );
    describe_counter!(REQUESTS_FINISHED, "Finished requests by reason");
    describe_counter!(
        SPEC_DRAFT_TOKENS,
        "Speculative draft tokens verified (committed steps)"
    );
    describe_counter!(
        SPEC_ACCEPTED_TOKENS,
        "Speculative draft tokens accepted (each one a token without a step of its own)"
    );
    describe_histogram!(
        CONSTRAINT_MASK,
        Unit::Seconds,
        "Host time computing one step's output-constraint token masks (steps with constrained rows)"
    );
    describe_counter!(
        ANTICIPATIONS,
        "Waits before a step for a tenant's next request after its last one ended, by outcome (arrived, missed)"
    );
    describe_histogram!(
        ANTICIPATION_WAIT,
        Unit::Seconds,
        "Length of one anticipatory wait before a step"
    );
    describe_counter!(
        CONSTRAINT_MASKS,
        "Output-constraint token masks computed (one per constrained row per step)"
    );
}

pub(crate) struct EngineMetrics {
    pub kv_used: Gauge,
    pub kv_free: Gauge,
    pub kv_cached: Gauge,
    pub kv_ratio: Gauge,
    pub preemptions: Counter,
    pub rollbacks: Counter,
    pub out_of_memory: Counter,
    pub pipelined: Counter,
    pub admissions_pipelined: Counter,
    pub admissions_undone: Counter,
    pub step_duration: Histogram,
    pub batch_size: Histogram,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub queue: Histogram,
    pub e2e: Histogram,
    pub prefix_queries: Counter,
    pub prefix_hits: Counter,
    pub spec_drafted: Counter,
    pub spec_accepted: Counter,
    pub constraint_mask: Histogram,
    pub constraint_masks: Counter,
    pub anticipation_arrived: Counter,
    pub anticipation_missed: Counter,
    pub anticipation_wait: Histogram,
}

impl EngineMetrics {
    pub fn new() -> Self {
        describe();
        Self {
            kv_used: gauge!(KV_BLOCKS_USED),
            kv_free: gauge!(KV_BLOCKS_FREE),
            kv_cached: gauge!(KV_BLOCKS_CACHED),
            kv_ratio: gauge!(KV_USAGE_RATIO),
            preemptions: counter!(PREEMPTIONS),
            rollbacks: counter!(STEP_ROLLBACKS),
            out_of_memory: counter!(STEP_OUT_OF_MEMORY),
            pipelined: counter!(STEPS_PIPELINED),
            admissions_pipelined: counter!(ADMISSIONS_PIPELINED),
            admissions_undone: counter!(ADMISSIONS_UNDONE),
            step_duration: histogram!(STEP_DURATION),
            batch_size: histogram!(BATCH_SIZE),
            ttft: histogram!(TTFT),
            itl: histogram!(ITL),
            queue: histogram!(QUEUE_TIME),
            e2e: histogram!(E2E),
            prefix_queries: counter!(PREFIX_QUERIES),
            prefix_hits: counter!(PREFIX_HITS),
            spec_drafted: counter!(SPEC_DRAFT_TOKENS),
            spec_accepted: counter!(SPEC_ACCEPTED_TOKENS),
            constraint_mask: histogram!(CONSTRAINT_MASK),
            constraint_masks: counter!(CONSTRAINT_MASKS),
            anticipation_arrived: counter!(ANTICIPATIONS, "outcome" => "arrived"),
            anticipation_missed: counter!(ANTICIPATIONS, "outcome" => "missed"),
            anticipation_wait: histogram!(ANTICIPATION_WAIT),
        }
    }

    /// The counter of anticipatory waits that ended so.
    pub fn anticipation(&self, arrived: bool) -> &Counter {
        if arrived {
            &self.anticipation_arrived
        } else {
            &self.anticipation_missed
        }
    }
}

/// One KV group's gauges: used, free, cached blocks.
pub(crate) struct KindMetrics {
    pub used: Gauge,
    pub free: Gauge,
    pub cached: Gauge,
}

impl KindMetrics {
    pub fn new(kind: &'static str) -> Self {
        let g = |state: &'static str| gauge!(KV_KIND_BLOCKS, "kind" => kind, "state" => state);
        Self {
            used: g("used"),
            free: g("free"),
            cached: g("cached"),
        }
    }
}

/// The recurrent-state slots' gauges: used, free.
pub(crate) struct SlotMetrics {
    pub used: Gauge,
    pub free: Gauge,
}

impl SlotMetrics {
    pub fn new() -> Self {
        Self {
            used: gauge!(STATE_SLOTS, "state" => "used"),
            free: gauge!(STATE_SLOTS, "state" => "free"),
        }
    }
}

pub(crate) struct TenantMetrics {
    pub running: Gauge,
    pub waiting: Gauge,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
}

impl TenantMetrics {
    pub fn new(label: &str) -> Self {
        let l = label.to_string();
        Self {
            running: gauge!(REQUESTS_RUNNING, "tenant" => l.clone()),
            waiting: gauge!(REQUESTS_WAITING, "tenant" => l.clone()),
            prompt_tokens: counter!(PROMPT_TOKENS, "tenant" => l.clone()),
            generation_tokens: counter!(GENERATION_TOKENS, "tenant" => l),
        }
    }
}

pub(crate) fn finished(reason: crate::request::FinishReason) {
    counter!(REQUESTS_FINISHED, "reason" => reason.as_str()).increment(1);
}
