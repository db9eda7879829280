"""Load timing in whole fresh processes: interpreter start, imports, load, weights evaluated, tokenizer ready.

A timed load is a child process running `python -m squishlike.bench --child ...`; the parent measures its wall
time from spawn to exit, and the child reports its own phases and peak RSS as one JSON line. Timing inside one
warm process would hide import cost and reuse memory, which is not what a user who runs a model sees.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

LOADERS = ("squishlike", "mlx_lm")


def measure_load(path: str | Path, *, loader: str = "squishlike", tier: str | None = None,
                 forward: bool = False, env: dict | None = None) -> dict:
    """Load `path` in a fresh process; return wall seconds, the child's phase timings and peak RSS."""
    if loader not in LOADERS:
        raise ValueError(f"unknown loader {loader!r}")
    cmd = [sys.executable, "-m", "squishlike.bench", "--child", loader, str(path)]
    if tier:
        cmd += ["--tier", tier]
    if forward:
        cmd.append("--forward")
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"loading {path} with {loader} failed:\n{done.stderr[-4000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, **report}


def _child(loader: str, path: str, tier: str | None, forward: bool) -> None:
    """Runs in the fresh process: import, load eagerly, optionally one forward pass; print JSON."""
    t0 = time.perf_counter()
    base_rss = _peak_rss_bytes()
    import mlx.core as mx

    if loader == "mlx_lm":
        from mlx_lm import load
    else:
        from squishlike import load
    t_import = time.perf_counter()
    if loader == "mlx_lm":
        model, tokenizer = load(path)
    else:
        model, tokenizer = load(path, tier=tier)
    t_load = time.perf_counter()
    report = {"import_s": t_import - t0, "load_s": t_load - t_import, "rss_peak_bytes": _peak_rss_bytes(),
              "rss_base_bytes": base_rss}
    if forward:
        out = model(mx.array([tokenizer.encode("The capital of France is")]))
        mx.eval(out)
        report["forward_s"] = time.perf_counter() - t_load
    print(json.dumps(report))


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m squishlike.bench")
    p.add_argument("--child", nargs=2, metavar=("LOADER", "PATH"), required=True)
    p.add_argument("--tier")
    p.add_argument("--forward", action="store_true")
    a = p.parse_args()
    _child(a.child[0], a.child[1], a.tier, a.forward)
