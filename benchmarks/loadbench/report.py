"""A run's result as a Markdown table and a matplotlib bar chart (the `bench` extra; no chart without it)."""

from __future__ import annotations

from pathlib import Path

from .results import GB


def _table(header: str, align: str, rows: list[str]) -> list[str]:
    """A Markdown table after a blank line; nothing when there are no rows."""
    return ["", header, align, *rows] if rows else []


def markdown(result: dict) -> str:
    f = result["figures"]
    m = result["machine"]
    lines = [
        f"### {result['model']}: load times, each a whole fresh process ({result['runs']} runs per figure, "
        f"{'memory primed before each run' if result['primed'] else 'back to back'})",
        "",
        f"{m.get('cpus')} CPUs, {m.get('memory_gb', 0):.0f} GB, {m.get('platform')}, mlx {m.get('mlx')}, "
        f"mlx_lm {m.get('mlx_lm')}. Source: `{Path(result['source']).name}`.",
        "",
        "| figure | median s | min s | max s | vs mlx_lm.load | weights s | vs memory floor (weights / process) "
        "| cold read vs disk floor | peak RSS above the startup floor's | RSS / weight bytes | bytes on disk |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, fig in f.items():
        if fig["group"] not in ("warm", "first", "cold"):
            continue
        w = fig["wall_s"]
        speed = f"{fig['speedup_vs_mlx_lm']:.2f}x" if "speedup_vs_mlx_lm" in fig else ""
        weights = f"{fig['weights_s']['median']:.2f}" if "weights_s" in fig else ""
        vf = fig.get("vs_memory_floor")
        floor = f"{vf['weights']:.2f}x / {vf['process']:.2f}x" if vf else ""
        cr = fig.get("cold_read")
        cold = f"{cr['bytes_per_s'] / GB:.2f} GB/s ({cr['vs_disk_floor']:.2f}x)" if cr else ""
        rss = fig.get("rss_above_baseline")
        ratio = f"{rss / fig['weight_bytes']:.2f}" if rss and fig["weight_bytes"] else ""
        lines.append(f"| {fig['label']} | {w['median']:.2f} | {w['min']:.2f} | {w['max']:.2f} | {speed} | {weights} "
                     f"| {floor} | {cold} | {rss / GB if rss else 0:.2f} GB | {ratio} | "
                     f"{fig['bytes_on_disk'] / GB:.2f} GB |")
        if fig["group"] == "first" and "built_s" in fig and "mlx_lm" in f:  # the build a first load left running
            b = fig["built_s"]
            lines.append(f"| {fig['label']}: until its tier is on disk (built on a background thread) "
                         f"| {b['median']:.2f} | {b['min']:.2f} | {b['max']:.2f} "
                         f"| {f['mlx_lm']['wall_s']['median'] / b['median']:.2f}x | | | | | | |")
        if "disk_after" in fig:  # what the first load left on disk: the store plus every cache it wrote
            lines.append(f"| {fig['label']}: the directory after it (store plus caches) | | | | | | | | | "
                         f"| {fig['disk_after']['max'] / GB:.2f} GB |")
    lines += _table(
        "| in-process load (mlx_lm imported before) | median s | min s | max s | vs mlx_lm.load | whole process s |",
        "|---|---:|---:|---:|---:|---:|",
        [f"| {fig['label']} | {fig['wall_s']['median']:.2f} | {fig['wall_s']['min']:.2f} | {fig['wall_s']['max']:.2f} "
         f"| {fig.get('speedup_vs_mlx_lm', 0):.2f}x | {fig.get('process_s', {}).get('median', 0):.2f} |"
         for fig in f.values() if fig["group"] == "inproc"])
    lines += _table(
        "| to first token (load, 64-token prompt, one token) | to ready s | vs mlx_lm 4-bit | to first token s "
        "| vs mlx_lm 4-bit | tokens/s after it | vs mlx_lm 4-bit | peak RSS |", "|---|---:|---:|---:|---:|---:|---:|---:|",
        [f"| {fig['label']} | {fig['ready_s']['median']:.2f} | {fig.get('ready_speedup_vs_mlx_lm', 0):.2f}x "
         f"| {fig['wall_s']['median']:.2f} | {fig.get('speedup_vs_mlx_lm', 0):.2f}x "
         f"| {fig['tokens_per_s']['median']:.2f} | {fig.get('tokens_per_s_vs_mlx_lm', 0):.2f}x "
         f"| {max(r['rss_peak'] for r in fig['runs']) / GB:.2f} GB |"
         for fig in f.values() if fig["group"] == "ttft"])
    lines += _table(
        "| floor | read s (median / min / max) | GB/s | process s (median) | bytes |", "|---|---:|---:|---:|---:|",
        [f"| {fig['label']} | {fig['read_s']['median']:.2f} / {fig['read_s']['min']:.2f} / {fig['read_s']['max']:.2f} "
         f"| {fig['bytes_on_disk'] / fig['read_s']['median'] / GB:.2f} | {fig['wall_s']['median']:.2f} "
         f"| {fig['bytes_on_disk'] / GB:.2f} GB |" for fig in f.values() if fig["group"] in ("floor", "disk")])
    lines += _table(
        "| compress | median s (in process) | min / max | MB/s of bf16 source | process s | peak RSS above baseline |",
        "|---|---:|---:|---:|---:|---:|",
        [f"| {fig['label']} | {fig['compress_s']['median']:.2f} | {fig['compress_s']['min']:.2f} / "
         f"{fig['compress_s']['max']:.2f} | {fig['throughput_mb_s']:.0f} | {fig['wall_s']['median']:.2f} "
         f"| {fig['rss_above_baseline'] / GB:.2f} GB |" for fig in f.values() if fig["group"] == "compress"])
    lines += _table(
        "| first forward pass (after load, not in load time) | s | logits finite | argmax |", "|---|---:|:-:|---:|",
        [f"| {fig['label']} | {fig['forward'].get('forward_s') or 0:.2f} | {fig['forward'].get('finite')} "
         f"| {fig['forward'].get('argmax')} |" for fig in f.values() if "forward" in fig])
    if result.get("targets"):
        lines += ["", "| target | measured | limit | met |", "|---|---:|---:|:-:|"]
        for t in result["targets"]:
            unit = "" if t["unit"] == "x" else f" {t['unit']}"
            fmt = ".2f" if t["unit"] != "MB/s" else ".0f"
            limit = f"{t['limit']:{fmt}}{unit if unit else 'x'}" if t["limit"] is not None else ""
            met = "" if t["met"] is None else "yes" if t["met"] else "NO"
            lines.append(f"| {t['target']} | {t['measured']:{fmt}}{unit if unit else 'x'} | {limit} | {met} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    f = result["figures"]
    rows = [(fig["label"], fig["wall_s"], "floor" if key == "startup" else fig["group"]) for key, fig in f.items()
            if fig["group"] in ("warm", "inproc", "ttft", "first", "cold", "floor", "disk")]  # startup: a floor
    colors = {"warm": "#4c72b0", "inproc": "#8172b2", "ttft": "#c44e52", "first": "#dd8452", "cold": "#55a868",
              "floor": "#8c8c8c", "disk": "#b0b0b0"}
    fig, ax = plt.subplots(figsize=(10, 0.38 * len(rows) + 1.5))
    ys = list(range(len(rows)))[::-1]
    for y, (label, w, group) in zip(ys, rows):
        ax.barh(y, w["median"], color=colors[group],
                xerr=[[w["median"] - w["min"]], [w["max"] - w["median"]]], capsize=3)
        ax.text(w["max"] + 0.05, y, f"{w['median']:.2f} s", va="center", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.set_xlabel("seconds (median; bars: min-max): whole fresh process, in-process load, or to first token")
    ax.set_title(f"{result['model']}: load time (warm / in-process / first token / first load / evicted / floors)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
