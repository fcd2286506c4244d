//! Compiled prefill: the forward of a group of prompt chunks traced once per
//! `(rows, tokens, table width)` bucket with `mx.compile` and replayed by MLX
//! instead of rebuilt op by op on the host. On a GPU an op-by-op prefill of a
//! short chunk is host time (~700 graph ops built and encoded, a few ms) for
//! little device work, and a step that carries one also waits for it; a
//! prompt joining decoding rows (a light tenant's request, a new stream's
//! prompt, each chunk of a long prompt cut to the ITL target) is such a step.
//!
//! Like a compiled decode step ([`crate::compiled_decode`]), everything that
//! changes from step to step is an input: the tokens (rows right-padded to
//! the bucket's length, padding rows added to its row count), the block and
//! offset each token's K/V goes to (padding tokens write the null block,
//! which nothing reads), each row's last real position, and the K/V pool
//! arrays, which come back written and replace the storage's. Two traces:
//! - **fresh** (every row starts at position 0): attention is the rows' own
//!   K/V under the causal mask, as an op-by-op step of fresh rows attends
//!   (a real query sees no padding key, all of which come after it);
//! - **deep** (rows with context in the pool: a cached prefix, a long
//!   prompt's later chunk): also each row's start (its RoPE offset) and its
//!   block table, padded with the null block to a table width (a power of
//!   two of blocks or one and a half times one);
//!   each layer gathers the table's K/V after writing and attends where key
//!   `j <= start + i`, as a gathering op-by-op step does.
//!
//! Rows with adapters, or past [`MAX_ROW_TOKENS`] / [`MAX_BUCKET_TOKENS`] /
//! [`MAX_TABLE_BLOCKS`], run op by op, where the host's graph is small
//! beside the device's work.
//!
//! Transactional like any other step: the pool slots it writes belong to the
//! step the scheduler's pool commits or rolls back.

use std::cell::Cell;
use std::collections::BTreeSet;
use std::rc::Rc;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array};
use weft_kv_pool::RowBlocks;

use crate::compiled_decode::{
    read_traced, run_traced, write_traced, Traced, TracedCall, TracedWrite,
};
use crate::error::{ModelError, Result};
use crate::kv::{LayerKv, PagedKv, TracedAttention};
use crate::llama::LlamaModel;
use weft_kv_pool::storage::AffineQuant;

/// Inputs before the pool arrays: tokens, write block, write offset, last
/// position; a deep trace's also start and block table.
const FRESH_INPUTS: usize = 4;
const DEEP_INPUTS: usize = 6;

/// Fewest tokens per row of a bucket (shorter rows are padded to it).
const MIN_ROW_TOKENS: usize = 16;

/// Row lengths of buckets are powers of two up to this, then its multiples.
pub const FINE_ROW_TOKENS: usize = 64;

/// Most tokens per row of a compiled prefill (a bucket's length).
pub const MAX_ROW_TOKENS: usize = 512;

/// Most tokens of a compiled prefill's bucket, rows times length: past it the
/// device's work dwarfs the host's graph, and a bucket's padding costs more
/// than the op-by-op build it saves.
pub const MAX_BUCKET_TOKENS: usize = 1024;

/// Narrowest block table of a deep bucket (fewer widths, fewer traces).
const MIN_TABLE_BLOCKS: usize = 8;

/// Widest block table of a deep bucket: deeper chunks run op by op (the
/// gather reads the whole padded table, up to twice a row's context).
pub const MAX_TABLE_BLOCKS: usize = 1024;

/// The compiled prefill forwards of one model over one KV storage.
pub struct CompiledPrefill {
    fresh: Traced,
    deep: Traced,
    traces: Rc<Cell<u64>>,
    /// `(rows, tokens, table width)` buckets called so far (width 0: fresh).
    buckets: BTreeSet<(i32, i32, i32)>,
    block_size: usize,
    null_block: u32,
    /// K/V pool arrays per step (two per layer, six when quantized).
    pools: usize,
}

