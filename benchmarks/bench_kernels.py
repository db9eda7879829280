"""Dequantization throughput of the Rust kernels: per-row INT8, and group-wise INT8, INT4 and the bitstream widths
(INT2, INT3, INT5, INT6) -> bfloat16 (groups of 64, bf16 scales).

Measured in GB/s of output, in one run, against
- a plain copy (np.copyto) of the same output bytes into memory that is already touched: the memory-speed ceiling;
- the NumPy reference (squishlike.quant.reference), the spec the kernels must match bit for bit.
Every method writes into buffers touched beforehand, so first-touch page faults (docs/design.md §1.2) are not
part of any number.
The methods take turns within each repeat, so machine noise hits them alike; the table reports medians.

Two workloads: one 4096x11008 matrix, and a ~1 GB (output) set of Llama-7B-shaped matrices. The NumPy reference is
too slow for the whole 1 GB set, so it runs on the set's first matrices and its throughput is taken as the set's;
the output says so.

    python benchmarks/bench_kernels.py            # table
    python benchmarks/bench_kernels.py --json     # JSON
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

import squishlike.quant as rq
import squishlike.quant.reference as ref
from squishlike.quant.schemes import SCHEMES as SCHEMES_TABLE

GROUP = 64
LLAMA_7B_LAYER = [(4096, 4096)] * 4 + [(11008, 4096), (11008, 4096), (4096, 11008)]  # q k v o gate up down
TARGET_VS_COPY, TARGET_VS_NUMPY = 0.7, 20.0
SCHEMES = ("int8", "int8g", "int4", "int3", "int2", "int5", "int6")
LABELS = {scheme: f"{scheme} -> bf16{'' if scheme == 'int8' else f' (g{GROUP})'}" for scheme in SCHEMES}


def group_params(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Random bf16 scales and biases, one per group."""
    scales = rng.random((rows, cols // GROUP), dtype=np.float32) * np.float32(0.01)
    biases = rng.standard_normal((rows, cols // GROUP), dtype=np.float32) * np.float32(0.1)
    return ref.from_float32(scales, "bfloat16"), ref.from_float32(biases, "bfloat16")


class Workload:
    """Random stores of every scheme in `schemes` for a list of matrix shapes (random codes, scales and biases),
    plus touched bf16 output and copy-source buffers."""

    def __init__(self, name: str, shapes: list[tuple[int, int]], schemes: tuple[str, ...] = SCHEMES, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.name, self.shapes = name, shapes
        self.out_bytes = sum(r * c * 2 for r, c in shapes)
        self.parts = {scheme: [self._parts(rng, scheme, r, c) for r, c in shapes] for scheme in schemes}
        self.out = [np.ones((r, c), np.uint16) for r, c in shapes]  # np.ones touches every page
        self.src = [np.full((r, c), 7, np.uint16) for r, c in shapes]

    @staticmethod
    def _parts(rng: np.random.Generator, scheme: str, rows: int, cols: int) -> tuple[np.ndarray, ...]:
        if scheme == "int8":
            return rng.integers(-127, 128, (rows, cols), dtype=np.int8), rng.random(rows, dtype=np.float32) * np.float32(0.01)
        kind = SCHEMES_TABLE[scheme]
        words = rng.integers(0, np.iinfo(kind.word).max, (rows, kind.packed_cols(cols)), dtype=kind.word,
                             endpoint=True)
        return words, *group_params(rng, rows, cols)

    def copy(self, k: int | None = None) -> None:
        for dst, src in zip(self.out[:k], self.src[:k]):
            np.copyto(dst, src)

    def dequantize(self, module, scheme: str, k: int | None = None) -> None:
        """Every matrix (or the first k) of `scheme` dequantized by `module`: the Rust kernels or the NumPy spec."""
        grouped = {} if scheme == "int8" else {"group_size": GROUP, "scale_dtype": "bfloat16"}
        name = f"dequantize_{scheme}"
        for parts, out in zip(self.parts[scheme][:k], self.out[:k]):
            getattr(module, name)(*parts, out_dtype="bfloat16", out=out, **grouped)


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(work: Workload, repeats: int, numpy_repeats: int, numpy_matrices: int) -> dict:
    """Median GB/s of every method on one workload, the methods interleaved within each repeat."""
    schemes = tuple(work.parts)
    methods = {"copy": work.copy, **{scheme: functools.partial(work.dequantize, rq, scheme) for scheme in schemes}}
    for fn in methods.values():  # warm-up: thread pool, caches, lazy imports
        fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            times[name].append(timed(fn))
    gbps = {name: work.out_bytes / 1e9 / statistics.median(t) for name, t in times.items()}

    k = min(numpy_matrices, len(work.shapes))
    numpy_bytes = sum(r * c * 2 for r, c in work.shapes[:k])
    numpy_gbps = {}
    for scheme in schemes:
        run = functools.partial(work.dequantize, ref, scheme, k)
        numpy_gbps[scheme] = numpy_bytes / 1e9 / statistics.median(timed(run) for _ in range(numpy_repeats))
    return {
        "workload": work.name,
        "matrices": len(work.shapes),
        "output_bytes": work.out_bytes,
        "copy_gbps": gbps["copy"],
        "numpy_subset": None if k == len(work.shapes) else {"matrices": k, "output_bytes": numpy_bytes},
        **{
            scheme: {
                "gbps": gbps[scheme],
                "numpy_gbps": numpy_gbps[scheme],
                "vs_copy": gbps[scheme] / gbps["copy"],
                "vs_numpy": gbps[scheme] / numpy_gbps[scheme],
                "meets_targets": gbps[scheme] >= TARGET_VS_COPY * gbps["copy"]
                and gbps[scheme] >= TARGET_VS_NUMPY * numpy_gbps[scheme],
            }
            for scheme in schemes
        },
    }


def model_shapes(total_bytes: float) -> list[tuple[int, int]]:
    """Llama-7B layer matrices, layer after layer, until their bf16 output reaches total_bytes."""
    shapes: list[tuple[int, int]] = []
    while sum(r * c * 2 for r, c in shapes) < total_bytes:
        shapes.append(LLAMA_7B_LAYER[len(shapes) % len(LLAMA_7B_LAYER)])
    return shapes


def print_table(results: list[dict], machine: dict) -> None:
    print(f"{machine['cpus']} CPUs, {machine['platform']}; medians of {machine['repeats']} repeats (NumPy: "
          f"{machine['numpy_repeats']}); GB/s of bfloat16 output written into touched memory")
    header = f"{'workload':<34} {'method':<26} {'GB/s':>7} {'vs copy':>8} {'vs NumPy':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        name = f"{r['workload']} ({r['output_bytes'] / 1e9:.2f} GB)"
        print(f"{name:<34} {'np.copyto':<26} {r['copy_gbps']:7.2f} {1:8.2f} {'':>9}")
        for scheme in [s for s in SCHEMES if s in r]:
            s, label = r[scheme], LABELS[scheme]
            print(f"{'':<34} {'rust ' + label:<26} {s['gbps']:7.2f} {s['vs_copy']:8.2f} {s['vs_numpy']:9.1f}")
            print(f"{'':<34} {'numpy ' + label:<26} {s['numpy_gbps']:7.2f} {s['numpy_gbps'] / r['copy_gbps']:8.2f}")
        if r["numpy_subset"]:
            sub = r["numpy_subset"]
            print(f"{'':<34} (NumPy timed on the first {sub['matrices']} matrices, "
                  f"{sub['output_bytes'] / 1e9:.2f} GB, and taken as the set's throughput)")
    print()
    for r in results:
        for scheme in [s for s in SCHEMES if s in r]:
            s = r[scheme]
            print(f"{'ok  ' if s['meets_targets'] else 'MISS'} {r['workload']:<22} {scheme}: {s['vs_copy']:.2f}x copy "
                  f"(target >= {TARGET_VS_COPY}), {s['vs_numpy']:.0f}x NumPy (target >= {TARGET_VS_NUMPY:.0f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per method (median reported)")
    parser.add_argument("--numpy-repeats", type=int, default=3)
    parser.add_argument("--model-bytes", type=float, default=1e9, help="output bytes of the model-sized set")
    parser.add_argument("--numpy-matrices", type=int, default=2, help="matrices of the set the NumPy reference runs")
    parser.add_argument("--schemes", type=lambda text: tuple(text.split(",")), default=SCHEMES,
                        help=f"comma-separated, from {','.join(SCHEMES)} (default: all)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()

    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "repeats": args.repeats,
        "numpy_repeats": args.numpy_repeats,
    }
    results = []
    for name, shapes in (("4096x11008", [(4096, 11008)]), ("llama-7b-shaped set", model_shapes(args.model_bytes))):
        work = Workload(name, shapes, args.schemes)
        results.append(bench(work, args.repeats, args.numpy_repeats, args.numpy_matrices))
    if args.json:
        print(json.dumps({"machine": machine, "results": results}, indent=2))
    else:
        print_table(results, machine)


if __name__ == "__main__":
    main()
