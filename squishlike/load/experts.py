"""A MoE model's expert stacks served from the store: each layer's experts read on demand into a cache bounded in
bytes, in the store's quantized form (MLX's own words, scales and biases), and multiplied by MLX's `gather_qmm`.

A group-wise tensor of shape [experts, out, in] is stored row-major, so each expert's codes, scales and biases are
one contiguous run of rows in each of its three parts, at an offset the manifest records (docs/format.md §3): an
expert's part is one `pread`, nothing dequantized. A call multiplies by the routed experts only, stacked in
ascending order, with the router's indices remapped to their places in that stack: `gather_qmm` computes each
(token, expert) product from that expert's rows alone, so the result is the resident stack's bit for bit, and the
remap keeps sorted indices sorted (SwitchGLU sorts a prompt's).
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cpu_layers import expert_product
from ..dtypes import MX_DTYPES, to_mx
from ..errors import MemoryBudgetError
from ..io.files import open_regular
from ..npydir import NpyDir
from ..quant.schemes import rows_cols


@dataclass
class ExpertStats:
    """What the expert cache did: experts found in it (hits) and read from the store (misses), and the bytes read."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0

    def describe(self) -> str:
        return (f"expert cache: hit rate {100 * self.hit_rate:.1f} % ({self.hits} hits, {self.misses} reads), "
                f"{self.bytes_read / 1e6:.1f} MB read")


