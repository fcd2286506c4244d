//! Times batched decode steps of a model directory: `cargo run --release -p
//! weft-models --example decode_timing -- <model dir> [batch] [prompt] [steps]`
//! (`HOST_GEMM=0|1` picks MLX matmuls or the packed CPU GEMM; `TWO_LANES=1`
//! runs the prefill as two interleaved halves on two lanes, as the runner does;
//! `DEQUANTIZE=0` keeps quantized weights quantized).
use std::time::Instant;

use mlx_rs::Array;
use weft_models::{load, KvCache, LoadOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(&args[1]);
    let b: i32 = args.get(2).map_or(Ok(32), |s| s.parse())?;
    let p: i32 = args.get(3).map_or(Ok(64), |s| s.parse())?;
    let steps: usize = args.get(4).map_or(Ok(10), |s| s.parse())?;
    let m = load(
        &dir,
        LoadOptions {
            host_gemm: std::env::var("HOST_GEMM").ok().map(|v| v != "0"),
            dequantize: std::env::var("DEQUANTIZE").ok().map(|v| v != "0"),
            ..LoadOptions::default()
        },
    )?
    .model;
    let ragged = std::env::var_os("RAGGED").is_some();
    let mut cache = KvCache::new(m.num_layers(), b as usize);
    let t0 = Instant::now();
    if ragged {
        // Rows of different lengths merged into one left-padded batch.
        let mut merged: Option<KvCache> = None;
        for r in 0..b {
            let n = p + r % 8;
            let ids: Vec<i32> = (0..n)
                .map(|i| 100 + ((r * 31 + i) * 7919) % 40000)
                .collect();
            let mut one = KvCache::new(m.num_layers(), 1);
            m.forward(&Array::from_slice(&ids, &[1, n]), &mut one, true)?
                .eval()?;
            one.commit();
            match merged.as_mut() {
                Some(c) => c.merge(&one)?,
                None => merged = Some(one),
            }
        }
        cache = merged.unwrap_or(cache);
    } else {
        // Earlier rounds warm the allocator; the last one's cache is decoded.
        let rounds: i32 = std::env::var("PREFILL_ROUNDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1);
        for r in 0..rounds {
            cache = KvCache::new(m.num_layers(), b as usize);
            let ids: Vec<i32> = (0..b * p).map(|i| 100 + (i * 7919 + r) % 40000).collect();
            let t = Instant::now();
            if std::env::var_os("TWO_LANES").is_some() {
                // The prefill as two halves on two lanes, interleaved.
                let lanes = weft_models::Lanes::cpu(2);
                let _blas = lanes.single_threaded_blas();
                let h = (b / 2 * p) as usize;
                let (ta, tb) = (
                    Array::from_slice(&ids[..h], &[b / 2, p]),
                    Array::from_slice(&ids[h..], &[b - b / 2, p]),
                );
                let mut ca = KvCache::new(m.num_layers(), (b / 2) as usize);
                let mut cb = KvCache::new(m.num_layers(), (b - b / 2) as usize);
                let out = m.forward_interleaved(
                    vec![(0, &ta, &mut ca, true), (1, &tb, &mut cb, true)],
                    &lanes,
                    &mut |_| Ok(()),
                )?;
                mlx_rs::transforms::eval(&out)?;
            } else {
                let l = m.forward(&Array::from_slice(&ids, &[b, p]), &mut cache, true)?;
                l.eval()?;
                cache.commit();
            }
            println!(
                "prefill round {r}: {:.1} ms",
                t.elapsed().as_secs_f64() * 1e3
            );
        }
    }
    println!(
        "prefill B={b} T={p}: {:.1} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    // DECODE_T > 1 times a verify step of speculative decoding (T tokens per row).
    let dt: i32 = std::env::var("DECODE_T")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let tok: Vec<i32> = (0..b * dt).map(|i| 200 + i).collect();
    let tok = Array::from_slice(&tok, &[b, dt]);
    let mut times = vec![];
    for _ in 0..steps {
        let t = Instant::now();
        let l = m.forward(&tok, &mut cache, true)?;
        l.eval()?;
        cache.commit();
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    println!(
        "decode B={b}: median {:.1} ms/step ({:.1} tok/s)",
        times[steps / 2],
        b as f64 * 1e3 / times[steps / 2]
    );
    Ok(())
}
