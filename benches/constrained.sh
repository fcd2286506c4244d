#!/usr/bin/env bash
# Constrained output (issue 19): 32 streams, half of them constrained by a JSON
# schema, against the same 32 streams unconstrained, in-process
# (`weft bench-engine`), interleaved so both see the same machine load. Prints
# one JSON report line per run (steady_decode_tok_per_s, mask_ms_per_step,
# mask_us_per_row, pipelined_steps, constrained_tokens) and the ratio.
#
#   bash benches/constrained.sh                       # here (default model, CPU)
#   WEFT=/root/ws/weft MODEL=/root/m12 bash benches/constrained.sh   # on the GPU box
#   STREAMS=32 CONSTRAINED=16 GEN=128 PROMPT=128 ROUNDS=2 PAIRS=2 SCHEMA=file.json
#
# The default schema (BENCH_SCHEMA in crates/grpc/src/engine_bench.rs) is a list
# of at least 64 records, so no stream completes it inside GEN tokens and both
# runs decode the same number of tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
WEFT=${WEFT:-target/release/weft}
STREAMS=${STREAMS:-32}; CONSTRAINED=${CONSTRAINED:-$((STREAMS / 2))}
GEN=${GEN:-128}; PROMPT=${PROMPT:-128}; ROUNDS=${ROUNDS:-2}; PAIRS=${PAIRS:-2}
args=(bench-engine --streams "$STREAMS" --gen-tokens "$GEN" --prompt-tokens "$PROMPT" --rounds "$ROUNDS")
[ -n "${MODEL:-}" ] && args+=(--model "$MODEL")
extra=(); [ -n "${SCHEMA:-}" ] && extra=(--json-schema "$SCHEMA")
free=(); cons=()
for i in $(seq "$PAIRS"); do
  f=$("$WEFT" "${args[@]}" 2>/dev/null | tail -1); echo "free:        $f"; free+=("$f")
  c=$("$WEFT" "${args[@]}" --constrained "$CONSTRAINED" "${extra[@]}" 2>/dev/null | tail -1)
  echo "constrained: $c"; cons+=("$c")
done
python3 - "${free[@]}" -- "${cons[@]}" <<'PY'
import json, statistics, sys
a = sys.argv[1:]; k = a.index("--")
free = [json.loads(x) for x in a[:k]]; cons = [json.loads(x) for x in a[k + 1:]]
f = statistics.median(r["steady_decode_tok_per_s"] for r in free)
c = statistics.median(r["steady_decode_tok_per_s"] for r in cons)
m = statistics.median(r["mask_ms_per_step"] for r in cons)
u = statistics.median(r["mask_us_per_row"] for r in cons)
print(f"steady decode tok/s: unconstrained {f:.1f}, half constrained {c:.1f}: {c / f:.3f}x; "
      f"host mask time {m:.2f} ms/step ({u:.0f} us per row); "
      f"pipelined steps {free[-1]['pipelined_steps']} vs {cons[-1]['pipelined_steps']}")
PY
