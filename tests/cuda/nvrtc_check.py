"""Compiles CUDA kernel bodies with NVRTC for sm_90 the way MLX's
`mx.fast.cuda_kernel` wraps them (inputs as `const T*` with `<name>_shape`
when the body uses it, outputs as `T*`, template arguments as constexpr
lines), without a GPU: crates/models/tests/cuda_sources.rs hands it every
variant Weft launches. Fails on any NVRTC error or warning, on register
spills (a spill is a slow kernel that still compiles) and, for a variant
whose block size is given (const `ST`), on more registers than an SM holds
for a block that size (such a launch fails on the GPU).

    python3 tests/cuda/nvrtc_check.py SPEC.json

SPEC: [{"name", "inputs": [[name, ctype]], "outputs": [[name, ctype]],
        "consts": [[name, int]], "types": [[name, ctype]], "source"}].
MLX's own device header is replaced by CUDA's bf16/fp16 headers and a
stand-in for its Shape parameter type (the bodies index it only).
"""
import ctypes
import json
import time
import pathlib
import re
import sys

import nvidia.cuda_nvrtc
import nvidia.cuda_runtime

NVRTC = ctypes.CDLL(str(pathlib.Path(nvidia.cuda_nvrtc.__path__[0]) / "lib" / "libnvrtc.so.12"))
INCLUDE = pathlib.Path(nvidia.cuda_runtime.__path__[0]) / "include"
PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef unsigned int uint32_t;
typedef int int32_t;
struct Shape { int d[8]; __device__ int operator[](int i) const { return d[i]; } };
#define inf (__int_as_float(0x7f800000))
"""


def wrap(v):
    params = []
    for name, ctype in v["inputs"]:
        params.append(f"const {ctype}* {name}")
        if f"{name}_shape" in v["source"]:
            params.append(f"const __grid_constant__ Shape {name}_shape")
    params += [f"{ctype}* {name}" for name, ctype in v["outputs"]]
    consts = "".join(f"  constexpr int {n} = {x};\n" for n, x in v["consts"])
    consts += "".join(f"  using {n} = {t};\n" for n, t in v["types"])
    return (PRELUDE + "namespace mlx::core::cu {\n__global__ void " + v["name"] + "(\n    "
            + ",\n    ".join(params) + ") {\n" + consts + v["source"] + "\n}\n}\n")


def compile_one(src, name):
    prog = ctypes.c_void_p()
    rc = NVRTC.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0,
                                  None, None)
    if rc != 0:
        return rc, f"nvrtcCreateProgram failed: {rc}"
    opts = [b"--gpu-architecture=sm_90", b"-I" + str(INCLUDE).encode(), b"--std=c++17",
            b"-default-device", b"--ptxas-options=--verbose"]
    rc = NVRTC.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    NVRTC.nvrtcGetProgramLog(prog, log)
    NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


def main():
    spec = json.loads(pathlib.Path(sys.argv[1]).read_text())
    bad = 0
    for v in spec:
        what = v["name"] + " " + " ".join(f"{n}={x}" for n, x in v["consts"]) + " " + " ".join(
            t for _, t in v["types"])
        t0 = time.perf_counter()
        rc, log = compile_one(wrap(v), v["name"])
        secs = time.perf_counter() - t0
        spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", log)]
        regs = re.findall(r"Used (\d+) registers", log)
        problems = []
        if rc != 0:
            problems.append(f"NVRTC error {rc}")
        if re.search(r"\bwarning\b", log):
            problems.append("warnings")
        if any(spills):
            problems.append(f"spills {spills}")
        threads = dict(v["consts"]).get("ST")
        if threads and regs and max(int(r) for r in regs) * threads > 65536:
            problems.append(f"{max(int(r) for r in regs)} registers: no room for {threads} threads")
        if problems:
            bad += 1
            print(f"FAIL {what}: {', '.join(problems)}\n{log[:4000]}", flush=True)
        else:
            print(f"ok   {what}: registers {','.join(regs)}, {secs:.2f} s", flush=True)
    print(f"{len(spec)} variants, {bad} failed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
