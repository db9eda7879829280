"""mlx_lm's text generation (`mlx_lm generate`), with the model loaded by squishlike.load: mlx_lm.generate's flags
(`--model`, `--prompt` with `-` for stdin, `--system-prompt`, `--max-tokens`, `--temp`, `--top-p`, `--top-k`,
`--min-p`, `--seed`, `--ignore-chat-template`, `--verbose`, ...; `squishlike generate --help` lists them), its
streamed output and its prompt and generation tokens/s and peak-memory lines, plus `--tier TIER`, which forces a
tier of an npy-dir."""

from __future__ import annotations

import argparse

HELP = "generate text, as `mlx_lm generate` (its flags), plus --tier"
MLX_LM_TOOL = "generate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--tier` is squishlike's; every other flag is mlx_lm.generate's own, parsed by it."""
    from ..tiers import TIER_NAMES

    parser.add_argument("--tier", choices=TIER_NAMES, help="force a tier of an npy-dir")


def run(args: argparse.Namespace) -> int:
    from ..mlx_lm_tools import run_tool

    run_tool(MLX_LM_TOOL, args.tool_argv, tier=args.tier)
    return 0
