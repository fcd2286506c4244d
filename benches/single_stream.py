"""Single-stream prefill and decode speed: `weft generate` vs mlx-lm, same
model, same machine, same run, same compute dtype and BLAS.

  .venv/bin/python benches/single_stream.py --weft target/release/weft \
      [--prompt-tokens 256] [--gen-tokens 128] [--repeats 3]

Configurations:
  f32+openblas  weights dequantized to f32 at load, OpenBLAS preloaded on both
                sides (Weft's CPU default; mlx-lm gets `set_dtype(float32)` on
                dequantized layers and the same LD_PRELOAD)
  q4            quantized weights kept (MLX quantized matmul, f32 activations),
                no OpenBLAS on either side
Prints a markdown table of medians and weft/mlx-lm ratios.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
HERE = Path(__file__).resolve().parent


def prompt_text(n_words):
    words = ("river stone quiet bright morning market silver garden window paper "
             "music winter orange forest castle letter").split()
    return " ".join(words[i % len(words)] for i in range(n_words))


def run_weft(weft, model, text, gen, config, extra):
    env = dict(os.environ)
    args = [weft, "generate", "--model", str(model), "--prompt", text,
            "--max-tokens", str(gen), "--ignore-eos"] + extra.split()
    if config == "q4":
        env["WEFT_OPENBLAS"] = "0"
        args += ["--weights", "keep", "--compute-dtype", "f32"]
    else:
        args += ["--weights", "dequantize", "--compute-dtype", "f32"]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    m = re.search(r"-- (\d+) prompt tokens, (\d+) generated .*prefill ([\d.]+) tok/s.*decode ([\d.]+) tok/s",
                  out.stderr)
    if not m:
        raise RuntimeError("unexpected weft output: " + out.stderr[-500:])
    return int(m.group(1)), float(m.group(3)), float(m.group(4))


MLX_CHILD = r'''
import sys, time, json
sys.path.insert(0, sys.argv[1])
import mlx.core as mx
from pathlib import Path
from mlx_lm.utils import load_model
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.generate import generate_step
from mlx_lm_oracle import dequantize_modules
model_dir, text, gen, config = Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
model, _ = load_model(model_dir)
if config != "q4":
    dequantize_modules(model)
model.set_dtype(mx.float32)
tok = load_tokenizer(model_dir)
ids = mx.array(tok.encode(text))
greedy = lambda x: mx.argmax(x, axis=-1)
for _ in generate_step(ids[:8], model, max_tokens=4, sampler=greedy):
    pass
t0 = time.perf_counter(); first = None; n = 0
for token, _ in generate_step(ids, model, max_tokens=gen, sampler=greedy):
    n += 1
    if first is None:
        first = time.perf_counter()
end = time.perf_counter()
print(json.dumps({"prompt": int(ids.size), "prefill": ids.size / (first - t0),
                  "decode": (n - 1) / (end - first)}))
'''


def run_mlx(model, text, gen, config):
    env = dict(os.environ)
    if config != "q4":
        env["LD_PRELOAD"] = OPENBLAS
    out = subprocess.run([sys.executable, "-c", MLX_CHILD, str(HERE.parent / "tests/oracle"),
                          str(model), text, str(gen), config],
                         env=env, capture_output=True, text=True, check=True)
    import json
    d = json.loads(out.stdout.strip().splitlines()[-1])
    return d["prompt"], d["prefill"], d["decode"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weft", default="target/release/weft")
    ap.add_argument("--model", default=str(Path.home() / ".cache/weft/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default="f32+openblas,q4")
    # `weft generate` speculates by default (greedy, prompt lookup); "--speculate 0"
    # measures one token per step.
    ap.add_argument("--weft-args", default="", help="extra `weft generate` flags")
    a = ap.parse_args()
    text = prompt_text(a.prompt_tokens)
    rows = []
    for config in a.configs.split(","):
        res = {"weft": [], "mlx-lm": []}
        for _ in range(a.repeats):
            # Interleave so drifts in machine load hit both sides alike.
            res["weft"].append(run_weft(a.weft, a.model, text, a.gen_tokens, config, a.weft_args))
            res["mlx-lm"].append(run_mlx(a.model, text, a.gen_tokens, config))
        med = {k: (v[0][0], statistics.median(x[1] for x in v), statistics.median(x[2] for x in v))
               for k, v in res.items()}
        rows.append((config, med))
    print(f"prompt ~{a.prompt_tokens} words, {a.gen_tokens} generated, median of {a.repeats}, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| config | side | prompt tokens | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|")
    for config, med in rows:
        for side in ("weft", "mlx-lm"):
            p, pf, dc = med[side]
            print(f"| {config} | {side} | {p} | {pf:.1f} | {dc:.1f} |")
        w, m = med["weft"], med["mlx-lm"]
        print(f"| {config} | **weft / mlx-lm** | | **{w[1] / m[1]:.2f}x** | **{w[2] / m[2]:.2f}x** |")


if __name__ == "__main__":
    main()
