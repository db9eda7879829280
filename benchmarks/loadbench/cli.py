"""The benchmark's command line: `python -m benchmarks.loadbench`, benchmarks/bench_load.py and `squishlike bench`."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import __doc__ as _package_doc
from .run import run_benchmark


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="smollm (the embedded SmolLM2-135M, default), qwen1.5b (a model with the shapes of a "
                             "1.5B Qwen2, random bf16 weights, built here), or the path of an HF/MLX directory")
    parser.add_argument("--model", dest="model_option", default=None, help="same as MODEL")
    parser.add_argument("--workdir", type=Path, default=Path("squishlike-bench"),
                        help="where the models, stores and results go (default: ./squishlike-bench)")
    parser.add_argument("--out", type=Path, default=None, help="where the JSON, Markdown and PNG go (default: workdir)")
    parser.add_argument("--runs", type=int, default=5, help="fresh-process runs per figure (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run of a minute or two: SmolLM2, 2 runs, fewer figures")
    parser.add_argument("--no-cold", action="store_true", help="skip the evicted-page-cache figures")
    parser.add_argument("--no-compress", action="store_true", help="skip the compress figures")
    parser.add_argument("--no-forward", action="store_true", help="skip the first forward pass")
    parser.add_argument("--generate", type=int, default=16, metavar="N",
                        help="tokens generated in the time-to-first-token figures (default 16; 0 skips them)")
    parser.add_argument("--prime", action="store_true",
                        help="touch and free as much memory as a run needs before each run (see the module doc)")
    parser.add_argument("--only", default=None, metavar="GROUPS",
                        help="run only these figure groups, comma-separated from warm, inproc, ttft, first, cold, "
                             "compress (mlx_lm.load and the startup floor always run: the baselines)")


def run(args: argparse.Namespace) -> int:
    model = args.model or args.model_option or "smollm"
    runs = args.runs
    if args.quick:
        model = args.model or args.model_option or "smollm"
        runs = min(runs, 2) if args.runs == 5 else runs
    if runs < 1:
        raise ValueError("--runs must be at least 1")
    run_benchmark(model, args.workdir, runs=runs, quick=args.quick, cold=not args.no_cold,
                  do_compress=not args.no_compress, prime=args.prime, forward=not args.no_forward,
                  out_dir=args.out, generate=args.generate,
                  only=None if args.only is None else set(args.only.split(",")))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="squishlike bench", description=_package_doc.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
