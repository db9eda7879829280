"""`squishlike.load`: the drop-in for `mlx_lm.load`.

An npy-dir goes through the tier decision tree (squishlike/tiers); any other format the provider reads (HF,
MLX, GGUF, Ollama) loads straight through the provider. Either way the result is what mlx_lm.load returns.

Why mlx_lm is imported inside `load`, not here: importing it (and with it transformers) takes about a second of
single-threaded Python, and the other big cost of a warm load is faulting in the fresh memory the weights land in.
So `load` of an npy-dir starts that fault-in (and a read-ahead of evicted tier files) on a background thread
(tiers.prepare_memory: threads that only call madvise and fadvise) and imports meanwhile; then it reads the
weights into the faulted memory, builds the model, then the tokenizer (docs/design.md §3).
Everything that touches MLX or imports mlx_lm stays on this thread: importing mlx_lm creates an MLX stream
(mlx_lm.generate's), and MLX streams belong to the thread that made them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import FormatError, SquishError
from .npydir import NpyDir
from .hub import resolve_local
from .tiers import load_weights, prepare_memory, release_memory

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper


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
        prepare_memory(store, tier, lazy)  # fault in the weights' memory on a background thread
        try:
            import mlx_lm  # noqa: F401  ~1 s of imports (transformers too), beside the fault-in; on this thread

            loaded = load_weights(store, tier, lazy)
        finally:
            release_memory()  # a reservation no load used (an error before load_weights)
        config = loaded.config
        model, tokenizer = _assemble(config, loaded.weights, store.path, tokenizer_config, model_config, lazy,
                                     trust_remote_code, source=store.path)
    else:
        if tier is not None:
            raise ValueError(f"{path_or_hf_repo}: tier= applies to squishlike npy-dirs only (see `squishlike compress`)")
        from .config import load_config
        from .provider import WeightProvider

        with WeightProvider.open(path if path is not None else path_or_hf_repo) as provider:
            weights = {provider.mlx_name(n): provider.get(n) for n in provider.names()}
            with tempfile.TemporaryDirectory(prefix="squishlike-side-") as side_files:
                provider.write_side_files(Path(side_files))
                config = load_config(Path(side_files))
                model, tokenizer = _assemble(config, weights, Path(side_files), tokenizer_config, model_config, lazy,
                                             trust_remote_code, source=provider.reader.path)
    if adapter_path is not None:
        from mlx_lm.utils import load_adapters

        model = load_adapters(model, adapter_path)
        model.eval()
    return (model, tokenizer, config) if return_config else (model, tokenizer)


def _assemble(config, weights, side_files: Path, tokenizer_config, model_config, lazy, trust_remote_code, source):
    """(model, tokenizer) as mlx_lm.load builds them: the model first (model_config may set the eos ids the
    tokenizer then takes from config). `source`: the model the user named (errors name it, and a trusted
    `model_file` is looked up beside it)."""
    model = _model(config, weights, model_config, lazy, trust_remote_code, side_files, source)
    tokenizer = _tokenizer(side_files, source, tokenizer_config, trust_remote_code, config.get("eos_token_id"))
    return model, tokenizer


def _model(config, weights, model_config, lazy, trust_remote_code, side_files: Path, source) -> nn.Module:
    """The mlx_lm model (_model and _tokenizer are separate functions so that the benchmark can time each)."""
    from .model import build_model

    if model_config:
        config.update(model_config)
    model_dir = Path(source) if Path(source).is_dir() else side_files
    try:
        return build_model(config, weights, lazy=lazy, model_dir=model_dir, trust_remote_code=trust_remote_code)
    except SquishError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, AttributeError) as e:
        # mlx_lm's own complaint (a weight of the wrong shape, a config it cannot build), with the model's name
        raise FormatError(source, f"config and weights do not make a {config.get('model_type')} model: {e}") from e


def _tokenizer(side_files: Path, source, tokenizer_config, trust_remote_code, eos_token_ids) -> TokenizerWrapper:
    from .model import build_tokenizer

    try:
        # trust_remote_code passed explicitly: transformers would otherwise *ask* on a terminal whether to run a
        # tokenizer_config.json's custom code (auto_map); the answer is the caller's, and it defaults to no.
        return build_tokenizer(side_files, {"trust_remote_code": trust_remote_code, **(tokenizer_config or {})},
                               eos_token_ids=eos_token_ids)
    except Exception as e:  # tokenizers raises a bare Exception for a malformed tokenizer.json
        raise FormatError(source, f"cannot load its tokenizer files: {type(e).__name__}: {e}") from e
