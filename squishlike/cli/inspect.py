"""Describe a model on disk: a summary first (format, architecture, size; for an npy-dir its tiers, ready or
stale, with their sizes, in this device's order, the tier `squishlike.load` takes here and why, and the shares
`squishlike.sharded_load` cached per layout under shards/), then a table of tensors fitted to the terminal.
--json prints everything, including each tensor's source name and an npy-dir's per-tensor error figures."""

from __future__ import annotations

import argparse
import shutil

HELP = "summary, tiers and tensor table of a model (npy-dir or any format squishlike reads)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="npy-dir, model directory, .gguf file, Ollama manifest or name:tag")
    parser.add_argument("--json", action="store_true", help="print the complete report as JSON")


def run(args: argparse.Namespace) -> int:
    import json

    from ..info import inspect_model

    report = inspect_model(args.path)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    width = shutil.get_terminal_size().columns
    print("\n".join(summary(report)))
    print()
    print("\n".join(tensor_table(report, width)))
    return 0


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def summary(report: dict) -> list[str]:
    cfg = report["config"]
    lines = [
        report["path"],
        f"  format        {report['format']}",
        f"  architecture  {report['architecture']}: {cfg.get('num_hidden_layers')} layers, "
        f"hidden {cfg.get('hidden_size')}, vocabulary {cfg.get('vocab_size')}",
        f"  size          {megabytes(report['bytes'])} in {len(report['tensors'])} tensors",
    ]
    if "store" not in report:
        return lines
    store = report["store"]
    lines[1] += f": {store['scheme'].upper()} store, runtime {store['runtime_dtype']}"
    for i, (name, tier) in enumerate(report["tiers"].items()):
        size = megabytes(tier["bytes"]) if tier["bytes"] else ""
        policy = "in policy" if tier["wanted"] else ""
        lines.append(f"  {'tiers' if i == 0 else '':12}  {name:10} {size:>10}  {policy:9}  {tier['state']}")
    lines.append(f"  {'':12}  {'cold':10} {'':>10}  {'':9}  always ready: dequantizes the store")
    lines.append(f"  load takes    {report['load']['tier']}: {report['load']['reason']}")
    key_width = max(map(len, report["rank_caches"]), default=0)  # layout keys grow with the split
    for i, (key, share) in enumerate(report["rank_caches"].items()):
        size = megabytes(share["bytes"])
        lines.append(f"  {'rank shares' if i == 0 else '':12}  {key:{key_width}} {size:>10}  {share['state']}")
    gate = store["int3_gate"]
    if store["scheme"] == "int3" and not gate.get("passed"):
        lines.append(f"  no 3-bit tier: {gate.get('reason', 'the INT3 accuracy gate was not passed')}")
    return lines


def tensor_table(report: dict, width: int) -> list[str]:
    """One row per tensor: name, stored dtype, shape, size, and for an npy-dir the relative error and cosine of
    a quantized tensor or why it is kept exact. The name and note columns shrink to fit `width`."""
    from tqdm import tqdm

    quality = report.get("quality", {})
    rows = []
    for t in report["tensors"]:
        q = quality.get(t["canonical"], {})
        note = f"{q['rel_error']:.2%} / {q['cosine']:.5f}" if "rel_error" in q else q.get("reason", "")
        size = tqdm.format_sizeof(t["nbytes"], "B", divisor=1000)
        rows.append([t["canonical"], t["dtype"], "x".join(map(str, t["shape"])), size, note])
    header = ["tensor", "dtype", "shape", "size", "rel. error / cosine" if quality else ""]
    fixed = [max(len(r[i]) for r in [header, *rows]) for i in (1, 2, 3)]
    name_width = max(16, min(max(len(r[0]) for r in [header, *rows]), width - sum(fixed) - 8 - 20))
    note_width = max(0, width - name_width - sum(fixed) - 8)
    lines = []
    for row in [header, *rows]:
        name, dtype, shape, size, note = row
        line = f"{fit(name, name_width):{name_width}}  {dtype:{fixed[0]}}  {shape:>{fixed[1]}}  {size:>{fixed[2]}}"
        lines.append(f"{line}  {fit(note, note_width)}".rstrip())
    return lines


def fit(text: str, width: int) -> str:
    """`text`, shortened in the middle to `width` characters when longer."""
    if len(text) <= width:
        return text
    keep = max(width - 1, 0)
    return text[: (keep + 1) // 2] + "…" + text[len(text) - keep // 2:] if keep else ""