impl CompiledPrefill {
    /// Compiles `model`'s prefill forwards over `kv`'s storage (one
    /// full-attention group, as [`PagedKv::compilable`] says).
    pub fn new(model: Rc<LlamaModel>, kv: &PagedKv) -> Self {
        let traces = Rc::new(Cell::new(0u64));
        let attention = kv.traced_attention();
        let quant = kv.shape().quant;
        let per_layer = kv.pool_arrays_per_layer();
        let pools = per_layer * model.num_layers();
        let block_size = kv.block_size() as i32;
        let trace = |deep: bool| -> Traced {
            let counter = traces.clone();
            let model = model.clone();
            let fixed = if deep { DEEP_INPUTS } else { FRESH_INPUTS };
            let body = move |args: &[Array]| -> std::result::Result<Vec<Array>, Exception> {
                counter.set(counter.get() + 1);
                crate::llama::count_trace();
                let fail = |e: ModelError| Exception::custom(e.to_string());
                if args.len() != fixed + pools {
                    return Err(Exception::custom("compiled prefill: wrong input count"));
                }
                let (b, t) = (args[0].dim(0), args[0].dim(1));
                let mut kv = TracedChunk {
                    start: if deep {
                        args[4].clone()
                    } else {
                        Array::from_slice(&vec![0i32; b as usize], &[b])
                    },
                    table: deep.then(|| args[5].clone()),
                    block: args[1].clone(),
                    offset: args[2].clone(),
                    last: args[3].clone(),
                    pools: args[fixed..].to_vec(),
                    per_layer,
                    quant,
                    attention,
                    block_size,
                    b,
                    t,
                };
                let logits = model
                    .forward_kv(&args[0], &mut kv, true, None)
                    .map_err(fail)?;
                let mut out = Vec::with_capacity(1 + kv.pools.len());
                out.push(logits);
                out.append(&mut kv.pools);
                Ok(out)
            };
            Box::new(mlx_rs::transforms::compile::compile(body, false))
        };
        Self {
            fresh: trace(false),
            deep: trace(true),
            traces: traces.clone(),
            buckets: BTreeSet::new(),
            block_size: kv.block_size() as usize,
            null_block: kv.null_block(),
            pools,
        }
    }

    /// The length a row of `tokens` tokens is padded to in a bucket, or
    /// `None` past [`MAX_ROW_TOKENS`]: a power of two up to
    /// [`FINE_ROW_TOKENS`] (where a step is the host's graph more than the
    /// device's work), then a multiple of it (a chunk cut to the ITL target
    /// pays for at most 63 tokens it does not carry).
    pub fn row_bucket(tokens: usize) -> Option<usize> {
        let t = tokens.max(MIN_ROW_TOKENS);
        let t = if t <= FINE_ROW_TOKENS {
            t.next_power_of_two()
        } else {
            t.div_ceil(FINE_ROW_TOKENS) * FINE_ROW_TOKENS
        };
        (tokens > 0 && t <= MAX_ROW_TOKENS).then_some(t)
    }

    /// Every row length a bucket has, shortest first.
    fn row_lengths() -> impl Iterator<Item = usize> {
        (0..)
            .map(|i| MIN_ROW_TOKENS << i)
            .take_while(|&t| t <= FINE_ROW_TOKENS)
            .chain(
                (2..)
                    .map(|k| k * FINE_ROW_TOKENS)
                    .take_while(|&t| t <= MAX_ROW_TOKENS),
            )
    }

    /// The `(rows, tokens, table width)` bucket of a group of `rows` rows of
    /// at most `tokens` tokens each whose tables need at most `blocks`
    /// blocks (0: every row starts fresh, no table), or `None` past the
    /// compiled sizes. Rows are powers of two; widths as
    /// [`table_width`](Self::table_width); lengths as
    /// [`row_bucket`](Self::row_bucket).
    pub fn bucket(rows: usize, tokens: usize, blocks: usize) -> Option<(usize, usize, usize)> {
        let t = Self::row_bucket(tokens)?;
        let b = rows.next_power_of_two();
        let w = match blocks {
            0 => 0,
            n => Self::table_width(n),
        };
        (rows > 0 && b * t <= MAX_BUCKET_TOKENS && w <= MAX_TABLE_BLOCKS).then_some((b, t, w))
    }

