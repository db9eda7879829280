"""Group-wise INT8 (MLX's 8-bit affine form): the Rust kernels against the NumPy spec bit for bit, and both against
MLX itself: without clip search the stored codes, scales and biases are mx.quantize(w, bits=8)'s, and
dequantization is mx.dequantize's, for every source, scale and output dtype."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_quant import SETTINGS, as_src, assert_same, assert_same_outcome, finite_bits, make_weights, weight_cases

import squishlike.quant as rq
import squishlike.quant.reference as ref
from squishlike.errors import QuantizationError

DTYPES = ref.DTYPES
GROUPS = ref.INT8G_GROUP_SIZES


# ---------------------------------------------------------------------------------------------------------------
# Rust == reference


@pytest.mark.parametrize("scale_dtype", DTYPES)
@SETTINGS
@given(case=weight_cases(block=32, group_sizes=GROUPS), clip=st.booleans())
def test_quantize_matches_reference(scale_dtype, case, clip):
    """Every kind of value (constant and zero groups, subnormals, huge ranges, arbitrary finite bits)."""
    w, src, group = case
    assert_same_outcome("quantize_int8g", w, src_dtype=src, group_size=group, scale_dtype=scale_dtype, clip_search=clip)


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    lead=st.sampled_from([(0,), (1,), (3,), (2, 2)]),
    group=st.sampled_from(GROUPS),
    scale_dtype=st.sampled_from(DTYPES),
    out_dtype=st.sampled_from(DTYPES),
)
def test_dequantize_matches_reference(seed, lead, group, scale_dtype, out_dtype):
    """Arbitrary codes and arbitrary finite scales/biases (overflow to inf included), every dtype pair."""
    rng = np.random.default_rng(seed)
    rows, cols = int(np.prod(lead)), group * int(rng.integers(1, 4))
    codes = rng.integers(0, 256, size=(*lead, cols), dtype=np.uint8)
    scales, biases = (as_src(finite_bits(rng, (rows, cols // group)), scale_dtype) for _ in range(2))
    if scale_dtype == "float16":  # drop the infinities the float16 cast made; dequantize's input is finite
        scales, biases = (np.nan_to_num(a, posinf=1, neginf=-1) for a in (scales, biases))
    kw = dict(group_size=group, scale_dtype=scale_dtype, out_dtype=out_dtype)
    assert_same(rq.dequantize_int8g(codes, scales, biases, **kw), ref.dequantize_int8g(codes, scales, biases, **kw))


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_many_rows_split_across_threads(out_dtype):
    w = make_weights(4, "outliers", (700, 512))
    parts = rq.quantize_int8g(w, clip_search=True)
    assert_same(parts, ref.quantize_int8g(w, clip_search=True))
    kw = dict(group_size=64, out_dtype=out_dtype)
    assert_same(rq.dequantize_int8g(*parts, **kw), ref.dequantize_int8g(*parts, **kw))


@pytest.mark.parametrize("module", [rq, ref])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_rejected(module, bad):
    w = np.ones((2, 64), np.float32)
    w[1, 7] = bad
    with pytest.raises(QuantizationError, match="NaN or inf"):
        module.quantize_int8g(w)


@pytest.mark.parametrize("module", [rq, ref])
def test_bad_group_sizes_and_overflow(module):
    w = np.ones((2, 96), np.float32)
    with pytest.raises(QuantizationError, match="group_size 48"):
        module.quantize_int8g(w, group_size=48)
    with pytest.raises(QuantizationError, match="not divisible"):
        module.quantize_int8g(w, group_size=64)
    w[0, :2] = -3e38, 3e38  # a width beyond float32
    with pytest.raises(QuantizationError, match="overflows"):
        module.quantize_int8g(w, group_size=32, scale_dtype="float32")
    with pytest.raises(TypeError):
        module.dequantize_int8g(np.zeros((1, 32), np.int8), np.zeros((1, 1), np.uint16), np.zeros((1, 1), np.uint16),
                                group_size=32)


@pytest.mark.parametrize("scale_dtype", DTYPES)
def test_round_trip_error_is_small(scale_dtype):
    w = make_weights(1, "normal", (16, 256))
    back = rq.dequantize_int8g(*rq.quantize_int8g(w, scale_dtype=scale_dtype), group_size=64,
                               scale_dtype=scale_dtype, out_dtype="float32")
    assert np.linalg.norm(back - w) / np.linalg.norm(w) < 0.01


@pytest.mark.parametrize("scale_dtype", DTYPES)
def test_clip_search_keeps_the_form_and_never_raises_group_error(scale_dtype):
    """With 255 levels, trimming a group's range pays only through the stored scale: bfloat16 keeps 8 bits of it,
    so MLX's codes (picked with the unrounded scale) drift by up to half a step at the far end, and a narrower
    range often lands on a better bfloat16 scale. float16 and float32 scales are precise enough that RTN stays."""
    w = np.concatenate([make_weights(2, "normal", (32, 128)), make_weights(3, "outliers", (32, 128))])

    def quantized(clip):
        parts = rq.quantize_int8g(w, scale_dtype=scale_dtype, clip_search=clip)
        back = rq.dequantize_int8g(*parts, group_size=64, scale_dtype=scale_dtype, out_dtype="float32")
        return parts, ((back.astype(np.float64) - w) ** 2).reshape(64, 2, 64).sum(-1)

    (rtn, rtn_err), (clipped, clipped_err) = quantized(False), quantized(True)
    assert [(a.dtype, a.shape) for a in clipped] == [(a.dtype, a.shape) for a in rtn]
    # float32 output holds every scale-dtype value exactly, so this is the error the search minimised (up to the
    # order of the float64 sum)
    assert np.all(clipped_err <= rtn_err * (1 + 1e-12))
    if scale_dtype == "bfloat16":
        assert clipped_err.sum() < 0.95 * rtn_err.sum()


# ---------------------------------------------------------------------------------------------------------------
# against MLX

mx = pytest.importorskip("mlx.core")
MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def to_mx(a: np.ndarray, dtype: str):
    return mx.array(a).view(mx.bfloat16) if dtype == "bfloat16" else mx.array(a)


def from_mx(a, dtype: str) -> np.ndarray:
    return np.array(a.view(mx.uint16)) if dtype == "bfloat16" else np.array(a)


def mlx_weights(seed: int, kind: str) -> np.ndarray:
    """[8, 256] float32: normal weights, with outliers, or with constant, zero and one-signed groups."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((8, 256)).astype(np.float32) * np.float32(0.05)
    if kind == "outliers":
        w[:, ::37] *= 20
    if kind == "special":
        w[0] = 0.0
        w[1, :128] = np.float32(0.3)
        w[2] = np.abs(w[2])
        w[3] = -np.abs(w[3])
        w[4] *= np.float32(1e-30)
    return w


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("kind", ["normal", "outliers", "special"])
def test_quantize_equals_mx_quantize(group, src_dtype, kind):
    """mx.quantize keeps scales and biases in w's dtype: with that scale_dtype our three arrays are its own."""
    w = mx.array(mlx_weights(group, kind)).astype(MX_DTYPES[src_dtype])
    words, scales, biases = mx.quantize(w, group_size=group, bits=8)
    theirs = (np.array(words).view(np.uint8), from_mx(scales, src_dtype), from_mx(biases, src_dtype))
    ours = rq.quantize_int8g(from_mx(w, src_dtype), src_dtype=src_dtype, group_size=group, scale_dtype=src_dtype)
    assert_same(ours, theirs)
    assert_same(ours[0].view("<u4"), np.array(words))  # the codes read as words are MLX's packing


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("scale_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize_equals_mx_dequantize(group, scale_dtype, out_dtype):
    # our own quantization (clip search on: any scales it picks must still repack exactly) ...
    w = mlx_weights(group, "outliers")
    ours = rq.quantize_int8g(w, group_size=group, scale_dtype=scale_dtype, clip_search=True)
    # ... and arbitrary codes, scales and biases, where rounding after the multiply and after the add both matter
    rng = np.random.default_rng(group)
    rand = (
        rng.integers(0, 256, size=(8, 256), dtype=np.uint8),
        ref.from_float32(rng.standard_normal((8, 256 // group)).astype(np.float32) * np.float32(0.05), scale_dtype),
        ref.from_float32(rng.standard_normal((8, 256 // group)).astype(np.float32), scale_dtype),
    )
    for codes, s, z in (ours, rand):
        got = rq.dequantize_int8g(codes, s, z, group_size=group, scale_dtype=scale_dtype, out_dtype=out_dtype)
        theirs = mx.dequantize(mx.array(codes.view("<u4")), to_mx(s, scale_dtype), to_mx(z, scale_dtype),
                               group_size=group, bits=8, dtype=MX_DTYPES[out_dtype])
        assert_same(got, from_mx(theirs, out_dtype))
