"""mlx-lm as the parity oracle for Weft's tests.

  fixture --arch llama|llama-tiny|llama-wide|qwen2|qwen3|gemma3|qwen3_5|nemotron_h --out DIR
          [--quantize]
                                                     random-weight model dir
  lora-fixture --model DIR --out DIR --rank R --scale S --seed N [--keys K,..] [--num-layers N]
               [--peft-out DIR [--rslora]]            random LoRA adapter (mlx-lm layout; the
                                                     same weights in PEFT's layout too)
  gdn-layer --model DIR --out FILE                   one Gated DeltaNet layer (layer 0) of a
                                                     qwen3_5 fixture on seeded inputs: two
                                                     calls carrying the state, into safetensors
  run --model DIR --requests FILE [--adapter DIR] [--kv-bits B --kv-group-size G]
                                                     logits + greedy tokens, each prompt alone
                                                     (with --kv-bits: over mlx-lm's
                                                     QuantizedKVCache from the first token)

`run` reads JSON {"max_tokens": N, "prompts": [{"ids": [...]} or {"text": "..."}],
"batch": bool} and prints JSON results. Everything runs in float32 so it matches
Weft's CPU policy (dequantized f32 weights); quantized fixtures keep MLX's
quantized matmul on the oracle side.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map


def make_fixture(arch, out, quantize):
    mx.random.seed({"llama": 7, "llama-tiny": 5, "llama-wide": 19, "qwen3": 11, "qwen2": 13,
                    "gemma3": 17, "qwen3_5": 29, "nemotron_h": 31}[arch])
    if arch == "llama-tiny":
        from mlx_lm.models import llama as mod

        cfg = dict(model_type="llama", hidden_size=64, num_hidden_layers=2,
                   intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   rms_norm_eps=1e-5, vocab_size=256, rope_theta=10000.0,
                   tie_word_embeddings=False, max_position_embeddings=2048)
    elif arch == "gemma3":
        from mlx_lm.models import gemma3_text as mod

        # A window of 8 tokens and a global layer every third: short prompts
        # already run past the window; blocks of 16 leave it mid-block.
        cfg = dict(model_type="gemma3_text", hidden_size=128, num_hidden_layers=5,
                   intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, rms_norm_eps=1e-6, vocab_size=512, rope_theta=1000000.0,
                   rope_local_base_freq=10000.0, query_pre_attn_scalar=24,
                   sliding_window=8, sliding_window_pattern=3,
                   max_position_embeddings=4096)
    elif arch == "qwen2":
        from mlx_lm.models import qwen2 as mod

        cfg = dict(model_type="qwen2", hidden_size=128, num_hidden_layers=3,
                   intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                   rms_norm_eps=1e-6, vocab_size=512, rope_theta=1000000.0,
                   tie_word_embeddings=False, max_position_embeddings=4096)
    elif arch == "qwen3_5":
        from mlx_lm.models import qwen3_5 as mod

        # Gated DeltaNet layers (0, 2) beside gated full attention (1, 3).
        cfg = dict(model_type="qwen3_5", hidden_size=128, num_hidden_layers=4,
                   intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, rms_norm_eps=1e-6, vocab_size=512, linear_num_value_heads=4,
                   linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
                   linear_conv_kernel_dim=4, full_attention_interval=2,
                   tie_word_embeddings=False, max_position_embeddings=4096,
                   rope_parameters={"type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.25})
    elif arch == "nemotron_h":
        from mlx_lm.models import nemotron_h as mod

        # Mamba-2 blocks (0, 3), attention blocks (1, 5) without RoPE, ReLU^2
        # MLP blocks (2, 4); each block one mixer behind one norm.
        cfg = dict(model_type="nemotron_h", vocab_size=512, hidden_size=128,
                   intermediate_size=256, max_position_embeddings=4096,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   attention_bias=False, mamba_num_heads=4, mamba_head_dim=16,
                   mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=2,
                   mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False,
                   use_conv_bias=True, hybrid_override_pattern=["M", "*", "-", "M", "-", "*"])
    elif arch == "llama-wide":
        from mlx_lm.models import llama as mod

        # Heads of 64: what K/V quantization groups (32, 64) divide.
        cfg = dict(model_type="llama", hidden_size=128, num_hidden_layers=3,
                   intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, rms_norm_eps=1e-5, vocab_size=512, rope_theta=10000.0,
                   tie_word_embeddings=False, max_position_embeddings=2048)
    elif arch == "llama":
        from mlx_lm.models import llama as mod

        cfg = dict(model_type="llama", hidden_size=128, num_hidden_layers=3,
                   intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
                   rms_norm_eps=1e-5, vocab_size=512, rope_theta=10000.0,
                   tie_word_embeddings=False, max_position_embeddings=2048)
    else:
        from mlx_lm.models import qwen3 as mod

        cfg = dict(model_type="qwen3", hidden_size=128, num_hidden_layers=3,
                   intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=48, rms_norm_eps=1e-6, vocab_size=512, rope_theta=1000000.0,
                   tie_word_embeddings=True, max_position_embeddings=4096)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))

    # Default inits give near-uniform logits (greedy ties); rescale so each
    # layer keeps O(1) activations and logits spread out.
    def reinit(path, p):
        if path.endswith(".bias"):
            return 0.5 * mx.random.normal(p.shape)
        if p.ndim == 2:
            fan_in = p.shape[1]
            scale = 1.0 if "embed" in path else fan_in ** -0.5
            return mx.random.normal(p.shape) * scale
        if p.ndim == 3:
            # Depthwise conv1d [channels, kernel, 1].
            return mx.random.normal(p.shape) * p.shape[1] ** -0.5
        if arch == "gemma3":
            # Gemma's norms scale by 1 + w.
            return 0.1 * mx.random.normal(p.shape)
        return 1.0 + 0.1 * mx.random.normal(p.shape)

    flat = [(k, reinit(k, v)) for k, v in tree_flatten(model.parameters())]
    model.load_weights(flat)
    if quantize:
        def pred(path, m):
            if not hasattr(m, "to_quantized"):
                return False
            if path == "model.embed_tokens":
                return {"group_size": 32, "bits": 8}
            return True

        nn.quantize(model, group_size=64, bits=4, class_predicate=pred)
        cfg["quantization"] = {"group_size": 64, "bits": 4,
                               "model.embed_tokens": {"group_size": 32, "bits": 8}}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


LORA_MODULES = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def make_lora_fixture(model_dir, out, rank, scale, seed, keys, num_layers, peft_out, rslora):
    """Random LoRA weights for the model in model_dir: lora_a as mlx-lm
    initializes it, lora_b random too (mlx-lm starts it at zero, which would
    make the adapter a no-op)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    mx.random.seed(seed)
    keys = keys.split(",") if keys else None
    n = len(model.layers)
    first = 0 if num_layers <= 0 else max(n - num_layers, 0)
    mods = dict(model.named_modules())
    weights = {}
    for i in range(first, n):
        for k in (keys or LORA_MODULES):
            m = mods[f"model.layers.{i}.{k}"]
            out_dims, in_dims = m.weight.shape
            if isinstance(m, nn.QuantizedLinear):
                in_dims = in_dims * 32 // m.bits
            bound = in_dims ** -0.5
            a = mx.random.uniform(low=-bound, high=bound, shape=(in_dims, rank))
            b = mx.random.normal((rank, out_dims)) * rank ** -0.5
            weights[f"model.layers.{i}.{k}.lora_a"] = a
            weights[f"model.layers.{i}.{k}.lora_b"] = b
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    params = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys:
        params["keys"] = keys
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}, indent=1))
    if peft_out:
        peft = {}
        for name, w in weights.items():
            stem, half = name.rsplit(".", 1)
            peft_name = "base_model.model." + stem + (".lora_A.weight" if half == "lora_a"
                                                      else ".lora_B.weight")
            peft[peft_name] = mx.array(w.T)
        p = Path(peft_out)
        p.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(p / "adapter_model.safetensors"), peft)
        alpha = scale * (rank ** 0.5 if rslora else rank)
        cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora,
               "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False,
               "target_modules": sorted({k.rsplit(".", 1)[-1] for k in (keys or LORA_MODULES)}),
               "layers_to_transform": list(range(first, n))}
        (p / "adapter_config.json").write_text(json.dumps(cfg, indent=1))


