//! Compiled mixed steps: a step's decoding rows and a group of prompt chunks
//! (a long prompt's next chunk, new streams' prompts) in one traced forward.
//!
//! Each token of the step is one row of the forward: the decoding rows' one
//! token each, then every chunk's tokens (right-padded to the bucket's
//! length). Norms, projections and MLPs are row-wise, so they run once over
//! all of them and read each weight once for the step (the fused decode
//! kernels' layer on the GPU); each layer writes every new K/V in one scatter
//! per pool array, and only attention splits: the decoding rows through the
//! paged kernel over their tables (as a compiled decode step), the chunks'
//! tokens over their rows' gathered tables under the causal edge (as a deep
//! compiled prefill). The forward returns the decoding rows' logits and each
//! chunk's last token's.
//!
//! Without it a step carrying a chunk beside decoding rows is two forwards,
//! and on the GPU the first must be evaluated before the second is built: a
//! pool array that a kernel still in flight reads is copied whole by the next
//! write, not updated in place. That is two passes over the weights, two
//! dispatches and a host wait inside every such step (measured on an H100
//! with the 1.2B model, 8 decoding rows: 4.9 ms alone, 13.6 ms beside a
//! 16-token chunk, of which 6.2 ms waiting for the chunk's forward).
//!
//! Like the other traced steps every per-step value is an input, shapes are
//! bucketed (decode rows as the runner pads them and tables as a compiled
//! decode step's; chunks as a compiled prefill's deep buckets), and the step
//! is transactional: the slots it writes belong to the step the scheduler's
//! pool commits or rolls back.

use std::cell::Cell;
use std::collections::BTreeSet;
use std::rc::Rc;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array};
use weft_kv_pool::RowBlocks;

use crate::compiled_decode::{run_traced, Traced, TracedCall, TracedKv};
use crate::compiled_prefill::{CompiledPrefill, TableRead};
use crate::decode_kernels::DecodeKernels;
use crate::error::{ModelError, Result};
use crate::kv::{LayerKv, PagedKv};
use crate::llama::LlamaModel;

/// Fewest decoding rows of a bucket: fewer are padded to it (rows that read
/// and write only the null block), so 1 to 8 rows share one set of traces.
pub const MIN_DECODE_ROWS: usize = 8;

/// Inputs before the pool arrays: tokens, positions, write block, write
/// offset, decode table, chunk starts, chunk tables, logit rows.
const FIXED_INPUTS: usize = 8;

/// A mixed step's shape: its decoding rows (padded) and their table width
/// (the chunks' where the rows fit it, else a power of two as a compiled
/// decode step's), and its chunks' `(rows, tokens, table width)` deep
/// prefill bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct MixedBucket {
    pub decode_rows: usize,
    pub decode_width: usize,
    pub chunk_rows: usize,
    pub chunk_tokens: usize,
    pub chunk_width: usize,
}

/// The compiled mixed forward of one model over one KV storage.
pub struct CompiledMixed {
    f: Traced,
    traces: Rc<Cell<u64>>,
    buckets: BTreeSet<MixedBucket>,
    block_size: usize,
    null_block: u32,
    /// Decode tables' narrowest width: the compiled decode step's, raised by
    /// [`cover_decode`](Self::cover_decode).
    min_width: usize,
    pools: usize,
    /// Steps built (warm-up steps included).
    steps: u64,
    /// Whether a step may trace a bucket it is the first to meet; otherwise
    /// only warmed buckets run (see [`warm`](Self::warm)).
    on_demand: bool,
}

