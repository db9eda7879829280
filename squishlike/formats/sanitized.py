"""A reader's tensors as mlx_lm sees them: under the model's own parameter names, after its `sanitize`.

For a family without a rule table (squishlike/arch) the provider wraps an HF, MLX or Ollama reader in this view:
the model class is built from config.json (parameters unevaluated: no memory), its `sanitize` runs over the
stored tensors (lazy arrays: nothing is read yet), and what comes out, renamed, stacked (MoE experts), split or
dropped, is what the view lists and reads, exactly what mlx_lm.load would bind. Not an on-disk format, so not in
READERS.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..errors import MissingTensorError
from .base import FormatReader, QuantizedTensor, TensorInfo
from .safetensors import dtype_name


class SanitizedReader(FormatReader):
    naming = "mlx"

    def __init__(self, inner: FormatReader):
        super().__init__(inner.path)
        self.inner = inner
        self.format_name = inner.format_name
        stored = inner.tensors()
        source = {name: inner.read(name) for name in stored}
        weights = self._sanitize(source)
        # The tensors sanitize hands back untouched (the very array it was given) keep the file's own facts (its
        # quantized dtype and bytes on disk) and its quantized triple.
        self._untouched = {name for name, a in weights.items() if source.get(name) is a}
        self._infos = {
            name: stored[name] if name in self._untouched else
            TensorInfo(name, tuple(a.shape), dtype_name(a.dtype), a.nbytes)
            for name, a in weights.items()
        }
        self._pending = weights

    def _sanitize(self, source: dict[str, mx.array]) -> dict[str, mx.array]:
        from ..model import new_model  # imports mlx_lm

        model = new_model(self.inner.config(), self.path)
        return model.sanitize(dict(source)) if hasattr(model, "sanitize") else dict(source)

    @classmethod
    def detect(cls, path: Path) -> bool:
        return False  # a view over another reader, never opened by detection

    def config(self) -> dict:
        return self.inner.config()

    def tensors(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def read(self, name: str) -> mx.array:
        """The sanitized tensor, lazy. Handed-out arrays are not kept (evaluated, they would pin the model in
        memory); a tensor read twice is sanitized again."""
        if name not in self._infos:
            raise MissingTensorError(self.path, name)
        if name not in self._pending:
            self._pending = self._sanitize({n: self.inner.read(n) for n in self.inner.tensors()})
        return self._pending.pop(name)

    def read_quantized(self, name: str) -> QuantizedTensor | None:
        return self.inner.read_quantized(name) if name in self._untouched else None

    def file_of(self, name: str) -> Path:
        return self.inner.file_of(name) if name in self._untouched else self.path

    def write_side_files(self, dest: Path) -> list[Path]:
        return self.inner.write_side_files(dest)

    def close(self) -> None:
        self._pending = {}
        self.inner.close()
