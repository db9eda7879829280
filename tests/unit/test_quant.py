"""The Rust kernels (squishlike.quant) against the NumPy spec (squishlike.quant.reference), bit for bit.

Property tests draw shapes (zero rows, one row, one group, N-D) and values (normal weights at scales from 1e-30 to
1e30, constant rows, zeros of both signs, subnormals, arbitrary finite bit patterns up to float32's largest); every
quantizer must either return the same bits as the reference or raise the same error. Then the error cases, and
read-only / memory-mapped inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import squishlike.quant as rq
import squishlike.quant.reference as ref
from squishlike.errors import QuantizationError

DTYPES = ref.DTYPES
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def assert_same(ours, spec) -> None:
    ours, spec = (ours, spec) if isinstance(ours, tuple) else ((ours,), (spec,))
    assert len(ours) == len(spec)
    for a, b in zip(ours, spec):
        assert same_bits(a, b), f"{a.dtype}{a.shape} vs {b.dtype}{b.shape}: {np.argwhere(a != b)[:5]}"


def outcome(fn, *args, **kwargs):
    """The result of fn, or the type of error it raised (the kernels and the spec must agree on either)."""
    try:
        return fn(*args, **kwargs)
    except (QuantizationError, TypeError) as e:
        return type(e)


def assert_same_outcome(name: str, *args, **kwargs) -> None:
    ours, spec = outcome(getattr(rq, name), *args, **kwargs), outcome(getattr(ref, name), *args, **kwargs)
    if isinstance(spec, type):
        assert ours is spec
    else:
        assert_same(ours, spec)


# ---------------------------------------------------------------------------------------------------------------
# value generators


def finite_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Arbitrary finite float32 bit patterns: every exponent, subnormals and both zeros included."""
    bits = rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32)
    exponent_all_ones = (bits & 0x7F800000) == 0x7F800000
    return np.where(exponent_all_ones, bits & 0x807FFFFF, bits).view(np.float32)


