"""Format 2's part files, the packs (docs/format.md §3): the parts of one block of tensors (one transformer layer;
the embeddings; the output norm and head) in one safetensors file, each part on a 16 KiB boundary.

Format 1 stored each part in its own .npy: a load of SmolLM2 opened 732 files one by one (0.27 s of a 0.79 s
load on mlx[cpu]). A pack is opened once, MLX reads it with one `mx.load`, and a reader that opens the file itself
reads each part at the offset the manifest records. How a pack is laid out follows from its parts alone (names,
dtypes, shapes, in order), so the manifest's offsets are checked against that layout before anything is read,
and each pack's header against it when the pack is first opened.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

TENSORS = "tensors"
_PACK = re.compile(r"pack-[0-9]{5}\.safetensors")
# The block a tensor belongs to: its layer index under any naming (canonical `layers.3.`, mlx_lm's
# `model.layers.3.`, `backbone.layers.3.`); tensors outside the layers share a pack with their neighbours.
_BLOCK = re.compile(r"(?:^|\.)layers\.([0-9]+)\.")


def pack_name(index: int) -> str:
    """The `index`-th pack of a store, relative to the npy-dir."""
    return f"{TENSORS}/pack-{index:05d}.safetensors"


def is_pack_name(rel: str) -> bool:
    """Whether `rel` is a name the writer gives a pack: anything else in a manifest's pack table is refused."""
    path = Path(rel)
    return path.parent == Path(TENSORS) and _PACK.fullmatch(path.name) is not None and rel == path.as_posix()


def part_name(key: str, suffix: str) -> str:
    """A part's tensor name inside its pack: the name its format-1 file had, without the extension."""
    return f"{key}__{suffix}"


def block_of(name: str) -> str | None:
    """The layer index of a tensor name, as the block that decides its pack; None outside the layers."""
    match = _BLOCK.search(name)
    return match.group(1) if match else None


def layout(parts: list[tuple[str, np.dtype, tuple[int, ...]]]) -> tuple[dict[str, int], int]:
    """({part name: absolute offset of its data}, file size) of a pack holding `parts` (name, storage dtype,
    shape) in that order: what the writer writes and every reader checks."""
    # formats/ imports this package, so its safetensors writer is imported here, once both are loaded
    from ..formats.safetensors import PAGE_ALIGN, Tensor, header_bytes, layout as tensor_layout  # noqa: PLC0415

    header = tensor_layout([Tensor(name, np.dtype(dtype).name, tuple(shape), None) for name, dtype, shape in parts],
                           PAGE_ALIGN)
    start = len(header_bytes(header, None, PAGE_ALIGN))
    offsets = {name: start + entry["data_offsets"][0] for name, entry in header.items()}
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    return offsets, start + end


def nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize
