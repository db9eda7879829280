#!/usr/bin/env python3
"""Bytes at rest, file by file: model directories side by side (an npy-dir before its first load, so without
caches, beside `mlx_lm.convert -q` outputs of the same model), as a markdown table with every directory's total
against the first's.

    python benchmarks/bench_bytes.py MLX_LM_4BIT_DIR INT4_STORE_DIR [...]

A directory of many files (an npy-dir's tensors/) is one row: its file count and their bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def files(directory: Path) -> dict[str, tuple[int, int]]:
    """Row name -> (files, bytes): each top-level file, and each subdirectory's files together."""
    rows = {}
    for path in sorted(directory.iterdir()):
        inside = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        rows[f"{path.name}/" if path.is_dir() else path.name] = (len(inside), sum(p.stat().st_size for p in inside))
    return rows


def table(directories: list[Path]) -> str:
    measured = [files(d) for d in directories]
    names = list(dict.fromkeys(name for rows in measured for name in rows))
    lines = ["| file | " + " | ".join(d.name for d in directories) + " |",
             "|---|" + "---:|" * len(directories)]
    for name in names:
        cells = []
        for rows in measured:
            count, size = rows.get(name, (0, 0))
            cells.append("" if not count else f"{size:,}" + (f" ({count} files)" if count > 1 else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    totals = [sum(size for _, size in rows.values()) for rows in measured]
    lines.append("| **every file** | " + " | ".join(f"**{t:,}** ({t / totals[0]:.4f}x)" for t in totals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directories", nargs="+", type=Path, help="the first is the baseline of the ratios")
    args = parser.parse_args(argv)
    print(table(args.directories))
    return 0


if __name__ == "__main__":
    sys.exit(main())
