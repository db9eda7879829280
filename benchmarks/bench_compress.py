"""Compress time and peak memory against what the ecosystem's own quantizers cost on the same machine, in the same
run: `mlx_lm.convert -q --q-bits 4 --q-group-size 64` (round to nearest, the store's bytes) and, on SmolLM2,
mlx_lm's own GPTQ (`mlx_lm.quant.gptq.gptq_quantize`, 4 bits, groups of 64, the model in float32, its fastest on
mlx[cpu]) on squishlike's calibration tokens (2,308 of the 2,311, as 4 rows).

Sources, built by loadbench's builders and reused: the embedded SmolLM2-135M as an MLX bf16 directory (`smollm`); a
directory with the exact shapes of a 1.5B Qwen2 and random bf16 weights (`qwen1.5b`: compute and memory depend on
shapes, not values); the same width at 7, 14 and 28 layers (`depth`: whether the default compress's peak memory
grows with depth; target: within 1.25x of each other); and Qwen2.5-7B's shapes (`qwen7b`, 15 GB of bf16: the
default compress with --calibration-tokens 2048 on a 24 GB machine, peak RSS <= 6 GB, then a load and a
generated token); and Qwen1.5-MoE-A2.7B's (`qwen-moe`, 28.6 GB of bf16, 60 experts a layer, each its own tensor
in the source: the same, every expert stack GPTQ'd expert by expert); and one size of several families (`families`:
the architecture sweep's configs at FAMILY_SIZE, random bf16 weights; each family's default compress time per
million parameters against llama's, target within 1.5x). Every figure is its own fresh process (OpenBLAS preloaded, as the CLI does, for all of them),
timed around the call alone (imports excluded); memory is the process's peak RSS, and its peak above its RSS once
imports are done.

    python -m benchmarks.bench_compress [--model smollm|qwen1.5b|depth|qwen7b|qwen-moe|families]
                                        [--methods default,...] [--types llama,qwen3,...]
                                        [--runs N]
"""

from __future__ import annotations

import argparse
import json
import math
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
CONVERT = "mlx_lm.convert -q"
GPTQ = "mlx_lm GPTQ"
TARGETS = {"default": (GPTQ, 1.5), "rtn": (CONVERT, 1.2)}  # SmolLM2: method -> (baseline, most time ratio)
# `families`: one size for every family (a 1,024-wide, 8-layer llama: 0.13 B parameters with its untied 32,000-token
# vocabulary), each family's own keys at it; an expert stack of 8 experts, 2 a token, as wide in all as the dense MLP
FAMILY_SIZE = {"hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 2816, "num_attention_heads": 16,
               "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000, "num_experts": 8,
               "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 352,
               "max_position_embeddings": 4096}
FAMILY_TYPES = "llama,qwen3,gemma3_text,phi3,qwen3_moe,mixtral"


def calibration_rows(tokenizer, max_tokens: int | None, rows: int = 4):
    """squishlike's calibration tokens as mlx_lm's GPTQ takes them: `rows` rows of equal length (the remainder of
    fewer than `rows` tokens dropped)."""
    import mlx.core as mx

    from squishlike.calibration import calibration_windows

    tokens = [t for w in calibration_windows(tokenizer, max_tokens=max_tokens) for t in w.tokens[:-1]]
    length = len(tokens) // rows
    return mx.array(tokens[:rows * length]).reshape(rows, length)


def child(method: str, src: str, out: str, options: dict) -> None:
    """One figure, in this process: print {"seconds", "rss_peak", "rss_peak_above_import", ...} as JSON."""
    import mlx.core as mx
    import mlx_lm

    import squishlike
    from squishlike.loadtime import peak_rss_bytes, rss_now

    generate = options.pop("generate", False)
    extra = {}
    if method == CONVERT:
        def run():
            mlx_lm.convert(src, out, quantize=True, q_bits=4, q_group_size=64)
    elif method == GPTQ:
        from mlx_lm.quant.gptq import gptq_quantize

        def run():  # in float32, mlx_lm's fastest on mlx[cpu] (bf16 matmuls are slow there)
            model, tokenizer, config = mlx_lm.load(src, lazy=True, return_config=True)
            model.set_dtype(mx.float32)
            data = calibration_rows(tokenizer, options.get("calibration_max_tokens"))
            extra["tokens"] = int(data.size)
            gptq_quantize(model, data, 4, 64, 4, 64)
    else:
        def run():
            squishlike.compress(src, out, scheme="int4", **{**METHODS[method], **options})
    rss_import = rss_now()
    started = time.perf_counter()
    run()
    seconds = time.perf_counter() - started
    if generate:
        model, tokenizer = squishlike.load(out)
        extra["generated"] = mlx_lm.generate(model, tokenizer, "The capital of France is", max_tokens=4)
    print(json.dumps({"seconds": seconds, "rss_peak": peak_rss_bytes(),
                      "rss_peak_above_import": peak_rss_bytes() - rss_import, **extra}))


