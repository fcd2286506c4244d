"""Device time of one deep prompt chunk's composed attention on MLX (issue 17
item 1): the scores in f32 through the mask and the softmax (Weft before
cad97d5) against the scores kept in bf16 with a precise softmax (after), per
(query tokens T, key slots L) of a chunk deep into a long prompt, one layer of
the 1.2B model's shape (32 query heads over 4 KV heads, head 64, bf16), each
compiled as Weft's compiled prefill is. Also the full-dtype SDPA for scale.

    bash .gpu/b/env.sh python3 benches/composed_attention_probe.py   (or STEPS=attnprobe of benches/gpu_decode.sh)
"""
import time

import mlx.core as mx

HQ, HKV, D = 32, 4, 64
SHAPES = [(256, 2048), (512, 4096), (256, 8192), (224, 6144), (512, 8192)]
LAYERS = 22


def scores(q, k):
    b, _, t, _ = q.shape
    qg = (q * D ** -0.5).reshape(b, HKV, HQ // HKV, t, D)
    return qg @ mx.expand_dims(k, 2).swapaxes(-1, -2)


def f32_scores(q, k, v, seen):
    b, _, t, _ = q.shape
    s = scores(q, k).astype(mx.float32)
    s = mx.where(seen, s, mx.array(-3.4e38, mx.float32))
    p = mx.softmax(s, axis=-1).astype(q.dtype)
    return (p @ mx.expand_dims(v, 2)).reshape(b, HQ, t, D)


def dtype_scores(q, k, v, seen):
    b, _, t, _ = q.shape
    s = scores(q, k)
    s = mx.where(seen, s, mx.array(-3.38e38, s.dtype))
    p = mx.softmax(s, axis=-1, precise=True)
    return (p @ mx.expand_dims(v, 2)).reshape(b, HQ, t, D)


def timed(f, args, reps=10):
    mx.eval(f(*args))
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        outs = [f(*args) for _ in range(LAYERS)]
        mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    print(f"one chunk over {LAYERS} layers, ms (bf16, {HQ}/{HKV} heads, head {D})")
    print("T, L | f32 scores | bf16 scores, precise softmax | max |diff| | SDPA with the mask")
    for t, l in SHAPES:
        q = mx.random.normal((1, HQ, t, D)).astype(mx.bfloat16)
        k = mx.random.normal((1, HKV, l, D)).astype(mx.bfloat16)
        v = mx.random.normal((1, HKV, l, D)).astype(mx.bfloat16)
        # The chunk's rows see keys up to their position (depth l - t, keys past
        # the row's context are table padding a real chunk's mask hides too).
        depth = (l * 2) // 3
        qi = mx.arange(t)[:, None] + depth
        seen = (mx.arange(l)[None, :] <= qi).reshape(1, 1, 1, t, l)
        a = timed(mx.compile(f32_scores), (q, k, v, seen))
        b = timed(mx.compile(dtype_scores), (q, k, v, seen))
        diff = mx.abs(f32_scores(q, k, v, seen).astype(mx.float32)
                      - dtype_scores(q, k, v, seen).astype(mx.float32)).max().item()
        m = seen.reshape(1, 1, t, l)
        s = timed(lambda q, k, v: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=D ** -0.5, mask=m), (q, k, v))
        print(f"{t}, {l} | {a:.2f} | {b:.2f} | {diff:.4f} | {s:.2f}")


if __name__ == "__main__":
    main()
