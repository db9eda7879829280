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
import shutil

import numpy as np

from ..config import load_config
from ..formats.safetensors import write_safetensors
from ..io.atomic import copy_file, make_temp_dir, publish_dir, write_json
from ..io.sentinel import write_sentinel
from ..npydir import NpyDir
from ..quant import mlx_words
from .base import Loaded, Tier, mlx_names
from .mlx import METADATA, load_safetensors

WEIGHTS = "model.safetensors"


class QuantizedTier(Tier):
    scheme: str
    bits: int
    directory: str

    def wanted(self, store: NpyDir) -> bool:
        return super().wanted(store) and self.scheme in store.manifest.schemes

    def needs_dense(self, store: NpyDir) -> set[str]:
        """Only the tensors stored another way: those of the tier's scheme are repacked from the store's parts."""
        return {name for name, entry in store.entries.items() if entry.scheme != self.scheme}

    def nbytes(self, store: NpyDir) -> int:
        with contextlib.suppress(OSError):
            return (store.path / self.directory / WEIGHTS).stat().st_size
        return 0

    def load(self, store: NpyDir, lazy: bool = False) -> Loaded:
        root = store.path / self.directory
        return Loaded(load_safetensors(root / WEIGHTS, lazy=lazy), load_config(root), self.name)

    def build(self, store: NpyDir, dense: dict[str, np.ndarray]) -> None:
        self.invalidate(store)
        names = mlx_names(store)
        tensors = []
        group_sizes = set()
        for name, entry in store.entries.items():
            if entry.scheme == self.scheme:
                # Each part is memory-mapped only while it is written (a callable, opened by write_safetensors):
                # zero-copy views of the store's bytes, never all mapped (and counted in RSS) at once.
                q_part, s_part, z_part = entry.kind.suffixes
                lead, cols = list(entry.shape[:-1]), entry.shape[-1]
                words = entry.kind.uint32_cols(cols)
                groups = cols // entry.group_size
                prefix = names[name].removesuffix(".weight")
                sd = entry.scale_dtype
                tensors.append((f"{prefix}.weight", "uint32", [*lead, words], self._words(store, name, q_part)))
                tensors.append((f"{prefix}.scales", sd, [*lead, groups], _part(store, name, s_part)))
                tensors.append((f"{prefix}.biases", sd, [*lead, groups], _part(store, name, z_part)))
                group_sizes.add(entry.group_size)
            else:
                tensors.append((names[name], store.runtime_dtype, entry.shape, dense[name]))

        config = store.config()
        # mlx_lm infers each layer's own group size from its scales' shape; the top level names the common one.
        config["quantization"] = {"group_size": min(group_sizes), "bits": self.bits, "mode": "affine"}
        config["quantization_config"] = config["quantization"]

        final = store.path / self.directory
        tmp = make_temp_dir(final)
        try:
            files = {f"{self.directory}/{WEIGHTS}": write_safetensors(tmp / WEIGHTS, tensors, METADATA)}
            files[f"{self.directory}/config.json"] = write_json(tmp / "config.json", config)
            for rel in store.manifest.side_files:
                if rel != "config.json":
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


def _part(store: NpyDir, name: str, suffix: str):
    return lambda: store.load_part(name, suffix)


class Int4Tier(QuantizedTier):
    name = "int4"
    scheme = "int4"
    bits = 4
    directory = "squish_4bit"
    paths = (directory,)
    sentinel = ".squish_4bit_ready"


class Int3Tier(QuantizedTier):
    """Only for a store whose 3-bit model passed the accuracy gate at compress time (docs/format.md §6.4)."""

    name = "int3"
    scheme = "int3"
    bits = 3
    directory = "squish_3bit"
    paths = (directory,)
    sentinel = ".squish_3bit_ready"

    def wanted(self, store: NpyDir) -> bool:
        return super().wanted(store) and store.manifest.int3_passed

    def sentinel_extra(self, store: NpyDir) -> dict:
        return {"int3_gate": store.manifest.int3_gate}
