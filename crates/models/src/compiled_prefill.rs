//! Compiled prefill of fresh prompts: the forward of a group of rows that all
//! start at position 0 (nothing of theirs in the pool yet), traced once per
//! `(rows, tokens)` bucket with `mx.compile` and replayed by MLX instead of
//! rebuilt op by op on the host. On a GPU an op-by-op prefill of a short
//! prompt is host time (~700 graph ops built and encoded, a few ms) for
//! little device work, and a step that carries one also waits for it; a
//! short prompt joining decoding rows (a light tenant's request, a new
//! stream's prompt, a long prompt's first chunk) is such a step.
//!
//! Like a compiled decode step ([`crate::compiled_decode`]), everything that
//! changes from step to step is an input: the tokens (rows right-padded to
//! the bucket's length, padding rows added to its row count), the block and
//! offset each token's K/V goes to (padding tokens write the null block,
//! which nothing reads), each row's last real position, and the K/V pool
//! arrays, which come back written and replace the storage's. Attention is
//! the rows' own K/V under the causal mask, as an op-by-op step of fresh rows
//! attends ([`crate::kv::fresh_causal_attention`]: a real query sees no
//! padding key, all of which come after it). Rows with a cached prefix
//! (a start past 0), adapters, or past [`MAX_ROW_TOKENS`] /
//! [`MAX_BUCKET_TOKENS`] run op by op, where the host's graph is small
//! beside the device's work.
//!
//! Transactional like any other step: the pool slots it writes belong to the
//! step the scheduler's pool commits or rolls back.

use std::cell::Cell;
use std::collections::BTreeSet;
use std::rc::Rc;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::Array;
use weft_kv_pool::RowBlocks;

use crate::compiled_decode::{write_traced, TracedWrite};
use crate::error::{ModelError, Result};
use crate::kv::{fresh_causal_attention, FreshAttention, LayerKv, PagedKv};
use crate::llama::LlamaModel;
use weft_kv_pool::storage::AffineQuant;

type Traced = Box<dyn FnMut(&[Array]) -> std::result::Result<Vec<Array>, Exception>>;

/// Inputs before the pool arrays: tokens, write block, write offset, last
/// position.
const FIXED_INPUTS: usize = 4;

/// Fewest tokens per row of a bucket (shorter rows are padded to it).
const MIN_ROW_TOKENS: usize = 16;

/// Most tokens per row of a compiled prefill (a bucket's length).
pub const MAX_ROW_TOKENS: usize = 512;

/// Most tokens of a compiled prefill's bucket, rows times length: past it the
/// device's work dwarfs the host's graph, and a bucket's padding costs more
/// than the op-by-op build it saves.
pub const MAX_BUCKET_TOKENS: usize = 1024;

/// The compiled prefill forward of one model over one KV storage.
pub struct CompiledPrefill {
    f: Traced,
    traces: Rc<Cell<u64>>,
    /// `(rows, tokens)` buckets called so far.
    buckets: BTreeSet<(i32, i32)>,
    block_size: usize,
    null_block: u32,
    /// K/V pool arrays per step (two per layer, six when quantized).
    pools: usize,
}

