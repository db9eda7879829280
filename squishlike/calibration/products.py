"""Calibration's matrix products in MLX, on the default device: the GPU where there is one, else the CPU (with
the BLAS the CLI preloads, see `openblas`), never NumPy's.

NumPy's bundled OpenBLAS spins its threads on a busy two-core machine (docs/design.md §6.2): an AWQ trial's product
([128, 576] by [576, 1536]) took 43 ms there and 8-22 ms in mlx, and the search makes thousands of them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b (float32), as a new NumPy array."""
    return np.array(mx.array(a) @ mx.array(b))


def output_error(x: mx.array, d: mx.array | np.ndarray) -> float:
    """||x d^T||^2: the squared change of a linear's outputs on inputs `x` ([n, cols]) when its weight changes by `d`
    ([rows, cols])."""
    y = x @ mx.array(d).T
    return mx.sum(y * y).item()
