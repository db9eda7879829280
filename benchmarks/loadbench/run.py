"""One benchmark run: the plan of figures (`Config`s), run round by round, then written as JSON, Markdown and PNG."""

from __future__ import annotations

import compileall
import contextlib
import json
import os
import time
from pathlib import Path

import squishlike
from squishlike.loadtime import measure_load, run_child
from squishlike.tiers.order import device_kind

from .models import build_mlx_lm_conversion, build_qwen_like, build_smollm_source
from .pagecache import evict, prime_memory, warm
from .report import markdown, plot
from .results import GB, results
from .stores import all_files, fresh_clone, prepare_store, reset_fresh, size, source_files, tier_files

_REPO = Path(__file__).resolve().parents[2]  # the probes run as `-m benchmarks.loadbench.probes` from here


def _probe(args: list[str]) -> dict:
    """Run a probe (probes.py) in a fresh process, timed as run_child times it."""
    path = os.pathsep.join(p for p in (str(_REPO), os.environ.get("PYTHONPATH")) if p)
    return run_child(["-m", "benchmarks.loadbench.probes", *args], env={"PYTHONPATH": path})


class Config:
    """One figure: how to run it once, and what it is compared with."""

    def __init__(self, key: str, label: str, group: str, run, *, files=(), weight_bytes=0, prime=0, evict=(),
                 before=None, floor=None, disk=None, baseline=None, load=None):
        self.key, self.label, self.group, self._run = key, label, group, run
        self.files, self.weight_bytes, self.prime, self.evict = list(files), weight_bytes, prime, list(evict)
        self.before, self.floor, self.disk, self.baseline, self.load = before, floor, disk, baseline, load
        self.runs: list[dict] = []
        self.forward: dict | None = None

    def once(self, prime: bool) -> dict:
        if self.before is not None:
            self.before()
        left = evict(self.evict) if self.evict else None
        if prime and self.prime:
            prime_memory(self.prime)
        report = self._run()
        if left is not None:
            report["resident_before"] = left
        self.runs.append(report)
        return report


WARM_KEYS = ("mlx_lm", "mlx_lm-4bit", "mlx_lm-8bit", "int4", "int8", "mlx", "finalized", "cold-tier-int8",
             "cold-tier-int4")
QUICK_KEYS = ("mlx_lm", "mlx_lm-4bit", "mlx_lm-8bit", "int4", "int8", "mlx", "finalized", "cold-tier-int4")
# mlx_lm's own conversions (`mlx_lm.convert -q`, group size 64): what an MLX user loads instead of bf16.
CONVERSIONS = {"mlx_lm-4bit": 4, "mlx_lm-8bit": 8}
SLACK = 256 << 20  # memory a run takes beyond its weights: what is primed, and dropped before an in-process load


def _in_process(loader: str, path: Path, tier: str | None, dropped_bytes: int):
    """A run of the in-process figure: load() timed after mlx_lm is imported and a model of `dropped_bytes` was
    dropped, as a process that switches models has (its wall_s is that load)."""
    def once() -> dict:
        report = measure_load(path, loader=loader, tier=tier, in_process=True, dropped_bytes=dropped_bytes)
        return {**report, "process_s": report["wall_s"], "wall_s": report["load_s"]}
    return once


def _first_load(store: Path):
    """A run of a first-load figure: a fresh npy-dir's load, and the bytes of the directory after it (store plus
    every cache the load wrote, its background build included: the child waits for it)."""
    def once() -> dict:
        report = measure_load(store, loader="squishlike")
        return {**report, "disk_after": size(all_files(store))}
    return once


def _to_first_token(loader: str, path: Path, tokens: int, in_process: bool = False):
    """A run of a time-to-first-token figure (load, a 64-token prompt, one token): its wall_s is spawn -> first token
    and ready_s spawn -> ready (whole process); `in_process` (mlx_lm imported before the clock, as a server that
    switches models) makes them load -> first token and the load. tokens_per_s is the generation after it."""
    def once() -> dict:
        report = measure_load(path, loader=loader, generate=tokens, in_process=in_process)
        if in_process:
            return {**report, "ready_s": report["load_s"],
                    "wall_s": report["load_s"] + report["first_token_s"] - report["wall_s"]}
        return {**report, "ready_s": report["wall_s"], "wall_s": report["first_token_s"]}
    return once


