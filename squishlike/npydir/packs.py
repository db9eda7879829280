"""Format 2's part files, the packs (docs/format.md §3): the parts of one block of tensors (one transformer layer;
the embeddings; the output norm and head) in one safetensors file, each part of 64 KiB or more on a 16 KiB
boundary (Metal can map those: 87 % of SmolLM2's bytes), the smaller ones on 64-byte boundaries, in the gaps the big
ones' alignment leaves. Padding every part to a page made SmolLM2's store 7 % bigger (its 692 parts average 110
KiB, its scales and norms a few KiB), more than mlx_lm's 4-bit conversion, which the store must not exceed.

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
# The block a tensor belongs to, as the model's own list of blocks names it: the path up to the first index and
# the index (canonical `layers.3.`, mlx_lm's `model.layers.3.`, GPT-2's `transformer.h.3.`); the same rule as
# model.py's check of a config's layer count. Tensors outside every list share a pack with their neighbours.
_BLOCK = re.compile(r"^(.*?)\.(\d+)\.")


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
    """The block of a tensor name (`model.layers.3.`), which decides its pack; None outside every block."""
    match = _BLOCK.match(name)
    return match.group(0) if match else None


BIG_PART = 64 << 10  # a part this big starts on a page
SMALL_ALIGN = 64  # any other part starts on a cache line (and so on a multiple of every dtype's size)


def alignment():
    """The packs' PartAlignment (formats/safetensors.py): 16 KiB pages for parts of BIG_PART bytes or more."""
    # formats/ imports this package, so its safetensors module is imported here, once both are loaded
    from ..formats.safetensors import PAGE_ALIGN, PartAlignment  # noqa: PLC0415

    return PartAlignment(PAGE_ALIGN, SMALL_ALIGN, BIG_PART)


def file_order(sizes: list[int]) -> list[int]:
    """The order the writer lays parts of these sizes (in the order they were added) out in a pack, as indices:
    the big ones in the order added, each small one in the first gap before a big one's page that it fits, the
    rest at the end. Any order is valid to a reader (the layout follows from the order); this one wastes least."""
    rule = alignment()
    big = [i for i, n in enumerate(sizes) if n >= rule.threshold]
    small = [i for i, n in enumerate(sizes) if n < rule.threshold]
    order: list[int] = []
    offset = 0
    for b in big:
        page = offset + -offset % rule.page
        for s in list(small):  # fill the gap before this part's page
            start = offset + -offset % rule.small
            if start + sizes[s] <= page:
                order.append(s)
                small.remove(s)
                offset = start + sizes[s]
        order.append(b)
        offset = page + sizes[b]
    return order + small


def layout(parts: list[tuple[str, np.dtype, tuple[int, ...]]]) -> tuple[dict[str, int], int]:
    """({part name: absolute offset of its data}, file size) of a pack holding `parts` (name, storage dtype,
    shape) in that file order: what the writer writes and every reader checks."""
    from ..formats.safetensors import Tensor, header_bytes, layout as tensor_layout  # noqa: PLC0415 - see alignment

    rule = alignment()
    header = tensor_layout([Tensor(name, np.dtype(dtype).name, tuple(shape), None) for name, dtype, shape in parts],
                           rule)
    start = len(header_bytes(header, None, rule))
    offsets = {name: start + entry["data_offsets"][0] for name, entry in header.items()}
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    return offsets, start + end


def nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize
