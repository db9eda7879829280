"""Quantized layers that are fast on `mlx[cpu]`: what a squishlike store's quantized model runs on a CPU.

MLX 0.32's CPU `quantized_matmul` is fast in float32 only. Measured on this project's 2-core VM with one 8960x1536
4-bit layer, groups of 64 (benchmarks/bench_cpu_matmul.py, docs/design.md §6.5): one row of input took 14.5 ms in
float32 against 121 ms in bfloat16 (a bf16 dense matvec: 11.1 ms); 64 rows took 1.0 s in float32, 8.4 s in
bfloat16, and 0.53 s to dequantize the layer and run one bf16 matmul. So a quantized layer here

- runs a few rows (a generated token) through `quantized_matmul` in float32 and casts the result back: near the
  dense model's matvec, at the quantized weights' memory;
- runs a prompt (ROWS rows or more) as one matmul of its weight dequantized to the activations' dtype: near the
  dense model's prompt pass, and only one layer's dense weight alive at a time.

Both are nearer the float32 product than bf16 `quantized_matmul` (whose accumulation in bf16 loses most).

A MoE model's expert stacks (mlx_lm's QuantizedSwitchLinear, and the streamed stacks of squishlike/load/) run
`gather_qmm` the same way, in float32 on the routed experts' rows (bf16 scales kept as they are).

MLX's float32 `quantized_matmul` and `gather_qmm` themselves run ~1 GMAC/s on this VM, so where the weights are
MLX's 4-bit affine form (a squishlike INT4 store's), a generated token's rows and every expert stack's rows go to
the Rust kernel instead (`quant.gather_qmv_int4`, rust_quant/src/qmv.rs): each group's codes unpacked once and
dotted with every row routed to that matrix, on every core; 2.5-4x MLX's float32 products on one layer (8 routed
experts of a Qwen3-30B-A3B stack: 12 ms against 30 ms; a prompt of 16 tokens: 149 ms against 589 ms), the same
float32 product summed in another order. Decode figures: benchmarks/README.md (bench_experts.py --bf16-baseline).

The layers are `nn.QuantizedLinear` and `nn.QuantizedEmbedding` with the same parameters (mlx_lm's code that
checks `isinstance`, saves or fuses them keeps working); only their matmul differs, so their outputs are not
bit-identical to mlx_lm's model of the same weights. They serve squishlike's own stores; a quantized MLX
directory loads as mlx_lm loads it.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from .quant import gather_qmv_int4

_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}

# From this many rows of input on, dequantizing the weight for one dense matmul is faster than float32
# quantized_matmul, which costs the same for every row (crossover measured at 7-8 rows on the layer above).
ROWS = 8
# The most dense weight a prompt's product makes at once (in float32 bytes): see _quantized_product.
BLOCK_BYTES = 64 << 20


def _quantized_product(layer: nn.Module, x: mx.array) -> mx.array:
    """x @ layer's weight.T, the fast way for x's number of rows on mlx[cpu]."""
    biases = layer.get("biases")
    if x.size // x.shape[-1] >= ROWS:
        # Dequantized only once x is computed: otherwise MLX may schedule every layer's dequantize first, and the
        # prompt pass would hold much of the dense model at once. A block of output rows at a time: an output
        # head's whole dense weight (151936 x 2048) took 3.1 GB at once for a 33-token prompt.
        block = max(1, BLOCK_BYTES // (4 * x.shape[-1]))
        products = []
        for start in range(0, layer.weight.shape[0], block):
            rows = slice(start, start + block)
            (codes,) = mx.depends([layer.weight[rows]], [x if not products else products[-1]])
            weight = mx.dequantize(codes, layer.scales[rows], None if biases is None else biases[rows],
                                   layer.group_size, layer.bits, mode=layer.mode)
            products.append(x @ weight.astype(x.dtype).T)
        return products[0] if len(products) == 1 else mx.concatenate(products, axis=-1)
    if _kernel_takes(layer, biases):
        rows = x.reshape(-1, x.shape[-1])
        product = _kernel_product(layer, rows, layer.weight, layer.scales, biases, mx.zeros(rows.shape[0], mx.uint32))
        return product.reshape(*x.shape[:-1], -1).astype(x.dtype)
    product = mx.quantized_matmul(x.astype(mx.float32), layer.weight, layer.scales, biases, transpose=True,
                                  group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
    return product.astype(x.dtype)


# The Rust kernel's products (quant.gather_qmv_int4) where they apply; the benchmark turns it off to measure it.
KERNEL = True


def _kernel_takes(layer: nn.Module, biases: mx.array | None) -> bool:
    """Whether the Rust kernel (quant.gather_qmv_int4) multiplies by `layer`'s weights: MLX's 4-bit affine form."""
    return KERNEL and layer.bits == 4 and layer.mode == "affine" and biases is not None and layer.group_size in (32, 64, 128)


def _numpy(a: mx.array) -> np.ndarray:
    """`a` as a C-contiguous NumPy array, its own buffer where it is contiguous (bfloat16 as its uint16 bits)."""
    return np.ascontiguousarray(memoryview(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a))


def _kernel_product(layer: nn.Module, rows: mx.array, weight: mx.array, scales: mx.array, biases: mx.array,
                    experts: mx.array) -> mx.array:
    """float32 [rows, out]: each of `rows` ([rows, cols]) times the matrix of (weight, scales, biases) `experts`
    picks for it ([rows]), transposed, by the Rust kernel: ~3x mlx[cpu]'s float32 quantized_matmul and gather_qmm
    on a generated token (benchmarks/bench_experts.py), and it takes a prompt's rows one expert at a time."""
    product = gather_qmv_int4(_numpy(rows.astype(mx.float32)), _numpy(weight), _numpy(scales), _numpy(biases),
                              _numpy(experts.astype(mx.uint32)), group_size=layer.group_size,
                              scale_dtype=_DTYPE_NAMES[scales.dtype])
    return mx.array(product)


