"""The one small interface every on-disk format implements.

A reader knows one file layout and nothing about canonical names: it lists the tensors under the names the file
spells, reads one tensor's bytes on request, and rebuilds the model's side files (config.json, tokenizer). The
provider (squishlike.provider) maps its names to canonical ones through the architecture's rule table, choosing
the table column named by `naming`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import mlx.core as mx

from ..errors import SquishError


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file stores it."""

    name: str  # the name as the file spells it
    shape: tuple[int, ...]  # logical (dequantized) shape, numpy order
    dtype: str  # "float32", "float16", "bfloat16", or a quant type: "Q4_1", "affine4", "mxfp4", "int8" ...
    nbytes: int  # bytes it occupies on disk
    quantized: bool = False


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


class FormatReader(ABC):
    """Reads one model format. Subclasses live one per file in squishlike/formats/ and register in __init__."""

    format_name: ClassVar[str]  # "hf", "mlx", "gguf", "ollama", "npydir"
    naming: ClassVar[str]  # which arch-table column the names use: "hf", "gguf" or "canonical"
    # What verify() checks, for `squishlike verify` to say. A format without checksums says so.
    verifies: ClassVar[str] = "no checksums in this format; checked the headers and that every tensor reads"

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    @abstractmethod
    def detect(cls, path: Path) -> bool:
        """True when `path` holds this format, judged by content (magic bytes, files present)."""

    @abstractmethod
    def config(self) -> dict:
        """The model's config as a config.json-style dict (GGUF builds it from metadata)."""

    @abstractmethod
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor, keyed by the file's own name. A quantized triple is one entry (its weight's name)."""

    @abstractmethod
    def read(self, name: str) -> mx.array:
        """One tensor, dequantized where stored quantized, reading only its bytes. Floats keep their dtype."""

    def read_quantized(self, name: str) -> QuantizedTensor | None:
        """The MLX-layout quantized triple when the file stores `name` that way, else None."""
        return None

    def verify(self) -> list[str]:
        """Problems found checking what the format allows (`verifies`); [] when none. Opening the reader has
        parsed the headers; here every tensor is read once, so one whose bytes lie outside its file is named."""
        problems = []
        for name in self.tensors():
            try:
                mx.eval(self.read(name))
            except (SquishError, ValueError, OSError) as e:
                problems.append(f"{self.path}: {name}: {e}")
        return problems

    @abstractmethod
    def write_side_files(self, dest: Path) -> list[Path]:
        """Copy or rebuild config.json, tokenizer files, generation_config.json, chat template into `dest`."""

    def close(self) -> None:
        """Release file handles and maps."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
