"""Tier `int8`: an MLX-native 8-bit model directory (`squish_8bit/`), a lossless repack of a group-wise INT8 store.

A group-wise INT8 store already holds MLX's 8-bit affine form: its code bytes are MLX's uint32 words read
little-endian, and its scales and offsets are MLX's scales and biases, so the repack copies bytes and
`mx.dequantize` of this tier equals the cold tier's dequantization bit for bit (docs/format.md §6.3). The weights
stay 8-bit in memory (QuantizedLinear, bits=8): about half the bytes of the bf16 tiers.
"""

from __future__ import annotations

from .quantized import QuantizedTier


class Int8Tier(QuantizedTier):
    name = "int8"
    scheme = "int8g"
    bits = 8
    directory = "squish_8bit"
