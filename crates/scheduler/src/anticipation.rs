//! Anticipatory scheduling: a short wait before a step for the next request of a
//! tenant whose last one just ended ([`crate::SchedulerConfig::anticipation`]).
//!
//! A client that chains requests sends the next one a millisecond or two after the
//! last one's final event (measured on the CPU server over loopback gRPC:
//! 0.9-2.6 ms). Without a wait the engine has begun its next step by then, and the
//! request waits for all of it before its own prefill can start: under another
//! tenant's 32-stream flood on the CPU that is a ~150 ms decode step, about
//! doubling the request's time to first token. The disk schedulers' anticipation,
//! applied to steps.
//!
//! Bounded three ways: only a tenant whose last return came within the wait is
//! anticipated (one that took longer is not, until it returns quickly again; one
//! away for longer than the isolation window starts afresh, as a new tenant
//! does, so a client chaining again after a pause is waited for at once), the
//! wait ends as soon as every anticipated tenant has a request in, and all waits
//! draw on a credit that grows at [`ANTICIPATION_SHARE`] seconds a second, so they
//! never take more than that share of the engine's time.

use std::time::{Duration, Instant};

use crate::config::{ANTICIPATION_CREDIT_WAITS, ANTICIPATION_SHARE};

/// What one tenant's returns have shown.
#[derive(Debug, Clone, Copy)]
struct Returns {
    /// When its last live request finished, while it has had none since.
    idle_since: Option<Instant>,
    /// Its last return (next request after `idle_since`) came within the wait or
    /// after a pause past the reset, or it has not returned yet: anticipate it.
    quick: bool,
}

impl Default for Returns {
    fn default() -> Self {
        Self {
            idle_since: None,
            quick: true,
        }
    }
}

/// Counts of waits, by how they ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AnticipationCounts {
    /// Waits that ended with every anticipated tenant's request in.
    pub arrived: u64,
    /// Waits that ran out (the step went ahead without it).
    pub missed: u64,
    /// Time spent waiting, all waits together.
    pub waited: Duration,
}

#[derive(Debug)]
pub(crate) struct Anticipation {
    window: Duration,
    /// A return after this long is a fresh start, not a slow return (None: never,
    /// with the isolation window off).
    reset: Option<Duration>,
    returns: Vec<Returns>,
    /// Tenants anticipated before the next step, with their deadlines.
    pending: Vec<(usize, Instant)>,
    /// When the current wait began (a step settles it).
    since: Option<Instant>,
    /// Seconds of waiting allowed now, and when it was last topped up.
    credit: f64,
    credit_at: Option<Instant>,
    counts: AnticipationCounts,
}

impl Anticipation {
    /// Waits of up to `window`; a tenant back after `reset` or more (the isolation
    /// window) is anticipated again like a new one. A zero `reset` (the window off)
    /// resets nobody: a tenant that came back slowly is waited for again only after
    /// it comes back quickly.
    pub fn new(window: Duration, reset: Duration) -> Self {
        Self {
            window,
            reset: (!reset.is_zero()).then(|| reset.max(window)),
            returns: Vec::new(),
            pending: Vec::new(),
            since: None,
            credit: (window * ANTICIPATION_CREDIT_WAITS).as_secs_f64(),
            credit_at: None,
            counts: AnticipationCounts::default(),
        }
    }

    pub fn counts(&self) -> AnticipationCounts {
        self.counts
    }

    fn returns(&mut self, t: usize) -> &mut Returns {
        if self.returns.len() <= t {
            self.returns.resize(t + 1, Returns::default());
        }
        &mut self.returns[t]
    }

    /// Tenant `t`'s last live request finished as asked (not cancelled or failed),
    /// leaving it nothing queued or running.
    pub fn finished(&mut self, t: usize, now: Instant) {
        if self.window.is_zero() {
            return;
        }
        let r = self.returns(t);
        r.idle_since = Some(now);
        if r.quick && !self.pending.iter().any(|&(x, _)| x == t) {
            self.pending.push((t, now + self.window));
        }
    }

