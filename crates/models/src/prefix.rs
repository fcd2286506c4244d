//! Tenant-scoped cache of finished rows' K/V for prefix reuse.
//!
//! Entries are single-row [`KvCache`]s keyed by (tenant, tokens). A new row
//! whose tokens start with an entry's tokens (same tenant only: one tenant can
//! never hit, or time, another's prefix) starts from a copy of that entry cut
//! to the block-aligned common length, and prefills only the rest. Cutting is
//! free: columns past a cache's cursor are dead data. Entries share MLX
//! buffers with nothing the engine writes, so a hit copies on first write.
//! Bounded by total cached tokens, evicting least recently used entries.

use crate::cache::KvCache;

struct Entry {
    tenant: String,
    tokens: Vec<u32>,
    cache: KvCache,
    last_used: u64,
}

pub struct PrefixStore {
    block: usize,
    max_tokens: usize,
    entries: Vec<Entry>,
    clock: u64,
}

impl PrefixStore {
    /// `block`: reuse granularity in tokens; `max_tokens`: capacity (0 = off).
    pub fn new(block: usize, max_tokens: usize) -> Self {
        Self {
            block: block.max(1),
            max_tokens,
            entries: Vec::new(),
            clock: 0,
        }
    }

    fn best(&self, tenant: &str, tokens: &[u32]) -> Option<(usize, usize)> {
        let limit = tokens.len().saturating_sub(1);
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.tenant == tenant)
            .map(|(i, e)| {
                let common = e
                    .tokens
                    .iter()
                    .zip(tokens)
                    .take_while(|(a, b)| a == b)
                    .count();
                (i, (common.min(limit) / self.block) * self.block)
            })
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(_, n)| n)
    }

    /// Longest reusable prefix of `tokens` for `tenant` (0 = none; < tokens.len()).
    pub fn lookup(&self, tenant: &str, tokens: &[u32]) -> usize {
        self.best(tenant, tokens).map_or(0, |(_, n)| n)
    }

    /// A single-row cache holding the first `lookup()` tokens' K/V.
    pub fn take(&mut self, tenant: &str, tokens: &[u32]) -> Option<(KvCache, usize)> {
        let (i, n) = self.best(tenant, tokens)?;
        self.clock += 1;
        let e = &mut self.entries[i];
        e.last_used = self.clock;
        Some((e.cache.truncated(n as i32), n))
    }

    /// Keeps `cache` (one row holding exactly `tokens`) for later reuse.
    pub fn insert(&mut self, tenant: &str, tokens: Vec<u32>, cache: KvCache) {
        if tokens.len() < self.block || tokens.len() > self.max_tokens {
            return;
        }
        // An entry that is a prefix of the new one adds nothing.
        self.entries
            .retain(|e| !(e.tenant == tenant && tokens.starts_with(&e.tokens)));
        self.clock += 1;
        self.entries.push(Entry {
            tenant: tenant.to_string(),
            tokens,
            cache,
            last_used: self.clock,
        });
        while self.cached_tokens() > self.max_tokens {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.entries.swap_remove(oldest);
        }
    }

    pub fn cached_tokens(&self) -> usize {
        self.entries.iter().map(|e| e.tokens.len()).sum()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
