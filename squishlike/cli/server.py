"""mlx_lm's OpenAI-compatible HTTP server (`mlx_lm server`), with models loaded by squishlike.load: the same flags
(`squishlike server --help` lists them) and the same API. A request's `model` field names a store, a model
directory, a GGUF file or a Hugging Face repo, and switches to it, as in mlx_lm. `--tier TIER` forces a tier."""

from __future__ import annotations

from ..mlx_lm_tools import add_tool_arguments, run_tool_command

HELP = "mlx_lm's OpenAI-compatible HTTP server, loading through squishlike (flags as `mlx_lm server`)"
MLX_LM_TOOL = "server"
add_arguments, run = add_tool_arguments, run_tool_command  # the shared pair of every tool subcommand
