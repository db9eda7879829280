"""The quantized layers a store's model runs on mlx[cpu] (squishlike/cpu_layers.py): the same parameters as MLX's,
a generated token through float32 quantized_matmul, a prompt through one dense matmul of the dequantized weight,
and both at least as near the float32 product as bf16 quantized_matmul."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from squishlike.cpu_layers import ROWS, CpuQuantizedEmbedding, CpuQuantizedLinear, expert_product, use_cpu_kernels
from squishlike.errors import QuantizationError
from squishlike.quant import gather_qmv_int4


def quantized_linear(bits: int, bias: bool) -> nn.QuantizedLinear:
    mx.random.seed(bits)
    linear = nn.Linear(512, 192, bias=bias)
    linear.set_dtype(mx.bfloat16)
    return nn.QuantizedLinear.from_linear(linear, group_size=64, bits=bits)


def float32_product(layer, x: mx.array) -> mx.array:
    weight = mx.dequantize(layer.weight, layer.scales, layer.get("biases"), layer.group_size, layer.bits)
    return x.astype(mx.float32) @ weight.astype(mx.float32).T


def switched(layer: nn.Module) -> nn.Module:
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

    holder = Holder()
    assert use_cpu_kernels(holder) == 1
    return holder.layer


def same_bits(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("rows", [1, ROWS - 1, ROWS, 64])
def test_linear_takes_the_fast_product_for_its_rows(bits, rows):
    mlx_layer = quantized_linear(bits, bias=True)
    x = mx.random.normal((1, rows, 512)).astype(mx.bfloat16)
    mlx_out = mlx_layer(x)
    before = dict(tree_flatten(mlx_layer.parameters()))
    layer = switched(mlx_layer)
    assert isinstance(layer, CpuQuantizedLinear) and isinstance(layer, nn.QuantizedLinear)
    after = dict(tree_flatten(layer.parameters()))
    assert before.keys() == after.keys() and all(same_bits(before[k], after[k]) for k in before)

    out = layer(x)
    args = (layer.weight, layer.scales, layer["biases"])
    if rows < ROWS:  # a generated token: quantized_matmul in float32, cast back
        expected = mx.quantized_matmul(x.astype(mx.float32), *args, transpose=True, group_size=64, bits=bits)
    else:  # a prompt: one matmul of the weight dequantized to the activations' dtype
        expected = x @ mx.dequantize(*args, group_size=64, bits=bits).T
    expected = (expected.astype(mx.bfloat16) + layer["bias"]).astype(mx.bfloat16)
    if rows < ROWS and bits == 4:  # the Rust kernel: the float32 product summed in another order (bf16 ulps apart)
        assert out.dtype == mx.bfloat16 and mx.allclose(out, expected, rtol=2**-7, atol=1e-3).item()
    else:
        assert same_bits(out, expected)

    truth = float32_product(layer, x) + layer["bias"].astype(mx.float32)
    error = mx.abs(out.astype(mx.float32) - truth).max().item()
    mlx_error = mx.abs(mlx_out.astype(mx.float32) - truth).max().item()
    assert error <= mlx_error


def test_tied_head_takes_the_fast_product():
    mx.random.seed(0)
    embedding = nn.Embedding(1000, 128)
    embedding.set_dtype(mx.bfloat16)
    mlx_layer = nn.QuantizedEmbedding.from_embedding(embedding, group_size=64, bits=4)
    ids = mx.array([[1, 5, 999]])
    prompts = [mx.random.normal((1, rows, 128)).astype(mx.bfloat16) for rows in (1, ROWS)]
    mlx_rows, mlx_heads = mlx_layer(ids), [mlx_layer.as_linear(x) for x in prompts]
    layer = switched(mlx_layer)
    assert isinstance(layer, CpuQuantizedEmbedding)
    assert same_bits(layer(ids), mlx_rows)  # the lookup is MLX's own
    for x, mlx_head in zip(prompts, mlx_heads):
        truth = float32_product(layer, x)
        head = layer.as_linear(x)
        assert head.dtype == mx.bfloat16
        error = mx.abs(head.astype(mx.float32) - truth).max().item()
        assert error <= mx.abs(mlx_head.astype(mx.float32) - truth).max().item()


def test_only_mlx_quantized_layers_change():
    model = nn.Sequential(nn.Linear(64, 64), quantized_linear(4, bias=False), nn.LayerNorm(64))
    assert use_cpu_kernels(model) == 1
    assert [type(m) for m in model.layers] == [nn.Linear, CpuQuantizedLinear, nn.LayerNorm]
    assert use_cpu_kernels(model) == 0  # already switched


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_expert_stack_product_is_gather_qmms_in_float32(tokens, dtype):
    """An expert stack's product (the Rust kernel, quant.gather_qmv_int4) is mx.gather_qmm's float32 product of
    the routed experts, for a generated token and for a prompt whose tokens share experts, whatever the scales'
    dtype; SwitchGLU's shapes: x [1, tokens, 1, 1, cols] by indices [1, tokens, k], then x [1, tokens, k, 1, cols]."""
    mx.random.seed(tokens)
    weight, scales, biases = mx.quantize(mx.random.normal((6, 96, 256)).astype(dtype), group_size=64, bits=4)
    layer = nn.Module()
    layer.group_size, layer.bits, layer.mode = 64, 4, "affine"
    indices = mx.array(np.random.default_rng(tokens).integers(0, 6, (1, tokens, 3)).astype(np.uint32))
    for x in (mx.random.normal((1, tokens, 1, 1, 256)), mx.random.normal((1, tokens, 3, 1, 256))):
        x = x.astype(dtype)
        out = expert_product(layer, x, weight, scales, biases, indices, sorted_indices=False)
        truth = mx.gather_qmm(x.astype(mx.float32), weight, scales, biases, rhs_indices=indices, transpose=True,
                              group_size=64, bits=4)
        assert out.dtype == dtype and out.shape == truth.shape == (1, tokens, 3, 1, 96)
        assert mx.allclose(out.astype(mx.float32), truth, rtol=1e-2, atol=1e-2).item()


