"""Batched generation throughput: Weft's engine vs mlx-lm's BatchGenerator,
same model, same machine, same run, same compute dtype (f32, weights
dequantized at load) and the same BLAS (OpenBLAS preloaded on both sides).

  .venv/bin/python benches/batch_throughput.py --weft target/release/weft \
      [--streams 1,8,32] [--prompt-tokens 128] [--gen-tokens 64] [--weft-args '--cpu-lanes 1']
      [--adapter DIR] [--json FILE]

LoRA (issue 18): `--weft-args '--adapters 8 --adapter-rank 16 --adapter-dir D'`
has Weft write 8 random mlx-lm adapters into D/adapter-1 ... D/adapter-8 and
spread the streams over them; `--adapter D/adapter-1` has mlx-lm load one of
them (mlx_lm.tuner.utils.load_adapters: LoRALinear layers, every row with that
adapter, mlx-lm serving one adapter at a time). Weft runs first at each stream
count, so D is written before mlx-lm reads it. Where mlx_lm.tuner does not
import (its package imports the trainer, whose UI needs `rich`, which mlx-lm
does not declare), a local copy of LoRALinear's forward applies the same
tensors (BENCH_LOCAL_LORA=1 forces it); the table says which loaded them.

Both sides get N distinct prompts at once, ignore EOS, and report
  generation tok/s = all generated tokens / wall time (prefill included)
  steady decode tok/s = tokens after every stream had its first token / that span
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
HERE = Path(__file__).resolve().parent

MLX_CHILD = r'''
import os, sys, time, json
sys.path.insert(0, sys.argv[1])
import mlx.core as mx
from pathlib import Path
from mlx_lm.utils import load_model
from mlx_lm.generate import BatchGenerator
from mlx_lm_oracle import dequantize_modules
model_dir, n, p, g = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
native = len(sys.argv) > 6 and sys.argv[6] == "native"
rounds = int(sys.argv[7]) if len(sys.argv) > 7 else 1
adapter = sys.argv[8] if len(sys.argv) > 8 and sys.argv[8] else None
model, _ = load_model(model_dir)
if not native:
    dequantize_modules(model)
def local_load_adapters(model, path):
    # mlx-lm's LoRALinear forward, for a machine where mlx_lm.tuner does not
    # import (its package imports the trainer, whose UI needs `rich`).
    import json as js
    import mlx.nn as nn
    from mlx.utils import tree_unflatten
    class LoRA(nn.Module):
        def __init__(self, linear, a, b, scale):
            super().__init__()
            self.linear, self.lora_a, self.lora_b, self.scale = linear, a, b, scale
        def __call__(self, x):
            return self.linear(x) + (self.scale * ((x @ self.lora_a) @ self.lora_b)).astype(x.dtype)
    cfg = js.load(open(Path(path) / "adapter_config.json"))
    lp = cfg["lora_parameters"]
    weights = mx.load(str(Path(path) / "adapters.safetensors"))
    layers = model.layers
    # mlx-lm adapts layers[-max(num_layers, 0):]: the last num_layers, or all.
    first = max(len(layers) - cfg["num_layers"], 0) if cfg["num_layers"] > 0 else 0
    if not lp.get("keys"):
        raise ValueError(f"{path}: no lora_parameters.keys (the local loader needs them)")
    used = 0
    for i in range(first, len(layers)):
        new = []
        for key in lp["keys"]:
            name = f"model.layers.{i}.{key}"
            if name + ".lora_a" not in weights:
                continue
            m = layers[i]
            for part in key.split("."):
                m = getattr(m, part)
            new.append((key, LoRA(m, weights[name + ".lora_a"], weights[name + ".lora_b"], lp["scale"])))
            used += 2
        if new:
            layers[i].update_modules(tree_unflatten(new))
    if used != len(weights):
        raise ValueError(f"{path}: {len(weights) - used} adapter tensors not applied")
if adapter:
    # As mlx_lm.load(..., adapter_path=) does: LoRALinear layers, then eval mode.
    try:
        if os.environ.get("BENCH_LOCAL_LORA"):
            raise ImportError("BENCH_LOCAL_LORA set")
        from mlx_lm.tuner.utils import load_adapters
        loader = "mlx_lm.tuner.utils.load_adapters"
    except ImportError as e:
        load_adapters = local_load_adapters
        loader = f"a local copy of mlx-lm's LoRALinear (mlx_lm.tuner: {e})"
    load_adapters(model, adapter)
    model.eval()
    print(f"mlx-lm: adapter {adapter} loaded by {loader}", file=sys.stderr)
if not native:
    model.set_dtype(mx.float32)
# Multimodal configs (Qwen3.5's) keep the text model's vocabulary in text_config.
args = model.args
vocab = getattr(args, "vocab_size", None) or (getattr(args, "text_config", None) or {}).get("vocab_size")
if vocab is None:
    vocab = model.language_model.args.vocab_size
prompts = [[100 + ((s * 7919 + i * 104729) % (vocab - 200)) for i in range(p)] for s in range(n)]
def run(prompts, g):
    gen = BatchGenerator(model, completion_batch_size=max(n, 1), prefill_batch_size=min(max(n, 1), 8),
                         stop_tokens=[], sampler=lambda x: mx.argmax(x, axis=-1))
    start = time.perf_counter()
    gen.insert(prompts, [g] * len(prompts))
    firsts, times, done = {}, [], 0
    while done < len(prompts):
        for r in gen.next_generated():
            now = time.perf_counter()
            firsts.setdefault(r.uid, now)
            times.append(now)
            if r.finish_reason is not None:
                done += 1
    return start, firsts, times
run(prompts[:1], 4)  # warm-up
for _ in range(rounds):  # the last round is reported
    start, firsts, times = run(prompts, g)
end = max(times); last_first = max(firsts.values())
steady = sum(1 for t in times if t > last_first)
ttft = sorted((f - start) * 1e3 for f in firsts.values())
print(json.dumps({"adapter_loader": loader if adapter else None, "wall_seconds": end - start, "generation_tok_per_s": len(times) / (end - start),
                  "steady_decode_tok_per_s": steady / max(end - last_first, 1e-9),
                  "ttft_p50_ms": ttft[len(ttft) // 2], "ttft_max_ms": ttft[-1]}))
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weft", default="target/release/weft")
    ap.add_argument("--model", default=str(Path.home() / ".cache/weft/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--weft-args", default="", help="extra bench-engine flags, e.g. '--cpu-lanes 1'")
    ap.add_argument("--rounds", type=int, default=1,
                    help="whole workload runs per side in one process, the last reported (GPU kernels load per shape)")
    ap.add_argument("--adapter", default="",
                    help="mlx-lm side: an mlx-lm LoRA adapter dir every row runs with (e.g. one bench-engine "
                         "--adapter-dir wrote); Weft's adapters are set by --weft-args")
    ap.add_argument("--json", default="", help="also write the results here (a list, one entry per stream count)")
    ap.add_argument("--native", action="store_true",
                    help="each side's default policy for the device (for the GPU: quantized weights kept, "
                         "mlx-lm loads the model as stored), no OpenBLAS")
    a = ap.parse_args()
    env = dict(os.environ) if a.native else dict(os.environ, LD_PRELOAD=OPENBLAS)
    policy = [] if a.native else ["--weights", "dequantize", "--compute-dtype", "f32"]
    rows = []
    for n in [int(x) for x in a.streams.split(",")]:
        w = subprocess.run([a.weft, "bench-engine", "--model", a.model, "--streams", str(n),
                            "--prompt-tokens", str(a.prompt_tokens), "--gen-tokens", str(a.gen_tokens),
                            "--rounds", str(a.rounds), *policy, *a.weft_args.split()],
                           capture_output=True, text=True)
        if w.returncode != 0:
            sys.exit(f"weft bench-engine failed ({w.returncode}):\n{w.stderr[-4000:]}")
        weft = json.loads(w.stdout.strip().splitlines()[-1])
        m = subprocess.run([sys.executable, "-c", MLX_CHILD, str(HERE.parent / "tests/oracle"), a.model,
                            str(n), str(a.prompt_tokens), str(a.gen_tokens), "native" if a.native else "f32",
                            str(a.rounds), a.adapter],
                           env=env, capture_output=True, text=True)
        if m.returncode != 0:
            sys.exit(f"mlx-lm BatchGenerator failed ({m.returncode}):\n{m.stderr[-4000:]}")
        mlx = json.loads(m.stdout.strip().splitlines()[-1])
        rows.append((n, weft, mlx))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"streams": n, "weft": w, "mlx": m, "mlx_adapter": a.adapter or None} for n, w, m in rows],
                      f, indent=1)
    print(f"prompt {a.prompt_tokens} tokens, {a.gen_tokens} generated per stream, {time.strftime('%Y-%m-%d')}")
    print("| streams | side | gen tok/s (incl. prefill) | steady decode tok/s | TTFT p50 ms | TTFT max ms |")
    print("|---|---|---|---|---|---|")
    mlx_side = "mlx-lm BatchGenerator"
    if a.adapter:
        mlx_side += f" (every row adapter {Path(a.adapter).name})"
    for n, w, m in rows:
        weft_side = "weft"
        if w.get("adapters"):
            weft_side += f" ({w['adapters']} adapters of rank {w['adapter_rank']}, rows round-robin)"
        for side, d in ((weft_side, w), (mlx_side, m)):
            print(f"| {n} | {side} | {d['generation_tok_per_s']:.1f} | {d['steady_decode_tok_per_s']:.1f} "
                  f"| {d['ttft_p50_ms']:.0f} | {d['ttft_max_ms']:.0f} |")
        if m.get("adapter_loader"):
            print(f"| {n} | mlx-lm adapter loaded by {m['adapter_loader']} | | | | |")
        if "steps" in w:
            print(f"| {n} | weft per step: {w['steps']} steps, {w['step_ms']:.2f} ms wall, forward {w['forward_ms']:.2f} ms "
                  f"(build {w['build_ms']:.2f}, eval wait {w['eval_ms']:.2f}) | | | | |")
        print(f"| {n} | **weft / mlx-lm** | **{w['generation_tok_per_s'] / m['generation_tok_per_s']:.2f}x** "
              f"| **{w['steady_decode_tok_per_s'] / m['steady_decode_tok_per_s']:.2f}x** | | |")


if __name__ == "__main__":
    main()
