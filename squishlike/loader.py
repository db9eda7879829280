"""`squishlike.load`: the drop-in for `mlx_lm.load`.

An npy-dir goes through the tier decision tree (squishlike/tiers); any other format the provider reads (HF,
MLX, GGUF, Ollama) loads straight through the provider. Either way the result is what mlx_lm.load returns.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_adapters, load_config

from .errors import FormatError, SquishError
from .formats.npydir import NpyDir
from .hub import resolve_local
from .model import build_model, build_tokenizer
from .provider import WeightProvider
from .tiers import load_weights


def load(
    path_or_hf_repo: str | Path,
    tokenizer_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    adapter_path: str | None = None,
    lazy: bool = False,
    return_config: bool = False,
    tier: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[nn.Module, TokenizerWrapper] | tuple[nn.Module, TokenizerWrapper, dict[str, Any]]:
    """Load a model and its tokenizer; same arguments and result as `mlx_lm.load`, plus `tier=`.

    `tier` forces one tier of an npy-dir ("int4", "int3", "mlx", "finalized", "cold"); a forced tier that is
    not ready raises TierNotReadyError. Without it the fastest ready tier wins, and the first load of a fresh
    npy-dir dequantizes the store and builds the caches for every later process.
    """
    path = resolve_local(path_or_hf_repo, revision)
    if path is not None and NpyDir.is_npydir(path):
        store = NpyDir(path)
        loaded = load_weights(store, tier)
        weights, config = loaded.weights, loaded.config
        side_files = store.path
        model, tokenizer = _assemble(
            config, weights, side_files, tokenizer_config, model_config, lazy, trust_remote_code, source=store.path
        )
    else:
        if tier is not None:
            raise ValueError(f"{path_or_hf_repo}: tier= applies to squishlike npy-dirs only (see `squishlike compress`)")
        with WeightProvider.open(path if path is not None else path_or_hf_repo) as provider:
            weights = {provider.mlx_name(n): provider.get(n) for n in provider.names()}
            with tempfile.TemporaryDirectory(prefix="squishlike-side-") as side_files:
                provider.write_side_files(Path(side_files))
                config = load_config(Path(side_files))
                model, tokenizer = _assemble(
                    config, weights, Path(side_files), tokenizer_config, model_config, lazy, trust_remote_code,
                    source=provider.reader.path,
                )
    if adapter_path is not None:
        model = load_adapters(model, adapter_path)
        model.eval()
    return (model, tokenizer, config) if return_config else (model, tokenizer)


def _assemble(config, weights, side_files, tokenizer_config, model_config, lazy, trust_remote_code, source):
    """`source`: the model the user named (errors name it, and a trusted `model_file` is looked up beside it)."""
    if model_config:
        config.update(model_config)
    model_dir = Path(source) if Path(source).is_dir() else side_files
    try:
        model = build_model(config, weights, lazy=lazy, model_dir=model_dir, trust_remote_code=trust_remote_code)
    except SquishError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, AttributeError) as e:
        # mlx_lm's own complaint (a weight of the wrong shape, a config it cannot build), with the model's name
        raise FormatError(source, f"config and weights do not make a {config.get('model_type')} model: {e}") from e
    try:
        # trust_remote_code passed explicitly: transformers would otherwise *ask* on a terminal whether to run a
        # tokenizer_config.json's custom code (auto_map); the answer is the caller's, and it defaults to no.
        tokenizer = build_tokenizer(side_files, {"trust_remote_code": trust_remote_code, **(tokenizer_config or {})},
                                    eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed tokenizer.json
        raise FormatError(source, f"cannot load its tokenizer files: {type(e).__name__}: {e}") from e
    return model, tokenizer
