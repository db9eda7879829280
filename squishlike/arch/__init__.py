"""Model families: which tensors a model has, what each file format calls them, and how their values differ.

Every family is one rule table (docs/format.md §10). A rule row names one tensor four ways:

- `canonical`: the provider's name, e.g. `layers.3.attention.q.weight`;
- `hf`: the name in a Hugging Face safetensors checkpoint;
- `gguf`: the name llama.cpp's converter writes;
- `mlx`: the mlx_lm parameter name after the model's `sanitize` (for GPT-2 these differ from the HF names).

`{n}` in a row stands for the layer index; a row is expanded once per layer and kept only where the source has
the tensor. Where a format stores different *values* than the canonical form (a permutation, an offset, a
transposition), an `Adapter` converts between them. Canonical tensors are always what mlx_lm expects after
`sanitize`: Linear weights `[out, in]`, norms as stored by HF.

A reader's `naming` ("hf", "gguf", "mlx" or "canonical") picks the column, so nothing here knows file layouts.

Every other family mlx_lm builds has no table: its tensors go by mlx_lm's own parameter names, after the model's
`sanitize` (`mlx_named`). Those names are then its canonical names, in every column.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from importlib import import_module
from typing import Any, ClassVar, Protocol

from ..errors import UnsupportedArchitectureError

NAMINGS = ("canonical", "hf", "gguf", "mlx")
_LAYER = re.compile(r"^layers\.(\d+)\.")  # every per-layer canonical name starts so


class Need(Enum):
    """Whether a model of this family must have the tensor (a missing one raises MissingTensorError)."""

    ALWAYS = "always"
    OPTIONAL = "optional"  # biases some checkpoints carry (attention_bias, mlp_bias)
    WHEN_UNTIED = "when_untied"  # lm_head: absent when tied to the token embedding


@dataclass(frozen=True)
class Rule:
    canonical: str
    hf: str
    gguf: str
    mlx: str
    need: Need = Need.ALWAYS

    def expand(self, layer: int) -> Rule:
        return Rule(*(getattr(self, n).replace("{n}", str(layer)) for n in NAMINGS), self.need)


def rule(canonical: str, hf: str, gguf: str, mlx: str | None = None, need: Need = Need.ALWAYS) -> Rule:
    """A row whose mlx_lm name equals its HF name unless given."""
    return Rule(canonical, hf, gguf, hf if mlx is None else mlx, need)


class HeadCounts(Protocol):
    """The config facts an adapter may need: squishlike.config.ModelConfig has them."""

    num_attention_heads: int
    num_key_value_heads: int


# (canonical name, array, config) -> array. Written with methods numpy and mlx arrays share, so the export writers
# can use them on either.
Transform = Callable[[str, Any, HeadCounts], Any]


@dataclass(frozen=True)
class Adapter:
    """Converts the tensors named by `pattern` between one format's values (`naming`) and the canonical ones."""

    naming: str
    pattern: str  # regex, full match on the canonical name
    to_canonical: Transform
    from_canonical: Transform

    def applies(self, naming: str, canonical: str) -> bool:
        return naming == self.naming and re.fullmatch(self.pattern, canonical) is not None