    /// A request of tenant `t` arrived (at `arrival`, its submit) while the tenant had
    /// nothing queued or running: how long it took to return decides whether it is
    /// anticipated next time.
    pub fn arrived(&mut self, t: usize, arrival: Instant) {
        if self.window.is_zero() {
            return;
        }
        let (window, reset) = (self.window, self.reset);
        let r = self.returns(t);
        if let Some(since) = r.idle_since.take() {
            let gap = arrival.saturating_duration_since(since);
            r.quick = gap <= window || reset.is_some_and(|x| gap >= x);
        }
    }

    /// How long the engine may still wait before its next step: until the latest
    /// deadline of the anticipated tenants still `idle`, within the credit. None:
    /// step now (nobody to wait for, or no credit left).
    pub fn wait(&mut self, now: Instant, idle: impl Fn(usize) -> bool) -> Option<Duration> {
        let until = self
            .pending
            .iter()
            .filter(|&&(t, _)| idle(t))
            .map(|&(_, d)| d)
            .max()?;
        let left = until.saturating_duration_since(now);
        if left.is_zero() {
            return None;
        }
        let started = match self.since {
            Some(s) => s,
            None => {
                self.top_up(now);
                self.since = Some(now);
                now
            }
        };
        let credit = (self.credit - now.saturating_duration_since(started).as_secs_f64()).max(0.0);
        let left = left.min(Duration::from_secs_f64(credit));
        (!left.is_zero()).then_some(left)
    }

    /// A step begins: the wait before it (if any) is over and paid for, and nobody
    /// is anticipated any more (a tenant that came back is in this step; one that
    /// did not has missed its turn). Returns the wait that ended, if one began:
    /// whether everyone waited for arrived, and how long it took.
    pub fn settle(
        &mut self,
        now: Instant,
        idle: impl Fn(usize) -> bool,
    ) -> Option<(bool, Duration)> {
        let ended = self.since.take().map(|started| {
            let waited = now.saturating_duration_since(started);
            self.credit = (self.credit - waited.as_secs_f64()).max(0.0);
            self.counts.waited += waited;
            let arrived = !self.pending.iter().any(|&(t, _)| idle(t));
            if arrived {
                self.counts.arrived += 1;
            } else {
                self.counts.missed += 1;
            }
            (arrived, waited)
        });
        self.pending.clear();
        ended
    }

