//! Compiled decode steps: the whole forward of a plain decode step (every
//! row one token) traced once per shape bucket with `mx.compile`, then
//! replayed by MLX instead of rebuilt op by op on the host.
//!
//! Everything that changes from step to step is an array input: the token
//! ids, each row's committed length (its RoPE offset and attention length),
//! the block and offset its new K/V go to, its block table, and the K/V pool
//! arrays themselves, which come back written as outputs and replace the
//! storage's (so each write still updates the pool in place). The weights are
//! constants of the trace; LoRA adapters are not: with an adapter pool, a
//! step with adapter rows also takes each row's slot and the pool's stacked
//! adapter arrays as inputs ([`crate::lora`]), so loading or swapping an
//! adapter changes inputs, never the trace. Shapes are bucketed so a changing batch meets few
//! traces: rows are padded by the runner (`decode_bucket`, padding rows read
//! and write only the null block) and block tables to a power of two of
//! blocks (padded with the null block, never read: attention stops at each
//! row's length). Each new bucket is one trace, counted in
//! [`CompiledDecode::traces`] and in the process's `compile_traces`.
//!
//! A compiled step is transactional like any other: nothing is staged; the
//! pool slots it writes belong to the step the scheduler's pool commits or
//! rolls back, and a failure before evaluation leaves the written-pool
//! outputs unevaluated (dead data once rolled back).

use std::cell::Cell;
use std::collections::BTreeSet;
use std::rc::Rc;

use mlx_rs::error::Exception;
use mlx_rs::fast;
use mlx_rs::{ops, Array};
use weft_kv_pool::RowBlocks;

use crate::decode_kernels::DecodeKernels;
use crate::error::{ModelError, Result};
use crate::kv::{storage_err, LayerKv, PagedKv};
use crate::llama::LlamaModel;
use crate::lora::{Layout, LoraStep};
use crate::paged_attention::{PagedAttention, Pools};
use weft_kv_pool::storage::AffineQuant;

/// A traced step: its inputs in, its logits then the written pools out.
pub(crate) type Traced = Box<dyn FnMut(&[Array]) -> std::result::Result<Vec<Array>, Exception>>;

/// Inputs before the pool arrays: tokens, start, write block, write offset,
/// block table, tokens per row.
const FIXED_INPUTS: usize = 6;

/// The compiled decode forward of one model over one KV storage.
pub struct CompiledDecode {
    f: Traced,
    traces: Rc<Cell<u64>>,
    /// `(rows, table width)` buckets called so far.
    buckets: BTreeSet<(i32, i32)>,
    block_size: usize,
    null_block: u32,
    min_width: usize,
    /// K/V pool arrays per step (two per layer, six when quantized).
    pools: usize,
}

