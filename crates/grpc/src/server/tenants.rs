//! Tenants, API keys and per-tenant limits.
//!
//! The tenant file (`--tenants PATH`, TOML) lists tenants; each has one or
//! more API keys stored only as lowercase sha256 hex digests
//! (`weft hash-key <key>` prints one):
//!
//! ```toml
//! [[tenant]]
//! name = "alice"                      # [A-Za-z0-9_.-], at most 64 bytes
//! api_key_sha256 = ["9f86d08...", "..."] # or a single string
//! weight = 2.0                        # share of the engine vs other tenants (> 0)
//! priority = [0, 10]                  # allowed request priorities (default [0, 0])
//! max_concurrent = 16                 # requests in flight (queued + running)
//! tokens_per_minute = 200000          # prompt + max_tokens charged at admission
//! max_prompt_tokens = 4096
//! max_tokens = 1024                   # per request; also caps the default
//! max_running = 8                     # rows in the running batch (optional)
//! max_waiting = 64                    # queued requests (optional)
//! ```
//!
//! A presented key is hashed and compared with every stored hash in constant
//! time; the comparison does not stop at the first match, so the time taken
//! says nothing about which tenant (if any) a key belongs to.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The tenant of open (no tenant file) mode.
pub const OPEN_TENANT: &str = "default";

/// One tenant as the server enforces it.
#[derive(Debug)]
pub struct Tenant {
    pub name: String,
    pub weight: f64,
    pub priority_min: i32,
    pub priority_max: i32,
    pub max_concurrent: Option<usize>,
    pub tokens_per_minute: Option<u64>,
    pub max_prompt_tokens: Option<usize>,
    pub max_tokens: Option<usize>,
    pub max_running: Option<usize>,
    pub max_waiting: Option<usize>,
    /// The LoRA adapters this tenant may run with (None: every served one); an
    /// entry ending in `*` is a name prefix (`team-a-*`: adapters mounted later
    /// under that prefix too).
    pub adapters: Option<Vec<String>>,
    /// May mount and unmount adapters (the Admin service).
    pub manage_adapters: bool,
    /// Requests of this tenant admitted and not yet finished.
    pub in_flight: AtomicUsize,
}

impl Tenant {
    /// Whether this tenant may run with the served adapter `name`.
    pub fn may_use_adapter(&self, name: &str) -> bool {
        self.adapters.as_ref().is_none_or(|allowed| {
            allowed.iter().any(|a| match a.strip_suffix('*') {
                Some(prefix) => name.starts_with(prefix),
                None => a == name,
            })
        })
    }

    /// The open-mode tenant: no limits but the server's.
    pub fn open() -> Self {
        Self {
            name: OPEN_TENANT.to_string(),
            weight: 1.0,
            priority_min: i32::MIN,
            priority_max: i32::MAX,
            max_concurrent: None,
            tokens_per_minute: None,
            max_prompt_tokens: None,
            max_tokens: None,
            max_running: None,
            max_waiting: None,
            adapters: None,
            // Open mode binds loopback only: whoever reaches it is local.
            manage_adapters: true,
            in_flight: AtomicUsize::new(0),
        }
    }

    /// Takes one of the tenant's concurrency slots; None when all are taken.
    pub fn acquire(self: &Arc<Self>) -> Option<InFlight> {
        let max = self.max_concurrent.unwrap_or(usize::MAX);
        let mut cur = self.in_flight.load(Ordering::Relaxed);
        loop {
            if cur >= max {
                return None;
            }
            match self.in_flight.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(InFlight(self.clone())),
                Err(now) => cur = now,
            }
        }
    }
}

