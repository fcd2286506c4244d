//! A deterministic fake model and detokenizer for tests and benchmarks.
//!
//! The logits of a row are a hash of its whole token history (ids and positions), so any
//! state corruption — a lost or duplicated token, a wrong position, a chunk applied twice
//! — changes every later output. The fake also checks the [`Model`] contract itself and
//! records violations instead of panicking.

use std::collections::HashMap;

use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

use crate::model::{Detokenizer, Logits, Model, ModelError, ModelInfo, RowId, RowInput};
use crate::util::mix64;

const HISTORY_SEED: u64 = 0x243f_6a88_85a3_08d3;

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
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            vocab_size: 64,
            max_context: 4096,
            eos_token_ids: vec![0],
            layers: 4,
            logits: FakeLogits::Hash,
        }
    }
}

/// Faults the fake model injects into itself.
#[derive(Debug, Clone, Default)]
pub struct FakeFaults {
    /// 1-based forward calls that fail after layer `fail_after_layer`, leaving partial
    /// staged state behind (the caller must roll back).
    pub forward_fail_calls: Vec<u64>,
    pub fail_after_layer: usize,
    /// 1-based commit calls that fail (the staged state stays until rollback).
    pub commit_fail_calls: Vec<u64>,
    /// Fail forward and commit each with this probability (seeded, deterministic).
    pub random: Option<(u64, f64)>,
    /// Every forward containing a new row (start_pos 0) whose first token is this one
    /// fails: a request that can never be served, to exercise isolation of persistent
    /// failures without hitting rows that merely generate the token.
    pub poison_token: Option<u32>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct RowState {
    len: usize,
    hash: u64,
    last: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeStats {
    pub forwards: u64,
    pub commits: u64,
    pub rollbacks: u64,
    pub failed_forwards: u64,
    pub failed_commits: u64,
    pub tokens: u64,
    pub max_batch_rows: usize,
}

#[derive(Debug)]
pub struct FakeModel {
    cfg: FakeConfig,
    faults: FakeFaults,
    rng: Option<ChaCha8Rng>,
    rows: HashMap<RowId, RowState>,
    /// Some between forward and commit/rollback; may be partial after a failed forward.
    staged: Option<HashMap<RowId, RowState>>,
    /// States after each token of the rows with a draft in the staged step (for `keep`).
    staged_drafts: HashMap<RowId, Vec<RowState>>,
    stats: FakeStats,
    violations: Vec<String>,
    /// Offered sequences by tenant, newest last (the fake's prefix cache).
    prefixes: Vec<(String, Vec<u32>)>,
}

/// The fake caches prefixes in blocks of this many tokens, like a paged cache.
const PREFIX_BLOCK: usize = 8;
/// Entries kept; older ones are evicted first.
const PREFIX_ENTRIES: usize = 64;

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
            staged: None,
            staged_drafts: HashMap::new(),
            stats: FakeStats::default(),
            violations: Vec::new(),
            prefixes: Vec::new(),
        }
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

    pub fn has_staged(&self) -> bool {
        self.staged.is_some()
    }