def test_kernel_refuses_an_expert_it_does_not_hold():
    words, scales, biases = (np.asarray(a) for a in mx.quantize(mx.random.normal((2, 8, 64)), group_size=64, bits=4))
    x = np.ones((1, 64), np.float32)
    with pytest.raises(QuantizationError, match="expert index 2 out of range for 2 matrices"):
        gather_qmv_int4(x, words, scales, biases, np.array([2], np.uint32), group_size=64, scale_dtype="float32")
    with pytest.raises(QuantizationError, match="scales has shape"):
        gather_qmv_int4(x, words, scales[:1].copy(), biases, np.array([0], np.uint32), group_size=64,
                        scale_dtype="float32")


def test_prompt_product_dequantizes_a_block_of_rows_at_a_time(monkeypatch):
    """A prompt through a large layer (an output head) never holds its whole dense weight: one block of output
    rows is dequantized at a time (cpu_layers.BLOCK_BYTES), with the same result."""
    from squishlike import cpu_layers

    mx.random.seed(7)
    linear = nn.Linear(512, 8192, bias=False)
    linear.set_dtype(mx.bfloat16)
    layer = switched(nn.QuantizedLinear.from_linear(linear, group_size=64, bits=4))
    mx.eval(layer.parameters())
    x = mx.random.normal((1, 2 * ROWS, 512)).astype(mx.bfloat16)
    mx.eval(x)

    def product_and_peak() -> tuple[mx.array, int]:
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        y = layer(x)
        mx.eval(y)
        return y, mx.get_peak_memory() - base

    whole, whole_peak = product_and_peak()  # 16 MB of float32 weight: one block
    monkeypatch.setattr(cpu_layers, "BLOCK_BYTES", 1 << 20)
    blocked, blocked_peak = product_and_peak()
    assert whole_peak > 8192 * 512 * 2  # the whole weight dense, at least in bf16
    assert blocked_peak < whole_peak / 4
    assert mx.allclose(blocked, whole, rtol=2**-7, atol=1e-3).item()
