"""Makes a random-weight Llama (or, with --arch qwen3_5, a Qwen3.5 hybrid) in
HF/mlx-lm layout, for GPU benchmarks.

The default shape is the ~1.2B model of DESIGN.md's H200 numbers (hidden 2048,
22 layers, 32 / 4 heads, FFN 5632, vocab 49152, bf16). Models this size are too
big to carry to the device machine, so they are made there with mlx-lm's own
model class; a tokenizer.json whose vocabulary fits (e.g. the default model's)
is copied beside it.

Usage: python3 benches/make_model.py OUT_DIR --tokenizer path/tokenizer.json [--layers 22]
       [--q-bits 4 --q-group 64]   (then quantized by mlx-lm's quantizer: affine, as mlx_lm.convert -q)
       [--arch qwen3_5]            Qwen3.5-0.8B's shape (hidden 1024, 24 layers, 3 Gated DeltaNet
                                   to 1 gated attention, 16 + 16 linear heads of 128, attention
                                   8 / 2 heads of 256, FFN 3584), the tokenizer's vocabulary
"""

import argparse
import json
import os
import shutil

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen3_5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--q-bits", type=int, default=0, help="quantize (affine) to this many bits; 0: bf16")
    ap.add_argument("--q-group", type=int, default=64)
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen3_5"])
    a = ap.parse_args()
    if a.arch == "qwen3_5":
        cfg = {
            "model_type": "qwen3_5",
            "hidden_size": 1024,
            "num_hidden_layers": 24,
            "intermediate_size": 3584,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "rms_norm_eps": 1e-6,
            "vocab_size": a.vocab,
            "linear_num_value_heads": 16,
            "linear_num_key_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "tie_word_embeddings": True,
            "max_position_embeddings": a.context,
            "rope_parameters": {"type": "default", "rope_theta": 10000000.0,
                                "partial_rotary_factor": 0.25},
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        mod = qwen3_5
    else:
        mod = llama
    cfg = cfg if a.arch == "qwen3_5" else {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": a.hidden,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "intermediate_size": a.ffn,
        "vocab_size": a.vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": a.context,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.bfloat16)
    # Small weights keep activations in range through 22 random layers.
    params = dict(tree_flatten(model.parameters()))
    for k, v in params.items():
        if v.ndim == 2:
            params[k] = (mx.random.normal(v.shape) * 0.02).astype(mx.bfloat16)
        elif k.endswith("A_log"):
            # mlx-lm keeps A_log in f32 (its cast predicate).
            params[k] = v.astype(mx.float32)
    mx.eval(params)
    if a.q_bits:
        import mlx.nn as nn
        model.load_weights(list(params.items()))
        nn.quantize(model, group_size=a.q_group, bits=a.q_bits)
        params = dict(tree_flatten(model.parameters()))
        mx.eval(params)
        cfg["quantization"] = {"group_size": a.q_group, "bits": a.q_bits, "mode": "affine"}
    os.makedirs(a.out, exist_ok=True)
    mx.save_safetensors(os.path.join(a.out, "model.safetensors"), params)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    shutil.copy(a.tokenizer, os.path.join(a.out, "tokenizer.json"))
    for name in ("tokenizer_config.json",):
        src = os.path.join(os.path.dirname(a.tokenizer), name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(a.out, name))
    n = sum(v.size for v in params.values())
    print(f"{a.out}: {n / 1e9:.2f}B parameters")


if __name__ == "__main__":
    main()
