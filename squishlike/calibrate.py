"""Calibration-driven quantization quality: activation statistics, AWQ-style scaling, mixed precision
chosen by measured sensitivity, and the INT3 accuracy gate (docs/format.md §6.4).

Everything here runs the *source* model in float32 on the shipped calibration text (`data/calibration.txt`, never
the evaluation prose) and turns what it measures into a `Plan` that `compress` applies tensor by tensor:

- Activation statistics (`collect`): every decoder layer's linear inputs are recorded through thin wrapper
  modules: the per-channel mean |x| over all calibration tokens, and up to `samples` evenly spaced input rows.
  The same forward pass also yields the reference perplexity on the calibration text that the INT3 gate uses.

- AWQ-style scaling (`search_awq`): for each group of linears that read the same input, a per-input-channel scale
  `s_j = mean|x_j|^alpha` (normalised so that sqrt(max * min) = 1) multiplies the weights' columns and is folded,
  divided out, into whatever produces that input, so the float model computes exactly the same function:

      group   scaled columns               folded into (divided by s)
      attn    q, k, v                      attention_norm weight (RMSNorm)
      o       attention.output             v rows (and v bias); GQA: s is shared by the query heads of a kv head
      mlp     ffn.gate, ffn.up             ffn_norm weight (RMSNorm)
      down    ffn.down                     ffn.up rows (and up bias)

  `alpha` is searched per group (0, 0.1, ..., 1, then +-0.05 around the best; 0 is round-to-nearest) to minimise the
  output error ||X W^T - X W_hat^T||^2 on the sampled calibration inputs, W_hat being the weight as the store
  will hold it (same scheme, group size, scale dtype and clip search, dequantized in the runtime dtype) with the
  scale divided back out. The store keeps the plain INT8/INT4/INT3 of docs/format.md §4 (scaled weights quantized
  as usual) and the folded norms as passthrough, so every tier, the 4-bit repack included, is unchanged.
  Architectures: the plain-RMSNorm decoder families (llama, mistral, qwen2, qwen3); others are compressed without
  scaling and the manifest says why.

- Mixed precision (`plan_mixed`): a diagonal-Fisher estimate of how much each linear's quantization error costs
  in calibration loss, `0.5 * sum F * (W - W_hat)^2` with F the sum over calibration windows of the squared
  gradient of the window's negative log-likelihood. The tensors whose higher-precision version saves the most
  estimated loss per extra byte are promoted, greedily, until the extra bytes reach `mixed_precision` x the bytes
  of the quantized tensors at the store's scheme: an INT4/INT3 store keeps them at INT8, an INT8 store keeps them
  exact (passthrough, in the runtime dtype, like the norms). Each chosen entry says so in its manifest "reason".

- The INT3 gate (`int3_gate`): the written (not yet published) store is loaded cold, and its perplexity on the
  calibration text is compared with the source's; `evaluate.passes_gate` decides with the bound
  `int3_max_ppl_increase` (default +8 %). The verdict goes into manifest["int3_gate"]; the int3 tier is built
  only when it passed.

All forward passes are float32 (`evaluate.prepare_for_eval`); on Linux CPU preload OpenBLAS for speed (the CLI
does, see `evaluate.reexec_with_openblas`). Cost on SmolLM2-135M, 2 shared cores: calibration pass ~35 s,
AWQ search ~30 s, Fisher pass ~1-2 min, gate ~35 s.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from . import evaluate as ev
from . import quant
from .quant.reference import from_float32, storage_dtype, to_float32

CALIBRATION_TEXT = "calibration"
CALIBRATION_WINDOW = ev.DEFAULT_WINDOW  # the gate's windows: the whole calibration text, 1024 tokens at a time
DEFAULT_SAMPLES = 512  # input rows kept per linear input for the AWQ error search
AWQ_GRID = tuple(i / 10 for i in range(11))  # alpha = 0 (round-to-nearest), 0.1, ..., 1; then best +- 0.05
FISHER_WINDOW = 256  # tokens per gradient sample for the Fisher estimate
AWQ_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _log(message: str) -> None:
    print(f"calibrate: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------
# The source model
# ----------------------------------------------------------------------------------------------------------


def source_model(provider) -> tuple[nn.Module, Any]:
    """The provider's model as mlx_lm builds it (what `squishlike.load` gives for a non-npy-dir source), in
    float32, and its tokenizer."""
    from .config import load_config
    from .model import build_model, build_tokenizer

    weights = {provider.mlx_name(n): provider.get(n) for n in provider.names()}
    with tempfile.TemporaryDirectory(prefix="squishlike-calib-") as side:
        provider.write_side_files(Path(side))
        config = load_config(Path(side))
        model = build_model(config, weights)
        tokenizer = build_tokenizer(Path(side), None, eos_token_ids=config.get("eos_token_id"))
    return ev.prepare_for_eval(model), tokenizer


def calibration_windows(tokenizer, text: str = CALIBRATION_TEXT, max_tokens: int | None = None) -> list[ev.Window]:
    """The token windows the gate's perplexity uses (`evaluate.text_perplexity` defaults)."""
    return ev.token_windows(tokenizer, ev.load_text(text), window=CALIBRATION_WINDOW, max_tokens=max_tokens)


