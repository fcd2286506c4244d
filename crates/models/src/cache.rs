//! KV cache for a batch of rows that share one write cursor.
//!
//! Rows are left-padded so every row's newest token sits at the same column:
//! one `slice_update` per layer writes a whole step for all rows, and each row's
//! RoPE position is `cursor - left_pad[row]`. Joining rows are merged by
//! padding the shorter side on the left; leaving rows are filtered out and the
//! common left padding trimmed.
//!
//! Writes are transactional by construction: a step writes at
//! `[cursor, cursor + T)` but only `commit` advances the cursor, so after a
//! rollback the written columns are dead data the retry overwrites. The arrays
//! are replaced in place (one reference) so MLX can donate their buffers.

use mlx_rs::ops::indexing::{TryIndexMutOp, TryIndexOp};
use mlx_rs::{ops, Array, Dtype};

use crate::error::{ModelError, Result};

const GROW: i32 = 256;

#[derive(Debug, Clone)]
pub struct KvCache {
    keys: Vec<Option<Array>>,
    values: Vec<Option<Array>>,
    cursor: i32,
    pending: i32,
    left_pad: Vec<i32>,
}

/// Attention mask for one step.
pub enum StepMask {
    None,
    Causal,
    Array(Array),
}

impl KvCache {
    pub fn new(num_layers: usize, batch: usize) -> Self {
        Self {
            keys: vec![None; num_layers],
            values: vec![None; num_layers],
            cursor: 0,
            pending: 0,
            left_pad: vec![0; batch],
        }
    }

    /// An empty cache whose rows start `pads[row]` columns in: a prefill of
    /// `[B, T]` tokens left-padded by those amounts gives each row its own
    /// positions from 0 (padding is masked out and never attended to).
    pub fn with_left_pad(num_layers: usize, pads: Vec<i32>) -> Self {
        Self {
            left_pad: pads,
            ..Self::new(num_layers, 0)
        }
    }

    pub fn batch_size(&self) -> usize {
        self.left_pad.len()
    }

    /// Committed length of each row (its next RoPE position).
    pub fn lengths(&self) -> Vec<i32> {
        self.left_pad.iter().map(|p| self.cursor - p).collect()
    }

    pub fn offsets_array(&self) -> Array {
        Array::from_slice(&self.lengths(), &[self.batch_size() as i32])
    }

    pub fn mask(&self, t: i32) -> StepMask {
        let padded = self.left_pad.iter().any(|&p| p > 0);
        if !padded {
            return if t > 1 {
                StepMask::Causal
            } else {
                StepMask::None
            };
        }
        let s = self.cursor + t;
        let b = self.batch_size() as i32;
        StepMask::Array(Array::from_slice(
            &self.visibility(&self.left_pad, t),
            &[b, 1, t, s],
        ))
    }

    /// The same mask as `mask`, additive (0 visible, -inf hidden) and shaped
    /// `[B, 1, 1, T, S]` (or `[T, S]` without padding) for attention that
    /// groups query heads; None when nothing is hidden.
    pub fn additive_mask(&self, t: i32) -> Option<Array> {
        let padded = self.left_pad.iter().any(|&p| p > 0);
        if !padded && t == 1 {
            return None;
        }
        let s = self.cursor + t;
        let (pads, shape): (&[i32], _) = if padded {
            (&self.left_pad, vec![self.batch_size() as i32, 1, 1, t, s])
        } else {
            (&[0], vec![t, s])
        };
        let bias: Vec<f32> = self
            .visibility(pads, t)
            .into_iter()
            .map(|v| if v { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        Some(Array::from_slice(&bias, &shape))
    }

    /// Row-major `[rows, T, S]`: may query `q` of a row padded by `pad` see column `j`.
    fn visibility(&self, pads: &[i32], t: i32) -> Vec<bool> {
        let s = self.cursor + t;
        let mut m = Vec::with_capacity(pads.len() * (t * s) as usize);
        for &pad in pads {
            for q in 0..t {
                let here = self.cursor + q;
                for j in 0..s {
                    // A padding query still sees itself: a row with no visible
                    // key would softmax to NaN, and NaN K/V at padding columns
                    // would leak into real rows through 0 * NaN.
                    m.push((j >= pad && j <= here) || j == here);
                }
            }
        }
        m
    }

    /// Writes one layer's new K/V `[B, Hkv, T, D]` at the cursor; returns the
    /// keys and values attention should read, `[B, Hkv, cursor + T, D]`.
    pub fn update(&mut self, layer: usize, k: &Array, v: &Array) -> Result<(Array, Array)> {
        let t = k.dim(2);
        if self.pending != 0 && self.pending != t {
            return Err(ModelError::Invalid(format!(
                "cache step wrote {} tokens in one layer and {t} in another",
                self.pending
            )));
        }
        self.pending = t;
        let end = self.cursor + t;
        let slots = [&mut self.keys[layer], &mut self.values[layer]];
        let new = [k, v];
        let mut out = Vec::with_capacity(2);
        for (slot, x) in slots.into_iter().zip(new) {
            let cap = slot.as_ref().map_or(0, |a| a.dim(2));
            if end > cap {
                let new_cap = (end + GROW - 1) / GROW * GROW;
                let shape = x.shape();
                let zeros =
                    ops::zeros_dtype(&[shape[0], shape[1], new_cap - cap, shape[3]], x.dtype())?;
                *slot = Some(match slot.take() {
                    Some(old) => ops::concatenate(&[old, zeros], 2)?,
                    None => zeros,
                });
            }
            let buf = slot
                .as_mut()
                .ok_or_else(|| ModelError::Invalid("cache slot".into()))?;
            buf.try_index_mut((.., .., self.cursor..end, ..), x)?;
            out.push(buf.try_index((.., .., 0..end, ..))?);
        }
        let v = out
            .pop()
            .ok_or_else(|| ModelError::Invalid("cache".into()))?;
        let k = out
            .pop()
            .ok_or_else(|| ModelError::Invalid("cache".into()))?;
        Ok((k, v))
    }

    /// Every K/V buffer (to evaluate a step that produced no logits).
    pub fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.keys.iter().chain(self.values.iter()).flatten()
    }

    pub fn commit(&mut self) {
        self.cursor += self.pending;
        self.pending = 0;
    }

    pub fn rollback(&mut self) {
        self.pending = 0;
    }

    /// Keeps only the rows at `keep` (in that order); trims the common left padding.
    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        if keep.iter().any(|&i| i >= self.batch_size()) {
            return Err(ModelError::Invalid("filter: row index out of range".into()));
        }
        let idx: Vec<i32> = keep.iter().map(|&i| i as i32).collect();
        let idx = Array::from_slice(&idx, &[idx.len() as i32]);
        self.left_pad = keep.iter().map(|&i| self.left_pad[i]).collect();
        let trim = self.left_pad.iter().copied().min().unwrap_or(0);
        for slot in self.keys.iter_mut().chain(self.values.iter_mut()) {
            if let Some(a) = slot.take() {
                let a = a.take_axis(&idx, 0)?;
                let a = if trim > 0 {
                    a.try_index((.., .., trim.., ..))?
                } else {
                    a
                };
                *slot = Some(a);
            }
        }
        self.cursor -= trim;
        for p in &mut self.left_pad {
            *p -= trim;
        }
        Ok(())
    }

