//! Length distributions for `--prompt-tokens` and `--max-tokens`.
//!
//! Spec grammar (values are token counts, at least 1):
//! - `128` or `fixed:128`: always 128;
//! - `uniform:LO:HI`: uniform over the integers `LO..=HI`;
//! - `normal:MEAN:STD`: normal, rounded to the nearest integer and clamped
//!   to `[1, MEAN + 6*STD]` so a rare draw can't ask for an absurd length.

use std::fmt;
use std::str::FromStr;

use rand::Rng;

/// A distribution of token counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LengthDist {
    /// Always this many.
    Fixed(u32),
    /// Uniform over `lo..=hi`.
    Uniform {
        /// Smallest value.
        lo: u32,
        /// Largest value (inclusive).
        hi: u32,
    },
    /// Normal with this mean and standard deviation (rounded, clamped).
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation (>= 0).
        std: f64,
    },
}

impl LengthDist {
    /// Draws one length (always >= 1).
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> u32 {
        match *self {
            LengthDist::Fixed(n) => n,
            LengthDist::Uniform { lo, hi } => rng.random_range(lo..=hi),
            LengthDist::Normal { mean, std } => {
                let z = standard_normal(rng);
                let upper = (mean + 6.0 * std).max(1.0);
                (mean + std * z).round().clamp(1.0, upper) as u32
            }
        }
    }

    /// The distribution's nominal mean (before rounding and clamping).
    pub fn mean(&self) -> f64 {
        match *self {
            LengthDist::Fixed(n) => n as f64,
            LengthDist::Uniform { lo, hi } => (lo as f64 + hi as f64) / 2.0,
            LengthDist::Normal { mean, .. } => mean,
        }
    }

    /// The largest value `sample` can return.
    pub fn max(&self) -> u32 {
        match *self {
            LengthDist::Fixed(n) => n,
            LengthDist::Uniform { hi, .. } => hi,
            LengthDist::Normal { mean, std } => (mean + 6.0 * std).max(1.0) as u32,
        }
    }
}

/// One standard normal draw (Box–Muller; one of the pair is discarded, which
/// keeps each request's draw independent of how many draws came before).
pub(crate) fn standard_normal<R: Rng + ?Sized>(rng: &mut R) -> f64 {
    // u1 in (0, 1] so ln(u1) is finite.
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

impl fmt::Display for LengthDist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LengthDist::Fixed(n) => write!(f, "{n}"),
            LengthDist::Uniform { lo, hi } => write!(f, "uniform:{lo}:{hi}"),
            LengthDist::Normal { mean, std } => write!(f, "normal:{mean}:{std}"),
        }
    }
}

impl serde::Serialize for LengthDist {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

fn parse_count(what: &str, s: &str) -> Result<u32, String> {
    let n: u32 = s
        .trim()
        .parse()
        .map_err(|_| format!("{what} `{s}` is not a whole number"))?;
    if n == 0 {
        return Err(format!("{what} must be at least 1"));
    }
    Ok(n)
}

fn parse_real(what: &str, s: &str) -> Result<f64, String> {
    let x: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{what} `{s}` is not a number"))?;
    if !x.is_finite() {
        return Err(format!("{what} must be finite"));
    }
    Ok(x)
}

const GRAMMAR: &str = "expected N, fixed:N, uniform:LO:HI or normal:MEAN:STD";

impl FromStr for LengthDist {
    type Err = String;

