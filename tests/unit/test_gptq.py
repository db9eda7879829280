"""GPTQ (squishlike/calibration/gptq.py and the Rust column loop) on a real SmolLM2 weight and real inputs (the
embeddings of 512 tokens): on the store's own grid, lower output error than rounding to nearest, and the factor
of the inverse Hessian it spreads errors with."""

from __future__ import annotations

import numpy as np
import pytest

from squishlike import quant
from squishlike.calibration.gptq import DAMPING, gptq, inverse_hessian_factor
from squishlike.calibration.quantizer import Quantizer
from squishlike.errors import QuantizationError
from squishlike.provider import WeightProvider

QZ = Quantizer("int4", 64, "bfloat16", clip_search=True)


@pytest.fixture(scope="module")
def smollm_layer(smollm_gguf):
    provider = WeightProvider.open(smollm_gguf)
    w = np.asarray(provider.get("layers.0.attention.q.weight"), np.float32)
    embeddings = np.asarray(provider.get("token_embedding.weight"), np.float32)
    return w, np.ascontiguousarray(embeddings[:: len(embeddings) // 512][:512])


def output_error(x, w, parts, scheme="int4"):
    w_hat = quant.dequantize(scheme, *parts, group_size=64, scale_dtype="bfloat16", out_dtype="float32")
    d = x.astype(np.float64) @ (w - w_hat).T.astype(np.float64)
    return float(np.sum(d * d))


def test_factor_is_the_inverse_hessians(smollm_layer):
    _, x = smollm_layer
    x = x.copy()
    x[:, 7] = 0  # a dead input
    [span] = inverse_hessian_factor(x)
    u, dead = span.u, span.dead
    h = x.T.astype(np.float64) @ x
    h[7, 7] = 1
    h += DAMPING * np.mean(np.diag(h)) * np.eye(len(h))
    assert np.flatnonzero(dead).tolist() == [7]
    assert np.array_equal(u, np.triu(u)) and (np.diag(u) > 0).all()
    np.testing.assert_allclose(u.T.astype(np.float64) @ u @ h, np.eye(len(h)), atol=2e-3)


WIDTHS = ["int4", "int2", "int3", "int5", "int6", "int8g"]


@pytest.mark.parametrize("scheme", WIDTHS)
def test_gptq_lowers_the_output_error_on_the_stores_grid(smollm_layer, scheme):
    w, x = smollm_layer
    parts = gptq(w, "float32", Quantizer(scheme, 64, "bfloat16", clip_search=True), inverse_hessian_factor(x))
    nearest = quant.quantize(scheme, w, group_size=64, scale_dtype="bfloat16", clip_search=True)
    assert [(p.shape, p.dtype) for p in parts] == [(p.shape, p.dtype) for p in nearest]
    assert output_error(x, w, parts, scheme) < 0.8 * output_error(x, w, nearest, scheme)


@pytest.mark.parametrize("scheme", WIDTHS)
def test_uncorrelated_inputs_give_round_to_nearest(smollm_layer, scheme):
    """With H a multiple of I no error has anywhere to go: the codes and grid are plain rounding's, bit for bit."""
    w, _ = smollm_layer
    qz = Quantizer(scheme, 64, "bfloat16", clip_search=True)
    parts = gptq(w, "float32", qz, inverse_hessian_factor(np.eye(w.shape[1], dtype=np.float32)))
    nearest = quant.quantize(scheme, w, group_size=64, scale_dtype="bfloat16", clip_search=True)
    for got, want in zip(parts, nearest):
        assert np.array_equal(got, want)


def test_refuses_non_finite_weights(smollm_layer):
    w, x = smollm_layer
    w = w.copy()
    w[3, 100] = np.nan
    with pytest.raises(QuantizationError, match="NaN"):
        gptq(w, "float32", QZ, inverse_hessian_factor(x))


def test_a_wide_input_is_factored_span_by_span(smollm_layer):
    """Over HESSIAN_SPAN columns (here a span of 128 over 576), each span's factor is its own diagonal block's, and
    GPTQ with them still beats rounding to nearest: errors are spread within each span."""
    w, x = smollm_layer
    spans = inverse_hessian_factor(x, span=128)
    assert [s.start for s in spans] == [0, 128, 256, 384, 512] and len(spans[-1].dead) == 64
    for s in spans:
        [whole] = inverse_hessian_factor(np.ascontiguousarray(x[:, s.start:s.start + len(s.dead)]))
        np.testing.assert_array_equal(s.u, whole.u)
    parts = gptq(w, "float32", QZ, spans)
    nearest = quant.quantize("int4", w, group_size=64, scale_dtype="bfloat16", clip_search=True)
    assert output_error(x, w, nearest) > output_error(x, w, parts) > output_error(x, w, gptq(w, "float32", QZ, inverse_hessian_factor(x)))


def test_rows_go_a_block_at_a_time_with_the_same_result(smollm_layer, monkeypatch):
    """A vocabulary-sized head is rounded ROW_BLOCK rows at a time: the rows are independent, so the parts are the
    same as in one go, and its values may stay in their stored dtype until a block is made float32."""
    from squishlike.calibration import gptq as gptq_module
    from squishlike.quant.reference import from_float32

    w, x = smollm_layer
    factor = inverse_hessian_factor(x)
    whole = gptq(w, "float32", QZ, factor)
    monkeypatch.setattr(gptq_module, "ROW_BLOCK", 100)
    for got, want in zip(gptq(w, "float32", QZ, factor), whole):
        assert np.array_equal(got, want)
    stored = from_float32(w, "bfloat16")
    bf16 = gptq(stored, "bfloat16", QZ, factor)
    monkeypatch.setattr(gptq_module, "ROW_BLOCK", 1 << 20)
    for got, want in zip(bf16, gptq(stored, "bfloat16", QZ, factor)):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("fast_mlx_lapack", [True, False])
def test_both_factorisations_give_the_inverse_hessians_factor(smollm_layer, monkeypatch, fast_mlx_lapack):
    """MLX's CPU LAPACK where a fast one is loaded, NumPy's where MLX has only its reference one (the Linux CUDA
    wheel without a preloaded OpenBLAS): the same factor to float32 rounding."""
    from squishlike.calibration import gptq as gptq_module

    _, x = smollm_layer
    monkeypatch.setattr(gptq_module, "mlx_lapack_is_fast", lambda: fast_mlx_lapack)
    [span] = inverse_hessian_factor(x)
    h = x.T.astype(np.float64) @ x
    h += DAMPING * np.mean(np.diag(h)) * np.eye(len(h))
    assert np.array_equal(span.u, np.triu(span.u)) and (np.diag(span.u) > 0).all()
    np.testing.assert_allclose(span.u.T.astype(np.float64) @ span.u @ h, np.eye(len(h)), atol=2e-3)
