"""Compress a model (HF safetensors dir, MLX dir, GGUF file, Ollama model, or a Hugging Face repo already in the
local cache) into an npy-dir that `squishlike.load` opens. Linear weights, embeddings and the output head are
quantized (INT4: calibrated with AWQ, GPTQ and clip search); norms, biases and outliers stay exact. A killed or
interrupted compress goes on from its last finished layer when run again with the same arguments."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "store a model compressed at rest (an npy-dir)"


def _group_size(text: str) -> int | str:
    from ..compress_options import ROW

    if text == ROW:
        return ROW
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"group size {text} is neither a number nor {ROW!r}") from None


def width_rule(text: str) -> tuple:
    """--bits PATTERN=N or PATTERN=N/G: one (pattern, bits[, group size]) rule; compress validates them."""
    pattern, sep, width = text.rpartition("=")
    numbers = width.split("/")
    if not (sep and pattern and len(numbers) <= 2 and all(n.isdigit() for n in numbers)):
        raise argparse.ArgumentTypeError(f"{text!r} is not PATTERN=BITS or PATTERN=BITS/GROUP_SIZE, e.g. "
                                         "'*.ffn.down.*=6' or '*.ffn.down.*=3/128'")
    return pattern, *map(int, numbers)


def tier_list(text: str) -> tuple[str, ...]:
    """--tiers: a comma-separated list naming at least one tier (leave the flag out for the default)."""
    tiers = tuple(t for t in text.split(",") if t)
    if not tiers:
        raise argparse.ArgumentTypeError("names no tier; leave --tiers out for the default")
    return tiers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..compress_options import ALL_TIERS, ROTATIONS, SCHEMES_OFFERED

    parser.add_argument("src", help="model directory, .gguf file, Ollama name:tag, or cached HF repo id")
    parser.add_argument("-o", "--output", required=True, type=Path,
                        help="output npy-dir (must not exist or be empty)")
    parser.add_argument("--scheme", "--format", dest="scheme", choices=SCHEMES_OFFERED, default=None,
                        help="quantization scheme for linear weights (default: int8; with --bpw each tensor's is "
                        "chosen); --format is its earlier name")
    parser.add_argument("--group-size", type=_group_size, default=64,
                        help="elements per scale along the input axis: 32, 64 (default) or 128 (int8, int4); "
                        "int8 also takes 'row', the per-row symmetric form")
    parser.add_argument("--passthrough", nargs="+", default=(), metavar="PATTERN",
                        help="canonical tensor names (glob) to keep exact, e.g. 'layers.0.*'")
    parser.add_argument("--bits", action="append", type=width_rule, default=[], metavar="PATTERN=N[/G]",
                        help="store the tensors whose canonical names match PATTERN (glob) at N bits: 2, 3, 4, 5, 6 "
                        "or 8, group-wise in groups of G (32, 64 or 128; default --group-size); repeatable, the "
                        "first match wins (mixed recipes, e.g. --bits '*.ffn.down.*=3/128' --bits '*=3')")
    parser.add_argument("--quantize-embeddings", action=argparse.BooleanOptionalAction, default=None,
                        help="quantize the embedding and lm_head with the linears' scheme, as mlx_lm.convert -q does "
                        "(default for int8 and int4); --no-quantize-embeddings keeps them exact, at about 2x the "
                        "bytes of a small INT4 store")
    parser.add_argument("--clip-search", action=argparse.BooleanOptionalAction, default=None,
                        help="group-wise schemes: per-group clip search (lower error, slower; default: on for int4)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="runtime dtype (default: the source's float dtype; bfloat16 for quantized sources)")
    parser.add_argument("--tiers", type=tier_list, metavar="LIST",
                        help=f"caches to build on first load, comma-separated from {','.join(ALL_TIERS)} "
                        "(default: mlx plus the store's quantized tier)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing npy-dir at OUTPUT (never a directory that is not an npy-dir)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    calib = parser.add_argument_group(
        "calibration", "these run the source model in float32 on the shipped calibration text, one layer at a time "
        "(memory does not grow with depth; on the GPU where there is one)"
    )
    calib.add_argument("--awq", action=argparse.BooleanOptionalAction, default=None,
                       help="activation-aware per-channel scaling (AWQ), folded into the norms; the stored form "
                       "stays plain INT8/INT4/INT3 (default: on for int4)")
    calib.add_argument("--gptq", action=argparse.BooleanOptionalAction, default=None,
                       help="error-compensating rounding (GPTQ) of the linears and the output head: each rounding "
                       "error is spread onto the columns not yet rounded; the stored form stays plain (default: on "
                       "for int4)")
    calib.add_argument("--gptq-embedding", action=argparse.BooleanOptionalAction, default=None,
                       help="GPTQ of an untied token embedding along its width, on the Hessian of what reads a "
                       "looked-up row in the first layer (found from the model) and of the residual path that carries "
                       "it on, read alike in every direction, as the head reads it, or both: whichever moves the "
                       "model's logits least on the first calibration window, measured; --no-gptq-embedding rounds "
                       "it with the clip search instead (default: on with GPTQ; docs/design.md §7.5)")
    calib.add_argument("--gptq-tied-lookup", action=argparse.BooleanOptionalAction, default=None,
                       help="a tied embedding (the output head too) is GPTQ'd on the head's calibration inputs and "
                       "that Hessian together, each weighed by what an error in its rows costs at the output, "
                       "measured; --no-gptq-tied-lookup: the head's inputs alone (default: on with GPTQ; "
                       "docs/design.md §7.5)")
    calib.add_argument("--refit-scales", action="store_true",
                       help="after GPTQ (which it turns on), solve each group's scale and offset again for GPTQ's "
                       "codes, by least squares on the layer's output error over the calibration inputs; the "
                       "stored form stays plain; its cost: docs/design.md §7.7 (default: off)")
    calib.add_argument("--mixed-precision", type=float, default=0.0, metavar="FRACTION",
                       help="keep the most sensitive tensors (measured) at more bits: at INT8 in an INT4/INT3 "
                       "store, exact (runtime dtype, passthrough) in an INT8 store; within FRACTION more bytes than "
                       "the quantized tensors take (e.g. 0.1)")
    calib.add_argument("--bpw", type=float, default=None, metavar="BITS",
                       help="a size target in bits per weight (what mlx_lm counts: every stored byte, scales "
                       "included, times 8 over the parameter count), e.g. 3.5: each linear, the embedding and the "
                       "head get the width among 2, 3, 4, 5, 6, 8 bits (or exact) that changes its layer's output "
                       "least, measured, within the target")
    calib.add_argument("--sensitivity-from", default=None, metavar="STORE",
                       help="with --bpw: plan the widths from the sensitivities a store of the same source measured "
                       "(its manifest keeps them) instead of measuring again: another size in a fraction of the time")
    calib.add_argument("--rotate", choices=ROTATIONS, default="none",
                       help="rotate the model before quantizing it, exactly (the float model computes the same "
                       "function): 'hadamard' multiplies the residual stream and each head's values by random "
                       "orthogonal Hadamard matrices folded into the weights (QuaRot/SpinQuant), which spreads "
                       "outlier channels so that low widths round better; the store stays plain layers of the same "
                       "architecture (a tied head gets its own copy, which --bpw pays for); 'heads' rotates each head's "
                       "values alone and keeps a tied head tied. Skipped, with the reason in the manifest, where a "
                       "family's layers do not commute with it (default: none)")
    calib.add_argument("--distill-steps", type=int, default=0, metavar="N",
                       help="once the store is written, train its scales and offsets (widths below 8 bits; codes "
                       "kept) for N steps against the float model's logits (mlx_lm's DWQ, one sample of 256 tokens a "
                       "step): each calibration sample twice, the rest text the float model writes itself (SmolLM2 "
                       "at 48 steps: 8,192 tokens); the stored form stays plain. Its cost: the float model's forward "
                       "pass and the store's forward and backward pass in float32 a step (SmolLM2: 15-20 s a step on "
                       "2 cores; docs/design.md §7.7). Group-wise stores only (int4, int3, --bpw, --bits) "
                       "(default: 0, off)")
    calib.add_argument("--distill-rate", type=float, default=6e-5, metavar="R",
                       help="with --distill-steps: Adam's learning rate (default: %(default)s)")
    calib.add_argument("--int3-max-ppl-increase", type=float, default=0.08, metavar="F",
                       help="INT3 accuracy gate: the store is written only if calibration perplexity rises by at "
                       "most F (a fraction: 0.08 is +8%%)")
    calib.add_argument("--calibration-tokens", dest="calibration_max_tokens", type=int, default=None, metavar="N",
                       help="use only the first N tokens of the calibration text (default: all)")
    # Decided once every option is parsed: a compress that runs the model in float32 restarts with OpenBLAS preloaded.
    parser.set_defaults(fast_blas=lambda args: _options(args).calibrates or args.rotate != "none"
                                                  or args.distill_steps > 0)


def _options(args: argparse.Namespace):
    from dataclasses import fields

    from ..compress_options import CompressOptions

    return CompressOptions(**{f.name: getattr(args, f.name) for f in fields(CompressOptions) if hasattr(args, f.name)})


def run(args: argparse.Namespace) -> int:
    import json

    from ..compressor import compress_with_report

    opts = _options(args)
    opts.check_tiers_fit_scheme()
    report = compress_with_report(args.src, args.output, opts)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.summary())
    return 0
