"""Check a model on disk as far as its format allows: every checksum of an npy-dir and of its ready tiers, the
sha256 digest of every blob of an Ollama model; GGUF and safetensors record no checksums, so for them the headers
and that every tensor reads. Names every file that is wrong and exits 1 when any is."""

from __future__ import annotations

import argparse

HELP = "check a model's checksums (npy-dir, Ollama) or structure (GGUF, safetensors)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="npy-dir, model directory, .gguf file, Ollama manifest or name:tag")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    import json

    from ..info import verify_report

    report = verify_report(args.path)
    problems = report["problems"]
    if args.json:
        print(json.dumps({**report, "ok": not problems}, indent=1))
    else:
        for line in problems:
            print(line)
        verdict = "OK" if not problems else f"{len(problems)} problem(s)"
        version = f" format {report['format_version']}" if "format_version" in report else ""
        print(f"{report['path']}: {verdict} ({report['format']}{version}: {report['checked']})")
    return 1 if problems else 0
