"""mlx_lm's text generation (`mlx_lm generate`), with the model loaded by squishlike.load: mlx_lm.generate's flags
(`--model`, `--prompt` with `-` for stdin, `--system-prompt`, `--max-tokens`, `--temp`, `--top-p`, `--top-k`,
`--min-p`, `--seed`, `--ignore-chat-template`, `--verbose`, ...; `squishlike generate --help` lists them), its
streamed output and its prompt and generation tokens/s and peak-memory lines, plus `--tier TIER`, which forces a
tier of an npy-dir."""

from __future__ import annotations

from ..mlx_lm_tools import add_tool_arguments, run_tool_command

HELP = "generate text, as `mlx_lm generate` (its flags), plus --tier"
MLX_LM_TOOL = "generate"
add_arguments, run = add_tool_arguments, run_tool_command  # the shared pair of every tool subcommand
