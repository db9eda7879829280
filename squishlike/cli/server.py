"""mlx_lm's OpenAI-compatible HTTP server (`mlx_lm server`), with models loaded by squishlike.load: the same flags
(`squishlike server --help` lists them) and the same API. A request's `model` field names a store, a model
directory, a GGUF file or a Hugging Face repo, and switches to it, as in mlx_lm."""

from __future__ import annotations

import argparse

HELP = "mlx_lm's OpenAI-compatible HTTP server, loading through squishlike (flags as `mlx_lm server`)"
MLX_LM_TOOL = "server"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag is mlx_lm.server's own, parsed by it."""


def run(args: argparse.Namespace) -> int:
    from ..mlx_lm_tools import run_tool

    run_tool(MLX_LM_TOOL, args.tool_argv)
    return 0
