"""Moving arrays between NumPy and MLX without losing bfloat16.

NumPy has no bfloat16, so on the NumPy side a bf16 array is its raw uint16 bit pattern plus a dtype name.
Dtype names are the strings used in manifests and by the Rust kernels: "float32", "float16", "bfloat16".
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# name: (the MLX dtype, the NumPy dtype that stores its bits, the MLX dtype of those same bits)
FLOAT_DTYPES = {
    "float32": (mx.float32, np.dtype(np.float32), mx.float32),
    "float16": (mx.float16, np.dtype(np.float16), mx.float16),
    "bfloat16": (mx.bfloat16, np.dtype(np.uint16), mx.uint16),
}
MX_DTYPES = {name: dtype for name, (dtype, _, _) in FLOAT_DTYPES.items()}
NP_STORAGE = {name: storage for name, (_, storage, _) in FLOAT_DTYPES.items()}
MX_STORAGE = {name: storage for name, (_, _, storage) in FLOAT_DTYPES.items()}
STORED_AS = {storage: name for name, storage in NP_STORAGE.items()}  # NumPy storage dtype -> the name it stores


def dtype_name(dtype: mx.Dtype) -> str:
    for name, d in MX_DTYPES.items():
        if d == dtype:
            return name
    raise TypeError(f"not a floating dtype squishlike stores: {dtype}")


def to_numpy(a: mx.array) -> tuple[np.ndarray, str]:
    """(array, dtype name); bfloat16 comes back as its uint16 bit pattern."""
    name = dtype_name(a.dtype)
    if name == "bfloat16":
        a = a.view(mx.uint16)
    return np.asarray(a), name


def to_mx(a: np.ndarray, name: str) -> mx.array:
    """The inverse of to_numpy: a uint16 array named "bfloat16" becomes an mx.bfloat16 array (one copy)."""
    out = mx.array(a)
    return out.view(mx.bfloat16) if name == "bfloat16" else out
