#!/usr/bin/env python3
"""Model swaps in a server: `squishlike server` against `mlx_lm.server`, switching between two models N times.

    python -m benchmarks.bench_server [--swaps 10] [--workdir /tmp/bench-server]      # from the repository root

The two models are built here: the embedded SmolLM2-135M (as an MLX bf16 directory) and a random-weight model of
Qwen2.5-0.5B's shapes (benchmarks/loadbench/models.py). mlx_lm.server serves mlx_lm's own 4-bit conversions of
them (`mlx_lm.convert -q`); squishlike serves INT4 stores of the same sources, under a --max-memory budget that
holds one of them (so every swap loads, as mlx_lm's do) and under one that holds both. Each server first answers
once per model (untimed: tiers built, files in the page cache); then each request alternates the model and is
timed from sending it to its first streamed token. Peak memory is the server process's peak RSS (VmHWM).
Prints a table with the medians and mlx_lm's over squishlike's (target: swaps 3x faster, peak within the budget).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.loadbench.models import build_qwen_like, build_smollm_source

QWEN_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24,
    "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "max_window_layers": 24, "use_sliding_window": False, "sliding_window": 32768, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
NAMES = ("smollm2-135m", "qwen2.5-0.5b-shaped")


def build(workdir: Path) -> tuple[dict[str, Path], dict[str, Path]]:
    """(mlx_lm's 4-bit conversions, squishlike INT4 stores), each by model name, built once into `workdir`."""
    from mlx_lm import convert

    import squishlike

    smollm = build_smollm_source(workdir / "sources" / NAMES[0])
    sources = {NAMES[0]: smollm, NAMES[1]: build_qwen_like(workdir / "sources" / NAMES[1], smollm, QWEN_0_5B)}
    converted, stores = {}, {}
    for name, source in sources.items():
        converted[name] = workdir / "mlx-4bit" / name
        if not (converted[name] / "config.json").is_file():
            convert(str(source), mlx_path=str(converted[name]), quantize=True, q_bits=4, q_group_size=64)
        stores[name] = workdir / "stores" / name
        if not stores[name].is_dir():
            squishlike.compress(source, stores[name], scheme="int4")
    return converted, stores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def first_token_s(port: int, model: str) -> float:
    """Seconds from sending a streamed completion request for `model` to its first token."""
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as reply:
        for line in reply:
            if line.startswith(b"data: {"):
                elapsed = time.perf_counter() - started
                reply.read()
                return elapsed
    raise RuntimeError(f"{model}: the server streamed no token")


def start_server(command: list[str], log: Path, startup_s: float = 300) -> tuple[subprocess.Popen, int]:
    """A server `command` on a free port, its output to `log`, once it answers /health: (its process, the port)."""
    port = free_port()
    with open(log, "w") as out:
        server = subprocess.Popen([*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + startup_s
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"the server did not start:\n{log.read_text()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
            return server, port
        except OSError:
            time.sleep(0.3)


def measure(command: list[str], models: list[str], swaps: int, log: Path) -> dict:
    """Start a server, answer each model once, then time `swaps` requests alternating between them."""
    server, port = start_server(command, log)
    try:
        for model in models:  # untimed: tiers built, files in the page cache
            first_token_s(port, model)
        times = [first_token_s(port, models[(i + 1) % len(models)]) for i in range(swaps)]
        return {"swap_s": statistics.median(times), "all_s": times, "peak_rss": peak_rss(server.pid)}
    finally:
        server.kill()
        server.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swaps", type=int, default=10)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-server"))
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    converted, stores = build(args.workdir)

    import squishlike

    sizes = {}
    for name, store in stores.items():  # the budget: what the larger model takes in memory, loaded as served
        model, _ = squishlike.load(store)
        from mlx.utils import tree_flatten

        sizes[name] = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        del model
    one = int(max(sizes.values()) * 1.25)
    both = int(sum(sizes.values()) * 1.25)
    python = [sys.executable, "-m"]
    runs = {
        "mlx_lm.server, 4-bit conversions": measure(
            [*python, "mlx_lm", "server", "--model", str(converted[NAMES[0]])],
            [str(converted[n]) for n in NAMES], args.swaps, args.workdir / "mlx_lm.log"),
    }
    for label, budget in (("one", one), ("both", both)):
        runs[f"squishlike server, INT4 stores, budget holds {label} ({budget / 1e9:.2f} GB)"] = measure(
            [*python, "squishlike", "server", "--model-dir", str(args.workdir / "stores"),
             "--max-memory", str(budget)], list(NAMES), args.swaps, args.workdir / f"squishlike-{label}.log")
    baseline = runs["mlx_lm.server, 4-bit conversions"]["swap_s"]
    print(f"{args.swaps} swaps between {' and '.join(NAMES)} (model sizes in memory as squishlike serves them: "
          + ", ".join(f"{n} {s / 1e9:.2f} GB" for n, s in sizes.items()) + ")\n")
    print("| server | swap: request to first token (median) | mlx_lm / this | peak RSS |")
    print("|---|---:|---:|---:|")
    for label, run in runs.items():
        print(f"| {label} | {run['swap_s']:.3f} s | {baseline / run['swap_s']:.2f}x | {run['peak_rss'] / 1e9:.2f} GB |")
    (args.workdir / "results.json").write_text(json.dumps({"sizes": sizes, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
