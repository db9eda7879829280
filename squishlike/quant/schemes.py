"""The one table of storage schemes: per scheme its parts, bits, group sizes and packed width.

Bits, group sizes and packing come from the Rust crate's constants (`rust_quant.SCHEMES`), so the kernels and
everything that sizes their arrays (the quantizers here, the npy-dir's validation, the MLX repack) agree by
construction. Each part is one array of the stored tensor, named `suffix` at rest, in the order the kernels take
them; its dtype and shape follow from the tensor's shape, group size and scale/stored dtype (`Scheme.part_spec`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

import numpy as np
import rust_quant as _rq

from ..dtypes import NP_STORAGE


class Role(Enum):
    """What a part holds, which fixes its dtype and shape."""

    CODES = "codes"  # packed codes: [rows, packed width] of the scheme's word
    ROW_SCALES = "row_scales"  # float32, one per row
    GROUP_SCALES = "group_scales"  # the scale dtype, [rows, cols / group size] (scales and MLX "biases")
    STORED = "stored"  # the tensor itself, exact, in its stored dtype


@dataclass(frozen=True)
class Part:
    suffix: str
    role: Role


@dataclass(frozen=True)
class Scheme:
    name: str
    parts: tuple[Part, ...]
    bits: int | None = None  # None: stored exactly
    group_sizes: tuple[int, ...] = ()  # the group sizes the kernels (and mx.quantize) take; () if not grouped
    block: int = 1  # codes per packing block: a row's length must be a multiple of it
    block_words: int = 1  # words holding one block
    word: np.dtype | None = None  # dtype of the packed codes

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def grouped(self) -> bool:
        """Whether the scheme keeps a scale and bias per group of columns (affine INT2..INT6, group-wise INT8)."""
        return bool(self.group_sizes)

    @cached_property  # asked for each part of each tensor a load opens: hundreds of times
    def suffixes(self) -> tuple[str, ...]:
        return tuple(p.suffix for p in self.parts)

    @cached_property
    def roles(self) -> dict[str, Role]:
        """Each part's role, by its suffix."""
        return {p.suffix: p.role for p in self.parts}

    def packed_cols(self, cols: int) -> int:
        """Words of packed codes per row of `cols` values."""
        return cols // self.block * self.block_words

    def uint32_cols(self, cols: int) -> int:
        """The packed width in the uint32 words MLX keeps quantized weights in."""
        return self.packed_cols(cols) * np.dtype(self.word).itemsize // 4

    def unpacked_cols(self, words: int) -> int:
        """Values per row of `words` packed words."""
        return words // self.block_words * self.block

    def part_spec(
        self,
        role: Role,
        shape: tuple[int, ...] | list[int],
        *,
        group_size: int = 0,
        scale_dtype: str | None = None,
        stored_dtype: str | None = None,
    ) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape a part of `role` has for a tensor of `shape`."""
        rows, cols = rows_cols(shape)
        if role is Role.CODES:
            return np.dtype(self.word), (rows, self.packed_cols(cols))
        if role is Role.ROW_SCALES:
            return np.dtype(np.float32), (rows,)
        if role is Role.GROUP_SCALES:
            return np.dtype(NP_STORAGE[scale_dtype]), (rows, cols // group_size)
        return np.dtype(NP_STORAGE[stored_dtype]), tuple(shape)


def rows_cols(shape: tuple[int, ...] | list[int]) -> tuple[int, int]:
    """Kernels see an N-D weight as [product of leading dims, last dim]; a scalar as [1, 1]."""
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def _from_rust(name: str, *parts: Part) -> Scheme:
    c = _rq.SCHEMES[name]
    return Scheme(name, parts, c["bits"], tuple(c["group_sizes"]), c["block"], c["block_words"], np.dtype(c["word"]))


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        _from_rust("int8", Part("q", Role.CODES), Part("s", Role.ROW_SCALES)),
        _from_rust("int8g", Part("q8", Role.CODES), Part("s8", Role.GROUP_SCALES), Part("z8", Role.GROUP_SCALES)),
        _from_rust("int4", Part("q4", Role.CODES), Part("s4", Role.GROUP_SCALES), Part("z4", Role.GROUP_SCALES)),
        *(_from_rust(f"int{b}", Part(f"q{b}", Role.CODES), Part(f"s{b}", Role.GROUP_SCALES),
                     Part(f"z{b}", Role.GROUP_SCALES)) for b in (3, 2, 5, 6)),
        Scheme("passthrough", (Part("pt", Role.STORED),)),
    )
}
QUANTIZED = tuple(name for name, s in SCHEMES.items() if s.quantized)
WIDTHS: dict[int, str] = {2: "int2", 3: "int3", 4: "int4", 5: "int5", 6: "int6", 8: "int8g"}  # bits -> the group-wise scheme of that width
