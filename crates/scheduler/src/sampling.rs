//! Sampling: what a row's next token is, given its logits and its
//! [`RowSampling`]. This is the host implementation of the sampling half of
//! the model contract ([`crate::Model::forward`] returns picked tokens, not
//! logits): the fake model and models whose logits already live in host memory
//! call [`HostSampler`]; a GPU model samples on its device with the same
//! semantics and the same random draws ([`uniform`]).
//!
//! Randomness is indexed, not streamed: the draw for generated token `i` of a request
//! comes from a ChaCha8 stream seeded by the request seed at word position `2 * i`. That
//! is a per-row RNG advanced exactly once per generated token, with no state to stage or
//! roll back, so a seeded request's tokens do not depend on the batch, on retries after
//! a failed step, or on preemption.

use std::collections::HashMap;

use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

use crate::model::{ModelError, RowInput, RowSampling, SeenToken, StepOutput, TokenMask};
use crate::request::{SamplingParams, TokenLogprob};

/// Candidates whose scaled logit is this far below the best one have relative
/// probability < 1e-10; dropping them before sorting keeps large vocabularies cheap and
/// changes no practical outcome (and determinism is unaffected).
const CANDIDATE_WINDOW: f32 = 23.0;

/// The uniform draw in `[0, 1)` that picks generated token `index` of a request seeded
/// with `seed` (ignored by greedy rows). Every sampler implementation uses exactly this
/// draw, so host and device pick from the same point of the same distribution.
pub fn uniform(seed: u64, index: u64) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_word_pos(u128::from(index) * 2);
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// Tokens seen so far by one request, for penalties, kept in the form the sampling
/// contract hands down ([`RowSampling::seen`]). Built lazily: requests without
/// penalties never pay for it.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct PenaltyState {
    pub seen: Vec<SeenToken>,
    ix: HashMap<u32, usize>,
}

impl PenaltyState {
    pub fn new(prompt: &[u32], generated: &[u32]) -> Self {
        let mut s = Self::default();
        for &t in prompt {
            s.entry(t).in_prompt = true;
        }
        for &t in generated {
            s.push(t);
        }
        s
    }

    fn entry(&mut self, t: u32) -> &mut SeenToken {
        let seen = &mut self.seen;
        let i = *self.ix.entry(t).or_insert_with(|| {
            seen.push(SeenToken {
                id: t,
                in_prompt: false,
                generated: 0,
            });
            seen.len() - 1
        });
        &mut self.seen[i]
    }

    pub fn push(&mut self, t: u32) {
        self.entry(t).generated += 1;
    }
}

/// Scratch buffers one sampler reuses across rows and steps.
#[derive(Debug, Default)]
pub struct Scratch {
    work: Vec<f32>,
    cand: Vec<(u32, f32)>,
}

/// Samples on the host: the contract's reference implementation.
#[derive(Debug, Default)]
pub struct HostSampler {
    scratch: Scratch,
}

impl HostSampler {
    /// Picks every wanted position of `batch` from host `logits` (row-major
    /// `[positions, vocab]`, in input order: one position per row with `want_logits`,
    /// `1 + draft` for a row with a draft). A row's position `j` draws generated token
    /// `sampling.index + j`.
    pub fn sample(
        &mut self,
        logits: &[f32],
        vocab: usize,
        batch: &[RowInput],
    ) -> Result<StepOutput, ModelError> {
        let positions: usize = batch
            .iter()
            .filter(|r| r.want_logits)
            .map(RowInput::positions)
            .sum();
        if vocab == 0 || logits.len() != positions * vocab {
            return Err(ModelError::Contract(format!(
                "{} logits for {positions} positions of vocabulary {vocab}",
                logits.len()
            )));
        }
        let any_logprobs = batch
            .iter()
            .any(|r| r.want_logits && r.sampling.logprobs.is_some());
        let mut out = StepOutput::default();
        let mut chunks = logits.chunks_exact(vocab);
        for r in batch.iter().filter(|r| r.want_logits) {
            out.rows.push(r.row);
            for j in 0..r.positions() {
                let lg = chunks
                    .next()
                    .ok_or_else(|| ModelError::Contract("logits shorter than the batch".into()))?;
                let (t, lp) = sample_position(lg, &r.sampling, j as u64, &mut self.scratch)
                    .map_err(|e| ModelError::Failed(format!("sampling row {}: {e}", r.row)))?;
                out.tokens.push(t);
                if any_logprobs {
                    out.logprobs.push(lp);
                }
            }
        }
        Ok(out)
    }
}