class _ExpertStack:
    """One stored expert stack, or the part of it a sharded rank keeps (`kept`: (axis, indices) of the stored
    [experts, out, in] tensor, as sharded.py's Plan says, one contiguous run along the out or the in axis): for each
    part (codes, scales, biases), the rows of an expert it holds, their run of columns as the kernels see the part
    ([rows, cols]), and the shape MLX takes an expert's part as; one expert's bytes."""

    def __init__(self, store: NpyDir, name: str, kept: tuple[int, np.ndarray] | None = None):
        entry = store.entry(name)
        self.name = name
        self.scale_dtype = entry.scale_dtype
        self.runtime = MX_DTYPES[store.runtime_dtype]
        self.group_size, self.bits = entry.group_size, entry.kind.bits
        rows, cols = _kept_runs(store, name, entry.shape, entry.group_size, kept)
        self.parts = []
        self.expert_bytes = 0
        self.spans = []  # where each part's expert 0 lies in its pack, its stride and extent: what readahead asks
        for i, suffix in enumerate(entry.kind.suffixes):
            stored, stored_shape = entry.part_spec(suffix)
            part_rows, part_cols = rows_cols(stored_shape)
            per_expert = part_rows // entry.shape[0]
            width = part_cols * (cols[1] - cols[0]) // entry.shape[-1]  # kept columns in the part's own units
            start = part_cols * cols[0] // entry.shape[-1]
            shape = [rows[1] - rows[0], entry.kind.uint32_cols(cols[1] - cols[0]) if i == 0
                     else (cols[1] - cols[0]) // entry.group_size]
            self.parts.append((suffix, per_expert, rows, (start, start + width), shape))
            self.expert_bytes += (rows[1] - rows[0]) * width * stored.itemsize
            if store.version >= 2:
                row_bytes = part_cols * stored.itemsize
                self.spans.append((store.part_path(name, suffix), entry.files[suffix].offset + rows[0] * row_bytes,
                                   per_expert * row_bytes, (rows[1] - rows[0]) * row_bytes))

    def read(self, store: NpyDir, expert: int) -> tuple[mx.array, ...]:
        """One expert's (weight, scales, biases) as MLX arrays: each part one pread of its rows (a strided copy for
        a run of columns), checked as every stored part is (NpyDir.read_part_block)."""
        arrays = []
        for i, (suffix, per_expert, (r0, r1), cols, shape) in enumerate(self.parts):
            first = expert * per_expert
            rows = store.read_part_block(self.name, suffix, [(first + r0, first + r1)], cols)
            if i == 0:  # the codes: MLX's uint32 words at rest
                array = mx.array(np.ascontiguousarray(rows).view(np.uint32))
            else:  # scales and biases, in the runtime dtype as the resident load holds them
                array = to_mx(rows, self.scale_dtype)
                array = array if array.dtype == self.runtime else array.astype(self.runtime)
            arrays.append(array.reshape(shape))
        return tuple(arrays)


def _kept_runs(store: NpyDir, name: str, shape: tuple[int, ...], group_size: int,
               kept: tuple[int, np.ndarray] | None) -> tuple[tuple[int, int], tuple[int, int]]:
    """The run of rows and the run of columns of each expert that `kept` keeps of a stored [experts, out, in]
    stack; MemoryBudgetError unless it is one contiguous run of rows, or of whole groups of columns."""
    rows, cols = (0, shape[1]), (0, shape[2])
    if kept is None:
        return rows, cols
    axis, index = kept[0] % 3, np.asarray(kept[1])
    run = (int(index[0]), int(index[-1]) + 1) if len(index) else (0, 0)
    contiguous = len(index) > 0 and np.array_equal(index, np.arange(*run))
    if axis == 0 or not contiguous or (axis == 2 and (run[0] % group_size or run[1] % group_size)):
        raise MemoryBudgetError(store.path, f"{name}: a rank keeps experts' {'rows' if axis == 1 else 'columns'} "
                                            f"that are not one run of whole groups along axis {axis}: its experts "
                                            "cannot be streamed; load it without max_memory")
    return (run, cols) if axis == 1 else (rows, run)


def _descriptor(path: Path, root: Path) -> int:
    """A read-only descriptor on a pack, opened from the store with no link followed, never a FIFO (io/files.py)."""
    with open_regular(path, root) as f:
        return os.dup(f.fileno())


class ExpertCache:
    """The experts of a model's streamed stacks in memory, least recently used evicted first, within `capacity`
    bytes; `stats` counts what it did. `gathered`: the most a call stacks at once beside them (the budget's);
    `kept`: the part of each stack a sharded rank keeps (_ExpertStack).

    Reads overlap compute by the kernel's readahead: the stacks of one SwitchGLU (up, gate, down) take the same
    routed experts, so when the first is asked for them the others' uncached experts are announced to the kernel
    (posix_fadvise WILLNEED), which reads them into the page cache while the first stack's product runs."""

    readahead = True  # the benchmark turns it off to measure it

    def __init__(self, store: NpyDir, names: list[str], capacity: int, gathered: int = 0,
                 kept: dict[str, tuple[int, np.ndarray] | None] | None = None):
        self.store = store
        self.stacks = {name: _ExpertStack(store, name, (kept or {}).get(name)) for name in names}
        self.capacity = capacity
        self.gathered = gathered
        self.stats = ExpertStats()
        self._cached: OrderedDict[tuple[str, int], tuple[mx.array, ...]] = OrderedDict()
        self.used = 0
        siblings: dict[str, list[str]] = {}  # a stack's SwitchGLU (its name up to the projection) -> its stacks
        for name in names:
            siblings.setdefault(name.rsplit(".", 2)[0], []).append(name)
        self._siblings = {name: [s for s in siblings[name.rsplit(".", 2)[0]] if s != name] for name in names}
        paths = {path for stack in self.stacks.values() for path, *_ in stack.spans}
        self._fds = {path: _descriptor(path, store.path) for path in paths} if hasattr(os, "posix_fadvise") else {}
        weakref.finalize(self, _close_all, list(self._fds.values()))

    def announce(self, name: str, experts: np.ndarray) -> None:
        """Ask the kernel to read ahead the uncached `experts` of the stacks beside `name` (class doc)."""
        if not (self.readahead and self._fds):
            return
        for sibling in self._siblings[name]:
            stack = self.stacks[sibling]
            for e in experts:
                if (sibling, int(e)) not in self._cached:
                    for path, start, stride, length in stack.spans:
                        os.posix_fadvise(self._fds[path], start + int(e) * stride, length, os.POSIX_FADV_WILLNEED)

    def gather(self, name: str, experts: np.ndarray) -> tuple[mx.array, ...]:
        """(weight, scales, biases) of stack `name`'s `experts` (ascending, distinct), stacked in that order. Those
        not cached are read, after the least recently used others make room for them."""
        stack = self.stacks[name]
        keys = [(name, int(e)) for e in experts]
        missing = [key for key in keys if key not in self._cached]
        self.stats.hits += len(keys) - len(missing)
        self._evict(len(missing) * stack.expert_bytes, set(keys))
        for key in missing:
            self._cached[key] = stack.read(self.store, key[1])
            self.used += stack.expert_bytes
            self.stats.misses += 1
            self.stats.bytes_read += stack.expert_bytes
        for key in keys:
            self._cached.move_to_end(key)
        parts = [self._cached[key] for key in keys]
        return tuple(mx.stack([expert[i] for expert in parts]) for i in range(3))

    def _evict(self, needed: int, keep: set[tuple[str, int]]) -> None:
        for key in list(self._cached):
            if self.used + needed <= self.capacity:
                return
            if key not in keep:
                del self._cached[key]
                self.used -= self.stacks[key[0]].expert_bytes


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class StreamedSwitchLinear(nn.Module):
    """mlx_lm's QuantizedSwitchLinear with its experts in an ExpertCache instead of in memory: the same call,
    the same `gather_qmm`, on the routed experts only. It takes the place of a QuantizedSwitchLinear (a load) or
    of a SwitchLinear (a sharded rank, whose other layers are dense): the quantization is the store's."""

    def __init__(self, layer: nn.Module, name: str, cache: ExpertCache):
        super().__init__()
        stack = cache.stacks[name]
        self.group_size, self.bits, self.mode = stack.group_size, stack.bits, "affine"
        self.num_experts = layer.weight.shape[0]
        if "bias" in layer:
            self.bias = layer.bias
        self.stack_name = name
        self.cache = cache

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        routed = np.array(indices)  # the router's choice, computed here: what to read
        experts, slots = np.unique(routed, return_inverse=True)
        weight, scales, biases = self.cache.gather(self.stack_name, experts)
        self.cache.announce(self.stack_name, experts)  # read while this product runs
        slots = mx.array(slots.reshape(routed.shape), mx.uint32)
        y = expert_product(self, x, weight, scales, biases, slots, sorted_indices)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        mx.eval(y)  # the gathered stack goes before the next layer's experts come: the cache's bound holds
        return y


def stream_experts(model: nn.Module, stacks: dict[str, str], cache: ExpertCache) -> None:
    """Replace `model`'s quantized expert stacks (`stacks`: module path -> stored tensor name) with streamed
    ones, in place; their resident arrays (unevaluated, never read) go with them."""
    modules = dict(model.named_modules())
    for path, name in stacks.items():
        parent, _, child = path.rpartition(".")
        modules[parent][child] = StreamedSwitchLinear(modules[path], name, cache)


def expert_cache(model: nn.Module) -> ExpertCache | None:
    """The ExpertCache of a model loaded with streamed experts; None for any other model."""
    return next((m.cache for _, m in model.named_modules() if isinstance(m, StreamedSwitchLinear)), None)