def gdn_layer(model_dir, out):
    """Layer 0's linear attention of a qwen3_5 fixture, on the CPU in f32: x1
    [2, 5, hidden] from a zero state, then x2 [2, 3, hidden] continuing it."""
    from mlx_lm.utils import load_model
    from mlx_lm.models.cache import ArraysCache

    model, _ = load_model(Path(model_dir))
    model.set_dtype(mx.float32)
    layer = model.layers[0].linear_attn
    mx.random.seed(23)
    h = model.args.text_config["hidden_size"]
    x1 = mx.random.normal((2, 5, h))
    x2 = mx.random.normal((2, 3, h))
    cache = ArraysCache(size=2)
    y1 = layer(x1, None, cache)
    conv1, rec1 = cache[0], cache[1]
    y2 = layer(x2, None, cache)
    mx.eval(y1, y2, cache[0], cache[1])
    mx.save_safetensors(out, {"x1": x1, "x2": x2, "y1": y1, "y2": y2, "conv1": conv1,
                              "rec1": rec1, "conv2": cache[0], "rec2": cache[1]})


def dequantize_modules(model):
    """Replace quantized layers by dense float32 ones holding the same values
    (what Weft's CPU policy does at load)."""
    swaps = []
    for path, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(mx.float32)
            if isinstance(m, nn.QuantizedEmbedding):
                new = nn.Embedding(w.shape[0], w.shape[1])
            else:
                new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
                if "bias" in m:
                    new.bias = m.bias
            new.weight = w
            swaps.append((path, new))
    for path, new in swaps:
        parts = path.split(".")
        parent = model
        for p in parts[:-1]:
            parent = parent[int(p)] if p.isdigit() else getattr(parent, p)
        if parts[-1].isdigit():
            parent[int(parts[-1])] = new
        else:
            setattr(parent, parts[-1], new)


