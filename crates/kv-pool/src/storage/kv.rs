//! Per-layer K/V pool tensors of one layer group, dense or affine-quantized.

use mlx_rs::ops::indexing::{TryIndexMutOp, TryIndexOp};
use mlx_rs::{ops, Array, Dtype};

use crate::storage::ffi;
use crate::storage::step::{to_i32, StepLayout};
use crate::storage::StorageError;
use crate::{layout::check_block_size, BlockId, GroupId, StorageOp};

/// MLX affine quantization of stored K/V: every `group_size` consecutive
/// elements of a token's head vector share one scale and one bias (in the
/// storage dtype); each element takes `bits` bits, packed into `uint32`s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AffineQuant {
    /// 4 or 8.
    pub bits: u8,
    /// 32 or 64; must divide `head_dim`.
    pub group_size: u8,
}

impl AffineQuant {
    /// `bits`-bit quantization with groups of `group_size`.
    pub fn new(bits: u8, group_size: u8) -> Self {
        Self { bits, group_size }
    }

    /// One quantization step of a group whose values span `range`
    /// (`max - min`): `range / (2^bits - 1)`.
    pub fn step(&self, range: f32) -> f32 {
        range / ((1u32 << self.bits) - 1) as f32
    }

    /// Largest error of one dequantized element of a group spanning `range`:
    /// `range / 2^bits`, i.e. `n / (n + 1)` of a [`step`](Self::step) with
    /// `n = 2^bits - 1` (before float rounding of the scale and bias).
    ///
    /// Round-to-nearest on a grid of step `s0 = range / n` alone would give
    /// `s0 / 2`, but MLX snaps the scale so that zero lies on the grid: the
    /// group's edge value `e` of larger magnitude (`|e| >= range / 2`, so
    /// `m = |e| / s0 >= n / 2`) gets `q = round(m)` steps of
    /// `s = |e| / q`. When `q = m + d` rounds up (`0 < d <= 1/2`) the grid
    /// of `n` steps covers only `range * m / (m + d)` and clips the opposite
    /// edge by at most `s0 * n * d / (m + d) <= s0 * n / (n + 1)`; interior
    /// values stay within `s / 2 <= s0 * n / (2 (n - 1))`, which is smaller
    /// for `n >= 3`. The tests observe both bounds attained (0.9375 of a step
    /// at 4 bits, 0.996 at 8).
    pub fn max_error(&self, range: f32) -> f32 {
        range / (1u32 << self.bits) as f32
    }

    /// `x` (`[..., head_dim]`) quantized and dequantized as the storage
    /// stores and reads it: what attention over a stored token sees, for
    /// attention over a step's own new tokens.
    pub fn round_trip(&self, x: &Array) -> Result<Array, StorageError> {
        let (wq, s, bi) = self.quantize(x)?;
        self.dequantize(&wq, &s, &bi)
    }

    /// `x`'s last axis quantized: (packed values, scales, biases), as stored.
    pub fn quantize(&self, x: &Array) -> Result<(Array, Array, Array), StorageError> {
        Ok(ops::quantize(
            x,
            i32::from(self.group_size),
            i32::from(self.bits),
        )?)
    }

    /// Packed values, scales and biases back to values.
    pub fn dequantize(
        &self,
        packed: &Array,
        scales: &Array,
        biases: &Array,
    ) -> Result<Array, StorageError> {
        Ok(ops::dequantize(
            packed,
            scales,
            biases,
            i32::from(self.group_size),
            i32::from(self.bits),
        )?)
    }
}

/// Configuration of one group's K/V storage.
#[derive(Debug, Clone, PartialEq)]
pub struct KvStorageConfig {
    /// Group (block id space) this storage serves; [`StorageOp::CopyBlock`]s of
    /// other groups are ignored by [`KvStorage::apply`].
    pub group: GroupId,
    /// Layers in the group.
    pub layers: usize,
    /// Blocks in the group (the accounting's `GroupSpec::num_blocks`).
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Model dtype: dense storage holds K/V in it, quantized storage its
    /// scales and biases, and reads return it.
    pub dtype: Dtype,
    /// Quantized storage, or `None` for dense storage in `dtype`.
    pub quant: Option<AffineQuant>,
}