    /// The table width a deep row needing `blocks` blocks is padded to: the
    /// narrowest of [`table_widths`](Self::table_widths) that holds it (past
    /// [`MAX_TABLE_BLOCKS`], the next power of two, which no bucket has).
    pub fn table_width(blocks: usize) -> usize {
        Self::table_widths()
            .find(|&w| w >= blocks)
            .unwrap_or_else(|| blocks.next_power_of_two())
    }

    /// Every table width a deep bucket has, narrowest first: powers of two and
    /// one and a half times them, from [`MIN_TABLE_BLOCKS`] to
    /// [`MAX_TABLE_BLOCKS`]. A deep chunk's attention reads and scores every
    /// key slot of its width, so its cost is the width's, not the row's
    /// context: powers of two alone padded a row to up to twice its context
    /// (a 4610-token row scored 8192 keys), half steps to at most 1.5 times.
    pub fn table_widths() -> impl Iterator<Item = usize> {
        (0..)
            .map(|i| MIN_TABLE_BLOCKS << i)
            .flat_map(|w| [w, w + w / 2])
            .take_while(|&w| w <= MAX_TABLE_BLOCKS)
    }

    /// The bucket of a group of rows, each `(start, tokens)`: its rows, its
    /// longest row, and the table blocks its deepest row needs (none when
    /// every row starts fresh), or `None` past the compiled sizes.
    pub fn bucket_of(
        rows: impl Iterator<Item = (usize, usize)> + Clone,
        block_size: usize,
    ) -> Option<(usize, usize, usize)> {
        let bs = block_size.max(1);
        let n = rows.clone().count();
        let longest = rows.clone().map(|(_, t)| t).max().unwrap_or(0);
        let blocks = if rows.clone().all(|(start, _)| start == 0) {
            0
        } else {
            rows.map(|(start, t)| (start + t).div_ceil(bs))
                .max()
                .unwrap_or(1)
        };
        Self::bucket(n, longest, blocks)
    }

    /// Every fresh bucket, and the deep ones of one row with tables up to
    /// `context` tokens: what [`BatchRunner::warm_prefill`] traces.
    ///
    /// [`BatchRunner::warm_prefill`]: crate::runner::BatchRunner::warm_prefill
    pub fn warm_buckets(context: usize, block_size: usize) -> Vec<(usize, usize, usize)> {
        let mut out = Vec::new();
        let top = Self::table_width(context.div_ceil(block_size.max(1)));
        for t in Self::row_lengths() {
            let mut b = 1;
            while b * t <= MAX_BUCKET_TOKENS {
                out.push((b, t, 0));
                b *= 2;
            }
            for w in Self::table_widths().take_while(|&w| w <= top) {
                out.push((1, t, w));
            }
        }
        out
    }

    /// Traces so far (one per bucket first met, more means a retrace).
    pub fn traces(&self) -> u64 {
        self.traces.get()
    }

    /// `(rows, tokens, table width)` buckets run so far (width 0: fresh).
    pub fn buckets(&self) -> &BTreeSet<(i32, i32, i32)> {
        &self.buckets
    }

