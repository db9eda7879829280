#!/usr/bin/env bash
# Builds the release wheel for this machine and the sdist into dist/, then installs each wheel into a fresh venv
# under /tmp and smoke-tests it (scripts/smoke_test.py). On Linux the wheel is manylinux2014 (glibc 2.17), linked
# by zig from the PyPI package ziglang and checked with auditwheel; on macOS it is the native arm64 wheel. The wheel
# is abi3, so one wheel serves every CPython >= 3.10. The build tools live in a private venv ($BUILD_VENV); the
# project's .venv is never touched. Needs Python >= 3.10, a Rust toolchain, PyPI and crates.io.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD_VENV=${BUILD_VENV:-/tmp/squishlike-build-venv}
pip_install() { "$1/bin/python" -m pip install --quiet --disable-pip-version-check "${@:2}"; }

[ -x "$BUILD_VENV/bin/python" ] || "$PYTHON" -m venv "$BUILD_VENV"
pip_install "$BUILD_VENV" "maturin>=1.9.4,<2"
export PATH="$BUILD_VENV/bin:$PATH"  # maturin finds zig as `python -m ziglang` on PATH

rm -rf dist
maturin sdist --manifest-path rust_quant/Cargo.toml --out dist
if [ "$(uname -s)" = Linux ]; then
    pip_install "$BUILD_VENV" ziglang auditwheel
    maturin build --release --zig --compatibility manylinux2014 --out dist
    for wheel in dist/*.whl; do auditwheel show "$wheel"; done
else
    maturin build --release --out dist
fi

for wheel in dist/*.whl; do
    echo "== $wheel"
    python -m zipfile -l "$wheel"
    venv=$(mktemp -d /tmp/squishlike-smoke-venv.XXXXXX)
    "$PYTHON" -m venv "$venv"
    pip_install "$venv" "$wheel"
    "$venv/bin/python" scripts/smoke_test.py
    rm -rf "$venv"
done
ls -l dist
