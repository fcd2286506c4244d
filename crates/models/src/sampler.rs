//! Sampling where the logits are: on the device, as MLX ops over the step's
//! `[positions, vocab]` logits, so only the picked ids (and logprobs a row
//! asked for) cross to the host.
//!
//! Semantics are the scheduler's host sampler's, position by position:
//! penalties over the row's seen tokens (repetition: `x / r` if `x > 0`, else
//! `x * r`; then minus `presence + frequency * count` for generated tokens);
//! greedy is the first maximum; otherwise the scaled logits `x / T` are sorted
//! descending, weights `exp(s - s_max)`, the first `top_k` kept, then those
//! whose exclusive cumulative share is below `top_p`, then those with weight
//! `>= min_p`; the pick is the first position whose cumulative kept weight
//! exceeds `u * total` for the row's uniform draw `u` (computed by the caller
//! from the request's seed and token index, never from the batch). Logprobs
//! are the log-softmax of the raw logits. Accumulation is f32 here and f64 on
//! the host, so a stochastic pick can differ from the host's where `u` falls
//! within rounding of a boundary; greedy picks are identical.

use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::{ops, Array, Dtype};

use crate::error::{ModelError, Result};

/// How one row's positions are picked.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRow {
    /// 0: greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: u32,
    /// 1: off.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Distinct tokens the penalties apply to, with how often each was generated
    /// (repetition applies to every one, presence and frequency to generated ones).
    pub seen: Vec<(u32, u32)>,
    /// One uniform draw in `[0, 1)` per position of the row (`1 + draft`).
    pub uniforms: Vec<f64>,
    /// Logprob of the pick and the `n` most likely tokens, at every position.
    pub logprobs: Option<usize>,
    /// Tokens an output constraint allows at each position of the row (one mask per
    /// position; empty: any token anywhere), as bitmask words (token `t`: bit `t % 32`
    /// of word `t / 32`; missing words allow nothing). The others get -inf logits
    /// after penalties, before the pick; logprobs stay those of the raw logits.
    pub allowed: Vec<std::sync::Arc<[u32]>>,
}

impl Default for SampleRow {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seen: Vec::new(),
            uniforms: vec![0.0],
            logprobs: None,
            allowed: Vec::new(),
        }
    }
}

impl SampleRow {
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    fn penalized(&self) -> bool {
        !self.seen.is_empty()
            && (self.repetition_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }

    fn positions(&self) -> usize {
        self.uniforms.len()
    }
}

/// The logprob of a pick and the most likely tokens at its position, best first.
#[derive(Debug, Clone, PartialEq)]
pub struct PickLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What [`Sampler::sample`] picked, one entry per position, rows concatenated.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Picked {
    pub tokens: Vec<u32>,
    /// Empty unless some row asked for logprobs; then one per position.
    pub logprobs: Vec<Option<PickLogprobs>>,
}

/// The sampler's graph over one step's logits, not yet evaluated.
pub struct PendingPicks {
    /// `[positions]` integer ids: the picked token of every position.
    pub tokens: Array,
    /// `tokens` as uint32, what is read back (converted in the graph, so the
    /// read needs no second evaluation).
    out: Array,
    logprobs: Option<PendingLogprobs>,
}

/// The logprob graph of the positions that asked: (position indices, `n` per
/// position, `[L]` pick logprobs, `[L, n]` top ids, `[L, n]` top logprobs).
type PendingLogprobs = (Vec<usize>, Vec<usize>, Array, Array, Array);

impl PendingPicks {
    /// The arrays an evaluation must produce.
    pub fn arrays(&self) -> Vec<Array> {
        let mut v = vec![self.out.clone()];
        if let Some((_, _, lp, ids, vals)) = &self.logprobs {
            v.extend([lp.clone(), ids.clone(), vals.clone()]);
        }
        v
    }

