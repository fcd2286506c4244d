"""Reference dequantization for weft-gguf's dequantization tests.

Usage:
  python dequant_oracle.py blocks TYPE IN.bin OUT.bin
      IN.bin holds whole blocks of ggml type TYPE (e.g. Q4_K); OUT.bin gets
      their values as little-endian f32, from `gguf.quants.dequantize`.
  python dequant_oracle.py tensors MODEL.gguf OUT_DIR NAME...
      For each tensor NAME of MODEL.gguf, OUT_DIR/NAME.f32 gets its values
      (as `gguf.quants.dequantize` decodes the bytes the `gguf` reader finds),
      and a JSON line {"name", "type", "n"} is printed.

`gguf` is llama.cpp's own Python package (pinned in tests/oracle/requirements.txt);
its dequantizers are numpy ports of ggml's reference C code, independent of the
Rust implementation under test.
"""

import json
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize


def main():
    mode = sys.argv[1]
    if mode == "blocks":
        qtype = GGMLQuantizationType[sys.argv[2]]
        data = np.fromfile(sys.argv[3], dtype=np.uint8)
        out = dequantize(data, qtype).astype("<f4", copy=False)
        out.tofile(sys.argv[4])
    elif mode == "tensors":
        reader = GGUFReader(sys.argv[2])
        by_name = {t.name: t for t in reader.tensors}
        for name in sys.argv[4:]:
            t = by_name[name]
            raw = np.asarray(t.data).view(np.uint8).reshape(-1)
            out = dequantize(raw, t.tensor_type).astype("<f4", copy=False).reshape(-1)
            out.tofile(os.path.join(sys.argv[3], name + ".f32"))
            print(json.dumps({"name": name, "type": t.tensor_type.name, "n": int(out.size)}))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
