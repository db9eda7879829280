"""A load whose expert stacks stay in the store (budget.py decides when): everything else resident, read from the
store's parts as the quantized tier's load reads them, and each expert stack replaced by one that reads its routed
experts on demand into one cache (experts.py) holding the bytes the budget leaves."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from ..npydir import NpyDir
from .budget import Budget
from .experts import ExpertCache, stream_experts

log = logging.getLogger("squishlike")


def load_streamed(store: NpyDir, budget: Budget, *, verify: bool, tokenizer_config: dict[str, Any] | None,
                  model_config: dict[str, Any] | None, trust_remote_code: bool) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, config) of `store` with its experts streamed within `budget`."""
    from ..model import model_tokenizer, source_model
    from ..tiers import BY_NAME, order
    from ..tiers.base import keep_uncast

    store.check_side_files(verify)
    config = {**store.config(), **(model_config or {})}
    tokenizer = model_tokenizer(config, store.path, store.path, tokenizer_config, trust_remote_code)
    # The quantized tier read from the store, lazily: the expert stacks' arrays are never evaluated, so never read.
    loaded = BY_NAME["int4"].from_store(store, lazy=True, verify=verify)
    config = {**loaded.config, **(model_config or {})}
    model = source_model(config, loaded.weights, store.path, store.path, lazy=True,
                         trust_remote_code=trust_remote_code)
    del loaded
    cache = ExpertCache(store, list(budget.stacks.values()), budget.cache, budget.gathered)
    stream_experts(model, budget.stacks, cache)
    keep_uncast(model, store)
    mx.eval(model.parameters())
    if order.device_kind() == "cpu":  # the resident quantized layers take mlx[cpu]'s fast matmuls, as in load
        from ..cpu_layers import use_cpu_kernels

        use_cpu_kernels(model)
    log.info("%s: experts streamed from the store: %.2f GB resident, a cache of %.2f GB for %.2f GB of experts "
             "(max_memory %.2f GB)", store.path, budget.resident / 1e9, budget.cache / 1e9, budget.experts / 1e9,
             budget.max_memory / 1e9)
    return model, tokenizer, config
