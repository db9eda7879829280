"""One model config for every format: filled from a config.json (a GGUF reader builds one from its metadata), written
as a config.json that mlx_lm accepts (`mlx_lm.utils._get_classes(d)`, then `ModelArgs.from_dict(d)`).

The fields are the facts the provider and the loader need; every other config.json key rides along in `extra`
untouched. A family that spells a field differently (GPT-2's `n_embd`) lists the spelling in its Architecture's
`config_aliases`; we read either spelling and write the family's own.
"""

from __future__ import annotations

from collections.abc import Mapping
import json
import math
from dataclasses import MISSING, dataclass, field, fields
from numbers import Integral, Real
from os import PathLike
from pathlib import Path
from typing import Any

from .arch import Architecture, architecture_for
from .errors import FormatError, UnsupportedArchitectureError
from .io.files import read_bytes, read_json_object

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
# What mlx_lm.load and transformers' tokenizers look for beside the weights.
SIDE_FILES = (
    CONFIG,
    GENERATION_CONFIG,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)

# What a family with a rule table needs (squishlike/arch); any other mlx_lm family needs only its model_type, and
# its ModelArgs judge the rest.
REQUIRED = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

def _positive_int(v: Any) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool) and v > 0


def _finite_number(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v)


# The type every known field must have: sizes and divisors positive integers, the rest what mlx_lm expects.
_FIELD_TYPES = {
    **{key: (_positive_int, "a positive integer") for key in (
        *REQUIRED[1:], "num_key_value_heads", "intermediate_size", "head_dim", "max_position_embeddings")},
    **{key: (_finite_number, "a finite number") for key in ("rms_norm_eps", "layer_norm_eps", "rope_theta")},
    "tie_word_embeddings": (lambda v: isinstance(v, bool), "true or false"),
    "torch_dtype": (lambda v: isinstance(v, str), "a dtype name"),
}


