#!/usr/bin/env bash
# The cold-server diagnostic of benches/RESULTS.md (issue 14, the server): one
# `weft serve` on the device's 1.2B model, the same 64-stream bench twice with
# per-step debug logs (steps over 30 ms listed), then the first-call cost of
# MLX's SDPA per new shape. Stage with `bash benches/gpu_decode.sh` and its call
# 1; then, within the machine's idle window:
#   carry .gpu/b .gpustash/d2:  bash .gpu/b/env.sh bash benches/gpu_server_cold.sh
set -e
W=/root/ws
[ -x /root/weft ] || { xz -d -c $W/weft.xz > /root/weft && chmod +x /root/weft; }
export PYTHONUNBUFFERED=1
M=/root/m12
t=$(date +%s)
[ -f $M/model.safetensors ] || python3 benches/make_model.py $M --tokenizer $W/tokenizer.json > /tmp/mk.log 2>&1
echo "model made in $(( $(date +%s) - t )) s"
RUST_LOG=weft_scheduler=debug,info /root/weft serve --model $M --listen 127.0.0.1:50551 \
  --metrics-listen 127.0.0.1:50553 --max-batch-rows 64 > /tmp/s.log 2>&1 &
P=$!
for _ in $(seq 600); do grep -q "ready: serving" /tmp/s.log && break; sleep 0.2; done
grep -v '"step"\| step ' /tmp/s.log | grep -iv "debug" | cut -c1-300 | tail -15
A="--prompt-tokens 128 --max-tokens 128 --warmup 2 --quiet"
for run in 1 2; do
  n0=$(wc -l < /tmp/s.log)
  /root/weft bench --target grpc://127.0.0.1:50551 -c 64 -n 128 $A --json /tmp/w$run.json > /dev/null
  python3 -c "
import json; d=json.load(open('/tmp/w$run.json'))['overall']
print('run $run', d['output_tokens_per_s'], 'ttft', d['ttft_ms'], 'itl p50', d['itl_ms']['p50'])"
  echo "-- run $run: steps over 30 ms (of $(tail -n +$n0 /tmp/s.log | grep -c 'step'))"
  tail -n +$n0 /tmp/s.log | grep "step" | python3 -c "
import sys, re
for l in sys.stdin:
    m = re.search(r'ms=([0-9.]+)', l)
    if m and float(m.group(1)) > 30:
        print(re.sub(r'\x1b\[[0-9;]*m', '', l).strip()[:220])
" | head -40
  # Where the run's time went: decode-only steps (tokens == rows) vs steps with
  # prefill, and the engine's idle time between steps (wall minus steps).
  tail -n +$n0 /tmp/s.log | grep "step rows=" | python3 -c "
import sys, re, json
wall = json.load(open('/tmp/w$run.json'))['duration_s']
dec, mix = [], []
for l in sys.stdin:
    m = re.search(r'rows=([0-9]+) tokens=([0-9]+).*ms=([0-9.]+)', l)
    if m:
        (dec if m.group(1) == m.group(2) else mix).append(float(m.group(3)))
med = lambda v: sorted(v)[len(v) // 2] if v else 0
tot = (sum(dec) + sum(mix)) / 1e3
print(f'   decode-only {len(dec)} steps, median {med(dec):.2f} ms, {sum(dec)/1e3:.2f} s;'
      f' with prefill {len(mix)} steps, median {med(mix):.2f} ms, {sum(mix)/1e3:.2f} s;'
      f' steps {tot:.2f} s of a {wall:.2f} s run')
"
done
python3 -c "
import urllib.request
for l in urllib.request.urlopen('http://127.0.0.1:50553/metrics').read().decode().splitlines():
    if 'compile_traces' in l or 'step_duration_seconds_sum' in l or 'step_duration_seconds_count' in l: print(l)"
kill -TERM $P; wait $P || true
python3 - <<'PY'
import time, mlx.core as mx
for (b, l) in [(1, 129), (2, 129), (3, 129), (7, 129), (3, 258), (1, 129)]:
    q = mx.random.normal((b, 32, l, 64)).astype(mx.bfloat16)
    k = mx.random.normal((b, 4, l, 64)).astype(mx.bfloat16)
    mx.eval(q, k)
    ts = []
    for _ in range(2):
        t = time.perf_counter()
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal"))
        ts.append((time.perf_counter() - t) * 1e3)
    print(f"sdpa causal B={b} L={l}: first {ts[0]:.1f} ms, second {ts[1]:.1f} ms")
PY
