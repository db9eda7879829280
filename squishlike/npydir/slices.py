"""Part of a stored tensor, read and dequantized alone: what one rank of a sharded load keeps.

A selection is one axis and the indices kept along it (what a model's `shard()` does to a weight: equal parts
along one axis, of each segment). The kernels see a tensor as [rows, cols] (the leading axes flattened), and
every scheme quantizes rows independently, so any set of rows is read exactly. Columns are exact for per-row
INT8 and passthrough; a grouped scheme (INT4, INT3) keeps a scale and bias per group of columns, so a column run
that starts or ends inside a group is read as the whole groups it touches, dequantized, and cut to the exact
columns: never more than one group too many at each end, and never a wrong value.
"""

from __future__ import annotations

import math

import numpy as np

from .. import quant
from ..quant.schemes import Role, rows_cols
from .reader import NpyDir

Runs = list[tuple[int, int]]


def runs(index: np.ndarray) -> Runs:
    """Ascending indices as half-open runs of consecutive values: [0, 1, 2, 5, 6] -> [(0, 3), (5, 7)]."""
    index = np.asarray(index, dtype=np.int64)
    if index.size == 0:
        return []
    return [(int(part[0]), int(part[-1]) + 1) for part in np.split(index, np.flatnonzero(np.diff(index) != 1) + 1)]


class SliceReader:
    """Reads selections of an npy-dir's tensors in the runtime dtype, counting the stored bytes it reads."""

    def __init__(self, store: NpyDir):
        self.store = store
        self.bytes_read = 0

    def read(self, name: str, axis: int | None = None, index: np.ndarray | None = None) -> np.ndarray:
        """Tensor `name` (runtime dtype, bf16 as uint16), or its indices `index` along `axis` (ascending)."""
        entry = self.store.entry(name)
        shape = list(entry.shape)
        n_rows, n_cols = rows_cols(shape)
        row_runs, col_runs = [(0, n_rows)], [(0, n_cols)]
        if axis is not None:
            axis %= len(shape)
            if np.any(np.diff(index) <= 0) or index[0] < 0 or index[-1] >= shape[axis]:
                raise ValueError(f"{name}: indices along axis {axis} must ascend within 0..{shape[axis] - 1}")
            if axis == len(shape) - 1:
                col_runs = runs(index)
            else:  # rows of the [rows, cols] view: the leading axes' grid, taken along `axis`
                row_runs = runs(np.arange(n_rows).reshape(shape[:-1]).take(index, axis=axis).reshape(-1))
            shape[axis] = len(index)
        blocks = [self._block(name, row_runs, c0, c1) for c0, c1 in col_runs]
        return np.concatenate(blocks, axis=1).reshape(shape) if len(blocks) > 1 else blocks[0].reshape(shape)

    def _block(self, name: str, rows: Runs, c0: int, c1: int) -> np.ndarray:
        """Rows `rows`, columns c0..c1 of the [rows, cols] view, in the runtime dtype."""
        entry = self.store.entry(name)
        scheme = entry.kind
        if not scheme.quantized:
            (part,) = scheme.parts
            return self.store.to_runtime(entry, self._read(name, part.suffix, rows, (c0, c1)))
        align = math.lcm(scheme.block, entry.group_size or 1)
        a0, a1 = c0 // align * align, -(-c1 // align) * align  # the whole groups (and packing blocks) touched
        group = entry.group_size or 1
        columns = {Role.CODES: (scheme.packed_cols(a0), scheme.packed_cols(a1)),
                   Role.GROUP_SCALES: (a0 // group, a1 // group)}
        parts = [
            # one scale per row, stored as one row: its runs are column runs
            np.concatenate([self._read(name, p.suffix, [(0, 1)], run).reshape(-1) for run in rows])
            if p.role is Role.ROW_SCALES else self._read(name, p.suffix, rows, columns[p.role])
            for p in scheme.parts
        ]
        dense = quant.dequantize(entry.scheme, *parts, group_size=entry.group_size, scale_dtype=entry.scale_dtype,
                                 out_dtype=self.store.runtime_dtype)
        return dense if (a0, a1) == (c0, c1) else np.ascontiguousarray(dense[:, c0 - a0:c1 - a0])

    def _read(self, name: str, suffix: str, rows: Runs, cols: tuple[int, int]) -> np.ndarray:
        block = self.store.read_part_block(name, suffix, rows, cols)
        self.bytes_read += block.nbytes
        return block
