"""The default INT4 store against mlx_lm's GPTQ and `mlx_lm.convert -q`, family by family, in the same run.

For each model type (the architecture sweep's tiny configs, tests/support/arch_sweep.py: random bfloat16 weights on
the type's real config at sweep size, norms near their identity, embedding and head rows of log-normal spread so
that the model has confident choices), three stores of the same source:

- squishlike's default INT4 compress (`compress(src, out, scheme="int4")`: AWQ where a fold exists, GPTQ on every
  linear and expert stack, clip search);
- mlx_lm's GPTQ (`mlx_lm.quant.gptq.gptq_quantize`, 4 bits, groups of 64, every `Linear` and `SwitchLinear`, the
  model in float32) on squishlike's calibration tokens, in 512-token rows;
- `mlx_lm.convert -q` (4 bits, groups of 64, round to nearest).

Each is scored by its mean KL to the source's next-token distribution on the evaluation prose (1,024 tokens), its
tensor bytes (values, scales and biases, no padding: what mlx_lm's bits-per-weight counts), and what each of the
store's tensors got (GPTQ, GPTQ per expert, round to nearest), from its manifest.

    python -m benchmarks.bench_families [--types llama,qwen3_moe,...|default|all] [--seeds 0,1,2]
        [--options '{"clip_search": false}'] [--out results/families.json]
    python -m benchmarks.bench_families --source gemma3-270m     # a real model (benchmarks/real_models.py)
    python -m benchmarks.bench_families --types deepseek_v3 --config '{"qk_nope_head_dim": 64, "v_head_dim": 64}'

One random model's KL is decided by the rounding of a few tensors (its input embedding above all, docs/design.md
§7.5): `--seeds` draws several models per type and prints the ratios' geometric mean per type;
`benchmarks/attribute_family.py` shows which tensors.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

EXTRA = ("gemma3_text", "qwen2_moe", "deepseek_v3", "olmoe", "granitemoe", "phi", "cohere", "starcoder2")


def build_source(model_type: str, directory: Path, tokenizer: Path, seed: int = 0,
                 overrides: dict | None = None) -> Path:
    """The type's random bfloat16 model at sweep size, with `overrides` over its config."""
    import mlx.core as mx

    from tests.support.arch_sweep import HAND, tiny_config
    from tests.support.tiny_models import make_hf_model

    config = {**(HAND.get(model_type) or tiny_config(model_type)), **(overrides or {})}
    # Positions for the 1,024-token windows the calibration and the evaluation take (learned ones: gpt2's)
    config = {**config, **{k: 2048 for k in ("n_positions", "n_ctx", "max_position_embeddings") if k in config}}
    make_hf_model(directory, config, tokenizer, dtype=mx.bfloat16, seed=seed, row_spread=1.0)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return directory


def mlx_lm_gptq(src: Path, out: Path) -> None:
    import mlx.core as mx
    from mlx_lm.quant.gptq import gptq_quantize
    from mlx_lm.utils import load, save

    from benchmarks.quality import sequences
    from squishlike.evaluation import load_text

    model, tokenizer, config = load(str(src), return_config=True)
    model.set_dtype(mx.float32)  # mlx[cpu]'s gather_mm (the expert stacks) runs float32 only
    tokens = tokenizer.encode(load_text("calibration"))
    model, config["quantization"] = gptq_quantize(model, sequences(tokens, 512), 4, 64, 4, 64)
    model.set_dtype(mx.bfloat16)
    save(str(out), str(src), model, tokenizer, config)


def methods(store: Path) -> dict[str, int]:
    """How many of the store's quantized tensors got each method, from the reasons its manifest records."""
    tensors = json.loads((store / "manifest.json").read_text())["tensors"].values()
    counts = Counter("GPTQ per expert" if "GPTQ per expert" in t["reason"] else "GPTQ" if "GPTQ" in t["reason"]
                     else "nearest" for t in tensors if t["scheme"] != "passthrough")
    return dict(counts)


def measure(model_type: str, work: Path, tokenizer: Path, seed: int = 0, options: dict | None = None,
            overrides: dict | None = None) -> dict:
    src = build_source(model_type, work / f"{model_type}-{seed}", tokenizer, seed, overrides)
    row = measure_source({"type": model_type, "seed": seed, **({"config": overrides} if overrides else {})}, src,
                         work, options)
    shutil.rmtree(src, ignore_errors=True)
    return row