def make_weights(seed: int, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "bits":
        return finite_bits(rng, shape)
    w = rng.standard_normal(shape).astype(np.float32)
    if kind == "constant":  # every row one value: zero scales, never NaN
        return np.broadcast_to(w[..., :1], shape).copy()
    if kind == "zeros":
        return np.where(rng.random(shape) < 0.5, np.float32(0.0), np.float32(-0.0))
    if kind == "subnormal":
        return (w * np.float32(1e-39)).astype(np.float32)
    if kind == "outliers":
        w.reshape(-1)[:: max(1, w.size // 5)] *= 50
        return w
    return (w * np.float32({"tiny": 1e-30, "small": 1e-3, "normal": 1.0, "huge": 1e30}[kind])).astype(np.float32)


KINDS = ["normal", "small", "tiny", "huge", "subnormal", "constant", "zeros", "outliers", "bits"]


def as_src(w: np.ndarray, src_dtype: str) -> np.ndarray:
    """w stored as src_dtype (rounded); float16 may overflow to inf, which the quantizers must then reject."""
    with np.errstate(over="ignore"):
        return ref.from_float32(w, src_dtype)


@st.composite
def weight_cases(draw, block: int = 1, group_sizes: tuple[int, ...] = (32,)):
    """(weights in some src dtype, src_dtype, group_size): shapes with zero/one/few rows, one to three groups, N-D."""
    group = draw(st.sampled_from(group_sizes))
    cols = group * draw(st.integers(1, 3)) if block > 1 else draw(st.sampled_from([0, 1, 5, 64, 130]))
    lead = draw(st.sampled_from([(0,), (1,), (3,), (2, 2)]))
    src = draw(st.sampled_from(DTYPES))
    w = make_weights(draw(st.integers(0, 2**32 - 1)), draw(st.sampled_from(KINDS)), (*lead, cols))
    return as_src(w, src), src, group


# ---------------------------------------------------------------------------------------------------------------
# INT8


@SETTINGS
@given(weight_cases())
def test_int8_quantize_matches_reference(case):
    w, src, _ = case
    assert_same_outcome("quantize_int8", w, src_dtype=src)


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.sampled_from([(0, 8), (1, 1), (3, 70), (2, 2, 33)]), st.sampled_from(DTYPES))
def test_int8_dequantize_matches_reference(seed, shape, out_dtype):
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, size=shape, dtype=np.int8)
    scales = np.abs(finite_bits(rng, (int(np.prod(shape[:-1])),)))
    assert_same(rq.dequantize_int8(q, scales, out_dtype=out_dtype), ref.dequantize_int8(q, scales, out_dtype=out_dtype))


def test_int8_known_values():
    w = np.array([[1.0, -0.5, 0.25, 127.0], [0, 0, 0, 0], [-2.54, 0, 0, 1.27]], np.float32)
    q, s = rq.quantize_int8(w)
    assert s.tolist() == pytest.approx([1.0, 0.0, 0.02])
    assert q.tolist() == [[1, 0, 0, 127], [0, 0, 0, 0], [-127, 0, 0, 64]]  # -0.5 rounds half to even
    assert rq.dequantize_int8(q, s, out_dtype="float32")[1].tolist() == [0, 0, 0, 0]


# ---------------------------------------------------------------------------------------------------------------
# INT2..INT6 quantize and dequantize

AFFINE_BITS = [4, 3, 2, 5, 6]


def pack(bits: int, codes: np.ndarray) -> np.ndarray:
    return rq.pack_int4(codes) if bits == 4 else rq.pack_bits(codes, bits)


@pytest.mark.parametrize("bits", AFFINE_BITS)
@pytest.mark.parametrize("scale_dtype", DTYPES)
@SETTINGS
@given(case=weight_cases(block=32, group_sizes=(32, 64, 128)), clip=st.booleans())
def test_affine_quantize_matches_reference(bits, scale_dtype, case, clip):
    w, src, group = case
    kw = dict(src_dtype=src, group_size=group, scale_dtype=scale_dtype, clip_search=clip)
    assert_same_outcome(f"quantize_int{bits}", w, **kw)


@pytest.mark.parametrize("bits", AFFINE_BITS)
@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    lead=st.sampled_from([(0,), (1,), (3,), (2, 2)]),
    group=st.sampled_from([32, 64, 128]),
    scale_dtype=st.sampled_from(DTYPES),
    out_dtype=st.sampled_from(DTYPES),
)
def test_affine_dequantize_matches_reference(bits, seed, lead, group, scale_dtype, out_dtype):
    """Arbitrary codes and arbitrary finite scales/biases (overflow to inf included), every dtype pair."""
    rng = np.random.default_rng(seed)
    rows, cols = int(np.prod(lead)), group * int(rng.integers(1, 4))
    codes = rng.integers(0, 2**bits, size=(*lead, cols), dtype=np.uint8)
    packed = pack(bits, codes)
    scales, biases = (as_src(finite_bits(rng, (rows, cols // group)), scale_dtype) for _ in range(2))
    if scale_dtype == "float16":  # drop the infinities the float16 cast made; dequantize's input is finite
        scales, biases = (np.nan_to_num(a, posinf=1, neginf=-1) for a in (scales, biases))
    kw = dict(group_size=group, scale_dtype=scale_dtype, out_dtype=out_dtype)
    name = f"dequantize_int{bits}"
    assert_same(getattr(rq, name)(packed, scales, biases, **kw), getattr(ref, name)(packed, scales, biases, **kw))


@pytest.mark.parametrize("bits", AFFINE_BITS)
@pytest.mark.parametrize("scale_dtype", DTYPES)
def test_round_trip_error_is_small(bits, scale_dtype):
    w = make_weights(1, "normal", (16, 256))
    quantize, dequantize = getattr(rq, f"quantize_int{bits}"), getattr(rq, f"dequantize_int{bits}")
    parts = quantize(w, scale_dtype=scale_dtype)
    back = dequantize(*parts, group_size=64, scale_dtype=scale_dtype, out_dtype="float32")
    rel = np.linalg.norm(back - w) / np.linalg.norm(w)
    assert rel < {2: 0.6, 3: 0.25, 4: 0.12, 5: 0.06, 6: 0.03}[bits]


@pytest.mark.parametrize("bits", AFFINE_BITS)
@pytest.mark.parametrize("scale_dtype", DTYPES)
def test_clip_search_never_worse(bits, scale_dtype):
    """The search measures the error the runtime will see; it keeps RTN unless a narrower range beats it."""
    w = np.concatenate([make_weights(2, "normal", (32, 128)), make_weights(3, "outliers", (32, 128))])
    quantize, dequantize = getattr(rq, f"quantize_int{bits}"), getattr(rq, f"dequantize_int{bits}")

    def group_errors(clip):
        parts = quantize(w, scale_dtype=scale_dtype, clip_search=clip)
        back = dequantize(*parts, group_size=64, scale_dtype=scale_dtype, out_dtype="float32")
        return ((back.astype(np.float64) - w) ** 2).reshape(64, 2, 64).sum(-1)

    # float32 output holds every scale-dtype value exactly, so this is the error the search minimised (up to the
    # order of the float64 sum)
    rtn, clipped = group_errors(False), group_errors(True)
    gain = 0.97 if bits <= 4 else 1.0  # a finer grid leaves the search less to win (5 bits: 1.6 % here)
    assert np.all(clipped <= rtn * (1 + 1e-12)) and clipped.sum() < gain * rtn.sum()


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_many_rows_split_across_threads(out_dtype):
    """Enough rows for several parallel tasks (about 64K elements each): every row lands where it belongs."""
    w = make_weights(4, "outliers", (700, 512))
    assert_same(rq.quantize_int8(w), ref.quantize_int8(w))
    q, s = rq.quantize_int8(w)
    assert_same(rq.dequantize_int8(q, s, out_dtype=out_dtype), ref.dequantize_int8(q, s, out_dtype=out_dtype))
    for bits in AFFINE_BITS:
        parts = getattr(rq, f"quantize_int{bits}")(w, clip_search=True)
        assert_same(parts, getattr(ref, f"quantize_int{bits}")(w, clip_search=True))
        name = f"dequantize_int{bits}"
        kw = dict(group_size=64, out_dtype=out_dtype)
        assert_same(getattr(rq, name)(*parts, **kw), getattr(ref, name)(*parts, **kw))


def test_affine_known_values():
    # 0..15 ramps: scale 1, bias -1 (exact in every scale dtype), so the round trip is exact
    w = np.tile(np.arange(16, dtype=np.float32) - 1, (2, 4))
    packed, s, z = rq.quantize_int4(w, scale_dtype="float32")
    assert s.tolist() == [[1.0]] * 2 and z.tolist() == [[-1.0]] * 2
    assert packed[0, 0] == 0x10  # codes 0 and 1: low nibble = even column
    assert same_bits(rq.dequantize_int4(packed, s, z, group_size=64, scale_dtype="float32", out_dtype="float32"), w)


def test_signed_zero_groups_store_positive_zero():
    w = np.zeros((1, 64), np.float32)
    w[0, ::2] = -0.0
    for bits in AFFINE_BITS:
        _, s, z = getattr(rq, f"quantize_int{bits}")(w, scale_dtype="float32")
        assert s.view(np.uint32).tolist() == [[0]] and z.view(np.uint32).tolist() == [[0]]


# ---------------------------------------------------------------------------------------------------------------
# packing


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.sampled_from([(0, 32), (1, 2), (3, 64), (2, 2, 96)]))
def test_pack_int4_matches_reference(seed, shape):
    q = np.random.default_rng(seed).integers(0, 16, size=shape, dtype=np.uint8)
    packed = rq.pack_int4(q)
    assert_same(packed, ref.pack_int4(q))
    assert_same(rq.unpack_int4(packed), q.reshape(-1, shape[-1]))
    assert_same(ref.unpack_int4(packed), q.reshape(-1, shape[-1]))


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
@SETTINGS
@given(st.integers(0, 2**32 - 1), st.sampled_from([(0, 32), (1, 32), (3, 64), (2, 2, 96)]))
def test_pack_bits_matches_reference(bits, seed, shape):
    q = np.random.default_rng(seed).integers(0, 2**bits, size=shape, dtype=np.uint8)
    packed = rq.pack_bits(q, bits)
    assert_same(packed, ref.pack_bits(q, bits))
    assert_same(rq.unpack_bits(packed, shape[-1], bits), q.reshape(-1, shape[-1]))
    assert_same(ref.unpack_bits(packed, shape[-1], bits), q.reshape(-1, shape[-1]))


@pytest.mark.parametrize("bits, element, words", [
    (3, 10, [0b11 << 30, 0b1, 0]),  # element 10 at bits 30..32 straddles words 0 and 1
    (5, 6, [0b11 << 30, 0b111, 0, 0, 0]),  # element 6 at bits 30..34
    (6, 5, [0b11 << 30, 0b1111, 0, 0, 0, 0]),  # element 5 at bits 30..35
    (2, 16, [0, 0b11]),  # 16 whole codes per word
])
def test_bitstream_layout(bits, element, words):
    """Element k sits at bits bits*k.. of the row's little-endian stream, split LSB first across a word boundary."""
    q = np.zeros((1, 32), np.uint8)
    q[0, element] = 2**bits - 1
    assert rq.pack_bits(q, bits).tolist() == [words]
    assert ref.pack_bits(q, bits).tolist() == [words]


def test_int4_to_mlx_is_a_view():
    packed = np.arange(64, dtype=np.uint8).reshape(2, 32)
    words = rq.int4_to_mlx(packed)
    assert words.shape == (2, 8) and words.dtype == np.dtype("<u4") and np.shares_memory(words, packed)
    assert words[0, 0] == 0x03020100  # little-endian: byte 0 holds elements 0 and 1, the lowest nibbles
    back = rq.mlx_to_int4(words)
    assert np.shares_memory(back, packed) and same_bits(back, packed)
    with pytest.raises(QuantizationError, match="multiple of 4"):
        rq.int4_to_mlx(packed[:, :30].copy())
    with pytest.raises(QuantizationError, match="contiguous"):
        rq.int4_to_mlx(packed[:, ::2])


# ---------------------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("name", ["quantize_int8", "quantize_int4", "quantize_int3", "quantize_int2", "quantize_int6"])
@pytest.mark.parametrize("module", [rq, ref], ids=["rust", "reference"])
def test_non_finite_input_is_rejected(module, name, bad):
    w = np.ones((2, 64), np.float32)
    w[1, 7] = bad
    with pytest.raises(QuantizationError, match="NaN or inf"):
        getattr(module, name)(w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [0, 1, 70_000, 200_001])  # several of the kernel's chunks of 65,536
def test_first_non_finite_matches_reference(dtype, size):
    """The finiteness check of scales and offsets (every load, docs/format.md §7): the first NaN or infinity's
    index, in each dtype (bfloat16 as raw bits, its NaN and infinity patterns included), or None."""
    rng = np.random.default_rng(size)
    values = ref.from_float32(rng.normal(size=size).astype(np.float32) * 1e3, dtype)
    assert rq.first_non_finite(values, dtype) is None is ref.first_non_finite(values, dtype)
    for at, bad in ((size - 1, np.inf), (size * 2 // 3, np.nan), (size // 3, -np.inf)):
        if size:
            values[at] = ref.from_float32(np.array([bad], np.float32), dtype)[0]
            assert rq.first_non_finite(values, dtype) == at == ref.first_non_finite(values, dtype)
    assert rq.first_non_finite(values.reshape(1, -1), dtype) == ref.first_non_finite(values, dtype)


@pytest.mark.parametrize("module", [rq, ref], ids=["rust", "reference"])
def test_bad_group_sizes_and_shapes(module):
    w = np.ones((2, 96), np.float32)
    for group in (0, -1, 48, 256):
        with pytest.raises(QuantizationError, match="group_size"):
            module.quantize_int4(w, group_size=group)
    with pytest.raises(QuantizationError, match="96 columns are not divisible by group_size 64"):
        module.quantize_int4(w, group_size=64)
    with pytest.raises(QuantizationError, match="not divisible"):
        module.quantize_int3(np.ones((2, 48), np.float32), group_size=32)
    with pytest.raises(QuantizationError, match="scalar"):
        module.quantize_int8(np.float32(1.0).reshape(()))
    with pytest.raises(QuantizationError, match="values must be 0..15"):
        module.pack_int4(np.full((1, 2), 16, np.uint8))
    with pytest.raises(QuantizationError, match="values must be 0..7"):
        module.pack_int3(np.full((1, 32), 8, np.uint8))
    with pytest.raises(QuantizationError):
        module.pack_int3(np.zeros((1, 16), np.uint8))
    with pytest.raises(QuantizationError):
        module.unpack_int3(np.zeros((1, 3), np.uint32), 64)
    with pytest.raises(QuantizationError, match="values must be 0..31"):
        module.pack_bits(np.full((1, 32), 32, np.uint8), 5)
    with pytest.raises(QuantizationError):
        module.unpack_bits(np.zeros((1, 5), np.uint32), 64, 6)
    with pytest.raises(QuantizationError, match="not divisible"):
        module.quantize_int6(np.ones((2, 48), np.float32), group_size=32)
    packed, s, z = module.quantize_int4(np.ones((2, 128), np.float32))
    with pytest.raises(QuantizationError, match="scales"):
        module.dequantize_int4(packed, s[:1], z, group_size=64)
    with pytest.raises(QuantizationError, match="group_size"):
        module.dequantize_int4(packed, s, z, group_size=48)
    with pytest.raises(QuantizationError, match="scales"):
        module.dequantize_int8(np.zeros((2, 3), np.int8), np.zeros(3, np.float32))


@pytest.mark.parametrize("module", [rq, ref], ids=["rust", "reference"])
def test_scale_overflow_is_rejected(module):
    w = np.array([[-1e5, 1e5] * 16], np.float32)  # range beyond float16
    with pytest.raises(QuantizationError, match="overflows float16"):
        module.quantize_int4(w, group_size=32, scale_dtype="float16")
    module.quantize_int4(w, group_size=32, scale_dtype="bfloat16")
    with pytest.raises(QuantizationError, match="overflows float32"):  # max - min overflows even float32
        module.quantize_int3(np.array([[-3e38, 3e38] * 16], np.float32), group_size=32, scale_dtype="float32")


@pytest.mark.parametrize("module", [rq, ref], ids=["rust", "reference"])
def test_wrong_dtypes(module):
    with pytest.raises(TypeError, match="src_dtype='bfloat16'"):
        module.quantize_int8(np.zeros((1, 4), np.uint16))
    with pytest.raises(TypeError, match="float64"):
        module.quantize_int4(np.zeros((1, 64), np.float64))
    with pytest.raises(TypeError):
        module.quantize_int8(np.zeros((1, 4), np.float32), src_dtype="bfloat16")
    with pytest.raises(ValueError, match="unknown dtype"):
        module.quantize_int4(np.zeros((1, 64), np.float32), scale_dtype="int8")
    q, s = module.quantize_int8(np.ones((2, 4), np.float32))
    with pytest.raises(TypeError):
        module.dequantize_int8(q.astype(np.int16), s)
    with pytest.raises(TypeError):
        module.dequantize_int8(q, s.astype(np.float64))
    packed, s4, z4 = module.quantize_int4(np.ones((2, 64), np.float32))
    with pytest.raises(TypeError):
        module.dequantize_int4(packed, s4, z4, group_size=64, scale_dtype="float16")


@pytest.mark.parametrize("module", [rq, ref], ids=["rust", "reference"])
def test_bad_out(module):
    q, s = module.quantize_int8(np.ones((2, 4), np.float32))
    with pytest.raises(QuantizationError, match="shape"):
        module.dequantize_int8(q, s, out=np.empty((2, 5), np.uint16))
    with pytest.raises(TypeError):
        module.dequantize_int8(q, s, out=np.empty((2, 4), np.float16))  # bfloat16 output is uint16 bits
    read_only = np.empty((2, 4), np.uint16)
    read_only.flags.writeable = False
    with pytest.raises(QuantizationError, match="writeable"):
        module.dequantize_int8(q, s, out=read_only)


def test_non_contiguous_input_is_rejected():
    w = np.ones((4, 128), np.float32)
    for bad in (w[:, ::2], w.T, w[::2]):
        for fn in (rq.quantize_int8, rq.quantize_int4, rq.quantize_int3):
            if bad.flags.c_contiguous:
                continue
            with pytest.raises(QuantizationError, match="not C-contiguous"):
                fn(bad)
    q, s = rq.quantize_int8(w)
    with pytest.raises(QuantizationError, match="not C-contiguous"):
        rq.dequantize_int8(q[:, ::2], s)
    out = np.empty((4, 256), np.uint16)
    with pytest.raises(QuantizationError, match="not C-contiguous"):
        rq.dequantize_int8(q, s, out=out[:, ::2])


def test_out_aliasing_an_input_is_rejected():
    q, s = rq.quantize_int8(np.ones((2, 1), np.float32))
    with pytest.raises(QuantizationError):
        rq.dequantize_int8(q, s, out_dtype="float32", out=s.reshape(2, 1))


# ---------------------------------------------------------------------------------------------------------------
# out=, read-only and memory-mapped inputs


@pytest.mark.parametrize("module", [rq, ref], ids=["rust", "reference"])
def test_out_is_filled_and_returned(module):
    w = make_weights(5, "normal", (2, 3, 64))
    q, s = module.quantize_int8(w)
    out = np.zeros((2, 3, 64), np.float32)  # N-D out with the same 2-D view
    assert module.dequantize_int8(q, s, out_dtype="float32", out=out) is out
    assert same_bits(out.reshape(6, 64), module.dequantize_int8(q, s, out_dtype="float32"))
    packed, s4, z4 = module.quantize_int4(w)
    out = np.zeros((6, 64), np.uint16)
    assert module.dequantize_int4(packed, s4, z4, group_size=64, out=out) is out
    assert same_bits(out, module.dequantize_int4(packed, s4, z4, group_size=64))


def test_read_only_and_memmap_inputs(tmp_path):
    w = make_weights(6, "normal", (8, 128))
    path = tmp_path / "w.npy"
    np.save(path, w)
    mapped = np.load(path, mmap_mode="r")
    assert not mapped.flags.writeable
    read_only = w.copy()
    read_only.flags.writeable = False
    for src in (mapped, read_only):
        assert_same(rq.quantize_int8(src), ref.quantize_int8(w))
        assert_same(rq.quantize_int4(src), ref.quantize_int4(w))
        assert_same(rq.quantize_int3(src), ref.quantize_int3(w))
    packed, s, z = rq.quantize_int4(w)
    for name, a in (("p", packed), ("s", s), ("z", z)):
        np.save(tmp_path / f"{name}.npy", a)
    parts = [np.load(tmp_path / f"{n}.npy", mmap_mode="r") for n in "psz"]
    assert same_bits(rq.dequantize_int4(*parts, group_size=64), rq.dequantize_int4(packed, s, z, group_size=64))


def test_bfloat16_input_is_raw_bits():
    w = make_weights(7, "normal", (4, 64))
    bf = ref.from_float32(w, "bfloat16")
    assert_same(rq.quantize_int8(bf, src_dtype="bfloat16"), rq.quantize_int8(ref.to_float32(bf, "bfloat16")))
    assert_same(rq.quantize_int4(bf, src_dtype="bfloat16"), rq.quantize_int4(ref.to_float32(bf, "bfloat16")))


def test_the_extension_is_installed_outside_the_tree_typed_by_its_stub_and_reached_only_through_quant_and_checksum():
    """The built extension is installed outside the source tree (even by `pip install -e`); rust_quant.pyi (at the
    repo root, where maturin takes a stub from) names exactly what it has; only quant/ and io/checksum.py import it
    (the tests and tools may reach it directly)."""
    import ast
    from pathlib import Path

    import rust_quant

    package = Path(rq.__file__).parent.parent
    built = Path(rust_quant.__file__).resolve().parents  # site-packages, wherever the environment lives
    assert package not in built and package.parent / "rust_quant" not in built, "the built library is in the tree"
    stub = ast.parse((package.parent / "rust_quant.pyi").read_text())
    typed = {n.name for n in stub.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    typed |= {n.target.id for n in stub.body if isinstance(n, ast.AnnAssign)}
    public = set(rust_quant.__all__)  # dir() also holds maturin's wrapper's own submodule
    assert typed - {"SchemeConstants"} == public
    importers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            if "rust_quant" in module or any("rust_quant" in n for n in names):
                importers.add(str(path.relative_to(package)))
    assert importers == {"quant/__init__.py", "quant/schemes.py", "io/checksum.py"}
