#!/usr/bin/env python3
"""Tokenizer load time: mlx_lm's load_tokenizer vs squishlike's fast path, on a 151k-entry Qwen2-style tokenizer.

    python -m benchmarks.bench_tokenizer [--runs 7] [--vocab 151643]      # from the repository root

The tokenizer is built in the run (tests/support/tiny_models.py make_qwen2_tokenizer: byte-level BPE, Qwen2's split regex,
special and added tokens, a ChatML template), its tokenizer.json and facts as `squishlike compress` keeps them. Each
timing is one fresh process, the two paths alternating; a process imports both libraries first, then times only
the call that returns the TokenizerWrapper. Prints both medians and their ratio (target: fast <= 1/3 of mlx_lm's).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from squishlike import tokenizer
from tests.support.tiny_models import make_qwen2_tokenizer

ARGUMENTS = {"trust_remote_code": False}  # what a plain squishlike.load passes
CHILD = """
import sys, time
from pathlib import Path
from mlx_lm.utils import load_tokenizer
from squishlike import tokenizer
directory, arguments = Path(sys.argv[2]), {"trust_remote_code": False}
start = time.perf_counter()
wrapper = load_tokenizer(directory, arguments) if sys.argv[1] == "mlx_lm" else tokenizer.load(directory, arguments)
print(time.perf_counter() - start)
"""


def time_in_fresh_process(path: str, directory: Path) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(directory)], check=True, capture_output=True,
                         text=True)
    return float(out.stdout.split()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per path (default 7)")
    parser.add_argument("--vocab", type=int, default=151_643, help="vocabulary size (default Qwen2.5's 151643)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tokenizer-") as tmp:
        directory = make_qwen2_tokenizer(Path(tmp), args.vocab)
        tokenizer.compact(directory)  # as compress keeps tokenizer.json: both paths read this file
        if not tokenizer.write_facts(directory, ARGUMENTS):
            raise SystemExit("the fast path cannot show this tokenizer identical; nothing to time")
        times = {"mlx_lm": [], "fast": []}
        for _ in range(args.runs):
            for path in times:
                times[path].append(time_in_fresh_process(path, directory))
    medians = {path: statistics.median(t) for path, t in times.items()}
    print(f"Qwen2-style tokenizer, {args.vocab} entries, median of {args.runs} fresh processes each (alternating)")
    for path, t in times.items():
        print(f"  {path:7s} {medians[path]:.3f} s   runs: {' '.join(f'{x:.3f}' for x in t)}")
    print(f"  fast / mlx_lm = {medians['fast'] / medians['mlx_lm']:.2f}  (target <= 0.33)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
