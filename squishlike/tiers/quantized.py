"""The MLX-native quantized tiers (`squish_4bit/`, `squish_3bit/` here; `squish_8bit/` in int8.py): each an
MLX model directory.

Built by a lossless repack of the store: the INT4 nibbles reinterpret as MLX's uint32 words, INT3 and
group-wise INT8 are stored in MLX's own layout already, and scales/offsets are kept in the runtime dtype, so
`mx.dequantize` of this tier equals the cold tier's Rust dequantization bit for bit. Tensors stored any other way go in dense. The directory
is a complete mlx_lm model (config.json with "quantization", tokenizer files): `mlx_lm.load` opens it too.

The repack is a byte copy: the store's parts (memory-mapped) and the cold path's dense buffers are streamed into
one safetensors file as they are, checksummed while written.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import numpy as np

from ..config import CONFIG
from ..errors import FormatError
from ..formats.safetensors import Tensor, write_safetensors
from ..io.atomic import copy_file, make_temp_dir, publish_dir, write_json
from ..io.files import read_json
from ..io.sentinel import write_sentinel
from ..npydir import NpyDir
from ..quant import mlx_words
from .base import Loaded, Tier, mlx_names
from .mlx import ALIGN, METADATA, load_safetensors

WEIGHTS = "model.safetensors"


class QuantizedTier(Tier):
    """An MLX model directory; a subclass declares its `directory`, and its files follow from it."""

    scheme: str
    bits: int
    directory: str

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.paths = (cls.directory,)
        cls.sentinel = f".{cls.directory}_ready"

    def unavailable(self, store: NpyDir) -> str | None:
        if self.scheme not in store.manifest.schemes:
            return f"only an {self.scheme} store has one: compress with format={self.scheme}"
        return None

    def needs_dense(self, store: NpyDir) -> set[str]:
        """Only the tensors stored another way: those of the tier's scheme are repacked from the store's parts."""
        return {name for name, entry in store.entries.items() if entry.scheme != self.scheme}

    def nbytes(self, store: NpyDir) -> int:
        with contextlib.suppress(OSError):
            return (store.path / self.directory / WEIGHTS).stat().st_size
        return 0

    def load(self, store: NpyDir, lazy: bool = False) -> Loaded:
        root = store.path / self.directory
        config = self.config(store)
        if _canonical(read_json(root / CONFIG, store.path)) != _canonical(config):  # 32.0 is not 32 here
            raise FormatError(root / CONFIG, "is not the config this tier was built with")
        weights = load_safetensors(root / WEIGHTS, self.tensors(store), store.path, lazy=lazy)
        return Loaded(weights, config, self.name)

    def config(self, store: NpyDir) -> dict:
        """The tier's config.json: the store's, with the quantization its file holds."""
        group_size = min(e.group_size for e in store.entries.values() if e.scheme == self.scheme)
        config = store.config()
        # mlx_lm infers each layer's own group size from its scales' shape; the top level names the common one.
        config["quantization"] = {"group_size": group_size, "bits": self.bits, "mode": "affine"}
        config["quantization_config"] = config["quantization"]
        return config

    def tensors(self, store: NpyDir, dense: dict[str, np.ndarray] | None = None) -> list[Tensor]:
        """What the tier's file holds, in order; with `dense`, the data to write. Each part is memory-mapped only
        while it is written (a callable, opened by write_safetensors): zero-copy views of the store's bytes, never
        all mapped (and counted in RSS) at once."""
        names = mlx_names(store)
        tensors = []
        for name, entry in store.entries.items():
            if entry.scheme == self.scheme:
                q_part, s_part, z_part = entry.kind.suffixes
                lead, cols = list(entry.shape[:-1]), entry.shape[-1]
                words = entry.kind.uint32_cols(cols)
                groups = cols // entry.group_size
                prefix = names[name].removesuffix(".weight")
                sd = entry.scale_dtype
                tensors.append(Tensor(f"{prefix}.weight", "uint32", [*lead, words], self._words(store, name, q_part)))
                tensors.append(Tensor(f"{prefix}.scales", sd, [*lead, groups], _part(store, name, s_part)))
                tensors.append(Tensor(f"{prefix}.biases", sd, [*lead, groups], _part(store, name, z_part)))
            else:
                tensors.append(Tensor(names[name], store.runtime_dtype, entry.shape, dense[name] if dense is not None else None))
        return tensors

    def build(self, store: NpyDir, dense: dict[str, np.ndarray]) -> None:
        self.invalidate(store)
        tensors = self.tensors(store, dense)
        config = self.config(store)

        final = store.path / self.directory
        tmp = make_temp_dir(final)
        try:
            files = {f"{self.directory}/{WEIGHTS}": write_safetensors(tmp / WEIGHTS, tensors, METADATA, align=ALIGN)}
            files[f"{self.directory}/{CONFIG}"] = write_json(tmp / CONFIG, config)
            for rel in store.manifest.side_files:
                if rel != CONFIG:
                    files[f"{self.directory}/{rel}"] = copy_file(store.path / rel, tmp / rel)
            publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        write_sentinel(
            store.path / self.sentinel,
            manifest_fingerprint=store.fingerprint,
            files=files,
            tier=self.name,
            **self.sentinel_extra(store),
        )

    def sentinel_extra(self, store: NpyDir) -> dict:
        return {}

    def _words(self, store: NpyDir, name: str, suffix: str):
        return lambda: mlx_words(self.scheme, store.load_part(name, suffix))


def _canonical(value: dict) -> str:
    return json.dumps(value, sort_keys=True)


def _part(store: NpyDir, name: str, suffix: str):
    return lambda: store.load_part(name, suffix)


class Int4Tier(QuantizedTier):
    name = "int4"
    scheme = "int4"
    bits = 4
    directory = "squish_4bit"


class Int3Tier(QuantizedTier):
    """Only for a store whose 3-bit model passed the accuracy gate at compress time (docs/format.md §6.4)."""

    name = "int3"
    scheme = "int3"
    bits = 3
    directory = "squish_3bit"

    def unavailable(self, store: NpyDir) -> str | None:
        if (no_codes := super().unavailable(store)) or store.manifest.int3_passed:
            return no_codes
        gate = store.manifest.int3_gate or {}
        return f"the store did not pass the INT3 accuracy gate ({gate.get('reason', 'not measured')})"

    def sentinel_extra(self, store: NpyDir) -> dict:
        return {"int3_gate": store.manifest.int3_gate}
