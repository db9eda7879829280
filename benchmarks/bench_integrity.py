#!/usr/bin/env python3
"""What the integrity checks cost a load: the cold path's checksums, and the warm tiers' structural checks.

    python benchmarks/bench_integrity.py                 # the embedded SmolLM2-135M, INT4 store, every tier
    python benchmarks/bench_integrity.py --model PATH    # any model squishlike reads, as the source

Compresses the model once (into --workdir), then, in this one process with the files in the page cache, times
each load with its checks and with them switched off, alternating, `--runs` times each, and prints the medians
and their ratio:
- cold: ColdTier.load_dense (dequantize the store into fresh buffers), with and without the store's files
  checked against the manifest's fast hash, xxh3 (a background thread hashes while the kernels dequantize);
- cold sha256: the same, the store seen as one written before xxh3 was recorded (its records without xxh3), so
  the check falls back to sha256: what the cold path cost before xxh3, measured in the same run;
- each warm tier: its load, with and without the header checks (the tier safetensors' header against the one
  written, each finalized .npy header against the manifest, the int4 tier's config.json) and, for int4, the check
  that its scales and offsets are finite; and the int4 tier read straight from the store (what a store under the
  default policy serves), with and without that check;
- warm load: the whole squishlike.load (model and tokenizer, from the first ready tier), with and without every
  check above, the side files' (config, tokenizer files and facts, chat template) against the manifest's
  records, which every load runs, warm or cold, and the identity check of the served tier's files; and the
  side-file check alone, and the finite check of the int4 tier's scales and offsets alone;
- identity check alone, per tier: Tier.check_files on the tier as its build left it (one stat per file, nothing
  hashed), and on a copy of the store (`cp -a`: new inodes), where its first load hashes each file once.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

import squishlike
from squishlike.default_model import default_model_path
from squishlike.io.checksum import FAST
from squishlike.npydir import NpyDir
from squishlike.tiers import BY_NAME, base, cold, finalized, mlx, quantized


@contextmanager
def checks_off():
    """The same loads with every integrity check replaced by nothing."""
    saved = (cold.check_files, mlx.check_layout, finalized.check_npy, quantized._canonical, NpyDir.check_side_files,
             base.Tier.check_files, quantized._check_finite)
    cold.check_files = mlx.check_layout = finalized.check_npy = NpyDir.check_side_files = lambda *a, **k: None
    base.Tier.check_files = quantized._check_finite = lambda *a, **k: None
    quantized._canonical = lambda value: ""
    try:
        yield
    finally:
        (cold.check_files, mlx.check_layout, finalized.check_npy, quantized._canonical,
         NpyDir.check_side_files, base.Tier.check_files, quantized._check_finite) = saved


def timed(load) -> float:
    started = time.perf_counter()
    weights = load()
    mx.eval(list(weights.values()))
    seconds = time.perf_counter() - started
    del weights
    return seconds


def measure(load, runs: int) -> tuple[float, float]:
    """(median seconds with the checks, median seconds without), the two alternating run by run."""
    load()  # one of each first: page cache and allocator warmed
    with checks_off():
        load()
    on, off = [], []
    for _ in range(runs):
        on.append(timed(load))
        with checks_off():
            off.append(timed(load))
    return statistics.median(on), statistics.median(off)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="source model (default: the embedded SmolLM2-135M GGUF)")
    parser.add_argument("--workdir", default=None, help="where the npy-dir is written (default: a temp dir)")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="squishlike-bench-integrity-"))
    out = workdir / "store"
    if not (out / "manifest.json").exists():
        squishlike.compress(args.model or default_model_path(), out, scheme="int4",
                            tiers=("int4", "mlx", "finalized"))
    store = NpyDir(out)
    squishlike.load(out)  # builds every tier of the policy
    stored = sum(r.size for r in store.part_files().values())
    print(f"{out}: {len(store.entries)} tensors, {stored / 1e6:.1f} MB stored; medians of {args.runs} runs each")
    print(f"{'load':<12} {'checked s':>10} {'unchecked s':>12} {'ratio':>7}")
    old_style = NpyDir(out)
    records = {rel: {k: v for k, v in r.items() if k != FAST} for rel, r in old_style.file_records().items()}
    old_style.file_records = lambda: records
    figures = {"cold": lambda: cold.ColdTier().load_dense(store)[0].weights,
               "cold sha256": lambda: cold.ColdTier().load_dense(old_style)[0].weights}
    for name in ("int4", "mlx", "finalized"):
        figures[name] = lambda tier=BY_NAME[name]: tier.load(store).weights
    figures["int4 store"] = lambda: BY_NAME["int4"].from_store(store).weights
    figures["warm load"] = lambda: dict(tree_flatten(squishlike.load(out)[0].parameters()))
    for name, load in figures.items():
        on, off = measure(load, args.runs)
        print(f"{name:<12} {on:>10.3f} {off:>12.3f} {on / off:>6.3f}x")
    side = sum(r.size for r in store.manifest.side_files.values())
    alone = []
    for _ in range(args.runs):
        started = time.perf_counter()
        store.check_side_files()
        alone.append(time.perf_counter() - started)
    print(f"side-file check alone: {statistics.median(alone) * 1e3:.2f} ms for {len(store.manifest.side_files)} "
          f"files, {side / 1e6:.1f} MB")
    weights, names = BY_NAME["int4"].load(store).weights, base.mlx_names(store)
    scales = [a for key, a in weights.items() if key.endswith((".scales", ".biases"))]
    finite = []
    for _ in range(args.runs):
        started = time.perf_counter()
        quantized._check_finite(store, names, weights, lambda key: out)
        finite.append(time.perf_counter() - started)
    print(f"finite check alone: {statistics.median(finite) * 1e3:.2f} ms for {sum(a.size for a in scales):,} scales "
          f"and offsets, {sum(a.nbytes for a in scales) / 1e6:.1f} MB")
    copy = workdir / "copy"
    for name in ("int4", "mlx", "finalized"):
        tier = BY_NAME[name]
        payload = tier.ready(store)[0]
        bound = []
        for _ in range(args.runs):
            started = time.perf_counter()
            tier.check_files(store, payload)
            bound.append(time.perf_counter() - started)
        moved = []
        for _ in range(args.runs):
            shutil.rmtree(copy, ignore_errors=True)
            copied = NpyDir(shutil.copytree(out, copy))  # copy2: mtimes kept, new inodes
            started = time.perf_counter()
            tier.check_files(copied, tier.ready(copied)[0])
            moved.append(time.perf_counter() - started)
        nbytes = sum(record["size"] for record in payload["files"].values())
        print(f"identity check alone, {name}: {statistics.median(bound) * 1e6:.0f} us for {len(payload['files'])} "
              f"files; after cp -a, first load: {statistics.median(moved) * 1e3:.1f} ms ({nbytes / 1e6:.0f} MB "
              "hashed once)")
    shutil.rmtree(copy, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