impl KvStorageConfig {
    /// Dense storage of `layers` layers.
    pub fn dense(
        group: GroupId,
        layers: usize,
        num_blocks: u32,
        block_size: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype: Dtype,
    ) -> Self {
        Self {
            group,
            layers,
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            dtype,
            quant: None,
        }
    }

    /// The same storage, quantized.
    pub fn quantized(mut self, quant: AffineQuant) -> Self {
        self.quant = Some(quant);
        self
    }

    fn validate(&self) -> Result<(), StorageError> {
        check_block_size(self.block_size)?;
        if self.layers == 0 || self.num_blocks == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return Err(StorageError::InvalidConfig(
                "zero layers, blocks, heads or head_dim",
            ));
        }
        if !matches!(
            self.dtype,
            Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16
        ) {
            return Err(StorageError::InvalidConfig(
                "storage dtype must be float32, float16 or bfloat16",
            ));
        }
        if let Some(q) = self.quant {
            if !matches!(q.bits, 4 | 8) || !matches!(q.group_size, 32 | 64) {
                return Err(StorageError::InvalidConfig(
                    "quantization needs 4 or 8 bits and groups of 32 or 64",
                ));
            }
            if self.head_dim % u32::from(q.group_size) != 0 {
                return Err(StorageError::InvalidConfig(
                    "head_dim must be a multiple of the quantization group",
                ));
            }
        }
        // Every dimension and the flat slot count must fit MLX's i32 shapes.
        to_i32(self.num_blocks as usize * self.block_size as usize)?;
        Ok(())
    }

    /// Bytes of one layer's K plus V storage.
    pub fn bytes_per_layer(&self) -> u64 {
        let elems = u64::from(self.num_blocks)
            * u64::from(self.block_size)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim);
        let el = dtype_bytes(self.dtype);
        2 * match self.quant {
            None => elems * el,
            Some(q) => elems * u64::from(q.bits) / 8 + 2 * elems / u64::from(q.group_size) * el,
        }
    }
}

/// The pool of `s` if it is quantized.
fn quant_pool(s: &Stored) -> Option<QuantPool<'_>> {
    match s {
        Stored::Quant {
            packed,
            scales,
            biases,
            q,
        } => Some(QuantPool {
            packed,
            scales,
            biases,
            quant: *q,
        }),
        Stored::Dense(_) => None,
    }
}

pub(crate) fn dtype_bytes(d: Dtype) -> u64 {
    match d {
        Dtype::Float32 => 4,
        _ => 2,
    }
}

/// One layer's quantized K or V pool, in place: `packed` `[num_blocks,
/// kv_heads, block_size, head_dim * bits / 32]` (`uint32`, element `i` of a
/// word in bits `i * bits ..`), `scales` and `biases` `[num_blocks, kv_heads,
/// block_size, head_dim / group_size]` in the storage dtype; an element is
/// `scale * q + bias`.
#[derive(Debug, Clone, Copy)]
pub struct QuantPool<'a> {
    /// The packed values.
    pub packed: &'a Array,
    /// One scale per group.
    pub scales: &'a Array,
    /// One bias per group.
    pub biases: &'a Array,
    /// Bits and group size.
    pub quant: AffineQuant,
}

/// Gathered quantized K or V in the padded read layout: `packed`
/// `[B, H, L, head_dim * bits / 32]` (`uint32`), `scales` and `biases`
/// `[B, H, L, head_dim / group_size]` — the operands of
/// `quantized_matmul`-based attention.
#[derive(Debug)]
pub struct QuantizedKv {
    /// Packed elements.
    pub packed: Array,
    /// Per-group scales.
    pub scales: Array,
    /// Per-group biases.
    pub biases: Array,
}

/// One stored tensor (K or V of one layer): `[num_blocks, kv_heads,
/// block_size, last]` for each component.
#[derive(Debug)]
enum Stored {
    Dense(Array),
    Quant {
        packed: Array,
        scales: Array,
        biases: Array,
        q: AffineQuant,
    },
}

impl Stored {
    fn arrays(&self) -> impl Iterator<Item = &Array> {
        let v: [Option<&Array>; 3] = match self {
            Stored::Dense(a) => [Some(a), None, None],
            Stored::Quant {
                packed,
                scales,
                biases,
                ..
            } => [Some(packed), Some(scales), Some(biases)],
        };
        v.into_iter().flatten()
    }

