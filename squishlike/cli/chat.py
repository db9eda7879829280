"""mlx_lm's interactive chat (`mlx_lm chat`), with the model loaded by squishlike.load: the same flags
(`squishlike chat --help` lists them) and commands (q quits, r resets, h helps). `--tier TIER` forces a tier."""

from __future__ import annotations

from ..mlx_lm_tools import add_tool_arguments, run_tool_command

HELP = "chat with a model in the terminal, as `mlx_lm chat`"
MLX_LM_TOOL = "chat"
add_arguments, run = add_tool_arguments, run_tool_command  # the shared pair of every tool subcommand
