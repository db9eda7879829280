"""Issue 34 §1's load figures in alternating rounds, with and without the huge-page arena (docs/design.md §2).

`squishlike bench` runs each figure's rounds after whatever ran before it, and on these VMs the speed of fresh
memory depends on that history (design.md §2.2): the same command gave the 1.5B shape's in-process ratio anywhere
from 1.00x to 1.82x within an hour. Here every round loads, one after another, the store as it loads by default
(SQUISHLIKE_HUGEPAGES unset: the arena where the process measures 4 KiB pages slow, design.md §2.4), the store
with the arena forced (=1) and forced off (=0), and mlx_lm's 4-bit conversion, each a fresh process timed as the
bench times it (squishlike.loadtime), so each pays for what the one before it freed; the medians are compared.

    PYTHONPATH=. python benchmarks/bench_arena.py --workdir /tmp/lw2-bench --model qwen1.5b [--in-process] [--rounds 8]

The work directory is a `squishlike bench --workdir` one: it holds MODEL-int4-fresh (the default store) and
MODEL-mlx_lm-4bit (`mlx_lm.convert -q`).
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from benchmarks.loadbench.run import SLACK
from benchmarks.loadbench.stores import size, source_files
from squishlike.loadtime import measure_load

# name, loader, SQUISHLIKE_HUGEPAGES ("" is unset: the default)
CONFIGS = (("default", "squishlike", ""), ("arena", "squishlike", "1"), ("no arena", "squishlike", "0"),
           ("mlx_lm 4-bit", "mlx_lm", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True, help="a `squishlike bench --workdir` directory")
    parser.add_argument("--model", default="qwen1.5b", help="the bench's model name: smollm2 or qwen1.5b")
    parser.add_argument("--in-process", action="store_true", help="time the load after mlx_lm is imported and a "
                        "model of the 4-bit conversion's size and the bench's slack was dropped, as the bench's "
                        "in-process figure drops each load's own")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    store, converted = args.workdir / f"{args.model}-int4-fresh", args.workdir / f"{args.model}-mlx_lm-4bit"
    dropped = size(source_files(converted)) + SLACK if args.in_process else 0
    print(f"load average before: {os.getloadavg()}")
    seconds: dict[str, list[float]] = {name: [] for name, _, _ in CONFIGS}
    for _ in range(args.rounds):
        for name, loader, hugepages in CONFIGS:
            os.environ.update(SQUISHLIKE_HUGEPAGES=hugepages)  # for the child processes measure_load starts
            report = measure_load(converted if loader == "mlx_lm" else store, loader=loader,
                                  in_process=args.in_process, dropped_bytes=dropped)
            seconds[name].append(report["load_s"] if args.in_process else report["wall_s"])
    print(f"load average after: {os.getloadavg()}")
    baseline = statistics.median(seconds["mlx_lm 4-bit"])
    how = "in process" if args.in_process else "whole process"
    for name, runs in seconds.items():
        median = statistics.median(runs)
        print(f"{args.model}, {how}, {name:13} median {median:.3f} s  ({baseline / median:.2f}x mlx_lm)  "
              f"runs {', '.join(f'{s:.2f}' for s in runs)}")


if __name__ == "__main__":
    main()
