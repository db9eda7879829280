"""Weights (by mlx_lm parameter name) + config.json dict -> an mlx_lm model; side files -> its tokenizer.
`assemble` builds both as mlx_lm.load does; `WeightProvider.build_model` runs the whole pipeline for any format
the provider reads (weights, side files written to a temporary directory, config, model, tokenizer).

This mirrors `mlx_lm.utils.load_model` step for step (model class from `model_type`, the model's own
`sanitize`, `nn.quantize` where the weights carry `.scales`, `load_weights`, eager eval) but takes the weights
from whichever tier or format produced them instead of globbing `model*.safetensors`.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any, Collection

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import infer_quant_config

from . import tokenizer
from .errors import FormatError, SquishError, UnsupportedArchitectureError
from .model_types import mlx_lm_classes



def model_classes(
    config: dict, model_dir: Path | None = None, trust_remote_code: bool = False
) -> tuple[type[nn.Module], type]:
    """mlx_lm's Model and ModelArgs for `config["model_type"]`; a typed error when mlx_lm has none.

    A config naming its own model code (`model_file`) is refused unless the caller passes trust_remote_code=True,
    exactly as mlx_lm does: loading a model must never run a stranger's Python by default.
    """
    if (model_file := config.get("model_file")) is not None:
        if not trust_remote_code or model_dir is None:
            raise UnsupportedArchitectureError(
                f"{model_dir or 'config.json'}: the config names custom model code {model_file!r}; "
                "pass trust_remote_code=True only if you trust this model"
            )
        spec = importlib.util.spec_from_file_location("custom_model", Path(model_dir) / model_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.Model, module.ModelArgs
    if "model_type" not in config:
        raise UnsupportedArchitectureError(f"{model_dir or 'config.json'}: config has no model_type")
    try:
        return mlx_lm_classes(config)
    except ValueError as e:
        raise UnsupportedArchitectureError(
            f"{model_dir or 'config.json'}: {e} mlx_lm has no model of that type, so neither has squishlike"
        ) from e


def new_model(config: dict[str, Any], model_dir: Path | None = None, trust_remote_code: bool = False) -> nn.Module:
    """The mlx_lm model `config` describes, its parameters not loaded (random and unevaluated: no memory yet)."""
    model_class, args_class = model_classes(config, model_dir, trust_remote_code)
    return model_class(args_class.from_dict(config))


def tie_absent_head(model: nn.Module, names: Collection[str]) -> None:
    """Tie `model`'s head as its `sanitize` would for weights `names` (mlx_lm names) that have none: gemma3_text and
    recurrent_gemma build an `lm_head` of their own and drop it there, calling the embedding's `as_linear` instead.
    A model built without loading (calibration's) would otherwise compute its logits with a random head, and the
    tied matrix's use as the head would go unmeasured."""
    if "lm_head" in model and "lm_head.weight" not in names and hasattr(model, "tie_word_embeddings"):
        model.tie_word_embeddings = True
        model.pop("lm_head")


def parameter_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape by mlx_lm name (of a `new_model`: read from its unevaluated arrays, no memory)."""
    return {name: tuple(array.shape) for name, array in tree_flatten(model.parameters())}


def embedding_weights(model: nn.Module) -> set[str]:
    """The weights of `model`'s input embeddings (nn.Embedding) and output head (`lm_head`, or its family's name
    for it), by parameter name, whether or not the model lets them be quantized."""
    vocab_sizes = {m.weight.shape[0] for _, m in model.named_modules() if isinstance(m, nn.Embedding)}

    def is_output_head(path: str, module: nn.Module) -> bool:
        # `lm_head` in most families, `output` (internlm2), `embed_out` (gpt_neox): a linear outside the layer
        # stack that maps to the vocabulary. Inside the stack a projection may have the vocabulary's width by chance.
        outside_layers = not any(part.isdigit() for part in path.split("."))
        return path.rsplit(".", 1)[-1] == "lm_head" or (outside_layers and module.weight.shape[0] in vocab_sizes)

    return {f"{path}.weight" for path, module in model.named_modules()
            if hasattr(module, "to_quantized") and "weight" in module
            and (isinstance(module, nn.Embedding) or is_output_head(path, module))}


MATRIX = "matrix"  # quantizable_weights' kind of an embedding the model's own code multiplies by as a matrix


def quantizable_weights(model: nn.Module) -> dict[str, str]:
    """The weights `nn.quantize` would quantize in `model`, by parameter name -> "embedding", "linear", "int8" or
    MATRIX.

    A weight qualifies when its module has `to_quantized` (nn.Linear, nn.Embedding, the expert stacks of
    SwitchLinear, ...) and the model's own `quant_predicate`, if it has one, does not refuse it (mlx_lm.convert
    asks the same). "int8": the predicate asks for 8 bits or more (MoE routers). "embedding": the input
    embeddings and the output head (`embedding_weights`), the tensors `compress` keeps exact when asked to
    (--no-quantize-embeddings). MATRIX: an input embedding whose weight the model's tied head multiplies by itself
    (`reads_embedding_matrix`), which must stay dense. Group-size fit is the caller's.
    """
    predicate = getattr(model, "quant_predicate", None)
    embeddings = embedding_weights(model)
    matrix = reads_embedding_matrix(model)
    kinds = {}
    for path, module in model.named_modules():
        if not _quantizable(module):
            continue
        asked = True if predicate is None else predicate(path, module)
        if asked is False:
            continue
        if matrix and isinstance(module, nn.Embedding):
            kinds[f"{path}.weight"] = MATRIX
        elif f"{path}.weight" in embeddings:
            kinds[f"{path}.weight"] = "embedding"
        elif isinstance(asked, dict) and asked.get("bits", 0) >= 8:
            kinds[f"{path}.weight"] = "int8"
        else:
            kinds[f"{path}.weight"] = "linear"
    return kinds


# A forward that multiplies by an embedding's weight itself: `h @ self.model.embed_tokens.weight.T`.
_EMBEDDING_MATRIX = re.compile(r"@\s*[\w.]*embed\w*\.weight\b")


def reads_embedding_matrix(model: nn.Module) -> bool:
    """Whether `model` has no output head of its own (its head is tied) and its forward multiplies by its input
    embedding's weight directly instead of through the embedding's `as_linear`: seed_oss (tied by default), and
    minicpm and llama4's text model when tied. A quantized embedding's `weight` is its packed codes, so such a model
    fails at its first forward with a quantized embedding (mlx_lm.convert -q's output too); its embedding stays
    dense. mlx_lm says so nowhere but in the forward's code, which is read here."""
    if any(path.rsplit(".", 1)[-1] == "lm_head" for path, _ in model.named_modules()):
        return False
    return any(_EMBEDDING_MATRIX.search(_forward_source(type(module))) for _, module in model.named_modules())


@functools.lru_cache(maxsize=None)
def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.__call__)
    except (OSError, TypeError):  # defined outside Python source (a C extension's class)
        return ""


