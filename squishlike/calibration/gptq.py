"""Error-compensating quantization (GPTQ, Frantar et al. 2022): each column of a linear weight is rounded in turn and
its rounding error, weighted by the inverse Hessian of the layer's calibration inputs, is pushed onto the columns
not yet rounded, so the layer's output on those inputs, not each weight, stays close.

The grid of each group (scale and offset) is the store's own: the Rust quantizer's choice (clip search included)
for the group's columns as they stand when the group is reached. The result is the scheme's parts, as
`quant.quantize` returns them, so every tier reads the store exactly as it reads a round-to-nearest one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .. import quant
from ..openblas import mlx_lapack_is_fast
from ..quant.reference import BITSTREAM_BITS, storage_dtype, to_float32
from .products import subtract_product
from .quantizer import Quantizer

DAMPING = 0.01  # of the Hessian's mean diagonal, added to its diagonal (the paper's and mlx_lm's value)
BATCH = 256  # columns whose errors are spread onto the later columns in one product (the paper's lazy batch: 128)
# Inputs at most this wide get one factor of their whole Hessian; a wider input (an MLP's down projection: 8,960
# columns at 1.5B, 18,944 at 7B) is factored in spans of this many columns, each error spread within its span.
# The factorisation costs width^3 on the CPU (MLX has no GPU Cholesky): at 8,960 columns two factorisations of
# 0.24 TFLOP a layer, in spans 29 GFLOP; at 18,944, 4.3 GB of factors at once, in spans 16 MB each.
HESSIAN_SPAN = 2048
ROW_BLOCK = 8192  # rows GPTQ rounds at once (see gptq)
# An expert reached by fewer calibration rows than this has its Hessian pooled with its stack's (expert_factors);
# measured in docs/design.md §7.5
EXPERT_MIN_ROWS = 16
_PACK = {"int4": quant.pack_int4, "int8g": lambda q: q,
         **{f"int{bits}": functools.partial(quant.pack_bits, bits=bits) for bits in BITSTREAM_BITS}}


@dataclass(frozen=True)
class FactorSpan:
    """The inverse-Hessian factor of columns start .. start + len(dead) of a layer's input."""

    start: int
    u: np.ndarray  # float32 [n, n]: upper Cholesky factor of the span's H^-1
    dead: np.ndarray  # bool [n]: inputs that are always zero, whose weights do not matter


def inverse_hessian_factor(x: np.ndarray, span: int = HESSIAN_SPAN,
                           prior: mx.array | None = None) -> list[FactorSpan]:
    """The factors for calibration inputs `x` (float32 [n, cols]), one per span of `span` columns: u the upper
    Cholesky factor of H^-1, H = x^T x damped (over the span's columns), whose row k says how column k's rounding
    error spreads onto the later columns of its span; dead the inputs that are always zero.

    H on MLX's default device (the GPU where there is one); its factorisation with MLX's LAPACK on the CPU (MLX has
    no GPU Cholesky; NumPy's, on two busy cores, was 40x slower), in float32, as mlx_lm's GPTQ. One Cholesky
    factorisation and one triangular inverse, not an inverse and a factorisation: the lower factor L of H with its
    rows and columns reversed (J H J = L L^T) gives H = (J L J)(J L J)^T, so u = (J L J)^-1 = J L^-1 J.

    `prior` ([cols, cols]), when given, is added to x^T x before damping (an expert's Hessian pooled with its
    stack's, `expert_factors`).
    """
    xs = mx.array(x)
    spans = []
    for start in range(0, xs.shape[1], span):
        xc = xs[:, start:start + span]
        h = xc.T @ xc
        if prior is not None:
            h = h + prior[start:start + span, start:start + span]
        dead = mx.diag(h) == 0
        h = h + mx.diag(dead.astype(mx.float32))  # a dead input's column: unconstrained, and H stays invertible
        h = h + DAMPING * mx.mean(mx.diag(h)) * mx.eye(h.shape[0])
        spans.append(FactorSpan(start, _upper_inverse_factor(h), np.array(dead)))
    return spans


