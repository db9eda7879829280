"""Widths by measured sensitivity: each quantized tensor's cost at each width it may be stored with, measured in the
block-by-block pass as the change it makes to its block's output (`block_losses`), and the choice of every
tensor's width that loses least within a size (`allocate`): for a bits-per-weight target (`plan_widths`), or for
mixed precision's promotions within a fraction of extra bytes (`plan_mixed`).

Every loss is relative: the squared change of what the tensor's block hands on (the residual stream after the block;
for the output head its logits; for the token embedding the rows it looks up), over the squares of that output.
Relative changes of the residual stream are what the normalised layers after it see, so one scale serves every
block, the head and the embedding. docs/design.md §7.4 has the reasons and the measurements behind the plan."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from ..errors import BudgetError
from ..quant.schemes import SCHEMES
from .awq import Transform
from .blocks import BlockRunner
from .products import output_error
from .quantizer import Quantizer

MEASURE = ("the relative change of the block's output (the head's logits, the embedding's rows) per calibration "
           "token, ||y_hat - y||^2 / ||y||^2, averaged, with the tensor rounded and the rest exact")
TRIAL_TOKENS = 512  # the calibration tokens a block's trial roundings run on: its first windows holding this many


def _stored(name: str, w: np.ndarray, transform: Transform, qz: Quantizer) -> np.ndarray:
    """`w` (float32, the source's) as the store will hold it with `qz`, back in the source's space: rounded after
    the AWQ rewrite, whose scales are then taken out again."""
    ws = transform.apply(name, w)
    return w + transform.error_back(name, qz(ws) - ws)


def _relative(changed: Sequence[mx.array], exact: Sequence[mx.array]) -> float:
    """The mean over tokens of ||changed - exact||^2 / ||exact||^2 (arrays [..., tokens, width]). Per token: a few
    tokens' residual streams (the first token's, most) are orders of magnitude larger than the rest, and would
    otherwise decide every sum."""
    total, count = 0.0, 0
    for c, e in zip(changed, exact):
        e = e.reshape(-1, e.shape[-1])
        d = c.reshape(-1, c.shape[-1]) - e
        total += mx.sum(mx.sum(d * d, axis=-1) / mx.maximum(mx.sum(e * e, axis=-1), 1e-30)).item()
        count += e.shape[0]
    return total / max(count, 1)


def block_losses(runner: BlockRunner, i: int, mlx_name: str, name: str, w: np.ndarray, x: np.ndarray,
                 inputs: Sequence[mx.array], outputs: Sequence[mx.array], transform: Transform,
                 quantizers: Sequence[Quantizer], reference: int) -> tuple[float, ...]:
    """For each quantizer, the relative change of block `i`'s outputs (`outputs`, on `inputs`) when its weight
    `name` (`mlx_name` in the model; `w`, float32; `x`, sampled rows of its inputs) is stored with it and the rest of
    the block is not.

    The block runs once, with the weight stored by `quantizers[reference]`, on the first windows holding
    TRIAL_TOKENS tokens; the other widths' losses follow from it in proportion to the change each makes to the
    linear's own outputs, ||X (W_hat - W)^T||^2: small changes pass through the block about linearly, and a run
    for every width would cost six times as much."""
    n, tokens = 0, 0
    while n < len(inputs) and tokens < TRIAL_TOKENS:
        tokens, n = tokens + inputs[n].shape[1], n + 1
    ws = transform.apply(name, w)
    change = quantizers[reference](ws) - ws  # in the rewritten weight's space; the others' one at a time below
    try:
        runner.set_weights(i, [(mlx_name, mx.array(w + transform.error_back(name, change)))])
        measured = _relative(runner.run(i, inputs[:n]), outputs[:n])
    finally:
        runner.set_weights(i, [(mlx_name, mx.array(w))])
    xs = mx.array(x / transform.col[name][None, :] if name in transform.col else x)
    linear = [output_error(xs, change if k == reference else qz(ws) - ws) for k, qz in enumerate(quantizers)]
    return tuple(measured * v / linear[reference] if linear[reference] > 0 else 0.0 for v in linear)


def tensor_losses(name: str, w: np.ndarray, x: np.ndarray, transform: Transform,
                  quantizers: Sequence[Quantizer]) -> tuple[float, ...]:
    """For each quantizer, the relative change of a linear's outputs on inputs `x` when its weight `w` (float32,
    as the source holds it) is stored with it (per input row, as `_relative`), after the AWQ rewrite
    `transform` (whose column scales divide the inputs, so the product is the source's). The output head's
    measure: its outputs are the logits."""
    ws = transform.apply(name, w)
    xs = mx.array(x / transform.col[name][None, :] if name in transform.col else x)
    exact = xs @ mx.array(ws).T
    return tuple(_relative([xs @ mx.array(qz(ws)).T], [exact]) for qz in quantizers)


def lookup_losses(name: str, w: np.ndarray, counts: np.ndarray, transform: Transform,
                  quantizers: Sequence[Quantizer]) -> tuple[float, ...]:
    """For each quantizer, the relative change of the rows a token embedding `w` looks up for the calibration
    tokens (`counts`: how often each row is looked up) when it is stored with it. Rows are quantized
    independently, so only the rows looked up are."""
    used = np.flatnonzero(counts)
    rows, weights = np.ascontiguousarray(w[used]), counts[used] / counts.sum()
    energy = np.maximum(np.square(rows, dtype=np.float64).sum(axis=1), 1e-30)
    return tuple(float(weights @ (np.square(_stored(name, rows, transform, qz) - rows, dtype=np.float64).sum(axis=1)
                                  / energy)) for qz in quantizers)


@dataclass(frozen=True)
class Choice:
    """One way to store a tensor: its scheme and group size (0: not group-wise), its bytes at rest and the loss
    measured with it."""

    scheme: str
    nbytes: int
    loss: float
    group_size: int = 0


def _lower_hull(choices: Sequence[Choice]) -> list[Choice]:
    """The choices on the lower convex hull of loss against bytes, cheapest first: each step to the next buys less
    loss per byte than the one before. The others can never be the best use of their bytes."""
    hull: list[Choice] = []
    for c in sorted(choices, key=lambda c: (c.nbytes, c.loss)):
        if hull and c.loss >= hull[-1].loss:
            continue  # more bytes, no less loss
        while len(hull) >= 2 and _gain(hull[-2], hull[-1]) <= _gain(hull[-1], c):
            hull.pop()
        hull.append(c)
    return hull


def _gain(a: Choice, b: Choice) -> float:
    """Loss saved per extra byte, going from `a` to `b`."""
    return (a.loss - b.loss) / max(b.nbytes - a.nbytes, 1)


def allocate(choices: dict[str, Sequence[Choice]], budget: int) -> dict[str, Choice]:
    """Each tensor's choice, the sum of losses least within `budget` bytes: every tensor starts at its cheapest
    choice, and the step (one tensor to its next choice on its lower hull) that saves the most loss per byte is
    taken while it fits, then the next best, until none does. Optimal at the hull's corners (the Lagrangian
    solution); the bytes left over are less than the smallest step that did not fit. Raises BudgetError when
    even the cheapest choices exceed the budget."""
    hulls = {name: _lower_hull(c) for name, c in choices.items()}
    picked = {name: 0 for name in hulls}
    spent = sum(h[0].nbytes for h in hulls.values())
    if spent > budget:
        raise BudgetError(f"the smallest choice of every tensor takes {spent} bytes, more than the {budget} allowed")
    order = {name: i for i, name in enumerate(hulls)}  # ties go to the earlier tensor: the same plan every run
    steps = [(-_gain(h[0], h[1]), order[n], n) for n, h in hulls.items() if len(h) > 1]
    heapq.heapify(steps)
    while steps:
        _, _, name = heapq.heappop(steps)
        hull, i = hulls[name], picked[name]
        extra = hull[i + 1].nbytes - hull[i].nbytes
        if spent + extra > budget:
            continue  # its later steps save less per byte; smaller steps of other tensors may still fit
        spent, picked[name] = spent + extra, i + 1
        if i + 2 < len(hull):
            heapq.heappush(steps, (-_gain(hull[i + 1], hull[i + 2]), order[name], name))
    return {name: hulls[name][i] for name, i in picked.items()}


def tensor_choices(losses: dict[str, Sequence[float]], shapes: dict[str, tuple[int, int]],
                   quantizers: dict[str, Sequence[Quantizer]]) -> dict[str, list[Choice]]:
    """`losses` (name -> a loss per quantizer of `quantizers[name]`) as every tensor's choices."""
    return {name: [Choice(q.scheme, q.nbytes(*shapes[name]), loss, stored_group_size(q))
                   for q, loss in zip(quantizers[name], ls)]
            for name, ls in losses.items()}