    fn top_up(&mut self, now: Instant) {
        if let Some(at) = self.credit_at {
            let grown = now.saturating_duration_since(at).as_secs_f64() * ANTICIPATION_SHARE;
            let cap = (self.window * ANTICIPATION_CREDIT_WAITS).as_secs_f64();
            self.credit = (self.credit + grown).min(cap);
        }
        self.credit_at = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_tenant_is_anticipated_until_it_arrives_or_its_deadline() {
        let t0 = Instant::now();
        let mut a = Anticipation::new(5 * MS, 1000 * MS);
        a.finished(1, t0);
        assert_eq!(a.wait(t0 + MS, |_| true), Some(4 * MS));
        assert_eq!(a.wait(t0 + 2 * MS, |_| false), None, "it came back");
        a.settle(t0 + 2 * MS, |_| false);
        assert_eq!(a.counts().arrived, 1);
        assert_eq!(a.counts().waited, MS);
        a.finished(1, t0 + 10 * MS);
        assert_eq!(a.wait(t0 + 11 * MS, |_| true), Some(4 * MS));
        assert_eq!(a.wait(t0 + 15 * MS, |_| true), None, "past its deadline");
        a.settle(t0 + 15 * MS, |_| true);
        assert_eq!(a.counts().missed, 1);
        assert_eq!(a.counts().waited, 5 * MS);
        // A step without a wait before it counts nothing.
        a.finished(1, t0 + 20 * MS);
        a.settle(t0 + 21 * MS, |_| true);
        assert_eq!(a.wait(t0 + 21 * MS, |_| true), None, "settled");
        assert_eq!((a.counts().arrived, a.counts().missed), (1, 1));
    }

    #[test]
    fn a_tenant_that_returned_slowly_is_not_anticipated_until_it_returns_quickly() {
        let t0 = Instant::now();
        let mut a = Anticipation::new(5 * MS, 1000 * MS);
        a.finished(2, t0);
        a.arrived(2, t0 + 20 * MS);
        a.settle(t0 + 20 * MS, |_| false);
        a.finished(2, t0 + 100 * MS);
        assert_eq!(a.wait(t0 + 100 * MS, |_| true), None, "slow last time");
        // It is still measured: a quick return makes it anticipated again.
        a.arrived(2, t0 + 102 * MS);
        a.finished(2, t0 + 200 * MS);
        assert_eq!(a.wait(t0 + 200 * MS, |_| true), Some(5 * MS));
        a.settle(t0 + 200 * MS, |_| true);
        // Slow again, then back after a pause past the reset: a fresh start.
        a.arrived(2, t0 + 300 * MS);
        a.finished(2, t0 + 400 * MS);
        assert_eq!(a.wait(t0 + 400 * MS, |_| true), None, "slow last time");
        a.arrived(2, t0 + 1500 * MS);
        a.finished(2, t0 + 1600 * MS);
        assert_eq!(
            a.wait(t0 + 1600 * MS, |_| true),
            Some(5 * MS),
            "back after a pause"
        );
    }

    #[test]
    fn waits_stay_within_their_share_of_the_engines_time() {
        let t0 = Instant::now();
        let mut a = Anticipation::new(5 * MS, 1000 * MS);
        let mut now = t0;
        let mut waited = Duration::ZERO;
        // A tenant finishing after every 10 ms step and never coming back in time:
        // at most the credit cap plus 5% of the run goes to waiting.
        for _ in 0..1000 {
            a.finished(3, now);
            if let Some(w) = a.wait(now, |_| true) {
                now += w;
                waited += w;
            }
            a.settle(now, |_| true);
            // Still slow to return? It never arrives here, so it stays "quick".
            now += 10 * MS;
        }
        let run = now - t0;
        let cap = (5 * MS * ANTICIPATION_CREDIT_WAITS).as_secs_f64();
        let bound = cap + run.as_secs_f64() * ANTICIPATION_SHARE;
        assert!(
            waited.as_secs_f64() <= bound + 1e-9,
            "{waited:?} of {run:?}"
        );
        assert!(
            waited.as_secs_f64() >= 0.9 * bound,
            "the share is used: {waited:?}"
        );
        assert_eq!(a.counts().waited, waited);
    }

    #[test]
    fn without_an_isolation_window_a_slow_tenant_is_never_reset() {
        let t0 = Instant::now();
        let mut a = Anticipation::new(5 * MS, Duration::ZERO);
        a.finished(2, t0);
        a.arrived(2, t0 + 20 * MS);
        a.settle(t0 + 20 * MS, |_| false);
        a.finished(2, t0 + 100 * MS);
        assert_eq!(a.wait(t0 + 100 * MS, |_| true), None, "slow last time");
        a.arrived(2, t0 + 5000 * MS);
        a.finished(2, t0 + 5100 * MS);
        assert_eq!(
            a.wait(t0 + 5100 * MS, |_| true),
            None,
            "a pause is no reset"
        );
        a.arrived(2, t0 + 5102 * MS);
        a.finished(2, t0 + 5200 * MS);
        assert_eq!(
            a.wait(t0 + 5200 * MS, |_| true),
            Some(5 * MS),
            "quick again"
        );
    }

    #[test]
    fn off_never_waits() {
        let t0 = Instant::now();
        let mut a = Anticipation::new(Duration::ZERO, 1000 * MS);
        a.finished(0, t0);
        assert_eq!(a.wait(t0, |_| true), None);
    }
}
