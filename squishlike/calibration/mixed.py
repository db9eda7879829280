"""Mixed precision by measured sensitivity: a diagonal-Fisher estimate of each linear's quantization cost, and the
greedy choice of the tensors kept at higher precision within a size budget."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..evaluation import Window
from .awq import Transform
from .quantizer import Quantizer

FISHER_WINDOW = 256  # tokens per gradient sample for the Fisher estimate


def fisher_diagonal(model: nn.Module, windows: Sequence[Window], params: Sequence[str]) -> dict[str, np.ndarray]:
    """sum over `windows` (calibration text, FISHER_WINDOW tokens each) of (d NLL_window / d W)^2 for the mlx
    parameters `params` (float32)."""
    wanted = set(params)
    model.freeze()
    for name, module in model.named_modules():
        if f"{name}.weight" in wanted:
            module.unfreeze(keys=["weight"], recurse=False)

    def loss_fn(m, inputs, targets):
        logits = m(inputs)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return -mx.take_along_axis(logprobs, targets[:, None], axis=-1).sum()

    grad_fn = nn.value_and_grad(model, loss_fn)
    fisher: dict[str, mx.array] = {}
    try:
        for w in windows:
            inputs = mx.array(w.tokens[:-1], dtype=mx.int32)[None]
            targets = mx.array(w.tokens[1:], dtype=mx.int32)
            _, grads = grad_fn(model, inputs, targets)
            for name, g in tree_flatten(grads):
                if name in wanted:
                    fisher[name] = g * g if name not in fisher else fisher[name] + g * g
            mx.eval(list(fisher.values()))
    finally:
        model.unfreeze()
    return {k: np.array(v) for k, v in fisher.items()}


def plan_mixed(
    names: Sequence[str],
    weight: Callable[[str], np.ndarray],
    transform: Transform,
    fisher: dict[str, np.ndarray],
    mlx_name: Callable[[str], str],
    base: Quantizer,
    high: Quantizer,
    budget: float,
) -> tuple[list[str], dict[str, Any]]:
    """Which of `names` (tensors the store quantizes with `base`) to keep at `high` instead (INT8, or exact:
    passthrough), greedily by estimated loss saved per extra byte, within `budget` x their bytes at `base`.
    Returns (chosen, report)."""
    rows = []
    for name in names:
        w = transform.apply(name, weight(name))
        f = fisher[mlx_name(name)]
        loss = []
        for qz in (base, high):
            e = transform.error_back(name, qz(w) - w)
            loss.append(0.5 * float(np.einsum("ij,ij->", f, e * e, dtype=np.float64)))
        r, c = w.shape
        extra = high.nbytes(r, c) - base.nbytes(r, c)
        rows.append((name, loss[0], loss[1], base.nbytes(r, c), extra))
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
    report = {
        "budget": budget,
        "extra_bytes": int(spent),
        "base_bytes": int(sum(r[3] for r in rows)),
        "promoted_to": high.scheme,
        "tensors": sorted(chosen, key=list(names).index),
        "estimated_loss_increase": {"all_base": round(est_total, 4), "mixed": round(est_after, 4)},
        "sensitivity": {r[0]: round(r[1], 5) for r in rows},
    }
    return chosen, report
