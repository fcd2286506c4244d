#!/usr/bin/env bash
# The whole test suite: formatting, lints, then every crate's tests (unit,
# property, parity against mlx-lm, end-to-end against a real server).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
