"""Error-compensating quantization (GPTQ, Frantar et al. 2022): each column of a linear weight is rounded in turn and
its rounding error, weighted by the inverse Hessian of the layer's calibration inputs, is pushed onto the columns
not yet rounded, so the layer's output on those inputs, not each weight, stays close.

The grid of each group (scale and offset) is the store's own: the Rust quantizer's choice (clip search included)
for the group's columns as they stand when the group is reached. The result is the scheme's parts, as
`quant.quantize` returns them, so every tier reads the store exactly as it reads a round-to-nearest one.
"""

from __future__ import annotations

import numpy as np

from .. import quant
from ..quant.reference import to_float32
from ..quant.schemes import SCHEMES
from .quantizer import Quantizer
from .stats import ScaleGroup

DAMPING = 0.01  # of the Hessian's mean diagonal, added to its diagonal (the paper's and mlx_lm's value)
_PACK = {"int4": quant.pack_int4, "int3": quant.pack_int3, "int8g": lambda q: q}


def gptq(w: np.ndarray, x: np.ndarray, qz: Quantizer) -> tuple[np.ndarray, ...]:
    """`w` (float32 [rows, cols]) quantized with `qz`'s grouped scheme so that `x @ w.T` (x: float32 [n, cols],
    calibration inputs) changes least; the scheme's parts (codes, scales, offsets)."""
    rows, cols = w.shape
    g = qz.group_size
    levels = 2 ** SCHEMES[qz.scheme].bits - 1
    h = (x.T.astype(np.float64) @ x.astype(np.float64))
    dead = np.diag(h) == 0  # an input that is always zero: its weights do not matter
    h[dead, dead] = 1.0
    h[np.diag_indices(cols)] += DAMPING * np.mean(np.diag(h))
    # Upper Cholesky factor of H^-1: row k holds how column k's error spreads onto the later columns.
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T.astype(np.float32)
    wt = np.array(w.T, dtype=np.float32)  # [cols, rows]: a column of w is a contiguous row here
    wt[dead] = 0
    codes = np.empty((cols, rows), np.uint8)
    scales, offsets = [], []
    for i in range(0, cols, g):
        j = i + g
        _, s_part, z_part = quant.quantize(qz.scheme, np.ascontiguousarray(wt[i:j].T), group_size=g,
                                           scale_dtype=qz.scale_dtype, clip_search=qz.clip_search)
        scales.append(s_part)
        offsets.append(z_part)
        s, z = to_float32(s_part, qz.scale_dtype)[:, 0], to_float32(z_part, qz.scale_dtype)[:, 0]
        for k in range(i, j):
            with np.errstate(divide="ignore", invalid="ignore"):
                q = np.where(s == 0, 0, np.clip(np.rint((wt[k] - z) / s), 0, levels))
            codes[k] = q
            wt[k] = (wt[k] - (q * s + z)) / hinv[k, k]  # row k now holds column k's scaled error
            wt[k + 1:j] -= np.outer(hinv[k, k + 1:j], wt[k])
        wt[j:] -= hinv[i:j, j:].T @ wt[i:j]
    return _PACK[qz.scheme](np.ascontiguousarray(codes.T)), np.concatenate(scales, axis=1), np.concatenate(offsets, axis=1)


def head_group(provider) -> ScaleGroup | None:
    """The output head (its own weight, or the token embedding it is tied to) as a group whose input is recorded
    at the final norm's output; None when the model has no such pair."""
    head = "output.weight" if provider.has("output.weight") else "token_embedding.weight"
    if not (provider.has(head) and provider.has("output_norm.weight")):
        return None
    norm = provider.mlx_name("output_norm.weight").removesuffix(".weight")
    return ScaleGroup("head", "head", -1, norm, (head,), (), records_output=True)
