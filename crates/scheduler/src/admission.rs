//! Submit-time checks, shared between callers' threads and the engine thread.
//!
//! Everything here answers at once: a request is either refused with a typed error or
//! counted as waiting. The engine thread keeps the counts current as requests start,
//! get preempted and finish, so limits hold without a round trip to the engine.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::config::SchedulerConfig;
use crate::model::ModelInfo;
use crate::request::{Request, RequestKey, SubmitError};

/// Hint for full queues: long enough that a retry storm does not spin, short enough that
/// a client comes back while the queue drains.
const QUEUE_RETRY_AFTER: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Bucket {
    capacity: f64,
    per_sec: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.per_sec).min(self.capacity);
        self.at = self.at.max(now);
    }
}

#[derive(Debug, Default)]
struct TenantCounts {
    waiting: usize,
    running: usize,
    bucket: Option<Bucket>,
    ids: HashSet<String>,
}

#[derive(Debug, Default)]
struct Inner {
    waiting: usize,
    running: usize,
    tenants: HashMap<String, TenantCounts>,
    closed: bool,
}

#[derive(Debug)]
pub(crate) struct Admission {
    cfg: SchedulerConfig,
    info: ModelInfo,
    kv_capacity_tokens: usize,
    next_key: AtomicU64,
    inner: Mutex<Inner>,
}

