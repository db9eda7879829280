"""The quantization schemes in plain NumPy. This file is the spec (docs/format.md §4): the Rust kernels behind
`squishlike.quant` must produce the same bits for every input.

Conventions shared by every function here and in `squishlike.quant`:

- Dtypes are named by string: "float32", "float16", "bfloat16". NumPy has no bfloat16, so a bfloat16 array is
  carried as its raw uint16 bit patterns (inputs say so with ``src_dtype="bfloat16"``; outputs come back as uint16).
- An N-D weight is treated as 2-D: rows = product of the leading dims, cols = the last dim. Rows may be 0.
- All arithmetic is float32 with round-half-to-even (``np.rint``). Converting float32 to float16/bfloat16 rounds to
  nearest even; float16 and bfloat16 overflow to inf.
- Affine dequantization (INT2..INT6, group-wise INT8) is what ``mx.dequantize`` computes on mlx[cpu] 0.32.4, found
  by experiment for every scale and output dtype: ``out = cast_out(T(T(q * scale) + bias))`` where ``T`` rounds to
  the *scale* dtype after the multiply and again after the add (for float32 scales that is plain float32
  arithmetic, no fused multiply-add), and only then is the result cast to the output dtype.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import numpy as np

from squishlike.dtypes import NP_STORAGE
from squishlike.errors import QuantizationError

DTYPES = ("float32", "float16", "bfloat16")
INT4_GROUP_SIZES = (32, 64, 128)
INT3_GROUP_SIZES = (32, 64, 128)  # mx.quantize(bits=3) accepts all three, as it does for 2, 5 and 6 bits
INT8G_GROUP_SIZES = (32, 64, 128)
INT4_LEVELS = 15
INT3_LEVELS = 7
INT8G_LEVELS = 255
BITSTREAM_BITS = (2, 3, 5, 6)  # the widths packed as mx.quantize's bitstream into uint32 words ("int2" ...)
_MLX_EPS = np.float32(1e-7)  # mx.quantize's smallest group width

# Clip search: shrink each end of a group's [min, max] toward the other by k % of the range, k = 0..10, so the
# width is scaled by 1.00, 0.98, ..., 0.80. The shrink amounts are float32 values of k/100 (Rust computes
# `(k as f64 / 100.0) as f32`, the same correctly rounded number).
CLIP_SHRINK = tuple(np.float32(k / 100) for k in range(11))

# ---------------------------------------------------------------------------------------------------------------
# dtypes


def storage_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype that carries values of `dtype` (uint16 raw bits for bfloat16)."""
    try:
        return NP_STORAGE[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}") from None


def src_dtype_of(w: np.ndarray, src_dtype: str | None) -> str:
    """The dtype name of `w`: `src_dtype` when given (and consistent with w's storage), else inferred."""
    if src_dtype is None:
        if w.dtype == np.float32:
            return "float32"
        if w.dtype == np.float16:
            return "float16"
        if w.dtype == np.uint16:
            raise TypeError("w is uint16: pass src_dtype='bfloat16' if it holds bfloat16 bit patterns")
        raise TypeError(f"w has dtype {w.dtype}; expected float32, float16 or bfloat16 (uint16 bits)")
    if w.dtype != storage_dtype(src_dtype):
        raise TypeError(f"w has dtype {w.dtype} but src_dtype={src_dtype!r} needs {storage_dtype(src_dtype)}")
    return src_dtype


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even; NaN stays NaN (quiet bit set)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    with np.errstate(over="ignore"):  # NaN bit patterns may wrap here; they are replaced below
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    return np.where(np.isnan(x), (bits >> 16) | np.uint32(0x40), rounded).astype(np.uint16)


def to_float32(a: np.ndarray, dtype: str) -> np.ndarray:
    """Decode stored values of `dtype` to float32 (exact)."""
    if dtype == "bfloat16":
        return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(a, dtype=storage_dtype(dtype)).astype(np.float32)


def first_non_finite(values: np.ndarray, dtype: str) -> int | None:
    """The flat index of the first NaN or infinite value of `values`, stored values of `dtype` (bfloat16 as its
    uint16 bits); None when every value is finite."""
    bad = np.flatnonzero(~np.isfinite(to_float32(values, dtype)))
    return int(bad[0]) if bad.size else None


