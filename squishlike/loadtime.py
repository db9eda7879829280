"""Load time as a user meets it: each load a whole fresh process (`measure_load`), for `squishlike demo` and the
load benchmark (benchmarks/loadbench).

A timed load is a child process (`python -m squishlike.loadtime LOADER PATH`): interpreter start, imports, the
load with the weights evaluated (eager, as mlx_lm.load with lazy=False) and the tokenizer ready. The parent takes
the time from spawn to the moment the child reports it is ready (CLOCK_MONOTONIC is shared by all processes); the
child reports its own phases and memory. squishlike's phases come from its debug log (which tier served the
weights and how long they took, what the fast-memory arena did), mlx_lm's from timing its two load steps. A first
forward pass is timed separately, after the ready mark, as proof that the weights work. Timing inside one warm
process would hide the imports and reuse memory, which is not what a user who starts a model sees.

Two more ways to run the child, for the figures users feel (issue: load speed where users feel it):
`--in-process` imports mlx_lm before the clock starts, as a server or notebook that switches models has, so its
load_s is the in-process load (`--dropped-bytes N`: after holding and dropping N bytes of MLX memory, as such a
process has just dropped the model it switches from); `--generate N` then streams N tokens greedily from a fixed 64-token prompt and
reports the first token's moment (first_token_s from spawn: time to first token) and the tokens/s after it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LOADERS = ("squishlike", "mlx_lm")
PROMPT = "The capital of France is"
GENERATION_PROMPT_TOKENS = 64


def rss_now() -> int:
    """This process's resident set size in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    """This process's peak RSS. On Linux VmHWM of /proc/self/status: ru_maxrss of an exec'd child also counts
    its parent's peak (the kernel carries the old address space's high-water mark across exec)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def reset_peak_rss() -> bool:
    """Start this process's peak RSS (VmHWM) over from its RSS now (Linux: `5` to /proc/self/clear_refs), so that
    peak_rss_bytes() tells what came after; whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def run_child(argv: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `python ARGV`, a child that prints a JSON report (its last line) holding `ready_at`, its
    time.monotonic() when it was ready. Returns the report with wall_s = spawn -> ready, exit_s = spawn -> exit, and
    each other `NAME_at` moment as NAME_s, seconds from spawn."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env={**os.environ, **(env or {})})
    ended = time.monotonic()
    if done.returncode != 0:
        raise RuntimeError(f"timed child {' '.join(argv)} failed (rc {done.returncode}):\n{done.stderr[-4000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    moments = {f"{k.removesuffix('_at')}_s": report.pop(k) - started for k in [k for k in report if k.endswith("_at")]}
    return {"wall_s": moments.pop("ready_s"), "exit_s": ended - started, **moments, **report}


def measure_load(path: str | Path, *, loader: str = "squishlike", tier: str | None = None, forward: bool = False,
                 in_process: bool = False, dropped_bytes: int = 0, generate: int = 0,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
    """Load `path` in a fresh process; return wall seconds (spawn to model and tokenizer ready), the child's
    phase timings (import_s, load_s, weights_s, tokenizer_s for mlx_lm, forward_s) and memory (rss_start,
    rss_after_import, rss_peak bytes). `in_process`: mlx_lm is imported before load_s starts, and `dropped_bytes`
    of MLX memory held and dropped (the model a process switching models drops first). `generate`: that
    many tokens from a 64-token prompt after the load (first_token_s from spawn, tokens_per_s after it). After a
    drop, rss_peak is the load's peak (the process's RSS at its highest from the load's start: rss_peak_reset),
    not the dropped model's (rss_peak_dropped), whose size is that of the files being compared."""
    if loader not in LOADERS:
        raise ValueError(f"unknown loader {loader!r}; choose one of {', '.join(LOADERS)}")
    argv = ["-m", "squishlike.loadtime", loader, str(path)] + (["--tier", tier] if tier else [])
    argv += (["--forward"] if forward else []) + (["--in-process"] if in_process else [])
    argv += ["--dropped-bytes", str(dropped_bytes)] if in_process and dropped_bytes else []
    return run_child(argv + (["--generate", str(generate)] if generate else []), env)


# ---------------------------------------------------------------------------------------------- the child


class _LoadLog(logging.Handler):
    """Collects the phases squishlike's debug log reports: the tier and weights_s of a load, the arena."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.phases: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.phases.update(getattr(record, "load_phases", {}))


def _timed(module, name: str, into: dict, key: str) -> None:
    """Wrap mlx_lm's `module.name` so that its duration (summed) lands in into[key]."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        started = time.monotonic()
        try:
            return original(*args, **kwargs)
        finally:
            into[key] = into.get(key, 0.0) + time.monotonic() - started

    setattr(module, name, wrapper)