    /// Builds the prefill of `rows` (each its block table, its start and its
    /// chunk's tokens): writes every token's K/V (the storage's pool arrays
    /// are replaced by the written ones) and returns each row's last-token
    /// logits `[rows, 1, vocab]`, unevaluated.
    pub fn step(&mut self, kv: &PagedKv, rows: &[(&RowBlocks, usize, &[u32])]) -> Result<Array> {
        let n = rows.len();
        let bs = self.block_size;
        let shape = rows.iter().map(|(_, start, t)| (*start, t.len()));
        let (b, t, w) = Self::bucket_of(shape.clone(), bs).ok_or_else(|| {
            let longest = shape.clone().map(|(_, t)| t).max().unwrap_or(0);
            ModelError::Invalid(format!(
                "compiled prefill: {n} rows of up to {longest} tokens are past its buckets"
            ))
        })?;
        let mut batch = self.padding(b, t, w);
        for (i, (table, start, tokens)) in rows.iter().enumerate() {
            let need = (start + tokens.len()).div_ceil(bs);
            if table.offset != 0 || table.blocks.len() < need || tokens.is_empty() {
                return Err(ModelError::Invalid(format!(
                    "compiled prefill: a row of {} tokens at {start} has {} blocks from {}",
                    tokens.len(),
                    table.blocks.len(),
                    table.offset
                )));
            }
            for (p, &tok) in tokens.iter().enumerate() {
                let pos = start + p;
                batch.tokens[i * t + p] = tok as i32;
                batch.block[i * t + p] = table.blocks[pos / bs] as i32;
                batch.offset[i * t + p] = (pos % bs) as i32;
            }
            batch.last[i] = tokens.len() as i32 - 1;
            batch.start[i] = *start as i32;
            if w > 0 {
                // `need <= w`: the bucket's width covers the deepest row.
                batch.table[i * w..i * w + need].copy_from_slice(
                    &table.blocks[..need]
                        .iter()
                        .map(|&x| x as i32)
                        .collect::<Vec<_>>(),
                );
            }
        }
        let logits = self.run(kv, batch, (b, t, w))?;
        Ok(if b > n {
            logits.try_index(..n as i32)?
        } else {
            logits
        })
    }

    /// Traces (and runs, evaluated) the `(rows, tokens, width)` bucket with
    /// rows that read and write only the null block, so serving does not pay
    /// the trace later. Returns whether this traced a new bucket.
    pub fn warm(&mut self, kv: &PagedKv, bucket: (usize, usize, usize)) -> Result<bool> {
        let (rows, tokens, width) = bucket;
        if Self::bucket(rows, tokens, width) != Some(bucket) {
            return Err(ModelError::Invalid(format!(
                "compiled prefill: {bucket:?} is not a bucket"
            )));
        }
        let before = self.traces();
        let batch = self.padding(rows, tokens, width);
        self.run(kv, batch, bucket)?.eval()?;
        Ok(self.traces() > before)
    }

    /// A batch of `b` rows of `t` tokens (tables of `w` blocks) that read and
    /// write only the null block.
    fn padding(&self, b: usize, t: usize, w: usize) -> Batch {
        let null = self.null_block as i32;
        Batch {
            tokens: vec![0; b * t],
            block: vec![null; b * t],
            offset: (0..b * t)
                .map(|i| ((i % t) % self.block_size) as i32)
                .collect(),
            last: vec![0; b],
            start: vec![0; b],
            table: vec![null; b * w],
        }
    }

    fn run(&mut self, kv: &PagedKv, batch: Batch, bucket: (usize, usize, usize)) -> Result<Array> {
        let (bi, ti, wi) = (bucket.0 as i32, bucket.1 as i32, bucket.2 as i32);
        let mut inputs = vec![
            Array::from_slice(&batch.tokens, &[bi, ti]),
            Array::from_slice(&batch.block, &[bi * ti]),
            Array::from_slice(&batch.offset, &[bi * ti]),
            Array::from_slice(&batch.last, &[bi, 1, 1]),
        ];
        if wi > 0 {
            inputs.push(Array::from_slice(&batch.start, &[bi]));
            inputs.push(Array::from_slice(&batch.table, &[bi, wi]));
        }
        let f = if wi > 0 {
            &mut self.deep
        } else {
            &mut self.fresh
        };
        let logits = run_traced(
            f,
            kv,
            TracedCall {
                inputs,
                pools: self.pools,
                extra: Vec::new(),
                what: "compiled prefill",
            },
        )?;
        self.buckets.insert((bi, ti, wi));
        Ok(logits)
    }
}

