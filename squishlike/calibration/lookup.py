"""What an error in the token embedding's rows costs, found from the model: the Hessian GPTQ rounds the embedding
along its width with (docs/design.md §7.5).

A row the model looks up is the first layer's input. It goes on unchanged down the residual path, and the first
layer's linears read it through a norm: to first order an error e in the row moves their outputs by
W diag(w + o) e / rms (w + o: the norm's scale, `awq.weight_offset`), so the Hessian of those outputs is
diag(w + o) W^T W diag(w + o), normalised here to a mean diagonal of 1 (the rms differs from row to row), plus the
identity for the residual path. Which linears read the first layer's input, and through which norm, the probe
shows (`linears.probe`), as it shows GPTQ's groups and AWQ's folds: no family is named.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..errors import UnsupportedArchitectureError
from .awq import norm_like, weight_offset
from .blocks import BlockRunner
from .linears import COMPENSATED_TYPES, probe


def lookup_readers(runner: BlockRunner) -> tuple[list[str], np.ndarray | None]:
    """The linears of the first block (loaded) that read its input through a norm or directly (mlx paths), and
    rows x ([width, width] float32) whose x^T x is the Hessian above; ([], None) when no linear reads it so."""
    block, prefix = runner.block(0), runner.slots[0].prefix
    norms = [prefix + p for p, m in block.named_modules() if norm_like(m)]
    linears = [prefix + p for p, m in block.named_modules() if isinstance(m, COMPENSATED_TYPES)]
    probes, _ = probe(runner, 0, [*norms, *linears])
    entering = runner.hidden[0]
    width = entering.shape[-1]
    scale_of = {id(entering): mx.ones((width,))}  # the arrays that carry the row, each with its scale
    for path in norms:
        p = probes[path]
        if len(p._squish_inputs) == 1 and p._squish_inputs[0] is entering and p.inner.weight.shape == (width,):
            scale_of[id(p._squish_outputs[0])] = p.inner.weight + weight_offset(p.inner)
    readers, h = [], mx.zeros((width, width))
    for path in linears:
        p = probes[path]
        scales = [scale_of[id(x)] for x in p._squish_inputs if id(x) in scale_of]
        if scales:
            w = p.inner.weight.reshape(-1, width).astype(mx.float32) * scales[0][None, :]
            h = h + w.T @ w
            readers.append(path)
    if not readers:
        return [], None
    h = h / mx.mean(mx.diag(h)) + mx.eye(width)
    return readers, np.ascontiguousarray(np.linalg.cholesky(np.array(h, dtype=np.float64)).T, dtype=np.float32)


def lookup_rows(runner: BlockRunner, canonical: dict[str, str]) -> tuple[np.ndarray | None, dict]:
    """`lookup_readers` of the first block (loaded) and the manifest's record of it: {"readers": canonical
    weights}, or {"left_out": why} with rows None. `canonical` maps mlx names to canonical."""
    why = "no linear of the first layer reads its input through a norm"
    try:
        readers, rows = lookup_readers(runner)
    except UnsupportedArchitectureError as e:
        readers, rows, why = [], None, str(e)
    return rows, {"readers": [canonical[f"{r}.weight"] for r in readers]} if readers else {"left_out": why}


def normalised(x: np.ndarray) -> np.ndarray:
    """Rows `x` scaled so that x^T x has a mean diagonal of 1: Hessians of two uses of one matrix, made comparable
    before they are summed."""
    return x / np.float32(max(np.sqrt(np.square(x, dtype=np.float64).sum() / x.shape[1]), 1e-30))