/// Picks the token of one position from its logits: the row's `offset`-th position
/// (generated token `s.index + offset`), with its logprobs if the row asks for them.
pub fn sample_position(
    logits: &[f32],
    s: &RowSampling,
    offset: u64,
    scratch: &mut Scratch,
) -> Result<(u32, Option<TokenLogprob>), String> {
    if logits.is_empty() {
        return Err("empty logits".into());
    }
    let p = &s.params;
    let penalize = p.has_penalties() && !s.seen.is_empty();
    let allowed = match s.allowed.len() {
        0 => None,
        _ => Some(
            s.allowed
                .get(offset as usize)
                .ok_or("no output-constraint mask for this position")?,
        ),
    };
    let penalized: &[f32] = if penalize || allowed.is_some() {
        scratch.work.clear();
        scratch.work.extend_from_slice(logits);
        if penalize {
            apply_penalties(&mut scratch.work, p, &s.seen);
        }
        if let Some(mask) = allowed {
            apply_mask(&mut scratch.work, mask);
        }
        &scratch.work
    } else {
        logits
    };
    let mut token = if p.is_greedy() {
        argmax(penalized).ok_or("logits are all NaN")?
    } else {
        let u = uniform(s.seed, s.index + offset);
        draw(penalized, p, u, &mut scratch.cand)?
    };
    if let Some(mask) = allowed {
        if !mask.allows(token) {
            // Every allowed logit is -inf or NaN (argmax then returns the first value
            // that is not NaN): the smallest allowed id, as any pick among equals.
            token = mask
                .first()
                .ok_or("the output constraint allows no token")?;
        }
    }
    let logprob = match s.logprobs {
        Some(n) => Some(logprobs(logits, token, n)?),
        None => None,
    };
    Ok((token, logprob))
}

fn apply_penalties(x: &mut [f32], p: &SamplingParams, seen: &[SeenToken]) {
    for t in seen {
        let Some(v) = x.get_mut(t.id as usize) else {
            continue;
        };
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            *v = if *v > 0.0 { *v / r } else { *v * r };
        }
        if t.generated > 0 {
            *v -= p.presence_penalty + p.frequency_penalty * t.generated as f32;
        }
    }
}

/// Sets the logits of the tokens `mask` does not allow (and those past its end) to -inf.
fn apply_mask(x: &mut [f32], mask: &TokenMask) {
    let words = mask.words();
    for (i, chunk) in x.chunks_mut(32).enumerate() {
        let w = words.get(i).copied().unwrap_or(0);
        if w == u32::MAX {
            continue;
        }
        for (b, v) in chunk.iter_mut().enumerate() {
            if w >> b & 1 == 0 {
                *v = f32::NEG_INFINITY;
            }
        }
    }
}

