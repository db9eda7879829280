"""Writing .npy files (never pickled) through a StreamWriter, the bytes np.save writes without its copy; and the
strict check of a .npy header against what the file must hold."""

from __future__ import annotations

import functools
import io
import math
import os
import threading
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..errors import FormatError
from .atomic import atomic_file, stream_file
from .files import open_written


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
    array = np.asarray(array, order="C")  # keeps a 0-d array 0-d, as ascontiguousarray does not
    with (atomic_file(final) if atomic else stream_file(final)) as w:
        w.write(npy_header(array.dtype, array.shape))
        w.write(array.reshape(-1).view(np.uint8) if array.size else b"")
    return w.record()


_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
# NumPy parses a .npy header with ast.literal_eval, and CPython 3.11 (before 3.11.8) keeps the AST constructor's
# recursion depth in interpreter-wide state: two threads parsing at once fail at random with "SystemError: AST
# constructor recursion depth mismatch" (python/cpython#106905). Parts are opened from thread pools, so header
# parsing takes turns; it is microseconds, the reads stay parallel.
HEADER_LOCK = threading.Lock()


def read_npy_header(f: BinaryIO, path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """Check the .npy header at the start of the open file `f` against what its role demands: exactly `dtype`
    (byte order included), `shape`, C order, never an object dtype, and a file exactly as long as that data.
    Returns the offset of the data. FormatError naming `path` otherwise."""
    try:
        version = np.lib.format.read_magic(f)
        if version not in _HEADER_READERS:
            raise ValueError(f"npy format version {version} not supported")
        with HEADER_LOCK:
            got_shape, fortran, got_dtype = _HEADER_READERS[version](f)
    except Exception as e:  # noqa: BLE001 - numpy's header parser also raises tokenize.TokenError, ...
        raise FormatError(path, f"unreadable .npy header ({type(e).__name__}: {e})") from None
    if got_dtype.hasobject:
        raise FormatError(path, f"holds Python objects ({got_dtype}); squishlike never unpickles")
    if got_dtype != dtype or tuple(got_shape) != tuple(shape):
        raise FormatError(path, f"holds {got_dtype.str}{list(got_shape)}, its role needs {dtype.str}{list(shape)}")
    if fortran and len(shape) > 1:
        raise FormatError(path, "is stored in Fortran (column-major) order; squishlike writes C order")
    offset = f.tell()
    size = os.fstat(f.fileno()).st_size
    if size != offset + math.prod(shape) * dtype.itemsize:
        raise FormatError(path, f"is {size} bytes; a {dtype.str}{list(shape)} .npy is "
                                f"{offset + math.prod(shape) * dtype.itemsize}")
    return offset


def check_npy(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    """The cheap check of a .npy squishlike wrote (a cache tier's): a regular file, not a link, holding exactly
    the header write_npy_stream writes for `dtype` and `shape` (so C order, that byte order) and that much data.
    One open, one pread, no parsing."""
    dtype = np.dtype(dtype)
    expected = _written_header(dtype.str, tuple(shape))
    with open_written(path) as f:
        head, size = os.pread(f.fileno(), len(expected), 0), os.fstat(f.fileno()).st_size
    if head != expected:
        raise FormatError(path, f"its header is not the one squishlike writes for {dtype.str}{list(shape)} in C "
                                f"order: {head[10:].decode('latin1', 'replace').strip()}")
    if size != len(expected) + math.prod(shape) * dtype.itemsize:
        raise FormatError(path, f"is {size} bytes; a {dtype.str}{list(shape)} .npy is "
                                f"{len(expected) + math.prod(shape) * dtype.itemsize}")


@functools.lru_cache(maxsize=4096)
def _written_header(descr: str, shape: tuple[int, ...]) -> bytes:
    return npy_header(np.dtype(descr), shape)
