"""Which cache tier serves a load on the device at hand: the one that makes time to first token shortest.

Load time alone would always pick the int4 tier (it reads a quarter of the bytes), but what follows the load
decides: MLX's quantized matmul is fast on Metal and CUDA, and slow on `mlx[cpu]`. Measured on this project's
Linux `mlx[cpu]` VM with a 1.5B Qwen2.5 model (docs/design.md §6.3): 0.12 tokens/s generated from the int4 tier
against 0.78 from the bf16 mlx tier, prompt processing 0.11 against 1.7 tokens/s, so a time to first token ~10x
worse from int4 although it loads fastest. On a GPU the quantized tiers also read and hold 4x fewer bytes, and
the matmuls that bound generation read them too: on an NVIDIA H200 with `mlx[cuda]` (§6.4), 201 tokens/s from the
int4 tier against 183 from the bf16 model, and an in-process load of 0.46 s against 0.88 s.

PREFERENCE keeps that data: by MLX device type (`mx.default_device().type`, where the model runs), the tier names
fastest first. A tier not named there goes last, in registry order; a new tier adds its name to each row.

CACHES says whether, by default, a first load writes the tier it would take at all: a cache is only worth its
disk where loading it is measurably faster than the cold path reading the store itself (docs/design.md §4.4).

FROM_STORE says whether the quantized tiers are read straight from the store's parts instead of from a built copy:
the store holds them in MLX's own packing, so where they come first (a GPU) the store is the quantized model and no
second copy of the weights is written.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .base import Tier

PREFERENCE: dict[str, tuple[str, ...]] = {
    "gpu": ("int4", "int8", "int3", "mlx", "finalized"),
    "cpu": ("mlx", "finalized", "int4", "int8", "int3"),
}
WHY: dict[str, str] = {
    "gpu": "quantized matmul is fast on the GPU, and the quantized tiers read a quarter of the bytes",
    "cpu": "quantized matmul is slow on mlx[cpu] (measured ~6x slower generation, ~10x slower first token than "
           "bf16), so the dense tiers come first",
}

# On mlx[cpu] the cold path (Rust dequantization of an INT4 store at memory speed) loaded the 1.5B-shaped model
# about as fast as the dense mlx tier warm (whole process 3.39 s against 3.30 s) and faster evicted (3.52 s against
# 4.95 s), while the tier took 2.6x the store's disk. On a GPU the quantized tier loads as QuantizedLinear.
CACHES: dict[str, bool] = {"gpu": True, "cpu": False}
# Reading the parts straight from the store loaded the 1.5B-shaped INT4 model on mlx[cpu] within noise of the built
# int4 tier's one file (benchmarks/bench_from_store.py); on CPU the quantized tiers are only loaded when forced.
FROM_STORE: dict[str, bool] = {"gpu": True, "cpu": False}


def caches_by_default(device: str | None = None) -> bool:
    """Whether a first load under the default policy writes a cache tier on `device` (default: this one)."""
    return CACHES.get(device or device_kind(), True)


def from_store_here(device: str | None = None) -> bool:
    """Whether loads on `device` (default: this one) read the quantized tiers straight from the store."""
    return FROM_STORE.get(device or device_kind(), False)


def device_kind() -> str:
    """'gpu' or 'cpu': the type of the device MLX runs the model on (Metal and CUDA are 'gpu')."""
    return mx.default_device().type.name


def ordered(tiers: Sequence[Tier], device: str | None = None) -> list[Tier]:
    """`tiers` fastest first on `device` (default: this one), by PREFERENCE."""
    preference = PREFERENCE.get(device or device_kind(), ())
    rank = {name: i for i, name in enumerate(preference)}
    return sorted(tiers, key=lambda t: rank.get(t.name, len(rank)))  # stable: the rest keep registry order


def reason(device: str | None = None) -> str:
    """Why the order on `device` is what it is, for `inspect`."""
    device = device or device_kind()
    return f"on {device}, {WHY.get(device, 'no measured order: registry order')}"