    fn arrays_mut(&mut self) -> Vec<&mut Array> {
        match self {
            Stored::Dense(a) => vec![a],
            Stored::Quant {
                packed,
                scales,
                biases,
                ..
            } => vec![packed, scales, biases],
        }
    }
}

#[derive(Debug)]
struct Layer {
    k: Stored,
    v: Stored,
}

/// `pool[blocks[i], :, offsets[i], :] = x[i]` for a dense pool array
/// `[num_blocks, kv_heads, block_size, head_dim]` and new tokens `x`
/// `[N, kv_heads, head_dim]` (cast to the pool's dtype), with `blocks` and
/// `offsets` `[N]` int32 arrays: the write [`KvStorage::write`] makes, for
/// graphs whose slots are array inputs (a compiled step) rather than a
/// host-side [`StepLayout`]. `x` may also come as `[N, 1, kv_heads, 1,
/// head_dim]`, the scatter's own update shape (no reshape in the graph).
/// Returns the written pool (in place when nothing else references `pool`
/// at evaluation).
pub fn scatter_tokens(
    pool: &Array,
    blocks: &Array,
    offsets: &Array,
    x: &Array,
) -> Result<Array, StorageError> {
    let ps = pool.shape();
    let shaped = x.ndim() == 5 && x.dim(1) == 1 && x.dim(3) == 1;
    let xs: Vec<i32> = if shaped {
        vec![x.dim(0), x.dim(2), x.dim(4)]
    } else {
        x.shape().to_vec()
    };
    if ps.len() != 4 || xs.len() != 3 || xs[1] != ps[1] || xs[2] != ps[3] {
        return Err(StorageError::Shape {
            what: "new K/V tokens",
            expected: vec![
                -1,
                ps.get(1).copied().unwrap_or(0),
                ps.get(3).copied().unwrap_or(0),
            ],
            got: xs.to_vec(),
        });
    }
    let x = if x.dtype() == pool.dtype() {
        x.clone()
    } else {
        x.as_dtype(pool.dtype())?
    };
    let u = if shaped {
        x
    } else {
        x.reshape(&[xs[0], 1, xs[1], 1, xs[2]])?
    };
    ffi::scatter(pool, &[blocks, offsets], &u, &[0, 2])
}

/// K/V storage of one layer group: per layer, K and V pool tensors shaped
/// `[num_blocks, kv_heads, block_size, head_dim]` in the model dtype (or the
/// packed/scales/biases triplet of [`AffineQuant`] with the same leading
/// dimensions), indexed by the accounting's block ids.
///
/// # One reference per pool array
///
/// MLX updates an array in place (donates its buffer to the scatter that
/// writes it) only when nothing else references the old array. This type
/// therefore owns its pool arrays exclusively: it is not `Clone`, never
/// returns a view of them (reads are gathers, i.e. copies), and every write
/// replaces the array with the scatter's result so the old handle is gone
/// before evaluation. Callers must keep it that way: evaluate
/// [`arrays`](Self::arrays) (do not clone them) and, within a layer, write
/// before reading ([`update_and_fetch`](Self::update_and_fetch)); a gather of
/// the old array still pending when the scatter runs forces a full copy.
#[derive(Debug)]
pub struct KvStorage {
    cfg: KvStorageConfig,
    layers: Vec<Layer>,
    heads: Array,
}

