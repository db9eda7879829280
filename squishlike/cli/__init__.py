"""The `squishlike` command. Each subcommand is a thin layer over the Python API; `python -m squishlike` is the same.

Each subcommand is a module of this package, named in SUBCOMMANDS, with `HELP` (one line for the command list), a
docstring (its description), `add_arguments(parser)` and `run(args) -> int`. A module imports what it works with
inside `run`, so that building the parser stays fast. A module that runs one of mlx_lm's tools names it in
`MLX_LM_TOOL` (squishlike/mlx_lm_tools.py): the flags its own parser does not know, `--help` included, reach `run`
as `args.tool_argv`, for that tool's parser to read.

Exit codes: 0 success, 1 a failure while working (disk full, corrupt data, busy directory), 2 a usage error
(bad option, missing or unknown model, output exists, tier not ready), as argparse itself does.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__
from ..errors import DirectoryBusyError, IntegrityError, SquishError

SUBCOMMANDS = ("compress", "generate", "chat", "server", "inspect", "verify", "export", "eval", "bench", "demo",
               "prune")
USAGE_ERRORS = (ValueError, FileNotFoundError, FileExistsError, SquishError)
RUNTIME_ERRORS = (IntegrityError, DirectoryBusyError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="squishlike",
        description="Compressed-at-rest, tiered weight loader for MLX language models. "
        "`squishlike.load` is a drop-in for `mlx_lm.load`.",
    )
    parser.add_argument("--version", action="version", version=f"squishlike {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        command = importlib.import_module(f"{__name__}.{name}")
        tool = getattr(command, "MLX_LM_TOOL", None)
        command_parser = sub.add_parser(name, help=command.HELP, description=command.__doc__, add_help=tool is None)
        command.add_arguments(command_parser)
        command_parser.set_defaults(run=command.run, mlx_lm_tool=tool)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, tool_argv = parser.parse_known_args(argv)
    if tool_argv and args.mlx_lm_tool is None:
        parser.error(f"unrecognized arguments: {' '.join(tool_argv)}")
    args.tool_argv = tool_argv
    if getattr(args, "fast_blas", False):  # float32 forward passes: 15x faster with the system OpenBLAS
        from ..openblas import reexec_with_openblas

        reexec_with_openblas(argv)
    try:
        return args.run(args)
    except RUNTIME_ERRORS as e:
        print(f"squishlike: error: {e}", file=sys.stderr)
        return 1
    except USAGE_ERRORS as e:
        print(f"squishlike {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("squishlike: interrupted; nothing was left half-written", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"squishlike: error: {e}", file=sys.stderr)
        return 1