def from_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    """Encode float32 values as `dtype` storage, rounding to nearest even."""
    if dtype == "bfloat16":
        return _bf16_bits(x)
    with np.errstate(over="ignore"):  # float16 overflow is inf, as in MLX
        return np.asarray(x, dtype=np.float32).astype(storage_dtype(dtype))


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to the nearest `dtype` value, still as float32."""
    return x if dtype == "float32" else to_float32(from_float32(x, dtype), dtype)


# ---------------------------------------------------------------------------------------------------------------
# shapes and checks


def rows_cols(shape: tuple[int, ...], name: str) -> tuple[int, int]:
    """The 2-D view (rows, cols) of an N-D shape."""
    if len(shape) == 0:
        raise QuantizationError(f"{name} is a scalar; expected an array of at least one dimension")
    return math.prod(shape[:-1]), shape[-1]


def _as_2d(a: np.ndarray, name: str) -> np.ndarray:
    return a.reshape(rows_cols(a.shape, name))


def check_group_size(cols: int, group_size: int, allowed: tuple[int, ...], scheme: str) -> None:
    if group_size not in allowed:
        raise QuantizationError(f"{scheme}: group_size {group_size} not supported; use one of {allowed}")
    if cols % group_size:
        raise QuantizationError(f"{scheme}: {cols} columns are not divisible by group_size {group_size}")


def _check_finite(w: np.ndarray) -> None:
    if not np.isfinite(w).all():
        raise QuantizationError("w contains NaN or inf; refusing to quantize it")


def _write(result: np.ndarray, out: np.ndarray | None, dtype: str) -> np.ndarray:
    """Return `result`, or copy it into the caller's `out` (any shape with the same 2-D view) and return that."""
    if out is None:
        return result
    if out.dtype != storage_dtype(dtype):
        raise TypeError(f"out has dtype {out.dtype}; out_dtype={dtype!r} needs {storage_dtype(dtype)}")
    if rows_cols(out.shape, "out") != result.shape:
        raise QuantizationError(f"out has shape {out.shape}; expected {result.shape}")
    if not out.flags.writeable:
        raise QuantizationError("out is not writeable")
    out.reshape(result.shape)[...] = result
    return out


# ---------------------------------------------------------------------------------------------------------------
# INT8, per-row symmetric