/// A bucket's host inputs.
struct Batch {
    tokens: Vec<i32>,
    block: Vec<i32>,
    offset: Vec<i32>,
    last: Vec<i32>,
    start: Vec<i32>,
    table: Vec<i32>,
}

/// The KV view a traced prefill runs against.
struct TracedChunk {
    /// `[B]` each row's first position (its RoPE offset): zeros when fresh.
    start: Array,
    /// `[B, W]` each row's block table (deep traces only).
    table: Option<Array>,
    /// `[B * T]` block and offset of each token's K/V.
    block: Array,
    offset: Array,
    /// `[B, 1, 1]` each row's last real position.
    last: Array,
    /// Every layer's pool arrays, replaced by the written ones layer by layer.
    pools: Vec<Array>,
    per_layer: usize,
    quant: Option<AffineQuant>,
    attention: TracedAttention,
    block_size: i32,
    b: i32,
    t: i32,
}

impl LayerKv for TracedChunk {
    fn batch(&self) -> usize {
        self.b as usize
    }

    fn step_tokens(&self) -> i32 {
        self.t
    }

    fn offsets(&self) -> &Array {
        &self.start
    }

    fn last_index(&self) -> Option<&Array> {
        Some(&self.last)
    }

    fn attend(
        &mut self,
        layer: usize,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
    ) -> Result<Array> {
        let ks = k.shape();
        if ks.len() != 4 || ks[0] != self.b || ks[2] != self.t {
            return Err(ModelError::Invalid(format!(
                "compiled prefill: new K {ks:?} for {} rows of {} tokens",
                self.b, self.t
            )));
        }
        let (h, d) = (ks[1], ks[3]);
        let flat = |x: &Array| -> Result<Array> {
            Ok(x.transpose_axes(&[0, 2, 1, 3])?
                .reshape(&[self.b * self.t, h, d])?)
        };
        write_traced(
            &mut self.pools,
            TracedWrite {
                layer,
                per_layer: self.per_layer,
                quant: self.quant,
                block: &self.block,
                offset: &self.offset,
            },
            &flat(k)?,
            &flat(v)?,
        )?;
        let Some(table) = &self.table else {
            return self.attention.fresh(q, k, v, scale);
        };
        let at = TableRead {
            per_layer: self.per_layer,
            quant: self.quant,
            attention: self.attention,
            block_size: self.block_size,
        };
        at.attend(&self.pools, layer, table, &self.start, q, scale)
    }
}

/// How a traced forward reads a layer's pools along rows' block tables.
#[derive(Clone, Copy)]
pub(crate) struct TableRead {
    /// Pool arrays per layer: 2, or 6 when quantized.
    pub per_layer: usize,
    pub quant: Option<AffineQuant>,
    pub attention: TracedAttention,
    pub block_size: i32,
}

