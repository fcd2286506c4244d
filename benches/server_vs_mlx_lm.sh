#!/usr/bin/env bash
# `weft serve` vs `mlx_lm.server` on the same model and machine, same run:
# `weft bench` drives both (gRPC for Weft, OpenAI streaming HTTP for mlx-lm) at
# each concurrency with the same prompt/output lengths.
#
#   bash benches/server_vs_mlx_lm.sh [streams="1 8 32"] [requests_per_stream=2]
#
# Both sides compute in f32 over the same dense weights with OpenBLAS: the
# default model is dequantized once into an f32 MLX directory (by mlx-lm), and
# both servers load that directory. Prints one JSON summary line per run.
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${1:-"1 8 32"}
PER=${2:-2}
PY=${WEFT_PYTHON:-.venv/bin/python}
WEFT=${WEFT_BIN:-target/release/weft}
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
SRC=$($WEFT pull)
F32=${WEFT_HOME:-$HOME/.cache/weft}/models/SmolLM2-135M-Instruct-f32
if [ ! -f "$F32/model.safetensors" ]; then
  $PY - "$SRC" "$F32" <<'PYEOF'
import json, shutil, sys
from pathlib import Path
sys.path.insert(0, "tests/oracle")
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
from mlx_lm_oracle import dequantize_modules
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
model, _ = load_model(src)
dequantize_modules(model)
model.set_dtype(mx.float32)
dst.mkdir(parents=True, exist_ok=True)
mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())))
cfg = json.loads((src / "config.json").read_text())
for k in ("quantization", "quantization_config"):
    cfg.pop(k, None)
cfg["torch_dtype"] = "float32"
(dst / "config.json").write_text(json.dumps(cfg, indent=1))
for f in src.iterdir():
    if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
        shutil.copy(f, dst / f.name)
PYEOF
fi
BENCH_ARGS="--prompt-tokens 128 --max-tokens 64 --warmup 1 --quiet"
for n in $STREAMS; do
  reqs=$((n * PER))
  $WEFT serve --model "$F32" --listen 127.0.0.1:50551 --metrics-listen off --max-batch-rows 64 > /tmp/weft-serve.log 2>&1 &
  WPID=$!
  for _ in $(seq 120); do grep -q "ready" /tmp/weft-serve.log && break; sleep 1; done
  $WEFT bench --target grpc://127.0.0.1:50551 -c "$n" -n "$reqs" $BENCH_ARGS --json /tmp/weft-$n.json > /dev/null
  kill -TERM $WPID; wait $WPID || true
  LD_PRELOAD=$OPENBLAS $PY -m mlx_lm.server --model "$F32" --port 50552 > /tmp/mlx-server.log 2>&1 &
  MPID=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:50552/v1/models > /dev/null && break; sleep 1; done
  $WEFT bench --target http://127.0.0.1:50552 --api openai -c "$n" -n "$reqs" $BENCH_ARGS --json /tmp/mlx-$n.json > /dev/null
  kill $MPID; wait $MPID || true
  for side in weft mlx; do
    $PY -c "
import json,sys; d=json.load(open('/tmp/$side-$n.json'))['overall']
print(json.dumps({'side': '$side', 'streams': $n, 'ok': d.get('ok'), 'errors': d.get('errors'),
  'output_tok_s': round(d.get('output_tokens_per_s', 0), 1), 'req_s': round(d.get('requests_per_s', 0), 3),
  'ttft_p50_ms': d['ttft_ms']['p50'], 'ttft_p99_ms': d['ttft_ms']['p99'], 'itl_p99_ms': d['itl_ms']['p99']}))"
  done
done
