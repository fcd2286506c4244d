"""Few-row matmuls on the GPU: MLX's own ops vs Weft's GEMV kernels
(crates/models/src/kernels/gemv_{head,dense,q4,tail}.cu, joined as
crates/models/src/gemv.rs joins them) through mx.fast.cuda_kernel, at the
1.2B Llama's projection shapes, bf16 and affine 4-bit (g64). Each decode-layer
op is measured as the fused kernel Weft runs and as MLX's chain of ops it
replaces:

  qkv      rms_norm(h) @ Wqkv^T              (NORM=1)
  o        h + a @ Wo^T                      (EPI=1)
  gate_up  silu(n @ Wg^T) * (n @ Wu^T), n = rms_norm(h)   (NORM=1, EPI=2)
  down     h + m @ Wd^T                      (EPI=1)
  head     rms_norm(h) @ Wlm^T               (NORM=1)

Prints the error against MLX's chain (max |diff| / max |ref|) and the device's
bandwidth; each timed op multiplies by the weights of all layers stacked
([layers * N, K], far past L2), so the host's few us per op are noise beside
the device's time.

    python3 benches/gemv_probe.py [--rows 1,2,4,8] [--cols 1,2,4] [--reps 20] [--max-blocks 1024]

--cols: output columns per warp (NC; several rows only, gemv.rs's GEMV_COLS).
"""
import argparse
import pathlib
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

SRC = pathlib.Path(__file__).resolve().parent.parent / "crates/models/src/kernels"
# name: (N, K, NORM, EPI)
OPS = {"qkv": (2560, 2048, 1, 0), "o": (2048, 2048, 0, 1), "gate_up": (11264, 2048, 1, 2),
       "down": (2048, 5632, 0, 1), "head": (49152, 2048, 1, 0)}
EPS = 1e-5


def source(loop):
    parts = ["gemv_head", "gemv_cols", f"gemv_{loop}", "gemv_tail"]
    return "constexpr int XS_CAP = (NB <= 4 ? 1024 : 2560);\n" + "".join(
        (SRC / f"{p}.cu").read_text() for p in parts)


def mma_source(a):
    parts = ["gemv_head", "mma_open", f"mma_a_{a}", "mma_close"]
    return "constexpr int XS_CAP = 1;\n" + "".join((SRC / f"{p}.cu").read_text() for p in parts)


def kernels():
    dn, qn = ["x", "w", "nw", "eps", "res"], ["x", "w", "scales", "biases", "nw", "eps", "res"]
    k = lambda name, ins, src: mx.fast.cuda_kernel(name=name, input_names=ins, output_names=["y"],
                                                   source=src)
    return (k("weft_gemv_dense", dn, source("dense")), k("weft_gemv_q4", qn, source("q4")),
            k("weft_mma_dense", dn, mma_source("dense")), k("weft_mma_q4", qn, mma_source("q4")))


