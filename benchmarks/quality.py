"""The quantization quality table: every scheme squishlike stores, and mlx_lm's own 8-bit and 4-bit, against the
unquantized reference, on the shipped evaluation prose.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/quality.py --workdir /tmp/squishlike-quality --markdown benchmarks/QUALITY.md

(the script re-executes itself with OpenBLAS preloaded when it finds it, so the LD_PRELOAD is optional).

Model: the embedded SmolLM2-135M-Instruct GGUF; reference: that GGUF as the provider reads it (Q4_1 dequantized,
float32). Every model is evaluated in float32 (`evaluate.prepare_for_eval`) with the same code as `squishlike eval`:
perplexity over the first --max-tokens tokens of data/eval_prose.txt (1024-token windows), teacher-forced top-1
agreement and mean KL(reference || model) on the same positions, greedy agreement over data/eval_prompts.json.
Calibration (AWQ, mixed precision, the INT3 gate) uses data/calibration.txt only. npy-dirs are read through the
cold tier: every tier of one npy-dir holds the same weights (tests/integration/test_tiers.py, tests/integration/test_quality.py).

Rows are built in --workdir and reused when already there (delete the directory to rebuild).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROWS: list[tuple[str, str, dict]] = [
    # (label, kind, options) -- kind: reference | npydir (compress options) | mlx (export -q options) |
    # mlx_lm (mlx_lm.convert -q options, from the GGUF exported to HF)
    ("reference (GGUF Q4_1 as read, float32)", "reference", {}),
    ("INT8 g32", "npydir", {"format": "int8", "group_size": 32}),
    ("INT8 g64", "npydir", {"format": "int8", "group_size": 64}),
    ("INT8 g128", "npydir", {"format": "int8", "group_size": 128}),
    ("INT8 g64, float16 runtime", "npydir", {"format": "int8", "group_size": 64, "dtype": "float16"}),
    ("INT8 g64, float32 runtime", "npydir", {"format": "int8", "group_size": 64, "dtype": "float32"}),
    ("mlx_lm 8-bit g64 (convert -q)", "mlx", {"q_bits": 8, "q_group_size": 64}),
    ("mlx_lm 8-bit g64, bfloat16 (convert -q --dtype bfloat16)", "mlx_lm",
     {"q_bits": 8, "q_group_size": 64, "dtype": "bfloat16"}),
    ("INT8 per-row", "npydir", {"format": "int8", "group_size": "row"}),
    ("INT8 per-row AWQ", "npydir", {"format": "int8", "group_size": "row", "awq": True}),
    ("INT8 per-row, mixed 20 %", "npydir", {"format": "int8", "group_size": "row", "mixed_precision": 0.2}),
    ("INT8 per-row, mixed 50 %", "npydir", {"format": "int8", "group_size": "row", "mixed_precision": 0.5}),
    ("INT8 per-row, mixed 85 %", "npydir", {"format": "int8", "group_size": "row", "mixed_precision": 0.85}),
    ("INT4 g64 RTN", "npydir", {"format": "int4", "group_size": 64}),
    ("INT4 g64 clip", "npydir", {"format": "int4", "group_size": 64, "clip_search": True}),
    ("INT4 g64 AWQ", "npydir", {"format": "int4", "group_size": 64, "awq": True}),
    ("INT4 g64 AWQ+clip", "npydir", {"format": "int4", "group_size": 64, "awq": True, "clip_search": True}),
    ("INT4 g64 AWQ+clip, mixed 10 %", "npydir",
     {"format": "int4", "group_size": 64, "awq": True, "clip_search": True, "mixed_precision": 0.1}),
    ("INT4 g64 AWQ+clip, embeddings too", "npydir",
     {"format": "int4", "group_size": 64, "awq": True, "clip_search": True, "quantize_embeddings": True}),
    ("mlx_lm 4-bit g64 (convert -q)", "mlx", {"q_bits": 4, "q_group_size": 64}),
    ("INT3 g64 RTN", "npydir", {"format": "int3", "group_size": 64}),
    ("INT3 g32 AWQ+clip", "npydir", {"format": "int3", "group_size": 32, "awq": True, "clip_search": True}),
]


def slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label.lower()).strip("_")


def weights_bytes(path: Path, kind: str) -> int:
    """Bytes of weights at rest: the GGUF file, the npy-dir's tensors/, the MLX directory's safetensors."""
    if kind == "reference":
        return path.stat().st_size
    if kind == "npydir":
        return sum(p.stat().st_size for p in (path / "tensors").iterdir())
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def build(label: str, kind: str, options: dict, gguf: Path, workdir: Path) -> tuple[Path, float | None]:
    import squishlike
    from squishlike.exporter import export

    if kind == "reference":
        return gguf, None
    out = workdir / slug(label)
    if out.exists():
        return out, None
    started = time.perf_counter()
    if kind == "npydir":
        squishlike.compress(gguf, out, **options)
    elif kind == "mlx":
        export(gguf, "mlx", out, quantize=True, **options)  # bit for bit what mlx_lm.convert writes
    else:
        import mlx_lm

        hf = workdir / "hf-export"
        if not hf.exists():
            export(gguf, "hf", hf)
        mlx_lm.convert(str(hf), str(out), quantize=True, **options)
    return out, time.perf_counter() - started


def evaluate_rows(args) -> list[dict]:
    import mlx.core as mx

    import squishlike
    from squishlike import evaluation as ev
    from squishlike.default_model import default_model_path

    gguf = default_model_path()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    selected = [r for r in ROWS if not args.rows or any(s in slug(r[0]) for s in args.rows)]

    built = {}
    for label, kind, options in selected:
        print(f"== building {label}", file=sys.stderr, flush=True)
        built[label] = build(label, kind, options, gguf, workdir)

    reference, tokenizer = ev.load_float32(gguf)
    windows = ev.token_windows(tokenizer, ev.load_text("eval_prose"), max_tokens=args.max_tokens)
    cache = ev.ReferenceCache(reference, windows)
    prompts = ev.load_prompts()
    ref_greedy = ev.greedy_generations(reference, tokenizer, prompts, args.gen_tokens)
    del reference

    results = []
    for label, kind, options in selected:
        path, compress_s = built[label]
        print(f"== evaluating {label}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        if kind == "npydir":
            model, _ = squishlike.load(path, tier="cold")  # builds no cache; every tier has these weights
        else:
            model, _ = squishlike.load(path)
        model = ev.prepare_for_eval(model)
        row = {"label": label, "kind": kind, "options": options, "path": str(path)}
        row.update(ev.compare(model, cache, windows))
        greedy = ev.greedy_generations(model, tokenizer, prompts, args.gen_tokens)
        row["greedy_agreement"] = ev.sequence_agreement(greedy, ref_greedy)
        row["greedy_exact"] = sum(a == b for a, b in zip(greedy, ref_greedy))
        row["weights_bytes"] = weights_bytes(path, kind)
        row["compress_s"] = compress_s
        row["eval_s"] = time.perf_counter() - t0
        if kind == "npydir":
            manifest = json.loads((path / "manifest.json").read_text())
            row["int3_gate"] = manifest.get("int3_gate")
            row["awq"] = {k: v for k, v in manifest.get("awq", {}).items() if k != "groups"} or None
            if "awq" in manifest and manifest["awq"].get("groups"):
                alphas = [g["alpha"] for g in manifest["awq"]["groups"].values()]
                row["awq"]["mean_alpha"] = sum(alphas) / len(alphas)
            if "mixed_precision" in manifest:
                mp = manifest["mixed_precision"]
                row["mixed_precision"] = {k: mp[k] for k in ("budget", "extra_bytes", "tensors")}
        results.append(row)
        del model
        mx.clear_cache()
        print(f"   ppl {row['perplexity']:.4f}  top-1 {row['top1_agreement']:.4f}  KL {row['kl_mean']:.5f}  "
              f"greedy {row['greedy_agreement']:.3f}", file=sys.stderr, flush=True)
    return results


def markdown(results: list[dict], args) -> str:
    from squishlike.evaluation import load_prompts

    ref = next((r for r in results if r["kind"] == "reference"), None)
    mlx = next((r for r in results if r["kind"] == "mlx" and r["options"].get("q_bits") == 4), None)
    lines = [
        f"Model: SmolLM2-135M-Instruct (embedded GGUF); reference = the GGUF as the provider reads it (float32). "
        f"Text: first {results[0]['positions'] + results[0]['windows']} tokens of data/eval_prose.txt "
        f"({results[0]['positions']} scored positions); greedy: {len(load_prompts())} prompts x {args.gen_tokens} "
        f"tokens. All in float32.",
        "",
        "| model | ppl | Δ ppl | Δ vs mlx_lm 4-bit | top-1 | KL (nats) | greedy | weights at rest | INT3 gate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = ref["perplexity"] if ref else results[0]["reference_perplexity"]
    mlx_inc = mlx["perplexity"] - base if mlx else None
    for r in results:
        inc = r["perplexity"] - base
        rel = f"{inc / mlx_inc:.2f}x" if mlx_inc and r["kind"] != "reference" else ""
        gate = ""
        if r.get("int3_gate"):
            g = r["int3_gate"]
            if "candidate_ppl" in g:
                verdict = "passed" if g["passed"] else "failed"
                gate = f"{verdict} ({g['increase']:+.1%} on calibration, bound {g['bound']:+.0%})"
            else:
                gate = g.get("reason", "")
        lines.append(
            f"| {r['label']} | {r['perplexity']:.3f} | {inc / base:+.2%} | {rel} | {r['top1_agreement']:.2%} | "
            f"{r['kl_mean']:.4f} | {r['greedy_agreement']:.1%} | {r['weights_bytes'] / 1e6:.1f} MB | {gate} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/squishlike-quality", help="where the models are built (reused)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="evaluate on the first N tokens of the prose")
    parser.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--rows", nargs="*", help="only rows whose slug contains one of these")
    parser.add_argument("--json", type=Path, help="write the full results here")
    parser.add_argument("--markdown", type=Path, help="write the table here (else stdout only)")
    parser.add_argument("--clean", action="store_true", help="delete --workdir first")
    args = parser.parse_args(argv)

    from squishlike.environment import switch
    from squishlike.openblas import find_openblas

    blas = find_openblas()
    if blas and blas not in os.environ.get("LD_PRELOAD", "") and switch("SQUISHLIKE_OPENBLAS"):
        env = dict(os.environ, LD_PRELOAD=blas, SQUISHLIKE_OPENBLAS="0")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if args.clean:
        shutil.rmtree(args.workdir, ignore_errors=True)

    started = time.perf_counter()
    results = evaluate_rows(args)
    table = markdown(results, args)
    command = "python benchmarks/quality.py " + " ".join(sys.argv[1:])
    print(table)
    print(f"\n({time.perf_counter() - started:.0f} s; command: {command})", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"command": command, "rows": results}, indent=1))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
