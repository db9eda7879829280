"""Quantize and dequantize INT8 (per row or group-wise) / INT2..INT6 weights with the Rust kernels
(`rust_quant`, the extension module built from rust_quant/).

Same functions and signatures as the NumPy spec in `squishlike.quant.reference`, with the same bits out, at memory
speed. See that module for the conventions: dtype names, bfloat16 as raw uint16, N-D weights seen as 2-D.

The kernels take NumPy arrays as they are, read-only and memory-mapped ones included, without copying; an input
that is not C-contiguous is refused (QuantizationError) rather than silently copied. Dequantizers write into
`out=` when given (any array whose 2-D view is [rows, cols], of the out_dtype's storage dtype, writeable) and
allocate otherwise. Wrong dtypes raise TypeError; every other bad input raises
`squishlike.errors.QuantizationError` (a ValueError).
"""

from __future__ import annotations

import numpy as np
import rust_quant as _rq

from squishlike.quant.reference import (
    BITSTREAM_BITS,
    grouped_functions,
    int4_to_mlx,
    mlx_to_int4,
    rows_cols,
    src_dtype_of,
    storage_dtype,
)
from squishlike.quant.schemes import SCHEMES

__all__ = [
    "quantize",
    "dequantize",
    "mlx_words",
    "from_mlx_words",
    "quantize_int8",
    "dequantize_int8",
    "quantize_int8g",
    "dequantize_int8g",
    "quantize_int4",
    "dequantize_int4",
    "pack_int4",
    "unpack_int4",
    "pack_bits",
    "unpack_bits",
    "int4_to_mlx",
    "mlx_to_int4",
    "quantize_int3",
    "dequantize_int3",
    "pack_int3",
    "unpack_int3",
    "quantize_int2",
    "dequantize_int2",
    "quantize_int5",
    "dequantize_int5",
    "quantize_int6",
    "dequantize_int6",
    "gptq_group",
    "first_non_finite",
    "gather_qmv_int4",
]


def _out(out: np.ndarray | None, shape: tuple[int, int], dtype: str) -> np.ndarray:
    return np.empty(shape, storage_dtype(dtype)) if out is None else out


