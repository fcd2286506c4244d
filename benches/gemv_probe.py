"""Few-row matmul on the GPU: MLX's own (x @ w.T, mx.quantized_matmul) vs
Weft's GEMV kernels (crates/models/src/kernels/gemv.cu, qgemv4.cu) through
mx.fast.cuda_kernel, at the 1.2B Llama's projection shapes. Prints max |diff|
against MLX and the device's bandwidth: each timed op multiplies by the weights
of all layers stacked ([layers * N, K], far past L2), so the host's few us per
op are noise beside the device's time.

    python3 benches/gemv_probe.py [--rows 1,2,4,8] [--reps 20]
"""
import argparse
import pathlib
import statistics
import time

import mlx.core as mx

SRC = pathlib.Path(__file__).resolve().parent.parent / "crates/models/src/kernels"
SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (11264, 2048),
          "down": (2048, 5632), "head": (49152, 2048)}


def kernel(name, inputs):
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=["y"],
                               source=(SRC / f"{name}.cu").read_text())


def gemv(k, x, w, extra=(), tmpl=()):
    n = w.shape[0]
    b = x.shape[0]
    threads = 256
    grid = (n * 32 + threads - 1) // threads * threads
    return k(inputs=[x, w, *extra], template=[("NB", b), *tmpl, ("DT", x.dtype)],
             grid=(grid, 1, 1), threadgroup=(threads, 1, 1),
             output_shapes=[(b, n)], output_dtypes=[x.dtype])[0]


def timed(fn, reps):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=22)
    a = ap.parse_args()
    kd = kernel("gemv", ["x", "w"])
    kq = kernel("qgemv4", ["x", "w", "scales", "biases"])
    for name, (n, k) in SHAPES.items():
        n = n * (2 if name == "head" else a.layers)
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        q = mx.quantize(w, group_size=64, bits=4)
        mx.eval(w, q)
        mb = n * k * 2 / 1e6
        for b in [int(r) for r in a.rows.split(",")]:
            x = mx.random.normal((b, k)).astype(mx.bfloat16)
            mx.eval(x)
            ref = x @ w.T
            got = gemv(kd, x, w)
            qref = mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=4)
            qgot = gemv(kq, x, q[0], q[1:], [("G", 64)])
            scale = mx.abs(ref).max().item()
            err = mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item() / scale
            qerr = mx.abs(qgot.astype(mx.float32) - qref.astype(mx.float32)).max().item() / scale
            t_mlx = timed(lambda: x @ w.T, a.reps)
            t_own = timed(lambda: gemv(kd, x, w), a.reps)
            t_qmlx = timed(lambda: mx.quantized_matmul(x, *q, transpose=True, group_size=64,
                                                       bits=4), a.reps)
            t_qown = timed(lambda: gemv(kq, x, q[0], q[1:], [("G", 64)]), a.reps)
            print(f"{name:8s} {n:6d}x{k:5d} rows {b}: bf16 mlx {t_mlx*1e6:7.0f} us "
                  f"({mb/t_mlx/1e3:5.0f} GB/s) own {t_own*1e6:7.0f} us ({mb/t_own/1e3:5.0f} GB/s) "
                  f"err {err:.1e} | q4 mlx {t_qmlx*1e6:7.0f} us ({mb/4/t_qmlx/1e3:5.0f} GB/s) "
                  f"own {t_qown*1e6:7.0f} us ({mb/4/t_qown/1e3:5.0f} GB/s) err {qerr:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
