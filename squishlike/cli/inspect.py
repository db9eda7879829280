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
    lines[1] += f" format {store['format_version']}: {store['scheme'].upper()} store, runtime {store['runtime_dtype']}"
    widths = ", ".join(f"{count} {scheme}" for scheme, count in store["widths"].items())
    lines[3] += f" ({widths}), {store['bits_per_weight']:.3f} bits per weight"
    for i, (name, tier) in enumerate(report["tiers"].items()):
        size = megabytes(tier["bytes"]) if tier["bytes"] else ""
        policy = "in policy" if tier["wanted"] else ""
        lines.append(f"  {'tiers' if i == 0 else '':12}  {name:10} {size:>10}  {policy:9}  {tier['state']}")
    lines.append(f"  {'':12}  {'cold':10} {'':>10}  {'':9}  always ready: dequantizes the store")
    lines.append(f"  load takes    {report['load']['tier']}: {report['load']['reason']}")
    memory = report["memory"]
    lines.append(f"  memory        {megabytes(memory['resident_load'])} loaded whole" + (
        f"; {megabytes(memory['experts'])} of it in {memory['expert_stacks']} expert stacks, streamed from the "
        f"store under a max_memory of {megabytes(memory['least_max_memory'])} or more" if memory["experts"] else ""))
    key_width = max(map(len, report["rank_caches"]), default=0)  # layout keys grow with the split
    for i, (key, share) in enumerate(report["rank_caches"].items()):
        size = megabytes(share["bytes"])
        lines.append(f"  {'rank shares' if i == 0 else '':12}  {key:{key_width}} {size:>10}  {share['state']}")
    gate = store["int3_gate"]
    if store["scheme"] == "int3" and not gate.get("passed"):
        lines.append(f"  no 3-bit tier: {gate.get('reason', 'the INT3 accuracy gate was not passed')}")
    return lines


NOTE_WIDTH = 24  # the narrowest the note column gets: a reason wrapped narrower would be a column of words


def tensor_table(report: dict, width: int) -> list[str]:
    """One row per tensor: name, stored dtype, shape, size, and for an npy-dir the relative error and cosine of
    a quantized tensor or why it is kept exact. Names are never cut: the note column takes the rest of `width`,
    its words wrapped onto indented lines (at least NOTE_WIDTH wide: a terminal narrower than that scrolls)."""
    import textwrap

    from tqdm import tqdm

    quality = report.get("quality", {})
    rows = []
    for t in report["tensors"]:
        q = quality.get(t["canonical"], {})
        note = f"{q['rel_error']:.2%} / {q['cosine']:.5f}" if "rel_error" in q else q.get("reason", "")
        size = tqdm.format_sizeof(t["nbytes"], "B", divisor=1000)
        dtype = q["layout"] if q.get("group_size") else t["dtype"]  # a group size not the store's: named
        rows.append([t["canonical"], dtype, "x".join(map(str, t["shape"])), size, note])
    header = ["tensor", "dtype", "shape", "size", "rel. error / cosine" if quality else ""]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    indent = sum(widths) + 2 * 4
    note_width = max(NOTE_WIDTH, width - indent)
    lines = []
    for name, dtype, shape, size, note in [header, *rows]:
        line = f"{name:{widths[0]}}  {dtype:{widths[1]}}  {shape:>{widths[2]}}  {size:>{widths[3]}}"
        first, *rest = textwrap.wrap(note, note_width, break_long_words=False, break_on_hyphens=False) or [""]
        lines.append(f"{line}  {first}".rstrip())
        lines += [" " * indent + more for more in rest]
    return lines
