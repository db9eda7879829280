"""mlx_lm's interactive chat (`mlx_lm chat`), with the model loaded by squishlike.load: the same flags
(`squishlike chat --help` lists them) and commands (q quits, r resets, h helps)."""

from __future__ import annotations

import argparse

HELP = "chat with a model in the terminal, as `mlx_lm chat`"
MLX_LM_TOOL = "chat"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag is mlx_lm.chat's own, parsed by it."""


def run(args: argparse.Namespace) -> int:
    from ..mlx_lm_tools import run_tool

    run_tool(MLX_LM_TOOL, args.tool_argv)
    return 0
