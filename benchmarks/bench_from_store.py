#!/usr/bin/env python3
"""A quantized tier read straight from the store against the same tier built as one file: what skipping the
second copy costs a load.

    python benchmarks/bench_from_store.py                      # the embedded SmolLM2-135M
    python benchmarks/bench_from_store.py --model qwen1.5b     # the 1.5B-shaped model of the load benchmark
    python benchmarks/bench_from_store.py --model PATH         # any model squishlike reads

Compresses the model to INT4 (round to nearest: load times do not depend on the values) into --workdir, builds
the int4 tier (squish_4bit/model.safetensors), then in this one process, files in the page cache, alternates
the two loads `--runs` times: the built tier's file (`Int4Tier.load`) and the store's own .npy parts
(`Int4Tier.from_store`, what a GPU load does), and prints the medians, their ratio and the disk each takes.
Both return the same arrays, bit for bit (checked once).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

import squishlike
from squishlike.default_model import default_model_path
from squishlike.npydir import NpyDir
from squishlike.tiers import BY_NAME


def source_for(model: str, workdir: Path) -> Path:
    if model == "smollm":
        return Path(default_model_path())
    if model == "qwen1.5b":
        from benchmarks.loadbench.models import build_qwen_like
        from benchmarks.loadbench.run import build_smollm_source

        return build_qwen_like(workdir / "qwen2-1.5b-shaped-bf16", build_smollm_source(workdir / "smollm2-135m-bf16"))
    return Path(model)


def timed(load) -> float:
    started = time.perf_counter()
    mx.eval(list(load().weights.values()))
    return time.perf_counter() - started


def disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm", help="smollm (default), qwen1.5b, or a model path")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "squishlike-bench-from-store")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    out = args.workdir / f"{Path(args.model).name}-int4"
    if not (out / "manifest.json").exists():
        squishlike.compress(source_for(args.model, args.workdir), out, scheme="int4", awq=False, gptq=False,
                            clip_search=False)
    squishlike.load(out, tier="int4")  # builds the tier once
    store, tier = NpyDir(out), BY_NAME["int4"]
    built, direct = tier.load(store).weights, tier.from_store(store).weights
    assert built.keys() == direct.keys() and all(mx.array_equal(built[k], direct[k]).item() for k in built)
    del built, direct

    times: dict[str, list[float]] = {"built tier": [], "from the store": []}
    for _ in range(args.runs):
        times["built tier"].append(timed(lambda: tier.load(store)))
        times["from the store"].append(timed(lambda: tier.from_store(store)))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:16} median {medians[name]:.3f} s  (min {min(t):.3f}, max {max(t):.3f}, {len(t)} runs)")
    print(f"from the store / built tier: {medians['from the store'] / medians['built tier']:.2f}x the time")
    store_bytes, tier_bytes = disk(out / "tensors"), disk(out / tier.directory)
    print(f"disk: the store's parts {store_bytes / 1e6:.1f} MB; the built tier adds {tier_bytes / 1e6:.1f} MB "
          f"({tier_bytes / store_bytes:.2f}x the parts), which reading from the store does not write")


if __name__ == "__main__":
    main()
