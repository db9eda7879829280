"""Offline end-to-end run on the embedded SmolLM2-135M: compress it to INT8 and INT4, load it cold and then warm
from each tier in fresh processes, answer a question, and print load times beside mlx_lm.load of the same model."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "the main job: compress the embedded SmolLM2, load every tier, answer a question"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=Path, default=Path("squishlike-demo"), help="where the models go")
    parser.add_argument("--repeats", type=int, default=3, help="fresh-process loads per figure (median reported)")


def run(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    run_demo(args.workdir, repeats=args.repeats)
    return 0
