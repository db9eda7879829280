"""A system OpenBLAS for float32 forward passes under the `mlx[cpu]` wheel on Linux.

That wheel links a slow reference BLAS. Preloading Debian's OpenBLAS (`apt-get install libopenblas0-pthread`, then
`LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0`) makes float32 matmuls an order of
magnitude faster (~5 -> ~80 tokens/s for a SmolLM2-135M forward pass). `find_openblas()` returns that path when
it exists, and `reexec_with_openblas()` restarts the CLI with it preloaded (a library must be loaded at start), its
idle threads (and NumPy's OpenBLAS's) put to sleep at once instead of spinning (`THREAD_TIMEOUT`).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

import mlx.core as mx

from .environment import switch

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)
# OpenBLAS's idle threads spin for 2^28 cycles (~0.1 s at 2.5 GHz) after each call before they sleep. Two of them
# run in a compress, the preloaded one (MLX's) and NumPy's own, beside the Rust kernels' threads: on two cores the
# spinning threads of one took the cores the next call needed, and GPTQ's products and column loop ran 3-5x slower
# (a second size's GPTQ of 100 tensors: 18.8 s, 3.5 s with 2^10). Both libraries read this variable at start.
THREAD_TIMEOUT = "10"


def find_openblas() -> str | None:
    """Path of a system OpenBLAS library worth LD_PRELOADing under `mlx[cpu]` on Linux, or None."""
    if not sys.platform.startswith("linux"):
        return None
    for candidate in OPENBLAS_CANDIDATES:
        if os.path.exists(candidate):
            return candidate
    return None


def mlx_lapack_is_fast() -> bool:
    """Whether MLX's CPU linear algebra runs on a fast BLAS/LAPACK in this process: Accelerate on macOS, an
    OpenBLAS preloaded on Linux. The Linux wheels (CPU and CUDA alike) link a reference one."""
    return sys.platform == "darwin" or "openblas" in os.environ.get("LD_PRELOAD", "")


def reexec_with_openblas(argv: Sequence[str] | None = None) -> None:
    """Restart this process with OpenBLAS preloaded, when that helps and has not been done yet.

    For the CLI to call first thing (before mlx does any work): on Linux with the CPU backend and a system
    OpenBLAS (see `find_openblas`), re-executes `python -m squishlike ARGS` with LD_PRELOAD set. Does nothing when
    the library is missing, it is already preloaded, or SQUISHLIKE_OPENBLAS=0 (set for the restarted process too). Returns only if it
    did nothing.
    """
    library = find_openblas()
    preload = os.environ.get("LD_PRELOAD", "")
    if library is None or library in preload.split(":") or not switch("SQUISHLIKE_OPENBLAS"):
        return
    if mx.default_device().type != mx.DeviceType.cpu:
        return
    env = dict(os.environ, LD_PRELOAD=":".join(p for p in (library, preload) if p), SQUISHLIKE_OPENBLAS="0")
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)
    args = list(sys.argv[1:] if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "squishlike", *args], env)