def _generate(model, tokenizer, tokens: int) -> dict[str, Any]:
    """Stream `tokens` tokens greedily from a fixed 64-token prompt: the first token's moment, the rate after it."""
    from mlx_lm.generate import stream_generate

    ids = tokenizer.encode(PROMPT)
    prompt = (ids * (GENERATION_PROMPT_TOKENS // max(1, len(ids)) + 1))[:GENERATION_PROMPT_TOKENS]
    moments = [time.monotonic() for _ in stream_generate(model, tokenizer, prompt, max_tokens=tokens)]
    rate = (len(moments) - 1) / (moments[-1] - moments[0]) if len(moments) > 1 else 0.0
    return {"first_token_at": moments[0], "generated": len(moments), "tokens_per_s": rate}


def _drop_a_model(nbytes: int) -> None:
    """Hold and drop `nbytes` of MLX memory, as a process that switches models has just dropped the last one: the
    load that follows meets recently used memory, as it would there, not free pages the host has taken back (which
    fault in several times slower on a VM: docs/design.md §2.2)."""
    import mlx.core as mx

    previous = mx.zeros((-(-nbytes >> 20), 1 << 20), mx.uint8)  # whole MiB: a dimension is an int32
    mx.eval(previous)
    del previous
    mx.clear_cache()


def _load_in_child(loader: str, path: str, tier: str | None, forward: bool, in_process: int | None = None,
                   generate: int = 0) -> dict[str, Any]:
    """In the fresh process: import, load eagerly, tokenizer ready; then, apart, one forward pass or a generation.
    `in_process`: None for a fresh process's load, else the bytes of the model dropped before it (_drop_a_model)."""
    t0 = time.monotonic()
    rss_start = rss_now()
    import mlx.core as mx

    phases: dict[str, Any] = {}
    if loader == "mlx_lm":
        import mlx_lm.utils as utils
        from mlx_lm import load

        _timed(utils, "load_model", phases, "weights_s")
        _timed(utils, "load_tokenizer", phases, "tokenizer_s")
    else:
        from squishlike import load

        log = _LoadLog()
        logger = logging.getLogger("squishlike")
        logger.addHandler(log)
        logger.setLevel(logging.DEBUG)
        phases = log.phases
    if in_process is not None:
        import mlx_lm  # noqa: F401  what a process that switches models has imported already

        if in_process:
            _drop_a_model(in_process)
            # rss_peak is then the load's, not the dropped model's (whose size is the files' being compared)
            phases["rss_peak_dropped"] = peak_rss_bytes()
            phases["rss_peak_reset"] = reset_peak_rss()
    t_import = time.monotonic()
    rss_import = rss_now()
    model, tokenizer = load(path) if loader == "mlx_lm" else load(path, tier=tier)
    t_ready = time.monotonic()
    report = {"ready_at": t_ready, "import_s": t_import - t0, "load_s": t_ready - t_import, **phases,
              "rss_start": rss_start, "rss_after_import": rss_import, "rss_peak": peak_rss_bytes()}
    if forward:
        tokens = tokenizer.encode(PROMPT)
        logits = model(mx.array([tokens]))[0, -1].astype(mx.float32)
        mx.eval(logits)
        report["forward_s"] = time.monotonic() - t_ready
        report["forward"] = {"tokens": len(tokens), "finite": bool(mx.isfinite(logits).all().item()),
                             "argmax": int(mx.argmax(logits).item()),
                             "logit_norm": float(mx.sqrt(mx.sum(logits * logits)).item())}
    if generate:
        report.update(_generate(model, tokenizer, generate))
    if loader == "squishlike":  # a first load's cache build, left to a background thread
        from squishlike.tiers.background import wait_for_builds

        wait_for_builds()
        report["built_at"] = time.monotonic()
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m squishlike.loadtime",
                                     description="one timed load; prints its report as JSON")
    parser.add_argument("loader", choices=LOADERS)
    parser.add_argument("path")
    parser.add_argument("--tier")
    parser.add_argument("--forward", action="store_true", help="time a first forward pass after the load")
    parser.add_argument("--in-process", action="store_true", help="import mlx_lm before the load's clock starts")
    parser.add_argument("--dropped-bytes", type=int, default=0, metavar="N",
                        help="with --in-process: first hold and drop N bytes of MLX memory (the model switched from)")
    parser.add_argument("--generate", type=int, default=0, metavar="N",
                        help="then generate N tokens from a 64-token prompt (time to first token, tokens/s)")
    args = parser.parse_args(argv)
    in_process = args.dropped_bytes if args.in_process else None
    print(json.dumps(_load_in_child(args.loader, args.path, args.tier, args.forward, in_process, args.generate)))


if __name__ == "__main__":
    main()