/// A held concurrency slot; released on drop.
#[derive(Debug)]
pub struct InFlight(Arc<Tenant>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Who may call, and how API keys map to tenants.
#[derive(Debug)]
pub enum Tenants {
    /// No tenant file: every caller is the "default" tenant (loopback only).
    Open(Arc<Tenant>),
    /// Keys are required.
    Keyed(Vec<(Arc<Tenant>, Vec<[u8; 32]>)>),
}

impl Tenants {
    pub fn open() -> Self {
        Tenants::Open(Arc::new(Tenant::open()))
    }

    pub fn all(&self) -> Vec<Arc<Tenant>> {
        match self {
            Tenants::Open(t) => vec![t.clone()],
            Tenants::Keyed(v) => v.iter().map(|(t, _)| t.clone()).collect(),
        }
    }

    /// The tenant for an `authorization` header value, if any.
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Arc<Tenant>, AuthError> {
        let entries = match self {
            Tenants::Open(t) => return Ok(t.clone()),
            Tenants::Keyed(v) => v,
        };
        let Some(value) = authorization else {
            return Err(AuthError::Missing);
        };
        let key = bearer_key(value).ok_or(AuthError::Malformed)?;
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        let mut found: Option<&Arc<Tenant>> = None;
        for (tenant, hashes) in entries {
            for h in hashes {
                // Every hash is compared; no early exit on a match.
                if bool::from(h.ct_eq(&digest)) {
                    found = Some(tenant);
                }
            }
        }
        found.cloned().ok_or(AuthError::Unknown)
    }

    /// Loads and checks a tenant file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading tenant file {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("tenant file {}", path.display()))
    }

    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let file: TenantFile = toml::from_str(text)?;
        if file.tenant.is_empty() {
            bail!("no [[tenant]] entries");
        }
        let mut names = HashSet::new();
        let mut keys = HashSet::new();
        let mut out = Vec::new();
        for t in file.tenant {
            let name = t.name;
            if name.is_empty()
                || name.len() > 64
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
            {
                bail!("tenant name {name:?}: expected 1-64 characters of [A-Za-z0-9_.-]");
            }
            if !names.insert(name.clone()) {
                bail!("tenant {name:?} is listed twice");
            }
            let hashes = t.api_key_sha256.into_vec();
            if hashes.is_empty() {
                bail!("tenant {name:?}: api_key_sha256 is empty");
            }
            let mut parsed = Vec::new();
            for h in hashes {
                let d = parse_sha256_hex(&h).with_context(|| {
                    format!(
                        "tenant {name:?}: api_key_sha256 {h:?} is not a sha256 hex digest \
                         (64 hex digits; `weft hash-key <key>` prints one)"
                    )
                })?;
                if !keys.insert(d) {
                    bail!("tenant {name:?}: an API key hash is listed twice");
                }
                parsed.push(d);
            }
            let weight = t.weight.unwrap_or(1.0);
            if !(weight.is_finite() && weight > 0.0) {
                bail!("tenant {name:?}: weight must be a positive number, got {weight}");
            }
            let [pmin, pmax] = t.priority.unwrap_or([0, 0]);
            if pmin > pmax {
                bail!("tenant {name:?}: priority range [{pmin}, {pmax}] is empty");
            }
            let positive = |field: &str, v: Option<u64>| -> anyhow::Result<Option<u64>> {
                match v {
                    Some(0) => bail!("tenant {name:?}: {field} must be at least 1"),
                    v => Ok(v),
                }
            };
            let as_usize = |v: Option<u64>| v.map(|x| usize::try_from(x).unwrap_or(usize::MAX));
            out.push((
                Arc::new(Tenant {
                    weight,
                    priority_min: pmin,
                    priority_max: pmax,
                    max_concurrent: as_usize(positive("max_concurrent", t.max_concurrent)?),
                    tokens_per_minute: positive("tokens_per_minute", t.tokens_per_minute)?,
                    max_prompt_tokens: as_usize(positive(
                        "max_prompt_tokens",
                        t.max_prompt_tokens,
                    )?),
                    max_tokens: as_usize(positive("max_tokens", t.max_tokens)?),
                    max_running: as_usize(positive("max_running", t.max_running)?),
                    max_waiting: as_usize(positive("max_waiting", t.max_waiting)?),
                    adapters: t.adapters,
                    manage_adapters: t.manage_adapters.unwrap_or(false),
                    in_flight: AtomicUsize::new(0),
                    name,
                }),
                parsed,
            ));
        }
        Ok(Tenants::Keyed(out))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthError {
    Missing,
    Malformed,
    Unknown,
}

impl AuthError {
    pub fn message(self) -> &'static str {
        match self {
            AuthError::Missing => "missing API key: send `authorization: Bearer <key>`",
            AuthError::Malformed => "malformed authorization header: expected `Bearer <key>`",
            AuthError::Unknown => "unknown API key",
        }
    }
}

fn bearer_key(value: &str) -> Option<&str> {
    let (scheme, key) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let key = key.trim();
    (!key.is_empty()).then_some(key)
}