def _quantizable(module: nn.Module) -> bool:
    # nn.quantize passes `mode` to every `to_quantized`: afm7's FusedLinear takes none, so mlx_lm cannot quantize it
    # (mlx_lm.convert -q fails on it) and no store may hold it quantized.
    if not hasattr(module, "to_quantized") or "weight" not in module:
        return False
    parameters = inspect.signature(module.to_quantized).parameters
    return "mode" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def build_model(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    *,
    lazy: bool = False,
    strict: bool = True,
    model_dir: Path | None = None,
    trust_remote_code: bool = False,
    sanitized: bool = False,
) -> nn.Module:
    """An mlx_lm model with `weights` loaded. Quantized layers are created where weights carry `<p>.scales`.
    `sanitized`: the weights come out of the model's own `sanitize` already (formats/sanitized.py), which is not
    run twice: it need not be idempotent (baichuan_m1 normalizes its head's rows each time)."""
    check_against_weights(config, weights, model_dir or "config.json")
    model = new_model(config, model_dir, trust_remote_code)
    if hasattr(model, "sanitize") and not sanitized:
        weights = model.sanitize(weights)
    quantize_as_stored(model, config, weights)
    model.eval()
    model.load_weights(list(weights.items()), strict=strict)
    if not lazy:
        mx.eval(model.parameters())
    return model


def quantize_as_stored(model: nn.Module, config: dict[str, Any], weights: dict[str, mx.array]) -> None:
    """Turn `model`'s layers into the quantized ones `weights` (by mlx_lm name, after `sanitize`) fill, as
    mlx_lm.load_model does for `config`'s "quantization": a layer the config names takes its override, any other
    takes the group size, bits and mode its stored `.scales` imply. Only the weights' names, shapes and dtypes are
    looked at, so lazy arrays cost no read. Without "quantization" in `config` the model stays as it is."""
    if (quantization := config.get("quantization")) is None:
        return

    def class_predicate(path: str, module: nn.Module):
        if path in quantization:  # per-layer override, as mlx_lm writes it
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(
        model,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=class_predicate,
    )


