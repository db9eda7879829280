"""The `squishlike` command. Each subcommand is a thin layer over the Python API; `python -m squishlike` is the same.

Each subcommand is a module of this package, named in SUBCOMMANDS, with `HELP` (one line for the command list), a
docstring (its description), `add_arguments(parser)` and `run(args) -> int`. A module imports what it works with
inside `run`, so that building the parser stays fast. A module that runs one of mlx_lm's tools names it in
`MLX_LM_TOOL` (squishlike/mlx_lm_tools.py): the flags its own parser does not know, `--help` included, reach `run`
as `args.tool_argv`, for that tool's parser to read.

Exit codes: 0 success, 1 a failure while working (disk full, corrupt data, busy directory, a failed accuracy
gate), 2 a usage error (bad option, missing or unknown model, output exists, tier not ready), as argparse itself
does. Results go to stdout; progress, warnings and errors to stderr. Every error reads
"squishlike COMMAND: error: ...", the form argparse uses; the API's messages name an option as `name=value`, which
the CLI shows as the subcommand's flag.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from .. import __version__
from ..errors import AccuracyGateError, DirectoryBusyError, IntegrityError, SquishError

SUBCOMMANDS = ("compress", "generate", "chat", "server", "inspect", "verify", "export", "eval", "bench", "demo",
               "prune")
USAGE_ERRORS = (ValueError, FileNotFoundError, FileExistsError, SquishError)
RUNTIME_ERRORS = (IntegrityError, DirectoryBusyError, AccuracyGateError)  # before USAGE_ERRORS: some are both


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default that says something: not an unset option (None) or an off switch (False), and not
    where the help text already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        unset = action.default is None or action.default is False or action.default == ()
        if unset or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="squishlike",
        description="Compressed-at-rest, tiered weight loader for MLX language models. "
        "`squishlike.load` is a drop-in for `mlx_lm.load`.",
    )
    parser.add_argument("--version", action="version", version=f"squishlike {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    flags: dict[str, dict[str, str]] = {}  # command -> option name -> its flag
    for name in SUBCOMMANDS:
        command = importlib.import_module(f"{__name__}.{name}")
        tool = getattr(command, "MLX_LM_TOOL", None)
        # a tool's flags reach the tool whole: `--model` must not read as an abbreviation of our `--model-dir`
        command_parser = sub.add_parser(name, help=command.HELP, description=command.__doc__, add_help=tool is None,
                                        allow_abbrev=tool is None, formatter_class=HelpFormatter)
        command.add_arguments(command_parser)
        command_parser.set_defaults(run=command.run, mlx_lm_tool=tool, parser=command_parser)
        # An option's longest flag; of a --x/--no-x pair, --x: what `name=True` in a message means
        flags[name] = {a.dest: max(a.option_strings, key=lambda f: (not f.startswith("--no-"), len(f)))
                       for a in command_parser._actions if a.option_strings}
    # A message may point to another command's option ("compress with scheme=int4"): its flags are named too.
    every_flag = {dest: flag for own in flags.values() for dest, flag in own.items()}
    for name, own in flags.items():
        sub.choices[name].set_defaults(flags={**every_flag, **own})
    return parser


def _own_options(parser: argparse.ArgumentParser) -> str:
    """The help of a parser's own options: for a tool's subcommand, what follows the tool's own --help."""
    formatter = parser._get_formatter()
    formatter.start_section("squishlike's options (beside the mlx_lm flags above)")
    formatter.add_arguments(parser._actions)
    formatter.end_section()
    return formatter.format_help()


def as_flags(message: str, flags: dict[str, str]) -> str:
    """An API message with its options (`name=value`, `name=True`) spelled as the subcommand's flags."""
    for dest, flag in flags.items():
        message = re.sub(rf"(?<![\w-]){dest}=True\b", flag, message)
        message = re.sub(rf"(?<![\w-]){dest}=(['\"]?)([^\s'\",;)]*)\1",
                         lambda m, flag=flag: f"{flag} {m.group(2)}" if m.group(2) else flag, message)
    return message


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `squishlike ... | head`: the reader has all it wanted, which is no failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail too
        return 0


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, tool_argv = parser.parse_known_args(argv)
    if tool_argv and args.mlx_lm_tool is None:  # a mistyped flag of this subcommand: its usage, not the top level's
        args.parser.error(f"unrecognized arguments: {' '.join(tool_argv)}")
    args.tool_argv = tool_argv
    fast_blas = getattr(args, "fast_blas", False)  # a subcommand's bool, or a function of its parsed arguments
    if fast_blas(args) if callable(fast_blas) else fast_blas:  # float32 forward passes: 15x faster with OpenBLAS
        from ..openblas import reexec_with_openblas

        reexec_with_openblas(argv)
    tool_help = args.mlx_lm_tool is not None and not {"-h", "--help"}.isdisjoint(tool_argv)
    try:
        return args.run(args)  # with tool_help, the tool's parser prints its help and exits
    except BrokenPipeError:  # no failure of the work (an OSError): main() ends quietly
        raise
    except (*RUNTIME_ERRORS, *USAGE_ERRORS, OSError) as e:  # OSError: disk full, permission denied
        print(f"squishlike {args.command}: error: {as_flags(str(e), args.flags)}", file=sys.stderr)
        return 2 if isinstance(e, USAGE_ERRORS) and not isinstance(e, RUNTIME_ERRORS) else 1
    except KeyboardInterrupt:
        print(f"squishlike {args.command}: interrupted; nothing was left half-written", file=sys.stderr)
        return 130
    finally:
        if tool_help:
            print(_own_options(args.parser))
