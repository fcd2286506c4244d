//! `--tenant name:apikey[:share]` and `--tenant-rate name:R`.

use std::str::FromStr;

/// One tenant the load is sent as.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TenantSpec {
    /// Name used in the report (not sent to the server).
    pub name: String,
    /// API key sent as `authorization: Bearer <key>`; `None` sends no header.
    #[serde(skip)]
    pub api_key: Option<String>,
    /// Relative weight when requests are split between tenants (default 1).
    pub share: f64,
}

impl FromStr for TenantSpec {
    type Err = String;

    /// `name:apikey[:share]`. The key may be empty (`name:` or `name::2`):
    /// no `authorization` header is sent then. A key containing `:` must be
    /// followed by an explicit share (the last field is always read as one
    /// when there are three or more).
    fn from_str(spec: &str) -> Result<Self, String> {
        const FORM: &str = "expected name:apikey[:share]";
        let (name, rest) = spec
            .split_once(':')
            .ok_or_else(|| format!("tenant `{spec}`: missing `:apikey` ({FORM})"))?;
        let name = name.trim();
        if name.is_empty() {
            return Err(format!("tenant `{spec}`: empty name ({FORM})"));
        }
        if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!(
                "tenant `{spec}`: name must not contain spaces or control characters"
            ));
        }
        let (key, share) = match rest.rsplit_once(':') {
            None => (rest, 1.0),
            Some((key, share)) => {
                let share: f64 = share.trim().parse().map_err(|_| {
                    format!("tenant `{name}`: share `{share}` is not a number ({FORM})")
                })?;
                if !(share.is_finite() && share > 0.0) {
                    return Err(format!(
                        "tenant `{name}`: share must be a positive number, got {share}"
                    ));
                }
                (key, share)
            }
        };
        // Header values must be visible ASCII (and spaces); check up front so a
        // bad key is a clear startup error, not a failure of every request.
        if key.bytes().any(|b| !(0x20..0x7f).contains(&b)) {
            return Err(format!(
                "tenant `{name}`: API key must be printable ASCII (it travels in a header)"
            ));
        }
        Ok(TenantSpec {
            name: name.to_string(),
            api_key: (!key.is_empty()).then(|| key.to_string()),
            share,
        })
    }
}

/// A per-tenant open-loop rate.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TenantRate {
    /// Name of a tenant given with `--tenant`.
    pub name: String,
    /// Poisson arrivals per second for that tenant alone.
    pub rate: f64,
}

impl FromStr for TenantRate {
    type Err = String;

    /// `name:R` with R > 0 requests per second.
    fn from_str(spec: &str) -> Result<Self, String> {
        let (name, rate) = spec
            .rsplit_once(':')
            .ok_or_else(|| format!("tenant rate `{spec}`: expected name:R (requests/s)"))?;
        let name = name.trim();
        if name.is_empty() {
            return Err(format!("tenant rate `{spec}`: empty tenant name"));
        }
        let rate: f64 = rate
            .trim()
            .parse()
            .map_err(|_| format!("tenant rate `{spec}`: `{rate}` is not a number"))?;
        if !(rate.is_finite() && rate > 0.0) {
            return Err(format!(
                "tenant rate `{spec}`: rate must be a positive number of requests/s"
            ));
        }
        Ok(TenantRate {
            name: name.to_string(),
            rate,
        })
    }
}

/// Checks a tenant list and its rates together: names unique, every rate
/// names a known tenant, at most one rate per tenant.
pub fn validate(tenants: &[TenantSpec], rates: &[TenantRate]) -> Result<(), String> {
    for (i, t) in tenants.iter().enumerate() {
        if tenants[..i].iter().any(|u| u.name == t.name) {
            return Err(format!("tenant `{}` is given twice", t.name));
        }
    }
    for (i, r) in rates.iter().enumerate() {
        if !tenants.iter().any(|t| t.name == r.name) {
            let known: Vec<&str> = tenants.iter().map(|t| t.name.as_str()).collect();
            return Err(format!(
                "--tenant-rate names unknown tenant `{}` (known: {})",
                r.name,
                if known.is_empty() {
                    "none; add --tenant name:apikey".to_string()
                } else {
                    known.join(", ")
                }
            ));
        }
        if rates[..i].iter().any(|u| u.name == r.name) {
            return Err(format!("--tenant-rate for `{}` is given twice", r.name));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tenants() {
        assert_eq!(
            "alice:sk-1".parse::<TenantSpec>().unwrap(),
            TenantSpec {
                name: "alice".into(),
                api_key: Some("sk-1".into()),
                share: 1.0
            }
        );
        assert_eq!(
            "bob:sk-2:3.5".parse::<TenantSpec>().unwrap(),
            TenantSpec {
                name: "bob".into(),
                api_key: Some("sk-2".into()),
                share: 3.5
            }
        );
        let anon = "anon:".parse::<TenantSpec>().unwrap();
        assert_eq!(anon.api_key, None);
        assert_eq!(anon.share, 1.0);
        let anon2 = "anon::2".parse::<TenantSpec>().unwrap();
        assert_eq!((anon2.api_key, anon2.share), (None, 2.0));
        // A key with a colon works when the share is explicit.
        let c = "c:part1:part2:1".parse::<TenantSpec>().unwrap();
        assert_eq!(c.api_key.as_deref(), Some("part1:part2"));
    }

    #[test]
    fn tenant_errors_are_clear() {
        let err = |s: &str| s.parse::<TenantSpec>().unwrap_err();
        assert!(err("alice").contains("missing `:apikey`"));
        assert!(err(":key").contains("empty name"));
        assert!(err("a b:key").contains("spaces"));
        assert!(err("a:key:x").contains("share `x` is not a number"));
        assert!(err("a:key:0").contains("positive"));
        assert!(err("a:key:-1").contains("positive"));
        assert!(err("a:key:NaN").contains("positive"));
        assert!(err("a:ke\ny").contains("printable ASCII"));
        // Ambiguous: a key with a colon but no share reads the tail as a share.
        assert!(err("a:part1:part2").contains("share `part2`"));
    }

    #[test]
    fn parses_rates() {
        assert_eq!(
            "flood:20".parse::<TenantRate>().unwrap(),
            TenantRate {
                name: "flood".into(),
                rate: 20.0
            }
        );
        assert_eq!("x:0.25".parse::<TenantRate>().unwrap().rate, 0.25);
        let err = |s: &str| s.parse::<TenantRate>().unwrap_err();
        assert!(err("flood").contains("expected name:R"));
        assert!(err(":3").contains("empty tenant name"));
        assert!(err("a:fast").contains("not a number"));
        assert!(err("a:0").contains("positive"));
        assert!(err("a:-2").contains("positive"));
    }

    #[test]
    fn validates_together() {
        let t = |s: &str| s.parse::<TenantSpec>().unwrap();
        let r = |s: &str| s.parse::<TenantRate>().unwrap();
        let tenants = vec![t("a:k1"), t("b:k2")];
        assert!(validate(&tenants, &[r("a:5")]).is_ok());
        assert!(validate(&tenants, &[r("c:5")])
            .unwrap_err()
            .contains("unknown tenant `c` (known: a, b)"));
        assert!(validate(&tenants, &[r("a:5"), r("a:1")])
            .unwrap_err()
            .contains("given twice"));
        assert!(validate(&[t("a:k1"), t("a:k2")], &[])
            .unwrap_err()
            .contains("tenant `a` is given twice"));
        assert!(validate(&[], &[r("a:1")]).unwrap_err().contains("none;"));
    }
}
