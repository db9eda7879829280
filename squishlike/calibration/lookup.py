"""What an error in the token embedding's rows costs, found from the model: the Hessian GPTQ rounds the embedding
along its width with (docs/design.md §7.5).

A row the model looks up is the first layer's input. It goes on unchanged down the residual path, and the first
layer's linears read it through a norm: to first order an error e in the row moves their outputs by
W diag(w + o) e / rms (w + o: the norm's scale, `awq.weight_offset`), so the Hessian of those outputs is
diag(w + o) W^T W diag(w + o), normalised here to a mean diagonal of 1 (the rms differs from row to row). Which
linears read the first layer's input, and through which norm, the probe shows (`linears.probe`), as it shows
GPTQ's groups and AWQ's folds: no family is named.

The residual path carries the row to every later layer and, at its end, to the head. Modelled as read alike in
every direction (the identity), it leaves the rounding free to fall along the few directions a head reads hard;
modelled as the head's reading (`head_hessian`), it costs models whose first layer reacts most. Which serves a
model is measured (`OutputProbe`): each candidate's rounding of the rows the first calibration window looked up,
carried through every layer beside the float pass, and the one whose logits move least is the store's.

A tied matrix is also the output head, whose rows' errors cost at the logits directly. How much each use weighs
differs by orders of magnitude from model to model, so it is measured too (`LookupProbe`), not assumed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import quant
from ..errors import UnsupportedArchitectureError
from ..evaluation.metrics import Window
from .awq import norm_like, outside_norms, weight_offset
from .blocks import BlockRunner, module_at
from .gptq import gptq, inverse_hessian_factor
from .linears import COMPENSATED_TYPES, probe
from .quantizer import Quantizer


HEAD_CHUNK = 8192  # a head's rows read as float32 at a time (`head_hessian`)
# How the residual path's reading of a row is modelled beside the first layer's readers (the module's docstring)
RESIDUAL_PATHS = ("identity", "head", "identity and head")


def lookup_readers(runner: BlockRunner) -> tuple[list[str], mx.array | None]:
    """The linears of the first block (loaded) that read its input through a norm or directly (mlx paths), and
    their Hessian above ([width, width] float32, a mean diagonal of 1); ([], None) when no linear reads it so."""
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
    return readers, h / mx.mean(mx.diag(h))


def as_rows(h: mx.array) -> np.ndarray:
    """Rows x ([width, width] float32) whose x^T x is the Hessian `h`, as GPTQ takes its inputs."""
    return np.ascontiguousarray(np.linalg.cholesky(np.array(h, dtype=np.float64)).T, dtype=np.float32)


def head_hessian(runner: BlockRunner, head: mx.array) -> mx.array:
    """The head's reading of the residual stream's end: diag(g) W^T W diag(g) of its weight W, normalised to a mean
    diagonal of 1, with g the final norm's scale where one norm outside the layers has the width (else 1)."""
    width = head.shape[-1]
    norms = [module_at(runner.model, p) for p in outside_norms(runner)]
    g = norms[0].weight + weight_offset(norms[0]) if len(norms) == 1 and norms[0].weight.shape == (width,) \
        else mx.ones((width,))
    h = mx.zeros((width, width))
    for r in range(0, head.shape[0], HEAD_CHUNK):
        w = head[r:r + HEAD_CHUNK].astype(mx.float32) * g.astype(mx.float32)[None, :]
        h = h + w.T @ w
        mx.eval(h)
    return h / mx.mean(mx.diag(h))


def with_identity(h: mx.array) -> mx.array:
    """`h` plus the identity: an error read alike in every direction, as the residual path is modelled by default."""
    return h + mx.eye(h.shape[0])


def path_hessians(readers: mx.array, head: Callable[[], mx.array],
                  paths: tuple[str, ...] = RESIDUAL_PATHS) -> dict[str, mx.array]:
    """The lookup's Hessian with each of `paths` (of RESIDUAL_PATHS): the readers' plus the identity, the head's,
    or both; `head()` (`head_hessian`, a pass over the head) is found once, and only where a path reads it."""
    head, hessians = cache(head), {}
    for path in paths:
        h = readers if path == "head" else with_identity(readers)
        hessians[path] = h if path == "identity" else h + head()
    return hessians


def lookup_hessian(runner: BlockRunner, canonical: dict[str, str]) -> tuple[mx.array | None, dict]:
    """`lookup_readers` of the first block (loaded) and the manifest's record of it: {"readers": canonical
    weights}, or {"left_out": why} with the Hessian None. `canonical` maps mlx names to canonical."""
    why = "no linear of the first layer reads its input through a norm"
    try:
        readers, h = lookup_readers(runner)
    except UnsupportedArchitectureError as e:
        readers, h, why = [], None, str(e)
    return h, {"readers": [canonical[f"{r}.weight"] for r in readers]} if readers else {"left_out": why}


def normalised(x: np.ndarray) -> np.ndarray:
    """Rows `x` scaled so that x^T x has a mean diagonal of 1: Hessians of two uses of one matrix, made comparable
    before they are summed."""
    return x / np.float32(max(np.sqrt(np.square(x, dtype=np.float64).sum() / x.shape[1]), 1e-30))


