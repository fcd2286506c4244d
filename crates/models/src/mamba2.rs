//! Mamba-2: the selective state-space mixer of Nemotron-H hybrids, over
//! per-row recurrent state (kept in the KV pool's state slots, see
//! `kv::RecurrentLayers`).
//!
//! Per row the mixer keeps the depthwise causal convolution's last `kernel -
//! 1` inputs `[kernel - 1, conv_dim]` and the SSM state per head `[heads,
//! head_dim, state]` (f32). A forward of `T` tokens: `in_proj(x)` splits into
//! the gate `z` (`heads x head_dim`), the convolution's input and `dt` (one
//! per head); the convolution (continuing the state, plus its bias) and SiLU
//! give `x` (`heads x head_dim`), `B` and `C` (`groups x state`, each group
//! serving `heads / groups` neighbouring heads). Per token, with `dt =
//! clip(softplus(dt + dt_bias))` and `A = -exp(A_log)`: `S = exp(A dt) S + dt
//! x B^T; y = S C + D x`. The output is `out_proj(w * group_rms_norm(silu(z)
//! * y))`, as mlx-lm's `nemotron_h.NemotronHMamba2Mixer` computes it (its
//! chunked `ssm_attn` is the same recurrence summed in another order).

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{fast, ops, Array, Dtype};

use crate::causal_conv::{softplus, CausalConv, Padding};
use crate::error::{ModelError, Result};
use crate::linear::{Linear, WeightPolicy};
use crate::weights::Weights;

/// The mixer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mamba2Shape {
    pub heads: i32,
    pub head_dim: i32,
    /// SSM state size per head and feature (`ssm_state_size`).
    pub state: i32,
    /// Groups of heads sharing one `B` and `C` (`n_groups`).
    pub groups: i32,
    /// Convolution taps (the state keeps `kernel - 1` inputs).
    pub kernel: i32,
}

impl Mamba2Shape {
    /// Features of `x` (and of the gate): `heads * head_dim`.
    pub fn inner(&self) -> i32 {
        self.heads * self.head_dim
    }

    /// Channels through the convolution: `x`, `B` and `C`.
    pub fn conv_dim(&self) -> i32 {
        self.inner() + 2 * self.groups * self.state
    }

    /// The zero state of `rows` rows: the convolution's inputs in `dtype`,
    /// the SSM state in f32 (what [`Mamba2::forward`] takes).
    pub fn zero_state(&self, rows: i32, dtype: Dtype) -> Result<Vec<Array>> {
        Ok(vec![
            ops::zeros_dtype(&[rows, self.kernel - 1, self.conv_dim()], dtype)?,
            ops::zeros_dtype(
                &[rows, self.heads, self.head_dim, self.state],
                Dtype::Float32,
            )?,
        ])
    }
}

/// One Mamba-2 mixer's weights.
pub struct Mamba2 {
    shape: Mamba2Shape,
    in_proj: Linear,
    conv: CausalConv,
    dt_bias: Array,
    /// `-exp(A_log)` per head, f32.
    neg_a: Array,
    d: Array,
    norm: Array,
    out: Linear,
    eps: f32,
    /// `dt` is clipped to this range after the softplus.
    dt_limit: (f32, f32),
}

