"""Issue 33's time bar for a second size: retargeting a store's kept sensitivities to another bits-per-weight target
(`compress --bpw Y --sensitivity-from FIRST`) takes less than a fifth of the first, measuring compress
(`compress --bpw X`). Both are the CLI as a user runs it, each its own process, timed around the whole process
(imports and the OpenBLAS re-exec included), in the same run; with --rounds N they alternate (first, second, first,
...) and the medians are compared. The load average is printed before and after: the VM is shared.

    PYTHONPATH=. python benchmarks/bench_retarget.py [--src MODEL] [--first 4.5] [--second 5] [--rounds 1]

Default source: the embedded SmolLM2-135M GGUF.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BAR = 0.2  # the issue's: the second size's time over the first's


def compress(src: str, out: Path, bpw: float, sensitivity_from: Path | None = None) -> tuple[float, str]:
    """One CLI compress in its own process: (seconds, its stderr's calibration lines)."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "squishlike", "compress", src, "-o", str(out), "--bpw", str(bpw)]
    if sensitivity_from is not None:
        command += ["--sensitivity-from", str(sensitivity_from)]
    started = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{run.stderr}")
    return seconds, "\n".join(line for line in run.stderr.splitlines() if line.startswith("calibrate:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", help="the model to compress (default: the embedded SmolLM2-135M GGUF)")
    parser.add_argument("--first", type=float, default=4.5, help="the measuring compress's bits per weight")
    parser.add_argument("--second", type=float, default=5.0, help="the retarget's bits per weight")
    parser.add_argument("--rounds", type=int, default=1, help="alternating pairs; medians compared")
    parser.add_argument("--workdir", type=Path, help="where the stores go (default: a temporary directory)")
    args = parser.parse_args()
    if args.src is None:
        from squishlike.default_model import default_model_path

        args.src = str(default_model_path())
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-retarget-"))
    first_out, second_out = workdir / "first", workdir / "second"
    print(f"load average before: {os.getloadavg()}")
    firsts, seconds = [], []
    for r in range(args.rounds):
        t, log = compress(args.src, first_out, args.first)
        firsts.append(t)
        print(f"round {r + 1}: --bpw {args.first}: {t:.1f} s", flush=True)
        t, log = compress(args.src, second_out, args.second, first_out)
        seconds.append(t)
        copied = re.search(r"(\d+) of (\d+) tensors keep the width", log)
        print(f"round {r + 1}: --bpw {args.second} --sensitivity-from: {t:.1f} s"
              + (f" ({copied[1]} of {copied[2]} planned tensors copied)" if copied else ""), flush=True)
    first, second = statistics.median(firsts), statistics.median(seconds)
    print(f"load average after: {os.getloadavg()}")
    print(f"first (measuring) compress: {first:.1f} s; retarget: {second:.1f} s; ratio {second / first:.3f} "
          f"(bar < {BAR}: {'met' if second / first < BAR else 'not met'})")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