def expert_product(layer: nn.Module, x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array | None,
                   indices: mx.array, sorted_indices: bool) -> mx.array:
    """`layer`'s gather_qmm of x by the experts `indices` picks from (weight, scales, biases), in float32 on a
    CPU (mlx[cpu]'s fast path; module doc), cast back to x's dtype; as mlx_lm computes it anywhere else."""
    if mx.default_device() == mx.cpu and _kernel_takes(layer, biases):
        lead = np.broadcast_shapes(x.shape[:-2], indices.shape)
        rows, cols = x.shape[-2], x.shape[-1]
        xs = mx.broadcast_to(x, (*lead, rows, cols)).reshape(-1, cols)
        experts = mx.repeat(mx.broadcast_to(indices, lead).reshape(-1), rows)
        y = _kernel_product(layer, xs, weight, scales, biases, experts)
        return y.reshape(*lead, rows, -1).astype(x.dtype)
    fast = mx.default_device() == mx.cpu and x.dtype != mx.float32
    y = mx.gather_qmm(x.astype(mx.float32) if fast else x, weight, scales, biases, rhs_indices=indices,
                      transpose=True, group_size=layer.group_size, bits=layer.bits, mode=layer.mode,
                      sorted_indices=sorted_indices)
    return y.astype(x.dtype) if fast else y


class CpuQuantizedSwitchLinear(QuantizedSwitchLinear):
    """mlx_lm's QuantizedSwitchLinear (an expert stack) with mlx[cpu]'s fast float32 gather_qmm (module doc)."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = expert_product(self, x, self["weight"], self["scales"], self.get("biases"), indices, sorted_indices)
        return y + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else y


class CpuQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear with mlx[cpu]'s fast matmuls (module doc)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _quantized_product(self, x)
        return y + self["bias"] if "bias" in self else y


class CpuQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose use as the output head (a tied embedding) has mlx[cpu]'s fast matmuls."""

    def as_linear(self, x: mx.array) -> mx.array:
        return _quantized_product(self, x)


_CPU_CLASS = {nn.QuantizedLinear: CpuQuantizedLinear, nn.QuantizedEmbedding: CpuQuantizedEmbedding,
              QuantizedSwitchLinear: CpuQuantizedSwitchLinear}


def use_cpu_kernels(model: nn.Module) -> int:
    """Give `model`'s quantized linear and embedding layers mlx[cpu]'s fast matmuls, in place; the number changed.

    Each layer's class is switched rather than the layer rebuilt: the subclasses add no state, and building a
    QuantizedLinear quantizes a random weight first. Layers of any other class (a model's own) are left as they
    are."""
    changed = 0
    for _, module in model.named_modules():
        if (cpu_class := _CPU_CLASS.get(type(module))) is not None:
            module.__class__ = cpu_class
            changed += 1
    return changed
