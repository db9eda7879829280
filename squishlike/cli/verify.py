"""Re-read every file of the store and of each ready tier against the checksums in the manifest and sentinels;
name every file that is wrong. Exits 1 when any is."""

from __future__ import annotations

import argparse

HELP = "check every checksum of an npy-dir and its tiers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path")


def run(args: argparse.Namespace) -> int:
    from ..info import verify

    problems = verify(args.path)
    for line in problems:
        print(line)
    print(f"{args.path}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0
