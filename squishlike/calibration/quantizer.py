"""Fake quantization: a weight as the store will hold it, back in float32, and its size there."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import mlx.core as mx

from .. import quant
from ..dtypes import MX_DTYPES
from ..quant.reference import from_float32, to_float32
from ..quant.schemes import SCHEMES


# The grids the Rust kernel builds from a group's [min, max] (format.md §4.2-4.3): every width but 8 bits
MIN_MAX_SCHEMES = ("int2", "int3", "int4", "int5", "int6")
CLIP_SHRINKS = tuple(k / 100 for k in range(11))  # the clip search's narrowing of each end, as the kernel's


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

    def on_device(self, w: mx.array) -> mx.array:
        """`__call__` for an MLX array, for the searches that try many roundings (AWQ's trials): in MLX on a GPU
        (`fake`), with the Rust kernel on a CPU, where it is 4.5x faster than MLX's CPU ops with the clip search
        (0.063 s against 0.287 s on SmolLM2's gate and up, 2-core VM)."""
        if mx.default_device() == mx.gpu and self.scheme in MIN_MAX_SCHEMES:
            return self.fake(w)
        return mx.array(self(np.array(w)))

    def fake(self, w: mx.array) -> mx.array:
        """`__call__` in MLX, on the default device: float32 [r, c] -> the dequantized stored form, float32. The
        MIN_MAX_SCHEMES only, following the Rust kernel's grid step by step (min/max, or the clip search's ranges,
        the scale and bias rounded to the runtime dtype, codes picked with them, dequantized as the runtime
        does)."""
        dtype = MX_DTYPES[self.scale_dtype]

        def stored(x: mx.array) -> mx.array:  # a value as the runtime dtype holds it, in float32
            return x.astype(dtype).astype(mx.float32)

        levels = float(2 ** SCHEMES[self.scheme].bits - 1)
        rows, cols = w.shape
        x = w.reshape(rows, cols // self.group_size, self.group_size)
        lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
        best = best_error = None
        for shrink in CLIP_SHRINKS if self.clip_search else CLIP_SHRINKS[:1]:
            low, high = lo + shrink * (hi - lo), hi - shrink * (hi - lo)
            scale, bias = stored((high - low) / levels), stored(low)
            codes = mx.where(scale == 0, 0.0, mx.clip(mx.round((x - bias) / scale), 0.0, levels))
            y = stored(stored(codes * scale) + bias)
            error = mx.sum(mx.square(y - x), axis=-1, keepdims=True)
            if best is None:
                best, best_error = y, error
            else:  # strict, as the kernel: on a tie the wider range (tried first) stays
                better = error < best_error
                best, best_error = mx.where(better, y, best), mx.where(better, error, best_error)
        return best.reshape(rows, cols)

    def nbytes(self, rows: int, cols: int) -> int:
        """The bytes of a [rows, cols] weight at rest: the sum of its parts."""
        kind = SCHEMES[self.scheme]
        specs = [kind.part_spec(p.role, (rows, cols), group_size=self.group_size, scale_dtype=self.scale_dtype,
                                stored_dtype=self.scale_dtype) for p in kind.parts]
        return sum(dtype.itemsize * math.prod(shape) for dtype, shape in specs)
