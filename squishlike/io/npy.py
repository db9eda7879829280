"""Writing .npy files (never pickled) through a StreamWriter: the bytes np.save writes, without its copy."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from .atomic import atomic_file, stream_file


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The .npy header np.save writes for a C-ordered array of `dtype` and `shape` (format 1.0)."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": tuple(shape)}
    )
    return buffer.getvalue()


def write_npy_stream(final: Path, array: np.ndarray, atomic: bool = True) -> dict:
    """Write `array` as a .npy; return its file record. `atomic=False`: straight to `final`, for a file inside a
    temp directory published by publish_dir."""
    array = np.ascontiguousarray(array)
    with (atomic_file(final) if atomic else stream_file(final)) as w:
        w.write(npy_header(array.dtype, array.shape))
        w.write(array.reshape(-1).view(np.uint8) if array.size else b"")
    return w.record()
