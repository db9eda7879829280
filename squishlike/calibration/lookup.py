"""What an error in the token embedding's rows costs, found from the model: the Hessian GPTQ rounds the embedding
along its width with (docs/design.md §7.5).

A row the model looks up is the first layer's input. It goes on unchanged down the residual path, and the first
layer's linears read it through a norm: to first order an error e in the row moves their outputs by
W diag(w + o) e / rms (w + o: the norm's scale, `awq.weight_offset`), so the Hessian of those outputs is
diag(w + o) W^T W diag(w + o), normalised here to a mean diagonal of 1 (the rms differs from row to row), plus the
identity for the residual path. Which linears read the first layer's input, and through which norm, the probe
shows (`linears.probe`), as it shows GPTQ's groups and AWQ's folds: no family is named.

A tied matrix is also the output head, whose rows' errors cost at the logits directly. How much each use weighs
differs by orders of magnitude from model to model, so it is measured (`LookupProbe`), not assumed.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import UnsupportedArchitectureError
from ..evaluation.metrics import Window
from .awq import norm_like, weight_offset
from .blocks import BlockRunner
from .linears import COMPENSATED_TYPES, probe


def lookup_readers(runner: BlockRunner) -> tuple[list[str], np.ndarray | None]:
    """The linears of the first block (loaded) that read its input through a norm or directly (mlx paths), and
    rows x ([width, width] float32) whose x^T x is the Hessian above; ([], None) when no linear reads it so."""
    block, prefix = runner.block(0), runner.slots[0].prefix
    norms = [prefix + p for p, m in block.named_modules() if norm_like(m)]
    linears = [prefix + p for p, m in block.named_modules() if isinstance(m, COMPENSATED_TYPES)]
    probes, _ = probe(runner, 0, [*norms, *linears])
    entering = runner.hidden[0]
    width = entering.shape[-1]
    scale_of = {id(entering): mx.ones((width,))}  # the arrays that carry the row, each with its scale
    for path in norms:
        p = probes[path]
        if len(p._squish_inputs) == 1 and p._squish_inputs[0] is entering and p.inner.weight.shape == (width,):
            scale_of[id(p._squish_outputs[0])] = p.inner.weight + weight_offset(p.inner)
    readers, h = [], mx.zeros((width, width))
    for path in linears:
        p = probes[path]
        scales = [scale_of[id(x)] for x in p._squish_inputs if id(x) in scale_of]
        if scales:
            w = p.inner.weight.reshape(-1, width).astype(mx.float32) * scales[0][None, :]
            h = h + w.T @ w
            readers.append(path)
    if not readers:
        return [], None
    h = h / mx.mean(mx.diag(h)) + mx.eye(width)
    return readers, np.ascontiguousarray(np.linalg.cholesky(np.array(h, dtype=np.float64)).T, dtype=np.float32)


def lookup_rows(runner: BlockRunner, canonical: dict[str, str]) -> tuple[np.ndarray | None, dict]:
    """`lookup_readers` of the first block (loaded) and the manifest's record of it: {"readers": canonical
    weights}, or {"left_out": why} with rows None. `canonical` maps mlx names to canonical."""
    why = "no linear of the first layer reads its input through a norm"
    try:
        readers, rows = lookup_readers(runner)
    except UnsupportedArchitectureError as e:
        readers, rows, why = [], None, str(e)
    return rows, {"readers": [canonical[f"{r}.weight"] for r in readers]} if readers else {"left_out": why}


def normalised(x: np.ndarray) -> np.ndarray:
    """Rows `x` scaled so that x^T x has a mean diagonal of 1: Hessians of two uses of one matrix, made comparable
    before they are summed."""
    return x / np.float32(max(np.sqrt(np.square(x, dtype=np.float64).sum() / x.shape[1]), 1e-30))


# The probe's noise against the looked-up rows' rms: small, so that the KL it causes is quadratic in it
PROBE_SPREAD = 1e-2
PROBE_CHUNK = 128


class LookupProbe:
    """What an error in the embedding's rows costs at the model's output, measured beside the float pass.

    The first window's hidden state entering the first block, plus noise of standard deviation `sigma` in the rows'
    units, put there as the model puts a looked-up row (times its scale: Gemma's sqrt(width)), runs through every
    block after the float pass (`step`). At the end, its logits' KL to the float logits is sigma^2 / 2 times the
    trace of the output's Fisher in an error at one position's row (`fisher_trace`). Against the head's, whose
    Hessian in its rows' error is E[h h^T] of its inputs h in the same units (a row's KL weighs both by how often
    its token comes), that is how much the lookup's Hessian weighs in a tied matrix's GPTQ: on SmolLM2-135M 0.04 of
    the head's, on random models of the sweep 20-180x (docs/design.md §7.5)."""

    def __init__(self, hidden: mx.array, sigma: float):
        self.hidden, self.sigma = hidden, sigma

    @classmethod
    def start(cls, hidden: mx.array, rows: np.ndarray, seed: int = 0) -> LookupProbe:
        """The probe of the first window's hidden state entering the first block, `hidden`, whose positions looked
        up the embedding's `rows`."""
        x = np.array(hidden, dtype=np.float64).reshape(rows.shape)
        r = rows.astype(np.float64)
        scale = float((x * r).sum() / max((r * r).sum(), 1e-30))  # what the model multiplies a row by
        sigma = PROBE_SPREAD * float(np.sqrt(np.mean(r * r)))
        noise = np.random.default_rng(seed).standard_normal(x.shape) * (sigma * scale)
        return cls(hidden + mx.array(noise.reshape(hidden.shape).astype(np.float32)), sigma)

    def step(self, runner: BlockRunner, i: int) -> None:
        """Run block `i` (loaded) on the probe, after the float pass ran it (what the block hands on beside its
        hidden state is the probe's own then)."""
        self.hidden = runner.forward(i, 0, self.hidden)
        runner.evaluate(i, [self.hidden])

    def fisher_trace(self, runner: BlockRunner) -> float:
        """After the last block: 2 KL / sigma^2, the KL of the probe's logits to the float pass's, per position.
        The logits are taken PROBE_CHUNK positions at a time (a 262,144-token vocabulary's are 1 MB a position)."""
        tokens, n = runner.windows[0].tokens, self.hidden.shape[-2]
        total = 0.0
        for a in range(0, n, PROBE_CHUNK):
            b = min(a + PROBE_CHUNK, n)
            part = Window(tokens[a:b + 1])  # the model reads tokens[:-1]
            clean = nn.log_softmax(runner.logits(runner.hidden[0][..., a:b, :], part), axis=-1)
            noisy = nn.log_softmax(runner.logits(self.hidden[..., a:b, :], part), axis=-1)
            total += mx.sum(mx.exp(clean) * (clean - noisy)).item()
        runner.release_vocabulary()
        return 2.0 * max(total / n, 0.0) / self.sigma ** 2


def head_trace(x: np.ndarray) -> float:
    """E[h h^T]'s trace over the head's input rows `x`: the head's Hessian in its rows' error, in KL's units."""
    return float(np.square(x, dtype=np.float64).sum() / max(len(x), 1))