impl CompiledPrefill {
    /// Compiles `model`'s forward of fresh rows over `kv`'s storage (one
    /// full-attention group, as [`PagedKv::compilable`] says).
    pub fn new(model: Rc<LlamaModel>, kv: &PagedKv) -> Self {
        let traces = Rc::new(Cell::new(0u64));
        let counter = traces.clone();
        let fresh = kv.fresh_attention();
        let quant = kv.shape().quant;
        let per_layer = kv.pool_arrays_per_layer();
        let pools = per_layer * model.num_layers();
        let body = move |args: &[Array]| -> std::result::Result<Vec<Array>, Exception> {
            counter.set(counter.get() + 1);
            crate::llama::count_trace();
            let fail = |e: ModelError| Exception::custom(e.to_string());
            if args.len() != FIXED_INPUTS + pools {
                return Err(Exception::custom("compiled prefill: wrong input count"));
            }
            let (b, t) = (args[0].dim(0), args[0].dim(1));
            let mut kv = TracedFresh {
                offsets: Array::from_slice(&vec![0i32; b as usize], &[b]),
                block: args[1].clone(),
                offset: args[2].clone(),
                last: args[3].clone(),
                pools: args[FIXED_INPUTS..].to_vec(),
                per_layer,
                quant,
                fresh,
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
        let f = mlx_rs::transforms::compile::compile(body, false);
        Self {
            f: Box::new(f),
            traces,
            buckets: BTreeSet::new(),
            block_size: kv.block_size() as usize,
            null_block: kv.null_block(),
            pools,
        }
    }

    /// The `(rows, tokens)` bucket a group of `rows` fresh rows of at most
    /// `tokens` tokens each runs in (powers of two, at least
    /// [`MIN_ROW_TOKENS`] long), or `None` past the compiled sizes.
    pub fn bucket(rows: usize, tokens: usize) -> Option<(usize, usize)> {
        let t = Self::row_bucket(tokens)?;
        let b = rows.next_power_of_two();
        (rows > 0 && b * t <= MAX_BUCKET_TOKENS).then_some((b, t))
    }

    /// The length a row of `tokens` tokens is padded to in a bucket, or
    /// `None` past [`MAX_ROW_TOKENS`].
    pub fn row_bucket(tokens: usize) -> Option<usize> {
        let t = tokens.max(MIN_ROW_TOKENS).next_power_of_two();
        (tokens > 0 && t <= MAX_ROW_TOKENS).then_some(t)
    }

    /// Every bucket, for warming them all.
    pub fn all_buckets() -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut t = MIN_ROW_TOKENS;
        while t <= MAX_ROW_TOKENS {
            let mut b = 1;
            while b * t <= MAX_BUCKET_TOKENS {
                out.push((b, t));
                b *= 2;
            }
            t *= 2;
        }
        out
    }

    /// Traces so far (one per bucket first met, more means a retrace).
    pub fn traces(&self) -> u64 {
        self.traces.get()
    }

    /// `(rows, tokens)` buckets run so far.
    pub fn buckets(&self) -> &BTreeSet<(i32, i32)> {
        &self.buckets
    }

    /// Builds the prefill of `rows` (each its block table and its prompt
    /// tokens, every row starting at position 0): writes every token's K/V
    /// (the storage's pool arrays are replaced by the written ones) and
    /// returns each row's last-token logits `[rows, 1, vocab]`, unevaluated.
    pub fn step(&mut self, kv: &PagedKv, rows: &[(&RowBlocks, &[u32])]) -> Result<Array> {
        let n = rows.len();
        let longest = rows.iter().map(|(_, t)| t.len()).max().unwrap_or(0);
        let (b, t) = Self::bucket(n, longest).ok_or_else(|| {
            ModelError::Invalid(format!(
                "compiled prefill: {n} rows of up to {longest} tokens are past its buckets"
            ))
        })?;
        let mut batch = self.padding(b, t);
        let bs = self.block_size;
        for (i, (table, tokens)) in rows.iter().enumerate() {
            if table.offset != 0 || table.blocks.len() * bs < tokens.len() || tokens.is_empty() {
                return Err(ModelError::Invalid(format!(
                    "compiled prefill: a fresh row of {} tokens has {} blocks from {}",
                    tokens.len(),
                    table.blocks.len(),
                    table.offset
                )));
            }
            for (p, &tok) in tokens.iter().enumerate() {
                batch.tokens[i * t + p] = tok as i32;
                batch.block[i * t + p] = table.blocks[p / bs] as i32;
            }
            batch.last[i] = tokens.len() as i32 - 1;
        }
        let logits = self.run(kv, batch, b, t)?;
        Ok(if b > n {
            logits.try_index(..n as i32)?
        } else {
            logits
        })
    }

    /// Traces (and runs, evaluated) the `(rows, tokens)` bucket with rows
    /// that write only the null block, so serving does not pay the trace
    /// later. Returns whether this traced a new bucket.
    pub fn warm(&mut self, kv: &PagedKv, rows: usize, tokens: usize) -> Result<bool> {
        let before = self.traces();
        let (b, t) = Self::bucket(rows, tokens).ok_or_else(|| {
            ModelError::Invalid(format!(
                "compiled prefill: no bucket of {rows} rows x {tokens} tokens"
            ))
        })?;
        let batch = self.padding(b, t);
        self.run(kv, batch, b, t)?.eval()?;
        Ok(self.traces() > before)
    }

    /// A batch of `b` rows of `t` tokens that write only the null block.
    fn padding(&self, b: usize, t: usize) -> Batch {
        Batch {
            tokens: vec![0; b * t],
            block: vec![self.null_block as i32; b * t],
            offset: (0..b * t)
                .map(|i| ((i % t) % self.block_size) as i32)
                .collect(),
            last: vec![0; b],
        }
    }

    fn run(&mut self, kv: &PagedKv, batch: Batch, b: usize, t: usize) -> Result<Array> {
        let (bi, ti) = (b as i32, t as i32);
        let mut inputs = vec![
            Array::from_slice(&batch.tokens, &[bi, ti]),
            Array::from_slice(&batch.block, &[bi * ti]),
            Array::from_slice(&batch.offset, &[bi * ti]),
            Array::from_slice(&batch.last, &[bi, 1, 1]),
        ];
        let pools = kv.pool_arrays()?;
        if pools.len() != self.pools {
            return Err(ModelError::Invalid(format!(
                "compiled prefill: {} pool arrays for {} expected",
                pools.len(),
                self.pools
            )));
        }
        inputs.extend(pools);
        let mut out = (self.f)(&inputs)?;
        // The old pools' only references are now the written ones' graph.
        drop(inputs);
        if out.is_empty() {
            return Err(ModelError::Invalid(
                "compiled prefill returned nothing".into(),
            ));
        }
        let pools = out.split_off(1);
        kv.replace_pools(pools)?;
        self.buckets.insert((bi, ti));
        out.pop()
            .ok_or_else(|| ModelError::Invalid("compiled prefill returned no logits".into()))
    }
}

/// A bucket's host inputs.
struct Batch {
    tokens: Vec<i32>,
    block: Vec<i32>,
    offset: Vec<i32>,
    last: Vec<i32>,
}

/// The KV view a traced prefill of fresh rows runs against.
struct TracedFresh {
    /// `[B]` zeros: every row's RoPE starts at position 0.
    offsets: Array,
    /// `[B * T]` block and offset of each token's K/V.
    block: Array,
    offset: Array,
    /// `[B, 1, 1]` each row's last real position.
    last: Array,
    /// Every layer's pool arrays, replaced by the written ones layer by layer.
    pools: Vec<Array>,
    per_layer: usize,
    quant: Option<AffineQuant>,
    fresh: FreshAttention,
    b: i32,
    t: i32,
}

impl LayerKv for TracedFresh {
    fn batch(&self) -> usize {
        self.b as usize
    }

    fn step_tokens(&self) -> i32 {
        self.t
    }

    fn offsets(&self) -> &Array {
        &self.offsets
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
        fresh_causal_attention(&self.fresh, q, k, v, scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_within_the_limits() {
        assert_eq!(CompiledPrefill::bucket(1, 1), Some((1, 16)));
        assert_eq!(CompiledPrefill::bucket(1, 17), Some((1, 32)));
        assert_eq!(CompiledPrefill::bucket(3, 100), Some((4, 128)));
        assert_eq!(CompiledPrefill::bucket(1, 512), Some((1, 512)));
        assert_eq!(CompiledPrefill::bucket(1, 513), None);
        assert_eq!(
            CompiledPrefill::bucket(9, 100),
            None,
            "16 x 128 is past the total"
        );
        assert_eq!(CompiledPrefill::bucket(0, 10), None);
        let all = CompiledPrefill::all_buckets();
        assert!(all
            .iter()
            .all(|&(b, t)| CompiledPrefill::bucket(b, t) == Some((b, t))));
        assert_eq!(all.len(), 7 + 6 + 5 + 4 + 3 + 2);
    }
}
