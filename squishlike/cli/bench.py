"""Time whole fresh processes loading a model with mlx_lm.load and with each squishlike tier, warm and with evicted
pages, beside the memory and disk floors; print medians, ratios and peak RSS as a Markdown table (and JSON / a PNG
chart)."""

from __future__ import annotations

import argparse

HELP = "load-time benchmark: every tier against mlx_lm.load, warm and cold"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..bench import add_bench_arguments

    add_bench_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ..bench import run_bench

    return run_bench(args)
