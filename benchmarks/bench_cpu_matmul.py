"""The matmuls a quantized layer can run on `mlx[cpu]`, by rows of input: why squishlike/cpu_layers.py does what
it does (docs/design.md §6.5).

For one layer (default 8960x1536, a 1.5B Qwen2's MLP shape, groups of 64, bf16 weights and activations), in one
process, the methods taking turns within each repeat: MLX's `nn.QuantizedLinear` (bf16 `quantized_matmul`),
float32 `quantized_matmul` (bf16 scales kept), the weight dequantized for one bf16 matmul, squishlike's
`CpuQuantizedLinear` (which picks between the two by rows), and the bf16 dense layer. Medians in ms, and each
against MLX's own layer.

    python benchmarks/bench_cpu_matmul.py [--rows 1,4,8,16,64] [--bits 4] [--shape 8960x1536] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

from squishlike.cpu_layers import use_cpu_kernels


def once(f) -> float:
    started = time.perf_counter()
    mx.eval(f())
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,64")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--shape", default="8960x1536", help="OUTxIN")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    out_dims, in_dims = map(int, args.shape.split("x"))
    mx.random.seed(0)
    dense = nn.Linear(in_dims, out_dims, bias=False)
    dense.set_dtype(mx.bfloat16)
    mlx_layer = nn.QuantizedLinear.from_linear(dense, group_size=64, bits=args.bits)
    cpu_layer = nn.QuantizedLinear.from_linear(dense, group_size=64, bits=args.bits)
    use_cpu_kernels(nn.Sequential(cpu_layer))
    q = (mlx_layer.weight, mlx_layer.scales, mlx_layer.biases)
    options = {"group_size": 64, "bits": args.bits}
    methods = {
        "MLX QuantizedLinear (bf16)": lambda x: mlx_layer(x),
        "float32 quantized_matmul": lambda x: mx.quantized_matmul(x.astype(mx.float32), *q, transpose=True, **options),
        "dequantize + bf16 matmul": lambda x: x @ mx.dequantize(*q, **options).T,
        "squishlike CpuQuantizedLinear": lambda x: cpu_layer(x),
        "bf16 dense Linear": lambda x: dense(x),
    }
    print(f"{out_dims}x{in_dims}, {args.bits}-bit g64, {mx.default_device()}, median of {args.repeats} (ms; "
          "in brackets: MLX's layer / this)")
    print("rows | " + " | ".join(methods))
    for rows in map(int, args.rows.split(",")):
        x = mx.random.normal((1, rows, in_dims)).astype(mx.bfloat16)
        runs = {name: [] for name in methods}
        for name, f in methods.items():
            once(lambda: f(x))  # warm
        for _ in range(args.repeats):  # turns within each repeat: noise hits every method alike
            for name, f in methods.items():
                runs[name].append(once(lambda: f(x)))
        ms = {name: statistics.median(times) for name, times in runs.items()}
        base = ms["MLX QuantizedLinear (bf16)"]
        print(f"{rows:4d} | " + " | ".join(f"{v:8.1f} ({base / v:5.2f}x)" for v in ms.values()))


if __name__ == "__main__":
    main()