def quantized_cache(model, bits, group_size):
    """The model's own cache with every attention layer's KVCache replaced by
    a QuantizedKVCache (recurrent layers keep their ArraysCache)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    return [QuantizedKVCache(group_size=group_size, bits=bits) if isinstance(c, KVCache) else c
            for c in make_prompt_cache(model)]


def run(model_dir, requests, dequantize=False, adapter=None, kv_bits=None, kv_group_size=64):
    from mlx_lm.utils import load_model, load_adapters
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache

    model_dir = Path(model_dir)
    model, _ = load_model(model_dir)
    if dequantize:
        dequantize_modules(model)
    if adapter:
        model = load_adapters(model, adapter)
        model.eval()
    model.set_dtype(mx.float32)
    req = json.loads(Path(requests).read_text())
    tok = None
    if any("text" in p for p in req["prompts"]):
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        tok = load_tokenizer(model_dir)
    results = []
    for p in req["prompts"]:
        if "text" in p:
            text = p["text"]
            add_special = tok.bos_token is None or not text.startswith(tok.bos_token)
            ids = tok.encode(text, add_special_tokens=add_special)
        else:
            ids = p["ids"]
        # Quantized K/V from the prompt on: every attention, the prompt's own
        # included, reads the quantized cache (as Weft's pool stores it).
        qcache = (lambda: quantized_cache(model, kv_bits, kv_group_size)) if kv_bits \
            else (lambda: None)
        logits = model(mx.array(ids)[None], cache=qcache())[0, -1].astype(mx.float32)
        greedy = []
        margins = []
        steps = []
        for token, lp in generate_step(mx.array(ids), model, max_tokens=req["max_tokens"],
                                       sampler=lambda x: mx.argmax(x, axis=-1),
                                       prompt_cache=qcache()):
            greedy.append(int(token))
            t2 = mx.sort(lp.astype(mx.float32))[-2:].tolist()
            margins.append(t2[1] - t2[0])
            if req.get("full"):
                steps.append(lp.astype(mx.float32).tolist())
        top2 = mx.sort(logits)[-2:].tolist()
        r = {"ids": ids, "logits": logits.tolist(), "greedy": greedy,
             "margin": top2[1] - top2[0], "margins": margins}
        if req.get("full"):
            r["steps"] = steps
        results.append(r)
    json.dump({"results": results}, sys.stdout)


def batch(model_dir, requests):
    """Greedy continuous batching with mlx-lm's BatchGenerator.

    requests: {"batch_size": B, "rows": [{"ids": [...], "max_tokens": n,
    "join_step": k}]}; a row is inserted before the k-th call of
    next_generated(), so rows join and leave at different steps.
    """
    from mlx_lm.utils import load_model
    from mlx_lm.generate import BatchGenerator

    model, _ = load_model(Path(model_dir))
    model.set_dtype(mx.float32)
    req = json.loads(Path(requests).read_text())
    rows = req["rows"]
    gen = BatchGenerator(model, completion_batch_size=req["batch_size"],
                         prefill_batch_size=req["batch_size"],
                         sampler=lambda x: mx.argmax(x, axis=-1))
    uid_of = {}
    out = [{"tokens": [], "logprobs": [], "margins": [], "full": []} for _ in rows]
    step = 0
    done = 0
    while done < len(rows):
        joiners = [i for i, r in enumerate(rows) if r["join_step"] == step]
        if joiners:
            uids = gen.insert([rows[i]["ids"] for i in joiners],
                              [rows[i]["max_tokens"] for i in joiners])
            for i, u in zip(joiners, uids):
                uid_of[u] = i
        for r in gen.next_generated():
            i = uid_of[r.uid]
            lp = r.logprobs.astype(mx.float32)
            top2 = mx.sort(lp)[-2:].tolist()
            out[i]["tokens"].append(int(r.token))
            out[i]["logprobs"].append(float(lp[r.token]))
            out[i]["margins"].append(top2[1] - top2[0])
            if lp.size <= 1024:
                out[i]["full"].append(lp.tolist())
            if r.finish_reason is not None:
                done += 1
        step += 1
    json.dump({"rows": out}, sys.stdout)


def main():
    # On a GPU machine the tests may keep the oracle on the CPU: exact f32
    # (no TF32) and no CUDA start-up or kernel JIT per call.
    if os.environ.get("WEFT_ORACLE_DEVICE") == "cpu":
        mx.set_default_device(mx.cpu)
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixture")
    f.add_argument("--arch", choices=["llama", "llama-tiny", "llama-wide", "qwen2", "qwen3",
                                      "gemma3", "qwen3_5", "nemotron_h"],
                   required=True)
    f.add_argument("--out", required=True)
    f.add_argument("--quantize", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--requests", required=True)
    r.add_argument("--dequantize", action="store_true")
    r.add_argument("--adapter")
    r.add_argument("--kv-bits", type=int)
    r.add_argument("--kv-group-size", type=int, default=64)
    lf = sub.add_parser("lora-fixture")
    lf.add_argument("--model", required=True)
    lf.add_argument("--out", required=True)
    lf.add_argument("--rank", type=int, required=True)
    lf.add_argument("--scale", type=float, required=True)
    lf.add_argument("--seed", type=int, required=True)
    lf.add_argument("--keys")
    lf.add_argument("--num-layers", type=int, default=0)
    lf.add_argument("--peft-out")
    lf.add_argument("--rslora", action="store_true")
    gl = sub.add_parser("gdn-layer")
    gl.add_argument("--model", required=True)
    gl.add_argument("--out", required=True)
    b = sub.add_parser("batch")
    b.add_argument("--model", required=True)
    b.add_argument("--requests", required=True)
    a = ap.parse_args()
    if a.cmd == "fixture":
        make_fixture(a.arch, a.out, a.quantize)
    elif a.cmd == "run":
        run(a.model, a.requests, a.dequantize, a.adapter, a.kv_bits, a.kv_group_size)
    elif a.cmd == "gdn-layer":
        gdn_layer(a.model, a.out)
    elif a.cmd == "lora-fixture":
        make_lora_fixture(a.model, a.out, a.rank, a.scale, a.seed, a.keys, a.num_layers,
                          a.peft_out, a.rslora)
    else:
        batch(a.model, a.requests)


if __name__ == "__main__":
    main()
