//! Open-loop arrival times: a Poisson process (exponential gaps) from a seeded
//! generator, so a run's schedule is reproducible with `--seed`.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Arrival offsets (seconds from the start) of a Poisson process.
///
/// Gaps are exponential with mean `1 / rate`, drawn by inversion
/// (`-ln(U) / rate`). The schedule depends only on `(rate, seed, stream)`,
/// never on how fast the server answers: that is what makes it open loop.
#[derive(Debug, Clone)]
pub struct PoissonArrivals {
    rate: f64,
    rng: ChaCha8Rng,
    t: f64,
}

impl PoissonArrivals {
    /// A process of `rate` arrivals per second. `stream` separates several
    /// independent processes that share one seed (one per tenant).
    ///
    /// Panics if `rate` is not a positive finite number (callers validate).
    pub fn new(rate: f64, seed: u64, stream: u64) -> Self {
        assert!(rate.is_finite() && rate > 0.0, "rate must be > 0");
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(stream);
        Self { rate, rng, t: 0.0 }
    }

    /// The rate in arrivals per second.
    pub fn rate(&self) -> f64 {
        self.rate
    }
}

impl Iterator for PoissonArrivals {
    type Item = f64;

    fn next(&mut self) -> Option<f64> {
        // U in (0, 1] keeps ln(U) finite.
        let u: f64 = 1.0 - self.rng.random::<f64>();
        self.t += -u.ln() / self.rate;
        Some(self.t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_rate_within_statistical_bound() {
        for (rate, seed) in [(50.0, 1u64), (0.5, 2), (1000.0, 3)] {
            let n = 20_000usize;
            let times: Vec<f64> = PoissonArrivals::new(rate, seed, 0).take(n).collect();
            assert!(times.windows(2).all(|w| w[1] > w[0]), "increasing");
            // Mean gap: std of the mean of n exponential gaps is (1/rate)/sqrt(n).
            let mean_gap = times[n - 1] / n as f64;
            let sigma = (1.0 / rate) / (n as f64).sqrt();
            assert!(
                (mean_gap - 1.0 / rate).abs() < 4.0 * sigma,
                "rate {rate}: mean gap {mean_gap}"
            );
            // Exponential gaps have a coefficient of variation of 1.
            let gaps: Vec<f64> = std::iter::once(times[0])
                .chain(times.windows(2).map(|w| w[1] - w[0]))
                .collect();
            let m = gaps.iter().sum::<f64>() / n as f64;
            let sd = (gaps.iter().map(|g| (g - m).powi(2)).sum::<f64>() / n as f64).sqrt();
            assert!((sd / m - 1.0).abs() < 0.05, "cv {}", sd / m);
        }
    }

    #[test]
    fn counts_in_a_window_are_poisson() {
        // Arrivals in [0, T) ~ Poisson(rate*T): within 4 standard deviations.
        let (rate, horizon) = (20.0, 500.0);
        let count = PoissonArrivals::new(rate, 9, 0)
            .take_while(|&t| t < horizon)
            .count() as f64;
        let expect = rate * horizon;
        assert!(
            (count - expect).abs() < 4.0 * expect.sqrt(),
            "{count} vs {expect}"
        );
    }

    #[test]
    fn reproducible_and_streams_differ() {
        let a: Vec<f64> = PoissonArrivals::new(5.0, 11, 0).take(100).collect();
        let b: Vec<f64> = PoissonArrivals::new(5.0, 11, 0).take(100).collect();
        let c: Vec<f64> = PoissonArrivals::new(5.0, 11, 1).take(100).collect();
        let d: Vec<f64> = PoissonArrivals::new(5.0, 12, 0).take(100).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
    }
}