    /// Appends the rows of `other` after this cache's rows.
    pub fn merge(&mut self, other: &KvCache) -> Result<()> {
        self.merge_many(&[other])
    }

    /// Appends the rows of every cache in `others` with one concatenation per
    /// layer (joiners arriving together cost one copy of the batch, not one each).
    pub fn merge_many(&mut self, others: &[&KvCache]) -> Result<()> {
        if others.iter().any(|o| o.keys.len() != self.keys.len()) {
            return Err(ModelError::Invalid("merge: layer counts differ".into()));
        }
        if self.pending != 0 || others.iter().any(|o| o.pending != 0) {
            return Err(ModelError::Invalid("merge inside an open step".into()));
        }
        let parts: Vec<&KvCache> = std::iter::once(&*self)
            .chain(others.iter().copied())
            .collect();
        let cursor = parts.iter().map(|c| c.cursor).max().unwrap_or(0);
        let mut keys = Vec::with_capacity(self.keys.len());
        let mut values = Vec::with_capacity(self.keys.len());
        for layer in 0..self.keys.len() {
            for (out, pick) in [(&mut keys, 0), (&mut values, 1)] {
                fn slot(c: &KvCache, pick: usize, layer: usize) -> &Option<Array> {
                    if pick == 0 {
                        &c.keys[layer]
                    } else {
                        &c.values[layer]
                    }
                }
                let Some(like) = parts.iter().find_map(|c| slot(c, pick, layer).as_ref()) else {
                    out.push(None);
                    continue;
                };
                let (h, d, dt) = (like.dim(1), like.dim(3), like.dtype());
                let mut pieces = Vec::with_capacity(parts.len());
                for c in &parts {
                    let a = slot(c, pick, layer)
                        .as_ref()
                        .map(|a| a.try_index((.., .., 0..c.cursor, ..)))
                        .transpose()?;
                    pieces.push(left_pad_to(
                        a,
                        c.left_pad.len() as i32,
                        h,
                        d,
                        dt,
                        cursor - c.cursor,
                        cursor,
                    )?);
                }
                out.push(Some(ops::concatenate(&pieces, 0)?));
            }
        }
        let left_pad = parts
            .iter()
            .flat_map(|c| c.left_pad.iter().map(move |p| p + cursor - c.cursor))
            .collect();
        self.keys = keys;
        self.values = values;
        self.left_pad = left_pad;
        self.cursor = cursor;
        Ok(())
    }

    /// A single-row cache cut to its first `len` tokens (the rest becomes dead
    /// data). Shares buffers with `self` until either side writes.
    pub fn truncated(&self, len: i32) -> KvCache {
        let mut c = self.clone();
        c.pending = 0;
        if c.left_pad.len() == 1 {
            c.cursor = c.left_pad[0] + len.min(self.cursor - c.left_pad[0]).max(0);
        }
        c
    }

    /// One row as a standalone single-row cache.
    pub fn extract(&self, row: usize) -> Result<KvCache> {
        let mut one = self.clone();
        one.filter(&[row])?;
        Ok(one)
    }
}

fn left_pad_to(
    a: Option<Array>,
    b: i32,
    h: i32,
    d: i32,
    dt: Dtype,
    pad: i32,
    len: i32,
) -> Result<Array> {
    Ok(match a {
        None => ops::zeros_dtype(&[b, h, len, d], dt)?,
        Some(a) if pad > 0 => {
            let z = ops::zeros_dtype(&[b, h, pad, d], dt)?;
            ops::concatenate(&[z, a], 2)?
        }
        Some(a) => a,
    })
}
