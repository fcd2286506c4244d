//! Quality and memory of quantized KV (`--kv-bits`) against full-precision
//! KV on a real model, over a fixed prompt set:
//! `cargo run --release -p weft-models --example kv_quality -- <model dir> [tokens] [budget MiB]`
//!
//! Each prompt is greedy-decoded `tokens` (default 64) tokens with
//! full-precision KV; that token sequence is then fed, token by token, through
//! a pool stored at each of 8/64, 8/32, 4/64 and 4/32 bits/group (teacher
//! forcing, so every position compares the same context). Per setting:
//! top-1 agreement of the next-token pick with full precision, mean and
//! worst KL(full || quantized) per token (nats), over the prompt's last
//! position and every generated one; then bytes per token and the rows of a
//! 2048-token context the pool holds in `budget` MiB (default 1024).
use weft_models::{load, AffineQuant, KvMemory, LlamaModel, LoadOptions, PagedKv, RowBlocks};

const PROMPTS: &[&str] = &[
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a paperclip:\n1.",
    "Translate to French: The weather is nice today, so we will walk to the market.",
    "Once upon a time, in a village at the edge of a great forest, there lived",
    "Q: What is 17 times 23?\nA:",
];

/// Next-token logits (f32) at the prompt's last position and each one
/// after it, `gen` in all: one prefill of `tokens[..prompt]`, then one
/// decode step per token, feeding `tokens[prompt..]` and past their end the
/// greedy pick, over a private pool (K/V quantized with `quant`). Returns the
/// tokens fed too.
fn walk(
    model: &LlamaModel,
    quant: Option<AffineQuant>,
    tokens: &[u32],
    prompt: usize,
    gen: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let bs = 16u32;
    let blocks = ((prompt + gen) as u32).div_ceil(bs) + 1;
    let kv = PagedKv::new(
        model.kv_shape().with_quant(quant),
        bs,
        KvMemory::Blocks(blocks),
        model.policy.kernels,
        weft_models::loader::cuda_available(),
    )
    .expect("pool");
    let table: Vec<RowBlocks> = kv
        .groups()
        .groups
        .iter()
        .map(|_| RowBlocks {
            offset: 0,
            blocks: (0..blocks).collect(),
        })
        .collect();
    let run = |ids: &[u32], start: usize, decode: bool| -> Vec<f32> {
        let ids: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
        let t = mlx_rs::Array::from_slice(&ids, &[1, ids.len() as i32]);
        let mut step = kv
            .step(&[(&table[..], start, ids.len())], decode)
            .expect("step");
        let l = model.forward(&t, &mut step, true).expect("forward");
        drop(step);
        let l = l.as_dtype(mlx_rs::Dtype::Float32).expect("cast");
        let mut pending = kv.arrays();
        pending.push(l.clone());
        mlx_rs::transforms::eval(pending.iter()).expect("eval");
        l.as_slice::<f32>().to_vec()
    };
    let mut ids = tokens[..prompt].to_vec();
    let mut out = vec![run(&ids, 0, false)];
    while out.len() < gen {
        let p = ids.len();
        let next = match tokens.get(p) {
            Some(&t) => t,
            None => argmax(out.last().expect("logits")) as u32,
        };
        ids.push(next);
        out.push(run(&[next], p, true));
    }
    (ids, out)
}

fn log_softmax(v: &[f32]) -> Vec<f64> {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    v.iter().map(|&x| x as f64 - lse).collect()
}

fn argmax(v: &[f32]) -> usize {
    let mut b = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[b] {
            b = i;
        }
    }
    b
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(
        args.get(1)
            .ok_or("usage: kv_quality <model dir> [tokens] [budget MiB]")?,
    );
    let gen: usize = args.get(2).map_or(Ok(64), |s| s.parse())?;
    let mib: u64 = args.get(3).map_or(Ok(1024), |s| s.parse())?;
    let loaded = load(&dir, LoadOptions::default())?;
    let (model, tok) = (loaded.model, loaded.tokenizer);
    // The full-precision greedy continuation of each prompt.
    let mut seqs = Vec::new();
    let mut reference = Vec::new();
    for p in PROMPTS {
        let ids = tok.encode(p)?;
        let prompt = ids.len();
        let (ids, l) = walk(&model, None, &ids, prompt, gen);
        seqs.push((ids, prompt));
        reference.push(l);
    }
    let shape = model.kv_shape();
    println!(
        "{}: {} prompts, {} positions each; full precision {} ({} bytes/token)",
        dir.display(),
        PROMPTS.len(),
        gen,
        shape.kv_dtype(),
        shape.bytes_per_token()
    );
    println!("| KV | top-1 agreement | mean KL (nats/token) | worst KL | bytes/token | rows of 2048 tokens in {mib} MiB |");
    println!("|---|---|---|---|---|---|");
    let rows_in = |bpt: u64| (mib << 20) / (bpt * 2048);
    println!(
        "| {} | 1 | 0 | 0 | {} | {} |",
        shape.kv_dtype(),
        shape.bytes_per_token(),
        rows_in(shape.bytes_per_token())
    );
    for (bits, group) in [(8, 64), (8, 32), (4, 64), (4, 32)] {
        let q = AffineQuant::new(bits, group);
        let (mut agree, mut n, mut kl_sum, mut kl_max) = (0usize, 0usize, 0f64, 0f64);
        for ((ids, p), want) in seqs.iter().zip(&reference) {
            let (_, got) = walk(&model, Some(q), ids, *p, gen);
            for (w, g) in want.iter().zip(&got) {
                agree += usize::from(argmax(w) == argmax(g));
                let (lw, lg) = (log_softmax(w), log_softmax(g));
                let kl: f64 = lw.iter().zip(&lg).map(|(a, b)| a.exp() * (a - b)).sum();
                kl_sum += kl;
                kl_max = kl_max.max(kl);
                n += 1;
            }
        }
        let qs = shape.with_quant(Some(q));
        println!(
            "| {} | {:.4} ({agree}/{n}) | {:.2e} | {:.2e} | {} | {} |",
            qs.kv_dtype(),
            agree as f64 / n as f64,
            kl_sum / n as f64,
            kl_max,
            qs.bytes_per_token(),
            rows_in(qs.bytes_per_token())
        );
    }
    Ok(())
}