    /// Reads the evaluated picks.
    pub fn read(self) -> Result<Picked> {
        let tokens: Vec<u32> = self.out.as_slice::<u32>().to_vec();
        let mut logprobs = Vec::new();
        if let Some((at, ns, lp, ids, vals)) = self.logprobs {
            logprobs = vec![None; tokens.len()];
            let lp = lp.as_slice::<f32>();
            let width = ids.dim(1).max(0) as usize;
            let ids = ids.as_slice::<i32>();
            let vals = vals.as_slice::<f32>();
            for (k, (&p, &n)) in at.iter().zip(&ns).enumerate() {
                let mut top: Vec<(u32, f32)> = (0..width)
                    .map(|j| (ids[k * width + j].max(0) as u32, vals[k * width + j]))
                    .collect();
                // Best first, ties by id (as the host sampler orders them).
                top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                top.truncate(n);
                logprobs[p] = Some(PickLogprobs {
                    logprob: lp[k],
                    top,
                });
            }
        }
        Ok(Picked { tokens, logprobs })
    }
}

/// Builds the sampling graph for `[positions, vocab]` logits: `rows` in order,
/// each covering `uniforms.len()` consecutive positions.
pub fn sample(logits: &Array, rows: &[SampleRow]) -> Result<PendingPicks> {
    let positions: usize = rows.iter().map(SampleRow::positions).sum();
    if logits.ndim() != 2 || logits.dim(0) as usize != positions {
        return Err(ModelError::Invalid(format!(
            "sampling {positions} positions from logits of shape {:?}",
            logits.shape()
        )));
    }
    if rows.iter().any(|r| r.uniforms.is_empty()) {
        return Err(ModelError::Invalid("a sampled row has no positions".into()));
    }
    if let Some(r) = rows
        .iter()
        .find(|r| !r.allowed.is_empty() && r.allowed.len() != r.positions())
    {
        return Err(ModelError::Invalid(format!(
            "{} output-constraint masks for a row of {} positions",
            r.allowed.len(),
            r.positions()
        )));
    }
    let vocab = logits.dim(1);
    // Only when some row is constrained: `[positions, vocab]` booleans.
    let allowed = allowed_mask(rows, positions, vocab)?;
    // Plain greedy rows only: the first maximum of the logits as they are
    // (exact in any float dtype), nothing else in the graph.
    if rows
        .iter()
        .all(|r| r.is_greedy() && !r.penalized() && r.logprobs.is_none())
    {
        let masked;
        let logits = match &allowed {
            Some(a) => {
                masked = ops::select(a, logits, Array::from_f32(f32::NEG_INFINITY))?;
                &masked
            }
            None => logits,
        };
        let out = argmax_axis(logits, -1, false)?.as_dtype(Dtype::Uint32)?;
        return Ok(PendingPicks {
            tokens: out.clone(),
            out,
            logprobs: None,
        });
    }
    let raw = if logits.dtype() == Dtype::Float32 {
        logits.clone()
    } else {
        logits.as_dtype(Dtype::Float32)?
    };

    // Penalties: one gather and one scatter over the flattened logits.
    let mut x = raw.clone();
    if rows.iter().any(SampleRow::penalized) {
        let (mut idx, mut rep, mut sub) = (Vec::new(), Vec::new(), Vec::new());
        let mut p0 = 0usize;
        for r in rows {
            if r.penalized() {
                for p in p0..p0 + r.positions() {
                    for &(t, count) in &r.seen {
                        if (t as i32) < vocab {
                            idx.push((p as i64 * i64::from(vocab) + i64::from(t)) as i32);
                            rep.push(r.repetition_penalty);
                            sub.push(if count > 0 {
                                r.presence_penalty + r.frequency_penalty * count as f32
                            } else {
                                0.0
                            });
                        }
                    }
                }
            }
            p0 += r.positions();
        }
        let n = idx.len() as i32;
        let idx = Array::from_slice(&idx, &[n]);
        let rep = Array::from_slice(&rep, &[n]);
        let sub = Array::from_slice(&sub, &[n]);
        let flat = x.reshape(&[-1])?;
        let v = flat.take_axis(&idx, 0)?;
        let pos = v.gt(Array::from_f32(0.0))?;
        let v = ops::select(&pos, &ops::divide(&v, &rep)?, &ops::multiply(&v, &rep)?)?;
        let v = ops::subtract(&v, &sub)?;
        x = flat
            .put_along_axis(&idx, &v, 0)?
            .reshape(&[positions as i32, vocab])?;
    }

    if let Some(a) = &allowed {
        x = ops::select(a, &x, Array::from_f32(f32::NEG_INFINITY))?;
    }

    let mut tokens = argmax_axis(&x, -1, false)?.as_dtype(Dtype::Int32)?;

    // Positions that draw: gathered, so greedy rows never pay for the sort.
    let mut drawn: Vec<i32> = Vec::new();
    let (mut inv_t, mut k, mut top_p, mut min_p, mut u) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut p0 = 0usize;
    for r in rows {
        if !r.is_greedy() {
            for (j, &uj) in r.uniforms.iter().enumerate() {
                drawn.push((p0 + j) as i32);
                inv_t.push(1.0 / r.temperature);
                k.push(if r.top_k == 0 || r.top_k as i32 > vocab {
                    vocab
                } else {
                    r.top_k as i32
                });
                // >= 1 is off: a threshold no exclusive share reaches.
                top_p.push(if r.top_p >= 1.0 { 2.0 } else { r.top_p });
                min_p.push(r.min_p);
                u.push(uj as f32);
            }
        }
        p0 += r.positions();
    }
    if !drawn.is_empty() {
        let g = drawn.len() as i32;
        let col = |v: &[f32]| Array::from_slice(v, &[g, 1]);
        let at = Array::from_slice(&drawn, &[g]);
        let xs = ops::multiply(&x.take_axis(&at, 0)?, col(&inv_t))?;
        let order = ops::argsort_axis(&ops::negative(&xs)?, -1)?;
        let s = xs.take_along_axis(&order, -1)?;
        let head = s.index((.., 0..1));
        let w = ops::exp(&ops::subtract(&s, &head)?)?;
        let rank = Array::arange::<i32, i32>(0, vocab, 1)?.reshape(&[1, vocab])?;
        let keep_k = rank.lt(Array::from_slice(&k, &[g, 1]))?;
        let wk = ops::multiply(&w, &keep_k)?;
        let total = wk.sum_axis(-1, true)?;
        let before = wk.cumsum(-1, false, false)?;
        let keep_p = before.lt(ops::multiply(col(&top_p), &total)?)?;
        let keep_m = w.ge(col(&min_p))?;
        let keep = keep_k.logical_and(&keep_p)?.logical_and(&keep_m)?;
        let wf = ops::multiply(&w, &keep)?;
        let cum = wf.cumsum(-1, false, true)?;
        let kept = cum.index((.., (vocab - 1)..vocab));
        let target = ops::multiply(col(&u), &kept)?;
        let j = cum
            .le(&target)?
            .sum_axis(-1, true)?
            .as_dtype(Dtype::Int32)?;
        let last = ops::subtract(
            &keep.sum_axis(-1, true)?.as_dtype(Dtype::Int32)?,
            Array::from_int(1),
        )?;
        let j = ops::maximum(&ops::minimum(&j, &last)?, Array::from_int(0))?;
        let pick = order
            .take_along_axis(&j, -1)?
            .reshape(&[g])?
            .as_dtype(Dtype::Int32)?;
        tokens = tokens.put_along_axis(&at, &pick, 0)?;
    }

    // Logprobs of the raw logits at the positions that asked.
    let (mut at, mut ns) = (Vec::new(), Vec::new());
    let mut p0 = 0usize;
    for r in rows {
        if let Some(n) = r.logprobs {
            for j in 0..r.positions() {
                at.push(p0 + j);
                ns.push(n.min(vocab as usize));
            }
        }
        p0 += r.positions();
    }
    let logprobs = if at.is_empty() {
        None
    } else {
        let l = at.len() as i32;
        let idx: Vec<i32> = at.iter().map(|&p| p as i32).collect();
        let idx = Array::from_slice(&idx, &[l]);
        let xr = raw.take_axis(&idx, 0)?;
        let lse = xr.logsumexp_axis(-1, true)?;
        let picks = tokens.take_axis(&idx, 0)?.reshape(&[l, 1])?;
        let lp = ops::subtract(&xr.take_along_axis(&picks, -1)?, &lse)?.reshape(&[l])?;
        let n = ns.iter().copied().max().unwrap_or(0).max(1) as i32;
        let top = if n >= vocab {
            ops::broadcast_to(
                Array::arange::<i32, i32>(0, vocab, 1)?.reshape(&[1, vocab])?,
                &[l, vocab],
            )?
        } else {
            ops::argpartition_axis(&ops::negative(&xr)?, n - 1, -1)?
                .index((.., 0..n))
                .as_dtype(Dtype::Int32)?
        };
        let vals = ops::subtract(&xr.take_along_axis(&top, -1)?, &lse)?;
        Some((at, ns, lp, top, vals))
    };
    let out = tokens.as_dtype(Dtype::Uint32)?;
    Ok(PendingPicks {
        tokens,
        out,
        logprobs,
    })
}

/// The tokens every position may pick, `[positions, vocab]` booleans, or None when no
/// row is constrained (then nothing of this is in the graph). Only the rows' bitmask
/// words cross to the device (`positions * vocab / 8` bytes); unconstrained rows of
/// a batch that has constrained ones get all-ones words.
fn allowed_mask(rows: &[SampleRow], positions: usize, vocab: i32) -> Result<Option<Array>> {
    if rows.iter().all(|r| r.allowed.is_empty()) {
        return Ok(None);
    }
    let w = (vocab as usize).div_ceil(32);
    let mut bits: Vec<u32> = Vec::with_capacity(positions * w);
    for r in rows {
        for j in 0..r.positions() {
            match r.allowed.get(j) {
                None => bits.extend(std::iter::repeat_n(u32::MAX, w)),
                Some(m) => {
                    let n = m.len().min(w);
                    bits.extend_from_slice(&m[..n]);
                    bits.extend(std::iter::repeat_n(0, w - n));
                }
            }
        }
    }
    let words = Array::from_slice(&bits, &[positions as i32, w as i32, 1]);
    // Bit j of a word: (word / 2^j) % 2, exact in uint32 (mlx-rs has no shifts).
    let pow: Vec<u32> = (0..32).map(|j| 1u32 << j).collect();
    let pow = Array::from_slice(&pow, &[1, 1, 32]);
    let bit = ops::remainder(
        &ops::floor_divide(&words, &pow)?,
        Array::from_slice(&[2u32], &[1]),
    )?
    .reshape(&[positions as i32, (w * 32) as i32])?
    .index((.., 0..vocab));
    Ok(Some(bit.ne(Array::from_slice(&[0u32], &[1]))?))
}
