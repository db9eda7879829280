"""mlx_lm's text generation (`mlx_lm generate`), with the model loaded by squishlike.load: mlx_lm.generate's flags
(`--model`, `--prompt` with `-` for stdin, `--system-prompt`, `--max-tokens`, `--temp`, `--top-p`, `--top-k`,
`--min-p`, `--seed`, `--ignore-chat-template`, `--verbose`, ...; `squishlike generate --help` lists them), its
streamed output and its prompt and generation tokens/s and peak-memory lines, plus `--tier TIER`, which forces a
tier of an npy-dir.

Under `mlx.launch` each rank loads only its share with squishlike.sharded_load (tensor parallelism where the model
has it, else pipeline parallelism; `--pipeline` asks for pipeline parallelism) and only rank 0 prints, as mlx_lm's
sharded_generate example does; mlx_lm's own `generate` has no distributed mode."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import TYPE_CHECKING, Any, Callable

from ..mlx_lm_tools import add_tool_arguments, run_tool, run_tool_command

if TYPE_CHECKING:
    import mlx.core as mx

HELP = "generate text, as `mlx_lm generate` (its flags), plus --tier, and --pipeline under mlx.launch"
MLX_LM_TOOL = "generate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_tool_arguments(parser)
    parser.add_argument("--pipeline", action="store_true",
                        help="under mlx.launch: pipeline parallelism instead of tensor parallelism")


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    group = mx.distributed.init()
    if group.size() == 1:
        return run_tool_command(args)
    if args.tier is not None:  # a share is no tier of the store's to force; better refused than ignored
        raise ValueError(f"tier={args.tier} forces a tier of a one-process load; under mlx.launch each rank reads "
                         f"its own share")
    # Every rank runs the same generation (each step is a collective); only rank 0's output is the answer.
    with contextlib.ExitStack() as stack:
        if group.rank() != 0:
            stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
        run_tool(MLX_LM_TOOL, args.tool_argv, loader=sharded_loader(group if args.pipeline else None,
                                                                    args.max_memory))
    # mlx_lm computes each token one step ahead, so a step is still in flight when generation ends; a rank that
    # exited then would leave the others waiting on it in that step's collectives ("connection to a peer was lost")
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    return 0


def sharded_loader(pipeline_group: mx.distributed.Group | None, max_memory: int | None = None) -> Callable[..., Any]:
    """mlx_lm.generate's `load`, answered with this rank's share (squishlike.sharded_load) within `max_memory`: a
    pipeline over `pipeline_group`, or with none, the split sharded_load picks. What a share cannot take is refused, not
    dropped: an adapter (as mlx_lm's chat and server refuse it on several ranks) and a changed model config."""
    from ..load.sharded import sharded_load

    def load(path: str, adapter_path: str | None = None, tokenizer_config: dict[str, Any] | None = None,
             model_config: dict[str, Any] | None = None, return_config: bool = False,
             trust_remote_code: bool = False) -> tuple:
        if adapter_path is not None:
            raise ValueError("adapters are not supported under mlx.launch (several ranks)")
        changed = [key for key, value in (model_config or {}).items() if value]  # {"quantize_activations": False}
        if changed:
            raise ValueError(f"{', '.join(changed)}: not supported under mlx.launch (several ranks)")
        return sharded_load(path, pipeline_group, None, return_config, tokenizer_config=tokenizer_config,
                            trust_remote_code=trust_remote_code, max_memory=max_memory)

    return load