def stored_group_size(qz: Quantizer) -> int:
    """The group size a tensor stored with `qz` records: its own for a group-wise scheme, else 0."""
    return qz.group_size if SCHEMES[qz.scheme].grouped else 0


def fitting(quantizers: Sequence[Quantizer], cols: int) -> list[Quantizer]:
    """The quantizers a weight of `cols` columns can be stored with: those whose groups split its rows."""
    return [q for q in quantizers if not SCHEMES[q.scheme].grouped or cols % q.group_size == 0]


def plan_widths(choices: dict[str, list[Choice]], budget: int, params: int, fixed: int,
                losses: dict[str, Sequence[float]]) -> dict[str, Any]:
    """The width of each tensor of `choices` within `budget` bytes for them (a bits-per-weight target less the
    `fixed` bytes of the tensors not chosen for), as the manifest's report: the chosen schemes, the bytes and bits
    per weight planned, and every measured loss (`losses`, as `tensor_choices` took them), which a later compress
    reads to plan another size without measuring again."""
    chosen = allocate(choices, budget)
    planned = fixed + sum(c.nbytes for c in chosen.values())
    counts: dict[str, int] = {}
    for c in chosen.values():
        counts[choice_label(c)] = counts.get(choice_label(c), 0) + 1
    return {
        "planned_bytes": planned,
        "planned_bpw": round(planned * 8 / params, 4),
        "params": params,
        "schemes": {name: c.scheme for name, c in chosen.items()},
        "group_sizes": {name: c.group_size for name, c in chosen.items() if c.group_size},
        "counts": counts,
        "measure": MEASURE,
        "sensitivity": {name: {"schemes": [c.scheme for c in choices[name]],
                               "group_sizes": [c.group_size for c in choices[name]], "losses": list(ls)}
                        for name, ls in losses.items()},
    }


