"""What calibration measures of a block's inputs as the block runs: for every scale group (the linears that read
one input), mean |x| per channel and evenly spaced sample rows."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..evaluation import DEFAULT_WINDOW, Window, load_text, token_windows
from ..errors import UnsupportedArchitectureError
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
    kind: str  # AWQ's attn | o | mlp | down; "linears", "experts" (an expert stack) or "heads" (a per-head stack
    # whose heads read one input) for GPTQ's input groups
    layer: int
    module: str  # mlx module path whose input is recorded (the group's first linear)
    members: tuple[str, ...]  # canonical weights whose columns are multiplied by s
    folds: tuple[str, ...]  # canonical tensors divided by s: a norm weight, or rows (+ bias) of the producer
    tie: tuple[int, int, int] | None = None  # (n_heads, n_kv_heads, head_dim): o's scale shared per kv head
    offset: float = 0.0  # the fold is a norm computing normalized * (weight + offset): Gemma's 1
    fold_rows: tuple[int, int] | None = None  # (first row, rows): 1/s folds into a slice of a fused producer's rows


class _Sink:
    def __init__(self):
        self.abs_sum: mx.array | None = None
        self.count = 0
        self.rows: list[mx.array] = []
        self.pick: mx.array | None = None  # positions of the current window to keep

    def add(self, x: mx.array, *_, **__) -> None:
        flat = self._sum(x)
        if self.pick is not None:
            self.rows.append(flat[self.pick])

    def _sum(self, x: mx.array) -> mx.array:
        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        total = mx.abs(flat).sum(axis=0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        self.count += flat.shape[0]
        return flat

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.abs_sum, *self.rows) if a is not None]


class _ExpertSink(_Sink):
    """An expert stack's input (`SwitchLinear(x, indices)`): every routed row, each with the expert it went to.
    All rows are kept, whatever `pick` says: a sorted dispatch (mlx_lm sorts 64 or more routed rows by expert)
    hands the stack its rows without their positions."""

    def __init__(self):
        super().__init__()
        self.experts: list[mx.array] = []

    def add(self, x: mx.array, indices: mx.array, *_, **__) -> None:
        # Unsorted, x is [..., 1 or k, 1, in] for indices [..., k]; sorted, [n, 1, in] for indices [n]
        self.rows.append(self._sum(mx.broadcast_to(x, (*indices.shape, *x.shape[-2:]))))
        self.experts.append(indices.reshape(-1).astype(mx.int32))

    def arrays(self) -> list[mx.array]:
        return [*super().arrays(), *self.experts]


class _Recorder(nn.Module):
    """Wraps a module; records its input into a sink. Adds no parameters of its own."""

    def __init__(self, inner: nn.Module, sink: _Sink):
        super().__init__()
        self.inner = inner
        self._squish_sink = sink

    def __call__(self, x, *args, **kwargs):
        self._squish_sink.add(x, *args, **kwargs)
        return self.inner(x, *args, **kwargs)


def replace_module(model: nn.Module, path: str, new: nn.Module) -> nn.Module:
    parent_path, _, attr = path.rpartition(".")
    parent = module_at(model, parent_path)
    if isinstance(parent, list):  # a module in a list (rwkv7's `lora`)
        old, parent[int(attr)] = parent[int(attr)], new
        return old
    old = parent[attr] if isinstance(parent, dict) and attr in parent else getattr(parent, attr)
    setattr(parent, attr, new)
    return old


@dataclass
class Calibration:
    """What one block's float32 pass over the calibration text measured of its groups' inputs."""

    abs_mean: dict[str, np.ndarray]  # group name -> mean |x_j| over every calibration token
    samples: dict[str, np.ndarray]  # group name -> [n, in] float32 input rows, evenly spaced over the text
    experts: dict[str, np.ndarray] = field(default_factory=dict)  # an expert stack's group -> [n] the expert each
    # of its rows (every routed row) went to


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
    sinks = {g.name: _ExpertSink() if g.kind == "experts" else _Sink() for g in groups}
    originals = []  # (path, what was there): groups may record one module (mixed precision's one-linear groups and
    # AWQ's q, k, v group read q's input), whose recorders then wrap each other and must come off in reverse
    try:
        for g in groups:
            recorder = _Recorder(module_at(runner.model, g.module), sinks[g.name])
            originals.append((g.module, replace_module(runner.model, g.module, recorder)))
        outputs = []
        for w, (h, pick) in enumerate(zip(runner.hidden if hidden is None else hidden, picks)):
            for sink in sinks.values():
                sink.pick = pick
            outputs.append(runner.forward(block, w, h))
        runner.evaluate(block, [*outputs, *(a for s in sinks.values() for a in s.arrays())])
    finally:
        for path, original in reversed(originals):
            replace_module(runner.model, path, original)
    return _measured(sinks), outputs


def record_head(runner: BlockRunner, group: ScaleGroup, picks: Sequence[mx.array]) -> Calibration:
    """The output head's input statistics (`linears.vocabulary`'s group), rows at `picks`: what the model's own
    tail (final norm, any scaling) hands the head on the last block's outputs (`runner.hidden`). Only that is
    computed: the logits' graph is built, never evaluated."""
    sink = _Sink()
    module = module_at(runner.model, group.module)
    tied = isinstance(module, nn.Embedding)
    if tied:  # the model calls the embedding's as_linear: an attribute of the instance shadows the method
        object.__setattr__(module, "as_linear", lambda x: (sink.add(x), type(module).as_linear(module, x))[1])
    else:
        replace_module(runner.model, group.module, _Recorder(module, sink))
    try:
        for h, window, pick in zip(runner.hidden, runner.windows, picks):
            sink.pick = pick
            runner.logits(h, window)
        mx.eval(*sink.arrays())
    finally:
        if tied:
            object.__delattr__(module, "as_linear")
        else:
            replace_module(runner.model, group.module, module)
        runner.release_vocabulary()
    if not sink.rows:
        raise UnsupportedArchitectureError(f"{type(runner.model).__module__}: the output head {group.module} is "
                                           "not called on the last layer's output")
    return _measured({group.name: sink})


def _measured(sinks: dict[str, _Sink]) -> Calibration:
    abs_mean = {k: np.array(s.abs_sum) / max(s.count, 1) for k, s in sinks.items()}
    rows = {k: np.concatenate([np.array(r) for r in s.rows], axis=0) for k, s in sinks.items()}
    experts = {k: np.concatenate([np.array(e) for e in s.experts]) for k, s in sinks.items()
               if isinstance(s, _ExpertSink)}
    return Calibration(abs_mean, rows, experts)

