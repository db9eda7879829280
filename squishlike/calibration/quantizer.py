"""Fake quantization: a weight as the store will hold it, back in float32, and its size there."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import quant
from ..quant.reference import from_float32, storage_dtype, to_float32


@dataclass(frozen=True)
class Quantizer:
    scheme: str  # int8 | int4 | int3 | passthrough (exact: the weight in the runtime dtype)
    group_size: int
    scale_dtype: str  # runtime dtype: INT4/INT3 scales and offsets, and passthrough weights, are stored in it
    clip_search: bool = False

    def __call__(self, w: np.ndarray) -> np.ndarray:
        """float32 [r, c] -> the dequantized stored form, float32 (values as the runtime dtype holds them)."""
        w = np.ascontiguousarray(w, dtype=np.float32)
        if self.scheme == "passthrough":
            return to_float32(from_float32(w, self.scale_dtype), self.scale_dtype)
        if self.scheme == "int8":
            q, s = quant.quantize_int8(w)
            out = quant.dequantize_int8(q, s, out_dtype=self.scale_dtype)
            return to_float32(out, self.scale_dtype)
        qf, df = (
            (quant.quantize_int4, quant.dequantize_int4)
            if self.scheme == "int4"
            else (quant.quantize_int3, quant.dequantize_int3)
        )
        q, s, z = qf(w, group_size=self.group_size, scale_dtype=self.scale_dtype, clip_search=self.clip_search)
        return df(q, s, z, group_size=self.group_size, scale_dtype=self.scale_dtype, out_dtype="float32")

    def nbytes(self, rows: int, cols: int) -> int:
        if self.scheme == "passthrough":
            return rows * cols * np.dtype(storage_dtype(self.scale_dtype)).itemsize
        if self.scheme == "int8":
            return rows * cols + 4 * rows
        per = 2 if self.scale_dtype != "float32" else 4
        bits = 4 if self.scheme == "int4" else 3
        return rows * cols * bits // 8 + 2 * per * rows * (cols // self.group_size)
