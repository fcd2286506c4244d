//! KV memory accounting as the scheduler sees it.
//!
//! The scheduler only needs to know whether a row can grow, to reserve that growth for
//! the step, and to give it back. [`BlockBudget`] counts blocks of `block_size` tokens per
//! row against a fixed total. The paged pool in `weft-kv-pool` (block tables, tenant-salted
//! prefix cache, begin/commit/rollback) is meant to back this trait in production, with the
//! same transaction shape: reservations made between `begin` and `rollback` vanish.

use crate::model::RowId;
use crate::util::IdMap;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("KV pool exhausted: need {needed} blocks, {free} free")]
    Exhausted { needed: usize, free: usize },
    #[error("KV transaction misuse: {0}")]
    Misuse(String),
}

pub trait KvBudget {
    fn block_size(&self) -> usize;
    fn total_blocks(&self) -> usize;
    fn free_blocks(&self) -> usize;
    /// Tokens currently reserved for `row` (0 for an unknown row).
    fn row_tokens(&self, row: RowId) -> usize;
    /// Extra blocks `row` needs to hold `tokens` tokens in total.
    fn blocks_needed(&self, row: RowId, tokens: usize) -> usize {
        let bs = self.block_size().max(1);
        tokens
            .div_ceil(bs)
            .saturating_sub(self.row_tokens(row).div_ceil(bs))
    }
    /// Whether `row` can grow by `n` tokens now.
    fn can_grow(&self, row: RowId, n: usize) -> bool {
        self.blocks_needed(row, self.row_tokens(row) + n) <= self.free_blocks()
    }
    /// Grow `row`'s reservation to hold `tokens` tokens in total (never shrinks).
    fn reserve(&mut self, row: RowId, tokens: usize) -> Result<(), KvError>;
    /// Return all of `row`'s blocks. Not transactional: rows are released outside steps.
    fn release(&mut self, row: RowId);
    /// Start a step; reservations until `commit`/`rollback` are provisional.
    fn begin(&mut self);
    fn commit(&mut self);
    fn rollback(&mut self);
    /// Digest of the whole reservation state; used only to verify rollbacks in tests.
    fn fingerprint(&self) -> u64 {
        self.free_blocks() as u64
    }
}

/// Counts `ceil(tokens / block_size)` blocks per row against a fixed total.
#[derive(Debug, Clone)]
pub struct BlockBudget {
    block_size: usize,
    /// log2 of `block_size` when it is a power of two (the usual case): block counts are
    /// taken several times per row per step, and a shift is far cheaper than a division.
    shift: Option<u32>,
    total: usize,
    used: usize,
    /// Tokens held per row, and the transaction that last journaled the row (so each
    /// reservation costs one map lookup).
    rows: IdMap<RowId, (usize, u64)>,
    /// Tokens each row held before its first reservation in the open transaction.
    journal: Vec<(RowId, usize)>,
    txn: u64,
    in_txn: bool,
}