/// First index of the largest value; NaN never wins.
fn argmax(x: &[f32]) -> Option<u32> {
    // Greedy decoding runs this once per row per step, so it is a large part of the host
    // cost at big batch sizes. One branch-free pass of lane-wise maxima, which compiles
    // to packed max instructions on baseline x86-64 (`v > m` is false for NaN, so NaN
    // never wins), reduced pairwise (a scalar fold over the lanes is one long dependency
    // chain); then a scan for the first chunk holding the maximum, a whole chunk per
    // (predictable) branch, and its first occurrence within that chunk.
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut w = LANES / 2;
    while w > 0 {
        let (lo, hi) = lanes.split_at_mut(w);
        for (a, &b) in lo.iter_mut().zip(&hi[..w]) {
            *a = if b > *a { b } else { *a };
        }
        w /= 2;
    }
    let max = tail
        .iter()
        .fold(lanes[0], |m, &v| if v > m { v } else { m });
    if max == f32::NEG_INFINITY {
        // Only -inf and NaN: the first value that is not NaN, if any.
        return x.iter().position(|v| !v.is_nan()).map(|i| i as u32);
    }
    for (ci, c) in x.chunks_exact(LANES).enumerate() {
        if c.iter().fold(false, |hit, &v| hit | (v == max)) {
            let j = c.iter().position(|&v| v == max)?;
            return Some((ci * LANES + j) as u32);
        }
    }
    let j = tail.iter().position(|&v| v == max)?;
    Some((x.len() - tail.len() + j) as u32)
}

