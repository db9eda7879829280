"""AWQ-style scaling: which linears share an input and where their scale folds (`scale_groups`), and the
per-group search of the scale exponent on the calibration samples (`search_awq`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

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
AWQ_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _norm_is_plain_rms(model: nn.Module, mlx_name: str) -> bool:
    module = dict(model.named_modules()).get(mlx_name.removesuffix(".weight"))
    return type(module) is nn.RMSNorm


def scale_groups(model: nn.Module, provider) -> tuple[list[ScaleGroup], str | None]:
    """The AWQ groups of a decoder model, or ([], why not) when its architecture is not supported."""
    config = provider.config
    if config.model_type not in AWQ_MODEL_TYPES:
        return [], f"model type {config.model_type!r} is not one AWQ scaling supports ({', '.join(AWQ_MODEL_TYPES)})"
    heads, kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = config.head_dim or config.hidden_size // heads
    groups = []
    for n in range(config.num_hidden_layers):
        p = f"layers.{n}."
        a, f = p + "attention.", p + "ffn."
        specs = [
            ("attn", (a + "q.weight", a + "k.weight", a + "v.weight"), (p + "attention_norm.weight",), None),
            ("o", (a + "output.weight",), (a + "v.weight", a + "v.bias"), (heads, kv, head_dim)),
            ("mlp", (f + "gate.weight", f + "up.weight"), (p + "ffn_norm.weight",), None),
            ("down", (f + "down.weight",), (f + "up.weight", f + "up.bias"), None),
        ]
        for kind, members, folds, tie in specs:
            if not all(provider.has(m) for m in members):
                return [], f"layer {n} has no {kind} group ({', '.join(members)})"
            folds = tuple(x for x in folds if provider.has(x))
            if kind in ("attn", "mlp") and not _norm_is_plain_rms(model, provider.mlx_name(folds[0])):
                return [], f"{folds[0]} is not a plain RMSNorm; folding a scale into it would not be exact"
            module = provider.mlx_name(members[0]).removesuffix(".weight")
            groups.append(ScaleGroup(f"{p}{kind}", kind, n, module, members, folds, tie))
    return groups, None


@dataclass
class Transform:
    """Per-tensor exact float rewrites: multiply columns (`col`), divide rows or 1-D values (`row`)."""

    col: dict[str, np.ndarray] = field(default_factory=dict)
    row: dict[str, np.ndarray] = field(default_factory=dict)

    def touches(self, name: str) -> bool:
        return name in self.col or name in self.row

    def apply(self, name: str, w: np.ndarray) -> np.ndarray:
        """`w` (float32) rewritten; a new float32 array."""
        w = np.asarray(w, dtype=np.float32)
        if name in self.row:
            r = self.row[name]
            w = w / (r[:, None] if w.ndim == 2 else r)
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
    for m in g.members:
        transform.col[m] = cols if m not in transform.col else transform.col[m] * cols
    for f in g.folds:
        transform.row[f] = fold if f not in transform.row else transform.row[f] * fold


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
