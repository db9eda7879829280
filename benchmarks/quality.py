"""The quantization quality table: every scheme squishlike stores, and mlx_lm's own conversions (2- to 8-bit,
its mixed recipes and floating-point modes, float32 and bfloat16 scales, and its calibrated methods: GPTQ, AWQ,
dynamic quantization, DWQ), against the unquantized reference, on the shipped evaluation prose; every row with its
bytes at rest and its bits a weight, with --pareto the KL-against-bits-a-weight chart (an SVG, and the CSV of its
points), and with --targets issue 33's bars (see benchmarks/README.md, "Bits per weight: the curve").

    PYTHONPATH=. LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/quality.py --workdir /tmp/squishlike-quality --json quality.json

(PYTHONPATH=.: this checkout's squishlike rather than whichever one is installed; the script re-executes itself
with OpenBLAS preloaded when it finds it, so the LD_PRELOAD is optional).

Model: the embedded SmolLM2-135M-Instruct GGUF, or --model (a name of benchmarks/real_models.py such as
gemma3-270m, or any model squishlike reads); reference: that model as the provider reads it (a GGUF dequantized,
float32; "Q4_1" in the reference row's label is SmolLM2's). Every model is evaluated in float32
(`evaluate.prepare_for_eval`) with the same code as `squishlike eval`: perplexity over the first --max-tokens tokens of data/eval_prose.txt (1024-token windows), teacher-forced top-1
agreement and mean KL(reference || model) on the same positions, greedy agreement over data/eval_prompts.json.
Calibration (AWQ, GPTQ, mixed precision, the INT3 gate; mlx_lm's calibrated methods too, whose command lines
download their own data sets) uses data/calibration.txt only. npy-dirs are read through the
cold tier: every tier of one npy-dir holds the same weights (tests/integration/test_tiers.py, tests/integration/test_quality.py).

Rows are built in --workdir (one per model by default) and reused when already there (delete the directory to
rebuild). --rows selects rows whose slug contains a selector, or equals it when it ends in "$".
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

EXACT = {"quantize_embeddings": False}  # the embedding and the head kept exact (the default before issue 25)
PLAIN = {"awq": False, "gptq": False, "clip_search": False}  # round to nearest, no calibration
ROWS: list[tuple[str, str, dict]] = [
    # (label, kind, options) -- kind: reference | npydir (compress options) | mlx (export -q options) |
    # mlx_lm (mlx_lm.convert -q options, from the GGUF exported to HF) | mlx_lm_METHOD (mlx_lm.quant's METHOD,
    # see CALIBRATED)
    ("reference (GGUF Q4_1 as read, float32)", "reference", {}),
    ("mlx_lm 8-bit g64 (convert -q, float32 scales)", "mlx", {"q_bits": 8, "q_group_size": 64}),
    ("mlx_lm 8-bit g64 (convert -q --dtype bfloat16)", "mlx_lm", {"q_bits": 8, "q_group_size": 64, "dtype": "bfloat16"}),
    ("INT8 default (g64, embeddings INT8)", "npydir", {"scheme": "int8"}),
    ("INT8 g32", "npydir", {"scheme": "int8", "group_size": 32, **EXACT}),
    ("INT8 g64, embeddings exact", "npydir", {"scheme": "int8", "group_size": 64, **EXACT}),
    ("INT8 g128", "npydir", {"scheme": "int8", "group_size": 128, **EXACT}),
    ("INT8 g64, float16 runtime", "npydir", {"scheme": "int8", "group_size": 64, "dtype": "float16", **EXACT}),
    ("INT8 g64, float32 runtime", "npydir", {"scheme": "int8", "group_size": 64, "dtype": "float32", **EXACT}),
    ("INT8 per-row", "npydir", {"scheme": "int8", "group_size": "row", **EXACT}),
    ("INT8 per-row AWQ", "npydir", {"scheme": "int8", "group_size": "row", "awq": True, **EXACT}),
    ("INT8 per-row, mixed 20 %", "npydir", {"scheme": "int8", "group_size": "row", "mixed_precision": 0.2, **EXACT}),
    ("INT8 per-row, mixed 50 %", "npydir", {"scheme": "int8", "group_size": "row", "mixed_precision": 0.5, **EXACT}),
    ("INT8 per-row, mixed 85 %", "npydir", {"scheme": "int8", "group_size": "row", "mixed_precision": 0.85, **EXACT}),
    ("mlx_lm 4-bit g64 (convert -q, float32 scales)", "mlx", {"q_bits": 4, "q_group_size": 64}),
    ("mlx_lm 4-bit g64 (convert -q --dtype bfloat16)", "mlx_lm", {"q_bits": 4, "q_group_size": 64, "dtype": "bfloat16"}),
    ("mlx_lm 4-bit g64 GPTQ (mlx_lm.quant.gptq)", "mlx_lm_gptq", {"bits": 4, "group_size": 64}),
    ("mlx_lm 4-bit g64 AWQ, 10-point grid (mlx_lm.quant.awq)", "mlx_lm_awq",
     {"bits": 4, "group_size": 64, "n_grid": 10}),
    *((f"mlx_lm {b}-bit g64 DWQ, 18 steps (mlx_lm.quant.dwq)", "mlx_lm_dwq", {"bits": b, "group_size": 64})
      for b in (4, 3)),
    ("INT4 default (g64, AWQ+GPTQ+clip, embeddings INT4)", "npydir", {"scheme": "int4"}),
    ("INT4 default + scale refit", "npydir", {"scheme": "int4", "refit_scales": True}),
    ("INT4 default, tied matrix on the head's inputs alone (no lookup)", "npydir",
     {"scheme": "int4", "gptq_tied_lookup": False}),
    ("INT4 g64 RTN", "npydir", {"scheme": "int4", **PLAIN}),
    ("INT4 g64 clip", "npydir", {"scheme": "int4", **PLAIN, "clip_search": True}),
    ("INT4 g64 AWQ+clip", "npydir", {"scheme": "int4", "gptq": False}),
    ("INT4 g64 GPTQ+clip", "npydir", {"scheme": "int4", "awq": False}),
    ("INT4 g64 RTN, embeddings exact", "npydir", {"scheme": "int4", **PLAIN, **EXACT}),
    ("INT4 g64 AWQ+clip, embeddings exact", "npydir", {"scheme": "int4", "gptq": False, **EXACT}),
    ("INT4 g64 AWQ+clip, embeddings exact, mixed 10 %", "npydir",
     {"scheme": "int4", "gptq": False, "mixed_precision": 0.1, **EXACT}),
    ("INT3 g64 RTN", "npydir", {"scheme": "int3", "group_size": 64}),
    ("INT3 g32 AWQ+clip", "npydir", {"scheme": "int3", "group_size": 32, "awq": True, "clip_search": True}),
    *((f"INT3 g64 AWQ+GPTQ+clip{extra}", "npydir", {"scheme": "int3", "group_size": 64, "awq": True, "gptq": True,
                                                      "clip_search": True, "int3_gate": False, **options})
      for extra, options in (("", {}), (" + scale refit", {"refit_scales": True}))),
]

# Issue 33's curve: mean KL against real bits per weight, a family of rows per method. mlx_lm's rows are in bfloat16
# as a user's convert makes them, so b-bit g64 costs b + 0.5 bits a weight (a bfloat16 scale and bias per 64).
BITS_ROWS = [(f"mlx_lm {b}-bit g64 (convert -q --dtype bfloat16)", "mlx_lm",
              {"q_bits": b, "q_group_size": 64, "dtype": "bfloat16"}) for b in (2, 3, 5, 6)]
RECIPE_ROWS = [(f"mlx_lm {recipe} g64 (convert -q --quant-predicate {recipe} --dtype bfloat16)", "mlx_lm",
                {"quant_predicate": recipe, "q_group_size": 64, "dtype": "bfloat16"})
               for recipe in ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")]

# mlx_lm's floating-point modes: their own group sizes and uint8 scales, no biases (mxfp4 4.25 bits a weight, nvfp4
# 4.5, mxfp8 8.25)
FP_ROWS = [(f"mlx_lm {mode} (convert -q --q-mode {mode} --dtype bfloat16)", "mlx_lm",
            {"q_mode": mode, "dtype": "bfloat16"}) for mode in ("mxfp4", "nvfp4", "mxfp8")]


def dynamic_widths(target: float) -> tuple[int, int]:
    """The two widths dynamic_quant mixes for a target: the pair whose g64 costs (low + 0.5 .. high + 0.5 bits a
    weight) hold it; a target on a boundary takes the pair that starts there, so it comes out all the lower width."""
    low = max(2, math.floor(target - 0.5))
    return low, low + 1


DYNAMIC_ROWS = [(f"mlx_lm dynamic {low}/{high}-bit g64 at {t:g} bits a weight (mlx_lm.quant.dynamic_quant)",
                 "mlx_lm_dynamic", {"bits": low, "group_size": 64, "high_bits": high, "high_group_size": 64,
                                    "target_bpw": t})
                for t in (2.5, 3, 3.5, 4, 4.5, 5, 6) for low, high in [dynamic_widths(t)]]
# squishlike's --bpw (each tensor 2..8 bits by measured sensitivity): the 4.5 row measures the sensitivities, the
# others plan theirs from its store (--sensitivity-from), as a user asking for a second size would
BPW_MEASURED = "squishlike --bpw 4.5"
BPW_ROWS = [(BPW_MEASURED, "npydir", {"bpw": 4.5}),
            *((f"squishlike --bpw {t:g}", "npydir", {"bpw": t, "sensitivity_from": BPW_MEASURED})
              for t in (2.5, 3, 3.5, 4, 5, 6, 8)),
            *((f"squishlike --bpw {t:g} + scale refit", "npydir",
               {"bpw": t, "sensitivity_from": BPW_MEASURED, "refit_scales": True}) for t in (3, 3.5, 4.5)),
            # issue 43: the written store's scales and offsets distilled end to end (docs/design.md §7.7)
            *((f"squishlike --bpw {t:g} --distill-steps 32", "npydir",
               {"bpw": t, "sensitivity_from": BPW_MEASURED, "distill_steps": 32}) for t in (3, 3.5))]
# Issue 43's rotations (compress --rotate hadamard): the same rows with the source rotated first, the --bpw ones
# planned from their own measured row (sensitivities measured on the rotated weights)
ROTATED = {"rotate": "hadamard"}
BPW_ROTATED = "squishlike --bpw 4.5 --rotate hadamard"
ROTATED_ROWS = [("INT4 g64 RTN, rotated", "npydir", {"scheme": "int4", **PLAIN, **ROTATED}),
                ("INT4 default, rotated", "npydir", {"scheme": "int4", **ROTATED}),
                (BPW_ROTATED, "npydir", {"bpw": 4.5, **ROTATED}),
                *((f"squishlike --bpw {t:g} --rotate hadamard", "npydir",
                   {"bpw": t, **ROTATED, "sensitivity_from": BPW_ROTATED}) for t in (2.5, 3, 3.5, 4))]
# --rotate heads: each head's values alone, the tied head kept tied (no bytes for a head of its own)
HEADS = {"rotate": "heads"}
BPW_HEADS = "squishlike --bpw 4.5 --rotate heads"
ROTATED_ROWS += [("INT4 g64 RTN, heads rotated", "npydir", {"scheme": "int4", **PLAIN, **HEADS}),
                 (BPW_HEADS, "npydir", {"bpw": 4.5, **HEADS}),
                 *((f"squishlike --bpw {t:g} --rotate heads", "npydir",
                    {"bpw": t, **HEADS, "sensitivity_from": BPW_HEADS}) for t in (2.5, 3, 3.5))]
ROWS += BITS_ROWS + RECIPE_ROWS + FP_ROWS + DYNAMIC_ROWS + BPW_ROWS + ROTATED_ROWS

# The --targets summary: the bits a weight at which squishlike must beat mlx_lm, the bytes window ("within 2 % of
# the same real bytes") and the bar (0.8x the best mlx_lm model's KL in that window)
TARGETS = (3, 3.5, 4, 4.5, 5, 6)
WINDOW = 0.02
BAR = 0.8


def slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label.lower()).strip("_")


def weights_bytes(path: Path, kind: str) -> int:
    """Bytes of weights at rest: the GGUF file, the npy-dir's tensors/, the MLX directory's safetensors."""
    if kind == "reference":
        return path.stat().st_size
    if kind == "npydir":
        return sum(p.stat().st_size for p in (path / "tensors").iterdir())
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def tensor_bytes(path: Path, kind: str) -> int:
    """Bytes of the stored tensors alone (values, scales, biases, exact tensors; no file headers, padding or
    metadata): what mlx_lm's compute_bits_per_weight counts, read from the files. An npy-dir's parts as its
    manifest records them, an MLX directory's safetensors entries, the GGUF's tensors."""
    if kind == "reference":
        import gguf

        return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    if kind == "npydir":
        manifest = json.loads((path / "manifest.json").read_text())
        return sum(part["size"] for entry in manifest["tensors"].values() for part in entry["files"].values())
    total = 0
    for file in path.glob("*.safetensors"):
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(end - start for name, entry in header.items() if name != "__metadata__"
                     for start, end in [entry["data_offsets"]])
    return total


def dir_bytes(path: Path) -> int:
    """Bytes of every file of the model (an npy-dir is read cold, so it holds no cache)."""
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


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
        if "sensitivity_from" in options:  # a row's label -> its store
            options = {**options, "sensitivity_from": workdir / slug(options["sensitivity_from"])}
        squishlike.compress(gguf, out, **options)
    elif kind == "mlx":
        export(gguf, "mlx", out, quantize=True, **options)  # bit for bit what mlx_lm.convert writes
    else:
        import mlx_lm

        hf = workdir / "hf-export"
        if not hf.exists():
            export(gguf, "hf", hf)
        if kind == "mlx_lm":
            mlx_lm.convert(str(hf), str(out), quantize=True, **options)
        elif kind == "mlx_lm_dynamic":
            # The sensitivities depend only on the two widths: one gradient pass per pair, reused by every target
            # (what the command line's --sensitivities file is for)
            pair = f"{options['bits']}g{options['group_size']}-{options['high_bits']}g{options['high_group_size']}"
            sensitivities = workdir / f"dynamic-sensitivities-{pair}.json"
            mlx_lm_calibrated("dynamic", hf, out, **options, sensitivities=sensitivities)
        else:
            mlx_lm_calibrated(kind.removeprefix("mlx_lm_"), hf, out, **options)
    return out, time.perf_counter() - started


def mlx_lm_calibrated(method: str, hf: Path, out: Path, bits: int, group_size: int, **options) -> None:
    """mlx_lm's own calibrated quantization (mlx_lm.quant: gptq, awq, dynamic or dwq), through the Python functions its
    command lines call, which take the calibration tokens as an argument: squishlike's calibration text, since those
    command lines download a calibration text, which this machine cannot. Weights it leaves unquantized otherwise
    (the embedding) at the same bits and group size, so its bytes are convert -q's. Float32 passes, then everything
    in bfloat16."""
    import mlx.core as mx
    from mlx_lm.utils import load, save

    from squishlike.evaluation import load_text

    model, tokenizer, config = load(str(hf), lazy=True, return_config=True)
    tokens = tokenizer.encode(load_text("calibration"))
    model, config = CALIBRATED[method](model, config, tokens, bits, group_size, **options)
    model.set_dtype(mx.bfloat16)  # scales, biases and norms in bfloat16, as convert -q --dtype bfloat16 keeps them
    save(str(out), str(hf), model, tokenizer, config)


def sequences(tokens: list[int], length: int):
    """The tokens as rows of `length` (the remainder dropped): an mx.array [rows, length]."""
    import mlx.core as mx

    return mx.array(tokens[: len(tokens) // length * length]).reshape(-1, length)


def _gptq(model, config: dict, tokens: list[int], bits: int, group_size: int):
    from mlx_lm.quant.gptq import gptq_quantize

    model, config["quantization"] = gptq_quantize(model, sequences(tokens, 512), bits, group_size, bits, group_size)
    return model, config


def _awq(model, config: dict, tokens: list[int], bits: int, group_size: int, n_grid: int):
    """AWQ's scale search and clipping per block, as its command line runs them but on an `n_grid`-point grid (its
    default 20 took over a minute a block on 2 cores: 37 minutes for SmolLM2's 30), the embedding at the same bits
    and group size."""
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize, update_config

    awq_quantize(model, sequences(tokens, 512), AWQ_MODEL_CONFIGS[config["model_type"]], group_size=group_size,
                 bits=bits, embed_group_size=group_size, embed_bits=bits, n_grid=n_grid)
    return model, update_config(model, config)


def _dynamic(model, config: dict, tokens: list[int], bits: int, group_size: int, high_bits: int,
             high_group_size: int, target_bpw: float, sensitivities: Path):
    """Dynamic quantization: each layer's sensitivity (the gradient of the KL to the unquantized model on the
    calibration sequences), then the most sensitive at `high_bits` until `target_bpw`, as its command line does.
    The sensitivities are read from the file `sensitivities` when it is there, else computed and written there.
    They are computed in float32, where mlx[cpu]'s matmuls are BLAS's (its bfloat16 gradient pass took over 7
    minutes here, float32's 1.5); the threshold is searched in bfloat16, the dtype the bits a weight are counted
    in when saved."""
    import mlx.core as mx
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities, estimate_threshold
    from mlx_lm.utils import quantize_model

    if not sensitivities.exists():
        model.set_dtype(mx.float32)
        found = estimate_sensitivities(model, sequences(tokens, 512), bits, group_size, high_bits, high_group_size)
        sensitivities.write_text(json.dumps(found))
    by_layer = dict(json.loads(sensitivities.read_text()))
    model.set_dtype(mx.bfloat16)
    threshold = estimate_threshold(model, by_layer, target_bpw, bits, group_size, high_bits, high_group_size)

    def predicate(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        return {"bits": high_bits, "group_size": high_group_size} if by_layer[path] > threshold else True

    return quantize_model(model, config, group_size=group_size, bits=bits, quant_predicate=predicate)


DWQ_LENGTH = 256  # tokens a DWQ training sample holds: the calibration text cut into 9 of them
DWQ_EPOCHS = 2  # passes over those samples (18 steps of one sample)
DWQ_RATE = 2.8e-5  # Adam's rate: steps x rate = its command line's 512 steps x 1e-6 (within 2 %)


def _dwq(model, config: dict, tokens: list[int], bits: int, group_size: int):
    """Distilled weight quantization (mlx_lm.quant.dwq's dwq_quantize): the model rounded to nearest, then its
    scales and biases trained by Adam on the KL (temperature 2) between its logits and the float model's on the
    calibration text. Its command line takes 2,048 samples of 1,024 tokens from a downloaded data set (512 steps of
    4, rate 1e-6); here the calibration text's 9 samples of DWQ_LENGTH tokens, DWQ_EPOCHS times over, one a step,
    at DWQ_RATE. The teacher's logits are computed in float32 at each step (its command line's
    --target-dir keeps the top 1,024 of each). The student trains in float32, its quantized layers computed as
    their dequantized weights times the input (the same function and gradients: mlx[cpu]'s quantized matmul took
    over 4 minutes for one 256-token validation pass, float32 BLAS takes seconds), and is saved in bfloat16 as
    every other row; dwq_quantize's validation loss, which only reports, runs on one training sample."""
    import copy

    import mlx.core as mx
    import mlx.optimizers as optimizers
    import numpy as np
    from mlx_lm.quant.dwq import dwq_quantize
    from mlx_lm.utils import quantize_model

    from squishlike.calibration.distill import dense_products, teacher_logits

    model.set_dtype(mx.float32)
    samples = [(row.tolist(), 0) for row in np.array(sequences(tokens, DWQ_LENGTH))]
    student = copy.deepcopy(model)
    _, config = quantize_model(student, config, group_size=group_size, bits=bits)
    layers = dense_products(student)
    targets = teacher_logits(model)

    dwq_quantize(student, targets, optimizers.Adam(learning_rate=DWQ_RATE, bias_correction=True),
                 samples * DWQ_EPOCHS, samples[:1], batch_size=1, max_seq_length=DWQ_LENGTH + 1, seed=0,
                 dtype=mx.float32)
    for layer in layers:
        layer.__class__ = layer.__class__.__base__
    return student, config


# mlx_lm.quant's methods: (model, config) -> (the quantized model, its config saying how).
CALIBRATED = {"gptq": _gptq, "awq": _awq, "dynamic": _dynamic, "dwq": _dwq}


def selects(selector: str, row_slug: str) -> bool:
    """A --rows selector: a part of the row's slug, or the whole of it when it ends in "$"."""
    return row_slug == selector[:-1] if selector.endswith("$") else selector in row_slug


def evaluate_rows(args) -> tuple[list[dict], list[tuple[str, str]]]:
    """Every selected row built and evaluated; the rows skipped (a --bpw row compress cannot build), with why."""
    import mlx.core as mx

    from mlx_lm.utils import get_total_parameters

    import squishlike
    from squishlike import evaluation as ev
    from benchmarks.real_models import model_path
    from squishlike.default_model import default_model_path

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    gguf = model_path(args.model, workdir) if args.model else default_model_path()
    selected = [r for r in ROWS if not args.rows or any(selects(s, slug(r[0])) for s in args.rows)]

    built, skipped = {}, []
    for label, kind, options in selected:
        print(f"== building {label}", file=sys.stderr, flush=True)
        try:
            built[label] = build(label, kind, options, gguf, workdir)
        except (TypeError, ValueError) as e:
            # A --bpw row compress cannot build: a compress without the option yet (issue 33; UnknownOptionError is
            # a TypeError), or a target below the smallest store it can write (BudgetError, a ValueError)
            if "bpw" not in options:
                raise
            skipped.append((label, str(e).split(";")[0]))  # the reason, without the list of valid options
            print(f"   skipped: {e}", file=sys.stderr, flush=True)

    reference, tokenizer = ev.load_float32(gguf)
    params = get_total_parameters(reference)  # the denominator of bits per weight, the same for every row
    windows = ev.token_windows(tokenizer, ev.load_text("eval_prose"), max_tokens=args.max_tokens)
    cache = ev.ReferenceCache(reference, windows)
    prompts = ev.load_prompts()
    ref_greedy = ev.greedy_generations(reference, tokenizer, prompts, args.gen_tokens)
    del reference

    results = []
    for label, kind, options in selected:
        if label not in built:
            continue
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
        row["tensor_bytes"] = tensor_bytes(path, kind)
        row["parameters"] = params
        row["bpw"] = row["tensor_bytes"] * 8 / params
        row["dir_bytes"] = dir_bytes(path)
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
              f"greedy {row['greedy_agreement']:.3f}  {row['bpw']:.3f} bits a weight", file=sys.stderr, flush=True)
    return results, skipped