def quantize_int8(w: np.ndarray, *, src_dtype: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-row symmetric INT8 -> (q int8 [r, c], scales float32 [r])."""
    src = src_dtype_of(w, src_dtype)
    rows, cols = rows_cols(w.shape, "w")
    q, scales = np.empty((rows, cols), np.int8), np.empty(rows, np.float32)
    _rq.quantize_int8(w, src, q, scales)
    return q, scales


def dequantize_int8(
    q: np.ndarray, scales: np.ndarray, *, out_dtype: str = "bfloat16", out: np.ndarray | None = None
) -> np.ndarray:
    """q * scale per row -> [r, c] in out_dtype (uint16 bits for bfloat16)."""
    out = _out(out, rows_cols(q.shape, "q"), out_dtype)
    _rq.dequantize_int8(q, scales, out, out_dtype)
    return out


def _quantize_affine(scheme, w, src_dtype, group_size, scale_dtype, clip_search):
    """Allocate the packed codes and the per-group scales/biases, then let the scheme's Rust kernel fill them."""
    src = src_dtype_of(w, src_dtype)
    rows, cols = rows_cols(w.shape, "w")
    groups = (rows, cols // group_size if group_size > 0 else 0)
    packed = np.empty((rows, SCHEMES[scheme].packed_cols(cols)), SCHEMES[scheme].word)
    scales, biases = np.empty(groups, storage_dtype(scale_dtype)), np.empty(groups, storage_dtype(scale_dtype))
    getattr(_rq, f"quantize_{scheme}")(w, src, group_size, scale_dtype, clip_search, packed, scales, biases)
    return packed, scales, biases


def _dequantize_affine(scheme, packed, scales, biases, group_size, scale_dtype, out_dtype, out):
    """Allocate the output (unless given), then let the scheme's Rust kernel fill it."""
    rows, words = rows_cols(packed.shape, "packed")
    out = _out(out, (rows, SCHEMES[scheme].unpacked_cols(words)), out_dtype)
    getattr(_rq, f"dequantize_{scheme}")(packed, scales, biases, out, group_size, scale_dtype, out_dtype)
    return out


quantize_int8g, dequantize_int8g = grouped_functions("int8g", _quantize_affine, _dequantize_affine)
quantize_int4, dequantize_int4 = grouped_functions("int4", _quantize_affine, _dequantize_affine)
quantize_int3, dequantize_int3 = grouped_functions("int3", _quantize_affine, _dequantize_affine)
quantize_int2, dequantize_int2 = grouped_functions("int2", _quantize_affine, _dequantize_affine)
quantize_int5, dequantize_int5 = grouped_functions("int5", _quantize_affine, _dequantize_affine)
quantize_int6, dequantize_int6 = grouped_functions("int6", _quantize_affine, _dequantize_affine)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """uint8 codes 0..15 [r, c] -> uint8 [r, c//2], the low nibble holding the even column."""
    rows, cols = rows_cols(q.shape, "q")
    packed = np.empty((rows, SCHEMES["int4"].packed_cols(cols)), SCHEMES["int4"].word)
    _rq.pack_int4(q, packed)
    return packed


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """uint8 [r, c//2] -> uint8 codes 0..15 [r, c]."""
    rows, words = rows_cols(packed.shape, "packed")
    q = np.empty((rows, SCHEMES["int4"].unpacked_cols(words)), np.uint8)
    _rq.unpack_int4(packed, q)
    return q


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes 0..2**bits-1 [r, c] -> uint32 [r, c*bits//32] in mx.quantize(bits=bits)'s bitstream layout
    (bits 2, 3, 5 or 6: the schemes "int2", "int3", "int5", "int6")."""
    scheme = _bitstream(bits)
    rows, cols = rows_cols(q.shape, "q")
    packed = np.empty((rows, SCHEMES[scheme].packed_cols(cols)), SCHEMES[scheme].word)
    getattr(_rq, f"pack_{scheme}")(q, packed)
    return packed


def unpack_bits(packed: np.ndarray, cols: int, bits: int) -> np.ndarray:
    """uint32 [r, cols*bits//32] in mx.quantize(bits=bits)'s layout -> uint8 codes [r, cols]."""
    scheme = _bitstream(bits)
    q = np.empty((rows_cols(packed.shape, "packed")[0], cols), np.uint8)
    getattr(_rq, f"unpack_{scheme}")(packed, q)
    return q


def _bitstream(bits: int) -> str:
    if bits not in BITSTREAM_BITS:
        raise ValueError(f"bits={bits} is not a bitstream width; use one of {BITSTREAM_BITS}")
    return f"int{bits}"


def pack_int3(q: np.ndarray) -> np.ndarray:
    """uint8 codes 0..7 [r, c] -> uint32 [r, c*3//32] in mx.quantize(bits=3)'s layout."""
    return pack_bits(q, 3)


def unpack_int3(packed: np.ndarray, cols: int) -> np.ndarray:
    """uint32 [r, cols*3//32] in mx.quantize(bits=3)'s layout -> uint8 codes 0..7 [r, cols]."""
    return unpack_bits(packed, cols, 3)


def gptq_group(
    scheme: str, w: np.ndarray, start: int, u: np.ndarray, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray,
    *, group_size: int, scale_dtype: str, clip_search: bool,
) -> None:
    """GPTQ's column loop over the group of columns of `w` (float32 [rows, cols]) that begins at `start`, in place:
    the group's codes into `codes` (uint8 [rows, cols]), its grid into `scales` / `biases` ([rows, cols //
    group_size], scale_dtype), and its columns of `w` replaced by the rounding errors divided by the diagonal of `u`
    (float32 [group_size, group_size], the group's block of the upper Cholesky factor of the inverse Hessian)."""
    _rq.gptq_group(scheme, w, start, group_size, u, scale_dtype, clip_search, codes, scales, biases)


def quantize(
    scheme: str, w: np.ndarray, *, src_dtype: str | None = None, group_size: int = 64,
    scale_dtype: str = "bfloat16", clip_search: bool = False,
) -> tuple[np.ndarray, ...]:
    """`w` quantized with `scheme` ("int8", "int8g", "int2".."int6"): its parts, in the order
    SCHEMES[scheme].parts names them."""
    if scheme == "int8":
        return quantize_int8(w, src_dtype=src_dtype)
    return _quantize_affine(scheme, w, src_dtype, group_size, scale_dtype, clip_search)


def dequantize(
    scheme: str, *parts: np.ndarray, group_size: int | None = None, scale_dtype: str | None = None,
    out_dtype: str = "bfloat16", out: np.ndarray | None = None,
) -> np.ndarray:
    """The parts `quantize(scheme, ...)` made, dequantized to [rows, cols] in out_dtype."""
    if scheme == "int8":
        return dequantize_int8(*parts, out_dtype=out_dtype, out=out)
    return _dequantize_affine(scheme, *parts, group_size, scale_dtype, out_dtype, out)


def mlx_words(scheme: str, q: np.ndarray) -> np.ndarray:
    """Group-wise packed codes as the uint32 words MLX keeps. INT2/3/5/6 are stored in MLX's layout already, and
    group-wise INT8 bytes are MLX's words read little-endian (a view, no copy); INT4 nibbles are reordered."""
    return int4_to_mlx(q) if scheme == "int4" else q.view("<u4")


def from_mlx_words(scheme: str, words: np.ndarray) -> np.ndarray:
    """The inverse of mlx_words for any grouped scheme: MLX's uint32 words [..., w] as the scheme's packed codes
    [rows, packed cols]. Every grouped scheme packs its codes LSB first as MLX does, into words of its own width
    (bytes for INT4 and group-wise INT8, uint32 for the bitstream widths), so MLX's words read little-endian at that width are
    the scheme's codes: a view (a copy only for non-contiguous input)."""
    words = np.ascontiguousarray(words, dtype="<u4")
    return words.reshape(rows_cols(words.shape, "words")).view(SCHEMES[scheme].word)


def first_non_finite(values: np.ndarray, dtype: str) -> int | None:
    """The flat index of the first NaN or infinite value of `values` (C-contiguous, stored values of `dtype`:
    bfloat16 as its uint16 bits), None when every value is finite; tested on every core."""
    return _rq.first_non_finite(values, dtype)


def gather_qmv_int4(x: np.ndarray, words: np.ndarray, scales: np.ndarray, biases: np.ndarray, experts: np.ndarray,
                    *, group_size: int, scale_dtype: str) -> np.ndarray:
    """float32 [rows, out]: each row of `x` (float32 [rows, cols]) times the MLX 4-bit affine matrix its entry of
    `experts` (uint32 [rows]) picks from `words` (MLX's uint32 words, [..., out, cols / 8]: one matrix or a stack of
    them), `scales` and `biases` (scale_dtype's storage, [..., out, cols / group_size]); transposed, as
    `mx.gather_qmm(..., transpose=True)` multiplies. The rows routed to one matrix share each group's unpacking."""
    y = np.empty((x.shape[0], words.shape[-2]), np.float32)
    _rq.gather_qmv_int4(x, words, scales, biases, experts, y, group_size, scale_dtype)
    return y
