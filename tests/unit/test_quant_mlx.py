"""INT2..INT6 against MLX itself: our packing is MLX's, and our dequantization is mx.dequantize's, bit for bit, for
every scale dtype and output dtype (the 4-bit tier repacks an INT4 store losslessly: docs/format.md §6.6)."""

from __future__ import annotations

import numpy as np
import pytest

import squishlike.quant as rq
from squishlike.quant import reference as ref

mx = pytest.importorskip("mlx.core")

DTYPES = ref.DTYPES
MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DTYPE_NAMES = {v: k for k, v in MX_DTYPES.items()}


def to_mx(a: np.ndarray, dtype: str):
    return mx.array(a).view(mx.bfloat16) if dtype == "bfloat16" else mx.array(a)


def from_mx(a, dtype: str) -> np.ndarray:
    return np.array(a.view(mx.uint16)) if dtype == "bfloat16" else np.array(a)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def pack(bits: int, codes: np.ndarray) -> np.ndarray:
    return rq.pack_int4(codes) if bits == 4 else rq.pack_bits(codes, bits)


def to_words(bits: int, packed: np.ndarray) -> np.ndarray:
    """Our packed codes as the uint32 words mx.quantize/mx.dequantize use."""
    return rq.int4_to_mlx(packed) if bits == 4 else packed


def weights(seed: int, shape=(8, 256)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * np.float32(0.05)
    w[:, ::37] *= 20  # outliers make the ranges uneven
    return w


@pytest.mark.parametrize("bits", [4, 3, 2, 5, 6])
def test_packing_layout_is_mlx(bits):
    """mx.dequantize with scale 1 and bias 0 reads back exactly the codes we packed."""
    codes = np.random.default_rng(0).integers(0, 2**bits, size=(4, 128), dtype=np.uint8)
    words = to_words(bits, pack(bits, codes))
    ones, zeros = mx.ones((4, 4), dtype=mx.float32), mx.zeros((4, 4), dtype=mx.float32)
    got = mx.dequantize(mx.array(words), ones, zeros, group_size=32, bits=bits)
    assert np.array_equal(np.array(got), codes.astype(np.float32))


@pytest.mark.parametrize("bits", [4, 3, 2, 5, 6])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize_equals_mx_dequantize(bits, group, scale_dtype, out_dtype):
    quantize, dequantize = getattr(rq, f"quantize_int{bits}"), getattr(rq, f"dequantize_int{bits}")
    # our own quantization (clip search on: any scales it picks must still repack exactly) ...
    packed, s, z = quantize(weights(group), group_size=group, scale_dtype=scale_dtype, clip_search=True)
    # ... and arbitrary codes, scales and biases, where rounding after the multiply and after the add both matter
    rng = np.random.default_rng(bits * group)
    codes = rng.integers(0, 2**bits, size=(8, 256), dtype=np.uint8)
    rand = (
        pack(bits, codes),
        ref.from_float32(rng.standard_normal((8, 256 // group)).astype(np.float32) * np.float32(0.05), scale_dtype),
        ref.from_float32(rng.standard_normal((8, 256 // group)).astype(np.float32), scale_dtype),
    )
    for packed, s, z in ((packed, s, z), rand):
        ours = dequantize(packed, s, z, group_size=group, scale_dtype=scale_dtype, out_dtype=out_dtype)
        theirs = mx.dequantize(
            mx.array(to_words(bits, packed)),
            to_mx(s, scale_dtype),
            to_mx(z, scale_dtype),
            group_size=group,
            bits=bits,
            dtype=MX_DTYPES[out_dtype],
        )
        assert same_bits(ours, from_mx(theirs, out_dtype))


@pytest.mark.parametrize("bits", [4, 3, 2, 5, 6])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_mx_quantize_output_unpacks_consistently(bits, group, in_dtype):
    """mx.quantize's own triple: our unpack/pack round-trips its words and our dequantize equals mx.dequantize."""
    w = mx.array(weights(7 + group)).astype(MX_DTYPES[in_dtype])
    words, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    words_np, scale_dtype = np.array(words), DTYPE_NAMES[scales.dtype]
    s, z = from_mx(scales, scale_dtype), from_mx(biases, scale_dtype)
    cols = w.shape[-1]
    if bits == 4:
        packed = rq.mlx_to_int4(words_np)
        codes = rq.unpack_int4(packed)
        assert same_bits(rq.int4_to_mlx(rq.pack_int4(codes)), words_np)
    else:
        packed = words_np
        codes = rq.unpack_bits(packed, cols, bits)
        assert same_bits(rq.pack_bits(codes, bits), words_np)
    assert codes.shape == (8, cols) and codes.max() < 2**bits
    ours = getattr(rq, f"dequantize_int{bits}")
    got = ours(packed, s, z, group_size=group, scale_dtype=scale_dtype, out_dtype=scale_dtype)
    theirs = mx.dequantize(words, scales, biases, group_size=group, bits=bits)
    assert same_bits(got, from_mx(theirs, scale_dtype))


@pytest.mark.parametrize("scheme, bits", [("int4", 4), ("int3", 3), ("int2", 2), ("int5", 5), ("int6", 6)])
def test_from_mlx_words_is_the_stored_packing(scheme, bits):
    """mx.quantize's words of a 3-D expert stack as the store's codes part (rows flattened): our kernels
    dequantize them to mx.dequantize's values, and mlx_words turns them back into the same words."""
    words, scales, biases = mx.quantize(mx.array(weights(11, shape=(2, 4, 128))), group_size=32, bits=bits)
    stored = rq.from_mlx_words(scheme, np.array(words))
    assert stored.shape[0] == 8
    s, z = (np.array(a).reshape(8, -1) for a in (scales, biases))
    ours = rq.dequantize(scheme, stored, s, z, group_size=32, scale_dtype="float32", out_dtype="float32")
    theirs = np.array(mx.dequantize(words, scales, biases, group_size=32, bits=bits)).reshape(8, 128)
    assert same_bits(ours, theirs)
    assert same_bits(np.asarray(rq.mlx_words(scheme, stored)), np.array(words).reshape(8, -1))
