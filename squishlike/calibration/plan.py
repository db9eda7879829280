"""The plan `compress` applies as it streams the tensors: what calibration decided, and how it is decided."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..compress_options import CompressOptions, choose_scheme, runtime_dtype, weight_kinds
from ..provider import WeightProvider
from ..quant.reference import from_float32, to_float32
from .awq import AWQ_GRID, ScaleGroup, Transform, scale_groups, search_awq
from .gptq import DAMPING, gptq, head_group, inverse_hessian_factor
from .mixed import FISHER_WINDOW, fisher_diagonal, plan_mixed
from .quantizer import Quantizer
from .stats import Calibration, calibration_windows, collect, log, source_model


@dataclass
class Plan:
    """What calibration decided, for `compress` to apply as it streams the tensors."""

    transform: Transform = field(default_factory=Transform)
    promote: dict[str, str] = field(default_factory=dict)  # name -> scheme
    reference_ppl: float | None = None
    record: dict[str, Any] = field(default_factory=dict)  # manifest keys
    runtime: str = "float32"  # the store's runtime dtype
    inputs: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)  # linear -> (its group, the group's
    # calibration inputs), for GPTQ
    quantizers: dict[str, Quantizer] = field(default_factory=dict)  # linear -> the store's quantizer, for GPTQ
    # The latest group's inverse-Hessian factor, shared by the linears that read one input (q, k, v; gate, up), which
    # compress reaches one after another. Only one is kept: a wide one (down's) is hundreds of MB.
    _factor: tuple[str, tuple[np.ndarray, np.ndarray]] | None = field(default=None, init=False, repr=False)

    def apply(self, name: str, array: np.ndarray, src_dtype: str) -> tuple[np.ndarray, str]:
        """The tensor as the store should hold it (float32 when rewritten), and its dtype name. A tensor kept
        exact by mixed precision is held in the runtime dtype: what the runtime sees, and what the budget counted."""
        if self.rewrites(name):
            array, src_dtype = self.transform.apply(name, to_float32(array, src_dtype)), "float32"
        if self.promote.get(name) == "passthrough" and src_dtype != self.runtime:
            array, src_dtype = from_float32(to_float32(array, src_dtype), self.runtime), self.runtime
        return array, src_dtype

    def quantize(self, name: str, array: np.ndarray, src_dtype: str, scheme: str) -> tuple[np.ndarray, ...] | None:
        """The parts of `name` (as `apply` returned it) quantized by GPTQ on its calibration inputs, when GPTQ was
        asked for and the tensor keeps the store's scheme; else None (compress rounds it to nearest)."""
        qz = self.quantizers.get(name)
        if qz is None or name not in self.inputs or scheme != qz.scheme:
            return None
        group, x = self.inputs[name]
        if self._factor is None or self._factor[0] != group:
            if name in self.transform.col:  # AWQ multiplied the weight's columns by s (the same for the whole
                x = x / self.transform.col[name][None, :]  # group): its inputs are divided by s
            self._factor = group, inverse_hessian_factor(x)
        return gptq(to_float32(array, src_dtype).reshape(array.shape[0], -1), qz, self._factor[1])

    def rewrites(self, name: str) -> bool:
        """Whether `apply` changes the values of `name` (AWQ scaling): a source's own quantized values then no
        longer hold them."""
        return self.transform.touches(name)

    def scheme(self, name: str, scheme: str, reason: str) -> tuple[str, str]:
        if scheme != "passthrough" and name in self.promote:
            kept = self.promote[name]
            what = "exact (runtime dtype)" if kept == "passthrough" else f"at {kept}"
            return kept, f"mixed precision: kept {what} (measured sensitivity)"
        return scheme, reason

    def manifest(self) -> dict[str, Any]:
        return dict(self.record)


class _SourceWeights:
    """The source model's weights as calibration reads them, and the quantizer the store will use for each."""

    def __init__(self, provider, model: nn.Module, opts: CompressOptions, runtime: str):
        self.provider, self.opts = provider, opts
        self.params = dict(tree_flatten(model.parameters()))
        self.kinds = weight_kinds(provider, model)
        self.base = Quantizer(opts.scheme, opts.groups, runtime, opts.clip_search)
        self.high = Quantizer("int8" if opts.format != "int8" else "passthrough", opts.groups, runtime)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.params[self.provider.mlx_name(name)].shape)

    def weight(self, name: str) -> np.ndarray:
        return np.array(self.params[self.provider.mlx_name(name)], dtype=np.float32)

    def quantizer_for(self, name: str) -> Quantizer | None:
        """The store's quantizer for canonical tensor `name`; None when compress will not quantize it."""
        scheme, _ = choose_scheme(name, self.shape(name), self.opts, self.kinds.get(name))
        return self.base if scheme == self.opts.scheme else None