impl CompiledDecode {
    /// Compiles `model`'s decode forward over `kv`'s storage: attention by
    /// the paged kernel where `kv` runs it, else by a gather of each row's
    /// table and MLX's attention (any device). `fused` (GPU only: where the
    /// paged kernel runs) makes the trace's layers the fused decode kernels'
    /// ([`crate::decode_kernels`]) for models whose layers allow it.
    ///
    /// Tables are at least `min_width` blocks wide: every row of up to that
    /// many blocks shares one table width, so a batch's rows growing meet
    /// no new trace until one passes it (then widths double).
    ///
    /// `lora`: the layout of the runner's adapter pool, whose arrays steps
    /// with adapter rows pass after the K/V pools (a step without adapter
    /// rows passes none and traces the plain forward).
    pub fn new(
        model: Rc<LlamaModel>,
        kv: &PagedKv,
        fused: Option<Rc<DecodeKernels>>,
        min_width: usize,
        lora: Option<Layout>,
    ) -> Self {
        let traces = Rc::new(Cell::new(0u64));
        let kernel = kv.kernel();
        let fused = if kernel.is_some() { fused } else { None };
        let block_size = kv.block_size() as usize;
        let counter = traces.clone();
        let quant = kv.shape().quant;
        let per_layer = kv.pool_arrays_per_layer();
        let pools = per_layer * model.num_layers();
        let body = move |args: &[Array]| -> std::result::Result<Vec<Array>, Exception> {
            counter.set(counter.get() + 1);
            crate::llama::count_trace();
            let fail = |e: ModelError| Exception::custom(e.to_string());
            let pools_end = FIXED_INPUTS + pools;
            if args.len() < pools_end {
                return Err(Exception::custom("compiled decode: too few inputs"));
            }
            let adapters: Option<LoraStep> = if args.len() > pools_end {
                let layout = lora.as_ref().ok_or_else(|| {
                    Exception::custom("compiled decode: adapter inputs without a pool")
                })?;
                Some(
                    layout
                        .step(args[pools_end].clone(), &args[pools_end + 1..])
                        .map_err(fail)?,
                )
            } else {
                None
            };
            let mut kv = TracedKv {
                start: args[1].clone(),
                write_block: args[2].clone(),
                write_offset: args[3].clone(),
                table: args[4].clone(),
                ntok: args[5].clone(),
                pools: args[FIXED_INPUTS..pools_end].to_vec(),
                per_layer,
                quant,
                kernel: kernel.clone(),
                fused: fused.clone(),
                block_size: block_size as i32,
            };
            let logits = model
                .forward_kv(&args[0], &mut kv, true, adapters.as_ref())
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
            block_size,
            null_block: kv.null_block(),
            min_width: min_width.max(1).next_power_of_two(),
            pools,
        }
    }

    /// The narrowest table a step uses, in blocks.
    pub fn min_width(&self) -> usize {
        self.min_width
    }

    /// Traces (and runs, evaluated) the bucket of `rows` rows at table width
    /// `width` (rounded up to a power of two, at least [`min_width`]) with
    /// rows that read and write only the null block, so serving does not pay
    /// the trace later. Returns whether this traced a new bucket.
    pub fn warm(&mut self, kv: &PagedKv, rows: usize, width: usize) -> Result<bool> {
        let before = self.traces();
        let null = RowBlocks {
            offset: 0,
            blocks: vec![self.null_block],
        };
        let r: Vec<(&RowBlocks, usize)> = vec![(&null, 0); rows];
        let tokens = Array::from_slice(&vec![0i32; rows], &[rows as i32, 1]);
        let logits = self.step_at(kv, &tokens, &r, width, None)?;
        logits.eval()?;
        Ok(self.traces() > before)
    }

    /// Traces so far (one per bucket first met, more means a retrace).
    pub fn traces(&self) -> u64 {
        self.traces.get()
    }

    /// `(rows, table width)` buckets stepped so far.
    pub fn buckets(&self) -> &BTreeSet<(i32, i32)> {
        &self.buckets
    }

    /// The table width (blocks) a step of rows at committed lengths
    /// `starts` (padding rows included or not: they need one block) uses.
    pub fn width_of(&self, starts: impl Iterator<Item = usize>) -> usize {
        let bs = self.block_size.max(1);
        starts
            .map(|s| s / bs + 1)
            .fold(self.min_width, usize::max)
            .next_power_of_two()
    }

    /// Builds one decode step: `tokens` `[B, 1]` int32 for rows
    /// `(block table, committed length)` (padding rows included; B is the
    /// runner's bucket). Writes every row's new K/V (the storage's pool
    /// arrays are replaced by the written ones) and returns the logits
    /// `[B, 1, vocab]`, unevaluated. `lora`: the rows' adapters (covering
    /// all B rows), passed as inputs.
    pub fn step(
        &mut self,
        kv: &PagedKv,
        tokens: &Array,
        rows: &[(&RowBlocks, usize)],
        lora: Option<&LoraStep>,
    ) -> Result<Array> {
        self.step_at(kv, tokens, rows, self.min_width, lora)
    }

