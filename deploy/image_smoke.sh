#!/usr/bin/env bash
# Builds the CPU image (deploy/Containerfile) unless it exists, runs it, and
# checks it from outside: it runs as uid 10001, gRPC health says SERVING, a
# gRPC generation succeeds (the image's own `weft bench`), the OpenAI HTTP API
# lists the model and completes with a tenant's key and answers 401 without
# one, and the metrics listener serves weft_ series. Exits non-zero on the
# first failed check. Run from the repository root.
#
# Environment:
#   PODMAN             podman command (default podman)
#   IMAGE              image name (default weft)
#   PODMAN_BUILD_ARGS  extra `podman build` args (default --network=host);
#                      add --pull=never to build on deploy/local_base_images.sh
#   GRPC_PORT HTTP_PORT METRICS_PORT  (default 50051 8000 9464; host network)
#   PYTHON             a python with grpcio-health-checking, for the gRPC
#                      health check (default python3); SKIP_GRPC_HEALTH=1
#                      leaves that one check out
#   READY_TIMEOUT      seconds to wait for the model to load (default 300)
set -euo pipefail

PODMAN=${PODMAN:-podman}
IMAGE=${IMAGE:-weft}
PODMAN_BUILD_ARGS=${PODMAN_BUILD_ARGS:---network=host}
GRPC_PORT=${GRPC_PORT:-50051}
HTTP_PORT=${HTTP_PORT:-8000}
METRICS_PORT=${METRICS_PORT:-9464}
PYTHON=${PYTHON:-python3}
READY_TIMEOUT=${READY_TIMEOUT:-300}
NAME=weft-smoke-$$

fail() { echo "FAIL: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }

if $PODMAN image exists "$IMAGE"; then
  echo "image $IMAGE exists; not rebuilding"
else
  # shellcheck disable=SC2086
  $PODMAN build $PODMAN_BUILD_ARGS -f deploy/Containerfile -t "$IMAGE" .
fi

size=$($PODMAN image inspect --format '{{.Size}}' "$IMAGE")
echo "image $IMAGE: $size bytes ($((size / 1000000)) MB)"
user=$($PODMAN image inspect --format '{{.Config.User}}' "$IMAGE")
[ "$user" = 10001:10001 ] || fail "image USER is '$user', not 10001:10001"
ok "image USER $user"

for p in "$GRPC_PORT" "$HTTP_PORT" "$METRICS_PORT"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
    fail "port $p is in use on this host"
  fi
done

dir=$(mktemp -d)
cleanup() {
  $PODMAN rm -f "$NAME" >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap cleanup EXIT

key="smoke-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
hash=$($PODMAN run --rm --network=none --entrypoint /usr/local/bin/weft "$IMAGE" hash-key "$key")
cat > "$dir/tenants.toml" <<EOF
[[tenant]]
name = "smoke"
api_key_sha256 = "$hash"
EOF
chmod 644 "$dir/tenants.toml"

# The image's own CMD at the default ports; other ports replace it.
args=()
if [ "$GRPC_PORT:$HTTP_PORT:$METRICS_PORT" != 50051:8000:9464 ]; then
  args=(--listen="0.0.0.0:$GRPC_PORT" --http-listen="0.0.0.0:$HTTP_PORT"
    --metrics-listen="0.0.0.0:$METRICS_PORT" --tenants=/etc/weft/tenants.toml)
fi
$PODMAN run -d --name "$NAME" --network=host \
  -v "$dir/tenants.toml:/etc/weft/tenants.toml:ro" "$IMAGE" ${args[@]+"${args[@]}"} >/dev/null
ok "started container $NAME${args[*]+ with ${args[*]}}"

uid=$($PODMAN exec "$NAME" id -u)
[ "$uid" = 10001 ] || fail "the server runs as uid $uid"
ok "the server runs as uid $uid"

# Ready: the OpenAI API lists the model once it has loaded.
models=
t=0
while [ "$t" -lt "$READY_TIMEOUT" ]; do
  [ "$($PODMAN inspect --format '{{.State.Running}}' "$NAME")" = true ] \
    || { $PODMAN logs "$NAME" >&2; fail "the container exited"; }
  if models=$(curl -sf -H "authorization: Bearer $key" "http://127.0.0.1:$HTTP_PORT/v1/models"); then
    break
  fi
  sleep 2
  t=$((t + 2))
done
[ -n "$models" ] || { $PODMAN logs "$NAME" >&2; fail "not ready after ${READY_TIMEOUT}s"; }
model=$(printf '%s' "$models" | sed -n 's/.*"id":"\([^"]*\)".*/\1/p')
[ -n "$model" ] || fail "GET /v1/models: $models"
ok "GET /v1/models after ${t}s: $model"

if [ "${SKIP_GRPC_HEALTH:-0}" = 1 ]; then
  echo "skipped: gRPC health (SKIP_GRPC_HEALTH=1)"
else
  health=$("$PYTHON" - "127.0.0.1:$GRPC_PORT" <<'EOF'
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
ch = grpc.insecure_channel(sys.argv[1])
r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
print(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
EOF
  ) || fail "gRPC health check (needs grpcio-health-checking in $PYTHON)"
  [ "$health" = SERVING ] || fail "gRPC health: $health"
  ok "gRPC health: $health"
fi

out=$($PODMAN exec "$NAME" weft bench --target "grpc://127.0.0.1:$GRPC_PORT" \
  --tenant "smoke:$key" -n 2 --prompt-tokens 16 --max-tokens 8 2>&1) \
  || { echo "$out" >&2; fail "gRPC generation (weft bench)"; }
echo "$out" | tail -n 20
ok "gRPC generation (weft bench, 2 requests)"

code=$(curl -s -o "$dir/completion.json" -w '%{http_code}' \
  -H "authorization: Bearer $key" -H 'content-type: application/json' \
  -d "{\"model\":\"$model\",\"prompt\":\"The capital of France is\",\"max_tokens\":8}" \
  "http://127.0.0.1:$HTTP_PORT/v1/completions")
[ "$code" = 200 ] && grep -q '"text"' "$dir/completion.json" \
  || fail "POST /v1/completions: $code $(cat "$dir/completion.json")"
ok "POST /v1/completions with the key: $code $(cat "$dir/completion.json")"

code=$(curl -s -o "$dir/noauth.json" -w '%{http_code}' -H 'content-type: application/json' \
  -d "{\"model\":\"$model\",\"prompt\":\"hi\",\"max_tokens\":4}" \
  "http://127.0.0.1:$HTTP_PORT/v1/completions")
[ "$code" = 401 ] || fail "POST /v1/completions without a key: $code $(cat "$dir/noauth.json")"
ok "POST /v1/completions without a key: $code"

curl -sf "http://127.0.0.1:$METRICS_PORT/metrics" > "$dir/metrics" || fail "GET /metrics"
n=$(grep -c '^weft_' "$dir/metrics" || true)
[ "$n" -gt 0 ] || fail "no weft_ series in /metrics"
ok "GET /metrics: $n weft_ samples, e.g. $(grep '^weft_requests' "$dir/metrics" | head -n 1)"

echo "--- the server's log (last lines)"
$PODMAN logs "$NAME" 2>&1 | tail -n 8
echo "all checks passed"