impl CompiledMixed {
    /// Compiles `model`'s mixed forward over `kv`'s storage (one
    /// full-attention group, as [`PagedKv::compilable`] says): decoding rows
    /// attend through the paged kernel where `kv` runs it (then the layers
    /// are `fused`'s where given, as a compiled decode step's), else through
    /// a gather of their tables.
    pub fn new(
        model: Rc<LlamaModel>,
        kv: &PagedKv,
        fused: Option<Rc<DecodeKernels>>,
        min_width: usize,
    ) -> Self {
        let traces = Rc::new(Cell::new(0u64));
        let kernel = kv.kernel();
        let fused = if kernel.is_some() { fused } else { None };
        let per_layer = kv.pool_arrays_per_layer();
        let pools = per_layer * model.num_layers();
        let block_size = kv.block_size() as i32;
        let read = TableRead {
            per_layer,
            quant: kv.shape().quant,
            attention: kv.traced_attention(),
            block_size,
        };
        let counter = traces.clone();
        let body = move |args: &[Array]| -> std::result::Result<Vec<Array>, Exception> {
            counter.set(counter.get() + 1);
            crate::llama::count_trace();
            let fail = |e: ModelError| Exception::custom(e.to_string());
            if args.len() != FIXED_INPUTS + pools {
                return Err(Exception::custom("compiled mixed step: wrong input count"));
            }
            let n = args[0].dim(0);
            let bd = args[4].dim(0);
            let bc = args[6].dim(0);
            if bc == 0 || (n - bd) % bc != 0 {
                return Err(Exception::custom("compiled mixed step: ragged chunks"));
            }
            let mut kv = MixedKv {
                dec: TracedKv {
                    start: args[1].try_index(..bd)?,
                    write_block: args[2].clone(),
                    write_offset: args[3].clone(),
                    table: args[4].clone(),
                    ntok: Array::from_slice(&vec![1i32; bd as usize], &[bd]),
                    pools: args[FIXED_INPUTS..].to_vec(),
                    per_layer,
                    quant: read.quant,
                    kernel: kernel.clone(),
                    fused: fused.clone(),
                    block_size,
                },
                positions: args[1].clone(),
                chunk_start: args[5].clone(),
                chunk_table: args[6].clone(),
                keep: args[7].clone(),
                read,
                bd,
                bc,
                t: (n - bd) / bc,
            };
            let logits = model
                .forward_kv(&args[0], &mut kv, false, None)
                .map_err(fail)?;
            let mut out = Vec::with_capacity(1 + kv.dec.pools.len());
            out.push(logits);
            out.append(&mut kv.dec.pools);
            Ok(out)
        };
        Self {
            f: Box::new(mlx_rs::transforms::compile::compile(body, false)),
            traces,
            buckets: BTreeSet::new(),
            block_size: kv.block_size() as usize,
            null_block: kv.null_block(),
            min_width: min_width.max(1).next_power_of_two(),
            pools,
            steps: 0,
            on_demand: false,
        }
    }

    /// Pads every step's decoding rows' tables to at least `context` tokens
    /// (a power of two of blocks): rows up to that deep then never make a
    /// bucket of their own, so warming each chunk bucket once covers them.
    /// The paged kernel walks each row only to its length; a wider table is
    /// table bytes and a few more idle splits.
    pub fn cover_decode(&mut self, context: usize) {
        let blocks = context.div_ceil(self.block_size.max(1));
        self.min_width = self.min_width.max(blocks.next_power_of_two());
    }

    /// Lets steps trace buckets no warm-up traced (the first step of each
    /// pays its trace; by default such a step runs as two forwards instead).
    pub fn trace_on_demand(mut self, on: bool) -> Self {
        self.on_demand = on;
        self
    }

    /// Whether a step of `bucket` may run mixed: traced already, or traced on
    /// demand.
    pub fn runs(&self, bucket: &MixedBucket) -> bool {
        self.on_demand || self.buckets.contains(bucket)
    }

