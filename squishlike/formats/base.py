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
from ..quant.tensor import QuantizedTensor


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file stores it."""

    name: str  # the name as the file spells it
    shape: tuple[int, ...]  # logical (dequantized) shape, numpy order
    dtype: str  # "float32", "float16", "bfloat16", or a quant type: "Q4_1", "affine4", "mxfp4", "int8" ...
    nbytes: int  # bytes it occupies on disk
    quantized: bool = False


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

    def file_of(self, name: str) -> Path:
        """The file that holds tensor `name`, for an error to name (the reader's path where it is one file)."""
        return self.path

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
