"""Fake quantization: a weight as the store will hold it, back in float32, and its size there."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import quant
from ..quant.reference import from_float32, to_float32
from ..quant.schemes import SCHEMES


@dataclass(frozen=True)
class Quantizer:
    scheme: str  # a quantized scheme of SCHEMES, or passthrough (exact: the weight in the runtime dtype)
    group_size: int  # of a group-wise scheme
    scale_dtype: str  # runtime dtype: group scales and offsets, and passthrough weights, are stored in it
    clip_search: bool = False

    def __call__(self, w: np.ndarray) -> np.ndarray:
        """float32 [r, c] -> the dequantized stored form, float32 (values as the runtime dtype holds them)."""
        w = np.ascontiguousarray(w, dtype=np.float32)
        if self.scheme == "passthrough":
            return to_float32(from_float32(w, self.scale_dtype), self.scale_dtype)
        parts = quant.quantize(self.scheme, w, group_size=self.group_size, scale_dtype=self.scale_dtype,
                               clip_search=self.clip_search)
        out = quant.dequantize(self.scheme, *parts, group_size=self.group_size, scale_dtype=self.scale_dtype,
                               out_dtype=self.scale_dtype)
        return to_float32(out, self.scale_dtype)

    def nbytes(self, rows: int, cols: int) -> int:
        """The bytes of a [rows, cols] weight at rest: the sum of its parts."""
        kind = SCHEMES[self.scheme]
        specs = [kind.part_spec(p.role, (rows, cols), group_size=self.group_size, scale_dtype=self.scale_dtype,
                                stored_dtype=self.scale_dtype) for p in kind.parts]
        return sum(dtype.itemsize * math.prod(shape) for dtype, shape in specs)