# ----------------------------------------------------------------------------------------------------------
# Scale groups: which linears share an input, and where their scale folds
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleGroup:
    """Linears that read one input, and the tensors that produce it (where 1/s folds)."""

    name: str  # "layers.3.attn"
    kind: str  # attn | o | mlp | down
    layer: int
    module: str  # mlx module path whose input is recorded (the group's first linear)
    members: tuple[str, ...]  # canonical weights whose columns are multiplied by s
    folds: tuple[str, ...]  # canonical tensors divided by s: a norm weight, or rows (+ bias) of the producer
    tie: tuple[int, int, int] | None = None  # (n_heads, n_kv_heads, head_dim): o's scale shared per kv head


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


# ----------------------------------------------------------------------------------------------------------
# Activation statistics
# ----------------------------------------------------------------------------------------------------------


class _Sink:
    def __init__(self):
        self.abs_sum: mx.array | None = None
        self.count = 0
        self.rows: list[mx.array] = []
        self.pick: mx.array | None = None  # positions of the current window to keep

    def add(self, x: mx.array) -> None:
        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        total = mx.abs(flat).sum(axis=0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        self.count += flat.shape[0]
        if self.pick is not None:
            self.rows.append(flat[self.pick])

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.abs_sum, *self.rows[-1:]) if a is not None]


class _Recorder(nn.Module):
    """Wraps a linear; records its input into a sink, then calls it. Adds no parameters of its own."""

    def __init__(self, inner: nn.Module, sink: _Sink):
        super().__init__()
        self.inner = inner
        self._squish_sink = sink

    def __call__(self, x, *args, **kwargs):
        self._squish_sink.add(x)
        return self.inner(x, *args, **kwargs)


def _replace(model: nn.Module, path: str, new: nn.Module) -> nn.Module:
    parent_path, _, attr = path.rpartition(".")
    parent = dict(model.named_modules())[parent_path] if parent_path else model
    old = parent[attr] if isinstance(parent, dict) and attr in parent else getattr(parent, attr)
    setattr(parent, attr, new)
    return old


@dataclass
class Calibration:
    """What one float32 pass of the source model over the calibration text measured."""

    text: str
    tokens: int
    reference_ppl: float
    abs_mean: dict[str, np.ndarray]  # group name -> mean |x_j| over every calibration token
    samples: dict[str, np.ndarray]  # group name -> [n, in] float32 input rows, evenly spaced over the text
    seconds: float = 0.0


def collect(
    model: nn.Module,
    tokenizer,
    groups: Sequence[ScaleGroup],
    *,
    text: str = CALIBRATION_TEXT,
    samples: int = DEFAULT_SAMPLES,
    max_tokens: int | None = None,
) -> Calibration:
    """Run `model` (float32) over the calibration text; record each group's input statistics and the perplexity."""
    started = time.perf_counter()
    windows = calibration_windows(tokenizer, text, max_tokens)
    total = sum(len(w.tokens) - 1 for w in windows)
    stride = max(1, math.ceil(total / max(samples, 1)))
    sinks = {g.name: _Sink() for g in groups}
    originals = {}
    try:
        for g in groups:
            originals[g.module] = _replace(model, g.module, _Recorder(_module(model, g.module), sinks[g.name]))
        nll, count, offset = 0.0, 0, 0
        for window in windows:
            n_inputs = len(window.tokens) - 1
            first = (-offset) % stride
            pick = mx.array(np.arange(first, n_inputs, stride, dtype=np.int32))
            for sink in sinks.values():
                sink.pick = pick
            logprobs, targets = ev._window_logprobs(model, window)
            loss = ev._nll_sum(logprobs, targets)
            mx.eval(loss, *[a for s in sinks.values() for a in s.arrays()])
            nll += float(loss.item())
            count += window.n_scored
            offset += n_inputs
    finally:
        for path, original in originals.items():
            _replace(model, path, original)
    abs_mean = {k: np.array(s.abs_sum) / max(s.count, 1) for k, s in sinks.items()}
    rows = {k: np.concatenate([np.array(r) for r in s.rows], axis=0) for k, s in sinks.items()}
    return Calibration(text, total, math.exp(nll / count), abs_mean, rows, time.perf_counter() - started)