def _plan(source: Path, work: Path, quick: bool, cold: bool, do_compress: bool, name: str,
          generate: int = 16) -> list[Config]:
    int8 = prepare_store(source, work / f"{name}-int8", "int8", with_finalized=True)
    int4 = prepare_store(source, work / f"{name}-int4", "int4", with_finalized=False)
    fresh8 = fresh_clone(int8, work / f"{name}-int8-fresh")
    fresh4 = fresh_clone(int4, work / f"{name}-int4-fresh")
    converted = {key: build_mlx_lm_conversion(source, work / f"{name}-{key}", bits) for key, bits in CONVERSIONS.items()}
    src_files = source_files(source)
    src_bytes = size(src_files)
    configs: list[Config] = []

    def load(loader, path, tier=None):
        return lambda: measure_load(path, loader=loader, tier=tier)

    def floor_of(files, pages="huge"):
        return lambda: _probe(["floor", *map(str, files), "--pages", pages])

    loads = [
        ("mlx_lm", "mlx_lm.load (source dir)", "mlx_lm", source, None, src_files),
        *[(key, f"mlx_lm.load ({key.removeprefix('mlx_lm-')} conversion, g64)", "mlx_lm", path, None,
           source_files(path)) for key, path in converted.items()],
        ("int4", "squishlike int4 tier", "squishlike", int4, "int4", tier_files(int4, "int4")),
        ("int8", "squishlike int8 tier (g64)", "squishlike", int8, "int8", tier_files(int8, "int8")),
        ("mlx", "squishlike mlx tier", "squishlike", int8, "mlx", tier_files(int8, "mlx")),
        ("finalized", "squishlike finalized tier", "squishlike", int8, "finalized", tier_files(int8, "finalized")),
        ("cold-tier-int8", "squishlike cold tier (int8 store, no build)", "squishlike", int8, "cold",
         tier_files(int8, "cold")),
        ("cold-tier-int4", "squishlike cold tier (int4 store, no build)", "squishlike", int4, "cold",
         tier_files(int4, "cold")),
    ]
    loads = [entry for entry in loads if entry[0] in (QUICK_KEYS if quick else WARM_KEYS)]
    in_memory = {k: src_bytes for k in WARM_KEYS}
    in_memory["int4"] = size(tier_files(int4, "int4"))
    in_memory["int8"] = size(tier_files(int8, "int8"))
    in_memory.update({key: size(source_files(path)) for key, path in converted.items()})
    for key, label, loader, path, tier, files in loads:
        configs.append(Config(key, label, "warm", load(loader, path, tier), files=files, weight_bytes=in_memory[key],
                              prime=in_memory[key] + SLACK, baseline="mlx_lm", load=(loader, path, tier),
                              floor=[f"floor-{key}"] + (["floor-4k-mlx"] if key in ("mlx", "mlx_lm") else [])))
        configs.append(Config(f"floor-{key}", f"memory floor: {label} bytes", "floor", floor_of(files),
                              files=files, weight_bytes=size(files), prime=size(files) + SLACK))
    configs.append(Config("startup", "startup floor: interpreter, import mlx_lm, tokenizer (no weights)", "warm",
                          lambda: _probe(["startup", str(source)]), baseline="mlx_lm"))
    for key, label, loader, path, tier, files in loads:
        if key in ("mlx_lm", *CONVERSIONS, "int4", "mlx", "finalized", "cold-tier-int4"):
            configs.append(Config(f"inproc-{key}", f"in-process: {label}", "inproc",
                                  _in_process(loader, path, tier, in_memory[key] + SLACK),
                                  files=files, weight_bytes=in_memory[key], baseline="inproc-mlx_lm"))
    if generate:  # against what users load instead of an INT4 store: mlx_lm's 4-bit conversion
        ttft = [("mlx_lm", "mlx_lm.load (source dir)", "mlx_lm", source),
                ("mlx_lm-4bit", "mlx_lm.load (4-bit conversion, g64)", "mlx_lm", converted["mlx_lm-4bit"]),
                ("default", "squishlike, default tier (int4 store)", "squishlike", int4)]
        for prefix, how, in_process in (("ttft", "whole process", False), ("ttft-inproc", "in process", True)):
            for key, label, loader, path in ttft:
                configs.append(Config(f"{prefix}-{key}", f"to first token, {how}: {label}", "ttft",
                                      _to_first_token(loader, path, generate, in_process), files=src_files,
                                      weight_bytes=src_bytes, prime=src_bytes + SLACK,
                                      baseline=f"{prefix}-mlx_lm-4bit"))
    if not quick:
        mlx_files = tier_files(int8, "mlx")
        configs.append(Config("floor-4k-mlx", "memory floor, 4 KiB pages: mlx tier bytes", "floor",
                              floor_of(mlx_files, "4k"), files=mlx_files, weight_bytes=src_bytes,
                              prime=src_bytes + SLACK))
    firsts = [("first-int8", "first load, fresh int8 npy-dir (builds the tier this device takes)", fresh8),
              ("first-int4", "first load, fresh int4 npy-dir (builds the tier this device takes)", fresh4)]
    for key, label, store in firsts[1:] if quick else firsts:
        configs.append(Config(key, label, "first", _first_load(store), files=tier_files(store, "cold"),
                              weight_bytes=src_bytes, prime=src_bytes + SLACK, baseline="mlx_lm",
                              before=lambda s=store: reset_fresh(s)))
    # The whole-process figure a fresh INT4 store is held to, in the same rounds: mlx_lm.load of the 4-bit
    # conversion (the store's own "first" load is its every load on a device that builds nothing).
    four_bit = converted["mlx_lm-4bit"]
    configs.append(Config("first-mlx_lm-4bit", "whole process: mlx_lm.load (4-bit conversion, g64)", "first",
                          load("mlx_lm", four_bit), files=source_files(four_bit),
                          weight_bytes=in_memory["mlx_lm-4bit"], prime=in_memory["mlx_lm-4bit"] + SLACK,
                          baseline="first-mlx_lm-4bit"))
    if cold:
        for key, label, loader, path, tier, files in loads:
            if key == "cold-tier-int8" or (quick and key not in ("mlx_lm", "mlx")):
                continue
            configs.append(Config(f"evicted-{key}", f"{label}, evicted", "cold", load(loader, path, tier),
                                  files=files, weight_bytes=in_memory[key], prime=in_memory[key] + SLACK,
                                  evict=all_files(path), disk=f"disk-{key}", baseline="evicted-mlx_lm"))
            configs.append(Config(f"disk-{key}", f"disk floor: {label} files", "disk",
                                  lambda f=files: _probe(["disk", *map(str, f)]), files=files, evict=files))
    if do_compress:
        for fmt, clip in [("int4", False)] if quick else [("int8", False), ("int4", False), ("int4", True)]:
            tag = f"{fmt}{'-clip' if clip else ''}"
            out = work / f"{name}-compress-{tag}"
            configs.append(Config(
                f"compress-{tag}", f"compress {fmt}{' + clip search' if clip else ''}", "compress",
                lambda fmt=fmt, clip=clip, out=out: _probe(
                    ["compress", str(source), str(out), fmt] + (["--clip"] if clip else [])),
                files=src_files, weight_bytes=src_bytes))
    return configs


