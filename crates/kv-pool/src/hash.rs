//! Content addressing for the prefix cache.

use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher, Hasher, RandomState};

/// Isolation domain of the prefix cache.
///
/// Every block hash is keyed by the salt and every cache hit re-checks it, so
/// two sequences share KV blocks only if they carry the same salt. The engine
/// must give each (tenant, adapter) pair its own salt — allocate them from a
/// registry rather than hashing names, so that two tenants can never collide —
/// which keeps one tenant from reusing, or timing, another tenant's prefixes,
/// and keeps KV computed under one LoRA adapter away from another adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Salt(pub u64);

/// Hash of one full block, chained through its parent so equal token blocks at
/// different positions (or after different histories) get different hashes.
pub type BlockHash = u64;

/// Parent hash of the first block of every sequence.
pub(crate) const ROOT_HASH: BlockHash = 0;

/// Keyed hash for block chains.
///
/// SipHash with a per-pool random key: a tenant cannot predict hashes, so it
/// cannot craft collisions; hits are additionally verified against the stored
/// tokens, salt and parent hash, so even a collision cannot return wrong KV for
/// the block itself.
#[derive(Debug, Clone)]
pub(crate) struct ChainHasher {
    random: Option<RandomState>,
    key: u64,
}

impl ChainHasher {
    pub(crate) fn new(key: Option<u64>) -> Self {
        match key {
            Some(key) => Self { random: None, key },
            None => Self {
                random: Some(RandomState::new()),
                key: 0,
            },
        }
    }

    pub(crate) fn hash_block(&self, parent: BlockHash, salt: Salt, tokens: &[u32]) -> BlockHash {
        let mut h = match &self.random {
            Some(r) => r.build_hasher(),
            None => {
                let mut h = DefaultHasher::new();
                h.write_u64(self.key);
                h
            }
        };
        h.write_u64(parent);
        h.write_u64(salt.0);
        h.write_u64(tokens.len() as u64);
        // One `write` per 64 tokens instead of one per token: SipHash's
        // per-call overhead dominates otherwise.
        let mut buf = [0u8; 256];
        for chunk in tokens.chunks(64) {
            for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            h.write(&buf[..chunk.len() * 4]);
        }
        h.finish()
    }
}

/// Map keys are already keyed SipHash outputs, so hashing them again would only
/// cost time; this hasher passes the key through.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type IdBuild = BuildHasherDefault<IdHasher>;