/// Lowercase sha256 hex of a key (`weft hash-key`).
pub fn hash_key(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn parse_sha256_hex(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, chunk) in s.as_bytes().chunks(2).enumerate() {
        let hi = (chunk[0] as char).to_digit(16)?;
        let lo = (chunk[1] as char).to_digit(16)?;
        out[i] = (hi * 16 + lo) as u8;
    }
    Some(out)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantFile {
    #[serde(default)]
    tenant: Vec<TenantEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantEntry {
    name: String,
    api_key_sha256: OneOrMany,
    weight: Option<f64>,
    priority: Option<[i32; 2]>,
    max_concurrent: Option<u64>,
    tokens_per_minute: Option<u64>,
    max_prompt_tokens: Option<u64>,
    max_tokens: Option<u64>,
    max_running: Option<u64>,
    max_waiting: Option<u64>,
    /// LoRA adapters (by served name) the tenant may run with; absent: all.
    adapters: Option<Vec<String>>,
    /// Whether the tenant may mount and unmount adapters (Admin service).
    manage_adapters: Option<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(extra: &str) -> String {
        format!(
            "[[tenant]]\nname = \"a\"\napi_key_sha256 = \"{}\"\n{extra}\n\
             [[tenant]]\nname = \"b\"\napi_key_sha256 = [\"{}\", \"{}\"]\n",
            hash_key("ka"),
            hash_key("kb1"),
            hash_key("kb2").to_uppercase()
        )
    }

    #[test]
    fn hash_key_is_sha256_hex() {
        assert_eq!(
            hash_key("test"),
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
        );
    }

    #[test]
    fn keys_select_tenants() {
        let t = Tenants::parse(&file("weight = 2.5\npriority = [-1, 3]")).unwrap();
        let a = t.authenticate(Some("Bearer ka")).unwrap();
        assert_eq!((a.name.as_str(), a.weight), ("a", 2.5));
        assert_eq!((a.priority_min, a.priority_max), (-1, 3));
        assert_eq!(t.authenticate(Some("bearer kb1")).unwrap().name, "b");
        assert_eq!(t.authenticate(Some("Bearer  kb2 ")).unwrap().name, "b");
        assert_eq!(t.authenticate(None).unwrap_err(), AuthError::Missing);
        assert_eq!(
            t.authenticate(Some("Basic ka")).unwrap_err(),
            AuthError::Malformed
        );
        assert_eq!(
            t.authenticate(Some("Bearer kc")).unwrap_err(),
            AuthError::Unknown
        );
        assert_eq!(
            t.authenticate(Some("Bearer ")).unwrap_err(),
            AuthError::Malformed
        );
    }

    #[test]
    fn bad_files_are_refused() {
        let h = hash_key("x");
        for (text, needle) in [
            ("", "no [[tenant]]"),
            (
                &format!("[[tenant]]\nname=\"a b\"\napi_key_sha256=\"{h}\""),
                "tenant name",
            ),
            (
                "[[tenant]]\nname=\"a\"\napi_key_sha256=\"abc\"",
                "sha256 hex",
            ),
            (
                &format!("[[tenant]]\nname=\"a\"\napi_key_sha256=\"{h}\"\nweight=0"),
                "weight",
            ),
            (
                &format!("[[tenant]]\nname=\"a\"\napi_key_sha256=\"{h}\"\npriority=[2,1]"),
                "priority",
            ),
            (
                &format!("[[tenant]]\nname=\"a\"\napi_key_sha256=\"{h}\"\nmax_tokens=0"),
                "max_tokens",
            ),
            (
                &format!("[[tenant]]\nname=\"a\"\napi_key_sha256=\"{h}\"\nbogus=1"),
                "bogus",
            ),
            (
                &format!(
                    "[[tenant]]\nname=\"a\"\napi_key_sha256=\"{h}\"\n\
                     [[tenant]]\nname=\"a\"\napi_key_sha256=\"{}\"",
                    hash_key("y")
                ),
                "twice",
            ),
            (
                &format!(
                    "[[tenant]]\nname=\"a\"\napi_key_sha256=\"{h}\"\n\
                     [[tenant]]\nname=\"b\"\napi_key_sha256=\"{h}\""
                ),
                "twice",
            ),
        ] {
            let e = format!("{:#}", Tenants::parse(text).unwrap_err());
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }

    #[test]
    fn adapter_lists() {
        let t = Tenants::parse(&file("adapters = [\"sql\"]")).unwrap();
        let all = t.all();
        let a = all.iter().find(|t| t.name == "a").unwrap();
        let b = all.iter().find(|t| t.name == "b").unwrap();
        assert!(a.may_use_adapter("sql"));
        assert!(!a.may_use_adapter("chat"));
        assert!(b.may_use_adapter("chat"), "no list: every served adapter");
        let t = Tenants::parse(&file("adapters = [\"sql\", \"team-a-*\"]")).unwrap();
        let all = t.all();
        let a = all.iter().find(|t| t.name == "a").unwrap();
        assert!(a.may_use_adapter("team-a-v2") && a.may_use_adapter("team-a-"));
        assert!(!a.may_use_adapter("team-b-v1") && !a.may_use_adapter("sq"));
        assert!(Tenant::open().may_use_adapter("anything"));
    }

    #[test]
    fn concurrency_slots() {
        let t = Arc::new(Tenant {
            max_concurrent: Some(2),
            ..Tenant::open()
        });
        let a = t.acquire().unwrap();
        let _b = t.acquire().unwrap();
        assert!(t.acquire().is_none());
        drop(a);
        assert!(t.acquire().is_some());
    }
}
