#!/usr/bin/env python
"""The long crash sweep: kill compress and the first load at every write/rename boundary and at many
random moments, with SIGKILL and with SIGINT, and check after each that nothing was lost and nothing half-built is
trusted (the checks are tests/support/crash_harness.py's CrashLab; tests/reliability/test_crash_safety.py runs a short version).

    (cd tests && python -m fuzz.crash_sweep)                   # every boundary x {SIGKILL, SIGINT} + 60 random moments per op
    (cd tests && python -m fuzz.crash_sweep --random 200)       # more random moments
    (cd tests && python -m fuzz.crash_sweep --json out.json)    # the figures, machine-readable

Exit status 0 only when every trial kept every invariant.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from support.crash_harness import CrashLab, ForkServer, random_delays, summarize


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--random", type=int, default=60, help="random kill moments per operation and signal (60)")
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--no-boundaries", action="store_true", help="skip the every-boundary sweeps")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/squishlike-crash-sweep"),
                    help="where the trials run: a real disk, not tmpfs, so files are written with O_DIRECT as in use")
    args = ap.parse_args(argv)

    args.workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="sweep-", dir=args.workdir))
    started = time.monotonic()
    categories: dict[str, dict] = {}
    failures = []
    with ForkServer(log=root / "server.log") as server:
        lab = CrashLab(root, server)

        def run(name: str, make_records) -> None:
            t = time.monotonic()
            records = make_records()
            s = summarize(records)
            s["seconds"] = round(time.monotonic() - t, 1)
            failures.extend({"category": name, **f} for f in s.pop("failed"))
            s["failed"] = s["trials"] - s["survived"]
            categories[name] = s
            print(f"{name:40} trials {s['trials']:5}  killed mid-run {s['killed_mid_run']:5}  "
                  f"interrupted {s['interrupted']:5}  survived {s['survived']:5}  failed {s['failed']:3}  "
                  f"{s['seconds']:7.1f} s", flush=True)

        def boundary(op: str, action: str, force: bool = False):
            labels = lab.boundaries(op, force)
            trial = lab.compress_trial if op == "compress" else lab.load_trial
            extra = {"force": True} if force else {}
            env = lambda n: {"SQUISHLIKE_FAULT_AT": "*", "SQUISHLIKE_FAULT_NTH": str(n),  # noqa: E731
                             "SQUISHLIKE_FAULT_ACTION": action}
            return [{**trial(env=env(n), **extra), "label": label} for n, label in enumerate(labels, 1)]

        def moments(op: str, sig: int, seed: int, force: bool = False):
            lab.boundaries(op, force)  # measure this operation's clean duration
            seconds = lab.compress_seconds if op == "compress" else lab.load_seconds
            trial = lab.compress_trial if op == "compress" else lab.load_trial
            extra = {"force": True} if force else {}
            return [trial(kill_after=d, send_signal=sig, **extra) for d in random_delays(args.random, seconds, seed)]

        if not args.no_boundaries:
            run("compress: SIGKILL at every boundary", lambda: boundary("compress", "kill"))
            run("compress --force: SIGKILL at every boundary", lambda: boundary("compress", "kill", force=True))
            run("first load: SIGKILL at every boundary", lambda: boundary("load", "kill"))
            run("compress: SIGINT at every boundary", lambda: boundary("compress", "sigint"))
            run("first load: SIGINT at every boundary", lambda: boundary("load", "sigint"))
        if args.random:
            run("compress: SIGKILL at random moments", lambda: moments("compress", signal.SIGKILL, args.seed))
            run("compress --force: SIGKILL at random moments",
                lambda: moments("compress", signal.SIGKILL, args.seed + 1, force=True))
            run("first load: SIGKILL at random moments", lambda: moments("load", signal.SIGKILL, args.seed + 2))
            run("compress: SIGINT at random moments", lambda: moments("compress", signal.SIGINT, args.seed + 3))
            run("first load: SIGINT at random moments", lambda: moments("load", signal.SIGINT, args.seed + 4))

    total = {k: sum(c[k] for c in categories.values()) for k in ("trials", "killed_mid_run", "interrupted",
                                                                  "survived", "failed")}
    total["seconds"] = round(time.monotonic() - started, 1)
    print(f"{'total':40} trials {total['trials']:5}  killed mid-run {total['killed_mid_run']:5}  "
          f"interrupted {total['interrupted']:5}  survived {total['survived']:5}  failed {total['failed']:3}  "
          f"{total['seconds']:7.1f} s")
    for f in failures[:20]:
        print(f"FAILED {f['category']} at {f.get('label') or f.get('kill_after')}: {f['problems']}")
    if args.json:
        args.json.write_text(json.dumps({"categories": categories, "total": total,
                                         "failures": failures[:50]}, indent=1, default=str))
    if not failures:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
