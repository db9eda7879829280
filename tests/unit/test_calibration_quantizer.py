"""The quantizer AWQ's trials use (squishlike/calibration/quantizer.py): its MLX form, which runs them on a GPU,
gives the Rust kernel's values on a real SmolLM2 weight, with and without the clip search."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from squishlike.calibration.quantizer import Quantizer
from squishlike.provider import WeightProvider


@pytest.fixture(scope="module")
def weight(smollm_gguf):
    with WeightProvider.open(smollm_gguf) as provider:
        return np.asarray(provider.get("layers.2.ffn.up.weight"), np.float32)


@pytest.mark.parametrize("scheme,group", [("int4", 64), ("int4", 32), ("int3", 32), ("int2", 64), ("int5", 64), ("int6", 32)])
@pytest.mark.parametrize("clip", [False, True])
def test_mlx_form_gives_the_kernels_values(weight, scheme, group, clip):
    qz = Quantizer(scheme, group, "bfloat16", clip)
    assert np.array_equal(np.array(qz.fake(mx.array(weight))), qz(weight))


def test_float32_scales_agree_but_for_rare_ties(weight):
    """float32 scales round nothing away: the kernel's float64 error sums and MLX's float32 ones may rank two clip
    ranges of a group differently when they are within rounding of each other."""
    qz = Quantizer("int4", 64, "float32", True)
    assert np.mean(np.array(qz.fake(mx.array(weight))) != qz(weight)) < 1e-3


def test_on_device_is_the_kernel_on_a_cpu(weight):
    qz = Quantizer("int4", 64, "bfloat16", True)
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        assert np.array_equal(np.array(qz.on_device(mx.array(weight))), qz(weight))
    finally:
        mx.set_default_device(device)
