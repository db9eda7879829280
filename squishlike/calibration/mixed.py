"""Mixed precision by measured sensitivity: each quantized tensor's cost, measured on its calibration inputs as
the change of its layer's outputs (`tensor_losses`), and the greedy choice of the tensors kept at higher precision
within a size budget (`plan_mixed`).

Why the layer's output change, ||X (W_hat - W)^T||^2 over the calibration inputs X: it is what one block of the
model shows (the Hessian of the layer's squared output error is X^T X, as GPTQ uses it), so it is measured in the
block-by-block pass with no backward pass through the whole model, which would hold every layer at once."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from .awq import Transform
from .products import output_error
from .quantizer import Quantizer


def tensor_losses(name: str, w: np.ndarray, x: np.ndarray, transform: Transform,
                  quantizers: Sequence[Quantizer]) -> tuple[float, ...]:
    """For each quantizer, the squared change of the layer's outputs on inputs `x` when its weight `w` (float32,
    as the source holds it) is stored with it, after the AWQ rewrite `transform` (whose column scales divide the
    inputs, so the product is the source's)."""
    ws = transform.apply(name, w)
    xs = x / transform.col[name][None, :] if name in transform.col else x
    xs = mx.array(xs)
    return tuple(output_error(xs, qz(ws) - ws) for qz in quantizers)


def plan_mixed(
    losses: dict[str, tuple[float, float]],
    shapes: dict[str, tuple[int, int]],
    base: Quantizer,
    high: Quantizer,
    budget: float,
) -> tuple[list[str], dict[str, Any]]:
    """Which tensors (`losses`: name -> (loss at `base`, loss at `high`)) to keep at `high` instead, greedily by
    loss saved per extra byte, within `budget` x their bytes at `base`. Returns (chosen, report)."""
    rows = []
    for name, (l_base, l_high) in losses.items():
        r, c = shapes[name]
        rows.append((name, l_base, l_high, base.nbytes(r, c), high.nbytes(r, c) - base.nbytes(r, c)))
    limit = budget * sum(r[3] for r in rows)
    ranked = sorted(rows, key=lambda r: (r[1] - r[2]) / max(r[4], 1), reverse=True)
    chosen, spent = [], 0
    for name, l_base, l_high, _, extra in ranked:
        if l_base - l_high <= 0 or spent + extra > limit:
            continue
        chosen.append(name)
        spent += extra
    est_total = sum(r[1] for r in rows)
    est_after = est_total - sum(r[1] - r[2] for r in rows if r[0] in chosen)
    names = list(losses)
    report = {
        "budget": budget,
        "extra_bytes": int(spent),
        "base_bytes": int(sum(r[3] for r in rows)),
        "promoted_to": high.scheme,
        "tensors": sorted(chosen, key=names.index),
        "measure": "the layer's output change on the calibration inputs, ||X (W_hat - W)^T||^2",
        "estimated_loss_increase": {"all_base": round(est_total, 4), "mixed": round(est_after, 4)},
        "sensitivity": {r[0]: round(r[1], 5) for r in rows},
    }
    return chosen, report