impl KvStorage {
    /// Allocates zeroed storage.
    pub fn new(cfg: KvStorageConfig) -> Result<Self, StorageError> {
        cfg.validate()?;
        let nb = to_i32(cfg.num_blocks as usize)?;
        let h = to_i32(cfg.kv_heads as usize)?;
        let bs = to_i32(cfg.block_size as usize)?;
        let d = to_i32(cfg.head_dim as usize)?;
        let make = || -> Result<Stored, StorageError> {
            Ok(match cfg.quant {
                None => Stored::Dense(ops::zeros_dtype(&[nb, h, bs, d], cfg.dtype)?),
                Some(q) => {
                    let words = d * i32::from(q.bits) / 32;
                    let groups = d / i32::from(q.group_size);
                    Stored::Quant {
                        packed: ops::zeros_dtype(&[nb, h, bs, words], Dtype::Uint32)?,
                        scales: ops::zeros_dtype(&[nb, h, bs, groups], cfg.dtype)?,
                        biases: ops::zeros_dtype(&[nb, h, bs, groups], cfg.dtype)?,
                        q,
                    }
                }
            })
        };
        let layers = (0..cfg.layers)
            .map(|_| {
                Ok(Layer {
                    k: make()?,
                    v: make()?,
                })
            })
            .collect::<Result<Vec<_>, StorageError>>()?;
        let heads: Vec<i32> = (0..h).collect();
        Ok(Self {
            heads: Array::from_slice(&heads, &[1, h, 1]),
            cfg,
            layers,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &KvStorageConfig {
        &self.cfg
    }

    /// Every pool array, to evaluate together with a step's outputs (so the
    /// writes happen and the graph does not grow across steps).
    pub fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.layers
            .iter()
            .flat_map(|l| l.k.arrays().chain(l.v.arrays()))
    }

    /// Writes one layer's new K and V, `[B, kv_heads, T, head_dim]` as planned
    /// by `step`, at each row's own slots: one scatter per stored array
    /// (three for quantized storage, after quantizing the new tokens).
    /// Inputs in another float dtype are cast to the storage dtype.
    pub fn write(
        &mut self,
        layer: usize,
        step: &StepLayout,
        k: &Array,
        v: &Array,
    ) -> Result<(), StorageError> {
        self.check_step(step)?;
        let l = self.layer_index(layer)?;
        let k = self.new_tokens(step, k)?;
        let v = self.new_tokens(step, v)?;
        let (blocks, offsets, _) = step.write_indices();
        // pool[blocks[i], :, offsets[i], :] = x[i]: one scatter over axes 0 and 2.
        let put = |dst: &mut Array, x: &Array| -> Result<(), StorageError> {
            let s = x.shape();
            let u = x.reshape(&[s[0], 1, s[1], 1, s[2]])?;
            // The old handle is dropped by the assignment, leaving the scatter
            // its only user (in-place update).
            *dst = ffi::scatter(dst, &[blocks, offsets], &u, &[0, 2])?;
            Ok(())
        };
        let layer = &mut self.layers[l];
        for (dst, x) in [(&mut layer.k, k), (&mut layer.v, v)] {
            match dst {
                Stored::Dense(a) => put(a, &x)?,
                Stored::Quant {
                    packed,
                    scales,
                    biases,
                    q,
                } => {
                    let (wq, s, b) = q.quantize(&x)?;
                    put(packed, &wq)?;
                    put(scales, &s)?;
                    put(biases, &b)?;
                }
            }
        }
        Ok(())
    }

    /// Gathers one layer's K and V for attention: `[B, kv_heads, L, head_dim]`
    /// in the storage dtype (dequantized for quantized storage), laid out as
    /// [`StepLayout`] describes; pair with [`StepLayout::mask`].
    ///
    /// One gather per stored array, straight into the attention layout (block
    /// and head indices together, so no transpose follows).
    pub fn read(&self, layer: usize, step: &StepLayout) -> Result<(Array, Array), StorageError> {
        self.check_step(step)?;
        let l = self.layer_index(layer)?;
        let layer = &self.layers[l];
        let k = self.read_one(&layer.k, step)?;
        let v = self.read_one(&layer.v, step)?;
        Ok((k, v))
    }

    /// [`write`](Self::write) then [`read`](Self::read): the one call a
    /// model's attention layer makes per step.
    pub fn update_and_fetch(
        &mut self,
        layer: usize,
        step: &StepLayout,
        k: &Array,
        v: &Array,
    ) -> Result<(Array, Array), StorageError> {
        self.write(layer, step, k, v)?;
        self.read(layer, step)
    }

    /// One layer's dense K and V pool arrays, `[num_blocks, kv_heads,
    /// block_size, head_dim]`, for attention kernels that read the pool in
    /// place through the step's block table instead of gathering it. The same
    /// rule as for [`read`](Self::read) applies: use them only in this step's
    /// graph (after this layer's [`write`](Self::write)) and never keep a
    /// clone, or the next write cannot update the pool in place.
    pub fn dense_arrays(&self, layer: usize) -> Result<(&Array, &Array), StorageError> {
        let l = self.layer_index(layer)?;
        match (&self.layers[l].k, &self.layers[l].v) {
            (Stored::Dense(k), Stored::Dense(v)) => Ok((k, v)),
            _ => Err(StorageError::BadRow("dense_arrays of quantized storage")),
        }
    }

    /// One layer's quantized K and V pool arrays, for attention kernels that
    /// read (and dequantize) the pool in place; the rule of
    /// [`dense_arrays`](Self::dense_arrays) applies.
    pub fn quantized_arrays(
        &self,
        layer: usize,
    ) -> Result<(QuantPool<'_>, QuantPool<'_>), StorageError> {
        let l = self.layer_index(layer)?;
        match (quant_pool(&self.layers[l].k), quant_pool(&self.layers[l].v)) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => Err(StorageError::NotQuantized),
        }
    }

    /// Arrays that hold one layer's K (or V): 1 dense, 3 quantized (packed
    /// values, scales, biases).
    pub fn arrays_per_pool(&self) -> usize {
        if self.cfg.quant.is_some() {
            3
        } else {
            1
        }
    }

    /// Every layer's pool arrays in order, layer 0's K arrays then its V
    /// arrays, then layer 1's, ... ([`arrays_per_pool`](Self::arrays_per_pool)
    /// each), as inputs of a compiled step that writes them and hands back
    /// their successors through [`replace_pools`](Self::replace_pools). These
    /// are extra references: drop them before the step is evaluated, or its
    /// writes copy the pool instead of updating it in place.
    pub fn pool_arrays(&self) -> Vec<Array> {
        self.layers
            .iter()
            .flat_map(|l| l.k.arrays().chain(l.v.arrays()).cloned())
            .collect()
    }

    /// Replaces every pool array with the written version a compiled step
    /// returned (the order of [`pool_arrays`](Self::pool_arrays); each must
    /// keep its shape and dtype). Nothing is replaced if one does not fit.
    pub fn replace_pools(&mut self, pools: Vec<Array>) -> Result<(), StorageError> {
        let n = self.layers.len() * 2 * self.arrays_per_pool();
        if pools.len() != n {
            return Err(StorageError::Shape {
                what: "replacement pool arrays",
                expected: vec![n as i32],
                got: vec![pools.len() as i32],
            });
        }
        for (old, new) in self.pool_arrays().iter().zip(&pools) {
            if old.shape() != new.shape() || old.dtype() != new.dtype() {
                return Err(StorageError::Shape {
                    what: "replacement pool array",
                    expected: old.shape().to_vec(),
                    got: new.shape().to_vec(),
                });
            }
        }
        let slots = self.layers.iter_mut().flat_map(|l| {
            let mut v = l.k.arrays_mut();
            v.extend(l.v.arrays_mut());
            v
        });
        for (slot, new) in slots.zip(pools) {
            *slot = new;
        }
        Ok(())
    }

    /// Gathers one layer's quantized K and V without dequantizing (for
    /// attention that consumes quantized operands directly).
    pub fn read_quantized(
        &self,
        layer: usize,
        step: &StepLayout,
    ) -> Result<(QuantizedKv, QuantizedKv), StorageError> {
        self.check_step(step)?;
        let l = self.layer_index(layer)?;
        let layer = &self.layers[l];
        let one = |s: &Stored| -> Result<QuantizedKv, StorageError> {
            match s {
                Stored::Quant {
                    packed,
                    scales,
                    biases,
                    ..
                } => Ok(QuantizedKv {
                    packed: self.gather(packed, step)?,
                    scales: self.gather(scales, step)?,
                    biases: self.gather(biases, step)?,
                }),
                Stored::Dense(_) => Err(StorageError::NotQuantized),
            }
        };
        Ok((one(&layer.k)?, one(&layer.v)?))
    }

    /// Applies this group's [`StorageOp::CopyBlock`]s, in order, to every
    /// layer; other operations are ignored. All block ids are checked before
    /// anything is written.
    pub fn apply(&mut self, ops: &[StorageOp]) -> Result<(), StorageError> {
        let nb = self.cfg.num_blocks;
        let mut copies: Vec<(BlockId, BlockId)> = Vec::new();
        for op in ops {
            if let StorageOp::CopyBlock { group, src, dst } = *op {
                if group != self.cfg.group {
                    continue;
                }
                for b in [src, dst] {
                    if b >= nb {
                        return Err(StorageError::BlockOutOfRange {
                            block: b,
                            num_blocks: nb,
                        });
                    }
                }
                copies.push((src, dst));
            }
        }
        // Runs of copies that neither read a block written earlier in the run
        // nor write one block twice become one gather + one scatter per array.
        let mut i = 0;
        while i < copies.len() {
            let mut written = std::collections::HashSet::new();
            let mut j = i;
            while j < copies.len() {
                let (s, d) = copies[j];
                if written.contains(&s) || !written.insert(d) {
                    break;
                }
                j += 1;
            }
            self.copy_blocks(&copies[i..j])?;
            i = j;
        }
        Ok(())
    }

    fn copy_blocks(&mut self, run: &[(BlockId, BlockId)]) -> Result<(), StorageError> {
        let src: Vec<i32> = run.iter().map(|p| p.0 as i32).collect();
        let dst: Vec<i32> = run.iter().map(|p| p.1 as i32).collect();
        let n = to_i32(run.len())?;
        let src = Array::from_slice(&src, &[n]);
        let dst = Array::from_slice(&dst, &[n]);
        for layer in &mut self.layers {
            for stored in [&mut layer.k, &mut layer.v] {
                for a in stored.arrays_mut() {
                    let rows = a.take_axis(&src, 0)?;
                    // Evaluate the copied rows first: a gather of `a` still
                    // pending when the scatter runs would hold a second
                    // reference to the pool and turn the in-place update into a
                    // copy of the whole pool.
                    rows.eval()?;
                    a.try_index_mut((&dst, ..), &rows)?;
                }
            }
        }
        Ok(())
    }

    fn layer_index(&self, layer: usize) -> Result<usize, StorageError> {
        if layer < self.layers.len() {
            Ok(layer)
        } else {
            Err(StorageError::UnknownLayer {
                layer,
                layers: self.layers.len(),
            })
        }
    }

    fn check_step(&self, step: &StepLayout) -> Result<(), StorageError> {
        if step.block_size() != self.cfg.block_size as usize {
            return Err(StorageError::BadRow("step planned for another block size"));
        }
        if step.max_block() >= self.cfg.num_blocks {
            return Err(StorageError::BlockOutOfRange {
                block: step.max_block(),
                num_blocks: self.cfg.num_blocks,
            });
        }
        Ok(())
    }

    /// New K or V `[B, H, T, D]` as `[N, H, D]` rows in the order of the
    /// step's write indices, in the storage dtype.
    fn new_tokens(&self, step: &StepLayout, x: &Array) -> Result<Array, StorageError> {
        let b = to_i32(step.batch())?;
        let t = to_i32(step.step_tokens())?;
        let h = self.cfg.kv_heads as i32;
        let d = self.cfg.head_dim as i32;
        if x.shape() != [b, h, t, d] {
            return Err(StorageError::Shape {
                what: "new K/V",
                expected: vec![b, h, t, d],
                got: x.shape().to_vec(),
            });
        }
        let x = if x.dtype() == self.cfg.dtype {
            x.clone()
        } else {
            x.as_dtype(self.cfg.dtype)?
        };
        // [B, H, T, D] -> [B*T, H, D]; with T = 1 the memory order already matches.
        let rows = if t == 1 {
            x.reshape(&[b, h, d])?
        } else {
            x.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b * t, h, d])?
        };
        let (_, _, select) = step.write_indices();
        Ok(match select {
            Some(sel) => rows.take_axis(sel, 0)?,
            None => rows,
        })
    }

    /// `a[blocks[b, n], h]` for every row, head and block: `[B, H, nb, bs, X]`
    /// reshaped to `[B, H, nb * bs, X]`.
    fn gather(&self, a: &Array, step: &StepLayout) -> Result<Array, StorageError> {
        let g = a.try_index((step.read_blocks(), &self.heads, .., ..))?;
        let s = g.shape();
        Ok(g.reshape(&[s[0], s[1], s[2] * s[3], s[4]])?)
    }

    fn read_one(&self, s: &Stored, step: &StepLayout) -> Result<Array, StorageError> {
        match s {
            Stored::Dense(a) => self.gather(a, step),
            Stored::Quant {
                packed,
                scales,
                biases,
                q,
            } => {
                let p = self.gather(packed, step)?;
                let sc = self.gather(scales, step)?;
                let bi = self.gather(biases, step)?;
                q.dequantize(&p, &sc, &bi)
            }
        }
    }
}
