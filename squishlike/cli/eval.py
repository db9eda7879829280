"""Perplexity on the shipped evaluation prose; against a reference model (default: the source recorded in an
npy-dir's manifest) also teacher-forced top-1 agreement, mean KL divergence of next-token distributions, and
greedy-generation agreement on fixed prompts. Models are evaluated in float32 (with the system OpenBLAS preloaded
when there is one)."""

from __future__ import annotations

import argparse

HELP = "perplexity, and agreement with a reference model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="model to evaluate (npy-dir or any format the provider reads)")
    parser.add_argument("--reference", help="reference model (default: the npy-dir's recorded source)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="evaluate on the first N tokens of the prose")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(fast_blas=True)


def run(args: argparse.Namespace) -> int:
    import json

    from ..evaluation import evaluate, format_report

    result = evaluate(args.path, args.reference, max_tokens=args.max_tokens)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0
