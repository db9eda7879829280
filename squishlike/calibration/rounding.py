"""The grid refitted to GPTQ's codes: after GPTQ has rounded a linear, each group's scale and offset are solved
again, with the codes kept, to minimise the linear's output error on its calibration inputs x, trace(E H E^T)
(E: the weight less its dequantized form, H = x^T x / n), a least-squares problem per row in its groups' scales
and offsets together. GPTQ picks each group's grid from the group's values as they stand when it reaches them
(min-max, or the clip search's narrowing), for the weights, not for the output; solved for the output, the grid
lowers SmolLM2's output errors by 3-87 % (docs/design.md §7.7).

The store keeps whichever of the two has the lower output error on every calibration row, so it never does worse
than GPTQ on them, and the result is the same affine codes, scales and offsets in the store's packing: every tier
and `export --to mlx` read it as they read any GPTQ'd tensor.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import quant
from ..quant.reference import from_float32, to_float32
from ..quant.schemes import SCHEMES
from .quantizer import Quantizer

REFIT_BYTES = 256 << 20  # the most a refit holds at once for its rows' normal equations
DAMPING = 1e-4  # of a row's mean diagonal: a group whose codes cannot tell scale from offset keeps GPTQ's grid
REFIT_METHOD = ("after GPTQ, each group's scale and offset solved again with GPTQ's codes kept, by least squares on "
                "the linear's output error over its calibration inputs (each row's groups together); kept where "
                "that error is lower than GPTQ's (tensors: each one's mean squared output error with GPTQ's grid "
                "and with the refitted one)")


def refit(w: np.ndarray, x: np.ndarray, qz: Quantizer,
          start: tuple[np.ndarray, ...]) -> tuple[tuple[np.ndarray, ...], dict[str, float]]:
    """GPTQ's parts `start` of `w` (float32 [rows, cols], quantized with `qz`'s group-wise scheme) with the grid
    refitted (refit_grid) on the linear's calibration inputs `x` (float32 [n, cols]); the parts with the lower
    output error on every row of x, and both errors ({"gptq": ..., "refit": ...})."""
    cols = w.shape[1]
    wf, xs = mx.array(w), mx.array(x)
    codes = mx.array(codes_of(qz.scheme, start[0], cols), dtype=mx.float32)
    scale, bias = refit_grid(wf, xs.T @ xs / xs.shape[0], codes,
                             *(mx.array(to_float32(p, qz.scale_dtype)) for p in start[1:]), qz.group_size)
    refitted = (start[0], from_float32(np.array(scale), qz.scale_dtype), from_float32(np.array(bias), qz.scale_dtype))
    errors = {"gptq": output_error(wf, xs, start, qz), "refit": output_error(wf, xs, refitted, qz)}
    return (refitted if errors["refit"] < errors["gptq"] else start), errors


def refit_grid(w: mx.array, hessian: mx.array, codes: mx.array, scale: mx.array, bias: mx.array,
               group_size: int) -> tuple[mx.array, mx.array]:
    """Each group's scale and offset that, with `codes` (float32 [rows, cols]) kept, minimise the output error
    trace(E H E^T) of `w` (float32 [rows, cols]; H = `hessian`, E = w less codes x scale + offset): per row, the
    normal equations of its groups' scales and offsets together, coupled through H. `scale`, `bias` ([rows,
    groups]): the grid the codes came with, which a group keeps where its codes do not determine one (a damping
    term pulls towards it)."""
    rows, cols = w.shape
    groups = cols // group_size
    member = (mx.arange(cols)[:, None] // group_size == mx.arange(groups)[None, :]).astype(mx.float32)  # [cols, G]
    offset_h = member.T @ hessian  # [G, cols]: an offset's column of the design, times H
    chunk = max(1, REFIT_BYTES // (cols * groups * 4 * 2))
    solved = []
    for r in range(0, rows, chunk):
        q, target = codes[r:r + chunk], w[r:r + chunk]
        n = q.shape[0]
        design = q[:, :, None] * member[None]  # [n, cols, G]: a scale's column of the design is its group's codes
        scale_h = design.swapaxes(1, 2) @ hessian  # [n, G, cols]
        cross = scale_h @ member  # [n, G, G]
        normal = mx.concatenate([mx.concatenate([scale_h @ design, cross], axis=2),
                                 mx.concatenate([cross.swapaxes(1, 2),
                                                 mx.broadcast_to(offset_h @ member, (n, groups, groups))], axis=2)],
                                axis=1)  # [n, 2G, 2G]
        rhs = mx.concatenate([scale_h @ target[:, :, None], (offset_h @ target.T).T[:, :, None]], axis=1)
        damp = DAMPING * mx.mean(mx.diagonal(normal, axis1=1, axis2=2), axis=1)[:, None, None] + 1e-12
        first = mx.concatenate([scale[r:r + chunk], bias[r:r + chunk]], axis=1)[:, :, None]
        solved.append(mx.linalg.solve(normal + damp * mx.eye(2 * groups)[None], rhs + damp * first,
                                      stream=mx.cpu)[..., 0])
    theta = mx.concatenate(solved)
    return theta[:, :groups], theta[:, groups:]


def output_error(w: mx.array, x: mx.array, parts: tuple[np.ndarray, ...], qz: Quantizer) -> float:
    """Mean squared error of `x @ w.T` (float32 [n, rows]) when `w` is replaced by `parts`, as stored."""
    stored = quant.dequantize(qz.scheme, *parts, group_size=qz.group_size, scale_dtype=qz.scale_dtype,
                              out_dtype=qz.scale_dtype)
    return mx.mean(mx.square(x @ (w - mx.array(to_float32(stored, qz.scale_dtype))).T)).item()


def codes_of(scheme: str, packed: np.ndarray, cols: int) -> np.ndarray:
    """The uint8 codes [rows, cols] of a group-wise scheme's packed codes."""
    if scheme == "int4":
        return quant.unpack_int4(packed)
    if scheme == "int8g":
        return packed
    return quant.unpack_bits(packed, cols, SCHEMES[scheme].bits)
