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
//!
//! A speculative step writes a draft for every row at once, but rows accept
//! different numbers of its tokens. Rejected columns become holes: masked out
//! like padding and not counted in the row's length, so the shared cursor
//! still moves by the whole step and nothing is copied to realign rows.

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
    /// Per row, ascending columns (in `[left_pad, cursor)`) holding rejected
    /// draft tokens.
    holes: Vec<Vec<i32>>,
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
            holes: vec![Vec::new(); batch],
        }
    }

    /// An empty cache whose rows start `pads[row]` columns in: a prefill of
    /// `[B, T]` tokens left-padded by those amounts gives each row its own
    /// positions from 0 (padding is masked out and never attended to).
    pub fn with_left_pad(num_layers: usize, pads: Vec<i32>) -> Self {
        Self {
            holes: vec![Vec::new(); pads.len()],
            left_pad: pads,
            ..Self::new(num_layers, 0)
        }
    }

    pub fn batch_size(&self) -> usize {
        self.left_pad.len()
    }

    /// Committed length of each row (its next RoPE position).
    pub fn lengths(&self) -> Vec<i32> {
        self.left_pad
            .iter()
            .zip(&self.holes)
            .map(|(p, h)| self.cursor - p - h.len() as i32)
            .collect()
    }

    /// Whether some row has a column to hide (padding or a hole).
    fn ragged(&self) -> bool {
        self.left_pad.iter().any(|&p| p > 0) || self.holes.iter().any(|h| !h.is_empty())
    }

    pub fn offsets_array(&self) -> Array {
        Array::from_slice(&self.lengths(), &[self.batch_size() as i32])
    }

    pub fn mask(&self, t: i32) -> StepMask {
        if !self.ragged() {
            return if t > 1 {
                StepMask::Causal
            } else {
                StepMask::None
            };
        }
        let s = self.cursor + t;
        let b = self.batch_size() as i32;
        StepMask::Array(Array::from_slice(&self.visibility(true, t), &[b, 1, t, s]))
    }

    /// The same mask as `mask`, additive (0 visible, -inf hidden) and shaped
    /// `[B, 1, 1, T, S]` (or `[T, S]` without padding) for attention that
    /// groups query heads; None when nothing is hidden.
    pub fn additive_mask(&self, t: i32) -> Option<Array> {
        let ragged = self.ragged();
        if !ragged && t == 1 {
            return None;
        }
        let s = self.cursor + t;
        let shape = if ragged {
            vec![self.batch_size() as i32, 1, 1, t, s]
        } else {
            vec![t, s]
        };
        let bias: Vec<f32> = self
            .visibility(ragged, t)
            .into_iter()
            .map(|v| if v { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        Some(Array::from_slice(&bias, &shape))
    }

    /// Row-major `[rows, T, S]` (one shared row without `per_row`): may
    /// query `q` of a row see column `j`.
    fn visibility(&self, per_row: bool, t: i32) -> Vec<bool> {
        let s = self.cursor + t;
        let rows = if per_row { self.batch_size() } else { 1 };
        let mut m = Vec::with_capacity(rows * (t * s) as usize);
        let mut keep = vec![true; s as usize];
        for row in 0..rows {
            let (pad, holes) = if per_row {
                (self.left_pad[row], &self.holes[row][..])
            } else {
                (0, &[][..])
            };
            for (j, k) in keep.iter_mut().enumerate() {
                *k = j as i32 >= pad;
            }
            for &h in holes {
                keep[h as usize] = false;
            }
            for q in 0..t {
                let here = self.cursor + q;
                for (j, &k) in keep.iter().enumerate() {
                    let j = j as i32;
                    // A padding query still sees itself: a row with no visible
                    // key would softmax to NaN, and NaN K/V at padding columns
                    // would leak into real rows through 0 * NaN.
                    m.push((k && j <= here) || j == here);
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

    /// Commits the open step keeping only the first `kept[row]` of its
    /// columns in each row; the rest become holes.
    pub fn commit_kept(&mut self, kept: &[i32]) -> Result<()> {
        if kept.len() != self.batch_size() || kept.iter().any(|&k| k < 0 || k > self.pending) {
            return Err(ModelError::Invalid(format!(
                "commit_kept: {kept:?} for {} rows of a {}-token step",
                self.batch_size(),
                self.pending
            )));
        }
        for (holes, &k) in self.holes.iter_mut().zip(kept) {
            holes.extend(self.cursor + k..self.cursor + self.pending);
        }
        self.commit();
        Ok(())
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
        self.holes = keep
            .iter()
            .map(|&i| self.holes[i].iter().map(|h| h - trim).collect())
            .collect();
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
        let holes = parts
            .iter()
            .flat_map(|c| {
                c.holes
                    .iter()
                    .map(move |h| h.iter().map(|x| x + cursor - c.cursor).collect())
            })
            .collect();
        self.holes = holes;
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
            let len = len.clamp(0, self.lengths()[0]);
            // The column after the row's `len`-th kept token.
            let mut end = c.left_pad[0] + len;
            for &h in &c.holes[0] {
                if h < end {
                    end += 1;
                }
            }
            c.cursor = end;
            c.holes[0].retain(|&h| h < end);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn step(c: &mut KvCache, t: i32) {
        let b = c.batch_size() as i32;
        let x = ops::zeros::<f32>(&[b, 1, t, 2]).unwrap();
        c.update(0, &x, &x).unwrap();
    }

    /// Rejected draft columns leave a row's length, its mask and its cut
    /// points as if they had never been written.
    #[test]
    fn holes_are_not_tokens() {
        let mut c = KvCache::with_left_pad(1, vec![0, 2]);
        step(&mut c, 4);
        c.commit();
        assert_eq!(c.lengths(), vec![4, 2]);
        step(&mut c, 3);
        c.commit_kept(&[1, 3]).unwrap();
        assert_eq!(c.lengths(), vec![5, 5], "row 0 kept 1 of 3 columns");
        // Row 0 holds columns 0..=4; 5 and 6 are holes. A one-token step at 7.
        let vis = c.visibility(true, 1);
        let row0: Vec<bool> = vis[..8].to_vec();
        assert_eq!(row0, [true, true, true, true, true, false, false, true]);
        let row1: Vec<bool> = vis[8..].to_vec();
        assert_eq!(row1, [false, false, true, true, true, true, true, true]);
        assert!(c.commit_kept(&[1, 1]).is_err(), "no open step to keep from");

        // Row 0 alone, cut to 5 and 4 tokens: the holes after its last kept
        // column go, the cursor lands after that column.
        let one = c.extract(0).unwrap();
        assert_eq!(one.lengths(), vec![5]);
        let cut = one.truncated(5);
        assert_eq!((cut.cursor, cut.lengths()), (5, vec![5]));
        let mut grown = one.clone();
        step(&mut grown, 1);
        grown.commit();
        assert_eq!(grown.lengths(), vec![6]);
        assert_eq!(
            grown.truncated(6).cursor,
            8,
            "the holes at 5, 6 stay inside"
        );
        assert_eq!(grown.truncated(6).lengths(), vec![6]);

        // Merging shifts the holes with the row they belong to.
        let mut m = KvCache::with_left_pad(1, vec![0]);
        step(&mut m, 9);
        m.commit();
        m.merge(&one).unwrap();
        assert_eq!(m.lengths(), vec![9, 5]);
        m.filter(&[1]).unwrap();
        assert_eq!(m.lengths(), vec![5]);
    }
}