impl Mamba2 {
    /// Loads `{prefix}.in_proj`, `conv1d.weight` `[conv_dim, kernel, 1]` (and
    /// `conv1d.bias` where the model has one), `dt_bias`, `A_log`, `D`,
    /// `norm.weight`, `out_proj`; `quant` says how a projection is stored.
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        shape: Mamba2Shape,
        eps: f32,
        dt_limit: (f32, f32),
        policy: WeightPolicy,
        quant: impl Fn(&str) -> Option<(i32, i32)>,
    ) -> Result<Self> {
        let lin = |w: &mut Weights, name: &str| {
            let path = format!("{prefix}.{name}");
            let q = quant(&path);
            Linear::load(w, &path, q, policy)
        };
        let dt = policy.dtype;
        let conv = CausalConv::load(w, prefix, shape.conv_dim(), shape.kernel, true, dt)?;
        let a_log = w
            .take(&format!("{prefix}.A_log"))?
            .as_dtype(Dtype::Float32)?;
        Ok(Self {
            in_proj: lin(w, "in_proj")?,
            conv,
            dt_bias: w.take(&format!("{prefix}.dt_bias"))?.as_dtype(dt)?,
            neg_a: ops::negative(&ops::exp(&a_log)?)?,
            d: w.take(&format!("{prefix}.D"))?.as_dtype(dt)?,
            norm: w.take(&format!("{prefix}.norm.weight"))?.as_dtype(dt)?,
            out: lin(w, "out_proj")?,
            shape,
            eps,
            dt_limit,
        })
    }

    /// The projections, for load-time evaluation.
    pub fn linears(&self) -> Vec<&Linear> {
        vec![&self.in_proj, &self.out]
    }

    /// The other weights, for load-time evaluation.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = self.conv.arrays();
        v.extend([&self.dt_bias, &self.neg_a, &self.d, &self.norm]);
        v
    }

    /// The mixer over `x` `[B, T, hidden]` from `state` (as
    /// [`Mamba2Shape::zero_state`] orders it): its output `[B, T, hidden]`
    /// and the state after each row's tokens. `last` `[B, 1, 1]` is each
    /// row's last real token where rows are right-padded: padded positions
    /// get `dt = 0`, which leaves the state exactly as it is, and the
    /// convolution keeps the inputs before them.
    pub fn forward(
        &self,
        x: &Array,
        state: &[Array],
        last: Option<&Array>,
    ) -> Result<(Array, Vec<Array>)> {
        let [conv, ssm] = state else {
            return Err(ModelError::Invalid(format!(
                "a Mamba-2 state has 2 components, got {}",
                state.len()
            )));
        };
        let s = self.shape;
        let xs = x.shape();
        let (b, t) = (xs[0], xs[1]);
        let inner = s.inner();
        let proj = self.in_proj.forward(x)?;
        let gate = proj.try_index((.., .., 0..inner))?;
        let conv_in = proj.try_index((.., .., inner..inner + s.conv_dim()))?;
        let dt_raw = proj.try_index((.., .., inner + s.conv_dim()..))?;
        let dt = softplus(&ops::add(&dt_raw, &self.dt_bias)?.as_dtype(Dtype::Float32)?)?;
        let mut dt = ops::clip(
            &dt,
            (
                Array::from_f32(self.dt_limit.0),
                Array::from_f32(self.dt_limit.1),
            ),
        )?;
        // Padding: dt = 0 leaves the state exactly as is.
        let pad = last.map(|l| Padding::new(l, t)).transpose()?;
        if let Some(p) = &pad {
            dt = p.mask(&dt, 0.0)?;
        }
        let (conv_out, conv_state) =
            self.conv
                .forward(&conv_in, conv, pad.as_ref().map(|p| &p.ends))?;
        let gs = s.groups * s.state;
        let xh = conv_out
            .try_index((.., .., 0..inner))?
            .reshape(&[b, t, s.heads, s.head_dim])?;
        let rep = s.heads / s.groups;
        let per_head = |a: Array| -> Result<Array> {
            let a = a.reshape(&[b, t, s.groups, s.state])?;
            Ok(if rep > 1 {
                ops::repeat_axis::<f32>(a, rep, 2)?
            } else {
                a
            })
        };
        let bm = per_head(conv_out.try_index((.., .., inner..inner + gs))?)?;
        let cm = per_head(conv_out.try_index((.., .., inner + gs..))?)?;

        // The recurrence in f32, token by token.
        let xf = xh.as_dtype(Dtype::Float32)?;
        let bf = bm.as_dtype(Dtype::Float32)?;
        let cf = cm.as_dtype(Dtype::Float32)?;
        let decay = ops::exp(&ops::multiply(&dt, &self.neg_a)?)?; // [B, T, H]
        let mut st = ssm.clone();
        let mut ys = Vec::with_capacity(t as usize);
        for i in 0..t {
            let dt_i = dt.try_index((.., i))?.reshape(&[b, s.heads, 1, 1])?;
            let a_i = decay.try_index((.., i))?.reshape(&[b, s.heads, 1, 1])?;
            let x_i = xf
                .try_index((.., i))?
                .reshape(&[b, s.heads, s.head_dim, 1])?;
            let b_i = bf.try_index((.., i))?.reshape(&[b, s.heads, 1, s.state])?;
            let c_i = cf.try_index((.., i))?.reshape(&[b, s.heads, 1, s.state])?;
            st = ops::add(
                &ops::multiply(&st, &a_i)?,
                &ops::multiply(&ops::multiply(&x_i, &dt_i)?, &b_i)?,
            )?;
            let y = ops::sum_axis(&ops::multiply(&st, &c_i)?, -1, false)?; // [B, H, Dh]
            ys.push(y.as_dtype(x.dtype())?);
        }
        let refs: Vec<&Array> = ys.iter().collect();
        let y = ops::stack(&refs, 1)?; // [B, T, H, Dh]
        let y = ops::add(
            &y,
            &ops::multiply(&xh, &self.d.reshape(&[1, 1, s.heads, 1])?)?,
        )?
        .reshape(&[b, t, inner])?;

        // Gated group RMS norm: silu(z) * y, normed per group of heads.
        let gated = ops::multiply(&ops::multiply(&gate, &ops::sigmoid(&gate)?)?, &y)?;
        let normed = fast::rms_norm(
            &gated.reshape(&[b, t, s.groups, inner / s.groups])?,
            None,
            self.eps,
        )?
        .reshape(&[b, t, inner])?;
        let o = ops::multiply(&self.norm, &normed)?;
        Ok((self.out.forward(&o)?, vec![conv_state, st]))
    }
}