def _module(model: nn.Module, path: str) -> nn.Module:
    return dict(model.named_modules())[path]


# ----------------------------------------------------------------------------------------------------------
# Fake quantization: the weight as the store will hold it, back in float32
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quantizer:
    scheme: str  # int8 | int4 | int3 | passthrough (exact: the weight in the runtime dtype)
    group_size: int
    scale_dtype: str  # runtime dtype: INT4/INT3 scales and offsets, and passthrough weights, are stored in it
    clip_search: bool = False

    def __call__(self, w: np.ndarray) -> np.ndarray:
        """float32 [r, c] -> the dequantized stored form, float32 (values as the runtime dtype holds them)."""
        w = np.ascontiguousarray(w, dtype=np.float32)
        if self.scheme == "passthrough":
            return to_float32(from_float32(w, self.scale_dtype), self.scale_dtype)
        if self.scheme == "int8":
            q, s = quant.quantize_int8(w)
            out = quant.dequantize_int8(q, s, out_dtype=self.scale_dtype)
            return to_float32(out, self.scale_dtype)
        qf, df = (
            (quant.quantize_int4, quant.dequantize_int4)
            if self.scheme == "int4"
            else (quant.quantize_int3, quant.dequantize_int3)
        )
        q, s, z = qf(w, group_size=self.group_size, scale_dtype=self.scale_dtype, clip_search=self.clip_search)
        return df(q, s, z, group_size=self.group_size, scale_dtype=self.scale_dtype, out_dtype="float32")

    def nbytes(self, rows: int, cols: int) -> int:
        if self.scheme == "passthrough":
            return rows * cols * np.dtype(storage_dtype(self.scale_dtype)).itemsize
        if self.scheme == "int8":
            return rows * cols + 4 * rows
        per = 2 if self.scale_dtype != "float32" else 4
        bits = 4 if self.scheme == "int4" else 3
        return rows * cols * bits // 8 + 2 * per * rows * (cols // self.group_size)


# ----------------------------------------------------------------------------------------------------------
# AWQ scaling
# ----------------------------------------------------------------------------------------------------------


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


def _output_error(x: np.ndarray, w: np.ndarray, w_hat: np.ndarray) -> float:
    d = x @ (w - w_hat).T
    return float(np.einsum("ij,ij->", d, d, dtype=np.float64))


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