# The spellings of a layer count among mlx_lm's ModelArgs (top level, or in a wrapper's text_config)
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_transformer_layers")
# A parameter in a list of blocks: the path up to its first index names the list (`model.layers`, afm7's
# `model.kv_reuse_layers`, GPT-2's `h`, a vision tower's), the index the block
BLOCK = re.compile(r"^(.*?)\.(\d+)\.")


def check_against_weights(config: dict[str, Any], weights: dict[str, mx.array], source: str | Path) -> None:
    """Refuse, before building anything, a config the weights cannot fill: more layers than the weights have
    blocks (a config claiming 2**31 layers would otherwise allocate for minutes), or a quantization block of the
    wrong types."""
    blocks = len({m.groups() for name in weights if (m := BLOCK.match(name))})
    text_config = config.get("text_config")
    for where, part in (("", config), ("text_config.", text_config if isinstance(text_config, dict) else {})):
        for key in LAYER_COUNT_KEYS:
            count = part.get(key)
            if isinstance(count, int) and not isinstance(count, bool) and count > blocks:
                raise FormatError(source, f"config says {where}{key}={count}, the weights hold {blocks} layers")
    quantization = config.get("quantization")
    if quantization is None:
        return
    if not isinstance(quantization, dict):
        raise FormatError(source, f"config's quantization is {quantization!r}, not an object")
    for path, value in [("", quantization), *((k, v) for k, v in quantization.items() if isinstance(v, dict))]:
        for key in ("group_size", "bits"):
            if key in value or not path:
                v = value.get(key)
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    where = f"{path}.{key}" if path else key
                    raise FormatError(source, f"config's quantization {where} is {v!r}, not a positive integer")
        if not isinstance(value.get("mode", "affine"), str):
            raise FormatError(source, f"config's quantization mode is {value.get('mode')!r}, not a name")


def build_tokenizer(
    side_files_dir: Path, tokenizer_config: dict | None = None, eos_token_ids: Any = None
) -> TokenizerWrapper:
    """mlx_lm's TokenizerWrapper from a directory holding tokenizer.json / tokenizer_config.json (through the
    tokenizer fast path where the directory keeps its facts)."""
    return tokenizer.load(Path(side_files_dir), tokenizer_config, eos_token_ids=eos_token_ids)


def assemble(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    side_files: Path,
    source: str | Path,
    *,
    tokenizer_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    lazy: bool = False,
    trust_remote_code: bool = False,
    sanitized: bool = False,
) -> tuple[nn.Module, TokenizerWrapper]:
    """(model, tokenizer) as mlx_lm.load builds them: the model first (model_config may set the eos ids the
    tokenizer then takes from config). `source`: the model the user named (errors name it, and a trusted
    `model_file` is looked up beside it). `sanitized`: as for build_model."""
    if model_config:
        config.update(model_config)
    model = source_model(config, weights, side_files, source, lazy=lazy, trust_remote_code=trust_remote_code,
                         sanitized=sanitized)
    return model, model_tokenizer(config, side_files, source, tokenizer_config, trust_remote_code)


def source_model(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    side_files: Path,
    source: str | Path,
    *,
    lazy: bool = False,
    trust_remote_code: bool = False,
    sanitized: bool = False,
) -> nn.Module:
    """build_model for the model `source` names (assemble's model half): mlx_lm's complaints about it become a
    FormatError naming `source`."""
    model_dir = Path(source) if Path(source).is_dir() else side_files
    try:
        return build_model(config, weights, lazy=lazy, model_dir=model_dir, trust_remote_code=trust_remote_code,
                           sanitized=sanitized)
    except SquishError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, AttributeError) as e:
        # mlx_lm's own complaint (a weight of the wrong shape, a config it cannot build), with the model's name
        raise FormatError(source, f"config and weights do not make a {config.get('model_type')} model: {e}") from e


def model_tokenizer(
    config: dict[str, Any],
    side_files: Path,
    source: str | Path,
    tokenizer_config: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> TokenizerWrapper:
    """The tokenizer of the model `source` from its side files, with the eos ids its config sets."""
    try:
        # trust_remote_code passed explicitly: transformers would otherwise *ask* on a terminal whether to run a
        # tokenizer_config.json's custom code (auto_map); the answer is the caller's, and it defaults to no.
        return build_tokenizer(side_files, {"trust_remote_code": trust_remote_code, **(tokenizer_config or {})},
                               eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed tokenizer.json
        raise FormatError(source, f"cannot load its tokenizer files: {type(e).__name__}: {e}") from e

