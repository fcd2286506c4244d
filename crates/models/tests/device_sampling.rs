//! The device sampler against the contract's host reference
//! (`weft_scheduler::sampling`): greedy picks identical, stochastic picks from
//! the same draw agreeing, logprobs equal, seeded picks independent of the
//! batch, and each sampler's empirical distribution matching its definition.
//! Runs on MLX's CPU backend, the same ops the GPU runs.

use mlx_rs::Array;
use weft_models::sampler::{sample, SampleRow};
use weft_scheduler::sampling::{sample_position, uniform, Scratch};
use weft_scheduler::{RowSampling, SamplingParams, SeenToken, TokenMask};

/// Deterministic pseudo-random logits in [-4, 4), with exact ties sprinkled in.
fn logits(rows: usize, vocab: usize, seed: u64) -> Vec<f32> {
    let mut h = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..rows * vocab)
        .map(|_| {
            h ^= h << 13;
            h ^= h >> 7;
            h ^= h << 17;
            if h.is_multiple_of(97) {
                3.0 // a tie at a high value
            } else {
                ((h >> 11) % 8000) as f32 / 1000.0 - 4.0
            }
        })
        .collect()
}

fn device(data: &[f32], vocab: usize, rows: &[SampleRow]) -> weft_models::Picked {
    let p: usize = rows.iter().map(|r| r.uniforms.len()).sum();
    let a = Array::from_slice(data, &[p as i32, vocab as i32]);
    let pending = sample(&a, rows).expect("sampling graph");
    mlx_rs::transforms::eval(pending.arrays().iter()).expect("eval");
    pending.read().expect("read picks")
}

/// The contract's form of a device row (seed and index give the draws).
fn contract(
    p: &SamplingParams,
    seed: u64,
    index: u64,
    seen: &[SeenToken],
    lp: Option<usize>,
) -> RowSampling {
    RowSampling {
        params: p.clone(),
        seed,
        index,
        logprobs: lp,
        seen: seen.to_vec(),
        allowed: Vec::new(),
    }
}

fn row_of(s: &RowSampling, positions: u64) -> SampleRow {
    let p = &s.params;
    SampleRow {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        seen: s.seen.iter().map(|t| (t.id, t.generated)).collect(),
        uniforms: (0..positions)
            .map(|j| uniform(s.seed, s.index + j))
            .collect(),
        logprobs: s.logprobs,
        allowed: s.allowed.iter().map(|m| m.shared()).collect(),
    }
}

fn host(data: &[f32], s: &RowSampling, offset: u64) -> (u32, Option<weft_scheduler::TokenLogprob>) {
    let mut scratch = Scratch::default();
    sample_position(data, s, offset, &mut scratch).expect("host sample")
}

fn params(t: f32, k: u32, top_p: f32, min_p: f32) -> SamplingParams {
    SamplingParams {
        temperature: t,
        top_k: k,
        top_p,
        min_p,
        ..Default::default()
    }
}

#[test]
fn greedy_with_and_without_penalties_equals_the_host() {
    let (n, vocab) = (48, 777);
    let data = logits(n, vocab, 1);
    let seen: Vec<SeenToken> = (0..40)
        .map(|i| SeenToken {
            id: (i * 19) % vocab as u32,
            in_prompt: i % 3 == 0,
            generated: i % 4,
        })
        .collect();
    let plain = SamplingParams::default();
    let pen = SamplingParams {
        repetition_penalty: 1.3,
        presence_penalty: 0.4,
        frequency_penalty: 0.2,
        ..Default::default()
    };
    let contracts: Vec<RowSampling> = (0..n)
        .map(|i| {
            if i % 2 == 0 {
                contract(&plain, 0, 0, &[], None)
            } else {
                contract(&pen, 0, 0, &seen, None)
            }
        })
        .collect();
    let rows: Vec<SampleRow> = contracts.iter().map(|c| row_of(c, 1)).collect();
    let got = device(&data, vocab, &rows);
    for (i, c) in contracts.iter().enumerate() {
        let (want, _) = host(&data[i * vocab..(i + 1) * vocab], c, 0);
        assert_eq!(got.tokens[i], want, "row {i}");
    }
    // The penalties changed some picks (the test would pass vacuously otherwise).
    let unpenalized: Vec<SampleRow> = contracts
        .iter()
        .map(|_| row_of(&contract(&plain, 0, 0, &[], None), 1))
        .collect();
    let base = device(&data, vocab, &unpenalized);
    // All plain greedy: the argmax-only graph, also equal to the host.
    for i in 0..n {
        let plain_row = contract(&plain, 0, 0, &[], None);
        let (want, _) = host(&data[i * vocab..(i + 1) * vocab], &plain_row, 0);
        assert_eq!(base.tokens[i], want, "plain row {i}");
    }
    assert!(got.tokens.iter().zip(&base.tokens).any(|(a, b)| a != b));
}

