//! Gated DeltaNet: the linear-attention layer of Qwen3.5 / Qwen3-Next hybrids,
//! over per-row recurrent state (kept in the KV pool's state slots, see
//! `kv::RecurrentLayers`).
//!
//! Per row the layer keeps two states: the depthwise causal convolution's last
//! `kernel - 1` inputs `[kernel - 1, conv_dim]` and the delta rule's matrix
//! per value head `[v_heads, v_dim, k_dim]` (f32). A forward of `T` tokens:
//! `qkv = in_proj_qkv(x)` through the convolution (continuing the state) and
//! SiLU, split into `q`, `k` (`k_heads x k_dim`) and `v` (`v_heads x v_dim`);
//! `q`, `k` L2-normalized (`q` also scaled by `1 / k_dim`, `k` by `1 /
//! sqrt(k_dim)`); per token, with `beta = sigmoid(in_proj_b(x))` and the decay
//! `g = exp(-exp(A_log) * softplus(in_proj_a(x) + dt_bias))`:
//! `S = g S; S += k (beta (v - S k))^T; y = S q`. The output is
//! `out_proj(rms_norm(y) * w * silu(z))` with `z = in_proj_z(x)`, as mlx-lm's
//! `qwen3_5.GatedDeltaNet` computes it (its ops path, `gated_delta_ops`).

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{fast, ops, Array, Dtype};

use crate::causal_conv::{softplus, CausalConv, Padding};
use crate::error::{ModelError, Result};
use crate::linear::{Linear, WeightPolicy};
use crate::weights::Weights;

/// The layer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaShape {
    pub k_heads: i32,
    pub v_heads: i32,
    pub k_dim: i32,
    pub v_dim: i32,
    /// Convolution taps (the state keeps `kernel - 1` inputs).
    pub kernel: i32,
}

impl DeltaShape {
    /// Channels through the convolution: `q`, `k` and `v`.
    pub fn conv_dim(&self) -> i32 {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }
}

impl DeltaShape {
    /// The zero state of `rows` rows: the convolution's inputs `[rows,
    /// kernel - 1, conv_dim]` in `dtype`, the delta rule's matrices `[rows,
    /// v_heads, v_dim, k_dim]` in f32 (what [`GatedDeltaNet::forward`] takes).
    pub fn zero_state(&self, rows: i32, dtype: Dtype) -> Result<Vec<Array>> {
        Ok(vec![
            ops::zeros_dtype(&[rows, self.kernel - 1, self.conv_dim()], dtype)?,
            ops::zeros_dtype(
                &[rows, self.v_heads, self.v_dim, self.k_dim],
                Dtype::Float32,
            )?,
        ])
    }
}

/// One Gated DeltaNet layer's weights.
pub struct GatedDeltaNet {
    shape: DeltaShape,
    in_qkv: Linear,
    in_z: Linear,
    in_b: Linear,
    in_a: Linear,
    conv: CausalConv,
    dt_bias: Array,
    /// `-exp(A_log)` per value head, f32.
    neg_a: Array,
    norm: Array,
    out: Linear,
    eps: f32,
}