    fn step_at(
        &mut self,
        kv: &PagedKv,
        tokens: &Array,
        rows: &[(&RowBlocks, usize)],
        min_width: usize,
        lora: Option<&LoraStep>,
    ) -> Result<Array> {
        let b = rows.len();
        if tokens.shape() != [b as i32, 1] {
            return Err(ModelError::Invalid(format!(
                "compiled decode: tokens {:?} for {b} rows",
                tokens.shape()
            )));
        }
        let bs = self.block_size;
        let mut width = min_width.max(self.min_width);
        let mut start = Vec::with_capacity(b);
        let mut write_block = Vec::with_capacity(b);
        let mut write_offset = Vec::with_capacity(b);
        for (t, s) in rows {
            let need = s / bs + 1;
            if t.offset != 0 || t.blocks.len() < need {
                return Err(ModelError::Invalid(format!(
                    "compiled decode: a row at {s} tokens has {} blocks from {} ({need} needed)",
                    t.blocks.len(),
                    t.offset
                )));
            }
            width = width.max(need);
            start.push(*s as i32);
            write_block.push(t.blocks[s / bs] as i32);
            write_offset.push((s % bs) as i32);
        }
        let width = width.next_power_of_two();
        let mut table = Vec::with_capacity(b * width);
        for (t, s) in rows {
            let used = s / bs + 1;
            table.extend(t.blocks[..used].iter().map(|&x| x as i32));
            table.extend(std::iter::repeat_n(self.null_block as i32, width - used));
        }
        let (bi, wi) = (b as i32, width as i32);
        let inputs = vec![
            tokens.clone(),
            Array::from_slice(&start, &[bi]),
            Array::from_slice(&write_block, &[bi]),
            Array::from_slice(&write_offset, &[bi]),
            Array::from_slice(&table, &[bi, wi]),
            Array::from_slice(&vec![1i32; b], &[bi]),
        ];
        let mut extra = Vec::new();
        if let Some(l) = lora {
            if l.rows() != b {
                return Err(ModelError::Invalid(format!(
                    "compiled decode: adapter slots for {} of {b} rows",
                    l.rows()
                )));
            }
            extra.push(l.slots().clone());
            extra.extend(l.arrays());
        }
        let logits = run_traced(
            &mut self.f,
            kv,
            TracedCall {
                inputs,
                pools: self.pools,
                extra,
                what: "compiled decode",
            },
        )?;
        self.buckets.insert((bi, wi));
        Ok(logits)
    }
}

/// The KV view a traced decode forward runs against: every per-step value is
/// one of the trace's inputs. A mixed step ([`crate::compiled_mixed`]) holds
/// one for its decoding rows, writing every token of the step through it.
pub(crate) struct TracedKv {
    /// `[B]` each row's committed length (its position and attention start).
    pub start: Array,
    /// `[N]` block and offset of each new token's K/V (N = B in a decode step).
    pub write_block: Array,
    pub write_offset: Array,
    /// `[B, W]` each row's block table.
    pub table: Array,
    /// `[B]` new tokens per row (ones).
    pub ntok: Array,
    /// Per layer its K arrays then its V arrays (`KvStorage::pool_arrays`),
    /// replaced by the written arrays layer by layer.
    pub pools: Vec<Array>,
    /// Pool arrays per layer: 2, or 6 when quantized.
    pub per_layer: usize,
    pub quant: Option<AffineQuant>,
    pub kernel: Option<Rc<PagedAttention>>,
    pub fused: Option<Rc<DecodeKernels>>,
    pub block_size: i32,
}

impl TracedKv {
    /// Writes layer `layer`'s new tokens `k`, `v`, one per write position
    /// ([`write_traced`]).
    pub(crate) fn write(&mut self, layer: usize, k: &Array, v: &Array) -> Result<()> {
        write_traced(
            &mut self.pools,
            TracedWrite {
                layer,
                per_layer: self.per_layer,
                quant: self.quant,
                block: &self.write_block,
                offset: &self.write_offset,
            },
            k,
            v,
        )
    }

    /// Layer `layer`'s pools as the paged kernel reads them.
    fn layer_pools(&self, layer: usize) -> Result<Pools<'_>> {
        let base = layer * self.per_layer;
        Pools::from_arrays(&self.pools[base..base + self.per_layer], self.quant)
    }

    fn keys(&self) -> usize {
        (self.table.dim(1) * self.block_size) as usize
    }
}

