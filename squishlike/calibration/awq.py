"""AWQ-style scaling: where the scale of linears that share an input folds, found from the model (`fold_groups`),
and the per-group search of the scale exponent on the calibration samples (`search_awq`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .blocks import BlockRunner, module_at
from .linears import probe
from .products import output_error
from .quantizer import Quantizer
from .stats import Calibration, ScaleGroup

AWQ_GRID = tuple(i / 10 for i in range(11))  # alpha = 0 (round-to-nearest), 0.1, ..., 1; then best +- 0.05
# Calibration rows the search measures each alpha's output error on (evenly spaced among the collected samples).
# The search only ranks alphas: on SmolLM2 128 rows choose as well as 512 at a quarter of the products.
AWQ_SEARCH_ROWS = 128
# Output rows of each member weight the trials round (evenly spaced): rows are rounded on their own, so fewer rows
# estimate the same error. A 1.5B's gate and up have 8,960 rows each, SmolLM2's 1,536; with 512, SmolLM2's default
# INT4 store measured KL 0.1817 against 0.1881 with every row (1,024 tokens; mlx_lm 4-bit: 0.4185), in less time.
AWQ_WEIGHT_ROWS = 512
FOLD_TOLERANCE = 1e-4  # a fold is exact when the block's output moves by at most this, relative to its largest


def fold_groups(runner: BlockRunner, i: int, canonical: dict[str, str], readers: Sequence[ScaleGroup], config,
                verified: dict) -> tuple[list[ScaleGroup], dict[str, str]]:
    """AWQ's groups of block `i` (loaded): each group of linears that read one input (`readers`, from
    linears.input_groups) with the tensors 1/s folds into, where a fold leaves the block's function exactly as it
    was: the norm whose output that input is (its weight, and bias; a norm that scales by 1 + w, Gemma's, folds as
    (1 + w) / s - 1), or the rows of the linear whose output reaches it through attention or the MLP's gate
    (v -> o, one scale per kv head under GQA; up -> down). Nothing is assumed from names: each candidate fold is
    tried on the block with random scales and kept when the block's output does not move (`verified` keeps each
    verdict for blocks of the same structure). Returns the groups, and {reader group: why 1/s folds nowhere}."""
    prefix = runner.slots[i].prefix
    mlx_of = {c: m.removesuffix(".weight") for m, c in canonical.items()}
    norms = [prefix + path for path, m in runner.block(i).named_modules() if norm_like(m)]
    linears = {prefix + path: m for path, m in runner.block(i).named_modules() if type(m) is nn.Linear}
    candidates = [g for g in readers if g.kind == "linears"]
    probes, _ = probe(runner, i, [*norms, *(g.module for g in candidates)])
    made_by = {id(p._squish_outputs[0]): path for path, p in probes.items()
               if path in norms and len(p._squish_outputs) == 1}
    not_scaled = {"experts": "an expert stack: not scaled", "heads": "a per-head stack: not scaled"}
    groups, why_not = [], {_name(g): not_scaled[g.kind] for g in readers if g.kind != "linears"}
    for g in candidates:
        members = [mlx_of[m] for m in g.members]
        reads = probes[g.module]._squish_inputs[0]
        width = reads.shape[-1]
        if id(reads) in made_by:
            options = [(made_by[id(reads)], None, None)]
        else:  # the output of attention or of a product: rows of a linear (or a slice of a fused one's rows) in
            # the same module (attention's v for o, the MLP's up for down): a layer's every linear would cost a
            # trial run each (rwkv7's dozens)
            parent = g.module.rpartition(".")[0]
            options = [option for path, m in linears.items() if path not in members
                       and path.rpartition(".")[0] == parent
                       for option in _row_folds(path, m.weight.shape[0], width, config)]
        found = next((o for o in options if _exact(runner, i, members, *o, verified)), None)
        if found is None:
            why_not[_name(g)] = "no module whose output it reads takes 1/s exactly"
            continue
        path, tie, rows = found
        module = module_at(runner.model, path)
        folds = tuple(canonical[f"{path}.{k}"] for k in ("weight", "bias") if f"{path}.{k}" in canonical)
        norm = path in norms
        groups.append(ScaleGroup(_name(g), "norm" if norm else "rows", i, g.module,
                                 g.members, folds, tie, offset=weight_offset(module) if norm else 0.0,
                                 fold_rows=rows))
    return groups, why_not


def _name(readers: ScaleGroup) -> str:
    """An AWQ group's name: its first linear's ("layers.3.attention.q")."""
    return readers.members[0].removesuffix(".weight")


def norm_like(module: nn.Module) -> bool:
    """Whether `module` scales by a 1-D weight of its own (a norm), not a linear or embedding."""
    weight = module.get("weight")
    return (isinstance(weight, mx.array) and weight.ndim == 1
            and not isinstance(module, (nn.Linear, nn.Embedding, nn.QuantizedLinear)))


def outside_norms(runner: BlockRunner) -> list[str]:
    """The model's norms outside its layers (mlx paths): the final norm the head reads, where there is one."""
    prefixes = tuple(s.prefix for s in runner.slots)
    return [p for p, m in runner.model.named_modules() if norm_like(m) and not (p + ".").startswith(prefixes)]


