#!/usr/bin/env bash
# The whole test suite: set-up (idempotent), the Rust crate's own tests, then pytest, then the whole architecture
# sweep (pytest -m archsweep).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
cargo test --quiet --manifest-path rust_quant/Cargo.toml
blas=$(.venv/bin/python -c "from squishlike.openblas import find_openblas; print(find_openblas() or '')")
export LD_PRELOAD="${blas}${LD_PRELOAD:+:$LD_PRELOAD}"
# Two test files at a time (pytest-xdist, a process each; a file's tests stay together, in order, with its module
# fixtures): most tests wait on subprocesses, imports and small models, not on both cores. `-n 0` runs them in one.
.venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
# The rest of the architecture sweep (the default run above covers part of it), its cases two at a time.
.venv/bin/python -m pytest -q -n 2 -m archsweep tests/integration/test_arch_sweep.py