    /// The buckets [`BatchRunner::warm_mixed`] traces: decoding rows padded
    /// to each of `decode_rows` (tables of the narrowest width) beside one
    /// chunk of every compiled prefill length over tables up to `context`
    /// tokens.
    ///
    /// [`BatchRunner::warm_mixed`]: crate::runner::BatchRunner::warm_mixed
    pub fn warm_buckets(
        &self,
        decode_rows: impl Iterator<Item = usize>,
        context: usize,
    ) -> Vec<MixedBucket> {
        let bs = self.block_size.max(1);
        let top = CompiledPrefill::table_width(context.div_ceil(bs));
        let chunks: Vec<(usize, usize)> = CompiledPrefill::warm_buckets(context, bs)
            .into_iter()
            // One chunk over a table, and a fresh one's own blocks.
            .map(|(b, t, w)| (b, t, if w == 0 { self.fresh_width(t) } else { w }))
            // (A table narrower than the chunk holds no such step.)
            .filter(|&(b, t, w)| b == 1 && w <= top && w * bs >= t)
            .map(|(_, t, w)| (t, w))
            .collect();
        self.one_chunk_buckets(decode_rows, &chunks)
    }

    /// The table width of a fresh chunk of `t` tokens: its own blocks'.
    fn fresh_width(&self, t: usize) -> usize {
        CompiledPrefill::table_width(t.div_ceil(self.block_size.max(1)))
    }

