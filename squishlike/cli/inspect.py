"""Describe a model on disk: its format, config and tensor table; for an npy-dir also which tiers are present,
ready or stale, their sizes on disk (in this device's order), which one `load` takes here and why, and per-tensor
error."""

from __future__ import annotations

import argparse
import json

HELP = "format, config, tensors, and an npy-dir's tiers and quality figures"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from ..info import inspect_model

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
        print(f"  load takes tier {report['load']['tier']}: {report['load']['reason']}")
        gate = store["int3_gate"]
        if not gate.get("passed"):
            print(f"  no 3-bit tier: {gate.get('reason', 'the INT3 accuracy gate was not passed')}")
    return 0