def quantize_int8(w: np.ndarray, *, src_dtype: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-row symmetric INT8: scale = max|w| / 127, q = clip(rint(w / scale), -127, 127); scale 0 gives q 0."""
    w = _as_2d(to_float32(w, src_dtype_of(w, src_dtype)), "w")
    _check_finite(w)
    amax = np.abs(w).max(axis=1, initial=np.float32(0))
    scales = (amax / np.float32(127)).astype(np.float32)
    s = scales[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint(w / s), -127, 127)
    return np.where(s == 0, 0, q).astype(np.int8), scales


def dequantize_int8(
    q: np.ndarray, scales: np.ndarray, *, out_dtype: str = "bfloat16", out: np.ndarray | None = None
) -> np.ndarray:
    """q * scale in float32, then rounded to out_dtype."""
    q = _as_2d(np.asarray(q), "q")
    if q.dtype != np.int8:
        raise TypeError(f"q has dtype {q.dtype}; expected int8")
    if scales.dtype != np.float32:
        raise TypeError(f"scales has dtype {scales.dtype}; expected float32")
    if scales.size != q.shape[0]:
        raise QuantizationError(f"scales has {scales.size} values for {q.shape[0]} rows")
    with np.errstate(over="ignore"):  # inf, as in float32 arithmetic anywhere
        result = q.astype(np.float32) * scales.reshape(-1, 1)
    return _write(from_float32(result, out_dtype), out, out_dtype)


# ---------------------------------------------------------------------------------------------------------------
# Affine group quantization (INT2..INT6, group-wise INT8)


# A group's grid is ((scale, bias) the codes are picked with, (scale, bias) stored): float32 arrays, the stored pair
# rounded to scale_dtype. The runtime dequantizes with the stored pair.
Grid = tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def _min_max_grid(lo: np.ndarray, hi: np.ndarray, levels: int, scale_dtype: str) -> Grid:
    """INT2..INT6: scale (hi - lo) / levels and bias lo, rounded to scale_dtype, and codes picked with them."""
    with np.errstate(over="ignore"):
        s = round_to(((hi - lo) / np.float32(levels)).astype(np.float32), scale_dtype)
        z = round_to(lo, scale_dtype)
    return (s, z), (s, z)


def _mlx_grid(lo: np.ndarray, hi: np.ndarray, levels: int, scale_dtype: str) -> Grid:
    """Group-wise INT8: the grid mx.quantize chooses on mlx[cpu] 0.32.4, all in float32.

    The end of [lo, hi] farther from zero (`edge`) falls exactly on a code: the scale, at least 1e-7 wide, points
    from it into the group (negative when edge is hi), and the bias is edge (0 where edge rounds to code 0). Codes
    are picked with this unrounded scale and bias, as MLX does; both are then rounded to scale_dtype. A scale of 0
    (edge / inf) picks code 0, whose value is then the bias.
    """
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        width = np.maximum(((hi - lo) / np.float32(levels)).astype(np.float32), _MLX_EPS)
        far_low = np.abs(lo) > np.abs(hi)
        s, edge = np.where(far_low, width, -width), np.where(far_low, lo, hi)
        q0 = np.rint(edge / s)
        on_code = q0 != 0
        s = np.where(on_code, edge / q0, s).astype(np.float32)
        z = np.where(on_code, edge, np.float32(0)).astype(np.float32)
        return (s, z), (round_to(s, scale_dtype), round_to(z, scale_dtype))


_AFFINE = {
    "int4": (INT4_LEVELS, INT4_GROUP_SIZES, _min_max_grid),
    **{f"int{b}": (2**b - 1, INT3_GROUP_SIZES, _min_max_grid) for b in BITSTREAM_BITS},
    "int8g": (INT8G_LEVELS, INT8G_GROUP_SIZES, _mlx_grid),
}


def _affine_q(w: np.ndarray, s: np.ndarray, z: np.ndarray, levels: int) -> np.ndarray:
    """q = clip(rint((w - z) / s), 0, levels), with q = 0 where s == 0; float32 in, float32 out."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = np.clip(np.rint((w - z) / s), 0, levels)
    return np.where(s == 0, np.float32(0), q).astype(np.float32)


def _affine_value(q: np.ndarray, s: np.ndarray, z: np.ndarray, scale_dtype: str) -> np.ndarray:
    """What mx.dequantize computes for one element, in the scale dtype (see the module docstring)."""
    with np.errstate(over="ignore"):
        return round_to(round_to(q * s, scale_dtype) + z, scale_dtype)


def _grid_error(g: np.ndarray, grid: Grid, levels: int, scale_dtype: str) -> np.ndarray:
    """Squared error of groups g quantized on `grid` and dequantized as the runtime does."""
    (ps, pz), (s, z) = grid
    return _sq_error(_affine_value(_affine_q(g, ps, pz, levels), s, z, scale_dtype), g)


def _sq_error(v: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Sum over the last axis of (v - w)^2 in float64, added in the Rust kernel's fixed order.

    Eight running sums, lane j taking elements j, j+8, j+16, ... in turn, then the eight added in lane order (an
    order that vectorises in Rust; np.sum's pairwise order would not be reproducible there). Group sizes are
    multiples of 32, so every group splits into rows of eight.
    """
    d = v.astype(np.float64) - w.astype(np.float64)
    d2 = (d * d).reshape(*w.shape[:-1], w.shape[-1] // 8, 8)
    lanes = np.zeros((*w.shape[:-1], 8), np.float64)
    for i in range(d2.shape[-2]):
        lanes += d2[..., i, :]
    err = np.zeros(w.shape[:-1], np.float64)
    for j in range(8):
        err += lanes[..., j]
    return err


def _affine_quantize(
    w: np.ndarray, src_dtype: str | None, group_size: int, scale_dtype: str, clip_search: bool, scheme: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group-wise affine quantization: (q uint8 [r, c], scales [r, c//g], biases [r, c//g]) in scale_dtype storage."""
    levels, group_sizes, grid_of = _AFFINE[scheme]
    w = _as_2d(to_float32(w, src_dtype_of(w, src_dtype)), "w")
    storage_dtype(scale_dtype)  # an unknown name fails here, before any work
    rows, cols = w.shape
    check_group_size(cols, group_size, group_sizes, scheme)
    _check_finite(w)
    g = w.reshape(rows, cols // group_size, group_size)
    # min/max may return either zero when a group holds both -0.0 and +0.0; adding +0.0 makes it +0.0
    lo = g.min(axis=-1, keepdims=True, initial=np.float32(np.inf)) + np.float32(0)
    hi = g.max(axis=-1, keepdims=True, initial=np.float32(-np.inf)) + np.float32(0)
    grid = grid_of(lo, hi, levels, scale_dtype)
    if not all(np.isfinite(a).all() for a in grid[1]):
        raise QuantizationError(f"{scheme}: a group's scale or bias overflows {scale_dtype}; use a wider scale_dtype")
    if clip_search:
        best = _grid_error(g, grid, levels, scale_dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            span = hi - lo
            for t in CLIP_SHRINK[1:]:
                grid_t = grid_of(lo + t * span, hi - t * span, levels, scale_dtype)
                err = _grid_error(g, grid_t, levels, scale_dtype)
                better = (err < best)[..., None]  # strict: ties keep the wider range
                best = np.where(better[..., 0], err, best)
                grid = tuple(tuple(np.where(better, new, old) for new, old in zip(pair_t, pair))
                             for pair_t, pair in zip(grid_t, grid))
    (ps, pz), (s, z) = grid
    q = _affine_q(g, ps, pz, levels).astype(np.uint8).reshape(rows, cols)
    return q, from_float32(s[..., 0], scale_dtype), from_float32(z[..., 0], scale_dtype)


def _affine_dequantize(
    q: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    group_size: int,
    scale_dtype: str,
    out_dtype: str,
    out: np.ndarray | None,
    scheme: str,
) -> np.ndarray:
    rows, cols = q.shape
    check_group_size(cols, group_size, _AFFINE[scheme][1], scheme)
    ngroups = cols // group_size
    need = storage_dtype(scale_dtype)
    for name, a in (("scales", scales), ("biases", biases)):
        if a.dtype != need:
            raise TypeError(f"{name} has dtype {a.dtype}; scale_dtype={scale_dtype!r} needs {need}")
        if rows_cols(a.shape, name) != (rows, ngroups):
            raise QuantizationError(f"{name} has shape {a.shape}; expected {(rows, ngroups)}")
    s = to_float32(_as_2d(scales, "scales"), scale_dtype)[..., None]
    z = to_float32(_as_2d(biases, "biases"), scale_dtype)[..., None]
    v = _affine_value(q.reshape(rows, ngroups, group_size).astype(np.float32), s, z, scale_dtype)
    return _write(from_float32(v.reshape(rows, cols), out_dtype), out, out_dtype)


# ---------------------------------------------------------------------------------------------------------------
# INT4


def pack_int4(q: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 [r, c] -> uint8 [r, c//2]; the low nibble holds the even column."""
    q = _as_2d(np.asarray(q), "q")
    if q.dtype != np.uint8:
        raise TypeError(f"q has dtype {q.dtype}; expected uint8")
    if q.shape[1] % 2:
        raise QuantizationError(f"int4: q has {q.shape[1]} columns; packing needs an even number")
    if q.size and q.max() > INT4_LEVELS:
        raise QuantizationError(f"int4: q holds {q.max()}; values must be 0..15")
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """uint8 [r, c//2] -> uint8 values 0..15 [r, c]."""
    packed = _as_2d(np.asarray(packed), "packed")
    if packed.dtype != np.uint8:
        raise TypeError(f"packed has dtype {packed.dtype}; expected uint8")
    q = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    q[:, 0::2] = packed & 15
    q[:, 1::2] = packed >> 4
    return q


def int4_to_mlx(packed: np.ndarray) -> np.ndarray:
    """uint8 [r, c//2] -> uint32 [r, c//8], MLX's 4-bit layout (element k at bits 4k..4k+3, LSB first).

    That layout is the nibble-packed bytes read as little-endian words, so this is a zero-copy view.
    """
    if packed.dtype != np.uint8:
        raise TypeError(f"packed has dtype {packed.dtype}; expected uint8")
    if packed.ndim == 0 or packed.shape[-1] % 4:
        raise QuantizationError(f"packed has shape {packed.shape}; the last dim must be a multiple of 4 bytes")
    if not packed.flags.c_contiguous:
        raise QuantizationError("packed is not C-contiguous; int4_to_mlx returns a view and needs contiguous rows")
    return _as_2d(packed, "packed").view("<u4")


def mlx_to_int4(words: np.ndarray) -> np.ndarray:
    """uint32 [r, c//8] in MLX's 4-bit layout -> uint8 [r, c//2] nibble-packed (a zero-copy view)."""
    if words.dtype != np.uint32:
        raise TypeError(f"words has dtype {words.dtype}; expected uint32")
    if words.ndim == 0 or not words.flags.c_contiguous:
        raise QuantizationError("words must be a C-contiguous array of at least one dimension")
    return _as_2d(words, "words").astype("<u4", copy=False).view(np.uint8)


# ---------------------------------------------------------------------------------------------------------------
# INT2, INT3, INT5, INT6: the bitstream
#
# mx.quantize(bits=B) for B = 2, 3, 5, 6 writes each row as one little-endian bitstream: element k occupies bits
# B*k..B*k+B-1, so 8 elements fill B bytes and 32 elements fill B uint32 words; the bytes are those words in
# little-endian order. For 3, 5 and 6 bits a word boundary cuts through some elements (3 bits: 10 and 21 of every
# 32). (Found by quantizing known values with mx.quantize and reading the words back; tests/unit/test_quant_mlx.py
# checks it against MLX.)


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 values 0..2**bits-1 [r, c] -> uint32 [r, c*bits//32] in mx.quantize(bits=bits)'s bitstream layout."""
    q = _as_2d(np.asarray(q), "q")
    if q.dtype != np.uint8:
        raise TypeError(f"q has dtype {q.dtype}; expected uint8")
    rows, cols = q.shape
    if cols % 32:
        raise QuantizationError(f"int{bits}: q has {cols} columns; packing needs a multiple of 32")
    if q.size and q.max() >= 2**bits:
        raise QuantizationError(f"int{bits}: q holds {q.max()}; values must be 0..{2**bits - 1}")
    eights = q.reshape(rows, cols // 8, 8).astype(np.uint64)
    acc = (eights << (bits * np.arange(8, dtype=np.uint64))).sum(axis=-1, dtype=np.uint64)  # 8*bits bits / 8 values
    stream = np.stack([(acc >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(bits)], axis=-1).astype(np.uint8)
    return np.ascontiguousarray(stream.reshape(rows, cols * bits // 8)).view("<u4").astype(np.uint32)


def unpack_bits(packed: np.ndarray, cols: int, bits: int) -> np.ndarray:
    """uint32 [r, cols*bits//32] in mx.quantize(bits=bits)'s layout -> uint8 values [r, cols]."""
    packed = _as_2d(np.asarray(packed), "packed")
    if packed.dtype != np.uint32:
        raise TypeError(f"packed has dtype {packed.dtype}; expected uint32")
    rows, words = packed.shape
    if cols % 32 or words * 32 != cols * bits:
        raise QuantizationError(f"int{bits}: packed has shape {packed.shape}, which does not hold {cols} columns")
    stream = np.ascontiguousarray(packed.astype("<u4")).view(np.uint8).reshape(rows, cols // 8, bits)
    acc = (stream.astype(np.uint64) << (8 * np.arange(bits, dtype=np.uint64))).sum(axis=-1, dtype=np.uint64)
    q = (acc[..., None] >> (bits * np.arange(8, dtype=np.uint64))) & np.uint64(2**bits - 1)
    return q.reshape(rows, cols).astype(np.uint8)


pack_int3 = functools.partial(pack_bits, bits=3)  # (q) -> packed, as squishlike.quant.pack_int3
unpack_int3 = functools.partial(unpack_bits, bits=3)  # (packed, cols) -> q


# ---------------------------------------------------------------------------------------------------------------
# INT8, group-wise asymmetric
#
# MLX's 8-bit affine form: one code per byte, so the codes are their own packing, and read as little-endian uint32
# words (element k at bits 8k..8k+7) they are the words mx.quantize(bits=8) writes.


def _int8g_codes(packed: np.ndarray) -> np.ndarray:
    """Group-wise INT8's packed codes are its codes: one uint8 each."""
    packed = _as_2d(np.asarray(packed), "packed")
    if packed.dtype != np.uint8:
        raise TypeError(f"packed has dtype {packed.dtype}; expected uint8")
    return packed


# ---------------------------------------------------------------------------------------------------------------
# Per scheme: the affine rules above, then the scheme's packing


def grouped_functions(
    scheme: str, quantize_affine: Callable[..., tuple], dequantize_affine: Callable[..., np.ndarray]
) -> tuple[Callable[..., tuple], Callable[..., np.ndarray]]:
    """`quantize_<scheme>` and `dequantize_<scheme>` of a grouped scheme, with the keyword signatures every grouped
    scheme has in both kernel modules (the Rust wrappers and the NumPy spec), over the module's generic
    `quantize_affine(scheme, w, src_dtype, group_size, scale_dtype, clip_search)` and
    `dequantize_affine(scheme, packed, scales, biases, group_size, scale_dtype, out_dtype, out)`."""
    bits = _AFFINE[scheme][0].bit_length()  # 15 -> 4, 7 -> 3, 255 -> 8, ...

    def quantize(
        w: np.ndarray, *, src_dtype: str | None = None, group_size: int = 64, scale_dtype: str = "bfloat16",
        clip_search: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return quantize_affine(scheme, w, src_dtype, group_size, scale_dtype, clip_search)

    def dequantize(
        packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, *, group_size: int,
        scale_dtype: str = "bfloat16", out_dtype: str = "bfloat16", out: np.ndarray | None = None,
    ) -> np.ndarray:
        return dequantize_affine(scheme, packed, scales, biases, group_size, scale_dtype, out_dtype, out)

    quantize.__name__ = quantize.__qualname__ = f"quantize_{scheme}"
    quantize.__doc__ = (f"Affine {bits}-bit per group of `group_size` columns -> (packed codes [r, packed cols], "
                        f"scales [r, c//g], biases [r, c//g]) in scale_dtype; without clip search, the values of "
                        f"mx.quantize(w, bits={bits}, group_size=group_size) bit for bit.")
    dequantize.__name__ = dequantize.__qualname__ = f"dequantize_{scheme}"
    dequantize.__doc__ = (f"Bit-identical to mx.dequantize(mlx_words({scheme!r}, packed), scales, biases, "
                          f"bits={bits}) in out_dtype; into `out` when given.")
    return quantize, dequantize


_PACKING = {  # scheme -> (codes [r, c] -> packed, packed -> codes)
    "int4": (pack_int4, unpack_int4),
    **{f"int{b}": (functools.partial(pack_bits, bits=b), lambda p, b=b: unpack_bits(p, p.shape[-1] * 32 // b, b))
       for b in BITSTREAM_BITS},
    "int8g": (_int8g_codes, _int8g_codes),
}


def _quantize_packed(scheme, w, src_dtype, group_size, scale_dtype, clip_search):
    q, s, z = _affine_quantize(w, src_dtype, group_size, scale_dtype, clip_search, scheme)
    return _PACKING[scheme][0](q), s, z


def _dequantize_packed(scheme, packed, scales, biases, group_size, scale_dtype, out_dtype, out):
    q = _PACKING[scheme][1](packed)
    return _affine_dequantize(q, scales, biases, group_size, scale_dtype, out_dtype, out, scheme)


quantize_int8g, dequantize_int8g = grouped_functions("int8g", _quantize_packed, _dequantize_packed)
quantize_int4, dequantize_int4 = grouped_functions("int4", _quantize_packed, _dequantize_packed)
quantize_int3, dequantize_int3 = grouped_functions("int3", _quantize_packed, _dequantize_packed)
quantize_int2, dequantize_int2 = grouped_functions("int2", _quantize_packed, _dequantize_packed)
quantize_int5, dequantize_int5 = grouped_functions("int5", _quantize_packed, _dequantize_packed)
quantize_int6, dequantize_int6 = grouped_functions("int6", _quantize_packed, _dequantize_packed)