impl BlockBudget {
    pub fn new(block_size: usize, total_blocks: usize) -> Self {
        let block_size = block_size.max(1);
        Self {
            block_size,
            shift: block_size
                .is_power_of_two()
                .then(|| block_size.trailing_zeros()),
            total: total_blocks,
            used: 0,
            rows: IdMap::default(),
            journal: Vec::new(),
            txn: 0,
            in_txn: false,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows.len()
    }

    fn blocks(&self, tokens: usize) -> usize {
        blocks_of(tokens, self.block_size, self.shift)
    }
}

/// `ceil(tokens / bs)`; `shift` is log2 of `bs` when that is a power of two.
#[inline]
fn blocks_of(tokens: usize, bs: usize, shift: Option<u32>) -> usize {
    match shift {
        Some(s) => (tokens >> s) + usize::from(tokens & (bs - 1) != 0),
        None => tokens.div_ceil(bs),
    }
}

impl KvBudget for BlockBudget {
    fn block_size(&self) -> usize {
        self.block_size
    }
    fn total_blocks(&self) -> usize {
        self.total
    }
    fn free_blocks(&self) -> usize {
        self.total - self.used
    }
    fn row_tokens(&self, row: RowId) -> usize {
        self.rows.get(&row).map_or(0, |r| r.0)
    }
    fn blocks_needed(&self, row: RowId, tokens: usize) -> usize {
        self.blocks(tokens)
            .saturating_sub(self.blocks(self.row_tokens(row)))
    }
    fn reserve(&mut self, row: RowId, tokens: usize) -> Result<(), KvError> {
        let free = self.total - self.used;
        let (bs, shift) = (self.block_size, self.shift);
        let entry = self.rows.entry(row).or_insert((0, 0));
        let old = entry.0;
        if tokens <= old {
            return Ok(());
        }
        let needed = blocks_of(tokens, bs, shift) - blocks_of(old, bs, shift);
        if needed > free {
            if old == 0 {
                self.rows.remove(&row);
            }
            return Err(KvError::Exhausted { needed, free });
        }
        if self.in_txn && entry.1 != self.txn {
            entry.1 = self.txn;
            self.journal.push((row, old));
        }
        entry.0 = tokens;
        self.used += needed;
        Ok(())
    }
    fn release(&mut self, row: RowId) {
        if let Some((t, _)) = self.rows.remove(&row) {
            self.used -= self.blocks(t);
        }
    }
    fn fingerprint(&self) -> u64 {
        // Order-independent, so HashMap iteration order does not matter.
        let mut acc = self.used as u64;
        for (r, (t, _)) in &self.rows {
            acc = acc.wrapping_add(crate::util::mix64(
                r.wrapping_mul(0x9e37_79b9) ^ (*t as u64),
            ));
        }
        acc
    }
    fn begin(&mut self) {
        self.journal.clear();
        self.txn += 1;
        self.in_txn = true;
    }
    fn commit(&mut self) {
        self.journal.clear();
        self.in_txn = false;
    }
    fn rollback(&mut self) {
        if !self.in_txn {
            return;
        }
        self.in_txn = false;
        for (row, old) in std::mem::take(&mut self.journal).into_iter().rev() {
            if let Some((t, _)) = self.rows.get(&row).copied() {
                self.used -= self.blocks(t);
            }
            if old == 0 {
                self.rows.remove(&row);
            } else {
                self.used += self.blocks(old);
                self.rows.insert(row, (old, 0));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_blocks_and_rolls_back() {
        let mut b = BlockBudget::new(4, 10);
        b.begin();
        b.reserve(1, 5).unwrap();
        b.commit();
        assert_eq!(b.free_blocks(), 8);
        assert_eq!(b.blocks_needed(1, 8), 0);
        assert_eq!(b.blocks_needed(1, 9), 1);
        b.begin();
        b.reserve(1, 12).unwrap();
        b.reserve(2, 3).unwrap();
        assert_eq!(b.free_blocks(), 6);
        b.rollback();
        assert_eq!(b.free_blocks(), 8);
        assert_eq!(b.row_tokens(1), 5);
        assert_eq!(b.row_tokens(2), 0);
        assert!(matches!(b.reserve(3, 100), Err(KvError::Exhausted { .. })));
        b.release(1);
        assert_eq!(b.free_blocks(), 10);
        assert_eq!(b.rows(), 0);
    }

    #[test]
    fn block_counts_are_ceilings_for_any_block_size() {
        for bs in [1usize, 2, 3, 7, 16, 17, 64] {
            let b = BlockBudget::new(bs, 1 << 20);
            for t in (0..200).chain([usize::MAX - 1, usize::MAX]) {
                assert_eq!(b.blocks(t), t.div_ceil(bs), "block size {bs}, {t} tokens");
                assert_eq!(b.blocks_needed(9, t), t.div_ceil(bs));
            }
        }
    }
}