impl GatedDeltaNet {
    /// Loads `{prefix}.in_proj_{qkv,z,b,a}`, `conv1d.weight` `[conv_dim,
    /// kernel, 1]`, `dt_bias`, `A_log`, `norm.weight`, `out_proj`; `quant`
    /// says how a projection is stored (mlx-lm's `(group_size, bits)` per
    /// module path, None: dense).
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        shape: DeltaShape,
        eps: f32,
        policy: WeightPolicy,
        quant: impl Fn(&str) -> Option<(i32, i32)>,
    ) -> Result<Self> {
        let lin = |w: &mut Weights, name: &str| {
            let path = format!("{prefix}.{name}");
            let q = quant(&path);
            Linear::load(w, &path, q, policy)
        };
        let dt = policy.dtype;
        let conv = CausalConv::load(w, prefix, shape.conv_dim(), shape.kernel, false, dt)?;
        let a_log = w
            .take(&format!("{prefix}.A_log"))?
            .as_dtype(Dtype::Float32)?;
        Ok(Self {
            in_qkv: lin(w, "in_proj_qkv")?,
            in_z: lin(w, "in_proj_z")?,
            in_b: lin(w, "in_proj_b")?,
            in_a: lin(w, "in_proj_a")?,
            conv,
            dt_bias: w.take(&format!("{prefix}.dt_bias"))?.as_dtype(dt)?,
            neg_a: ops::negative(&ops::exp(&a_log)?)?,
            norm: w.take(&format!("{prefix}.norm.weight"))?.as_dtype(dt)?,
            out: lin(w, "out_proj")?,
            shape,
            eps,
        })
    }

    /// The projections, for load-time evaluation.
    pub fn linears(&self) -> Vec<&Linear> {
        vec![&self.in_qkv, &self.in_z, &self.in_b, &self.in_a, &self.out]
    }

    /// The other weights, for load-time evaluation.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = self.conv.arrays();
        v.extend([&self.dt_bias, &self.neg_a, &self.norm]);
        v
    }

    /// The layer over `x` `[B, T, hidden]` from `state` (its two components,
    /// as [`DeltaShape::zero_state`] orders them): its output `[B, T, hidden]` and the
    /// state after each row's tokens. `last` `[B, 1, 1]` is each row's last
    /// real token where rows are right-padded (None: all `T` are real); a
    /// row's state then stops there: padded positions neither decay nor
    /// write the state, and the convolution keeps the inputs before them.
    pub fn forward(
        &self,
        x: &Array,
        state: &[Array],
        last: Option<&Array>,
    ) -> Result<(Array, Vec<Array>)> {
        let [conv, rec] = state else {
            return Err(ModelError::Invalid(format!(
                "a Gated DeltaNet state has 2 components, got {}",
                state.len()
            )));
        };
        let s = self.shape;
        let xs = x.shape();
        let (b, t) = (xs[0], xs[1]);
        let qkv = self.in_qkv.forward(x)?;
        let z = self.in_z.forward(x)?.reshape(&[b, t, s.v_heads, s.v_dim])?;
        let mut beta = ops::sigmoid(&self.in_b.forward(x)?)?;
        let a = self.in_a.forward(x)?;
        // Decay per token and value head, in f32.
        let sp = softplus(&ops::add(&a, &self.dt_bias)?.as_dtype(Dtype::Float32)?)?;
        let mut g = ops::exp(&ops::multiply(&self.neg_a, &sp)?)?;
        // Padding: decay 1 and write strength 0 leave the state exactly as is.
        let pad = last.map(|l| Padding::new(l, t)).transpose()?;
        if let Some(p) = &pad {
            g = p.mask(&g, 1.0)?;
            beta = p.mask(&beta, 0.0)?;
        }
        let (conv_out, conv_state) =
            self.conv
                .forward(&qkv, conv, pad.as_ref().map(|p| &p.ends))?;

        let kd = s.k_heads * s.k_dim;
        let q = conv_out
            .try_index((.., .., 0..kd))?
            .reshape(&[b, t, s.k_heads, s.k_dim])?;
        let k = conv_out
            .try_index((.., .., kd..2 * kd))?
            .reshape(&[b, t, s.k_heads, s.k_dim])?;
        let v = conv_out
            .try_index((.., .., 2 * kd..))?
            .reshape(&[b, t, s.v_heads, s.v_dim])?;
        // L2 norms as mlx-lm's `normalize_qk`: rms_norm with eps scaled by
        // 1 / k_dim, q also by 1 / k_dim and k by 1 / sqrt(k_dim).
        let inv = (s.k_dim as f32).powf(-0.5);
        let rms_eps = 1e-6 * inv * inv;
        let q = ops::multiply(
            &fast::rms_norm(&q, None, rms_eps)?,
            Array::from_f32(inv * inv),
        )?;
        let k = ops::multiply(&fast::rms_norm(&k, None, rms_eps)?, Array::from_f32(inv))?;
        // Each key head serves v_heads / k_heads value heads (neighbours).
        let rep = s.v_heads / s.k_heads;
        let (q, k) = if rep > 1 {
            (
                ops::repeat_axis::<f32>(q, rep, 2)?,
                ops::repeat_axis::<f32>(k, rep, 2)?,
            )
        } else {
            (q, k)
        };

        let mut rec = rec.clone();
        let mut ys = Vec::with_capacity(t as usize);
        for i in 0..t {
            let qt = q.try_index((.., i))?; // [B, Hv, Dk]
            let kt = k.try_index((.., i))?;
            let vt = v.try_index((.., i))?; // [B, Hv, Dv]
            let gt = g.try_index((.., i))?; // [B, Hv]
            let bt = beta.try_index((.., i))?;
            rec = ops::multiply(&rec, &gt.reshape(&[b, s.v_heads, 1, 1])?)?;
            let k4 = kt.reshape(&[b, s.v_heads, 1, s.k_dim])?;
            let mem = ops::sum_axis(&ops::multiply(&rec, &k4)?, -1, false)?;
            let delta =
                ops::multiply(&ops::subtract(&vt, &mem)?, &bt.reshape(&[b, s.v_heads, 1])?)?;
            rec = ops::add(
                &rec,
                &ops::multiply(&k4, &delta.reshape(&[b, s.v_heads, s.v_dim, 1])?)?,
            )?;
            let q4 = qt.reshape(&[b, s.v_heads, 1, s.k_dim])?;
            let y = ops::sum_axis(&ops::multiply(&rec, &q4)?, -1, false)?;
            ys.push(y.as_dtype(x.dtype())?);
        }
        let refs: Vec<&Array> = ys.iter().collect();
        let y = ops::stack(&refs, 1)?; // [B, T, Hv, Dv]

        // Gated RMS norm: rms_norm(y) * w, times silu(z), in f32.
        let normed = fast::rms_norm(&y, Some(&self.norm), self.eps)?;
        let zf = z.as_dtype(Dtype::Float32)?;
        let gate = ops::multiply(&zf, &ops::sigmoid(&zf)?)?;
        let o = ops::multiply(&gate, &normed.as_dtype(Dtype::Float32)?)?.as_dtype(y.dtype())?;
        let out = self
            .out
            .forward(&o.reshape(&[b, t, s.v_heads * s.v_dim])?)?;
        Ok((out, vec![conv_state, rec]))
    }
}