    fn from_str(spec: &str) -> Result<Self, String> {
        let spec = spec.trim();
        if spec.is_empty() {
            return Err(format!("empty length spec ({GRAMMAR})"));
        }
        let parts: Vec<&str> = spec.split(':').collect();
        let kind = parts[0].to_ascii_lowercase();
        let want = |n: usize| -> Result<(), String> {
            if parts.len() != n {
                Err(format!(
                    "`{spec}`: {kind} takes {} value(s) ({GRAMMAR})",
                    n - 1
                ))
            } else {
                Ok(())
            }
        };
        match kind.as_str() {
            _ if parts.len() == 1 => parse_count("length", parts[0])
                .map(LengthDist::Fixed)
                .map_err(|e| format!("`{spec}`: {e} ({GRAMMAR})")),
            "fixed" => {
                want(2)?;
                Ok(LengthDist::Fixed(parse_count("length", parts[1])?))
            }
            "uniform" => {
                want(3)?;
                let lo = parse_count("uniform low bound", parts[1])?;
                let hi = parse_count("uniform high bound", parts[2])?;
                if lo > hi {
                    return Err(format!("`{spec}`: uniform needs LO <= HI"));
                }
                Ok(LengthDist::Uniform { lo, hi })
            }
            "normal" => {
                want(3)?;
                let mean = parse_real("normal mean", parts[1])?;
                let std = parse_real("normal standard deviation", parts[2])?;
                if mean < 1.0 {
                    return Err(format!("`{spec}`: normal mean must be at least 1"));
                }
                if std < 0.0 {
                    return Err(format!("`{spec}`: normal standard deviation must be >= 0"));
                }
                Ok(LengthDist::Normal { mean, std })
            }
            other => Err(format!(
                "`{spec}`: unknown distribution `{other}` ({GRAMMAR})"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn parses_fixed_uniform_normal() {
        assert_eq!("128".parse::<LengthDist>(), Ok(LengthDist::Fixed(128)));
        assert_eq!(" fixed:7 ".parse::<LengthDist>(), Ok(LengthDist::Fixed(7)));
        assert_eq!(
            "uniform:64:256".parse::<LengthDist>(),
            Ok(LengthDist::Uniform { lo: 64, hi: 256 })
        );
        assert_eq!(
            "UNIFORM:5:5".parse::<LengthDist>(),
            Ok(LengthDist::Uniform { lo: 5, hi: 5 })
        );
        assert_eq!(
            "normal:128:32".parse::<LengthDist>(),
            Ok(LengthDist::Normal {
                mean: 128.0,
                std: 32.0
            })
        );
        assert_eq!(
            "normal:12.5:0".parse::<LengthDist>(),
            Ok(LengthDist::Normal {
                mean: 12.5,
                std: 0.0
            })
        );
    }

    #[test]
    fn display_round_trips() {
        for s in ["128", "uniform:64:256", "normal:128:32", "normal:12.5:0.5"] {
            let d: LengthDist = s.parse().unwrap();
            assert_eq!(d.to_string(), s);
            assert_eq!(d.to_string().parse::<LengthDist>().unwrap(), d);
        }
    }

    #[test]
    fn rejects_bad_specs_with_clear_errors() {
        let err = |s: &str| s.parse::<LengthDist>().unwrap_err();
        assert!(err("").contains("empty"));
        assert!(err("0").contains("at least 1"), "{}", err("0"));
        assert!(err("-3").contains("not a whole number"));
        assert!(err("abc").contains("not a whole number"));
        assert!(err("uniform:10").contains("takes 2 value(s)"));
        assert!(err("uniform:1:2:3").contains("takes 2 value(s)"));
        assert!(err("uniform:20:10").contains("LO <= HI"));
        assert!(err("uniform:0:10").contains("at least 1"));
        assert!(err("normal:0.5:1").contains("mean must be at least 1"));
        assert!(err("normal:100:-1").contains(">= 0"));
        assert!(err("normal:100:x").contains("not a number"));
        assert!(err("normal:inf:1").contains("finite"));
        assert!(err("fixed:1:2").contains("takes 1 value(s)"));
        assert!(err("zipf:1:2").contains("unknown distribution `zipf`"));
    }

    #[test]
    fn samples_stay_in_range_and_match_mean() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let u = LengthDist::Uniform { lo: 64, hi: 256 };
        let n = 20_000;
        let mut sum = 0u64;
        let (mut min, mut max) = (u32::MAX, 0);
        for _ in 0..n {
            let x = u.sample(&mut rng);
            sum += x as u64;
            min = min.min(x);
            max = max.max(x);
        }
        assert!((64..=256).contains(&min) && (64..=256).contains(&max));
        assert_eq!((min, max), (64, 256), "both ends are reachable");
        let mean = sum as f64 / n as f64;
        // std of a uniform over 193 values is ~55.7; 4 sigma of the mean ~1.6.
        assert!((mean - 160.0).abs() < 1.6, "mean {mean}");

        let g = LengthDist::Normal {
            mean: 128.0,
            std: 32.0,
        };
        let xs: Vec<f64> = (0..n).map(|_| g.sample(&mut rng) as f64).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!((mean - 128.0).abs() < 1.0, "mean {mean}");
        assert!((var.sqrt() - 32.0).abs() < 1.0, "std {}", var.sqrt());
        assert!(xs.iter().all(|&x| x >= 1.0 && x <= g.max() as f64));

        // A wide normal clamps at 1 instead of going to 0 or below.
        let wide = LengthDist::Normal {
            mean: 2.0,
            std: 10.0,
        };
        assert!((0..1000).all(|_| wide.sample(&mut rng) >= 1));
        assert_eq!(LengthDist::Fixed(9).sample(&mut rng), 9);
    }

    #[test]
    fn same_seed_same_lengths() {
        let d: LengthDist = "normal:100:20".parse().unwrap();
        let a: Vec<u32> = {
            let mut r = ChaCha8Rng::seed_from_u64(42);
            (0..50).map(|_| d.sample(&mut r)).collect()
        };
        let b: Vec<u32> = {
            let mut r = ChaCha8Rng::seed_from_u64(42);
            (0..50).map(|_| d.sample(&mut r)).collect()
        };
        assert_eq!(a, b);
    }
}