@dataclass
class ModelConfig:
    """A model's hyperparameters under transformers' names (`hidden_size`, ...), plus every other key in `extra`."""

    model_type: str
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    vocab_size: int | None = None
    intermediate_size: int | None = None
    num_key_value_heads: int | None = None  # None: as many as attention heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float | None = None
    layer_norm_eps: float | None = None
    rope_theta: float | None = None
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.hidden_size and self.num_attention_heads:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], path: str | PathLike = "config.json") -> ModelConfig:
        """From a config.json dict. FormatError (naming `path`) when a required key is missing."""
        rest = dict(config)
        aliases = _aliases(rest.get("model_type"))
        for alias, name in aliases.items():
            if alias in rest:
                rest.setdefault(name, rest.pop(alias))
        # transformers >= 5 writes `dtype`, and nests rope_theta in rope_parameters
        if rest.get("torch_dtype") is None and "dtype" in rest:
            rest["torch_dtype"] = rest.pop("dtype")
        if rest.get("rope_theta") is None and isinstance(rest.get("rope_parameters"), dict):
            rest["rope_theta"] = rest["rope_parameters"].get("rope_theta")

        if rest.get("model_type") is None:
            raise FormatError(path, "config is missing required keys: model_type")
        if not isinstance(rest["model_type"], str):
            raise FormatError(path, f"config's model_type is {rest['model_type']!r}, not a name")
        family = _family(rest["model_type"])
        missing = [key for key in REQUIRED if rest.get(key) is None] if family else []
        if missing:
            raise FormatError(path, f"config is missing required keys: {', '.join(missing)}")
        for key, (is_valid, what) in _FIELD_TYPES.items():  # hostile values fail here, named
            value = rest.get(key)
            if value is not None and not is_valid(value):
                raise FormatError(path, f"config key {key} is {value!r}; it must be {what}")
        if "tie_word_embeddings" not in rest:
            rest["tie_word_embeddings"] = tie_word_embeddings_default(rest["model_type"]) if family else False

        names = {f.name for f in fields(cls)} - {"extra"}
        values = {key: rest.pop(key) for key in names if key in rest}
        return cls(**values, extra=rest)

    def to_dict(self) -> dict[str, Any]:
        """A config.json dict: `extra` as it came, the fields on top, in the family's own spelling."""
        out = dict(self.extra)
        out.update({f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"})
        aliases = _aliases(self.model_type)
        out.update({alias: out[name] for alias, name in aliases.items()})
        return {key: value for key, value in out.items() if value is not None and key not in aliases.values()}


def tie_word_embeddings_default(model_type: str) -> bool:
    """Whether mlx_lm ties `model_type`'s output head to its token embedding when config.json does not say: its
    ModelArgs' default; True where its ModelArgs has no such field: GPT-2 has no head of its own, and Gemma 3 uses
    one only when the weights hold it, so it is never required."""
    tie = next((f for f in fields(_model_args(model_type)) if f.name == "tie_word_embeddings"), None)
    if tie is None:
        return True
    return False if tie.default is MISSING else tie.default  # a required field: mlx_lm refuses such a config


def model_args_defaults(model_type: str) -> dict[str, Any]:
    """What each field of mlx_lm's ModelArgs for `model_type` is when config.json leaves it out (a field without a
    default is left out here too); {} for a type mlx_lm does not build here."""
    try:
        model_args = _model_args(model_type)
    except (ValueError, ImportError):  # no such model type; a model needing a package that is not installed
        return {}
    return {f.name: f.default if f.default is not MISSING else f.default_factory()
            for f in fields(model_args) if f.default is not MISSING or f.default_factory is not MISSING}


def _model_args(model_type: str) -> type:
    from .model_types import mlx_lm_classes

    return mlx_lm_classes({"model_type": model_type})[1]


def _family(model_type: str | None) -> Architecture | None:
    # A config of a family we have no rule table for still parses; the provider refuses it later.
    try:
        return architecture_for(model_type)
    except UnsupportedArchitectureError:
        return None


def _aliases(model_type: str | None) -> Mapping[str, str]:
    family = _family(model_type)
    return family.config_aliases if family else {}


def read_config(directory: str | PathLike) -> dict[str, Any]:
    """A model directory's config.json as stored. FormatError naming the file when it is not a JSON object."""
    return read_json_object(Path(directory) / CONFIG, directory)


def load_config(directory: str | PathLike) -> dict[str, Any]:
    """What `mlx_lm.utils.load_config` returns: config.json with generation_config.json's eos_token_id over it.

    mlx_lm.utils is imported (with transformers, ~1 s) only for a config holding the tagged floats
    ({"__float__": "NaN"}) that it alone decodes."""
    directory = Path(directory)
    config = read_config(directory)
    if _has_tagged_float(config):
        from mlx_lm.utils import load_config as mlx_lm_load_config

        return mlx_lm_load_config(directory)
    generation = {}
    if (directory / GENERATION_CONFIG).exists():
        try:
            generation = json.loads(read_bytes(directory / GENERATION_CONFIG, directory))
        except (ValueError, RecursionError):  # mlx_lm ignores a generation config it cannot parse
            pass
    if not isinstance(generation, dict):
        raise FormatError(directory / GENERATION_CONFIG, "is not a JSON object")
    if eos := generation.get("eos_token_id", False):
        if not _is_token_ids(eos):
            raise FormatError(directory / GENERATION_CONFIG, f"eos_token_id is {eos!r}, not token ids")
        config["eos_token_id"] = eos
    return config


def _is_token_ids(value: Any) -> bool:
    def is_id(v: Any) -> bool:
        return isinstance(v, Integral) and not isinstance(v, bool) and v >= 0

    return is_id(value) or (isinstance(value, list) and all(is_id(v) for v in value))


def _has_tagged_float(obj: Any) -> bool:
    if isinstance(obj, dict):
        return "__float__" in obj or any(_has_tagged_float(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_tagged_float(v) for v in obj)
    return False
