"""Peak RSS of `squishlike server --max-memory B` answering one OpenAI chat request on a MoE store whose experts it
streams, against `squishlike generate --max-memory B` of the same messages (the baseline: one process, one model,
mlx_lm's generate_step), in the same run.

The store is bench_experts.py's (built once under --workdir, with its --shape/--layers/--experts/--vocab); the
prompt is --words words of plain prose, which both tools put through the chat template (a few hundred tokens:
a prompt pass that gathers every expert of each layer's stacks), and both generate 2 tokens. Peak RSS: generate's
from `/usr/bin/time -v`; the server's from its VmHWM, sampled each second through the request (the trace is
printed), after a --preload start.

    python -m benchmarks.bench_server_experts --workdir DIR --layers 8 --max-memory 1.2GB [--words 300]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.bench_experts import SHAPES, build_store
from benchmarks.bench_server import start_server

WORDS = ("the quick brown fox jumps over the lazy dog while a river runs past old stone walls and children count "
         "birds on the wire near the station").split()


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes (empty once it is gone or a zombie)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines if line.startswith(("VmRSS", "VmHWM"))}


def generate_peak(store: Path, budget: str, prompt: str) -> int:
    run = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "squishlike", "generate", "--model", str(store),
                          "--max-memory", budget, "--prompt", prompt, "--max-tokens", "2"],
                         capture_output=True, text=True, check=True)
    for line in (run.stdout + run.stderr).splitlines():
        if re.search(r"Prompt:|Generation:|expert cache", line):
            print(f"  generate: {line.strip()}")
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr)[1]) * 1024


def server_peak(store: Path, budget: str, prompt: str, log: Path) -> int:
    server, port = start_server([sys.executable, "-m", "squishlike", "server", "--model", str(store), "--max-memory",
                                 budget, "--preload"], log, startup_s=1800)
    try:
        print(f"  server loaded: RSS {status(server.pid)['VmRSS'] / 1e9:.3f} GB")
        body = json.dumps({"model": "default_model", "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": 2, "temperature": 0}).encode()
        reply = {}

        def ask() -> None:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=3600) as answer:
                reply.update(json.load(answer))

        asking, started = threading.Thread(target=ask), time.monotonic()
        asking.start()
        while asking.is_alive():
            asking.join(10)
            now = status(server.pid)
            print(f"  {time.monotonic() - started:6.0f} s: RSS {now['VmRSS'] / 1e9:.3f} GB, "
                  f"peak {now['VmHWM'] / 1e9:.3f} GB")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/ps", timeout=10) as answer:
            ps = json.load(answer)
        print(f"  server: {reply['usage']['prompt_tokens']} prompt tokens; counted {ps['resident'] / 1e9:.3f} GB of "
              f"the {ps['budget'] / 1e9:.3f} GB budget")
        return status(server.pid)["VmHWM"]
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_experts"))
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-moe")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--experts", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--max-memory", default="1.2GB")
    parser.add_argument("--words", type=int, default=300)
    args = parser.parse_args()
    config = dict(SHAPES[args.shape])
    for key, value in (("num_hidden_layers", args.layers), ("num_experts", args.experts), ("vocab_size", args.vocab)):
        if value is not None:
            config[key] = value
    store = build_store(args.workdir, config)
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(args.words))
    print(f"{store}: max_memory {args.max_memory}, a {args.words}-word chat prompt, 2 tokens")
    generated = generate_peak(store, args.max_memory, prompt)
    served = server_peak(store, args.max_memory, prompt, args.workdir / "server.log")
    print(f"peak RSS: generate {generated / 1e9:.3f} GB, server {served / 1e9:.3f} GB "
          f"({served / generated:.2f}x generate's)")


if __name__ == "__main__":
    main()