def _upper_inverse_factor(h: mx.array) -> np.ndarray:
    """J L^-1 J for the lower Cholesky factor L of J h J, on the CPU. MLX's LAPACK where it is fast (an OpenBLAS
    preloaded, Accelerate); else NumPy's bundled OpenBLAS: the Linux CUDA wheel's CPU LAPACK is a reference one,
    which on one H100's host took ~20 s a factor of a 1.5B's layer, most of that compress."""
    if mlx_lapack_is_fast():
        lower = mx.linalg.cholesky(h[::-1, ::-1], stream=mx.cpu)
        return np.array(mx.linalg.tri_inv(lower, upper=False, stream=mx.cpu)[::-1, ::-1])
    lower = np.linalg.cholesky(np.array(h)[::-1, ::-1])
    return np.ascontiguousarray(np.tril(np.linalg.inv(lower))[::-1, ::-1])


def expert_factors(x: np.ndarray, experts: np.ndarray, count: int,
                   min_rows: int = EXPERT_MIN_ROWS) -> list[list[FactorSpan]]:
    """The inverse-Hessian factor of each of an expert stack's `count` experts, from the rows `x` routed to it
    (`experts[r]`: the expert row r went to). An expert that fewer than `min_rows` rows reached has its Hessian
    pooled with the stack's: the stack's mean row outer product, (min_rows - its rows) times, is added to its own,
    so an expert that saw 3 tokens is compensated mostly on what the whole stack saw (as mlx_lm's one Hessian per
    stack does for every expert) and one that saw many on its own tokens alone."""
    xs = mx.array(x)
    mean = (xs.T @ xs) / max(len(x), 1)
    factors = []
    for e in range(count):
        own = x[experts == e]
        missing = max(min_rows - len(own), 0)
        factors.append(inverse_hessian_factor(own, prior=mean * missing if missing else None))
    return factors


def gptq(w: np.ndarray, dtype: str, qz: Quantizer, factor: list[FactorSpan]) -> tuple[np.ndarray, ...]:
    """`w` ([rows, cols], its values stored as `dtype`) quantized with `qz`'s grouped scheme so that `x @ w.T`
    changes least on the calibration inputs x whose `inverse_hessian_factor` is `factor`; the scheme's parts
    (codes, scales, offsets).

    Rows are independent (each spreads its own errors with the same factor), so they go ROW_BLOCK at a time, made
    float32 as they go: a vocabulary-sized head is 0.9 GB of float32 at 1.5B and 2.2 GB at 7B."""
    rows, cols = w.shape
    codes = np.empty((rows, cols), np.uint8)
    scales, biases = (np.empty((rows, cols // qz.group_size), storage_dtype(qz.scale_dtype)) for _ in range(2))
    for r in range(0, rows, ROW_BLOCK):
        block = slice(r, min(r + ROW_BLOCK, rows))
        _gptq_rows(np.array(to_float32(w[block], dtype), dtype=np.float32), qz, factor, codes[block],
                   scales[block], biases[block])
    return _PACK[qz.scheme](codes), scales, biases


def _gptq_rows(w: np.ndarray, qz: Quantizer, factor: list[FactorSpan], codes: np.ndarray, scales: np.ndarray,
               biases: np.ndarray) -> None:
    """GPTQ of float32 rows `w` (overwritten: each group's columns become its scaled rounding errors) into `codes`,
    `scales` and `biases`.

    Span by span, group by group: the Rust kernel rounds the group's columns in turn, each error spread onto the
    group's later columns (`quant.gptq_group`, rows in parallel), and a matrix product spreads its errors onto the
    rest of its batch of columns; each batch's errors reach the span's columns after it in one product (the paper's
    lazy batch update)."""
    g = qz.group_size
    batch = max(g, BATCH // g * g)
    for f in factor:
        first, last = f.start, f.start + len(f.dead)
        u = f.u
        w[:, first:last][:, f.dead] = 0
        for b in range(first, last, batch):
            end = min(b + batch, last)
            for i in range(b, end, g):
                j = i + g
                quant.gptq_group(qz.scheme, w, i, np.ascontiguousarray(u[i - first:j - first, i - first:j - first]),
                                 codes, scales, biases, group_size=g, scale_dtype=qz.scale_dtype,
                                 clip_search=qz.clip_search)
                if j < end:
                    subtract_product(w[:, j:end], w[:, i:j], u[i - first:j - first, j - first:end - first])
            if end < last:
                subtract_product(w[:, end:last], w[:, b:end], u[b - first:end - first, end - first:])
