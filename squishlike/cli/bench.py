"""Time whole fresh processes loading a model with mlx_lm.load and with each squishlike tier, warm and with evicted
pages, beside the memory and disk floors; print medians, ratios and peak RSS as a Markdown table (and JSON / a PNG
chart). The benchmark is a harness beside the package (benchmarks/loadbench in the source repository), not part of
an installed wheel."""

from __future__ import annotations

import argparse
import sys

HELP = "load-time benchmark: every tier against mlx_lm.load, warm and cold"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    try:
        from benchmarks.loadbench import add_arguments as add_bench_arguments
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", "benchmarks.loadbench"):
            raise
        parser.add_argument("args", nargs=argparse.REMAINDER)  # whatever is asked, the answer is the same
        parser.set_defaults(bench_unavailable=True)
        return
    add_bench_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench_unavailable", False):
        print("squishlike bench: the load benchmark ships with the source repository (benchmarks/loadbench), not "
              "with the installed package; run it from a checkout: python -m benchmarks.loadbench", file=sys.stderr)
        return 2
    from benchmarks.loadbench import run as run_bench

    return run_bench(args)
