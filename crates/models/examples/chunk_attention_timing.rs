//! Where a prefill chunk's attention at depth spends its time on the CPU: the
//! gather of the row's context out of the paged pool, and the attention over
//! it, per layer, at the default model's shape (9 query heads, 3 KV heads,
//! head_dim 64, f32, 16-token blocks).
//!
//! `cargo run --release -p weft-models --example chunk_attention_timing -- [DEPTHS] [CHUNK]`
//! (DEPTHS comma-separated, default 1000,3000,7000; CHUNK default 16).

use std::time::Instant;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let depths: Vec<usize> = args
        .get(1)
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![1000, 3000, 7000]);
    let chunk: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(16);
    let (heads, kvh, hd, bs) = (9usize, 3usize, 64usize, 16usize);
    let layers = 30;
    for &depth in &depths {
        let keys = depth + chunk;
        let nb = keys.div_ceil(bs);
        let blocks = nb + 8;
        let pool = mlx_rs::random::normal::<f32>(
            &[blocks as i32, kvh as i32, bs as i32, hd as i32],
            None,
            None,
            None,
        )?;
        let vpool = mlx_rs::random::normal::<f32>(
            &[blocks as i32, kvh as i32, bs as i32, hd as i32],
            None,
            None,
            None,
        )?;
        let q = mlx_rs::random::normal::<f32>(
            &[1, heads as i32, chunk as i32, hd as i32],
            None,
            None,
            None,
        )?;
        mlx_rs::transforms::eval([&pool, &vpool, &q])?;
        let table: Vec<i32> = (0..nb as i32).rev().collect();
        let read = Array::from_slice(&table, &[1, 1, nb as i32]);
        let heads_idx =
            Array::from_slice(&(0..kvh as i32).collect::<Vec<_>>(), &[1, kvh as i32, 1]);
        let s = (nb * bs) as i32;
        // Additive causal mask: query i sees keys 0..=depth + i.
        let bias: Vec<f32> = (0..chunk * nb * bs)
            .map(|i| {
                let (qi, k) = (i / (nb * bs), i % (nb * bs));
                if k <= depth + qi {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let mask = Array::from_slice(&bias, &[1, 1, 1, chunk as i32, s]);
        let mut gather_s = 0.0;
        let mut attn_s = 0.0;
        let mut host_s = 0.0;
        for _ in 0..layers {
            let t0 = Instant::now();
            let k = pool
                .try_index((&read, &heads_idx, .., ..))?
                .reshape(&[1, kvh as i32, s, hd as i32])?;
            let v = vpool
                .try_index((&read, &heads_idx, .., ..))?
                .reshape(&[1, kvh as i32, s, hd as i32])?;
            mlx_rs::transforms::eval([&k, &v])?;
            let t1 = Instant::now();
            let o = weft_models::cpu_kernels::attention(&q, &k, &v, 0.125, Some(&mask))?;
            mlx_rs::transforms::eval([&o])?;
            let t2 = Instant::now();
            let d = weft_models::host_attention::Dims {
                rows: 1,
                heads,
                kv_heads: kvh,
                t: chunk,
                head_dim: hd,
                block_size: bs,
                table_width: nb,
            };
            let qs = q.as_dtype(Dtype::Float32)?;
            let _ = weft_models::host_attention::decode(
                qs.as_slice::<f32>(),
                pool.as_slice::<f32>(),
                vpool.as_slice::<f32>(),
                &table,
                &[depth],
                &[chunk],
                d,
            )?;
            let t3 = Instant::now();
            gather_s += (t1 - t0).as_secs_f64();
            attn_s += (t2 - t1).as_secs_f64();
            host_s += (t3 - t2).as_secs_f64();
        }
        println!(
            "depth {depth} chunk {chunk}, {layers} layers: gather {:.1} ms, attention {:.1} ms, \
             host in-place {:.1} ms",
            gather_s * 1e3,
            attn_s * 1e3,
            host_s * 1e3
        );
    }
    Ok(())
}