fn draw(x: &[f32], p: &SamplingParams, u: f64, cand: &mut Vec<(u32, f32)>) -> Result<u32, String> {
    let inv_t = 1.0 / p.temperature;
    let max = x
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return Err("logits have no finite maximum".into());
    }
    let floor = max * inv_t - CANDIDATE_WINDOW;
    cand.clear();
    cand.extend(
        x.iter()
            .enumerate()
            .map(|(i, &v)| (i as u32, v * inv_t))
            .filter(|&(_, v)| v >= floor),
    );
    // Descending by value, ties by id, so the order (and so the draw) is deterministic.
    let by_value = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let k = p.top_k as usize;
    if k > 0 && k < cand.len() {
        cand.select_nth_unstable_by(k - 1, by_value);
        cand.truncate(k);
    }
    cand.sort_unstable_by(by_value);
    let top = cand[0].1;
    let mut total = 0.0f64;
    for c in cand.iter_mut() {
        c.1 = (c.1 - top).exp();
        total += f64::from(c.1);
    }
    let mut keep = cand.len();
    if p.top_p < 1.0 {
        let mut cum = 0.0f64;
        for (i, c) in cand.iter().enumerate() {
            cum += f64::from(c.1) / total;
            if cum >= f64::from(p.top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        // cand[0] has weight 1 (the maximum), so the threshold is min_p itself.
        let n = cand[..keep].iter().take_while(|c| c.1 >= p.min_p).count();
        keep = n.max(1);
    }
    cand.truncate(keep);
    let kept: f64 = cand.iter().map(|c| f64::from(c.1)).sum();
    let mut target = u * kept;
    for c in cand.iter() {
        target -= f64::from(c.1);
        if target < 0.0 {
            return Ok(c.0);
        }
    }
    Ok(cand[cand.len() - 1].0)
}

/// Log-softmax of the raw model logits: the chosen token and the `n` best.
fn logprobs(x: &[f32], token: u32, n: usize) -> Result<TokenLogprob, String> {
    let max = x
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return Err("logits have no finite maximum".into());
    }
    let lse = max
        + x.iter()
            .filter(|v| !v.is_nan())
            .map(|&v| (v - max).exp())
            .sum::<f32>()
            .ln();
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &v) in x.iter().enumerate() {
            if v.is_nan() || (top.len() == n && v <= top[n - 1].1) {
                continue;
            }
            let pos = top.partition_point(|&(_, t)| t >= v);
            top.insert(pos, (i as u32, v));
            top.truncate(n);
        }
    }
    let lp = x.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY) - lse;
    Ok(TokenLogprob {
        id: token,
        logprob: lp,
        top: top.into_iter().map(|(i, v)| (i, v - lse)).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(p: &SamplingParams, index: u64) -> RowSampling {
        RowSampling {
            params: p.clone(),
            seed: 7,
            index,
            ..Default::default()
        }
    }

    fn sample(logits: &[f32], s: &RowSampling, scratch: &mut Scratch) -> Result<u32, String> {
        sample_position(logits, s, 0, scratch).map(|(t, _)| t)
    }

    #[test]
    fn greedy_picks_first_max_and_skips_nan() {
        let p = SamplingParams::default();
        let mut s = Scratch::default();
        let out = sample(&[0.0, f32::NAN, 3.0, 3.0, 1.0], &ctx(&p, 0), &mut s).unwrap();
        assert_eq!(out, 2);
        // Long enough for the lane path, with ties across lanes and a NaN.
        let mut v: Vec<f32> = (0..100).map(|i| (i % 13) as f32).collect();
        v[3] = f32::NAN;
        assert_eq!(argmax(&v), Some(12));
        v[99] = 50.0;
        assert_eq!(argmax(&v), Some(99));
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), Some(0));
        assert!(sample(&[f32::NAN], &ctx(&p, 0), &mut s).is_err());
    }

    #[test]
    fn argmax_matches_a_naive_scan() {
        let naive = |x: &[f32]| {
            let mut best: Option<usize> = None;
            for (i, &v) in x.iter().enumerate() {
                if !v.is_nan() && best.is_none_or(|b| v > x[b]) {
                    best = Some(i);
                }
            }
            best.map(|i| i as u32)
        };
        let mut h = 1u64;
        for len in [1usize, 5, 15, 16, 17, 31, 32, 33, 100, 256, 257] {
            for _ in 0..50 {
                let x: Vec<f32> = (0..len)
                    .map(|_| {
                        h = crate::util::mix64(h);
                        match h % 11 {
                            0 => f32::NAN,
                            1 => f32::NEG_INFINITY,
                            _ => (h % 7) as f32, // many ties
                        }
                    })
                    .collect();
                assert_eq!(argmax(&x), naive(&x), "{x:?}");
            }
        }
    }

    #[test]
    fn seeded_draws_are_reproducible_and_indexed() {
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let logits: Vec<f32> = (0..64).map(|i| (i % 7) as f32 * 0.3).collect();
        let mut s = Scratch::default();
        let a: Vec<u32> = (0..50)
            .map(|i| sample(&logits, &ctx(&p, i), &mut s).unwrap())
            .collect();
        let b: Vec<u32> = (0..50)
            .rev()
            .map(|i| sample(&logits, &ctx(&p, i), &mut s).unwrap())
            .collect();
        let b: Vec<u32> = b.into_iter().rev().collect();
        assert_eq!(a, b);
        let distinct: std::collections::HashSet<u32> = a.iter().copied().collect();
        assert!(distinct.len() > 3, "temperature 1 should spread: {a:?}");
    }

    #[test]
    fn top_k_top_p_min_p_restrict_support() {
        let logits = [5.0, 4.9, 4.8, 0.0, -1.0, -2.0];
        let mut s = Scratch::default();
        for (params, allowed) in [
            (
                SamplingParams {
                    temperature: 1.0,
                    top_k: 2,
                    ..Default::default()
                },
                vec![0, 1],
            ),
            (
                SamplingParams {
                    temperature: 1.0,
                    top_p: 0.5,
                    ..Default::default()
                },
                vec![0, 1],
            ),
            (
                SamplingParams {
                    temperature: 1.0,
                    min_p: 0.5,
                    ..Default::default()
                },
                vec![0, 1, 2],
            ),
        ] {
            for i in 0..200 {
                let t = sample(&logits, &ctx(&params, i), &mut s).unwrap();
                assert!(allowed.contains(&t), "{params:?} drew {t}");
            }
        }
    }

    #[test]
    fn penalties_change_the_choice() {
        let logits = [2.0, 1.9, 0.0];
        let mut s = Scratch::default();
        let pen = PenaltyState::new(&[], &[0, 0]);
        let p = SamplingParams {
            frequency_penalty: 0.1,
            ..Default::default()
        };
        let c = RowSampling {
            params: p.clone(),
            seen: pen.seen.clone(),
            ..Default::default()
        };
        assert_eq!(sample(&logits, &c, &mut s).unwrap(), 1);
        let p = SamplingParams {
            presence_penalty: 0.05,
            ..Default::default()
        };
        let c = RowSampling {
            params: p.clone(),
            seen: pen.seen.clone(),
            ..Default::default()
        };
        assert_eq!(sample(&logits, &c, &mut s).unwrap(), 0);
        let pen = PenaltyState::new(&[0], &[]);
        let p = SamplingParams {
            repetition_penalty: 1.2,
            ..Default::default()
        };
        let c = RowSampling {
            params: p.clone(),
            seen: pen.seen.clone(),
            ..Default::default()
        };
        assert_eq!(sample(&logits, &c, &mut s).unwrap(), 1);
    }

    #[test]
    fn logprobs_are_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let lp = logprobs(&logits, 0, 2).unwrap();
        let z: f32 = logits.iter().map(|v| v.exp()).sum();
        assert!((lp.logprob - (1.0f32.exp() / z).ln()).abs() < 1e-5);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
        assert!((lp.top[0].1 - (3.0f32.exp() / z).ln()).abs() < 1e-5);
    }

    fn mask_of(vocab: usize, allowed: &[u32]) -> TokenMask {
        let mut w = vec![0u32; vocab.div_ceil(32)];
        for &t in allowed {
            w[t as usize / 32] |= 1 << (t % 32);
        }
        TokenMask::from_words(w)
    }

    #[test]
    fn a_mask_restricts_greedy_and_drawn_picks() {
        let mut s = Scratch::default();
        let logits: Vec<f32> = (0..70).map(|i| (i % 17) as f32).collect();
        let allowed = [3u32, 40, 65];
        let mask = mask_of(70, &allowed);
        assert_eq!(mask.count(), 3);
        assert_eq!(mask.first(), Some(3));
        assert!(mask.allows(65) && !mask.allows(64) && !mask.allows(1000));
        let greedy = RowSampling {
            allowed: vec![mask.clone()],
            ..ctx(&SamplingParams::default(), 0)
        };
        // 16 is the best logit overall (id 16); among the allowed, 65 % 17 = 14 wins.
        assert_eq!(sample(&logits, &greedy, &mut s).unwrap(), 65);
        let hot = SamplingParams {
            temperature: 5.0,
            ..SamplingParams::default()
        };
        let mut seen = std::collections::HashSet::new();
        for index in 0..200 {
            let c = RowSampling {
                allowed: vec![mask.clone()],
                ..ctx(&hot, index)
            };
            let (t, lp) = sample_position(&logits, &c, 0, &mut s).unwrap();
            assert!(allowed.contains(&t), "drew {t}");
            assert!(lp.is_none());
            seen.insert(t);
        }
        assert_eq!(seen.len(), 3, "every allowed token is drawn at some point");
        // Logprobs stay those of the raw logits.
        let c = RowSampling {
            allowed: vec![mask.clone()],
            logprobs: Some(1),
            ..ctx(&SamplingParams::default(), 0)
        };
        let (_, lp) = sample_position(&logits, &c, 0, &mut s).unwrap();
        assert_eq!(lp.unwrap().top[0].0, 16);
        // Allowed tokens whose logits are all -inf: the smallest allowed id.
        let mut dead = logits.clone();
        for &t in &allowed {
            dead[t as usize] = f32::NEG_INFINITY;
        }
        assert_eq!(sample(&dead, &greedy, &mut s).unwrap(), 3);
        // A mask allowing nothing is an error, not a pick.
        let none = RowSampling {
            allowed: vec![mask_of(70, &[])],
            ..ctx(&SamplingParams::default(), 0)
        };
        assert!(sample(&dead, &none, &mut s).is_err());
        // A row with a draft has a mask per position: position 1 picks under the
        // second, and a position without one is an error.
        let two = RowSampling {
            allowed: vec![mask.clone(), mask_of(70, &[5, 30])],
            ..ctx(&SamplingParams::default(), 0)
        };
        let at = |j| sample_position(&logits, &two, j, &mut Scratch::default());
        assert_eq!(at(0).unwrap().0, 65);
        assert_eq!(at(1).unwrap().0, 30);
        assert!(at(2).is_err());
    }
}
