"""Which cache tier serves a load on the device at hand: the one that makes time to first token shortest, at the
least memory.

Load time alone would always pick the int4 tier (it reads a quarter of the bytes), but what follows the load
decides. MLX's quantized matmul is fast on Metal and CUDA: on an NVIDIA H200 with `mlx[cuda]` (docs/design.md
§6.4), 201 tokens/s from the int4 tier against 183 from the bf16 model, and an in-process load of 0.46 s against
0.88 s. On `mlx[cpu]` it is fast in float32 only, and slow in bf16 (0.12 tokens/s generated from mlx_lm's int4
model of the 1.5B shape against 0.78 from bf16, §6.3); a store's quantized layers on a CPU therefore run float32
for generated tokens and a dequantized dense matmul for the prompt (squishlike/cpu_layers.py, §6.5), which keeps
the quantized tiers near the bf16 ones' speed there at a third of their memory (the 1.5B shape: 0.84x the bf16
model's first token, 13.7x mlx_lm's 4-bit model's, at 0.96x the latter's peak memory; benchmarks/README.md).

PREFERENCE keeps that data: by MLX device type (`mx.default_device().type`, where the model runs), the tier names
fastest first. A tier not named there goes last, in registry order; a new tier adds its name to each row.

CACHES says whether, by default, a first load writes the tier it would take at all: a cache is only worth its
disk where loading it is measurably faster than the cold path reading the store itself (docs/design.md §4.4).

FROM_STORE says whether the quantized tiers are read straight from the store's parts instead of from a built copy:
the store holds them in MLX's own packing, so where they come first the store is the quantized model and no
second copy of the weights is written.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .base import Tier

PREFERENCE: dict[str, tuple[str, ...]] = {
    "gpu": ("int4", "int8", "int3", "mlx", "finalized"),
    "cpu": ("int4", "int8", "int3", "mlx", "finalized"),
}
WHY: dict[str, str] = {
    "gpu": "quantized matmul is fast on the GPU, and the quantized tiers read a quarter of the bytes",
    "cpu": "a store's quantized layers run mlx[cpu]'s fast matmuls (float32 for generated tokens, dense for the "
           "prompt), near the bf16 tiers' speed at a third of the memory",
}

# On mlx[cpu] the cold path (Rust dequantization of an INT4 store at memory speed) loaded the 1.5B-shaped model
# about as fast as the dense mlx tier warm (whole process 3.39 s against 3.30 s) and faster evicted (3.52 s against
# 4.95 s), while the tier took 2.6x the store's disk. On a GPU the quantized tier loads as QuantizedLinear.
CACHES: dict[str, bool] = {"gpu": True, "cpu": False}
# Reading the parts straight from the store loaded the 1.5B-shaped INT4 model on mlx[cpu] within noise of the built
# int4 tier's one file (benchmarks/bench_from_store.py).
FROM_STORE: dict[str, bool] = {"gpu": True, "cpu": True}


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
