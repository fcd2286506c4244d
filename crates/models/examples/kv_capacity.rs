//! KV memory: bytes per token of the paged pool as MLX allocates it, against
//! theory, and how many concurrent 2K-context rows a fixed budget holds paged
//! versus a dense, left-padded batch cache grown in 256-column steps (mlx-lm's
//! `BatchKVCache`).
//!
//! `kv_capacity [budget MiB] [layers kv_heads head_dim dtype_bytes]`
//! (default: 1024 MiB, the 1.2B Llama's 22 x 4 x 64 in bf16).
//!
//! Rows: every row of a continuous batch is somewhere in its life, so row `i`
//! of `n` holds `2048 * (i + 1) / n` tokens (uniform up to 2K). Paged, a row
//! takes `ceil(len / 16)` blocks; dense, every row takes as many columns as the
//! longest, rounded up to 256.
use weft_models::{KvMemory, KvShape, PagedKv};

fn active() -> u64 {
    let mut n = 0usize;
    // SAFETY: out-parameter query.
    unsafe { mlx_sys::mlx_get_active_memory(&mut n) };
    n as u64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    let mib: u64 = a.get(1).map_or(Ok(1024), |s| s.parse())?;
    let num = |i: usize, d: u32| a.get(i).map_or(Ok(d), |s| s.parse::<u32>());
    let (layers, heads, dim, el) = (num(2, 22)?, num(3, 4)?, num(4, 64)?, num(5, 2)?);
    let shape = KvShape {
        layers: layers as usize,
        kv_heads: heads,
        head_dim: dim,
        dtype: if el == 4 {
            mlx_rs::Dtype::Float32
        } else {
            mlx_rs::Dtype::Bfloat16
        },
        sliding: None,
        quant: None,
        recurrent: None,
        stateless: 0,
    };
    let budget = mib << 20;
    let before = active();
    let kv = PagedKv::new(
        shape,
        16,
        KvMemory::Bytes(budget),
        weft_models::Kernels::Stock,
        false,
    )?;
    let used = active() - before;
    let blocks = u64::from(kv.groups().groups[0].num_blocks);
    let tokens = blocks * 16;
    let theory = shape.bytes_per_token();
    let measured = used as f64 / tokens as f64;
    println!(
        "budget {mib} MiB: {blocks} blocks, {tokens} tokens; MLX allocated {:.1} MiB; \
         bytes/token measured {measured:.1}, theory {theory} ({:+.2}%)",
        used as f64 / (1 << 20) as f64,
        (measured / theory as f64 - 1.0) * 100.0
    );
    // Concurrent rows at up to 2K context.
    let ctx = 2048u64;
    let fits_paged = |n: u64| -> bool {
        let need: u64 = (0..n).map(|i| (ctx * (i + 1) / n).div_ceil(16)).sum();
        need <= blocks
    };
    let fits_dense = |n: u64| -> bool {
        let cols = ctx.div_ceil(256) * 256;
        n * cols * theory <= budget
    };
    let most = |f: &dyn Fn(u64) -> bool| (1..100_000).take_while(|&n| f(n)).last().unwrap_or(0);
    let (p, d) = (most(&fits_paged), most(&fits_dense));
    println!(
        "rows with contexts uniform up to {ctx}: paged {p}, dense padded batch {d} ({:.2}x); \
         all rows at exactly {ctx}: paged {}, dense {}",
        p as f64 / d.max(1) as f64,
        blocks / ctx.div_ceil(16),
        budget / (ctx.div_ceil(256) * 256 * theory),
    );
    Ok(())
}
