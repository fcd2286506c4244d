//! Durations as flags and config values spell them ("30s", "500ms", "2m",
//! "1h", or plain seconds such as "2.5"), for `weft serve` and `weft bench`.

use std::time::Duration;

/// The longest duration [`parse_duration`] accepts.
pub const MAX_DURATION_SECS: f64 = 1e9;

/// Parses a non-negative duration; callers that need it positive check that.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, unit) = match t.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => (&t[..i], &t[i..]),
        None => (t, "s"),
    };
    let x: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{t}`: expected a duration like 30, 30s, 2m, 500ms"))?;
    let secs = match unit {
        "ms" => x / 1000.0,
        "s" => x,
        "m" => x * 60.0,
        "h" => x * 3600.0,
        _ => return Err(format!("`{t}`: unknown unit `{unit}` (ms, s, m, h)")),
    };
    if !(secs.is_finite() && secs >= 0.0) {
        return Err(format!("`{t}`: must be zero or more"));
    }
    // Durations are added to `Instant`s and multiplied (the coalescing
    // window is 5x its gap): a value near `Duration::MAX` would overflow there.
    if secs > MAX_DURATION_SECS {
        return Err(format!(
            "`{t}`: at most {MAX_DURATION_SECS:e} seconds (~31 years)"
        ));
    }
    Duration::try_from_secs_f64(secs).map_err(|e| format!("`{t}`: {e}"))
}

/// As [`parse_duration`], refusing zero.
pub fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err(format!("`{}`: must be positive", s.trim()));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_and_without_units() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("1.5m").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_positive_duration("0")
            .unwrap_err()
            .contains("positive"));
        assert!(parse_duration("-1s").unwrap_err().contains("zero or more"));
        assert!(parse_duration("5d").unwrap_err().contains("unknown unit"));
        // Found by tests/fuzz_inputs.rs: these panicked (from_secs_f64, and
        // the coalescing window's 5x) instead of being refused.
        for huge in [
            "100000000000000000000",
            "10000000000000000000s",
            "3000000000000000h",
            "1000000001",
        ] {
            assert!(
                parse_duration(huge).unwrap_err().contains("at most"),
                "{huge}"
            );
        }
        assert!(parse_duration("x")
            .unwrap_err()
            .contains("expected a duration"));
    }
}