def measure(method: str, src: Path, out: Path, options: dict | None = None) -> dict:
    from squishlike.openblas import find_openblas

    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, SQUISHLIKE_OPENBLAS="0")
    if (library := find_openblas()) is not None:
        env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_compress", "--child", method, str(src), str(out),
                           json.dumps(options or {})], env=env, stdout=subprocess.PIPE, check=True, text=True)
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def sources(model: str, workdir: Path) -> dict[str, Path]:
    from benchmarks.loadbench.models import QWEN_1_5B, QWEN_7B, QWEN_MOE_A2_7B, build_qwen_like, build_smollm_source

    try:
        smollm = build_smollm_source(workdir / "smollm2-135m-bf16")
    except FileNotFoundError:  # the embedded model is not installed (a lent GPU machine): a small tokenizer instead
        if model == "smollm":
            raise
        smollm = None
    if model == "smollm":
        return {"smollm": smollm}
    if model == "qwen1.5b":
        return {"qwen1.5b": build_qwen_like(workdir / "qwen2-1.5b-shaped-bf16", smollm)}
    if model == "qwen7b":
        return {"qwen7b": build_qwen_like(workdir / "qwen2.5-7b-shaped-bf16", smollm, QWEN_7B)}
    if model == "qwen-moe":
        return {"qwen-moe": build_qwen_like(workdir / "qwen1.5-moe-a2.7b-shaped-bf16", smollm, QWEN_MOE_A2_7B)}
    return {f"{n} layers": build_qwen_like(workdir / f"qwen2-1.5b-width-{n}-layers", smollm,
                                           {**QWEN_1_5B, "num_hidden_layers": n, "max_window_layers": n})
            for n in (7, 14, 28)}


def family_sources(types: list[str], workdir: Path) -> dict[str, Path]:
    """Each of `types` at FAMILY_SIZE (the keys its sweep config has; a mixtral's experts are its intermediate size),
    random bf16 weights, built once into `workdir`."""
    import mlx.core as mx

    from tests.support.arch_sweep import HAND, tiny_config
    from tests.support.tiny_models import make_hf_model, make_tokenizer

    tokenizer = make_tokenizer(workdir / "tokenizer")
    found = {}
    for model_type in types:
        config = HAND.get(model_type) or tiny_config(model_type)
        config = {**config, **{k: v for k, v in FAMILY_SIZE.items() if k in config}}
        if "num_local_experts" in config:
            config["intermediate_size"] = FAMILY_SIZE["moe_intermediate_size"]
        if isinstance(config.get("layer_types"), list):  # a pattern of two layers, repeated
            config["layer_types"] = [config["layer_types"][i % 2] for i in range(config["num_hidden_layers"])]
        directory = workdir / f"{model_type}-family-size"
        if not (directory / "config.json").exists():
            make_hf_model(directory, config, tokenizer, dtype=mx.bfloat16, row_spread=1.0)
        found[model_type] = directory
    return found


def parameters(src: Path) -> int:
    from safetensors import safe_open

    with safe_open(src / "model.safetensors", "np") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def table(figures: dict, base: str) -> None:
    print("| method | compress s | vs " + base + " | peak RSS | peak RSS above imports |")
    print("|---|---:|---:|---:|---:|")
    for method, fig in figures.items():
        print(f"| {method} | {fig['seconds']:.1f} | {fig['seconds'] / figures[base]['seconds']:.2f}x | "
              f"{fig['rss_peak'] / 1e9:.2f} GB | {fig['rss_peak_above_import'] / 1e9:.2f} GB |")


