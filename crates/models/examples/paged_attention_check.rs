//! Checks and times Weft's paged decode-attention kernel against gathering the
//! blocks and running masked SDPA (the portable path), on a CUDA GPU:
//! `paged_attention_check [rows,...] [contexts,...] [reps]`
//!
//! Shapes are the 1.2B Llama's (32 query heads, 4 KV heads, head_dim 64, bf16,
//! 16-token blocks); tables are fragmented (every row's blocks interleaved with
//! the others'), contexts vary per row (each row holds `ctx - row % 16` keys),
//! and the step verifies `T` queries per row (`DECODE_T`, default 1).
//! `KV_BITS=4|8` (`KV_GROUP=32|64`, default 64) stores the pool quantized: the
//! kernel then dequantizes as it reads, the gather path through MLX's
//! `dequantize`. Prints the largest difference between the two and the time
//! per layer of each.
use std::time::Instant;

use mlx_rs::{ops, random, Array, Dtype};
use weft_kv_pool::storage::{
    AffineQuant, KvStorage, KvStorageConfig, RowStep as RowWrite, StepLayout,
};
use weft_kv_pool::{AttentionKind, BlockTable};
use weft_models::paged_attention::{PagedAttention, Pools};

/// Query heads, KV heads and head_dim: `HEADS=32,4,64` (the 1.2B model's, the
/// default), e.g. `HEADS=9,3,64` (SmolLM2-135M) or `HEADS=16,8,128`.
fn heads() -> (i32, i32, i32) {
    let v: Vec<i32> = std::env::var("HEADS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|x| x.trim().parse().ok())
        .collect();
    match v[..] {
        [hq, h, d] => (hq, h, d),
        _ => (32, 4, 64),
    }
}
const BS: usize = 16;

fn list(arg: Option<&String>, default: &[usize]) -> Vec<usize> {
    arg.map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    #[allow(non_snake_case)]
    let (HQ, H, D) = heads();
    println!("heads {HQ} / kv heads {H} / head_dim {D}");
    let rows = list(args.get(1), &[1, 64, 256]);
    let ctxs = list(args.get(2), &[512, 2048, 8192]);
    let reps: usize = args.get(3).map_or(Ok(20), |s| s.parse())?;
    let t: usize = std::env::var("DECODE_T")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let env = |k: &str| std::env::var(k).ok().and_then(|s| s.parse::<u8>().ok());
    let quant = env("KV_BITS").map(|b| AffineQuant::new(b, env("KV_GROUP").unwrap_or(64)));
    if let Some(q) = quant {
        println!("K/V quantized: {} bits, groups of {}", q.bits, q.group_size);
    }
    let kernel = PagedAttention::new()?;
    println!("rows  ctx  T  max|diff|  kernel ms/layer  gather+sdpa ms/layer  speedup");
    for &b in &rows {
        for &ctx in &ctxs {
            let per_row = (ctx + t).div_ceil(BS);
            let nb = (b * per_row + 1) as u32;
            let cfg =
                KvStorageConfig::dense(0, 1, nb, BS as u32, H as u32, D as u32, Dtype::Bfloat16);
            let mut storage = KvStorage::new(match quant {
                Some(q) => cfg.quantized(q),
                None => cfg,
            })?;
            // Interleaved tables: block j of row r is j * b + r.
            let tables: Vec<Vec<u32>> = (0..b)
                .map(|r| (0..per_row).map(|j| (j * b + r) as u32).collect())
                .collect();
            let lens: Vec<usize> = (0..b).map(|r| ctx - r % 16).collect();
            // Fill every row's context with random K/V, then plan the step.
            let fill: Vec<RowWrite> = (0..b)
                .map(|r| RowWrite {
                    table: BlockTable {
                        offset: 0,
                        blocks: &tables[r],
                        block_size: BS,
                    },
                    start: 0,
                    tokens: lens[r],
                })
                .collect();
            let fl = StepLayout::new(&fill, AttentionKind::Full, 1)?;
            let kf = random::normal::<f32>(&[b as i32, H, ctx as i32, D], None, None, None)?
                .as_dtype(Dtype::Bfloat16)?;
            let vf = random::normal::<f32>(&[b as i32, H, ctx as i32, D], None, None, None)?
                .as_dtype(Dtype::Bfloat16)?;
            storage.write(0, &fl, &kf, &vf)?;
            mlx_rs::transforms::eval(storage.arrays())?;
            let step: Vec<RowWrite> = (0..b)
                .map(|r| RowWrite {
                    table: BlockTable {
                        offset: 0,
                        blocks: &tables[r],
                        block_size: BS,
                    },
                    start: lens[r],
                    tokens: t,
                })
                .collect();
            let layout = StepLayout::new(&step, AttentionKind::Full, 1)?;
            let kn = random::normal::<f32>(&[b as i32, H, t as i32, D], None, None, None)?
                .as_dtype(Dtype::Bfloat16)?;
            let vn = random::normal::<f32>(&[b as i32, H, t as i32, D], None, None, None)?
                .as_dtype(Dtype::Bfloat16)?;
            storage.write(0, &layout, &kn, &vn)?;
            mlx_rs::transforms::eval(storage.arrays())?;
            let q = random::normal::<f32>(&[b as i32, HQ, t as i32, D], None, None, None)?
                .as_dtype(Dtype::Bfloat16)?;
            let scale = 1.0 / (D as f32).sqrt();
            let starts: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let ntok = vec![t as i32; b];
            let table = Array::from_slice(
                layout.block_table(),
                &[b as i32, layout.blocks_per_row() as i32],
            );
            let start = Array::from_slice(&starts, &[b as i32]);
            let ntok = Array::from_slice(&ntok, &[b as i32]);
            let max_keys = ctx + t;
            let qscale = Array::from_slice(&[scale], &[1]);
            let run_kernel = || -> Result<Array, Box<dyn std::error::Error>> {
                let pools = if quant.is_some() {
                    let (kq, vq) = storage.quantized_arrays(0)?;
                    Pools::Quantized(kq, vq)
                } else {
                    let (kp, vp) = storage.dense_arrays(0)?;
                    Pools::Dense(kp, vp)
                };
                Ok(kernel.decode(&q, pools, &table, &start, &ntok, &qscale, max_keys)?)
            };
            let run_gather = || -> Result<Array, Box<dyn std::error::Error>> {
                let (k, v) = storage.read(0, &layout)?;
                Ok(mlx_rs::fast::scaled_dot_product_attention(
                    &q,
                    &k,
                    &v,
                    scale,
                    layout.mask(),
                    None,
                )?)
            };
            let a = run_kernel()?.as_dtype(Dtype::Float32)?;
            let g = run_gather()?.as_dtype(Dtype::Float32)?;
            let diff = ops::abs(&ops::subtract(&a, &g)?)?.max(None)?;
            diff.eval()?;
            let diff = diff.item_cast::<f32>();
            let time = |f: &dyn Fn() -> Result<Array, Box<dyn std::error::Error>>| -> Result<f64, Box<dyn std::error::Error>> {
                for _ in 0..3 {
                    f()?.eval()?;
                }
                let t0 = Instant::now();
                let mut outs = Vec::with_capacity(reps);
                for _ in 0..reps {
                    outs.push(f()?);
                }
                mlx_rs::transforms::eval(outs.iter())?;
                Ok(t0.elapsed().as_secs_f64() * 1e3 / reps as f64)
            };
            let tk = time(&run_kernel)?;
            let tg = time(&run_gather)?;
            println!(
                "{b:>4} {ctx:>5} {t:>2} {diff:>10.2e} {tk:>16.3} {tg:>21.3} {:>8.1}x",
                tg / tk
            );
            if !diff.is_finite() || diff > 2e-2 {
                return Err(format!(
                    "kernel differs from gather+SDPA by {diff} at {b} rows x {ctx}"
                )
                .into());
            }
        }
    }
    Ok(())
}
