//! Small helpers shared by the scheduler and the fake model.

/// SplitMix64 finalizer: a cheap, well-mixed 64-bit hash step.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hasher for engine-assigned integer keys (request keys, row ids). They are not
/// attacker-chosen, so SipHash's DoS resistance buys nothing and costs a large share of
/// a step at 256 rows.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    #[inline]
    fn finish(&self) -> u64 {
        mix64(self.0)
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }
}

pub type IdBuild = std::hash::BuildHasherDefault<IdHasher>;
pub type IdMap<K, V> = std::collections::HashMap<K, V, IdBuild>;
