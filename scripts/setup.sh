#!/usr/bin/env bash
# Installs Weft's build and test prerequisites on a Debian/Ubuntu machine:
# apt packages (needs root or sudo), the mlx-lm oracle venv at .venv, and the
# rustfmt/clippy components. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
# Build: cmake/clang/libclang-dev: mlx-sys builds mlx-c and runs bindgen;
# protobuf-compiler: tonic-build compiles proto/.
# Run: libopenblas0-pthread: optional fast f32 BLAS for CPU runs and benchmarks.
# Test: prometheus: promtool checks and unit-tests deploy/prometheus's rules,
# and the live-Prometheus test scrapes weft serve.
# (deploy/Containerfile installs the build and run groups; a test checks it.)
build_pkgs="cmake clang libclang-dev protobuf-compiler curl unzip"
run_pkgs="libopenblas0-pthread"
test_pkgs="prometheus"
pkgs="$build_pkgs $run_pkgs $test_pkgs"
missing=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
fi

# The parity oracle: mlx-lm on the same MLX version Weft links (tests find it
# at .venv/bin/python; WEFT_PYTHON overrides).
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check -r tests/oracle/requirements.txt

rustup component add rustfmt clippy >/dev/null 2>&1 || true