def run_figures(methods: list[str], src: Path, out: Path, runs: int, options: dict | None = None) -> dict:
    figures = {}
    for method in methods:
        results = [measure(method, src, out, options) for _ in range(runs)]
        figures[method] = {"seconds": statistics.median(r["seconds"] for r in results),
                           "rss_peak": max(r["rss_peak"] for r in results),
                           "rss_peak_above_import": max(r["rss_peak_above_import"] for r in results),
                           "runs": results}
        print(f"{method}: {figures[method]['seconds']:.1f} s, peak {figures[method]['rss_peak'] / 1e9:.2f} GB",
              file=sys.stderr, flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_compress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm", "qwen1.5b", "depth", "qwen7b", "qwen-moe", "families"),
                        default="smollm")
    parser.add_argument("--types", default=FAMILY_TYPES, help="with --model families: the model types, llama first "
                        "(default: %(default)s)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated from {','.join(METHODS)}")
    parser.add_argument("--runs", type=int, default=1, help="runs per figure (the median is reported)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/squishlike-bench-compress"))
    parser.add_argument("--calibration-tokens", type=int, help="squishlike's calibration_max_tokens (default: all)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--child", nargs=4, metavar=("METHOD", "SRC", "OUT", "OPTIONS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child[:3], json.loads(args.child[3]))
        return 0
    methods = [m for m in args.methods.split(",") if m]
    if unknown := set(methods) - set(METHODS):
        parser.error(f"unknown method(s) {', '.join(sorted(unknown))}; choose from {', '.join(METHODS)}")
    out = args.workdir / "out"
    tokens = {"calibration_max_tokens": args.calibration_tokens} if args.calibration_tokens else {}
    results: dict = {"model": args.model, "options": tokens}
    if args.model == "depth":  # the default compress at three depths, one width
        figures = {}
        for label, src in sources(args.model, args.workdir).items():
            figures[label] = run_figures(["default"], src, out, args.runs, tokens)["default"]
        peaks = [f["rss_peak"] for f in figures.values()]
        print("\nthe default INT4 compress of a 1.5B-wide model at three depths\n")
        table(figures, "7 layers")
        print(f"\npeak RSS, largest over smallest: {max(peaks) / min(peaks):.2f}x (target <= 1.25x)")
        results["figures"] = figures
    elif args.model == "families":  # the default compress of each family at one size, against llama's
        figures = {}
        for model_type, src in family_sources(args.types.split(","), args.workdir).items():
            figures[model_type] = {**run_figures(["default"], src, out, args.runs, tokens)["default"],
                                   "parameters": parameters(src)}
        per = {t: f["seconds"] / f["parameters"] * 1e6 for t, f in figures.items()}
        first = next(iter(figures))
        print(f"\nthe default INT4 compress of each family at one size, {args.runs} run(s) each\n")
        print(f"| type | parameters | compress s | s per M parameters | vs {first} | peak RSS |")
        print("|---|---:|---:|---:|---:|---:|")
        for t, f in figures.items():
            print(f"| {t} | {f['parameters'] / 1e6:.1f} M | {f['seconds']:.1f} | {per[t]:.3f} | "
                  f"{per[t] / per[first]:.2f}x | {f['rss_peak'] / 1e9:.2f} GB |")
        print(f"\nslowest per parameter against {first}: {max(per.values()) / per[first]:.2f}x (target <= 1.5x)")
        results["figures"] = figures
    elif args.model in ("qwen7b", "qwen-moe"):
        [src] = sources(args.model, args.workdir).values()
        figures = run_figures(["default"], src, out, 1, {"calibration_max_tokens": 2048, "generate": True})
        fig = figures["default"]
        shapes = "Qwen2.5-7B" if args.model == "qwen7b" else "Qwen1.5-MoE-A2.7B"
        print(f"\n{shapes} shapes ({src}): default INT4 compress with calibration_max_tokens=2048 in "
              f"{fig['seconds']:.0f} s, peak RSS {fig['rss_peak'] / 1e9:.2f} GB (target <= 6 GB); then loaded and "
              f"generated {fig['runs'][0]['generated']!r}")
        results["figures"] = figures
    else:
        [src] = sources(args.model, args.workdir).values()
        baselines = [CONVERT, GPTQ] if args.model == "smollm" else [CONVERT]
        figures = run_figures([*baselines, *methods], src, out, args.runs, tokens)
        print(f"\n{args.model} ({src}), {args.runs} run(s) per figure\n")
        table(figures, CONVERT)
        for method, (base, most) in TARGETS.items():
            if method in figures and base in figures:
                ratio = figures[method]["seconds"] / figures[base]["seconds"]
                print(f"{method} / {base}: {ratio:.2f}x (target <= {most}x)")
        results["figures"] = figures
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