    /// The logits this model gives after `history` — for oracles in tests.
    pub fn logits_for_history(&self, history: &[u32]) -> Vec<f32> {
        let h = history
            .iter()
            .enumerate()
            .fold(HISTORY_SEED, |h, (p, &t)| step_hash(h, t, p));
        let mut out = vec![0.0; self.cfg.vocab_size];
        let state = RowState {
            len: history.len(),
            hash: h,
            last: history.last().copied().unwrap_or(0),
        };
        self.fill(state, &mut out);
        out
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

    fn fill(&self, state: RowState, out: &mut [f32]) {
        let v = out.len() as u64;
        let h = state.hash;
        match self.cfg.logits {
            FakeLogits::LastToken => {
                let h = mix64(u64::from(state.last) ^ HISTORY_SEED);
                for (i, o) in out.iter_mut().enumerate() {
                    let x = mix64(h ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    *o = (x >> 40) as f32 / (1u32 << 24) as f32 * 8.0 - 4.0;
                }
            }
            FakeLogits::Hash => {
                for (i, o) in out.iter_mut().enumerate() {
                    let x = mix64(h ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    *o = (x >> 40) as f32 / (1u32 << 24) as f32 * 8.0 - 4.0;
                }
            }
            FakeLogits::Trivial => {
                if v > 0 {
                    out[(h % v) as usize] = 1.0;
                }
            }
        }
    }
}

#[inline]
fn step_hash(h: u64, token: u32, pos: usize) -> u64 {
    mix64(h.rotate_left(17) ^ u64::from(token) ^ ((pos as u64) << 32))
}

impl Model for FakeModel {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            vocab_size: self.cfg.vocab_size,
            max_context: self.cfg.max_context,
            eos_token_ids: self.cfg.eos_token_ids.clone(),
        }
    }

    fn forward(&mut self, batch: &[RowInput]) -> Result<Logits, ModelError> {
        self.stats.forwards += 1;
        let call = self.stats.forwards;
        if self.staged.is_some() {
            return Err(self.violation("forward called while a step is staged".into()));
        }
        let mut staged: HashMap<RowId, RowState> = HashMap::with_capacity(batch.len());
        self.staged_drafts.clear();
        for r in batch {
            let committed = self.rows.get(&r.row).copied().unwrap_or(RowState {
                len: 0,
                hash: HISTORY_SEED,
                last: 0,
            });
            if staged.contains_key(&r.row) {
                return Err(self.violation(format!("row {} appears twice in one batch", r.row)));
            }
            if r.tokens.is_empty() {
                return Err(self.violation(format!("row {} has no tokens", r.row)));
            }
            if r.start_pos != committed.len {
                return Err(self.violation(format!(
                    "row {}: start_pos {} but committed length is {}",
                    r.row, r.start_pos, committed.len
                )));
            }
            if r.start_pos + r.tokens.len() > self.cfg.max_context {
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
            let mut s = committed;
            let mut steps = Vec::new();
            for &t in &r.tokens {
                s.hash = step_hash(s.hash, t, s.len);
                s.len += 1;
                s.last = t;
                if r.draft > 0 {
                    steps.push(s);
                }
            }
            staged.insert(r.row, s);
            if r.draft > 0 {
                self.staged_drafts.insert(r.row, steps);
            }
        }
        let fail_here = self.faults.forward_fail_calls.contains(&call) || self.random_fault();
        let poisoned = self.faults.poison_token.is_some_and(|p| {
            batch
                .iter()
                .any(|r| r.start_pos == 0 && r.tokens.first() == Some(&p))
        });
        for layer in 0..self.cfg.layers.max(1) {
            if (fail_here && layer == self.faults.fail_after_layer) || (poisoned && layer == 0) {
                // Leave half-written state staged, as a real model would after writing
                // KV for some layers: only rollback may clear it.
                let keep = staged.len() / 2;
                self.staged = Some(staged.into_iter().take(keep).collect());
                self.stats.failed_forwards += 1;
                return Err(ModelError::Failed(format!(
                    "injected fault after layer {layer}"
                )));
            }
        }
        let wanted: Vec<&RowInput> = batch.iter().filter(|r| r.want_logits).collect();
        let vocab = self.cfg.vocab_size;
        let positions: usize = wanted.iter().map(|r| 1 + r.draft).sum();
        let mut data = vec![0.0f32; positions * vocab];
        let mut rows = Vec::with_capacity(wanted.len());
        let mut at = 0;
        for r in &wanted {
            // A row with a draft has logits after each of its tokens.
            let states = match self.staged_drafts.get(&r.row) {
                Some(steps) => &steps[..],
                None => staged.get(&r.row).map(std::slice::from_ref).unwrap_or(&[]),
            };
            for &st in states {
                self.fill(st, &mut data[at * vocab..(at + 1) * vocab]);
                at += 1;
            }
            rows.push(r.row);
        }
        self.stats.tokens += batch.iter().map(|r| r.tokens.len() as u64).sum::<u64>();
        self.stats.max_batch_rows = self.stats.max_batch_rows.max(batch.len());
        self.staged = Some(staged);
        Ok(Logits { data, rows, vocab })
    }

    fn commit(&mut self) -> Result<(), ModelError> {
        let call = self.stats.commits + self.stats.failed_commits + 1;
        if self.staged.is_none() {
            return Err(self.violation("commit without a staged step".into()));
        }
        if self.faults.commit_fail_calls.contains(&call) || self.random_fault() {
            self.stats.failed_commits += 1;
            return Err(ModelError::Failed("injected commit fault".into()));
        }
        if let Some(staged) = self.staged.take() {
            self.rows.extend(staged);
        }
        self.staged_drafts.clear();
        self.stats.commits += 1;
        Ok(())
    }

    fn supports_drafts(&self) -> bool {
        true
    }

    fn keep(&mut self, row: RowId, tokens: usize) -> Result<(), ModelError> {
        let state = self
            .staged_drafts
            .get(&row)
            .and_then(|steps| tokens.checked_sub(1).and_then(|i| steps.get(i)))
            .copied();
        match (state, self.staged.as_mut()) {
            (Some(st), Some(staged)) => {
                staged.insert(row, st);
                Ok(())
            }
            _ => Err(self.violation(format!(
                "keep({row}, {tokens}) without a staged draft that long"
            ))),
        }
    }

    fn rollback(&mut self) {
        self.stats.rollbacks += 1;
        self.staged = None;
        self.staged_drafts.clear();
    }

    fn prefix_len(&self, tenant: &str, tokens: &[u32]) -> usize {
        let best = self
            .prefixes
            .iter()
            .filter(|(t, _)| t == tenant)
            .map(|(_, p)| p.iter().zip(tokens).take_while(|(a, b)| a == b).count())
            .max()
            .unwrap_or(0);
        (best.min(tokens.len().saturating_sub(1)) / PREFIX_BLOCK) * PREFIX_BLOCK
    }

    fn attach_prefix(&mut self, row: RowId, tenant: &str, tokens: &[u32]) -> usize {
        let n = self.prefix_len(tenant, tokens);
        if n == 0 {
            return 0;
        }
        if self.rows.contains_key(&row) || self.staged.is_some() {
            self.violations.push(format!(
                "attach_prefix({row}) on a live row or inside a step"
            ));
            return 0;
        }
        let hash = tokens[..n]
            .iter()
            .enumerate()
            .fold(HISTORY_SEED, |h, (p, &t)| step_hash(h, t, p));
        let last = tokens[n - 1];
        self.rows.insert(row, RowState { len: n, hash, last });
        n
    }

    fn offer_prefix(&mut self, row: RowId, tenant: &str, tokens: &[u32]) {
        match self.rows.get(&row) {
            Some(s) if s.len == tokens.len() => {
                if self.prefixes.len() >= PREFIX_ENTRIES {
                    self.prefixes.remove(0);
                }
                self.prefixes.push((tenant.to_string(), tokens.to_vec()));
            }
            other => self.violations.push(format!(
                "offer_prefix({row}) with {} tokens but the row holds {:?}",
                tokens.len(),
                other.map(|s| s.len)
            )),
        }
    }

    fn release_row(&mut self, row: RowId) {
        if self.staged.is_some() {
            self.violations
                .push(format!("release_row({row}) while a step is staged"));
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

    fn row(row: RowId, tokens: Vec<u32>, start_pos: usize) -> RowInput {
        RowInput {
            row,
            tokens,
            start_pos,
            want_logits: true,
            draft: 0,
        }
    }

    #[test]
    fn logits_depend_on_exact_history_not_chunking() {
        let mut m = FakeModel::new(FakeConfig::default());
        let a = m.forward(&[row(1, vec![1, 2, 3], 0)]).unwrap();
        m.commit().unwrap();
        let b = m.forward(&[row(1, vec![4], 3)]).unwrap();
        m.commit().unwrap();
        let mut m2 = FakeModel::new(FakeConfig::default());
        let c = m2.forward(&[row(9, vec![1, 2, 3, 4], 0)]).unwrap();
        assert_eq!(b.data, c.data);
        assert_ne!(a.data, b.data);
        assert_eq!(m.logits_for_history(&[1, 2, 3, 4]), c.data);
        assert_ne!(m.logits_for_history(&[1, 2, 4, 3]), c.data);
    }

    #[test]
    fn staging_and_contract_checks() {
        let mut m = FakeModel::new(FakeConfig::default());
        m.forward(&[row(1, vec![1, 2], 0)]).unwrap();
        m.rollback();
        assert!(matches!(
            m.forward(&[row(1, vec![3], 2)]),
            Err(ModelError::Contract(_))
        ));
        m.forward(&[row(1, vec![1, 2], 0)]).unwrap();
        assert!(m.forward(&[row(1, vec![1, 2], 0)]).is_err());
        m.commit().unwrap();
        assert!(m.commit().is_err());
        assert_eq!(m.live_rows(), 1);
        m.release_row(1);
        assert_eq!(m.live_rows(), 0);
        assert_eq!(m.violations().len(), 3);
    }

    #[test]
    fn injected_faults_leave_partial_staging() {
        let faults = FakeFaults {
            forward_fail_calls: vec![1],
            fail_after_layer: 2,
            commit_fail_calls: vec![1],
            ..Default::default()
        };
        let mut m = FakeModel::with_faults(FakeConfig::default(), faults);
        assert!(m
            .forward(&[row(1, vec![1], 0), row(2, vec![1], 0)])
            .is_err());
        assert!(m.has_staged());
        m.rollback();
        m.forward(&[row(1, vec![1], 0)]).unwrap();
        assert!(m.commit().is_err());
        m.rollback();
        assert_eq!(m.live_rows(), 0);
        assert!(m.violations().is_empty());
    }
}
