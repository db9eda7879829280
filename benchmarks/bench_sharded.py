"""Sharded loads on 2 ranks (`mlx.launch -n 2 --backend ring` on 127.0.0.1): per-rank load time and bytes read,
squishlike.sharded_load of an npy-dir against mlx_lm.sharded_load of its bf16 source, in the same run.

Model: the shapes of a 0.5B Qwen2 (random bf16 weights, 0.99 GB), built by loadbench's builder. For each mode
(tensor, pipeline) and each round, three launches in turn: mlx_lm.sharded_load of the source; squishlike's first
launch (no rank tier: reads its slices of the store, dequantizes them, builds the rank tier); squishlike's next
launch (the rank tier). Each rank times its sharded_load call alone (imports done before) and counts the bytes
its process read meanwhile (`rchar` of /proc/self/io: every read/pread, from disk or the page cache; not what a
process copies out of a memory map: squishlike's column cuts, counted instead by SliceReader.bytes_read, which
sharded_load logs). Files are warm in the page cache: this measures reading and dequantizing, not the disk.

    python -m benchmarks.bench_sharded [--workdir DIR] [--rounds N] [--scheme int8|int4]

`--slices` times instead the reading of a first launch alone, in one process: SliceReader.read of one rank's half
of 4096x4096 weights, cut along the columns (what o_proj and down_proj keep) and along the rows, from an INT4 g64
and an INT8 store.

    python -m benchmarks.bench_sharded --slices [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

QWEN_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24,
    "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
SLICES_MODEL = {**QWEN_0_5B, "hidden_size": 4096, "intermediate_size": 4096, "num_attention_heads": 32,
                "num_key_value_heads": 8, "num_hidden_layers": 1, "vocab_size": 2048}
LOADERS = ("mlx_lm", "squishlike first", "squishlike rank tier")
RANKS = 2


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def rank_main(loader: str, model: str, mode: str, out: str) -> None:
    """One rank: time one sharded load of `model`, count the bytes read meanwhile, write them to OUT/rank{r}.json."""
    import mlx.core as mx
    from mlx_lm.utils import sharded_load as mlx_lm_sharded_load

    import squishlike

    group = mx.distributed.init()
    load = mlx_lm_sharded_load if loader == "mlx_lm" else squishlike.sharded_load
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # start together
    before, started = _rchar(), time.perf_counter()
    load(model, **{f"{mode}_group": group})
    seconds, nbytes = time.perf_counter() - started, _rchar() - before
    Path(out, f"rank{group.rank()}.json").write_text(json.dumps({"seconds": seconds, "bytes": nbytes}))


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out on its own (to connect() and bind(0)): Linux's setting, else macOS's
    default."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def ring_starting_port(n: int) -> int:
    """A port p with p .. p+n-1 free on 127.0.0.1 now, for `mlx.launch --backend ring --starting-port p` (rank r
    listens on p + r).

    Taken outside the kernel's ephemeral range, never from bind(0): a port in that range is where every outgoing
    connection gets its source port (the ranks' own connects to each other included; Linux gives bind(0) odd ports
    and connect() even ones, so p + 1 was exactly the kind it takes), so between this check and the rank's bind it
    could be taken: `[ring] Couldn't bind socket (error: 98)`. Random, so runs side by side rarely try the same."""
    low, high = _ephemeral_range()
    candidates = [*range(15000, low - n), *range(high + 1, 65536 - n)]  # below 15000: where services listen
    rng = random.SystemRandom()
    for _ in range(100):
        base = rng.choice(candidates)
        socks = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports on 127.0.0.1")


def launch(loader: str, model: Path, mode: str, out: Path) -> list[dict]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    launcher = Path(sys.executable).with_name("mlx.launch")
    command = [str(launcher), "-n", str(RANKS), "--backend", "ring", "--starting-port", str(ring_starting_port(RANKS)),
               sys.executable, "-m", "benchmarks.bench_sharded", "--rank", loader, str(model), mode, str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, start_new_session=True)
    try:
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    except FileNotFoundError:
        raise RuntimeError(f"{loader} {mode}: a rank failed\n{done.stdout[-3000:]}{done.stderr[-3000:]}") from None


def prepare(workdir: Path, scheme: str) -> tuple[Path, Path]:
    from benchmarks.loadbench.models import build_qwen_like

    import squishlike

    source = build_qwen_like(workdir / "qwen2-0.5b-shaped-bf16", None, QWEN_0_5B)
    index = source / "model.safetensors.index.json"  # mlx_lm's pipeline split reads the weight map
    if not index.exists():
        from safetensors import safe_open

        with safe_open(str(source / "model.safetensors"), "numpy") as f:
            index.write_text(json.dumps({"weight_map": dict.fromkeys(f.keys(), "model.safetensors")}))
    store = workdir / f"store-{scheme}"
    if not (store / "manifest.json").exists():
        squishlike.compress(source, store, scheme=scheme, group_size=64, tiers=[], force=True)
    return source, store


def run(workdir: Path, rounds: int, scheme: str) -> dict:
    source, store = prepare(workdir, scheme)
    for path in [*source.rglob("*"), *store.rglob("*")]:  # warm the page cache
        if path.is_file():
            path.read_bytes()
    results: dict = {}
    for mode in ("tensor", "pipeline"):
        for _ in range(rounds):
            for loader in LOADERS:
                if loader == "squishlike first":
                    shutil.rmtree(store / "shards", ignore_errors=True)
                ranks = launch(loader, source if loader == "mlx_lm" else store, mode, workdir / "out")
                for rank, r in enumerate(ranks):
                    results.setdefault((mode, loader, rank), []).append(r)
    return {"scheme": scheme, "rounds": rounds, "rows": [
        {"mode": mode, "loader": loader, "rank": rank,
         "seconds": statistics.median(r["seconds"] for r in runs), "bytes": statistics.median(r["bytes"] for r in runs)}
        for (mode, loader, rank), runs in results.items()]}


def slices(workdir: Path, repeats: int = 5) -> str:
    """Median milliseconds of SliceReader.read of rank 0's half of each 4096x4096 weight, along each axis."""
    from benchmarks.loadbench.models import build_qwen_like

    import squishlike
    from squishlike.npydir import NpyDir
    from squishlike.npydir.slices import SliceReader

    source = build_qwen_like(workdir / "slices-4096-bf16", None, SLICES_MODEL)
    lines = ["| scheme | axis | ms (median) | MB read |", "|---|---|---:|---:|"]
    for scheme, group_size in (("int4", 64), ("int8", "row")):
        path = workdir / f"slices-4096-{scheme}"
        if not (path / "manifest.json").exists():
            squishlike.compress(source, path, scheme=scheme, group_size=group_size, tiers=[], force=True)
        store = NpyDir(path)
        names = [n for n, e in store.entries.items() if list(e.shape) == [4096, 4096]]
        for axis, label in ((1, "columns"), (0, "rows")):
            reader, times = SliceReader(store), []
            for _ in range(repeats):
                started = time.perf_counter()
                for name in names:
                    reader.read(name, axis, np.arange(2048))
                times.append(time.perf_counter() - started)
            lines.append(f"| {scheme} | {label} of {len(names)} | {statistics.median(times) * 1e3:.1f} | "
                         f"{reader.bytes_read / repeats / 1e6:.1f} |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    base = {(r["mode"], r["rank"]): r for r in result["rows"] if r["loader"] == "mlx_lm"}
    lines = ["| mode | loader | rank | load s (median) | vs mlx_lm | bytes read | vs mlx_lm |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        b = base[(r["mode"], r["rank"])]
        lines.append(f"| {r['mode']} | {r['loader']} | {r['rank']} | {r['seconds']:.2f} | "
                     f"{b['seconds'] / r['seconds']:.2f}x | {r['bytes'] / 1e6:.0f} MB | "
                     f"{r['bytes'] / b['bytes']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank"]:
        rank_main(*argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path,
                        default=Path(os.environ.get("TMPDIR", "/tmp")) / "squishlike-bench-sharded")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scheme", choices=("int8", "int4"), default="int4")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--slices", action="store_true", help="time SliceReader.read alone (see above)")
    args = parser.parse_args(argv)
    if args.slices:
        print(slices(args.workdir))
        return 0
    result = run(args.workdir, args.rounds, args.scheme)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
