#!/usr/bin/env bash
# The whole test suite: set-up (idempotent), the Rust crate's own tests, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
cargo test --quiet --manifest-path rust_quant/Cargo.toml
.venv/bin/python -m pytest -q "$@"