# The probe's noise against the looked-up rows' rms: small, so that the KL it causes is quadratic in it
PROBE_SPREAD = 1e-2
PROBE_CHUNK = 128


class OutputProbe:
    """The first window's hidden state entering the first block, each copy with an error put where the model puts a
    looked-up row, run through every block after the float pass (`step`); at the end, the KL of each copy's logits
    to the float logits (`kls`)."""

    def __init__(self, hidden: list[mx.array]):
        self.hidden = hidden

    @classmethod
    def with_errors(cls, entering: mx.array, rows: np.ndarray, errors: list[np.ndarray],
                    spread: float = 1.0) -> OutputProbe:
        """The probe of `entering` (the hidden state entering the first block, whose positions looked up the
        embedding's `rows`) with each of `errors` times `spread` added to those rows, times what the model
        multiplies a row by (Gemma's sqrt(width)), found from the hidden state."""
        x = np.array(entering, dtype=np.float64).reshape(rows.shape)
        r = rows.astype(np.float64)
        scale = float((x * r).sum() / max((r * r).sum(), 1e-30))
        return cls([entering + mx.array((e * (spread * scale)).reshape(entering.shape).astype(np.float32))
                    for e in errors])

    def step(self, runner: BlockRunner, i: int) -> None:
        """Run block `i` (loaded) on the probe, after the float pass ran it (what the block hands on beside its
        hidden state is the probe's own then)."""
        self.hidden = [runner.forward(i, 0, h) for h in self.hidden]
        runner.evaluate(i, self.hidden)

    def kls(self, runner: BlockRunner) -> list[float]:
        """After the last block: each copy's KL of its logits to the float pass's, per position. The logits are
        taken PROBE_CHUNK positions at a time (a 262,144-token vocabulary's are 1 MB a position)."""
        tokens, n = runner.windows[0].tokens, self.hidden[0].shape[-2]
        totals = [0.0] * len(self.hidden)
        for a in range(0, n, PROBE_CHUNK):
            b = min(a + PROBE_CHUNK, n)
            part = Window(tokens[a:b + 1])  # the model reads tokens[:-1]
            clean = nn.log_softmax(runner.logits(runner.hidden[0][..., a:b, :], part), axis=-1)
            # Evaluated alone first: each logits pass makes a float32 copy of a bfloat16 head for its matmul (1.2 GB
            # at a 151,936 x 2,048 head), and the float and a copy's passes in one graph would hold two at once
            mx.eval(clean)
            for k, hidden in enumerate(self.hidden):
                noisy = nn.log_softmax(runner.logits(hidden[..., a:b, :], part), axis=-1)
                totals[k] += mx.sum(mx.exp(clean) * (clean - noisy)).item()
        runner.release_vocabulary()
        return [max(total / n, 0.0) for total in totals]


class LookupProbe(OutputProbe):
    """What an error in the embedding's rows costs at the model's output, measured beside the float pass: an
    OutputProbe whose error is noise of standard deviation `sigma` in the rows' units. Its logits' KL is sigma^2 / 2
    times the trace of the output's Fisher in an error at one position's row (`fisher_trace`). Against the head's,
    whose Hessian in its rows' error is E[h h^T] of its inputs h in the same units (a row's KL weighs both by how
    often its token comes), that is how much the lookup's Hessian weighs in a tied matrix's GPTQ: on SmolLM2-135M
    0.04 of the head's, on random models of the sweep 20-180x (docs/design.md §7.5)."""

    def __init__(self, hidden: list[mx.array], sigma: float):
        super().__init__(hidden)
        self.sigma = sigma

    @classmethod
    def start(cls, entering: mx.array, rows: np.ndarray, seed: int = 0) -> LookupProbe:
        """The probe of `entering`, whose positions looked up the embedding's `rows`."""
        sigma = PROBE_SPREAD * float(np.sqrt(np.mean(np.square(rows, dtype=np.float64))))
        noise = np.random.default_rng(seed).standard_normal(rows.shape)
        return cls(OutputProbe.with_errors(entering, rows, [noise], sigma).hidden, sigma)

    def fisher_trace(self, runner: BlockRunner) -> float:
        """After the last block: 2 KL / sigma^2."""
        return 2.0 * self.kls(runner)[0] / self.sigma ** 2


def rounding_probe(entering: mx.array, rows: np.ndarray, hessians: dict[str, mx.array],
                   qz: Quantizer) -> OutputProbe:
    """An OutputProbe of `entering` (whose positions looked up the embedding's `rows`, float32) with the error of
    each of `hessians`' GPTQ of those rows: GPTQ rounds each row alone, so they are the store's rows with it."""
    errors = []
    for h in hessians.values():
        parts = gptq(rows, "float32", qz, inverse_hessian_factor(as_rows(h)))
        errors.append(quant.dequantize(qz.scheme, *parts, group_size=qz.group_size, scale_dtype=qz.scale_dtype,
                                       out_dtype="float32").reshape(rows.shape) - rows)
    return OutputProbe.with_errors(entering, rows, errors)


def head_trace(x: np.ndarray) -> float:
    """E[h h^T]'s trace over the head's input rows `x`: the head's Hessian in its rows' error, in KL's units."""
    return float(np.square(x, dtype=np.float64).sum() / max(len(x), 1))
