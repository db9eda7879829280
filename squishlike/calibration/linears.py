"""Which linears of a block read one input, found from the model itself rather than from a list of families.

The block's graph is built once on a calibration window (never evaluated: MLX builds it lazily) with a probe on
every `nn.Linear`, expert stack (`SwitchLinear`) and per-head stack (MLA's `MultiLinear`); linears handed the very
same input array read one input and share one Hessian (q, k, v; gate and up; an expert stack's gate and up). This is
what GPTQ needs on any architecture the block runner runs: the 4 families AWQ folds into are no longer a gate on it.

A per-head stack ([heads, out, in], each head's `x @ w[h].T`) is compensated where every head reads one input, as
MLA's `unembed_out` reads the latent: one Hessian for all its heads, as a linear's. Called transposed (`x @ w[h]`,
MLA's `embed_q` on the latent), its groups run across what the call sums over, so no input Hessian applies.
"""

from __future__ import annotations

import math
from typing import Callable

import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear

from ..model import embedding_weights
from .blocks import BlockRunner, module_at
from .stats import ScaleGroup, replace_module

try:
    from mlx_lm.models.mla import MultiLinear
    PER_HEAD_TYPES: tuple[type, ...] = (MultiLinear,)
except ImportError:  # an mlx_lm from before MLA's per-head stacks had a module of their own
    PER_HEAD_TYPES = ()

COMPENSATED_TYPES = (nn.Linear, SwitchLinear, *PER_HEAD_TYPES)  # mlx_lm's GPTQ covers the first two


class Probe(nn.Module):
    """Stands in for a module while the block's graph is built: notes each input it is handed and each output."""

    def __init__(self, inner: nn.Module, calls: list):
        super().__init__()
        self.inner = inner
        self._squish_calls = calls  # every probe's, in call order
        # The arrays themselves, so that no id is reused while the probes live
        self._squish_inputs: list = []
        self._squish_outputs: list = []
        self._squish_transposed = False  # a per-head stack called as x @ w[h]

    def __call__(self, x, *args, **kwargs):
        self._squish_calls.append(self)
        self._squish_inputs.append(x)
        self._squish_transposed |= isinstance(self.inner, PER_HEAD_TYPES) and not kwargs.get("transpose", True)
        self._squish_outputs.append(self.inner(x, *args, **kwargs))
        return self._squish_outputs[-1]


def probe(runner: BlockRunner, i: int, paths: list[str]) -> tuple[dict[str, Probe], list[Probe]]:
    """Build block `i`'s graph on its first window (nothing is computed) with a probe on each module of `paths`
    (mlx paths): the probes, and every call in order."""
    calls: list[Probe] = []
    probes = {path: Probe(module_at(runner.model, path), calls) for path in paths}
    for path, p in probes.items():
        replace_module(runner.model, path, p)
    try:
        runner.forward(i, 0, runner.hidden[0])
    finally:
        for path, p in probes.items():
            replace_module(runner.model, path, p.inner)
    return probes, calls


def input_groups(runner: BlockRunner, i: int, canonical: dict[str, str],
                 wanted: Callable[[str], bool]) -> tuple[list[ScaleGroup], dict[str, str]]:
    """The linears of block `i` (loaded) whose canonical weight `wanted` accepts, grouped by the input they read,
    in the order the block calls them; and {canonical weight: why it is left out} for those that cannot take one
    Hessian (called more than once, or never). `canonical` maps mlx names to canonical ones."""
    prefix = runner.slots[i].prefix
    paths = [prefix + path for path, module in runner.block(i).named_modules()
             if isinstance(module, COMPENSATED_TYPES) and (name := canonical.get(f"{prefix}{path}.weight")) is not None
             and wanted(name)]
    probes, calls = probe(runner, i, paths)
    readers: dict[tuple[int, str], list[str]] = {}
    left_out: dict[str, str] = {}
    first_call = {id(p): k for k, p in reversed(list(enumerate(calls)))}
    positions = math.prod(runner.hidden[0].shape[:-1])
    for path, p in sorted(probes.items(), key=lambda item: first_call.get(id(item[1]), len(calls))):
        name = canonical[f"{path}.weight"]
        if len(p._squish_inputs) != 1:
            left_out[name] = f"called {len(p._squish_inputs)} times a forward pass: no single input to compensate on"
            continue
        kind = "experts" if isinstance(p.inner, SwitchLinear) else "linears"
        if isinstance(p.inner, PER_HEAD_TYPES):
            kind = "heads"
            if p._squish_transposed:
                left_out[name] = ("a per-head stack called transposed (x @ w[h]): its groups run across what the "
                                  "call sums over, so no input Hessian applies")
                continue
            if math.prod(p._squish_inputs[0].shape[:-1]) != positions:
                left_out[name] = "a per-head stack whose heads read inputs of their own: no one Hessian for its heads"
                continue
        readers.setdefault((id(p._squish_inputs[0]), kind), []).append(path)
    groups = []
    for (_, kind), paths in readers.items():
        members = tuple(canonical[f"{p}.weight"] for p in paths)
        groups.append(ScaleGroup(f"{members[0].removesuffix('.weight')}:input", kind, i, paths[0], members, ()))
    return groups, left_out


def vocabulary(model: nn.Module, canonical: dict[str, str]) -> tuple[str | None, ScaleGroup | None]:
    """The canonical weight of the model's token embedding, and its output head as a group whose input
    `stats.record_head` records (the head's own linear outside the blocks, or, tied, the embedding whose
    `as_linear` the model calls); None for what the model does not have."""
    vocab = {n.removesuffix(".weight"): module_at(model, n.removesuffix(".weight")) for n in embedding_weights(model)}
    embeddings = [p for p, m in vocab.items() if isinstance(m, nn.Embedding)]
    heads = [p for p, m in vocab.items() if isinstance(m, nn.Linear)]
    embedding = canonical.get(f"{embeddings[0]}.weight") if len(embeddings) == 1 else None
    head_path = heads[0] if len(heads) == 1 else embeddings[0] if len(embeddings) == 1 and not heads else None
    if head_path is None or f"{head_path}.weight" not in canonical:
        return embedding, None
    return embedding, ScaleGroup("head", "head", -1, head_path, (canonical[f"{head_path}.weight"],), ())
