//! Test-only fault injection inside the step transaction.
//!
//! Faults in the model itself (mid-forward after layer k, in commit) live in the fake
//! model; these are the scheduler-side points. A production config has an empty plan,
//! which costs one branch per point.

use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultPoint {
    /// After the step is planned and KV reserved, before the forward call.
    AfterPlan,
    /// After the forward call returned logits, before sampling.
    AfterForward,
    /// Part-way through sampling the rows.
    Sampling,
    /// Part-way through building the commit record, before the model commits.
    CommitBookkeeping,
}

impl FaultPoint {
    pub const ALL: [FaultPoint; 4] = [
        FaultPoint::AfterPlan,
        FaultPoint::AfterForward,
        FaultPoint::Sampling,
        FaultPoint::CommitBookkeeping,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// When injected faults fire. Counters are per point and count every time the point is
/// reached (retries included), so `at(AfterPlan, 3)` fails the third attempt that gets
/// past planning.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// (point, 1-based occurrence) pairs that fail.
    pub at: Vec<(FaultPoint, u64)>,
    /// Fail each point with this probability, from a seeded RNG (deterministic runs).
    pub random: Option<(u64, f64)>,
    /// The engine thread panics in its `n`th (1-based) step that runs rows: a fault
    /// outside the step transaction, which nothing rolls back (the engine fails every
    /// live request and stops; see `Engine`).
    pub panic_at_step: Option<u64>,
    counters: [u64; 4],
    steps: u64,
    rng: Option<ChaCha8Rng>,
}

impl FaultPlan {
    pub fn at(mut self, point: FaultPoint, occurrence: u64) -> Self {
        self.at.push((point, occurrence));
        self
    }

    pub fn random(seed: u64, probability: f64) -> Self {
        Self {
            random: Some((seed, probability)),
            ..Self::default()
        }
    }

    /// Panic in the `n`th step that runs rows.
    pub fn panic_at_step(mut self, n: u64) -> Self {
        self.panic_at_step = Some(n);
        self
    }

    pub fn is_empty(&self) -> bool {
        self.at.is_empty() && self.random.is_none()
    }

    /// Counts a step that runs rows; true when it is the one to panic in.
    pub(crate) fn step_panics(&mut self) -> bool {
        let Some(n) = self.panic_at_step else {
            return false;
        };
        self.steps += 1;
        self.steps == n
    }

    /// Faults fired so far at each point.
    pub fn reached(&self, point: FaultPoint) -> u64 {
        self.counters[point.index()]
    }

    pub(crate) fn hit(&mut self, point: FaultPoint) -> bool {
        if self.is_empty() {
            return false;
        }
        let c = &mut self.counters[point.index()];
        *c += 1;
        let n = *c;
        if self.at.iter().any(|&(p, k)| p == point && k == n) {
            return true;
        }
        if let Some((seed, p)) = self.random {
            let rng = self
                .rng
                .get_or_insert_with(|| ChaCha8Rng::seed_from_u64(seed));
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            return u < p;
        }
        false
    }
}
