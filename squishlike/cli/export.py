"""Read any model the provider reads and write it as an HF safetensors directory, an MLX directory (optionally
quantized, flags as `mlx_lm convert`), or into an Ollama store."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "write a model as an HF, MLX or Ollama model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..dtypes import MX_DTYPES
    from ..formats import EXPORT_TARGETS
    from ..formats.mlx import MODE_DEFAULTS

    parser.add_argument("src", help="model to export: a directory, a .gguf file, or an Ollama name:tag")
    parser.add_argument("--to", required=True, choices=EXPORT_TARGETS, help="output format")
    parser.add_argument("-o", "--output", required=True, type=Path,
                        help="output directory (for --to ollama: the store root, e.g. ~/.ollama/models)")
    parser.add_argument("-q", "--quantize", action="store_true", help="quantize the weights (mlx, ollama)")
    parser.add_argument("--q-bits", type=int, default=None,
                        help="bits per weight (default: 4 for affine, and a layer the source stores as an affine "
                        "triple, a mixed store's, keeps its own bits and group size)")
    parser.add_argument("--q-group-size", type=int, default=None, help="group size (default: 64 for affine)")
    parser.add_argument("--q-mode", default="affine", choices=list(MODE_DEFAULTS), help="quantization mode")
    parser.add_argument("--ollama-name", default=None, help="model name for --to ollama (name[:tag])")
    parser.add_argument("--dtype", choices=list(MX_DTYPES),
                        help="cast the float weights (default: as the source reads; a dequantized GGUF reads float32)")
    parser.add_argument("--force", action="store_true", help="replace an existing output")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    import json

    from ..exporter import export

    out = export(
        args.src, args.to, args.output,
        quantize=args.quantize, q_bits=args.q_bits, q_group_size=args.q_group_size, q_mode=args.q_mode,
        force=args.force, ollama_name=args.ollama_name, dtype=args.dtype,
    )
    if args.json:
        print(json.dumps({"source": args.src, "to": args.to, "output": str(out.absolute()), "dtype": args.dtype,
                          "quantize": args.quantize}, indent=1))
    else:
        print(out)
    return 0
