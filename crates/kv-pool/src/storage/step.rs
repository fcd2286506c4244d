//! Host-side plan of one step in one layer group: where each row's new K/V
//! goes, which blocks attention reads, and the mask over the padded layout.
//!
//! Every layer of a group shares the group's block tables, so this is computed
//! once per step and group and reused by all of the group's layers; the work
//! is a few host loops over the batch's block tables plus three small uploads.

use mlx_rs::Array;

use crate::storage::StorageError;
use crate::{AttentionKind, BlockTable, GroupId, KvPool, SeqId};

/// One row of a step, as the storage half sees it.
#[derive(Debug, Clone, Copy)]
pub struct RowStep<'a> {
    /// The row's block table in the group, with this step's appends already
    /// planned (so it holds the blocks the new tokens go to).
    pub table: BlockTable<'a>,
    /// KV slot index of the row's first new token: its committed length
    /// before the step.
    pub start: usize,
    /// New tokens written this step (at least 1, at most the step's `T`).
    pub tokens: usize,
}

impl<'a> RowStep<'a> {
    /// The row of `seq` after `tokens` tokens were appended to it in this step
    /// (its `len` already counts them).
    pub fn from_pool(
        pool: &'a KvPool,
        group: GroupId,
        seq: SeqId,
        tokens: usize,
    ) -> Result<Self, StorageError> {
        let info = pool.sequence(seq)?;
        let start = info.len.checked_sub(tokens).ok_or(StorageError::BadRow(
            "more new tokens than the sequence holds",
        ))?;
        Ok(Self {
            table: pool.table(seq, group)?,
            start,
            tokens,
        })
    }
}

/// Index plan of one step for one layer group.
///
/// Built by [`StepLayout::new`] from the rows' block tables; consumed by
/// [`KvStorage::write`](crate::storage::KvStorage::write) and
/// [`KvStorage::read`](crate::storage::KvStorage::read) for every layer of the
/// group.
///
/// # Read layout
///
/// Row `r` reads `blocks_per_row` consecutive logical blocks starting at
/// `first_block(r)`; column `c` of the padded `[B, H, L, D]` read holds KV slot
/// `first_block(r) * block_size + c`. Full-attention rows start at block 0;
/// sliding-window rows start at the first block holding a key inside the
/// window of the step's first query, so they read only in-window blocks
/// (at most `ceil((window - 1 + T) / block_size) + 1`).
///
/// Query `q` of row `r` sits at KV slot `start + min(q, tokens - 1)` (padding
/// queries of a row with fewer than `T` new tokens repeat its last query, so
/// no mask row is empty) and sees column `c` when the slot `a` of `c` is at
/// most the query's slot `p` and, in a sliding-window group of window `W`,
/// `p - a < W` (the query and the `W - 1` keys before it).
///
/// The host copies ([`block_table`](Self::block_table),
/// [`context_lens`](Self::context_lens), [`first_block`](Self::first_block))
/// are what a paged-attention kernel would take instead of the gathered
/// layout.
#[derive(Debug)]
pub struct StepLayout {
    kind: AttentionKind,
    block_size: usize,
    t: usize,
    starts: Vec<usize>,
    tokens: Vec<usize>,
    first_block: Vec<usize>,
    blocks_per_row: usize,
    block_table: Vec<i32>,
    max_block: u32,
    write_blocks: Array,
    write_offsets: Array,
    write_select: Option<Array>,
    read_blocks: Array,
    valid_blocks: Vec<usize>,
    /// Built at the first [`mask`](StepLayout::mask) call: attention that
    /// reads the pool through the block table (a paged kernel) never needs it,
    /// and at hundreds of rows of long context it is megabytes of host work.
    mask: std::cell::OnceCell<Array>,
}