def launch_mma(k, x, weights, nw, eps, res, n, norm, epi, max_blocks, g=None):
    b = x.shape[0]
    no = n // 2 if epi == 2 else n
    blocks = min(no // 16, max_blocks)
    tmpl = [("NB", (b + 7) // 8 * 8), ("ROWS_RT", 1), ("NORM", norm), ("EPI", epi), ("BF16", 1)] + ([("G", g)] if g else []) + [
        ("DT", x.dtype)]
    return k(inputs=[x, *weights, nw, eps, res], template=tmpl, grid=(blocks * 128, 1, 1),
             threadgroup=(128, 1, 1), output_shapes=[(b, no)], output_dtypes=[x.dtype])[0]


def launch(k, x, weights, nw, eps, res, n, norm, epi, max_blocks, nc, g=None):
    b = x.shape[0]
    no = n // 2 if epi == 2 else n
    blocks = min((no + 8 * nc - 1) // (8 * nc), max_blocks)
    tmpl = [("NB", b), ("ROWS_RT", 0), ("NORM", norm), ("EPI", epi), ("NC", nc)] + ([("G", g)] if g else []) + [("DT", x.dtype)]
    return k(inputs=[x, *weights, nw, eps, res], template=tmpl, grid=(blocks * 256, 1, 1),
             threadgroup=(256, 1, 1), output_shapes=[(b, no)], output_dtypes=[x.dtype])[0]


def timed(fn, reps):
    mx.eval(fn())
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
    ap.add_argument("--max-blocks", type=int, default=1024)
    ap.add_argument("--cols", default="1,2,4")
    a = ap.parse_args()
    kd, kq, kmd, kmq = kernels()
    eps = mx.array([EPS], dtype=mx.float32)
    for name, (n, k, norm, epi) in OPS.items():
        # Stack the layers' weights (gate/up stays [gate; up] per kernel call,
        # so the stacked form is [L * F gate rows; L * F up rows]).
        n = n * (1 if name == "head" else a.layers)
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        q = mx.quantize(w, group_size=64, bits=4)
        nw = (1.0 + 0.1 * mx.random.normal((k,))).astype(mx.bfloat16)
        mx.eval(w, q, nw)
        mb = n * k * 2 / 1e6
        for b in [int(r) for r in a.rows.split(",")]:
            x = mx.random.normal((b, k)).astype(mx.bfloat16)
            no = n // 2 if epi == 2 else n
            res = mx.random.normal((b, no)).astype(mx.bfloat16) if epi == 1 else mx.zeros((1,), mx.bfloat16)
            mx.eval(x, res)

            def chain(mm):
                y = mm(mx.fast.rms_norm(x, nw, EPS) if norm else x)
                if epi == 1:
                    y = res + y
                elif epi == 2:
                    gt, up = mx.split(y, 2, axis=-1)
                    y = nn.silu(gt) * up
                return y

            dense_mm = lambda v: v @ w.T
            q_mm = lambda v: mx.quantized_matmul(v, *q, transpose=True, group_size=64, bits=4)
            ref, qref = chain(dense_mm), chain(q_mm)
            scale = mx.abs(ref).max().item()
            t_mlx, t_qmlx = timed(lambda: chain(dense_mm), a.reps), timed(lambda: chain(q_mm), a.reps)
            print(f"{name:8s} {n:6d}x{k:5d} rows {b}: bf16 mlx {t_mlx*1e6:6.0f} us "
                  f"({mb/t_mlx/1e3:5.0f} GB/s) | q4 mlx {t_qmlx*1e6:6.0f} us ({mb/4/t_qmlx/1e3:5.0f} GB/s)",
                  flush=True)
            def measure(label, own, qown):
                got, qgot = own(), qown()
                err = mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item() / scale
                qerr = mx.abs(qgot.astype(mx.float32) - qref.astype(mx.float32)).max().item() / scale
                t_own, t_qown = timed(own, a.reps), timed(qown, a.reps)
                print(f"{'':8s} {'':12s} {label}: bf16 own {t_own*1e6:6.0f} us ({mb/t_own/1e3:5.0f} GB/s) "
                      f"err {err:.1e} | q4 own {t_qown*1e6:6.0f} us ({mb/4/t_qown/1e3:5.0f} GB/s) "
                      f"err {qerr:.1e}", flush=True)

            if b >= 2:
                measure("mma", lambda: launch_mma(kmd, x, [w], nw, eps, res, n, norm, epi, a.max_blocks),
                        lambda: launch_mma(kmq, x, list(q), nw, eps, res, n, norm, epi, a.max_blocks, 64))
            for nc in [int(c) for c in a.cols.split(",")]:
                if (b == 1 and nc != 1) or no % nc:
                    continue
                measure(f"NC {nc}", lambda: launch(kd, x, [w], nw, eps, res, n, norm, epi, a.max_blocks, nc),
                        lambda: launch(kq, x, list(q), nw, eps, res, n, norm, epi, a.max_blocks, nc, 64))


if __name__ == "__main__":
    main()
