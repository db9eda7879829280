"""What a load under a memory budget (`load(path, max_memory=...)`) does, decided from the manifest before
anything is read: the whole model when it fits; when it does not, a MoE model's expert stacks streamed from the
store with the rest resident and a cache of experts in the bytes left; any other model refused, naming both sizes.

The sizes are what the resident load holds: a group-wise tensor's codes as stored (MLX's words), its scales and
biases in the runtime dtype; every other tensor in the runtime dtype.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..dtypes import NP_STORAGE
from ..errors import MemoryBudgetError, SquishError
from ..npydir import NpyDir
from ..npydir.manifest import TensorEntry


def parse_size(text: str | int) -> int:
    """Bytes from "8GB", "512MB", "8G" or a plain number (powers of ten, as mlx_lm's --prompt-cache-bytes)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)B?", text.strip().upper())
    if match is None:
        raise ValueError(f"{text!r}: expected a size such as 8GB or 512MB")
    return int(float(match[1]) * 1000 ** " KMGT".index(match[2] or " "))


def held_bytes(store: NpyDir, entry: TensorEntry) -> int:
    """The bytes one tensor takes in memory in the resident load of `store`."""
    runtime = np.dtype(NP_STORAGE[store.runtime_dtype]).itemsize
    if not entry.kind.grouped:
        return math.prod(entry.shape) * runtime
    codes, *scales = entry.kind.suffixes
    dtype, shape = entry.part_spec(codes)
    return math.prod(shape) * dtype.itemsize + sum(math.prod(entry.part_spec(s)[1]) * runtime for s in scales)


@dataclass(frozen=True)
class Budget:
    """A streamed load's memory: the resident part, the experts' stored bytes, the cache of experts, and the most a
    call gathers at once (one stack's experts, all of them in a long prompt), which the budget also holds."""

    max_memory: int
    resident: int
    experts: int
    cache: int
    gathered: int
    stacks: dict[str, str]  # module path of each streamed expert stack -> its stored tensor


@dataclass(frozen=True)
class Held:
    """What a load holds in memory, by stored tensor name: each tensor it keeps, as the load that streams nothing
    holds it; and each expert stack's experts in the store's quantized form, as a streamed load caches them."""

    tensors: dict[str, int]
    streamed: dict[str, int]


def plan_budget(store: NpyDir, max_memory: int, stacks: dict[str, str], held: Held | None = None) -> Budget | None:
    """None when the whole model fits `max_memory`; the Budget of a streamed load when its group-wise expert
    stacks (`stacks`: module path -> stored tensor, of every SwitchLinear; see expert_stacks) can be streamed
    within it. MemoryBudgetError naming the store and both sizes otherwise: nothing has been read.

    `held`: the tensors' sizes (a sharded rank's share: what it keeps of each, dense); default: every tensor as
    the resident load holds it."""
    held = held or resident_held(store)
    whole = sum(held.tensors.values())
    if whole <= max_memory:
        return None
    if not any(store.entries[name].kind.grouped for name in stacks.values()):
        raise MemoryBudgetError(store.path, f"needs {_gb(whole)} in memory and max_memory is {_gb(max_memory)}; "
                                            "it has no expert stacks stored group-wise to stream from the store")
    if store.version < 2:
        raise MemoryBudgetError(store.path, f"needs {_gb(whole)}, more than max_memory {_gb(max_memory)}, and its "
                                            "experts are streamed from format 2's packs only: compress it again")
    budget = streamed_budget(store, stacks, 0, held)
    cache = max_memory - budget.max_memory
    if cache < budget.gathered:  # a call's experts must all be in the cache at once: memory_figures' least
        raise MemoryBudgetError(store.path, f"needs {_gb(whole)} in memory, or at least "
                                            f"{_gb(budget.max_memory + budget.gathered)} with its experts streamed "
                                            f"({_gb(budget.resident)} resident, and one layer's largest expert "
                                            f"stack twice: cached and gathered); max_memory is {_gb(max_memory)}")
    return streamed_budget(store, stacks, cache, held)


def resident_held(store: NpyDir) -> Held:
    """What the resident load holds: each tensor's held_bytes, a stack's experts the same streamed or not."""
    tensors = {name: held_bytes(store, entry) for name, entry in store.entries.items()}
    return Held(tensors, tensors)


def streamed_budget(store: NpyDir, stacks: dict[str, str], cache: int, held: Held | None = None) -> Budget:
    """The Budget of a streamed load of `store` whose cache of experts holds `cache` bytes (the benchmark sets it
    as a share of the experts' bytes; plan_budget, from max_memory); `held` as plan_budget's."""
    held = held or resident_held(store)
    streamed = {path: name for path, name in stacks.items() if store.entries[name].kind.grouped}
    sizes = [held.streamed[name] for name in streamed.values()]
    resident = sum(size for name, size in held.tensors.items() if name not in streamed.values())
    gathered = max(sizes)
    return Budget(resident + gathered + cache, resident, sum(sizes), cache, gathered, streamed)


def memory_figures(store: NpyDir) -> dict:
    """What `inspect` says of a store's memory: the resident load's bytes, and for a MoE model its streamable
    expert stacks' bytes and the least max_memory a streamed load takes (None without such stacks)."""
    whole = sum(held_bytes(store, entry) for entry in store.entries.values())
    try:
        stacks = expert_stacks(store, store.config())
    except (SquishError, ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, AttributeError):
        # no model mlx_lm builds from this config (a load says why): no stacks to stream
        stacks = {}
    if not any(store.entries[name].kind.grouped for name in stacks.values()):
        return {"resident_load": whole, "experts": 0, "expert_stacks": 0, "least_max_memory": None}
    budget = streamed_budget(store, stacks, 0)
    return {"resident_load": whole, "experts": budget.experts, "expert_stacks": len(budget.stacks),
            "least_max_memory": budget.max_memory + budget.gathered}


def expert_stacks(store: NpyDir, config: dict, trust_remote_code: bool = False) -> dict[str, str]:
    """Module path -> stored tensor name, of each expert stack (mlx_lm's SwitchLinear) of the model `config`
    describes that the store holds. The model is built unevaluated (nothing allocated), once the config is checked
    against the store's tensors as every load checks it (a config claiming more layers than stored is refused)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    from ..model import check_against_weights, new_model
    from ..tiers.base import mlx_names

    stored = {mlx_name: name for name, mlx_name in mlx_names(store).items()}
    check_against_weights(config, dict.fromkeys(stored), store.path)
    model = new_model(config, store.path, trust_remote_code)
    return {path: stored[f"{path}.weight"] for path, module in model.named_modules()
            if isinstance(module, (SwitchLinear, QuantizedSwitchLinear)) and f"{path}.weight" in stored}


def files_bytes(path: str | Path) -> int:
    """The bytes of a model's files on disk (a GGUF file, a checkpoint directory): what loading it takes, about."""
    root = Path(path)
    if root.is_file():
        return root.stat().st_size
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())


def check_fits(path: str | Path, max_memory: int) -> None:
    """A model of another format (read whole, never streamed): MemoryBudgetError when its files exceed the budget."""
    needed = files_bytes(path)
    if needed > max_memory:
        raise MemoryBudgetError(path, f"needs about {_gb(needed)} in memory (its files) and max_memory is "
                                      f"{_gb(max_memory)}; only an npy-dir's experts can be streamed")


def _gb(nbytes: int) -> str:
    """A size as people read it: 3.20 GB, 1.05 MB; exact bytes below a megabyte."""
    if nbytes >= 10**9:
        return f"{nbytes / 1e9:.2f} GB ({nbytes} bytes)"
    return f"{nbytes / 1e6:.2f} MB ({nbytes} bytes)" if nbytes >= 10**6 else f"{nbytes} bytes"
