"""mlx_lm's own command-line tools (`server`, `chat`, `generate`), run with models loaded by `squishlike.load`.

The seam: each of those mlx_lm modules binds `load` from mlx_lm.utils at import (`from .utils import load`) and
calls it by that module-level name, with `mlx_lm.load`'s arguments. `run_tool` rebinds that name to
`squishlike.load` for the run (and `sharded_load`, which chat and server call under `mlx.launch`, to
`squishlike.sharded_load`), then calls the tool's own `main()`, which parses its own flags from `sys.argv`;
everything else (HTTP API, chat loop, sampling, streaming, the tokens/s lines) is mlx_lm's code, unchanged.
The seam was read and tested on the mlx_lm series in TESTED_MLX_LM only; on any other it refuses, naming the
version, rather than half-work.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import re
import sys
from typing import Any, Callable

from .errors import IncompatibleVersionError

TESTED_MLX_LM = "0.32"  # the minor series whose server.py, chat.py and generate.py this seam was checked against
TOOLS = ("server", "chat", "generate")


def check_mlx_lm_version(version: str) -> None:
    """Refuse, naming it, an mlx_lm `version` outside the series the seam is tested on."""
    if version.split(".")[:2] != TESTED_MLX_LM.split("."):
        raise IncompatibleVersionError(
            f"mlx_lm {version} is installed, but squishlike runs mlx_lm's server, chat and generate only on mlx_lm "
            f"{TESTED_MLX_LM}.x, the series this seam is tested on; install mlx-lm=={TESTED_MLX_LM}.*"
        )


def run_tool(tool: str, argv: list[str], loader: Callable[..., Any] | None = None,
             seams: dict[str, Callable[..., Any]] | None = None, max_memory: int | None = None,
             **load_options: Any) -> None:
    """Run `mlx_lm <tool> ARGV` with squishlike.load(..., **load_options) as its loader (`tier=`, say), or with
    `loader` in its place; `seams` rebinds more of the tool module's names for the run (the server's `run`). A
    tool that loads a share under mlx.launch gets squishlike.sharded_load, within `max_memory` if given."""
    import mlx_lm
    import mlx_lm.utils

    from .loader import load
    from .load.sharded import sharded_load

    check_mlx_lm_version(mlx_lm.__version__)
    module = importlib.import_module(f"mlx_lm.{tool}")
    if getattr(module, "load", None) is not mlx_lm.utils.load:
        raise IncompatibleVersionError(
            f"mlx_lm {mlx_lm.__version__}: mlx_lm.{tool} no longer calls mlx_lm.utils.load by its module-level "
            f"name `load`, the seam squishlike replaces"
        )
    saved_argv = sys.argv
    seams = {"load": loader or functools.partial(load, **load_options), **(seams or {})}
    if getattr(module, "sharded_load", None) is mlx_lm.utils.sharded_load:  # chat, server: under mlx.launch
        seams["sharded_load"] = sharded_load if max_memory is None else functools.partial(sharded_load,
                                                                                         max_memory=max_memory)
    originals = {name: getattr(module, name) for name in seams}
    for name, replacement in seams.items():
        setattr(module, name, replacement)
    sys.argv = [f"squishlike {tool}", *argv]  # argparse names the program after argv[0]
    try:
        # mlx_lm's chat forces colours (rich's truecolor) and moves the cursor whatever stdout is
        plain = contextlib.nullcontext() if sys.stdout.isatty() else contextlib.redirect_stdout(_PlainText(sys.stdout))
        with plain:
            module.main()
    finally:
        for name, original in originals.items():
            setattr(module, name, original)
        sys.argv = saved_argv


class _PlainText(io.TextIOBase):
    """A text stream that drops terminal control sequences (colours, cursor moves, readline's prompt markers): a
    tool's stdout when it is a pipe or a file."""

    CONTROL = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|[\x01\x02]")

    def __init__(self, stream: io.TextIOBase):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(self.CONTROL.sub("", text))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()


def add_tool_arguments(parser: argparse.ArgumentParser,
                       max_memory_help: str = "bound the model's memory, e.g. 3GB: a mixture of experts over it "
                       "keeps its experts in the store and reads each token's routed experts into a cache of the "
                       "bytes left; any other model over it is refused") -> None:
    """`add_arguments` of the subcommands that run a tool: `--tier` and `--max-memory` are squishlike's; every other
    flag, `--help` included, is the tool's own and reaches `run_tool_command` unparsed (squishlike/cli)."""
    from .load.budget import parse_size
    from .tiers import TIER_NAMES

    parser.add_argument("--tier", choices=TIER_NAMES, help="force this tier of every npy-dir the tool loads")
    parser.add_argument("--max-memory", type=_size_argument(parse_size), metavar="BYTES", help=max_memory_help)


def _size_argument(parse: Callable[[str], int]) -> Callable[[str], int]:
    def parse_argument(text: str) -> int:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_argument


def run_tool_command(args: argparse.Namespace) -> int:
    """`run` of the subcommands that run a tool: the tool named by the subcommand's MLX_LM_TOOL, on its flags. A
    model whose experts were streamed (--max-memory) gets its expert cache's figures on stderr afterwards."""
    from .load.experts import expert_cache
    from .loader import load

    caches = []

    def loader(*load_args: Any, **load_kwargs: Any) -> tuple:
        loaded = load(*load_args, tier=args.tier, max_memory=args.max_memory, **load_kwargs)
        if (cache := expert_cache(loaded[0])) is not None:
            caches.append(cache)
        return loaded

    try:
        run_tool(args.mlx_lm_tool, args.tool_argv, loader=loader, max_memory=args.max_memory)
    finally:
        for cache in caches:
            print(cache.stats.describe(), file=sys.stderr)
    return 0
