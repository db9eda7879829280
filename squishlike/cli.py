"""The `squishlike` command. Each subcommand is a thin layer over the Python API; `python -m squishlike` is the same.

Exit codes: 0 success, 1 a failure while working (disk full, corrupt data, busy directory), 2 a usage error
(bad option, missing or unknown model, output exists, tier not ready), as argparse itself does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import DirectoryBusyError, IntegrityError, SquishError

USAGE_ERRORS = (ValueError, FileNotFoundError, FileExistsError, SquishError)
RUNTIME_ERRORS = (IntegrityError, DirectoryBusyError)


def _tier_choices() -> list[str]:
    from .tiers import TIER_NAMES

    return TIER_NAMES


# ---------------------------------------------------------------------------------------------- compress


class _Calibrates(argparse.Action):
    """Stores an option; one that makes compress run the model in float32 (AWQ, mixed precision, the INT3 gate)
    also asks main() to restart with OpenBLAS preloaded (`fast_blas`), as eval does."""

    def __call__(self, parser, namespace, values, option_string=None):
        value = True if self.nargs == 0 else values
        setattr(namespace, self.dest, value)
        if value not in (False, 0, 0.0, "int8", "int4"):  # True, a fraction > 0, or "int3" (the gate)
            namespace.fast_blas = True


def add_compress(sub) -> None:
    from .compress_options import ALL_TIERS, FORMATS

    p = sub.add_parser(
        "compress",
        help="store a model compressed at rest (an npy-dir)",
        description="Compress a model (HF safetensors dir, MLX dir, GGUF file, Ollama model, or a Hugging Face repo "
        "already in the local cache) into an npy-dir that `squishlike.load` opens. Linear weights are "
        "quantized; embeddings, norms, biases and outliers stay exact.",
    )
    p.add_argument("src", help="model directory, .gguf file, Ollama name:tag, or cached HF repo id")
    p.add_argument("-o", "--output", required=True, type=Path, help="output npy-dir (must not exist or be empty)")
    p.add_argument("--format", choices=FORMATS, default="int8", action=_Calibrates,
                   help="scheme for linear weights (default: int8)")
    p.add_argument("--group-size", type=int, default=64, help="INT4/INT3 group size: 32, 64 (default) or 128 (int4)")
    p.add_argument("--passthrough", nargs="+", default=[], metavar="PATTERN",
                   help="canonical tensor names (glob) to keep exact, e.g. 'layers.0.*'")
    p.add_argument("--quantize-embeddings", action="store_true", help="quantize the embedding and lm_head too")
    p.add_argument("--clip-search", action="store_true", help="INT4/INT3: per-group clip search (lower error, slower)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="runtime dtype (default: the source's float dtype; bfloat16 for quantized sources)")
    p.add_argument("--tiers", type=lambda s: tuple(t for t in s.split(",") if t), metavar="LIST",
                   help=f"caches to build on first load, comma-separated from {','.join(ALL_TIERS)} "
                   "(default: mlx plus the store's quantized tier)")
    p.add_argument("--force", action="store_true", help="replace an existing npy-dir at OUTPUT")
    calib = p.add_argument_group("calibration", "these run the source model in float32 on the shipped calibration text")
    calib.add_argument("--awq", action=_Calibrates, nargs=0, default=False,
                       help="activation-aware per-channel scaling (AWQ), folded into the norms; the stored form "
                       "stays plain INT8/INT4/INT3")
    calib.add_argument("--mixed-precision", type=float, default=0.0, action=_Calibrates, metavar="FRACTION",
                       help="keep the most sensitive tensors (measured) at more bits: at INT8 in an INT4/INT3 "
                       "store, exact (runtime dtype, passthrough) in an INT8 store; within FRACTION more bytes than "
                       "the quantized tensors take (e.g. 0.1)")
    calib.add_argument("--int3-max-ppl-increase", type=float, default=0.08, metavar="F",
                       help="INT3 accuracy gate: the 3-bit tier is built only if calibration perplexity rises by at "
                       "most F (default 0.08, +8%%)")
    calib.add_argument("--calibration-tokens", type=int, default=None, metavar="N",
                       help="use only the first N tokens of the calibration text (default: all)")
    p.set_defaults(run=run_compress)


def run_compress(args) -> int:
    from .compressor import compress

    compress(
        args.src,
        args.output,
        format=args.format,
        group_size=args.group_size,
        passthrough=tuple(args.passthrough),
        quantize_embeddings=args.quantize_embeddings,
        clip_search=args.clip_search,
        dtype=args.dtype,
        tiers=args.tiers,
        force=args.force,
        awq=args.awq,
        mixed_precision=args.mixed_precision,
        int3_max_ppl_increase=args.int3_max_ppl_increase,
        calibration_max_tokens=args.calibration_tokens,
    )
    return 0


# ---------------------------------------------------------------------------------------------- generate


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text, in the spirit of `mlx_lm generate`",
                       description="Load a model with squishlike.load and generate a reply to a prompt.")
    p.add_argument("--model", required=True, help="npy-dir, or any model the provider reads")
    p.add_argument("--prompt", "-p", default="What is the capital of France?", help="the prompt")
    p.add_argument("--max-tokens", "-m", type=int, default=100, help="maximum tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--tier", choices=_tier_choices(), help="force a tier of an npy-dir")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt raw, without the chat template")
    p.set_defaults(run=run_generate)


def run_generate(args) -> int:
    import mlx.core as mx
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    from .loader import load

    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer = load(args.model, tier=args.tier)
    prompt = args.prompt
    if tokenizer.chat_template is not None and not args.no_chat_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    text = generate(model, tokenizer, prompt, max_tokens=args.max_tokens, sampler=make_sampler(args.temp))
    print(text)
    return 0


# ---------------------------------------------------------------------------------------------- inspect, verify


def add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="format, config, tensors, and an npy-dir's tiers and quality figures",
                       description="Describe a model on disk: its format, config and tensor table; for an npy-dir "
                       "also which tiers are present, ready or stale, their sizes, and per-tensor error.")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run_inspect)


def run_inspect(args) -> int:
    from .info import inspect_model

    report = inspect_model(args.path)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    cfg = report["config"]
    print(f"{report['path']}: {report['format']}, {cfg.get('model_type')}, {cfg.get('num_hidden_layers')} layers, "
          f"hidden {cfg.get('hidden_size')}")
    quality = report.get("quality", {})
    print(f"{'tensor':48} {'source name':48} {'dtype':>10} {'shape':>16} {'bytes':>12}  error")
    for row in report["tensors"]:
        q = quality.get(row["canonical"], {})
        err = f"{q['rel_error']:.4f} cos {q['cosine']:.5f}" if "rel_error" in q else q.get("reason", "")
        print(f"{row['canonical']:48} {row['source']:48} {row['dtype']:>10} {str(tuple(row['shape'])):>16} "
              f"{row['nbytes']:>12}  {err}")
    if "tiers" in report:
        store = report["store"]
        print(f"\nstore: {store['scheme']}, runtime {store['runtime_dtype']}, {store['bytes'] / 1e6:.1f} MB")
        for name, t in report["tiers"].items():
            print(f"  tier {name:10} {t['state']:40} {t['bytes'] / 1e6:10.1f} MB  {'(in policy)' if t['wanted'] else ''}")
        gate = store["int3_gate"]
        if not gate.get("passed"):
            print(f"  no 3-bit tier: {gate.get('reason', 'the INT3 accuracy gate was not passed')}")
    return 0


def add_verify(sub) -> None:
    p = sub.add_parser("verify", help="check every checksum of an npy-dir and its tiers",
                       description="Re-read every file of the store and of each ready tier against the checksums "
                       "in the manifest and sentinels; name every file that is wrong.")
    p.add_argument("path")
    p.set_defaults(run=run_verify)


def run_verify(args) -> int:
    from .info import verify

    problems = verify(args.path)
    for line in problems:
        print(line)
    print(f"{args.path}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


# ---------------------------------------------------------------------------------------------- eval


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="perplexity, and agreement with a reference model",
                       description="Perplexity on the shipped evaluation prose; against a reference model (default: "
                       "the source recorded in an npy-dir's manifest) also teacher-forced top-1 agreement, mean KL "
                       "divergence of next-token distributions, and greedy-generation agreement on fixed prompts. "
                       "Models are evaluated in float32 (with the system OpenBLAS preloaded when there is one).")
    p.add_argument("path", help="model to evaluate (npy-dir or any format the provider reads)")
    p.add_argument("--reference", help="reference model (default: the npy-dir's recorded source)")
    p.add_argument("--max-tokens", type=int, default=2048, help="evaluate on the first N tokens of the prose")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run_eval, fast_blas=True)


def run_eval(args) -> int:
    from .evaluation import evaluate, format_report

    result = evaluate(args.path, args.reference, max_tokens=args.max_tokens)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0


# ---------------------------------------------------------------------------------------------- export


def add_export(sub) -> None:
    from .exporter import add_export_arguments, run_export

    p = sub.add_parser("export", help="write a model as an HF, MLX or Ollama model",
                       description="Read any model the provider reads and write it as an HF safetensors directory, "
                       "an MLX directory (optionally quantized, flags as `mlx_lm convert`), or into an Ollama store.")
    add_export_arguments(p)
    p.set_defaults(run=run_export)


# ---------------------------------------------------------------------------------------------- bench


def add_bench(sub) -> None:
    summary = "load-time benchmark: every tier against mlx_lm.load, warm and cold"
    try:  # the benchmark is a harness beside the package (benchmarks/loadbench), not part of an installed wheel
        from benchmarks.loadbench import add_arguments, run
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", "benchmarks.loadbench"):
            raise
        # every argument, options and --help included, is taken as is: the answer is the same for all of them
        p = sub.add_parser("bench", help=summary, prefix_chars="+", add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER)
        p.set_defaults(run=run_bench_unavailable)
        return
    p = sub.add_parser("bench", help=summary,
                       description="Time whole fresh processes loading a model with mlx_lm.load and with each "
                       "squishlike tier, warm and with evicted pages, beside the memory and disk floors; print "
                       "medians, ratios and peak RSS as a Markdown table (and JSON / a PNG chart).")
    add_arguments(p)
    p.set_defaults(run=run)


def run_bench_unavailable(args) -> int:
    print("squishlike bench: the load benchmark ships with the source repository (benchmarks/loadbench), not with "
          "the installed package; run it from a checkout: python -m benchmarks.loadbench", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------- demo


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the main job: compress the embedded SmolLM2, load every tier, answer a question",
                       description="Offline end-to-end run on the embedded SmolLM2-135M: compress it to INT8 and "
                       "INT4, load it cold and then warm from each tier in fresh processes, answer a question, "
                       "and print load times beside mlx_lm.load of the same model.")
    p.add_argument("--workdir", type=Path, default=Path("squishlike-demo"), help="where the models go")
    p.add_argument("--repeats", type=int, default=3, help="fresh-process loads per figure (median reported)")
    p.set_defaults(run=run_demo)


def run_demo(args) -> int:
    from .demo import run_demo as demo

    demo(args.workdir, repeats=args.repeats)
    return 0


# ---------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="squishlike",
        description="Compressed-at-rest, tiered weight loader for MLX language models. "
        "`squishlike.load` is a drop-in for `mlx_lm.load`.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (add_compress, add_generate, add_inspect, add_verify, add_eval, add_export, add_bench, add_demo):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "fast_blas", False):  # float32 forward passes: 15x faster with the system OpenBLAS
        from .openblas import reexec_with_openblas

        reexec_with_openblas(argv)
    try:
        return args.run(args)
    except RUNTIME_ERRORS as e:
        print(f"squishlike: error: {e}", file=sys.stderr)
        return 1
    except USAGE_ERRORS as e:
        print(f"squishlike {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("squishlike: interrupted; nothing was left half-written", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"squishlike: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