@dataclass(frozen=True)
class Architecture:
    """One model family: its rule table, its adapters, and the config facts that differ between its formats."""

    # Which names the canonical column holds: squishlike's own ("canonical") or mlx_lm's ("mlx", see mlx_named).
    # An npy-dir records it (docs/format.md §2).
    canonical_names: ClassVar[str] = "canonical"

    model_types: tuple[str, ...]  # config.json `model_type` values; the first is the one we write
    gguf_arch: str  # GGUF `general.architecture`
    rules: tuple[Rule, ...]  # in model order: embeddings, then one layer's rows, then the output rows
    adapters: tuple[Adapter, ...] = ()
    # config.json keys this family spells differently, e.g. GPT-2's {"n_embd": "hidden_size"}
    config_aliases: Mapping[str, str] = field(default_factory=dict)
    # extra config.json keys from GGUF metadata; `get(suffix)` reads `{arch}.{suffix}`, then `{suffix}`
    gguf_config: Callable[[Callable[[str], Any], dict], dict] | None = None

    @property
    def model_type(self) -> str:
        return self.model_types[0]

    def expanded_rules(self, num_layers: int) -> list[Rule]:
        """Every row with `{n}` expanded, in model order (all of layer 0's rows, then layer 1's, ...)."""
        layer_rows = [i for i, r in enumerate(self.rules) if "{n}" in r.canonical]
        if not layer_rows:
            return list(self.rules)
        first, last = layer_rows[0], layer_rows[-1] + 1
        per_layer = self.rules[first:last]
        layers = [r.expand(n) for n in range(num_layers) for r in per_layer]
        return [*self.rules[:first], *layers, *self.rules[last:]]

    def _rule(self, canonical: str) -> Rule:
        layer = _LAYER.match(canonical)
        template = _LAYER.sub("layers.{n}.", canonical) if layer else canonical
        for r in self.rules:
            if r.canonical == template:
                return r.expand(int(layer.group(1))) if layer else r
        raise KeyError(f"{canonical}: not a tensor of {self.model_type}")

    def name(self, naming: str, canonical: str) -> str:
        """`canonical`'s name in the `naming` column ("canonical", "hf", "gguf" or "mlx")."""
        return getattr(self._rule(canonical), naming)

    def hf_name(self, canonical: str) -> str:
        return self.name("hf", canonical)

    def gguf_name(self, canonical: str) -> str:
        return self.name("gguf", canonical)

    def mlx_name(self, canonical: str) -> str:
        return self.name("mlx", canonical)

    def adapters_for(self, naming: str, canonical: str) -> list[Adapter]:
        return [a for a in self.adapters if a.applies(naming, canonical)]

    def to_canonical(self, naming: str, canonical: str, array, config: HeadCounts):
        """A tensor as the `naming` format stores it -> its canonical values."""
        for adapter in self.adapters_for(naming, canonical):
            array = adapter.to_canonical(canonical, array, config)
        return array

    def from_canonical(self, naming: str, canonical: str, array, config: HeadCounts):
        """Canonical values -> the tensor as the `naming` format stores it (what an export writer writes)."""
        for adapter in reversed(self.adapters_for(naming, canonical)):
            array = adapter.from_canonical(canonical, array, config)
        return array


@dataclass(frozen=True)
class MlxNamed(Architecture):
    """A family without a rule table: one identity row per mlx_lm parameter name, no adapters."""

    canonical_names: ClassVar[str] = "mlx"

    @cached_property
    def _rows(self) -> dict[str, Rule]:
        return {r.canonical: r for r in self.rules}

    def expanded_rules(self, num_layers: int | None) -> list[Rule]:
        return list(self.rules)

    def _rule(self, canonical: str) -> Rule:
        try:
            return self._rows[canonical]
        except KeyError:
            raise KeyError(f"{canonical}: not a parameter of this {self.model_type} model") from None


def mlx_named(model_type: str, names: Iterable[str]) -> Architecture:
    """The family of an mlx_lm model without a rule table, whose tensors are `names` (mlx_lm's, after sanitize)."""
    return MlxNamed(model_types=(model_type,), gguf_arch="", rules=tuple(Rule(n, n, n, n) for n in names))


# Family modules, imported on first use; each exports ARCHITECTURES: a list of Architecture.
FAMILIES = ("llama", "qwen", "gemma", "gpt2")


def architectures() -> list[Architecture]:
    return [a for family in FAMILIES for a in import_module(f"{__name__}.{family}").ARCHITECTURES]


def architecture_for(model_type: str) -> Architecture:
    """The family for a config.json `model_type`. UnsupportedArchitectureError says whether mlx_lm builds it at
    all (in mlx_lm's words when it does not) and lists the ones we have."""
    for arch in architectures():
        if model_type in arch.model_types:
            return arch
    from ..model_types import mlx_lm_module

    try:
        mlx_lm_module({"model_type": model_type})
    except ValueError as e:  # "Model type X not supported.", as mlx_lm.load says it
        raise UnsupportedArchitectureError(f"{e} mlx_lm has no model of that type, so neither has squishlike") from None
    known = sorted(t for a in architectures() for t in a.model_types)
    raise UnsupportedArchitectureError(
        f"model_type {model_type!r}: mlx_lm builds it, but squishlike has no family table for it "
        f"(supported: {', '.join(known)})"
    )


def architecture_for_gguf(gguf_arch: str) -> Architecture:
    """The family for a GGUF `general.architecture`."""
    for arch in architectures():
        if arch.gguf_arch == gguf_arch:
            return arch
    known = sorted(a.gguf_arch for a in architectures())
    raise UnsupportedArchitectureError(
        f"GGUF architecture {gguf_arch!r} is not supported (supported: {', '.join(known)})"
    )


__all__ = [
    "Adapter",
    "Architecture",
    "MlxNamed",
    "NAMINGS",
    "Need",
    "Rule",
    "HeadCounts",
    "architecture_for",
    "architecture_for_gguf",
    "architectures",
    "mlx_named",
    "rule",
]