GROUPS = ("warm", "inproc", "ttft", "first", "cold", "compress")  # in the order they run


def run_benchmark(model: str, workdir: Path, runs: int = 5, quick: bool = False, cold: bool = True,
                  do_compress: bool = True, prime: bool = False, forward: bool = True, out_dir: Path | None = None,
                  generate: int = 16, log=print, only: set[str] | None = None) -> dict:
    """Prepare the models and stores under `workdir`, run every figure (or those of the groups in `only`, beside
    the baselines), write JSON, Markdown and PNG."""
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    # Installed packages carry their bytecode (mlx_lm's and transformers' do); a checkout run with
    # PYTHONDONTWRITEBYTECODE=1 would have every timed child compile squishlike's modules from source (~0.1 s).
    compileall.compile_dir(Path(squishlike.__file__).parent, quiet=1)
    started = time.monotonic()
    if model == "smollm":
        source, name = build_smollm_source(workdir / "smollm2-135m-bf16"), "smollm2"
    elif model in ("qwen1.5b", "qwen"):
        tokenizer = None
        with contextlib.suppress(FileNotFoundError, ImportError, RuntimeError):
            tokenizer = build_smollm_source(workdir / "smollm2-135m-bf16")
        source, name = build_qwen_like(workdir / "qwen2-1.5b-shaped-bf16", tokenizer), "qwen1.5b"
    else:
        source, name = Path(model).absolute(), Path(model).name
        if not source_files(source):
            raise FileNotFoundError(f"{model}: no model*.safetensors there (or give one of: smollm, qwen1.5b)")
    log(f"source: {source} ({size(source_files(source)) / GB:.2f} GB); preparing the stores ...")
    configs = _plan(source, workdir, quick, cold, do_compress, name, generate)
    if only is not None:
        unknown = only - set(GROUPS)
        if unknown:
            raise ValueError(f"unknown figure group {', '.join(sorted(unknown))}; choose from {', '.join(GROUPS)}")
        configs = [c for c in configs if c.group in only or c.key in ("mlx_lm", "startup")]
    for c in configs:
        if not c.evict:
            warm(c.files)
    for group in GROUPS:
        members = [c for c in configs if c.group == group or (group, c.group) in (("warm", "floor"), ("cold", "disk"))]
        count = 1 if group == "compress" and quick else runs
        if group == "ttft" and device_kind() != "cpu":
            # A kernel's first use on a machine compiles it, and MLX caches the result on disk (on CUDA, NVRTC's
            # output under /tmp/mlx/<version>/ptx: 11 s for the bf16 model's kernels on an H200, 31 s more for the
            # 4-bit ones). Whichever figure ran first would pay that for the others; one untimed round pays it.
            # mlx[cpu] keeps no such cache across processes, and its 4-bit first token is minutes on a 1.5B model.
            for c in members:
                c._run()
                log(f"  [{group} warm-up] {c.label:59} (untimed: compiles and caches the kernels)")
        for r in range(count):
            for c in members:
                rep = c.once(prime)
                log(f"  [{group} {r + 1}/{count}] {c.label:62} {rep['wall_s']:7.2f} s")
    if forward:
        for c in configs:
            if c.group == "warm" and c.load is not None:
                loader, path, tier = c.load
                c.forward = measure_load(path, loader=loader, tier=tier, forward=True)
                log(f"  [forward] {c.label:62} {c.forward.get('forward_s', 0):7.2f} s")
    result = results(configs, source, workdir, name, runs, prime, time.monotonic() - started)
    out_dir = Path(out_dir or workdir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{name}{'-quick' if quick else ''}"
    table = markdown(result)
    chart = plot(result, out_dir / f"{stem}.png")
    result["outputs"] = {"json": str(out_dir / f"{stem}.json"), "markdown": str(out_dir / f"{stem}.md"),
                         "chart": str(chart) if chart else None}
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out_dir / f"{stem}.md").write_text(table)
    log("\n" + table)
    log(f"wrote {out_dir / (stem + '.json')}, {out_dir / (stem + '.md')}"
        + (f", {chart}" if chart else " (no chart: matplotlib is not installed; pip install 'squishlike[bench]')"))
    return result