def search_awq(
    groups: Sequence[ScaleGroup],
    calib: Calibration,
    weight: Callable[[str], np.ndarray],
    quantizer_for: Callable[[str], Quantizer | None],
    grid: Sequence[float] = AWQ_GRID,
    refine: float = 0.05,
) -> tuple[Transform, dict[str, dict]]:
    """Per group, the alpha whose scaling gives the least output error on the calibration samples: the best of
    `grid` (whose first point must be 0, plain round-to-nearest), then of its neighbours at +- `refine`.

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
        ws = [weight(m) for m in g.members]
        x = calib.samples[g.name]
        errors: dict[float, float] = {}

        def try_alpha(alpha: float) -> None:
            s, _ = group_scales(g, calib.abs_mean[g.name], alpha)
            errors[alpha] = sum(_output_error(x, w, qz(w * s[None, :]) / s[None, :]) for w, qz in zip(ws, quantizers))

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


# ----------------------------------------------------------------------------------------------------------
# Sensitivity (diagonal Fisher) and mixed precision
# ----------------------------------------------------------------------------------------------------------


def fisher_diagonal(
    model: nn.Module,
    tokenizer,
    params: Sequence[str],
    *,
    text: str = CALIBRATION_TEXT,
    window: int = FISHER_WINDOW,
    max_tokens: int | None = None,
) -> dict[str, np.ndarray]:
    """sum over calibration windows of (d NLL_window / d W)^2 for the mlx parameters `params` (float32)."""
    windows = ev.token_windows(tokenizer, ev.load_text(text), window=window, max_tokens=max_tokens)
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


# ----------------------------------------------------------------------------------------------------------
# The plan compress applies
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What calibration decided, for `compress` to apply as it streams the tensors."""

    transform: Transform = field(default_factory=Transform)
    promote: dict[str, str] = field(default_factory=dict)  # name -> scheme
    reference_ppl: float | None = None
    record: dict[str, Any] = field(default_factory=dict)  # manifest keys
    runtime: str = "float32"  # the store's runtime dtype

    def apply(self, name: str, array: np.ndarray, src_dtype: str) -> tuple[np.ndarray, str]:
        """The tensor as the store should hold it (float32 when rewritten), and its dtype name. A tensor kept
        exact by mixed precision is held in the runtime dtype: what the runtime sees, and what the budget counted."""
        if self.transform.touches(name):
            array, src_dtype = self.transform.apply(name, to_float32(array, src_dtype)), "float32"
        if self.promote.get(name) == "passthrough" and src_dtype != self.runtime:
            array, src_dtype = from_float32(to_float32(array, src_dtype), self.runtime), self.runtime
        return array, src_dtype

    def scheme(self, name: str, scheme: str, reason: str) -> tuple[str, str]:
        if scheme != "passthrough" and name in self.promote:
            kept = self.promote[name]
            what = "exact (runtime dtype)" if kept == "passthrough" else f"at {kept}"
            return kept, f"mixed precision: kept {what} (measured sensitivity)"
        return scheme, reason

    def manifest(self) -> dict[str, Any]:
        return dict(self.record)


def prepare(provider, opts, choose_scheme: Callable[[str, tuple, Any], tuple[str, str]]) -> Plan | None:
    """The calibration plan for `compress` with options `opts` (CompressOptions), or None when it needs none.

    Runs the source model only for what was asked: AWQ (`opts.awq`, any format), mixed precision
    (`opts.mixed_precision` > 0: INT4/INT3 stores promote to INT8, INT8 stores keep tensors exact), the INT3
    gate's reference perplexity (format int3).
    `choose_scheme` is compress's own rule.
    """
    want_awq = bool(opts.awq)
    want_mixed = opts.mixed_precision > 0
    want_gate = opts.format == "int3" and opts.int3_gate
    if not (want_awq or want_mixed or want_gate):
        return None
    started = time.perf_counter()
    runtime = opts.dtype or _runtime_dtype(provider)
    base = Quantizer(opts.format, opts.group_size, runtime, opts.clip_search)
    high = Quantizer("int8" if opts.format != "int8" else "passthrough", opts.group_size, runtime)
    model, tokenizer = source_model(provider)
    params = dict(tree_flatten(model.parameters()))

    def weight(name: str) -> np.ndarray:
        return np.array(params[provider.mlx_name(name)], dtype=np.float32)

    def quantizer_for(name: str) -> Quantizer | None:
        scheme, _ = choose_scheme(name, tuple(params[provider.mlx_name(name)].shape), opts)
        return base if scheme == opts.format else None

    plan = Plan(runtime=runtime)
    groups, why_not = scale_groups(model, provider) if want_awq else ([], None)
    _log(f"running the source model in float32 on the calibration text ({provider.reader.path})")
    calib = collect(model, tokenizer, groups, samples=opts.calibration_samples, max_tokens=opts.calibration_max_tokens)
    plan.reference_ppl = calib.reference_ppl
    plan.record["calibration"] = {
        "text": calib.text,
        "tokens": calib.tokens,
        "reference_ppl": round(calib.reference_ppl, 6),
        "samples": opts.calibration_samples,
        "max_tokens": opts.calibration_max_tokens,
    }
    _log(f"calibration pass: {calib.tokens} tokens, perplexity {calib.reference_ppl:.4f}, {calib.seconds:.1f} s")
    if want_awq:
        if why_not:
            warnings.warn(f"AWQ scaling skipped: {why_not}")
            plan.record["awq"] = {"applied": False, "reason": why_not}
        else:
            t0 = time.perf_counter()
            plan.transform, report = search_awq(groups, calib, weight, quantizer_for)
            plan.record["awq"] = {
                "applied": True,
                "method": "per-input-channel s = mean|x|^alpha, alpha grid-searched per group on calibration "
                "output error; folded into RMSNorm weights, v rows (o) and up rows (down)",
                "grid": [*AWQ_GRID, "then best +- 0.05"],
                "groups": report,
            }
            mean_alpha = np.mean([r["alpha"] for r in report.values()]) if report else 0.0
            _log(f"AWQ search: {len(report)} groups, mean alpha {mean_alpha:.2f}, {time.perf_counter() - t0:.1f} s")
    del calib
    if want_mixed:
        t0 = time.perf_counter()
        names = [n for n in provider.names() if n.endswith(".weight") and quantizer_for(n) is not None]
        names = [n for n in names if len(params[provider.mlx_name(n)].shape) == 2]
        fisher = fisher_diagonal(
            model, tokenizer, [provider.mlx_name(n) for n in names], max_tokens=opts.calibration_max_tokens
        )
        chosen, report = plan_mixed(
            names, weight, plan.transform, fisher, provider.mlx_name, base, high, opts.mixed_precision
        )
        plan.promote = {n: high.scheme for n in chosen}
        plan.record["mixed_precision"] = report
        _log(f"mixed precision: {len(chosen)} of {len(names)} tensors kept as {high.scheme} "
             f"(+{report['extra_bytes'] / 1e6:.2f} MB), {time.perf_counter() - t0:.1f} s")
    plan.record.setdefault("calibration", {})["seconds"] = round(time.perf_counter() - started, 1)
    return plan


