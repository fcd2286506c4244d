"""Paged KV on MLX (CUDA or CPU): what a decode step pays for reading paged KV.

Measures, per attention layer of a Llama-1.2B-like shape (32 query heads, 4 KV
heads, head_dim 64, bf16, 16-token blocks), at B rows and C tokens of context:

* write:  one token per row scattered into the pool at per-row (block, offset)
          slots, for a small and a large pool: equal times mean the scatter
          updates the pool in place (donated buffer), times that grow with the
          pool mean MLX copied it.
* dense:  SDPA over a contiguous [B, 4, C, 64] cache (what a dense batch reads).
* gather: the paged read Weft does (gather every row's blocks into the padded
          [B, 4, C, 64] layout) plus SDPA with the boolean mask.
* gather_only: the gather alone.

Usage: python3 benches/paged_attention_probe.py [--rows 1,64,256] [--ctx 512,2048,8192]
Prints a table; `--layers 22` scales per-layer numbers to a whole step's share.
"""

import argparse
import time

import mlx.core as mx


def timeit(fn, reps, sync_each=False):
    for _ in range(3):
        mx.eval(fn())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
        if sync_each:
            mx.synchronize()
    mx.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--ctx", default="512,2048,8192")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=22)
    a = ap.parse_args()
    try:
        print("device_info:", mx.device_info())
    except Exception as e:  # older MLX
        print("device_info unavailable:", e)
    print("default device:", mx.default_device())
    H, HQ, D, BS, dt = 4, 32, 64, 16, mx.bfloat16

    # Donation: a write into a small and into a large pool.
    for nb in (4096, 262144):
        pool = mx.zeros((nb, H, BS, D), dtype=dt)
        mx.eval(pool)
        b = 256
        blocks = mx.array([(i * 37) % nb for i in range(b)], dtype=mx.int32)
        offs = mx.array([i % BS for i in range(b)], dtype=mx.int32)
        x = mx.random.normal((b, H, D)).astype(dt)
        hidx = mx.arange(H, dtype=mx.int32)[None, :]
        mx.eval(x)
        state = {"p": pool}
        del pool

        def write():
            p = state.pop("p")
            p[blocks[:, None], hidx, offs[:, None]] = x
            state["p"] = p
            return p

        gb = nb * H * BS * D * 2 / 1e9
        for sync in (False, True):
            ms = timeit(write, a.reps, sync_each=sync)
            print(f"write 256 tokens into a {gb:.2f} GB pool (sync each {sync}): {ms:.3f} ms")
        del state

    print(f"{'rows':>5} {'ctx':>6} {'dense ms':>9} {'gather+sdpa':>12} {'gather':>8} {'extra/layer':>12} {'extra/step':>11}")
    for B in [int(v) for v in a.rows.split(",")]:
        for C in [int(v) for v in a.ctx.split(",")]:
            nbr = C // BS
            nb = B * nbr + 8
            pool_k = mx.random.normal((nb, H, BS, D)).astype(dt)
            pool_v = mx.random.normal((nb, H, BS, D)).astype(dt)
            # Fragmented tables: row r's blocks interleaved with every other row's.
            perm = mx.random.permutation(B * nbr).astype(mx.int32)
            table = perm.reshape(B, nbr)
            heads = mx.arange(H, dtype=mx.int32).reshape(1, H, 1)
            q = mx.random.normal((B, HQ, 1, D)).astype(dt)
            kd = mx.random.normal((B, H, C, D)).astype(dt)
            vd = mx.random.normal((B, H, C, D)).astype(dt)
            mask = mx.ones((B, 1, 1, C), dtype=mx.bool_)
            mx.eval(pool_k, pool_v, table, q, kd, vd, mask)
            scale = D ** -0.5

            def dense():
                return mx.fast.scaled_dot_product_attention(q, kd, vd, scale=scale)

            def gather():
                idx = table[:, None, :]  # [B, 1, nb]
                k = pool_k[idx, heads].reshape(B, H, C, D)
                v = pool_v[idx, heads].reshape(B, H, C, D)
                return k, v

            def paged():
                k, v = gather()
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

            td = timeit(dense, a.reps)
            tp = timeit(paged, a.reps)
            tg = timeit(gather, a.reps)
            extra = tp - td
            print(f"{B:>5} {C:>6} {td:>9.3f} {tp:>12.3f} {tg:>8.3f} {extra:>12.3f} {extra * a.layers:>11.2f}")
            del pool_k, pool_v, kd, vd


if __name__ == "__main__":
    main()
