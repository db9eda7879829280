"""On-disk formats, one module each, all behind `FormatReader` (formats/base.py).

Adding a format means adding a module and one line in READERS. Order matters only where two formats could claim
the same path: the more specific one comes first (an npy-dir also holds config.json; an MLX directory is an HF
directory plus quantization).
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from ..errors import ModelNotFoundError, UnknownFormatError
from ..npydir import MANIFEST, is_npydir
from .base import FormatReader, QuantizedTensor, TensorInfo

# What `squishlike export` writes (exporter.py): an HF safetensors directory, an MLX directory, an Ollama store. Here,
# not in exporter.py, which imports mlx_lm and transformers (0.9 s), so that the CLI's parser can name them cheaply.
EXPORT_TARGETS = ("hf", "mlx", "ollama")

# (module, class) pairs, imported on first use so that `import squishlike` stays cheap.
READERS: list[tuple[str, str]] = [
    ("npydir", "NpyDirReader"),
    ("ollama", "OllamaReader"),
    ("gguf", "GGUFReader"),
    ("mlx", "MLXReader"),
    ("safetensors", "HFReader"),
]


def reader_classes() -> list[type[FormatReader]]:
    return [getattr(import_module(f"{__name__}.{module}"), cls) for module, cls in READERS]


def detect_format(path: str | Path) -> type[FormatReader]:
    """The reader class for `path`, judged by content. UnknownFormatError names what was looked for."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(str(path), "no such file or directory")
    for reader in reader_classes():
        if reader.detect(path):
            return reader
    # the two half-models mlx_lm.load names, in its words
    if is_npydir(path, damaged=True):  # a damaged npy-dir: name its manifest
        raise UnknownFormatError(path, f"{path / MANIFEST} is not a squishlike npy-dir manifest (not a JSON "
                                       "object of its format) and there are no *.safetensors")
    if path.is_dir() and (path / "config.json").is_file():
        raise UnknownFormatError(path, f"No safetensors found in {path}: it has a config.json but no *.safetensors")
    if path.is_dir() and any(path.glob("*.safetensors")):
        raise UnknownFormatError(path, "config.json not found: it has *.safetensors weights but no config.json")
    raise UnknownFormatError(
        path,
        "not a model squishlike reads (looked for: squishlike npy-dir manifest.json, Ollama manifest, "
        "GGUF magic, config.json with *.safetensors)",
    )


def open_reader(path: str | Path) -> FormatReader:
    return detect_format(path)(Path(path))


__all__ = ["FormatReader", "QuantizedTensor", "TensorInfo", "READERS", "detect_format", "open_reader"]
