"""`squishlike.load`: the drop-in for `mlx_lm.load`.

An npy-dir goes through the tier decision tree (squishlike/tiers); any other format the provider reads (HF,
MLX, GGUF, Ollama) loads straight through the provider. Either way the result is what mlx_lm.load returns.

Why mlx_lm is imported inside `load`, not here: importing it (and with it transformers) takes about a second of
single-threaded Python, and on a machine where fresh memory faults in slowly (memory.small_pages_slow) the other
big cost of a warm load is that fault-in. So `load` of an npy-dir starts it there (and a read-ahead of evicted tier
files, everywhere) on a background thread (tiers.prepare_memory: threads that only call madvise and fadvise),
imports meanwhile (without transformers' AutoTokenizer registry, which it never uses: mlx_lm_import.py) and
builds the tokenizer; then it reads the weights and builds the model (docs/design.md §2.4, §3).
Everything that touches MLX or imports mlx_lm stays on this thread: importing mlx_lm creates an MLX stream
(mlx_lm.generate's), and MLX streams belong to the thread that made them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .npydir import NpyDir, is_npydir
from .hub import resolve
from .mlx_lm_import import import_mlx_lm
from .tiers.load import load_weights, verify_wanted
from .tiers import decide, order
from .tiers.prepare import prepare_memory, release_memory

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

log = logging.getLogger("squishlike")


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
    verify: bool | None = None,
    max_memory: int | str | None = None,
) -> tuple[nn.Module, TokenizerWrapper] | tuple[nn.Module, TokenizerWrapper, dict[str, Any]]:
    """Load a model and its tokenizer; same arguments and result as `mlx_lm.load`, plus `tier=`.

    `tier` forces one tier of an npy-dir ("int4", "int8", "int3", "mlx", "finalized", "cold"); a forced tier
    that is not ready raises TierNotReadyError (one its policy names but never built is built first). Without it
    the first ready tier in this device's order wins: the store's own quantized tier, read straight from its parts
    with nothing written (docs/format.md §9); a store whose policy names its tiers (compress --tiers) has them
    built by its first load, for every later process. On mlx[cpu] the quantized layers take its fast matmuls
    (squishlike/cpu_layers.py).
    The first load checks every store file against the manifest's fast hash (XXH3; SHA-256 in a store written
    before XXH3 was recorded), so a damaged store fails naming the file and never becomes a cache.

    `verify=True` (or SQUISHLIKE_VERIFY=1 in the environment) checks every recorded hash, SHA-256 too, and also
    hashes a cache tier's files against its sentinel before loading them; a damaged tier is then skipped and
    rebuilt. (An Ollama blob is always checked
    against its digest; other formats record no checksum.)

    `max_memory` (bytes, or a size such as "3GB") bounds the model's memory (squishlike/load/budget.py): a model
    that fits loads as without it; an npy-dir of a mixture of experts that does not keeps its expert stacks in the
    store, reading each token's routed experts into a cache of the bytes left (the same tokens and logits as the
    resident load; `squishlike.load.experts.expert_cache(model).stats` counts hits and bytes read); any other
    model over the budget raises MemoryBudgetError naming both sizes before anything is read.
    """
    path = resolve(path_or_hf_repo, revision)
    options = {"tokenizer_config": tokenizer_config, "model_config": model_config, "lazy": lazy,
               "trust_remote_code": trust_remote_code}
    if max_memory is not None:
        streamed = _load_within(path, max_memory, tier, verify, tokenizer_config, model_config, trust_remote_code)
        if streamed is not None:
            model, tokenizer, config = streamed
            return _finish(model, tokenizer, config, adapter_path, return_config)
    if is_npydir(path):
        store = NpyDir(path)
        plan = decide(store, tier)  # the tier question, asked once: memory, the load and its log read the answer
        prepare_memory(store, lazy=lazy, plan=plan)  # fault in the weights' memory on a background thread
        try:
            import_mlx_lm()  # ~1 s of imports (transformers too), beside the fault-in; on this thread

            from .model import model_tokenizer, source_model

            started = time.perf_counter()
            verify = verify_wanted(verify)
            store.check_side_files(verify)  # what the tokenizer reads, checked before it does
            config = {**store.config(), **(model_config or {})}  # the eos ids the tokenizer takes, as mlx_lm's
            tokenizer = model_tokenizer(config, store.path, store.path, tokenizer_config, trust_remote_code)
            tokenizer_s = time.perf_counter() - started
            loaded = load_weights(store, tier, lazy, verify, plan=plan)
            seconds = time.perf_counter() - started - tokenizer_s
            log.debug("%s: weights from the %s tier in %.3f s", store.path, loaded.tier, seconds,
                      extra={"load_phases": {"tier": loaded.tier, "weights_s": seconds, "tokenizer_s": tokenizer_s}})
        finally:
            release_memory()  # a reservation no load used (an error before load_weights)
        from .tiers.base import keep_uncast

        config = {**loaded.config, **(model_config or {})}
        model = source_model(config, loaded.weights, store.path, store.path, lazy=lazy,
                             trust_remote_code=trust_remote_code)
        keep_uncast(model, store, lazy)  # what mlx_lm keeps in float32 in a bf16 model, from the store
        if order.device_kind() == "cpu":  # a store's quantized layers take mlx[cpu]'s fast matmuls (cpu_layers.py)
            from .cpu_layers import use_cpu_kernels

            use_cpu_kernels(model)
    else:
        if tier is not None:
            raise ValueError(f"{path_or_hf_repo}: tier= applies to squishlike npy-dirs only (see `squishlike compress`)")
        from .provider import WeightProvider

        with WeightProvider.open(path) as provider:
            model, tokenizer, config = provider.build_model(**options)
    return _finish(model, tokenizer, config, adapter_path, return_config)


def _finish(model, tokenizer, config, adapter_path, return_config):
    """The model with its adapter, if any, as mlx_lm.load returns it."""
    if adapter_path is not None:
        from mlx_lm.utils import load_adapters

        model = load_adapters(model, adapter_path)
        model.eval()
    return (model, tokenizer, config) if return_config else (model, tokenizer)


def _load_within(path: Path, max_memory: int | str, tier: str | None, verify: bool | None,
                 tokenizer_config: dict[str, Any] | None, model_config: dict[str, Any] | None,
                 trust_remote_code: bool) -> tuple | None:
    """A load under max_memory (squishlike/load/budget.py): None when the whole model fits (the load goes on as
    without a budget), the streamed (model, tokenizer, config) of a MoE npy-dir that does not fit;
    MemoryBudgetError, before any weight is read, for any other model that does not fit."""
    from .load.budget import check_fits, expert_stacks, parse_size, plan_budget

    max_memory = parse_size(max_memory)
    if not is_npydir(path):
        check_fits(path, max_memory)
        return None
    store = NpyDir(path)
    import_mlx_lm()
    config = {**store.config(), **(model_config or {})}
    budget = plan_budget(store, max_memory, expert_stacks(store, config, trust_remote_code))
    if budget is None:
        return None
    if tier is not None:
        raise ValueError(f"{path}: tier={tier} and a max_memory its model exceeds: its experts are streamed from "
                         "the store, not loaded from a tier")
    from .load.streamed import load_streamed

    return load_streamed(store, budget, verify=verify_wanted(verify), tokenizer_config=tokenizer_config,
                         model_config=model_config, trust_remote_code=trust_remote_code)