impl Admission {
    pub fn new(cfg: SchedulerConfig, info: ModelInfo, kv_capacity_tokens: usize) -> Self {
        Self {
            cfg,
            info,
            kv_capacity_tokens,
            next_key: AtomicU64::new(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Counts stay meaningful even if a holder panicked: every update is a few integer
        // ops that cannot be left half-done in a way that breaks the next caller.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks that depend only on the request and fixed limits.
    pub fn validate(&self, r: &Request) -> Result<(), SubmitError> {
        let inv = |m: String| Err(SubmitError::Invalid(m));
        if r.tenant.is_empty() {
            return inv("tenant must not be empty".into());
        }
        if !(r.tenant_weight.is_finite() && r.tenant_weight > 0.0) {
            return inv(format!(
                "tenant_weight must be a positive number, got {}",
                r.tenant_weight
            ));
        }
        if r.prompt.is_empty() {
            return inv("prompt must contain at least one token".into());
        }
        if r.max_tokens == 0 {
            return inv("max_tokens must be at least 1".into());
        }
        if let Some(&t) = r
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.info.vocab_size)
        {
            return inv(format!(
                "prompt token {t} is outside the vocabulary ({})",
                self.info.vocab_size
            ));
        }
        let total = r.prompt.len().saturating_add(r.max_tokens);
        if total > self.info.max_context {
            return inv(format!(
                "prompt ({}) + max_tokens ({}) = {total} exceeds the model's max_context ({})",
                r.prompt.len(),
                r.max_tokens,
                self.info.max_context
            ));
        }
        // The last sampled token is never fed back, so a row holds at most total - 1.
        if total - 1 > self.kv_capacity_tokens {
            return inv(format!(
                "prompt + max_tokens = {total} exceeds the whole KV capacity ({} tokens)",
                self.kv_capacity_tokens
            ));
        }
        if let Some(c) = &r.constraint {
            if c.vocab_words() != self.info.vocab_size.div_ceil(32) {
                return inv(format!(
                    "the output constraint was compiled for {} tokens, the model has {}",
                    c.vocab_words() * 32,
                    self.info.vocab_size
                ));
            }
        }
        let s = &r.sampling;
        if !(s.temperature.is_finite() && s.temperature >= 0.0) {
            return inv(format!("temperature must be >= 0, got {}", s.temperature));
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            return inv(format!("top_p must be in (0, 1], got {}", s.top_p));
        }
        if !(0.0..=1.0).contains(&s.min_p) {
            return inv(format!("min_p must be in [0, 1], got {}", s.min_p));
        }
        if !(s.repetition_penalty.is_finite() && s.repetition_penalty > 0.0) {
            return inv(format!(
                "repetition_penalty must be > 0, got {}",
                s.repetition_penalty
            ));
        }
        if !(s.presence_penalty.is_finite() && s.frequency_penalty.is_finite()) {
            return inv("presence_penalty and frequency_penalty must be finite".into());
        }
        if let Some(n) = r.logprobs {
            if n > self.cfg.max_logprobs {
                return inv(format!(
                    "logprobs {n} exceeds the limit of {}",
                    self.cfg.max_logprobs
                ));
            }
        }
        if r.stop_strings.iter().any(|s| s.is_empty()) {
            return inv("stop strings must not be empty".into());
        }
        if let Some(tpm) = self.cfg.limits(&r.tenant).tokens_per_minute {
            if total as u64 > tpm {
                return inv(format!(
                    "prompt + max_tokens = {total} exceeds the tenant's token budget of {tpm} tokens/minute"
                ));
            }
        }
        Ok(())
    }

    /// Validates, applies limits and counts the request as waiting.
    pub fn admit(&self, r: &Request, now: Instant) -> Result<RequestKey, SubmitError> {
        self.validate(r)?;
        let limits = self.cfg.limits(&r.tenant);
        let mut g = self.lock();
        if g.closed {
            return Err(SubmitError::ShuttingDown);
        }
        if g.waiting >= self.cfg.max_waiting {
            return Err(SubmitError::Overloaded {
                retry_after: QUEUE_RETRY_AFTER,
                reason: format!("engine queue is full ({} waiting)", g.waiting),
            });
        }
        let t = g.tenants.entry(r.tenant.clone()).or_default();
        if t.waiting >= limits.max_waiting {
            return Err(SubmitError::Overloaded {
                retry_after: QUEUE_RETRY_AFTER,
                reason: format!("tenant queue is full ({} waiting)", t.waiting),
            });
        }
        if let Some(id) = &r.request_id {
            if t.ids.contains(id) {
                return Err(SubmitError::Invalid(format!(
                    "request_id {id:?} is already in use"
                )));
            }
        }
        let cost = (r.prompt.len() + r.max_tokens) as f64;
        if let Some(tpm) = limits.tokens_per_minute {
            let b = t.bucket.get_or_insert_with(|| Bucket {
                capacity: tpm as f64,
                per_sec: tpm as f64 / 60.0,
                level: tpm as f64,
                at: now,
            });
            b.refill(now);
            if b.level < cost {
                let secs = (cost - b.level) / b.per_sec.max(f64::MIN_POSITIVE);
                return Err(SubmitError::Overloaded {
                    retry_after: Duration::from_secs_f64(secs.min(3600.0)),
                    reason: format!("tenant token budget of {tpm} tokens/minute is spent"),
                });
            }
            b.level -= cost;
        }
        if let Some(id) = &r.request_id {
            t.ids.insert(id.clone());
        }
        t.waiting += 1;
        g.waiting += 1;
        Ok(RequestKey(self.next_key.fetch_add(1, Ordering::Relaxed)))
    }

    /// Undo `admit` for a request that never reached the engine.
    pub fn abandon(&self, r: &Request) {
        self.finished(&r.tenant, r.request_id.as_deref(), true, r.max_tokens);
    }

    pub fn started(&self, tenant: &str) {
        let mut g = self.lock();
        g.waiting = g.waiting.saturating_sub(1);
        g.running += 1;
        if let Some(t) = g.tenants.get_mut(tenant) {
            t.waiting = t.waiting.saturating_sub(1);
            t.running += 1;
        }
    }

    pub fn preempted(&self, tenant: &str) {
        let mut g = self.lock();
        g.running = g.running.saturating_sub(1);
        g.waiting += 1;
        if let Some(t) = g.tenants.get_mut(tenant) {
            t.running = t.running.saturating_sub(1);
            t.waiting += 1;
        }
    }

    /// `unused_tokens` of generation budget go back to the tenant's token bucket.
    pub fn finished(
        &self,
        tenant: &str,
        request_id: Option<&str>,
        was_waiting: bool,
        unused_tokens: usize,
    ) {
        let mut g = self.lock();
        if was_waiting {
            g.waiting = g.waiting.saturating_sub(1);
        } else {
            g.running = g.running.saturating_sub(1);
        }
        let remove = if let Some(t) = g.tenants.get_mut(tenant) {
            if was_waiting {
                t.waiting = t.waiting.saturating_sub(1);
            } else {
                t.running = t.running.saturating_sub(1);
            }
            if let Some(id) = request_id {
                t.ids.remove(id);
            }
            if let Some(b) = &mut t.bucket {
                b.level = (b.level + unused_tokens as f64).min(b.capacity);
            }
            // Idle tenants without a rate budget carry no state worth keeping; dropping
            // them keeps this map bounded by live tenants.
            t.waiting == 0 && t.running == 0 && t.bucket.is_none()
        } else {
            false
        };
        if remove {
            g.tenants.remove(tenant);
        }
    }

    pub fn knows(&self, tenant: &str, request_id: &str) -> bool {
        self.lock()
            .tenants
            .get(tenant)
            .is_some_and(|t| t.ids.contains(request_id))
    }

    pub fn close(&self) {
        self.lock().closed = true;
    }

    /// (waiting, running) as the submit path sees them.
    pub fn counts(&self) -> (usize, usize) {
        let g = self.lock();
        (g.waiting, g.running)
    }
}
