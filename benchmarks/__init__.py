"""Measuring tools that live beside the squishlike package, not in it: the load benchmark (loadbench), the
quantization-quality run (quality.py) and the kernel timings (bench_kernels.py)."""