    /// Decoding rows padded to each of `decode_rows` beside one chunk of
    /// each `(tokens, table width)` of `chunks`, sorted and deduplicated.
    fn one_chunk_buckets(
        &self,
        decode_rows: impl Iterator<Item = usize>,
        chunks: &[(usize, usize)],
    ) -> Vec<MixedBucket> {
        let mut out: Vec<MixedBucket> = decode_rows
            .flat_map(|r| {
                chunks.iter().map(move |&(t, w)| MixedBucket {
                    decode_rows: r.max(MIN_DECODE_ROWS),
                    decode_width: self.min_width.max(w),
                    chunk_rows: 1,
                    chunk_tokens: t,
                    chunk_width: w,
                })
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The buckets of a short fresh prompt (one chunk of each compiled length
    /// up to `tokens`, over its own blocks' table) beside decoding rows padded
    /// to each of `decode_rows`: what [`BatchRunner::warm_mixed`] traces for
    /// batches wider than the ones it warms in full, so a new request's
    /// prompt joins a wide batch's step as one forward (not two, nor a step
    /// of its own that the batch skips).
    ///
    /// [`BatchRunner::warm_mixed`]: crate::runner::BatchRunner::warm_mixed
    pub fn fresh_buckets(
        &self,
        decode_rows: impl Iterator<Item = usize>,
        tokens: usize,
    ) -> Vec<MixedBucket> {
        let chunks: Vec<(usize, usize)> = CompiledPrefill::warm_buckets(0, self.block_size.max(1))
            .into_iter()
            .filter(|&(b, t, w)| b == 1 && w == 0 && t <= tokens)
            .map(|(_, t, _)| (t, self.fresh_width(t)))
            .collect();
        self.one_chunk_buckets(decode_rows, &chunks)
    }

    /// Traces (and runs, evaluated) `bucket` with rows that read and write
    /// only the null block. Returns whether this traced it.
    pub fn warm(&mut self, kv: &PagedKv, bucket: MixedBucket) -> Result<bool> {
        if self.buckets.contains(&bucket) {
            return Ok(false);
        }
        let before = self.traces();
        let null = RowBlocks {
            offset: 0,
            blocks: vec![self.null_block; bucket.chunk_width],
        };
        let bd = bucket.decode_rows;
        let decode: Vec<(&RowBlocks, usize)> = vec![(&null, 0); bd];
        let tokens = vec![0u32; bucket.chunk_tokens];
        // A start that makes the chunk's table the bucket's width.
        let start = (bucket.chunk_width * self.block_size).saturating_sub(bucket.chunk_tokens);
        let chunks: Vec<(&RowBlocks, usize, &[u32])> = vec![(&null, start, tokens.as_slice())];
        let shape = chunks.iter().map(|c| (c.1, c.2.len()));
        if self.bucket(decode.iter().map(|d| d.1), bd, shape) != Some(bucket) {
            return Err(ModelError::Invalid(format!(
                "compiled mixed step: {bucket:?} is not a bucket"
            )));
        }
        let zeros = Array::from_slice(&vec![0i32; bd], &[bd as i32, 1]);
        let (a, b) = self.step(kv, &zeros, &decode, &chunks)?;
        mlx_rs::transforms::eval([&a, &b])?;
        Ok(self.traces() > before)
    }

    /// The bucket of a step of `decode` rows (each `(table blocks,
    /// committed length)`, padding rows included) beside `chunks` (each
    /// `(start, tokens)`), or `None` where the chunks are past the compiled
    /// prefill's buckets.
    pub fn bucket(
        &self,
        decode: impl Iterator<Item = usize>,
        decode_rows: usize,
        chunks: impl Iterator<Item = (usize, usize)> + Clone,
    ) -> Option<MixedBucket> {
        let bs = self.block_size.max(1);
        let width = decode
            .map(|len| len / bs + 1)
            .fold(self.min_width, usize::max)
            .next_power_of_two();
        let rows = chunks.clone().count();
        let longest = chunks.clone().map(|(_, t)| t).max()?;
        let blocks = chunks
            .map(|(start, t)| (start + t).div_ceil(bs))
            .max()?
            .max(1);
        let (b, t, w) = CompiledPrefill::bucket(rows, longest, blocks)?;
        (decode_rows > 0).then_some(MixedBucket {
            decode_rows: decode_rows.max(MIN_DECODE_ROWS),
            // The chunks' width where the rows fit it (the paged kernel walks
            // each row only to its length): no dimension of its own to trace.
            decode_width: width.max(w),
            chunk_rows: b,
            chunk_tokens: t,
            chunk_width: w,
        })
    }

    /// Traces so far (one per bucket first met, more means a retrace).
    pub fn traces(&self) -> u64 {
        self.traces.get()
    }

    /// Mixed steps built so far (warm-up steps included).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Buckets stepped so far.
    pub fn buckets(&self) -> &BTreeSet<MixedBucket> {
        &self.buckets
    }

    /// Builds one mixed step: decoding rows `decode` (each its table and
    /// committed length, padding rows included) with their tokens `tokens`
    /// `[B, 1]` int32 (on the device or not), beside `chunks` (each its table,
    /// start and tokens). Writes every new token's K/V (the storage's pool
    /// arrays are replaced by the written ones) and returns the decoding
    /// rows' logits `[B, 1, vocab]` and each chunk's last token's `[chunks,
    /// 1, vocab]`, unevaluated.
    pub fn step(
        &mut self,
        kv: &PagedKv,
        tokens: &Array,
        decode: &[(&RowBlocks, usize)],
        chunks: &[(&RowBlocks, usize, &[u32])],
    ) -> Result<(Array, Array)> {
        let bs = self.block_size;
        let bd = decode.len();
        if tokens.shape() != [bd as i32, 1] {
            return Err(ModelError::Invalid(format!(
                "compiled mixed step: tokens {:?} for {bd} decoding rows",
                tokens.shape()
            )));
        }
        let shape = chunks.iter().map(|(_, start, t)| (*start, t.len()));
        let bucket = self
            .bucket(decode.iter().map(|(_, len)| *len), bd, shape)
            .ok_or_else(|| {
                ModelError::Invalid(format!(
                    "compiled mixed step: {} chunks past the compiled buckets",
                    chunks.len()
                ))
            })?;
        let MixedBucket {
            decode_rows: bdp,
            decode_width: wd,
            chunk_rows: bc,
            chunk_tokens: t,
            chunk_width: wc,
        } = bucket;
        let n = bdp + bc * t;
        let null = self.null_block as i32;
        let mut positions = Vec::with_capacity(n);
        let mut block = Vec::with_capacity(n);
        let mut offset = Vec::with_capacity(n);
        let mut table_d = Vec::with_capacity(bdp * wd);
        for (tb, len) in decode {
            let need = len / bs + 1;
            if tb.offset != 0 || tb.blocks.len() < need {
                return Err(ModelError::Invalid(format!(
                    "compiled mixed step: a decoding row at {len} tokens has {} blocks from {}",
                    tb.blocks.len(),
                    tb.offset
                )));
            }
            positions.push(*len as i32);
            block.push(tb.blocks[len / bs] as i32);
            offset.push((len % bs) as i32);
            table_d.extend(tb.blocks[..need].iter().map(|&x| x as i32));
            table_d.extend(std::iter::repeat_n(null, wd - need));
        }
        // Padding decoding rows (up to the bucket's): position 0 of the null block.
        for _ in bd..bdp {
            positions.push(0);
            block.push(null);
            offset.push(0);
            table_d.extend(std::iter::repeat_n(null, wd));
        }
        // Chunk tokens: padding tokens (and padding rows) write the null
        // block, which nothing reads.
        let mut chunk_tokens = vec![0i32; bc * t];
        let mut start = vec![0i32; bc];
        let mut table_c = vec![null; bc * wc];
        let mut keep: Vec<i32> = (0..bdp as i32).collect();
        for i in 0..bc {
            let Some((tb, s, toks)) = chunks.get(i) else {
                positions.extend((0..t).map(|p| p as i32));
                block.extend(std::iter::repeat_n(null, t));
                offset.extend((0..t).map(|p| (p % bs) as i32));
                keep.push((bdp + i * t) as i32);
                continue;
            };
            let need = (s + toks.len()).div_ceil(bs);
            if tb.offset != 0 || tb.blocks.len() < need || toks.is_empty() {
                return Err(ModelError::Invalid(format!(
                    "compiled mixed step: a chunk of {} tokens at {s} has {} blocks from {}",
                    toks.len(),
                    tb.blocks.len(),
                    tb.offset
                )));
            }
            for p in 0..t {
                let pos = s + p;
                positions.push(pos as i32);
                if let Some(&tok) = toks.get(p) {
                    chunk_tokens[i * t + p] = tok as i32;
                    block.push(tb.blocks[pos / bs] as i32);
                    offset.push((pos % bs) as i32);
                } else {
                    block.push(null);
                    offset.push((p % bs) as i32);
                }
            }
            start[i] = *s as i32;
            table_c[i * wc..i * wc + need].copy_from_slice(
                &tb.blocks[..need]
                    .iter()
                    .map(|&x| x as i32)
                    .collect::<Vec<_>>(),
            );
            keep.push((bdp + i * t + toks.len() - 1) as i32);
        }
        let (ni, bdi, bpi) = (n as i32, bd as i32, bdp as i32);
        let (bci, wdi, wci) = (bc as i32, wd as i32, wc as i32);
        // The decoding rows' tokens (maybe on the device), then the padding
        // rows' and the chunks' from the host.
        let mut host = vec![0i32; bdp - bd];
        host.extend_from_slice(&chunk_tokens);
        let all_tokens = ops::concatenate(
            &[
                tokens.as_dtype(mlx_rs::Dtype::Int32)?.reshape(&[bdi])?,
                Array::from_slice(&host, &[host.len() as i32]),
            ],
            0,
        )?
        .reshape(&[ni, 1])?;
        let inputs = vec![
            all_tokens,
            Array::from_slice(&positions, &[ni]),
            Array::from_slice(&block, &[ni]),
            Array::from_slice(&offset, &[ni]),
            Array::from_slice(&table_d, &[bpi, wdi]),
            Array::from_slice(&start, &[bci]),
            Array::from_slice(&table_c, &[bci, wci]),
            Array::from_slice(&keep, &[bpi + bci]),
        ];
        let logits = run_traced(
            &mut self.f,
            kv,
            TracedCall {
                inputs,
                pools: self.pools,
                extra: Vec::new(),
                what: "compiled mixed step",
            },
        )?;
        self.buckets.insert(bucket);
        self.steps += 1;
        let rows = chunks.len() as i32;
        Ok((logits.try_index(..bdi)?, logits.try_index(bpi..bpi + rows)?))
    }
}

/// The KV view a traced mixed forward runs against: rows `..bd` decode one
/// token each, the rest are `bc` chunks of `t` tokens, one token a row.
struct MixedKv {
    /// The decoding rows' view; it also writes every token of the step.
    dec: TracedKv,
    /// `[N]` each token's position (its RoPE offset).
    positions: Array,
    /// `[Bc]` each chunk's first position, `[Bc, W]` its row's table.
    chunk_start: Array,
    chunk_table: Array,
    /// `[Bd + Bc]` the rows whose logits come out.
    keep: Array,
    read: TableRead,
    bd: i32,
    bc: i32,
    t: i32,
}

impl MixedKv {
    fn n(&self) -> i32 {
        self.bd + self.bc * self.t
    }

    /// The chunks' attention: their tokens' queries `q` `[Bc * T, heads, 1,
    /// head_dim]` as `[Bc * T, heads, 1, head_dim]`.
    fn chunks(&self, layer: usize, q: &Array, scale: f32) -> Result<Array> {
        let (h, d) = (q.dim(1), q.dim(3));
        let q = q
            .reshape(&[self.bc, self.t, h, d])?
            .transpose_axes(&[0, 2, 1, 3])?;
        let o = self.read.attend(
            &self.dec.pools,
            layer,
            &self.chunk_table,
            &self.chunk_start,
            &q,
            scale,
        )?;
        Ok(o.transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[self.bc * self.t, h, 1, d])?)
    }

    fn check(&self, q: &Array) -> Result<()> {
        let s = q.shape();
        if s.len() != 4 || s[0] != self.n() || s[2] != 1 {
            return Err(ModelError::Invalid(format!(
                "compiled mixed step: queries {s:?} for {} one-token rows",
                self.n()
            )));
        }
        Ok(())
    }
}

impl LayerKv for MixedKv {
    fn batch(&self) -> usize {
        self.n() as usize
    }

    fn step_tokens(&self) -> i32 {
        1
    }

    fn offsets(&self) -> &Array {
        &self.positions
    }

    fn last_index(&self) -> Option<&Array> {
        None
    }

    fn logit_rows(&self) -> Option<&Array> {
        Some(&self.keep)
    }

    fn attend(
        &mut self,
        layer: usize,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
    ) -> Result<Array> {
        self.check(q)?;
        let (h, d) = (k.dim(1), k.dim(3));
        let n = self.n();
        self.dec
            .write(layer, &k.reshape(&[n, h, d])?, &v.reshape(&[n, h, d])?)?;
        let a = self.dec.read(layer, &q.try_index(..self.bd)?, scale)?;
        let c = self.chunks(layer, &q.try_index(self.bd..)?, scale)?;
        Ok(ops::concatenate(&[a.clone(), same_dtype(c, &a)?], 0)?)
    }

    fn fused(&self) -> Option<Rc<DecodeKernels>> {
        self.dec.fused.clone()
    }

    fn attend_rows(
        &mut self,
        layer: usize,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
    ) -> Result<Array> {
        self.check(q)?;
        self.dec.write(layer, k, v)?;
        let a = self.dec.read_rows(layer, &q.try_index(..self.bd)?, scale)?;
        let c = self.chunks(layer, &q.try_index(self.bd..)?, scale)?;
        let c = c.reshape(&[self.bc * self.t, -1])?;
        Ok(ops::concatenate(&[a.clone(), same_dtype(c, &a)?], 0)?)
    }
}

/// `x` in `like`'s dtype (itself where it already is).
fn same_dtype(x: Array, like: &Array) -> Result<Array> {
    Ok(if x.dtype() == like.dtype() {
        x
    } else {
        x.as_dtype(like.dtype())?
    })
}