impl StepLayout {
    /// Plans a step over `rows` in a group of the given attention kind.
    ///
    /// `T` is the largest `tokens` of any row; the new K/V handed to the
    /// storage must be `[rows.len(), kv_heads, T, head_dim]`, rows with fewer
    /// tokens right-padded (their padding is not written).
    ///
    /// `block_bucket` rounds the number of gathered blocks per row up to a
    /// multiple of itself (1 = no rounding), which bounds the number of
    /// distinct read shapes a compiled step sees.
    pub fn new(
        rows: &[RowStep<'_>],
        kind: AttentionKind,
        block_bucket: usize,
    ) -> Result<Self, StorageError> {
        let first = rows
            .first()
            .ok_or(StorageError::BadRow("a step needs at least one row"))?;
        let bs = first.table.block_size;
        if bs == 0 {
            return Err(StorageError::BadRow("block size 0"));
        }
        let b = rows.len();
        let t = rows.iter().map(|r| r.tokens).max().unwrap_or(0);
        let bucket = block_bucket.max(1);
        let mut starts = Vec::with_capacity(b);
        let mut tokens = Vec::with_capacity(b);
        let mut first_block = Vec::with_capacity(b);
        let mut valid_blocks = Vec::with_capacity(b);
        for r in rows {
            if r.table.block_size != bs {
                return Err(StorageError::BadRow("rows with different block sizes"));
            }
            if r.tokens == 0 {
                return Err(StorageError::BadRow("a row with no new tokens"));
            }
            let end = r.start + r.tokens;
            // Slot of the first key the step's first query still sees.
            let lo = match kind {
                AttentionKind::Full => 0,
                AttentionKind::SlidingWindow { window } => {
                    (r.start + 1).saturating_sub(window as usize)
                }
            };
            let fb = lo / bs;
            let last = (end - 1) / bs;
            if fb < r.table.offset || last >= r.table.offset + r.table.blocks.len() {
                return Err(StorageError::NotHeld {
                    first: fb * bs,
                    end,
                });
            }
            starts.push(r.start);
            tokens.push(r.tokens);
            first_block.push(fb);
            valid_blocks.push(last - fb + 1);
        }
        let nb = valid_blocks
            .iter()
            .copied()
            .max()
            .unwrap_or(1)
            .div_ceil(bucket)
            * bucket;
        let l = nb * bs;

        let mut block_table = Vec::with_capacity(b * nb);
        let mut max_block = 0u32;
        for (i, r) in rows.iter().enumerate() {
            let from = first_block[i] - r.table.offset;
            let ids = &r.table.blocks[from..from + valid_blocks[i]];
            for &id in ids {
                max_block = max_block.max(id);
                block_table.push(to_i32(id as usize)?);
            }
            // Padding columns repeat the row's first block: a valid id, masked out.
            let pad = to_i32(ids[0] as usize)?;
            block_table.extend(std::iter::repeat_n(pad, nb - ids.len()));
        }

        let n: usize = tokens.iter().sum();
        let mut wb = Vec::with_capacity(n);
        let mut wo = Vec::with_capacity(n);
        let mut select = Vec::with_capacity(n);
        for (i, r) in rows.iter().enumerate() {
            for j in 0..r.tokens {
                let slot = r.start + j;
                let (blk, off) = r.table.locate(slot).ok_or(StorageError::NotHeld {
                    first: slot,
                    end: slot + 1,
                })?;
                wb.push(to_i32(blk as usize)?);
                wo.push(to_i32(off)?);
                select.push(to_i32(i * t + j)?);
            }
        }
        let ragged = n != b * t;

        let (bi, ni, nbi) = (to_i32(b)?, to_i32(n)?, to_i32(nb)?);
        to_i32(t)?;
        to_i32(l)?;
        Ok(Self {
            kind,
            block_size: bs,
            t,
            read_blocks: Array::from_slice(&block_table, &[bi, 1, nbi]),
            valid_blocks,
            mask: std::cell::OnceCell::new(),
            write_blocks: Array::from_slice(&wb, &[ni]),
            write_offsets: Array::from_slice(&wo, &[ni]),
            write_select: ragged.then(|| Array::from_slice(&select, &[ni])),
            starts,
            tokens,
            first_block,
            blocks_per_row: nb,
            block_table,
            max_block,
        })
    }

    /// Plans a step from the pool directly: `rows` are `(sequence, new
    /// tokens)` in batch order, after this step's appends; the attention kind
    /// is the group's.
    pub fn from_pool(
        pool: &KvPool,
        group: GroupId,
        rows: &[(SeqId, usize)],
        block_bucket: usize,
    ) -> Result<Self, StorageError> {
        let kind = pool
            .config()
            .groups
            .get(group)
            .ok_or(crate::KvError::UnknownGroup(group))?
            .kind;
        let rows = rows
            .iter()
            .map(|&(seq, tokens)| RowStep::from_pool(pool, group, seq, tokens))
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(&rows, kind, block_bucket)
    }

    /// Rows in the step (`B`).
    pub fn batch(&self) -> usize {
        self.starts.len()
    }

    /// New tokens per row in the K/V input (`T`).
    pub fn step_tokens(&self) -> usize {
        self.t
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Attention kind the plan was built for.
    pub fn kind(&self) -> AttentionKind {
        self.kind
    }

    /// Gathered blocks per row (padded to the longest row and the bucket).
    pub fn blocks_per_row(&self) -> usize {
        self.blocks_per_row
    }

    /// Key columns of the padded read (`L = blocks_per_row * block_size`).
    pub fn read_len(&self) -> usize {
        self.blocks_per_row * self.block_size
    }

    /// Row-major `[B, blocks_per_row]` block ids read per row (padding entries
    /// repeat the row's first block).
    pub fn block_table(&self) -> &[i32] {
        &self.block_table
    }

    /// Logical index of each row's first gathered block.
    pub fn first_block(&self) -> &[usize] {
        &self.first_block
    }

    /// KV slot of each row's first new token.
    pub fn starts(&self) -> &[usize] {
        &self.starts
    }

    /// New tokens of each row.
    pub fn tokens(&self) -> &[usize] {
        &self.tokens
    }

    /// Each row's length after the step (`start + tokens`).
    pub fn context_lens(&self) -> Vec<usize> {
        self.starts
            .iter()
            .zip(&self.tokens)
            .map(|(s, t)| s + t)
            .collect()
    }

    /// Boolean attention mask `[B, 1, T, L]` over the padded read layout.
    pub fn mask(&self) -> &Array {
        self.mask.get_or_init(|| self.build_mask())
    }

    fn build_mask(&self) -> Array {
        let (b, t, bs) = (self.batch(), self.t, self.block_size);
        let l = self.blocks_per_row * bs;
        let mut mask = Vec::with_capacity(b * t * l);
        for i in 0..b {
            let base = self.first_block[i] * bs;
            let valid = self.valid_blocks[i] * bs;
            for q in 0..t {
                let p = self.starts[i] + q.min(self.tokens[i] - 1);
                for c in 0..l {
                    let a = base + c;
                    let in_window = match self.kind {
                        AttentionKind::Full => true,
                        AttentionKind::SlidingWindow { window } => p - a.min(p) < window as usize,
                    };
                    mask.push(c < valid && a <= p && in_window);
                }
            }
        }
        // Each dimension was checked to fit an i32 when the layout was built.
        Array::from_slice(&mask, &[b as i32, 1, t as i32, l as i32])
    }

    pub(crate) fn max_block(&self) -> u32 {
        self.max_block
    }

    pub(crate) fn write_indices(&self) -> (&Array, &Array, Option<&Array>) {
        (
            &self.write_blocks,
            &self.write_offsets,
            self.write_select.as_ref(),
        )
    }

    pub(crate) fn read_blocks(&self) -> &Array {
        &self.read_blocks
    }
}

pub(crate) fn to_i32(x: usize) -> Result<i32, StorageError> {
    i32::try_from(x).map_err(|_| StorageError::TooLarge(x))
}