#[test]
fn stochastic_picks_from_the_same_draw_agree_with_the_host() {
    let vocab = 300;
    let configs = [
        params(0.7, 0, 1.0, 0.0),
        params(1.0, 20, 1.0, 0.0),
        params(1.2, 0, 0.8, 0.0),
        params(0.9, 0, 1.0, 0.1),
        params(1.5, 50, 0.9, 0.05),
    ];
    let n = 400;
    let data = logits(n, vocab, 2);
    let contracts: Vec<RowSampling> = (0..n)
        .map(|i| {
            contract(
                &configs[i % configs.len()],
                1000 + i as u64,
                i as u64 * 3,
                &[],
                None,
            )
        })
        .collect();
    let rows: Vec<SampleRow> = contracts.iter().map(|c| row_of(c, 1)).collect();
    let got = device(&data, vocab, &rows);
    let mut agree = 0;
    for (i, c) in contracts.iter().enumerate() {
        let (want, _) = host(&data[i * vocab..(i + 1) * vocab], c, 0);
        agree += usize::from(got.tokens[i] == want);
    }
    // Only a draw within f32 rounding of a cumulative boundary may differ.
    assert!(agree * 100 >= n * 99, "{agree} of {n} agree");
}

#[test]
fn seeded_picks_do_not_depend_on_the_batch() {
    let vocab = 500;
    let p = params(1.0, 40, 0.95, 0.0);
    let me = contract(&p, 42, 7, &[], None);
    let data = logits(64, vocab, 3);
    let alone = device(&data[..vocab], vocab, &[row_of(&me, 1)]);
    // The same row first, last and in the middle of 64 rows with other params.
    for at in [0usize, 31, 63] {
        let rows: Vec<SampleRow> = (0..64)
            .map(|i| {
                if i == at {
                    row_of(&me, 1)
                } else {
                    row_of(
                        &contract(
                            &params(0.5 + i as f32 / 64.0, i as u32, 1.0, 0.0),
                            i as u64,
                            0,
                            &[],
                            None,
                        ),
                        1,
                    )
                }
            })
            .collect();
        let mut batch = data.clone();
        batch[at * vocab..(at + 1) * vocab].copy_from_slice(&data[..vocab]);
        let got = device(&batch, vocab, &rows);
        assert_eq!(got.tokens[at], alone.tokens[0], "row at {at}");
    }
}

/// Probabilities of the restricted distribution, by definition (f64).
fn expected(x: &[f32], p: &SamplingParams) -> Vec<f64> {
    let mut c: Vec<(usize, f64)> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| (i, f64::from(v) / f64::from(p.temperature)))
        .collect();
    c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        c.truncate(p.top_k as usize);
    }
    let top = c[0].1;
    let w: Vec<f64> = c.iter().map(|&(_, v)| (v - top).exp()).collect();
    let total: f64 = w.iter().sum();
    let mut keep = c.len();
    if p.top_p < 1.0 {
        let mut before = 0.0;
        for (i, wi) in w.iter().enumerate() {
            if before / total >= f64::from(p.top_p) {
                keep = i;
                break;
            }
            before += wi;
        }
    }
    keep = w[..keep]
        .iter()
        .take_while(|&&wi| wi >= f64::from(p.min_p))
        .count()
        .max(1);
    let kept: f64 = w[..keep].iter().sum();
    let mut out = vec![0.0; x.len()];
    for (j, &(i, _)) in c[..keep].iter().enumerate() {
        out[i] = w[j] / kept;
    }
    out
}

