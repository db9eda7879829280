"""Compress time and peak memory of INT4 stores, calibrated and not, against `mlx_lm.convert -q` of the same source
in the same run (`--q-bits 4 --q-group-size 64`: the store's bytes).

Sources, built by loadbench's builders and reused: the embedded SmolLM2-135M as an MLX bf16 directory (`smollm`),
and a directory with the exact shapes of a 1.5B Qwen2 and random bf16 weights (`qwen1.5b`: compute and memory
depend on shapes, not values). Every figure is its own fresh process (OpenBLAS preloaded, as the CLI does, for all
of them), timed around the call alone (imports excluded); memory is the process's peak RSS above its RSS once
imports are done, against loadbench's compress bound (largest tensor x4 + 512 MB).

    python -m benchmarks.bench_compress [--model smollm|qwen1.5b] [--methods default,awq+clip,...] [--runs N]

Each method's seconds and peak are also printed as a ratio to mlx_lm.convert's (target: time <= 3x).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# method -> compress options (INT4, group size 64, embeddings quantized: the default store's bytes, mlx_lm's)
PLAIN = {"awq": False, "gptq": False, "clip_search": False}
METHODS = {
    "rtn": PLAIN,
    "clip": {**PLAIN, "clip_search": True},
    "awq+clip": {"gptq": False},
    "gptq+clip": {"awq": False},
    "default": {},  # AWQ + GPTQ + clip search
}
BASELINE = "mlx_lm.convert -q"


def child(method: str, src: str, out: str) -> None:
    """One figure, in this process: print {"seconds", "rss_peak_above_import"} as JSON."""
    from squishlike.loadtime import peak_rss_bytes, rss_now

    if method == BASELINE:
        import mlx_lm

        def run():
            mlx_lm.convert(src, out, quantize=True, q_bits=4, q_group_size=64)
    else:
        import squishlike

        def run():
            squishlike.compress(src, out, scheme="int4", **METHODS[method])
    rss_import = rss_now()
    started = time.perf_counter()
    run()
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "rss_peak_above_import": peak_rss_bytes() - rss_import}))


def measure(method: str, src: Path, out: Path) -> dict:
    from squishlike.openblas import find_openblas

    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, SQUISHLIKE_OPENBLAS="0")
    if (library := find_openblas()) is not None:
        env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_compress", "--child", method, str(src), str(out)],
                          env=env, stdout=subprocess.PIPE, check=True, text=True)
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def source(model: str, workdir: Path) -> Path:
    from benchmarks.loadbench.models import build_qwen_like, build_smollm_source

    smollm = build_smollm_source(workdir / "smollm2-135m-bf16")
    return smollm if model == "smollm" else build_qwen_like(workdir / "qwen2-1.5b-shaped-bf16", smollm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_compress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm", "qwen1.5b"), default="smollm")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated from {','.join(METHODS)}")
    parser.add_argument("--runs", type=int, default=1, help="runs per figure (the median is reported)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/squishlike-bench-compress"))
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    from benchmarks.loadbench.results import largest_tensor_bytes

    methods = [m for m in args.methods.split(",") if m]
    if unknown := set(methods) - set(METHODS):
        parser.error(f"unknown method(s) {', '.join(sorted(unknown))}; choose from {', '.join(METHODS)}")
    src = source(args.model, args.workdir)
    bound = largest_tensor_bytes(sorted(src.glob("*.safetensors"))) * 4 + 512e6
    figures = {}
    for method in [BASELINE, *methods]:
        runs = [measure(method, src, args.workdir / "out") for _ in range(args.runs)]
        figures[method] = {"seconds": statistics.median(r["seconds"] for r in runs),
                           "rss_peak_above_import": max(r["rss_peak_above_import"] for r in runs), "runs": runs}
        print(f"{method}: {figures[method]['seconds']:.1f} s", file=sys.stderr, flush=True)
    base = figures[BASELINE]
    print(f"\n{args.model} ({src}), {args.runs} run(s) per figure; peak RSS bound {bound / 1e9:.2f} GB\n")
    print("| method | compress s | vs mlx_lm.convert | peak RSS above imports | vs mlx_lm.convert | within bound |")
    print("|---|---:|---:|---:|---:|---|")
    for method, fig in figures.items():
        rss = fig["rss_peak_above_import"]
        print(f"| {method} | {fig['seconds']:.1f} | {fig['seconds'] / base['seconds']:.2f}x | {rss / 1e9:.2f} GB | "
              f"{rss / base['rss_peak_above_import']:.2f}x | {'yes' if rss <= bound else 'no'} |")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "bound": bound, "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
