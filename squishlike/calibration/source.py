"""What calibration reads of the source model (its weights in float32, their shapes) and the quantizer compress
rounds each with, the store's own or each width a bits-per-weight target may choose."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..compress_options import CompressOptions, choose_scheme, weight_kinds
from ..dtypes import NP_STORAGE
from ..model import parameter_shapes
from ..provider import WeightProvider
from ..quant.schemes import WIDTHS, rows_cols
from .quantizer import Quantizer


PLAN_GROUP_SIZES = (32, 64, 128)  # the group sizes a bits-per-weight target chooses among, with each width


class SourceWeights:
    """The source model's weights as calibration reads them, and the quantizer the store will use for each."""

    def __init__(self, provider: WeightProvider, model: nn.Module, opts: CompressOptions, runtime: str):
        self.provider, self.opts = provider, opts
        self.shapes = parameter_shapes(model)  # of the unevaluated model: no memory
        self.kinds = weight_kinds(provider, model)
        self.runtime = runtime
        self.base = Quantizer(opts.stored_scheme, opts.groups, runtime, opts.clip_search)
        self.high = Quantizer("int8" if opts.scheme != "int8" else "passthrough", opts.groups, runtime)
        # What a bits-per-weight target chooses among: each width at each group size (those that split a
        # tensor's rows, `fitting`), and exact
        self.widths = (*(Quantizer(WIDTHS[b], g, runtime, opts.clip_search) for b in WIDTHS for g in PLAN_GROUP_SIZES),
                       Quantizer("passthrough", 0, runtime))

    def weight(self, name: str) -> np.ndarray:
        array = self.provider.get(name)
        return np.array(array.astype(mx.float32))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[self.provider.mlx_name(name)]

    def quantizer_for(self, name: str) -> Quantizer | None:
        """The store's quantizer for canonical tensor `name`; None when compress will not quantize it."""
        scheme, _ = choose_scheme(name, self.shape(name), self.opts, self.kinds.get(name))
        if scheme != self.opts.stored_scheme:
            return None
        group_size = self.opts.group_for(name)  # a `bits` rule may keep the scheme at another group size
        return self.base if group_size == self.base.group_size else Quantizer(scheme, group_size, self.runtime,
                                                                              self.opts.clip_search)

    def stored_bytes(self, name: str, dtype: str) -> int:
        """The bytes `name` takes in the store by compress's rules alone (no width planned for it); `dtype`: the
        dtype its values come in."""
        shape = self.shape(name)
        scheme, _ = choose_scheme(name, shape, self.opts, self.kinds.get(name))
        if scheme != "passthrough":
            return Quantizer(scheme, self.opts.group_for(name), self.runtime).nbytes(*rows_cols(shape))
        return math.prod(shape) * np.dtype(NP_STORAGE.get(dtype, NP_STORAGE[self.runtime])).itemsize