#[test]
fn each_sampler_draws_its_distribution() {
    let x: Vec<f32> = vec![2.0, 1.5, 1.2, 0.8, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0];
    let vocab = x.len();
    let draws = 6000;
    for p in [
        params(1.0, 0, 1.0, 0.0),
        params(0.5, 0, 1.0, 0.0),
        params(1.0, 3, 1.0, 0.0),
        params(1.0, 0, 0.7, 0.0),
        params(1.0, 0, 1.0, 0.2),
        params(2.0, 6, 0.9, 0.1),
    ] {
        let want = expected(&x, &p);
        let data: Vec<f32> = x.iter().copied().cycle().take(draws * vocab).collect();
        let rows: Vec<SampleRow> = (0..draws)
            .map(|i| row_of(&contract(&p, 9, i as u64, &[], None), 1))
            .collect();
        let got = device(&data, vocab, &rows);
        let mut freq = vec![0usize; vocab];
        for &t in &got.tokens {
            freq[t as usize] += 1;
        }
        for (t, (&f, &w)) in freq.iter().zip(&want).enumerate() {
            let e = f as f64 / draws as f64;
            if w == 0.0 {
                assert_eq!(f, 0, "{p:?}: token {t} is outside the support");
            } else {
                // Five standard errors of a binomial proportion.
                let tol = 5.0 * (w * (1.0 - w) / draws as f64).sqrt() + 1e-3;
                assert!(
                    (e - w).abs() <= tol,
                    "{p:?}: token {t} drawn {e:.4}, expected {w:.4}"
                );
            }
        }
    }
}

#[test]
fn drafts_logprobs_and_mixed_rows() {
    let vocab = 257;
    let data = logits(6, vocab, 4);
    // A greedy row with a 2-token draft (3 positions) asking logprobs, a seeded
    // row, and a greedy row with top-5 logprobs.
    let a = contract(&SamplingParams::default(), 0, 10, &[], Some(3));
    let b = contract(&params(0.8, 0, 0.9, 0.0), 5, 2, &[], None);
    let c = contract(&SamplingParams::default(), 0, 0, &[], Some(5));
    let rows = [row_of(&a, 3), row_of(&b, 2), row_of(&c, 1)];
    let got = device(&data, vocab, &rows);
    assert_eq!(got.tokens.len(), 6);
    assert_eq!(got.logprobs.len(), 6);
    let plan = [(&a, 0u64), (&a, 1), (&a, 2), (&b, 0), (&b, 1), (&c, 0)];
    for (i, (s, off)) in plan.iter().enumerate() {
        let (t, lp) = host(&data[i * vocab..(i + 1) * vocab], s, *off);
        assert_eq!(got.tokens[i], t, "position {i}");
        match (lp, &got.logprobs[i]) {
            (None, None) => {}
            (Some(h), Some(d)) => {
                assert!((h.logprob - d.logprob).abs() < 1e-4, "position {i}");
                assert_eq!(
                    h.top.iter().map(|x| x.0).collect::<Vec<_>>(),
                    d.top.iter().map(|x| x.0).collect::<Vec<_>>(),
                    "position {i}"
                );
                for (x, y) in h.top.iter().zip(&d.top) {
                    assert!((x.1 - y.1).abs() < 1e-4);
                }
            }
            (h, d) => panic!("position {i}: host {h:?}, device {d:?}"),
        }
    }
}

/// A mask allowing every `stride`-th token from `first` (and nothing past `vocab`).
fn mask(vocab: usize, first: usize, stride: usize) -> TokenMask {
    let mut w = vec![0u32; vocab.div_ceil(32)];
    for t in (first..vocab).step_by(stride) {
        w[t / 32] |= 1 << (t % 32);
    }
    TokenMask::from_words(w)
}