def markdown(results: list[dict], skipped: list[tuple[str, str]], args) -> str:
    from squishlike.evaluation import load_prompts

    ref = next((r for r in results if r["kind"] == "reference"), None)
    # The baseline of the ratio columns: mlx_lm's 4-bit in bfloat16 (what mlx-community models hold) if measured
    mlx = next((r for kind in ("mlx_lm", "mlx") for r in results
                if r["kind"] == kind and r["options"].get("q_bits") == 4), None)
    lines = [
        f"Model: {args.model or 'SmolLM2-135M-Instruct (embedded GGUF)'}; "
        "reference = the model as the provider reads it (float32). "
        f"Text: first {results[0]['positions'] + results[0]['windows']} tokens of data/eval_prose.txt "
        f"({results[0]['positions']} scored positions); greedy: {len(load_prompts())} prompts x {args.gen_tokens} "
        f"tokens. All in float32.",
        "",
        "| model | bits a weight | ppl | Δ ppl | Δ vs mlx_lm 4-bit | top-1 | KL (nats) | KL vs mlx_lm 4-bit | greedy "
        "| tensors | weights at rest | every file | compress | INT3 gate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
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
        kl_rel = f"{r['kl_mean'] / mlx['kl_mean']:.2f}x" if mlx and r["kind"] != "reference" else ""
        took = f"{r['compress_s']:.0f} s" if r.get("compress_s") else ""
        lines.append(
            f"| {r['label']} | {r['bpw']:.3f} | {r['perplexity']:.3f} | {inc / base:+.2%} | {rel} | "
            f"{r['top1_agreement']:.2%} | {r['kl_mean']:.4f} | {kl_rel} | {r['greedy_agreement']:.1%} | "
            f"{r['tensor_bytes'] / 1e6:.2f} MB | {r['weights_bytes'] / 1e6:.2f} MB | {r['dir_bytes'] / 1e6:.2f} MB | "
            f"{took} | {gate} |"
        )
    lines += ["", "Bits a weight: the stored tensors' bytes (values, scales, biases, exact tensors) x 8 / "
              f"{results[0]['parameters']:,} parameters (mlx_lm's compute_bits_per_weight); tensors: those bytes; "
              "weights at rest: their files; every file: the whole directory."]
    for reason in dict.fromkeys(why for _, why in skipped):
        lines += ["", f"Not built ({reason}): {', '.join(label for label, why in skipped if why == reason)}."]
    return "\n".join(lines)


def targets(results: list[dict]) -> list[dict]:
    """Issue 33's bars: for each target, squishlike's --bpw row's tensor bytes (target x parameters / 8 while
    that row is missing), the best (lowest KL) mlx_lm model whose tensor bytes are within WINDOW of them, and
    BAR x its KL, which squishlike's KL must not exceed."""
    summary = []
    for t in TARGETS:
        ours = next((r for r in results if r["kind"] == "npydir" and r["options"].get("bpw") == t), None)
        budget = ours["tensor_bytes"] if ours else t * results[0]["parameters"] / 8
        near = [r for r in results if r["kind"].startswith("mlx") and abs(r["tensor_bytes"] / budget - 1) <= WINDOW]
        best = min(near, key=lambda r: r["kl_mean"], default=None)
        summary.append({"target": t, "bytes": budget, "squishlike": ours, "best": best,
                        "bar": BAR * best["kl_mean"] if best else None})
    return summary


def targets_markdown(summary: list[dict]) -> str:
    lines = [f"| target (bits a weight) | bytes compared | best mlx_lm model within {WINDOW:.0%} | its bits a weight "
             f"| its KL | bar ({BAR}x) | squishlike --bpw KL | met |",
             "|---:|---:|---|---:|---:|---:|---:|:---:|"]
    for s in summary:
        best, ours = s["best"], s["squishlike"]
        basis = f"{s['bytes'] / 1e6:.2f} MB" + ("" if ours else " (target x parameters / 8)")
        mlx = f"{best['label']} | {best['bpw']:.3f} | {best['kl_mean']:.4f} | {s['bar']:.4f}" if best else \
            "none within the window | | |"
        met = ("yes" if ours["kl_mean"] <= s["bar"] else "no") if ours and best else ""
        kl = f"{ours['kl_mean']:.4f}" if ours else "not measured"
        lines.append(f"| {s['target']:g} | {basis} | {mlx} | {kl} | {met} |")
    return "\n".join(lines)


def family(row: dict) -> str | None:
    """The curve a row is a point of on the chart (None: a point on its own)."""
    kind, options = row["kind"], row["options"]
    if kind == "npydir" and "bpw" in options:
        if "rotate" in options:
            return f"squishlike --bpw --rotate {options['rotate']}"
        return "squishlike --bpw" + (", scale refit" if options.get("refit_scales") else "") + (
            ", distilled" if options.get("distill_steps") else "")
    if kind == "mlx_lm" and "quant_predicate" in options:
        return "mlx_lm mixed recipes"
    if kind == "mlx_lm" and "q_bits" in options:
        return "mlx_lm uniform g64"
    if kind == "mlx_lm_dynamic":
        return "mlx_lm dynamic_quant"
    return None


FAMILY_COLOURS = {"squishlike --bpw": "#1f77b4", "squishlike --bpw, scale refit": "#e377c2",
                  "squishlike --bpw, distilled": "#17becf",
                  "squishlike --bpw --rotate hadamard": "#9467bd", "squishlike --bpw --rotate heads": "#8c564b",
                  "mlx_lm uniform g64": "#d62728", "mlx_lm mixed recipes": "#ff7f0e", "mlx_lm dynamic_quant": "#2ca02c"}


def pareto(results: list[dict], csv_path: Path) -> Path:
    """Real bits a weight against mean KL, every row but the reference: the points as CSV (every file's bytes
    beside), and beside it an SVG chart (written directly: no plotting library). Returns the SVG's path."""
    rows = [r for r in results if r["kind"] != "reference"]
    header = "label,kind,family,bpw,tensor_bytes,weights_bytes,dir_bytes,kl_mean,perplexity,top1\n"
    csv_path.write_text(header + "".join(
        f"\"{r['label']}\",{r['kind']},{family(r) or ''},{r['bpw']:.4f},{r['tensor_bytes']},{r['weights_bytes']},"
        f"{r['dir_bytes']},{r['kl_mean']:.6f},{r['perplexity']:.4f},{r['top1_agreement']:.4f}\n" for r in rows))
    svg = csv_path.with_suffix(".svg")
    svg.write_text(svg_chart(rows))
    return svg


def svg_chart(rows: list[dict], width: int = 1100, height: int = 640, margin: int = 70) -> str:
    """Real bits a weight across, mean KL down the side on a log scale: a line through each family's points
    (legend top right), squishlike's other stores as circles and mlx_lm's other models as squares, each labelled
    (a family's points up to the label's parenthesis)."""
    xs = [r["bpw"] for r in rows]
    ys = [math.log10(max(r["kl_mean"], 1e-9)) for r in rows]
    x0, x1 = math.floor(min(xs)), math.ceil(max(xs))
    y0, y1 = math.floor(min(ys)), math.ceil(max(ys))

    def at(x: float, y: float) -> tuple[float, float]:
        return (margin + (x - x0) / ((x1 - x0) or 1) * (width - 2 * margin),
                height - margin - (y - y0) / ((y1 - y0) or 1) * (height - 2 * margin))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="9"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="13">mean KL to the reference against bits '
           f'a weight (stored tensors\' bytes x 8 / parameters)</text>']
    for e in range(y0, y1 + 1):  # a gridline per decade of KL
        _, y = at(x0, e)
        out.append(f'<line x1="{margin}" y1="{y:.1f}" x2="{width - margin}" y2="{y:.1f}" stroke="#ddd"/>'
                   f'<text x="{margin - 6}" y="{y + 3:.1f}" text-anchor="end">1e{e}</text>')
    for value in range(x0, x1 + 1):  # a gridline per bit
        x, _ = at(value, y0)
        out.append(f'<line x1="{x:.1f}" y1="{margin}" x2="{x:.1f}" y2="{height - margin + 4}" stroke="#ddd"/>'
                   f'<text x="{x:.1f}" y="{height - margin + 16}" text-anchor="middle">{value}</text>')
    out.append(f'<text x="{width / 2}" y="{height - 20}" text-anchor="middle">bits a weight</text>'
               f'<text x="16" y="{height / 2}" transform="rotate(-90 16 {height / 2})" text-anchor="middle">'
               f'mean KL (nats, log scale)</text>'
               f'<rect x="{margin}" y="{margin}" width="{width - 2 * margin}" height="{height - 2 * margin}" '
               f'fill="none" stroke="black"/>')
    for i, (name, colour) in enumerate(FAMILY_COLOURS.items()):
        points = sorted((x, y) for r, x, y in zip(rows, xs, ys) if family(r) == name)
        if points:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in (at(x, y) for x, y in points))
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        lx, ly = width - margin - 170, margin + 16 + 14 * i
        out.append(f'<line x1="{lx}" y1="{ly - 3}" x2="{lx + 20}" y2="{ly - 3}" stroke="{colour}" stroke-width="2"/>'
                   f'<text x="{lx + 26}" y="{ly}" fill="{colour}">{html.escape(name)}</text>')
    for r, value, kl in zip(rows, xs, ys):
        x, y = at(value, kl)
        colour = FAMILY_COLOURS.get(family(r), "#1f77b4" if r["kind"] == "npydir" else "#7f7f7f")
        mark = (f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{colour}"/>' if r["kind"] == "npydir" else
                f'<rect x="{x - 3.5:.1f}" y="{y - 3.5:.1f}" width="7" height="7" fill="{colour}"/>')
        text = r["label"] if family(r) is None else r["label"].split(" (")[0]  # the legend names the method
        out.append(f'{mark}<text x="{x + 6:.1f}" y="{y + 3:.1f}" fill="{colour}">{html.escape(text)}</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="the model instead of the embedded SmolLM2: a name of "
                        "benchmarks/real_models.py (gemma3-270m) or a path to any model squishlike reads")
    parser.add_argument("--workdir", help="where the models are built (reused); default "
                        "/tmp/squishlike-quality, with -MODEL after it for --model")
    parser.add_argument("--max-tokens", type=int, default=2048, help="evaluate on the first N tokens of the prose")
    parser.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--rows", nargs="*",
                        help="only rows whose slug contains one of these (or equals one ending in $)")
    parser.add_argument("--json", type=Path, help="write the full results here")
    parser.add_argument("--markdown", type=Path, help="write the table here (else stdout only)")
    parser.add_argument("--pareto", type=Path,
                        help="write bits a weight against KL here (CSV, and an SVG chart beside it)")
    parser.add_argument("--targets", action="store_true",
                        help="add issue 33's bars: at each target bits a weight, the best mlx_lm model's KL x 0.8")
    parser.add_argument("--clean", action="store_true", help="delete --workdir first")
    args = parser.parse_args(argv)
    args.workdir = args.workdir or "/tmp/squishlike-quality" + (f"-{Path(args.model).stem}" if args.model else "")

    from squishlike.environment import switch
    from squishlike.openblas import find_openblas

    blas = find_openblas()
    if blas and blas not in os.environ.get("LD_PRELOAD", "") and switch("SQUISHLIKE_OPENBLAS"):
        env = dict(os.environ, LD_PRELOAD=blas, SQUISHLIKE_OPENBLAS="0")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if args.clean:
        shutil.rmtree(args.workdir, ignore_errors=True)

    started = time.perf_counter()
    results, skipped = evaluate_rows(args)
    table = markdown(results, skipped, args)
    if args.targets:
        table += "\n\n" + targets_markdown(targets(results))
    command = "python benchmarks/quality.py " + " ".join(sys.argv[1:])
    print(table)
    print(f"\n({time.perf_counter() - started:.0f} s; command: {command})", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"command": command, "rows": results, "skipped": skipped}, indent=1))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.pareto:
        pareto(results, args.pareto)
    return 0


if __name__ == "__main__":
    sys.exit(main())
