"""Calibration's matrix products, on the device that computes each fastest: MLX's default device (the GPU where
there is one; else the CPU, with the BLAS the CLI preloads, see `openblas`), except GPTQ's updates on a CPU.

AWQ's trial products go through MLX: NumPy's bundled OpenBLAS spins its threads on a busy two-core machine
(docs/design.md §6.2): an AWQ trial's product ([128, 576] by [576, 1536]) took 43 ms there and 8-22 ms in mlx, and
the search makes thousands of them. GPTQ's updates of NumPy arrays in place are another matter (below).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def subtract_product(target: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """target -= a @ b, in place (float32 NumPy arrays): GPTQ's error updates, with NumPy's BLAS. Large enough for
    its threads, these took 0.038 s against 0.100 s through MLX for [8192, 256] @ [256, 1280] (MLX's arrays are
    copies both ways), and SmolLM2's shapes 1-14x less too (2-core VM); on a GPU the copies would cross to the
    device and back for each group of columns."""
    target -= a @ b


def output_error(x: mx.array, d: mx.array | np.ndarray) -> float:
    """||x d^T||^2: the squared change of a linear's outputs on inputs `x` ([n, cols]) when its weight changes by `d`
    ([rows, cols])."""
    y = x @ mx.array(d).T
    return mx.sum(y * y).item()