def prepare(provider: WeightProvider, opts: CompressOptions) -> Plan:
    """The calibration plan for `compress` with options `opts`, for a compress that asks for one.

    Runs the source model once on the calibration text (the reference perplexity the INT3 gate uses), then what
    was asked: AWQ (`opts.awq`, any format), mixed precision (`opts.mixed_precision` > 0: INT4/INT3 stores
    promote to INT8, INT8 stores keep tensors exact).
    """
    started = time.perf_counter()
    plan = Plan(runtime=opts.dtype or runtime_dtype(provider))
    model, tokenizer = source_model(provider)
    source = _SourceWeights(provider, model, opts, plan.runtime)
    groups, why_not = scale_groups(model, provider) if opts.awq or opts.gptq else ([], None)
    head = head_group(provider) if opts.gptq else None
    log(f"running the source model in float32 on the calibration text ({provider.reader.path})")
    calib = collect(model, tokenizer, [*groups, *([head] if head else [])], samples=opts.calibration_samples, max_tokens=opts.calibration_max_tokens)
    plan.reference_ppl = calib.reference_ppl
    plan.record["calibration"] = {
        "text": calib.text,
        "tokens": calib.tokens,
        "reference_ppl": round(calib.reference_ppl, 6),
        "samples": opts.calibration_samples,
        "max_tokens": opts.calibration_max_tokens,
    }
    log(f"calibration pass: {calib.tokens} tokens, perplexity {calib.reference_ppl:.4f}, {calib.seconds:.1f} s")
    if opts.awq:
        plan.transform, plan.record["awq"] = _awq(groups, why_not, calib, source)
    if opts.gptq:
        plan.inputs, plan.quantizers, plan.record["gptq"] = _gptq(groups, why_not, head, calib, source)
    del calib
    if opts.mixed_precision > 0:
        plan.promote, plan.record["mixed_precision"] = _mixed(model, tokenizer, source, plan.transform)
    # Logged, not recorded: the manifest, like the tensors, is the same for the same source and options (an INT4
    # store is calibrated by default, and compress is reproducible).
    log(f"calibration: {time.perf_counter() - started:.1f} s")
    return plan


def _awq(groups: list[ScaleGroup], why_not: str | None, calib: Calibration,
         source: _SourceWeights) -> tuple[Transform, dict[str, Any]]:
    """The AWQ transform and its manifest record (not applied, and why, when the architecture has no groups)."""
    if why_not:
        warnings.warn(f"AWQ scaling skipped: {why_not}")
        return Transform(), {"applied": False, "reason": why_not}
    started = time.perf_counter()
    transform, report = search_awq(groups, calib, source.weight, source.quantizer_for)
    mean_alpha = np.mean([r["alpha"] for r in report.values()]) if report else 0.0
    log(f"AWQ search: {len(report)} groups, mean alpha {mean_alpha:.2f}, {time.perf_counter() - started:.1f} s")
    return transform, {
        "applied": True,
        "method": "per-input-channel s = mean|x|^alpha, alpha grid-searched per group on calibration "
        "output error; folded into RMSNorm weights, v rows (o) and up rows (down)",
        "grid": [*AWQ_GRID, "then best +- 0.05"],
        "groups": report,
    }


def _gptq(groups: list[ScaleGroup], why_not: str | None, head: ScaleGroup | None, calib: Calibration,
          source: _SourceWeights) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, Quantizer], dict[str, Any]]:
    """Each linear's calibration inputs and quantizer (the decoder's, and the output head's), for `Plan.quantize`,
    and the manifest record."""
    if why_not:
        warnings.warn(f"GPTQ of the decoder linears skipped: {why_not}")
        groups = []
    inputs, quantizers = {}, {}
    for g in [*groups, *([head] if head else [])]:
        for m in g.members:
            if (qz := source.quantizer_for(m)) is not None:
                inputs[m], quantizers[m] = (g.name, calib.samples[g.name]), qz
    return inputs, quantizers, {
        "applied": bool(inputs),
        "decoder_skipped": why_not,
        "method": f"GPTQ: columns rounded in order, each error spread by the inverse Hessian of the layer's "
        f"calibration inputs (damping {DAMPING} of its mean diagonal); grids are the store's own",
        "tensors": len(inputs),
        "samples": int(next(iter(calib.samples.values())).shape[0]) if calib.samples else 0,
    }


def _mixed(model: nn.Module, tokenizer, source: _SourceWeights,
           transform: Transform) -> tuple[dict[str, str], dict[str, Any]]:
    """The tensors mixed precision keeps at higher precision (name -> scheme), and its manifest record."""
    started = time.perf_counter()
    provider, opts, high = source.provider, source.opts, source.high
    names = [n for n in provider.names()
             if n.endswith(".weight") and source.quantizer_for(n) is not None and len(source.shape(n)) == 2]
    windows = calibration_windows(tokenizer, max_tokens=opts.calibration_max_tokens, window=FISHER_WINDOW)
    fisher = fisher_diagonal(model, windows, [provider.mlx_name(n) for n in names])
    chosen, report = plan_mixed(names, source.weight, transform, fisher, provider.mlx_name, source.base, high,
                                opts.mixed_precision)
    log(f"mixed precision: {len(chosen)} of {len(names)} tensors kept as {high.scheme} "
        f"(+{report['extra_bytes'] / 1e6:.2f} MB), {time.perf_counter() - started:.1f} s")
    return {n: high.scheme for n in chosen}, report