def choice_label(c: Choice) -> str:
    """A choice as the plan's counts name it: `int3/g128`, or the scheme alone when it is not group-wise."""
    return f"{c.scheme}/g{c.group_size}" if c.group_size else c.scheme


def plan_mixed(
    losses: dict[str, tuple[float, float]],
    shapes: dict[str, tuple[int, int]],
    base: Quantizer,
    high: Quantizer,
    budget: float,
) -> tuple[list[str], dict[str, Any]]:
    """Which tensors (`losses`: name -> (loss at `base`, loss at `high`)) to keep at `high` instead, by loss saved
    per extra byte, within `budget` x their bytes at `base`. Returns (chosen, report)."""
    choices = tensor_choices(losses, shapes, {name: (base, high) for name in losses})
    base_bytes = sum(cs[0].nbytes for cs in choices.values())
    picked = allocate(choices, int(base_bytes * (1 + budget)))
    chosen = [name for name, c in picked.items() if c.scheme == high.scheme]
    est_total = sum(cs[0].loss for cs in choices.values())
    est_after = sum(c.loss for c in picked.values())
    report = {
        "budget": budget,
        "extra_bytes": int(sum(c.nbytes for c in picked.values()) - base_bytes),
        "base_bytes": int(base_bytes),
        "promoted_to": high.scheme,
        "tensors": chosen,
        "measure": MEASURE,
        "estimated_loss_increase": {"all_base": round(est_total, 6), "mixed": round(est_after, 6)},
        "sensitivity": {name: round(cs[0].loss, 8) for name, cs in choices.items()},
    }
    return chosen, report
