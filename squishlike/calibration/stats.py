"""What calibration measures of a block's inputs as the block runs: for every scale group (the linears that read
one input), mean |x| per channel and evenly spaced sample rows."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..evaluation import DEFAULT_WINDOW, Window, load_text, token_windows
from .blocks import BlockRunner, module_at

CALIBRATION_TEXT = "calibration"
CALIBRATION_WINDOW = DEFAULT_WINDOW  # the gate's windows: the whole calibration text, 1024 tokens at a time


def log(message: str) -> None:
    print(f"calibrate: {message}", file=sys.stderr, flush=True)


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
        return [a for a in (self.abs_sum, *self.rows) if a is not None]


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
    parent = module_at(model, parent_path)
    old = parent[attr] if isinstance(parent, dict) and attr in parent else getattr(parent, attr)
    setattr(parent, attr, new)
    return old


@dataclass
class Calibration:
    """What one block's float32 pass over the calibration text measured of its groups' inputs."""

    abs_mean: dict[str, np.ndarray]  # group name -> mean |x_j| over every calibration token
    samples: dict[str, np.ndarray]  # group name -> [n, in] float32 input rows, evenly spaced over the text


def positions(windows: Sequence[Window]) -> int:
    """The input positions of the calibration text: each window's tokens but its last (whose next token is
    unknown)."""
    return sum(len(w.tokens) - 1 for w in windows)


def _stride(windows: Sequence[Window], samples: int) -> int:
    """The spacing of `samples` rows evenly spread over the whole text's positions."""
    return max(1, math.ceil(positions(windows) / max(samples, 1)))


def sample_positions(windows: Sequence[Window], samples: int) -> list[mx.array]:
    """Per window, the input positions whose rows are kept: `samples` rows evenly spaced over the whole text."""
    stride = _stride(windows, samples)
    picks, offset = [], 0
    for w in windows:
        n = len(w.tokens) - 1
        picks.append(mx.array(np.arange((-offset) % stride, n, stride, dtype=np.int32)))
        offset += n
    return picks


def thinned(calib: Calibration, windows: Sequence[Window], samples: int) -> Calibration:
    """`calib`, recorded at every position, with only the rows `sample_positions(windows, samples)` keeps: those
    are every stride-th position of the whole text, as the rows are."""
    stride = _stride(windows, samples)
    return Calibration(calib.abs_mean, {name: rows[::stride] for name, rows in calib.samples.items()})


def record(runner: BlockRunner, block: int, groups: Sequence[ScaleGroup], picks: Sequence[mx.array],
           hidden: Sequence[mx.array] | None = None) -> tuple[Calibration, list[mx.array]]:
    """Run block `block` (loaded) on the windows' hidden states, recording each group's input statistics: what
    the groups measured, and the block's outputs. The windows run side by side (`BlockRunner.forward`)."""
    sinks = {g.name: _Sink() for g in groups}
    originals = []  # (path, what was there): groups may record one module (mixed precision's one-linear groups and
    # AWQ's q, k, v group read q's input), whose recorders then wrap each other and must come off in reverse
    try:
        for g in groups:
            recorder = _Recorder(module_at(runner.model, g.module), sinks[g.name], g.records_output)
            originals.append((g.module, _replace(runner.model, g.module, recorder)))
        outputs = []
        for w, (h, pick) in enumerate(zip(runner.hidden if hidden is None else hidden, picks)):
            for sink in sinks.values():
                sink.pick = pick
            outputs.append(runner.forward(block, w, h))
        runner.evaluate(block, [*outputs, *(a for s in sinks.values() for a in s.arrays())])
    finally:
        for path, original in reversed(originals):
            _replace(runner.model, path, original)
    return _measured(sinks), outputs


def record_output(x: Sequence[mx.array], group: ScaleGroup, picks: Sequence[mx.array]) -> Calibration:
    """A group's statistics from inputs computed outside any block (the head's: the final norm's outputs)."""
    sink = _Sink()
    for h, pick in zip(x, picks):
        sink.pick = pick
        sink.add(h)
    mx.eval(*sink.arrays())
    return _measured({group.name: sink})


def _measured(sinks: dict[str, _Sink]) -> Calibration:
    abs_mean = {k: np.array(s.abs_sum) / max(s.count, 1) for k, s in sinks.items()}
    rows = {k: np.concatenate([np.array(r) for r in s.rows], axis=0) for k, s in sinks.items()}
    return Calibration(abs_mean, rows)