def measure_source(row: dict, src: Path, work: Path, options: dict | None = None) -> dict:
    """The three stores of `src` (an MLX directory), each scored against it; `row` names the model."""
    import mlx_lm

    import squishlike
    from benchmarks.quality import tensor_bytes
    from squishlike import evaluation as ev

    reference, tok = ev.load_float32(src)
    windows = ev.token_windows(tok, ev.load_text("eval_prose"), max_tokens=1024)
    cache = ev.ReferenceCache(reference, windows)
    del reference
    row = {**row, **({"options": options} if options else {})}
    slug = f"{row['type']}-{row['seed']}"
    builders = {
        "squishlike": lambda out: squishlike.compress(src, out, scheme="int4", **(options or {})),
        "mlx_lm_gptq": lambda out: mlx_lm_gptq(src, out),
        "convert_q": lambda out: mlx_lm.convert(str(src), str(out), quantize=True, q_bits=4, q_group_size=64,
                                                dtype="bfloat16"),
    }
    for name, build in builders.items():
        out = work / f"{slug}-{name}"
        try:
            started = time.perf_counter()
            build(out)
            seconds = time.perf_counter() - started
            model, _ = squishlike.load(out, tier="cold") if name == "squishlike" else squishlike.load(out)
            kl = ev.compare(ev.prepare_for_eval(model), cache, windows)["kl_mean"]
            kind = "npydir" if name == "squishlike" else "mlx"
            row[name] = {"kl": round(kl, 5), "bytes": tensor_bytes(out, kind), "seconds": round(seconds, 1)}
            if name == "squishlike":
                row[name]["methods"] = methods(out)
        except Exception as e:  # noqa: BLE001 - a method that cannot quantize this type is a row of the table
            row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            traceback.print_exc(file=sys.stderr)
        shutil.rmtree(out, ignore_errors=True)
    ours, theirs = row["squishlike"], row["mlx_lm_gptq"]
    if "kl" in ours and "kl" in theirs:
        row["kl_ratio"] = round(ours["kl"] / theirs["kl"], 3)
        row["bytes_ratio"] = round(ours["bytes"] / theirs["bytes"], 4)
    return row


def table(rows: list[dict]) -> str:
    seeds = len({r.get("seed", 0) for r in rows}) > 1
    lines = [f"| type |{' seed |' if seeds else ''} squishlike KL | mlx_lm GPTQ KL | convert -q KL | KL ratio | "
             "bytes ratio | tensors |", f"|---|{'---:|' if seeds else ''}---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cells = [r[k].get("kl", r[k].get("error", "")) for k in ("squishlike", "mlx_lm_gptq", "convert_q")]
        got = ", ".join(f"{n} {m}" for m, n in r["squishlike"].get("methods", {}).items())
        seed = f" {r.get('seed', 0)} |" if seeds else ""
        name = r["type"] + (f" ({', '.join(f'{k} {v}' for k, v in r['config'].items())})" if "config" in r else "")
        lines.append(f"| {name} |{seed} {' | '.join(map(str, cells))} | {r.get('kl_ratio', '')} | "
                     f"{r.get('bytes_ratio', '')} | {got} |")
    return "\n".join(lines)


def by_type(rows: list[dict]) -> str:
    """Per type, the KL ratios of its seeds and their geometric mean: one random model's ratio swings with the
    rounding luck of a few tensors (docs/design.md §7.5), the seeds' mean far less."""
    ratios: dict[str, list[float]] = {}
    for r in rows:
        if "kl_ratio" in r:
            ratios.setdefault(r["type"], []).append(r["kl_ratio"])
    lines = ["| type | KL ratio per seed | geometric mean |", "|---|---|---:|"]
    for t, rs in ratios.items():
        lines.append(f"| {t} | {', '.join(map(str, rs))} | {math.exp(sum(map(math.log, rs)) / len(rs)):.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.loadbench.models import build_bf16_source
    from benchmarks.real_models import model_path
    from tests.support.arch_sweep import DEFAULT, GENERATED, HAND
    from tests.support.tiny_models import make_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="default",
                        help="comma-separated model types; 'default': the sweep's default share and a few more "
                        "families; 'all': every swept type")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated seeds of each type's random model; with more than one, the KL ratios' "
                        "geometric mean per type is printed too")
    parser.add_argument("--options", type=json.loads, default={},
                        help='compress options beside scheme="int4", as JSON, e.g. \'{"clip_search": false}\'')
    parser.add_argument("--config", type=json.loads, default={},
                        help="fields over each type's sweep config, as JSON: e.g. deepseek_v3's heads widened to a "
                        "group of 64, where mlx_lm's GPTQ needs every weight's rows split into groups")
    parser.add_argument("--source", action="append", default=[],
                        help="a real model instead of the random ones: a name of benchmarks/real_models.py "
                        "(gemma3-270m) or any model squishlike reads (a GGUF file, an HF or MLX directory), taken as "
                        "bfloat16; repeatable; with it, --types is ignored")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here, and the table beside it (.md)")
    args = parser.parse_args(argv)
    types = {"default": [*DEFAULT, *EXTRA], "all": sorted({*HAND, *GENERATED})}.get(args.types,
                                                                                     args.types.split(","))
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for source in args.source:
            print(f"== {source}", file=sys.stderr, flush=True)
            name = Path(source).stem
            src = build_bf16_source(model_path(source, work), work / f"{name}-bf16")
            rows.append(measure_source({"type": name, "seed": 0}, src, work, args.options))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        tokenizer = make_tokenizer(work / "tokenizer")
        for model_type in types if not args.source else []:
            for seed in seeds:
                print(f"== {model_type} seed {seed}", file=sys.stderr, flush=True)
                rows.append(measure(model_type, work, tokenizer, seed, args.options, args.config))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    text = table(rows) + ("\n\n" + by_type(rows) if len(seeds) > 1 else "")
    print(text)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
        args.out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
