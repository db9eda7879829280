#!/usr/bin/env bash
# The whole test suite: set-up (idempotent), the Rust crate's own tests, then pytest, then the whole architecture
# sweep (pytest -m archsweep).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
cargo test --quiet --manifest-path rust_quant/Cargo.toml
blas=$(.venv/bin/python -c "from squishlike.openblas import find_openblas; print(find_openblas() or '')")
export LD_PRELOAD="${blas}${LD_PRELOAD:+:$LD_PRELOAD}"
.venv/bin/python -m pytest -q "$@"
# The rest of the architecture sweep (the default run above covers part of it).
.venv/bin/python -m pytest -q -m archsweep tests/integration/test_arch_sweep.py