def _runtime_dtype(provider) -> str:
    from .compressor import runtime_dtype

    return runtime_dtype(provider)


# ----------------------------------------------------------------------------------------------------------
# The INT3 gate
# ----------------------------------------------------------------------------------------------------------


def int3_gate(provider, store_dir: Path, opts, plan: Plan | None) -> dict[str, Any]:
    """Perplexity of the written 3-bit store (loaded cold) and of the source on the calibration text; the verdict.

    Returns the manifest's "int3_gate" record: passed, candidate_ppl, reference_ppl, increase, bound, text,
    tokens, reason. A gate that cannot run (an architecture mlx_lm cannot build, ...) does not pass.
    """
    from .loader import load

    bound = float(opts.int3_max_ppl_increase)
    record: dict[str, Any] = {"passed": False, "bound": bound, "text": CALIBRATION_TEXT}
    if not opts.int3_gate:
        record["reason"] = "the INT3 accuracy gate was skipped (int3_gate=False)"
        return record
    try:
        started = time.perf_counter()
        reference_ppl = plan.reference_ppl if plan is not None else None
        if reference_ppl is None:
            model, tokenizer = source_model(provider)
            reference_ppl = ev.perplexity(model, calibration_windows(tokenizer, max_tokens=opts.calibration_max_tokens))
            del model
        candidate, tokenizer = load(store_dir, tier="cold")
        candidate = ev.prepare_for_eval(candidate)
        windows = calibration_windows(tokenizer, max_tokens=opts.calibration_max_tokens)
        candidate_ppl = ev.perplexity(candidate, windows)
        del candidate
    except Exception as e:  # noqa: BLE001 - the store is fine; only the gate could not decide
        record["reason"] = f"the INT3 accuracy gate could not run: {type(e).__name__}: {e}"
        return record
    increase = candidate_ppl / reference_ppl - 1.0
    passed = ev.passes_gate(candidate_ppl, reference_ppl, bound)
    verdict = "within" if passed else "over"
    record.update(
        passed=passed,
        candidate_ppl=round(candidate_ppl, 6),
        reference_ppl=round(reference_ppl, 6),
        increase=round(increase, 6),
        tokens=sum(w.n_scored for w in windows),
        seconds=round(time.perf_counter() - started, 1),
        reason=f"3-bit perplexity on the calibration text {candidate_ppl:.4f} is {increase:+.2%} against the "
        f"reference {reference_ppl:.4f}: {verdict} the bound of {bound:+.0%}",
    )
    _log(f"INT3 gate: {'passed' if passed else 'failed'}: {record['reason']}")
    return record


def write_int3_gate(provider, store_dir: Path, opts, plan: Plan | None) -> dict[str, Any]:
    """Run the gate on the unpublished store at `store_dir` and record it as manifest["int3_gate"] (atomically,
    through io.atomic.write_json, before compress publishes the directory)."""
    from .io.atomic import read_json, write_json
    from .npydir import MANIFEST

    record = int3_gate(provider, Path(store_dir), opts, plan)
    manifest = read_json(Path(store_dir) / MANIFEST)
    manifest["int3_gate"] = record
    write_json(Path(store_dir) / MANIFEST, manifest)
    return record