def _row_folds(path: str, rows: int, width: int, config) -> list[tuple[str, tuple | None, tuple | None]]:
    """The folds into the rows of linear `path` (`rows` rows) that could feed an input `width` wide: one row per
    column, or, under GQA, one row per kv head's column (each read by heads / kv query heads), at each offset of
    a fused projection's rows (phi3's qkv_proj, gate_up_proj): (path, tie, (first row, rows) or None)."""
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    ties: dict[int, tuple | None] = {width: None}
    if heads and kv and heads % kv == 0 and heads != kv and width % heads == 0:
        ties[width * kv // heads] = (heads, kv, width // heads)
    return [(path, tie, None if n == rows else (first, rows)) for n, tie in ties.items() if rows % n == 0
            for first in range(0, rows, n)]


def weight_offset(norm: nn.Module) -> float:
    """The offset o of a norm that computes normalized(x) * (weight + o) (+ bias): 0 for most, 1 for Gemma's."""
    saved = {k: norm[k] for k in ("weight", "bias") if k in norm}
    x = mx.random.normal((4, norm.weight.shape[0]), key=mx.random.key(0))
    try:
        if "bias" in saved:
            norm.bias = mx.zeros_like(saved["bias"])
        norm.weight = mx.zeros_like(saved["weight"])
        at_zero = norm(x)
        norm.weight = mx.ones_like(saved["weight"])
        unit = norm(x) - at_zero  # normalized(x)
    finally:
        norm.update(saved)
    return round(mx.sum(at_zero * unit).item() / max(mx.sum(unit * unit).item(), 1e-30), 6)


def _exact(runner: BlockRunner, i: int, members: list[str], producer: str, tie, rows, verified: dict) -> bool:
    """Whether folding 1/s into `producer` (a norm, or a linear's rows, or a slice of them, `rows`, tied by `tie`)
    and s into the columns of `members` (mlx module paths) leaves block `i`'s output as it was, for random s."""
    prefix = runner.slots[i].prefix
    key = (type(runner.block(i)).__name__, tuple(m.removeprefix(prefix) for m in members),
           producer.removeprefix(prefix), tie, rows)
    if key not in verified:
        verified[key] = _try_fold(runner, i, members, producer, tie, rows)
    return verified[key]


def _try_fold(runner: BlockRunner, i: int, members: list[str], producer: str, tie, rows) -> bool:
    readers = [module_at(runner.model, m) for m in members]
    fold = module_at(runner.model, producer)
    width = readers[0].weight.shape[-1]
    n = width if tie is None else width * tie[1] // tie[0]
    s = mx.exp(mx.random.uniform(-0.7, 0.7, (n,), key=mx.random.key(1)))
    cols = s if tie is None else mx.repeat(s.reshape(tie[1], 1, tie[2]), tie[0] // tie[1], axis=1).reshape(-1)
    if rows is not None:  # a slice of a fused producer's rows: the others keep their scale
        s = mx.concatenate([mx.ones(rows[0]), s, mx.ones(rows[1] - rows[0] - n)])
    saved = [(m, {"weight": m.weight}) for m in readers]
    saved.append((fold, {k: fold[k] for k in ("weight", "bias") if k in fold}))
    before = runner.forward(i, 0, runner.hidden[0])
    runner.evaluate(i, [before])
    try:
        for m in readers:
            m.weight = m.weight * cols[None, :]
        if fold.weight.ndim == 1:  # a norm
            offset = weight_offset(fold)
            fold.weight = (fold.weight + offset) / s - offset
        else:
            fold.weight = fold.weight / s[:, None]
        if "bias" in fold:
            fold.bias = fold.bias / s
        after = runner.forward(i, 0, runner.hidden[0])
        runner.evaluate(i, [after])
    except (ValueError, TypeError):  # shapes that do not fit: no fold
        return False
    finally:
        for m, params in saved:
            m.update(params)
    return relative_change(after, before) <= FOLD_TOLERANCE


def relative_change(after: mx.array, before: mx.array) -> float:
    """The largest change from `before` to `after`, relative to `before`'s largest value."""
    return mx.abs(after - before).max().item() / max(mx.abs(before).max().item(), 1e-30)


@dataclass
class Transform:
    """Per-tensor exact float rewrites: multiply columns (`col`), divide rows or 1-D values (`row`)."""

    col: dict[str, np.ndarray] = field(default_factory=dict)
    row: dict[str, np.ndarray] = field(default_factory=dict)
    offset: dict[str, float] = field(default_factory=dict)  # a norm weight w that scales by (w + offset): its
    # row division is (w + offset) / r - offset

    def touches(self, name: str) -> bool:
        return name in self.col or name in self.row

    def update(self, other: Transform) -> None:
        """Take `other`'s rewrites, every kind of them (another block's: of other tensors)."""
        for f in fields(self):
            getattr(self, f.name).update(getattr(other, f.name))

    def apply(self, name: str, w: np.ndarray) -> np.ndarray:
        """`w` (float32) rewritten; a new float32 array."""
        w = np.asarray(w, dtype=np.float32)
        if name in self.row:
            r, offset = self.row[name], self.offset.get(name, 0.0)
            w = (w + offset) / (r[:, None] if w.ndim == 2 else r) - offset
        if name in self.col:
            w = w * self.col[name][None, :]
        return np.ascontiguousarray(w, dtype=np.float32)

    def error_back(self, name: str, e: np.ndarray) -> np.ndarray:
        """An error in the rewritten tensor's space, expressed in the original tensor's space."""
        if name in self.row:
            e = e * self.row[name][:, None]
        if name in self.col:
            e = e / self.col[name][None, :]
        return e


def _normalised(a: np.ndarray, alpha: float) -> np.ndarray:
    s = np.power(np.maximum(a.astype(np.float64), 1e-6), alpha)
    s = s / math.sqrt(s.max() * s.min())
    return s.astype(np.float32)


def group_scales(g: ScaleGroup, abs_mean: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray] | None:
    """(column scale of the group's members, divisor of its folds) for `alpha`; None when no exact fold exists.

    s = mean|x|^alpha normalised so that sqrt(max * min) = 1. For o under GQA the statistic is first averaged over
    the query heads that read one kv head, so that one v row's divisor matches every o column it feeds.
    """
    a = abs_mean
    if g.tie is not None:
        heads, kv, hd = g.tie
        if a.shape[0] != heads * hd or heads % kv:
            return None
        a = a.reshape(kv, heads // kv, hd).mean(axis=1).reshape(-1)  # query head h reads kv head h // (heads/kv)
    s = _normalised(a, alpha)
    if g.tie is None:
        return s, s
    heads, kv, hd = g.tie
    return np.repeat(s.reshape(kv, 1, hd), heads // kv, axis=1).reshape(-1), s


def add_scales(transform: Transform, g: ScaleGroup, scales: tuple[np.ndarray, np.ndarray]) -> None:
    """Record group `g`'s scaling in `transform` (composing with what is there: v and up are in two groups)."""
    cols, fold = scales
    if g.fold_rows is not None:  # a slice of a fused producer's rows
        first, rows = g.fold_rows
        fold = np.concatenate([np.ones(first, np.float32), fold, np.ones(rows - first - len(fold), np.float32)])
    for m in g.members:
        transform.col[m] = cols if m not in transform.col else transform.col[m] * cols
    for f in g.folds:
        transform.row[f] = fold if f not in transform.row else transform.row[f] * fold
    if g.offset:
        transform.offset[g.folds[0]] = g.offset


def _rows(w: np.ndarray, most: int) -> np.ndarray:
    return w if len(w) <= most else w[np.linspace(0, len(w) - 1, most).astype(np.int64)]


def search_awq(
    groups: Sequence[ScaleGroup],
    calib: Calibration,
    weight: Callable[[str], np.ndarray],
    quantizer_for: Callable[[str], Quantizer | None],
    grid: Sequence[float] = AWQ_GRID,
    refine: float = 0.05,
    rows: int = AWQ_SEARCH_ROWS,
) -> tuple[Transform, dict[str, dict]]:
    """Per group, the alpha whose scaling gives the least output error on `rows` of the calibration samples: the
    best of `grid` (whose first point must be 0, plain round-to-nearest), then of its neighbours at +- `refine`.

    `weight(name)` gives a canonical tensor as float32; `quantizer_for(name)` the quantizer the store will use
    for it (None: it will not be quantized). Groups with a member that will not be quantized are left alone.
    Returns the transform and, per group, {"alpha", "error_ratio" (best / alpha 0)}.
    """
    transform = Transform()
    report: dict[str, dict] = {}
    for g in groups:
        quantizers = [quantizer_for(m) for m in g.members]
        if any(q is None for q in quantizers) or group_scales(g, calib.abs_mean[g.name], 0.0) is None:
            continue
        ws = [mx.array(_rows(weight(m), AWQ_WEIGHT_ROWS)) for m in g.members]
        x = calib.samples[g.name]
        x = mx.array(x[np.linspace(0, len(x) - 1, min(rows, len(x))).astype(np.int64)])
        errors: dict[float, float] = {}

        def try_alpha(alpha: float) -> None:
            s = mx.array(group_scales(g, calib.abs_mean[g.name], alpha)[0])[None, :]
            change = mx.concatenate([w - qz.on_device(w * s) / s for w, qz in zip(ws, quantizers)])
            errors[alpha] = output_error(x, change)

        for alpha in grid:
            try_alpha(float(alpha))
        coarse = min(errors, key=errors.get)
        for alpha in (coarse - refine, coarse + refine):  # then the midpoints beside the best coarse point
            if refine and 0 < alpha < 1:
                try_alpha(round(alpha, 4))
        alpha = min(errors, key=errors.get)
        base = errors[float(grid[0])]
        report[g.name] = {"alpha": alpha, "error_ratio": round(errors[alpha] / base, 4) if base else 1.0}
        if alpha != 0.0:
            add_scales(transform, g, group_scales(g, calib.abs_mean[g.name], alpha))
    return transform, report