#[test]
fn constrained_rows_pick_inside_their_mask_as_the_host_does() {
    // A vocabulary that is not a multiple of 32 (the last word is partial).
    let vocab = 1000;
    let n = 48;
    let data = logits(n, vocab, 11);
    let seen = [SeenToken {
        id: 7,
        in_prompt: true,
        generated: 2,
    }];
    let rows: Vec<RowSampling> = (0..n)
        .map(|i| {
            let p = match i % 4 {
                0 => params(0.0, 0, 1.0, 0.0),
                1 => params(0.9, 40, 0.95, 0.0),
                2 => SamplingParams {
                    repetition_penalty: 1.3,
                    frequency_penalty: 0.5,
                    ..params(0.0, 0, 1.0, 0.0)
                },
                _ => params(1.0, 0, 1.0, 0.05),
            };
            let mut s = contract(&p, 100 + i as u64, 3, &seen, (i % 5 == 0).then_some(3));
            // Every third row unconstrained; the others allow a sparse, varying set.
            if i % 3 != 0 {
                s.allowed = vec![mask(vocab, i % 7, 3 + i % 11)];
            }
            s
        })
        .collect();
    let sample_rows: Vec<SampleRow> = rows.iter().map(|s| row_of(s, 1)).collect();
    let got = device(&data, vocab, &sample_rows);
    let mut drawn_agree = 0;
    let mut drawn = 0;
    for (i, s) in rows.iter().enumerate() {
        let x = &data[i * vocab..(i + 1) * vocab];
        let (want, lp) = host(x, s, 0);
        let t = got.tokens[i];
        if let Some(m) = s.allowed.first() {
            assert!(m.allows(t), "row {i} picked {t} outside its mask");
        }
        if s.params.is_greedy() {
            assert_eq!(t, want, "row {i} greedy");
        } else {
            drawn += 1;
            drawn_agree += usize::from(t == want);
        }
        // Logprobs are the raw logits' on both sides, the mask notwithstanding.
        if let Some(lp) = lp {
            let d = got.logprobs[i].as_ref().expect("device logprobs");
            assert_eq!(
                d.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                lp.top.iter().map(|t| t.0).collect::<Vec<_>>()
            );
        }
    }
    assert!(
        drawn_agree * 100 >= drawn * 90,
        "{drawn_agree} of {drawn} draws agree"
    );
    // No constrained row: no mask in the graph, the same picks as before.
    let plain: Vec<SampleRow> = rows
        .iter()
        .map(|s| {
            let mut r = row_of(s, 1);
            r.allowed.clear();
            r
        })
        .collect();
    let free = device(&data, vocab, &plain);
    for (i, s) in rows.iter().enumerate() {
        let x = &data[i * vocab..(i + 1) * vocab];
        let unmasked = RowSampling {
            allowed: Vec::new(),
            ..s.clone()
        };
        if s.params.is_greedy() {
            assert_eq!(free.tokens[i], host(x, &unmasked, 0).0, "row {i}");
        }
    }
    // A greedy-only batch takes the argmax path with the mask applied.
    let greedy: Vec<SampleRow> = (0..n)
        .map(|i| SampleRow {
            allowed: vec![mask(vocab, i, 5).shared()],
            ..SampleRow::default()
        })
        .collect();
    let g = device(&data, vocab, &greedy);
    for i in 0..n {
        let s = RowSampling {
            allowed: vec![mask(vocab, i, 5)],
            ..RowSampling::default()
        };
        let x = &data[i * vocab..(i + 1) * vocab];
        assert_eq!(g.tokens[i], host(x, &s, 0).0, "greedy row {i}");
        assert_eq!(g.tokens[i] as usize % 5, i % 5);
    }
}

#[test]
fn a_constrained_draft_row_picks_each_position_under_its_own_mask() {
    // Rows of 1 + draft positions (a speculating constrained row: each position's
    // mask is the constraint's state after the draft tokens before it), among
    // unconstrained rows; greedy-only batches and mixed ones alike.
    let vocab = 1000;
    for drawn in [false, true] {
        let mut rows = Vec::new();
        let mut samplings = Vec::new();
        for i in 0..12usize {
            let positions = 1 + i % 4;
            let p = if drawn && i % 2 == 1 {
                params(0.9, 0, 1.0, 0.0)
            } else {
                params(0.0, 0, 1.0, 0.0)
            };
            let mut s = contract(&p, 40 + i as u64, 5, &[], None);
            if i % 3 != 2 {
                s.allowed = (0..positions)
                    .map(|j| mask(vocab, (i + 3 * j) % 11, 7 + j))
                    .collect();
            }
            rows.push(row_of(&s, positions as u64));
            samplings.push((s, positions));
        }
        let total: usize = samplings.iter().map(|(_, n)| n).sum();
        let data = logits(total, vocab, 23);
        let got = device(&data, vocab, &rows);
        let mut at = 0;
        let mut masked = 0;
        for (i, (s, positions)) in samplings.iter().enumerate() {
            for j in 0..*positions {
                let x = &data[at * vocab..(at + 1) * vocab];
                let t = got.tokens[at];
                if let Some(m) = s.allowed.get(j) {
                    assert!(
                        m.allows(t),
                        "row {i} position {j} picked {t} outside its mask"
                    );
                    masked += 1;
                }
                if s.params.is_greedy() {
                    assert_eq!(t, host(x, s, j as u64).0, "row {i} position {j}");
                }
                at += 1;
            }
        }
        assert!(masked > 10);
    }
    // A row whose masks do not cover its positions is refused, not sampled.
    let s = RowSampling {
        allowed: vec![mask(vocab, 0, 3)],
        ..RowSampling::default()
    };
    let bad = row_of(&s, 2);
    let data = logits(2, vocab, 5);
    let arr = Array::from_slice(&data, &[2, vocab as i32]);
    assert!(sample(&arr, &[bad]).is_err());
}
