"""A weight in MLX's quantized layout, as the readers hand it over and the npy-dir repacks it: below both the
formats (formats/) and the store (npydir/), which share it."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight in MLX's quantized layout: packed uint32 words, per-group scales and (affine only) biases."""

    weight: mx.array
    scales: mx.array
    biases: mx.array | None
    group_size: int
    bits: int
    mode: str = "affine"  # "affine", "mxfp4", "mxfp8", "nvfp4"

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense tensor's shape: each uint32 word packs 32 / bits values of its last axis."""
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 32 // self.bits)

    def dequantize(self, dtype: mx.Dtype | None = None) -> mx.array:
        w = mx.dequantize(
            self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits, mode=self.mode
        )
        return w if dtype is None else w.astype(dtype)

    def parameters(self, layer: str) -> dict[str, mx.array]:
        """The triple as the quantized module `layer` holds it: `<layer>.weight`, `.scales`, and `.biases` (affine)."""
        parts = {f"{layer}.weight": self.weight, f"{layer}.scales": self.scales}
        if self.biases is not None:
            parts[f"{layer}.biases"] = self.biases
        return parts
