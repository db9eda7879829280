"""mlx_lm's OpenAI-compatible HTTP server (`mlx_lm server`) with Ollama-style model management, loading through
squishlike: mlx_lm's flags and API, plus the options below. A request's `model` names the `--model` the server was
started with, a model directly under a `--model-dir` (by its name or path), or, with `--allow-hub`, a Hugging Face
repo id; any other name gets HTTP 404. Models load on their first request, stay resident within `--max-memory`
(least recently used evicted first) and unload after `--keep-alive` idle seconds; `GET /api/ps` shows them.
docs/server.md compares each flag with mlx_lm.server's."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from ..mlx_lm_tools import add_tool_arguments

HELP = "mlx_lm's OpenAI-compatible HTTP server with model management, loading through squishlike"
MLX_LM_TOOL = "server"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_tool_arguments(parser, "memory budget of the resident models, e.g. 8GB; the least recently used idle model "
                       "is unloaded to make room (default: half the physical memory); a mixture of experts larger "
                       "than it alone keeps its experts in the store, in a cache of the bytes left")
    parser.add_argument("--model-dir", type=Path, action="append", metavar="DIR",
                        help="serve the models directly under DIR, by name (repeatable); the server writes tier "
                        "caches only into these and --model")
    parser.add_argument("--allow-hub", action="store_true",
                        help="also serve Hugging Face repo ids a request names (downloaded into the HF cache)")
    parser.add_argument("--keep-alive", default="5m", metavar="DURATION",
                        help="unload a model idle this long (seconds, or 30s, 5m, 1h; negative: never); a "
                        "request's keep_alive field sets it for its model")
    parser.add_argument("--max-wait", type=float, default=60.0, metavar="SECONDS",
                        help="how long a request waits for generating models to free the memory its model needs, "
                        "before HTTP 503")
    parser.add_argument("--preload", action="store_true", help="load --model at start instead of on first request")


def run(args: argparse.Namespace) -> int:
    from ..loader import load
    from ..mlx_lm_tools import run_tool
    from ..server import ServerOptions, parse_duration, serve

    options = ServerOptions(model_dirs=args.model_dir or [], allow_hub=args.allow_hub, max_wait=args.max_wait,
                            keep_alive=parse_duration(args.keep_alive), preload=args.preload)
    if args.max_memory is not None:
        options.max_memory = args.max_memory
    loader = functools.partial(load, tier=args.tier, max_memory=args.max_memory)
    for directory in options.model_dirs:
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory}: --model-dir is not a directory")

    import mlx_lm.server

    single_model_run = mlx_lm.server.run

    def managed_run(host: str, port: int, model_provider) -> None:  # in place of mlx_lm.server.run
        if model_provider.is_distributed:  # under mlx.launch: one sharded model, mlx_lm's way
            return single_model_run(host, port, model_provider)
        serve(host, port, model_provider.cli_args, options, loader)

    run_tool("server", args.tool_argv, loader=loader, seams={"run": managed_run}, max_memory=args.max_memory)
    return 0
