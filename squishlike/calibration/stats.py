"""The source model in float32 and one pass of it over the calibration text: the perplexity there, and the
statistics of every scale group's input (a group: the linears that read one input): mean |x| per channel and
evenly spaced sample rows."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..evaluation import (
    DEFAULT_WINDOW,
    Window,
    load_text,
    nll_sum,
    prepare_for_eval,
    token_windows,
    window_logprobs,
)
from ..provider import WeightProvider

CALIBRATION_TEXT = "calibration"
CALIBRATION_WINDOW = DEFAULT_WINDOW  # the gate's windows: the whole calibration text, 1024 tokens at a time
DEFAULT_SAMPLES = 512  # input rows kept per linear input for the AWQ error search


def log(message: str) -> None:
    print(f"calibrate: {message}", file=sys.stderr, flush=True)


def source_model(provider: WeightProvider) -> tuple[nn.Module, Any]:
    """The provider's model as mlx_lm builds it (what `squishlike.load` gives for a non-npy-dir source), in
    float32, and its tokenizer."""
    model, tokenizer, _ = provider.build_model()
    return prepare_for_eval(model), tokenizer


def calibration_windows(tokenizer, text: str = CALIBRATION_TEXT, max_tokens: int | None = None,
                        window: int = CALIBRATION_WINDOW) -> list[Window]:
    """The calibration text in token windows; by default those the gate's perplexity uses
    (`evaluation.text_perplexity`'s)."""
    return token_windows(tokenizer, load_text(text), window=window, max_tokens=max_tokens)


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
    records_output: bool = False  # record `module`'s output, not its input (the final norm, for a tied head)


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
    """Wraps a module; records its input (or its output) into a sink. Adds no parameters of its own."""

    def __init__(self, inner: nn.Module, sink: _Sink, output: bool):
        super().__init__()
        self.inner = inner
        self._squish_sink = sink
        self._squish_output = output

    def __call__(self, x, *args, **kwargs):
        if not self._squish_output:
            self._squish_sink.add(x)
        y = self.inner(x, *args, **kwargs)
        if self._squish_output:
            self._squish_sink.add(y)
        return y


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
            originals[g.module] = _replace(model, g.module, _Recorder(_module(model, g.module), sinks[g.name],
                                                                       g.records_output))
        nll, count, offset = 0.0, 0, 0
        for window in windows:
            n_inputs = len(window.tokens) - 1
            first = (-offset) % stride
            pick = mx.array(np.arange(first, n_inputs, stride, dtype=np.int32))
            for sink in sinks.values():
                sink.pick = pick
            logprobs, targets = window_logprobs(model, window)
            loss = nll_sum(logprobs, targets)
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
