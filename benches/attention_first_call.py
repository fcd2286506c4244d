"""First-call cost of prefill attention per new shape on MLX (issue 14, the
cold server): mx.fast.scaled_dot_product_attention against attention composed
of matmul + softmax, for the ragged/chunked prefill shapes a server meets
(rows B, query tokens T, keys L; 32 query heads over 4 KV heads, head 64, bf16).

    bash .gpu/b/env.sh python3 benches/attention_first_call.py   (or STEPS=firstcall of benches/gpu_decode.sh)

(Written 2026-12-03 after the cold-server run of benches/RESULTS.md; not run yet.)
"""
import time

import mlx.core as mx

HQ, HKV, D = 32, 4, 64
SHAPES = [(1, 129, 129), (2, 129, 129), (16, 128, 128), (17, 16, 300), (17, 16, 316),
          (3, 77, 500), (8, 32, 1000), (16, 128, 128)]


def sdpa(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)


def composed(q, k, v, mask):
    b, _, t, _ = q.shape
    l = k.shape[2]
    qg = q.reshape(b, HKV, HQ // HKV, t, D)
    s = (qg * D ** -0.5) @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    s = mx.where(mx.expand_dims(mask, 2), s, mx.array(float("-inf"), s.dtype))
    p = mx.softmax(s.astype(mx.float32), axis=-1).astype(q.dtype)
    return (p @ mx.expand_dims(v, 2)).reshape(b, HQ, t, D)


def timed(f, *a):
    t = time.perf_counter()
    mx.eval(f(*a))
    return (time.perf_counter() - t) * 1e3


for name, f in [("sdpa", sdpa), ("composed", composed)]:
    for b, t, l in SHAPES:
        q = mx.random.normal((b, HQ, t, D)).astype(mx.bfloat16)
        k = mx.random.normal((b, HKV, l, D)).astype(mx.bfloat16)
        v = mx.random.normal((b, HKV, l, D)).astype(mx.bfloat16)
        mask = (mx.arange(l)[None, :] <= (mx.arange(t)[:, None] + l - t))[None, None]
        mask = mx.broadcast_to(mask, (b, 1, t, l))
        mx.eval(q, k, v, mask)
        first, second = timed(f, q, k, v, mask), timed(f, q, k, v, mask)
        err = ""
        if name == "composed":
            d = mx.abs(composed(q, k, v, mask).astype(mx.float32) - sdpa(q, k, v, mask).astype(mx.float32)).max()
            err = f" max |composed - sdpa| {d.item():.4f}"
        print(f"{name} B={b} T={t} L={l}: first {first:.1f} ms, second {second:.2f} ms{err}", flush=True)