impl LayerKv for TracedKv {
    fn fused(&self) -> Option<Rc<DecodeKernels>> {
        self.fused.clone()
    }

    fn attend_rows(
        &mut self,
        layer: usize,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
    ) -> Result<Array> {
        self.write(layer, k, v)?;
        self.read_rows(layer, q, scale)
    }

    fn batch(&self) -> usize {
        self.start.dim(0) as usize
    }

    fn step_tokens(&self) -> i32 {
        1
    }

    fn offsets(&self) -> &Array {
        &self.start
    }

    fn last_index(&self) -> Option<&Array> {
        None
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
        if ks.len() != 4 || ks[2] != 1 {
            return Err(ModelError::Invalid(format!(
                "compiled decode: new K {ks:?} is not one token per row"
            )));
        }
        let (b, h, d) = (ks[0], ks[1], ks[3]);
        self.write(layer, &k.reshape(&[b, h, d])?, &v.reshape(&[b, h, d])?)?;
        self.read(layer, q, scale)
    }
}

impl TracedKv {
    /// Layer `layer`'s attention of the rows' one-token queries `q` `[B,
    /// heads, 1, head_dim]` over their tables (new K/V written), `[B, heads,
    /// 1, head_dim]`: the paged kernel where it runs, else a gather of each
    /// table and MLX's attention to each row's length.
    pub(crate) fn read(&self, layer: usize, q: &Array, scale: f32) -> Result<Array> {
        let keys = self.keys() as i32;
        if let Some(kernel) = &self.kernel {
            let scale = Array::from_slice(&[scale], &[1]);
            return kernel.decode(
                q,
                self.layer_pools(layer)?,
                &self.table,
                &self.start,
                &self.ntok,
                &scale,
                keys as usize,
            );
        }
        let b = q.dim(0);
        let (kc, vc) = read_traced(
            &self.pools,
            self.per_layer,
            self.quant,
            layer,
            &self.table,
            self.block_size,
        )?;
        let pos = ops::arange::<_, i32>(0, keys, 1)?.reshape(&[1, keys])?;
        let len = ops::add(&self.start, &self.ntok)?.reshape(&[b, 1])?;
        let mask = pos.lt(&len)?.reshape(&[b, 1, 1, keys])?;
        let q = if q.dtype() == kc.dtype() {
            q.clone()
        } else {
            q.as_dtype(kc.dtype())?
        };
        Ok(fast::scaled_dot_product_attention(
            &q, &kc, &vc, scale, &mask, None,
        )?)
    }

    /// [`read`](Self::read) in the fused layer's form: `[B, heads *
    /// head_dim]` by the paged kernel (the fused layers run only with it).
    pub(crate) fn read_rows(&self, layer: usize, q: &Array, scale: f32) -> Result<Array> {
        let Some(kernel) = &self.kernel else {
            return Err(ModelError::Invalid(
                "compiled decode: fused layers need the paged kernel".into(),
            ));
        };
        let scale = Array::from_slice(&[scale], &[1]);
        kernel.decode_rows(
            q,
            self.layer_pools(layer)?,
            &self.table,
            &self.start,
            &self.ntok,
            &scale,
            self.keys(),
        )
    }
}

/// Where a traced step writes one layer's new tokens.
pub(crate) struct TracedWrite<'a> {
    pub layer: usize,
    /// Pool arrays per layer: 2, or 6 when quantized.
    pub per_layer: usize,
    pub quant: Option<AffineQuant>,
    /// `[N]` block and offset of each new token.
    pub block: &'a Array,
    pub offset: &'a Array,
}