impl TableRead {
    /// Layer `layer`'s attention of rows' chunks `q` `[B, heads, T,
    /// head_dim]` (new K/V written in `pools`) over each row's table `[B, W]`
    /// gathered: query `i` of a row starting at `start` `[B]` sees key `j`
    /// where `j <= start + i`. `[B, heads, T, head_dim]`.
    pub(crate) fn attend(
        &self,
        pools: &[Array],
        layer: usize,
        table: &Array,
        start: &Array,
        q: &Array,
        scale: f32,
    ) -> Result<Array> {
        let (b, t) = (q.dim(0), q.dim(2));
        let (kc, vc) = read_traced(
            pools,
            self.per_layer,
            self.quant,
            layer,
            table,
            self.block_size,
        )?;
        let keys = kc.dim(2);
        let key = ops::arange::<_, i32>(0, keys, 1)?.reshape(&[1, 1, 1, keys])?;
        let query = ops::arange::<_, i32>(0, t, 1)?.reshape(&[1, 1, t, 1])?;
        let seen = ops::add(&start.reshape(&[b, 1, 1, 1])?, &query)?;
        let visible = key.le(&seen)?;
        self.attention.gathered(q, &kc, &vc, scale, &visible)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_pad_rows_and_lengths_within_the_limits() {
        assert_eq!(CompiledPrefill::bucket(1, 1, 0), Some((1, 16, 0)));
        assert_eq!(CompiledPrefill::bucket(1, 17, 0), Some((1, 32, 0)));
        assert_eq!(CompiledPrefill::bucket(3, 100, 0), Some((4, 128, 0)));
        assert_eq!(CompiledPrefill::bucket(1, 65, 0), Some((1, 128, 0)));
        assert_eq!(CompiledPrefill::bucket(1, 272, 0), Some((1, 320, 0)));
        assert_eq!(CompiledPrefill::bucket(4, 190, 0), Some((4, 192, 0)));
        assert_eq!(
            CompiledPrefill::bucket(5, 190, 0),
            None,
            "8 x 192 is past the total"
        );
        assert_eq!(CompiledPrefill::bucket(1, 512, 0), Some((1, 512, 0)));
        assert_eq!(CompiledPrefill::bucket(1, 513, 0), None);
        assert_eq!(
            CompiledPrefill::bucket(9, 100, 0),
            None,
            "16 x 128 is past the total"
        );
        assert_eq!(CompiledPrefill::bucket(0, 10, 0), None);
        // A group's bucket: its longest row, and its deepest row's blocks
        // once any row has context.
        let fresh = [(0, 100), (0, 30), (0, 7)];
        assert_eq!(
            CompiledPrefill::bucket_of(fresh.into_iter(), 16),
            Some((4, 128, 0))
        );
        let deep = [(0, 20), (80, 40)];
        assert_eq!(
            CompiledPrefill::bucket_of(deep.into_iter(), 16),
            Some((2, 64, 8))
        );
        let past = [(17000, 64), (0, 5)];
        assert_eq!(CompiledPrefill::bucket_of(past.into_iter(), 16), None);
        assert_eq!(CompiledPrefill::bucket(1, 64, 3), Some((1, 64, 8)));
        assert_eq!(CompiledPrefill::bucket(2, 64, 300), Some((2, 64, 384)));
        assert_eq!(CompiledPrefill::bucket(1, 64, 256), Some((1, 64, 256)));
        assert_eq!(CompiledPrefill::bucket(1, 64, 257), Some((1, 64, 384)));
        assert_eq!(CompiledPrefill::bucket(1, 64, 385), Some((1, 64, 512)));
        assert_eq!(CompiledPrefill::bucket(1, 64, 1024), Some((1, 64, 1024)));
        let widths: Vec<usize> = CompiledPrefill::table_widths().collect();
        assert_eq!(widths[..5], [8, 12, 16, 24, 32]);
        assert_eq!(widths.last(), Some(&MAX_TABLE_BLOCKS));
        // No width pads a row past 1.5 times its blocks (from the narrowest on).
        for n in MIN_TABLE_BLOCKS..=MAX_TABLE_BLOCKS {
            let w = CompiledPrefill::table_width(n);
            assert!(w >= n && 2 * w <= 3 * n, "{n} blocks -> {w}");
        }
        assert_eq!(
            CompiledPrefill::bucket(1, 64, 1025),
            None,
            "past the widest table"
        );
        let warm = CompiledPrefill::warm_buckets(512, 16);
        assert!(warm
            .iter()
            .all(|&(b, t, w)| CompiledPrefill::bucket(b, t, w) == Some((b, t, w))));
        let fresh = warm.iter().filter(|k| k.2 == 0).count();
        // Lengths 16, 32, 64, 128, 192, ... 512: rows up to 1024 tokens.
        assert_eq!(fresh, 7 + 6 + 5 + 4 + 3 + 3 + 2 + 2 + 2 + 2);
        // One row at widths 8, 12, 16, 24 and 32 blocks (512 tokens), every
        // length.
        assert_eq!(warm.len() - fresh, 10 * 5);
    }
}
