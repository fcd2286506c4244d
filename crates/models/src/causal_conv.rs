//! What the recurrent layers (Gated DeltaNet, Mamba-2) share: the depthwise
//! causal convolution that continues each row's last `kernel - 1` inputs, and
//! where right-padded rows of a ragged prefill end.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};

use crate::error::{ModelError, Result};
use crate::weights::Weights;

/// A depthwise causal convolution's taps `[channels, kernel]` (and bias).
pub struct CausalConv {
    taps: Array,
    bias: Option<Array>,
    kernel: i32,
}

impl CausalConv {
    /// Loads `{prefix}.conv1d.weight` `[channels, kernel, 1]` (and
    /// `conv1d.bias` where `bias`) in `dtype`.
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        channels: i32,
        kernel: i32,
        bias: bool,
        dtype: Dtype,
    ) -> Result<Self> {
        let conv = w.take(&format!("{prefix}.conv1d.weight"))?;
        let cs = conv.shape().to_vec();
        if cs != [channels, kernel, 1] {
            return Err(ModelError::Invalid(format!(
                "{prefix}.conv1d.weight is {cs:?}, expected [{channels}, {kernel}, 1]"
            )));
        }
        let bias = if bias {
            w.take_opt(&format!("{prefix}.conv1d.bias"))
                .map(|b| b.as_dtype(dtype))
                .transpose()?
        } else {
            None
        };
        Ok(Self {
            taps: conv.reshape(&[channels, kernel])?.as_dtype(dtype)?,
            bias,
            kernel,
        })
    }

    /// The weights, for load-time evaluation.
    pub fn arrays(&self) -> Vec<&Array> {
        std::iter::once(&self.taps).chain(&self.bias).collect()
    }

    /// SiLU of the convolution over `x` `[B, T, channels]` continuing `state`
    /// `[B, kernel - 1, channels]`, and the state after each row's last real
    /// input (`ends`: [`Padding::ends`]; None: after all `T`).
    pub fn forward(
        &self,
        x: &Array,
        state: &Array,
        ends: Option<&Array>,
    ) -> Result<(Array, Array)> {
        let (b, t) = (x.dim(0), x.dim(1));
        let state = if state.dtype() == x.dtype() {
            state.clone()
        } else {
            state.as_dtype(x.dtype())?
        };
        let inputs = ops::concatenate(&[&state, x], 1)?;
        let keep = self.kernel - 1;
        let new_state = match ends {
            // Each row's last `keep` inputs end at its last real one.
            Some(e) => {
                let at = ops::add(e, &ops::arange::<_, i32>(0, keep, 1)?.reshape(&[1, keep])?)?
                    .reshape(&[b, keep, 1])?;
                inputs.take_along_axis(&at, 1)?
            }
            None => inputs.try_index((.., t.., ..))?,
        };
        let mut acc: Option<Array> = None;
        for j in 0..self.kernel {
            let tap = self.taps.try_index((.., j))?;
            let term = ops::multiply(&inputs.try_index((.., j..j + t, ..))?, &tap)?;
            acc = Some(match acc {
                Some(a) => ops::add(&a, &term)?,
                None => term,
            });
        }
        let mut out = acc.ok_or_else(|| ModelError::Invalid("empty convolution".into()))?;
        if let Some(bias) = &self.bias {
            out = ops::add(&out, bias)?;
        }
        let out = ops::multiply(&out, &ops::sigmoid(&out)?)?;
        Ok((out, new_state))
    }
}

/// Where the rows of a right-padded forward end.
pub struct Padding {
    /// `[B, T, 1]`: the position is one of the row's real tokens.
    pub valid: Array,
    /// `[B, 1]`: the row's real tokens.
    pub ends: Array,
}

impl Padding {
    /// From `last` `[B, 1, 1]` (each row's last real token; see
    /// `LayerKv::last_index`) for a forward of `t` tokens per row.
    pub fn new(last: &Array, t: i32) -> Result<Self> {
        let l = last.reshape(&[-1, 1])?;
        let valid = ops::le(&ops::arange::<_, i32>(0, t, 1)?.reshape(&[1, t])?, &l)?
            .reshape(&[-1, t, 1])?;
        Ok(Self {
            valid,
            ends: ops::add(&l, Array::from_int(1))?,
        })
    }

    /// `x` at real positions, `fill` at padded ones (`x` `[B, T, ...]`).
    pub fn mask(&self, x: &Array, fill: f32) -> Result<Array> {
        let f = ops::full::<f32>(x.shape(), Array::from_f32(fill))?.as_dtype(x.dtype())?;
        Ok(ops::select(&self.valid, x, &f)?)
    }
}

/// `log(1 + exp(x))`, as MLX's `nn.softplus` (`logaddexp(x, 0)`).
pub fn softplus(x: &Array) -> Result<Array> {
    Ok(ops::logaddexp(x, Array::from_f32(0.0))?)
}