/// Replaces `at.layer`'s K and V arrays in `pools` (every layer's, K's then
/// V's) by the ones written with the new tokens `k`, `v` (`[N, kv_heads,
/// head_dim]` or the scatter's `[N, 1, kv_heads, 1, head_dim]`), quantized
/// first for quantized pools (in the pools' dtype, as the storage's own
/// write does).
pub(crate) fn write_traced(
    pools: &mut [Array],
    at: TracedWrite<'_>,
    k: &Array,
    v: &Array,
) -> Result<()> {
    let base = at.layer * at.per_layer;
    if base + at.per_layer > pools.len() {
        return Err(ModelError::Invalid(format!(
            "compiled step: no pool arrays for layer {}",
            at.layer
        )));
    }
    let per = at.per_layer / 2;
    for (i, x) in [(base, k), (base + per, v)] {
        let parts = match at.quant {
            None => vec![x.clone()],
            Some(q) => {
                let dt = pools[i + 1].dtype();
                let x = if x.dtype() == dt {
                    x.clone()
                } else {
                    x.as_dtype(dt)?
                };
                let (w, sc, bi) = q.quantize(&x).map_err(storage_err)?;
                vec![w, sc, bi]
            }
        };
        for (j, part) in parts.iter().enumerate() {
            pools[i + j] =
                weft_kv_pool::storage::scatter_tokens(&pools[i + j], at.block, at.offset, part)
                    .map_err(storage_err)?;
        }
    }
    Ok(())
}

/// Layer `layer`'s K and V in `pools` (every layer's, K's then V's) gathered
/// along each row's block table `table` `[B, W]` into `[B, kv_heads, W *
/// block_size, head_dim]`, dequantized when quantized.
pub(crate) fn read_traced(
    pools: &[Array],
    per_layer: usize,
    quant: Option<AffineQuant>,
    layer: usize,
    table: &Array,
    block_size: i32,
) -> Result<(Array, Array)> {
    let (b, width) = (table.dim(0), table.dim(1));
    let keys = width * block_size;
    let flat = table.reshape(&[-1])?;
    let ctx = |pool: &Array| -> Result<Array> {
        let (h, last) = (pool.dim(1), pool.dim(3));
        Ok(pool
            .take_axis(&flat, 0)?
            .reshape(&[b, width, h, block_size, last])?
            .transpose_axes(&[0, 2, 1, 3, 4])?
            .reshape(&[b, h, keys, last])?)
    };
    let read = |p: &[Array]| -> Result<Array> {
        match (p, quant) {
            ([x], None) => ctx(x),
            ([w, sc, bi], Some(q)) => q
                .dequantize(&ctx(w)?, &ctx(sc)?, &ctx(bi)?)
                .map_err(storage_err),
            _ => Err(ModelError::Invalid(
                "compiled step: pool arrays do not match the storage".into(),
            )),
        }
    };
    let base = layer * per_layer;
    let per = per_layer / 2;
    if base + per_layer > pools.len() {
        return Err(ModelError::Invalid(format!(
            "compiled step: no pool arrays for layer {layer}"
        )));
    }
    Ok((
        read(&pools[base..base + per])?,
        read(&pools[base + per..base + 2 * per])?,
    ))
}

/// One call of a traced step: its per-step `inputs`, then the storage's
/// `pools` pool arrays, then `extra` inputs (adapters).
pub(crate) struct TracedCall<'a> {
    pub inputs: Vec<Array>,
    pub pools: usize,
    pub extra: Vec<Array>,
    /// The step's name, for errors.
    pub what: &'a str,
}

/// Calls the traced step `f` over `kv`'s current pool arrays, installs the
/// written pools it returns after its logits, and returns the logits,
/// unevaluated.
pub(crate) fn run_traced(f: &mut Traced, kv: &PagedKv, call: TracedCall<'_>) -> Result<Array> {
    let TracedCall {
        mut inputs,
        pools,
        extra,
        what,
    } = call;
    let current = kv.pool_arrays()?;
    if current.len() != pools {
        return Err(ModelError::Invalid(format!(
            "{what}: {} pool arrays for {pools} expected",
            current.len()
        )));
    }
    inputs.extend(current);
    inputs.extend(extra);
    let mut out = f(&inputs)?;
    // The old pools' only references are now the written ones' graph.
    drop(inputs);
    if out.is_empty() {
        return Err(ModelError::Invalid(format!("{what} returned nothing")));
    }
    let written = out.split_off(1);
    kv.replace_pools(written)?;
    out.pop()
        .ok_or_else(|| ModelError::Invalid(format!("{what} returned no logits")))
}
