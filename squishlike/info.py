"""What `squishlike inspect` and `squishlike verify` report about a model on disk."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .errors import FormatError
from .formats import detect_format
from .formats.npydir import NpyDirReader
from .load.budget import memory_figures
from .npydir import NpyDir, TensorEntry, is_npydir
from .provider import WeightProvider, locate
from .tiers import ORDER, choice, ordered, tier_status
from .tiers.rank import RankTier


def inspect_model(path: str | Path) -> dict:
    """Format, architecture, size, config, tensor table; for an npy-dir also each tier's state and size, the
    tier `squishlike.load` takes now and why (`load`), each rank's cached share of a sharded load
    (`rank_caches`, by layout key) and the quality figures."""
    path = locate(path)
    with WeightProvider.open(path) as provider:
        tensors = [dict(row) for row in provider.listing()]
        report = {
            "path": str(path),
            "format": provider.format,
            "architecture": provider.config.model_type,
            "bytes": sum(row["nbytes"] for row in tensors),
            "config": provider.config.to_dict(),
            "tensors": tensors,
        }
    if is_npydir(path):
        store = NpyDir(path)
        status = tier_status(store)
        report["store"] = {
            "scheme": store.manifest.scheme,
            "format_version": store.version,
            "runtime_dtype": store.runtime_dtype,
            "bytes": sum(r.size for r in store.part_files().values()),
            "bits_per_weight": store.manifest.bits_per_weight(),
            # tensors per scheme (and group size), widest first: a mixed store's widths
            "widths": dict(Counter(layout(e, store.manifest.group_size) for e in sorted(
                store.entries.values(), key=lambda e: (-(e.kind.bits or 99), -(e.group_size or 0))))),
            "policy": store.manifest.policy.to_json(),
            "int3_gate": store.manifest.int3_gate or {"passed": False, "reason": "store is not INT3"},
        }
        report["memory"] = memory_figures(store)
        served, why = choice(store)
        report["load"] = {"tier": served, "reason": why}
        report["tiers"] = {
            tier.name: {"state": status[tier.name], "bytes": tier.disk_bytes(store), "wanted": tier.wanted(store)}
            for tier in ordered(ORDER)
        }
        report["rank_caches"] = {}
        for tier in RankTier.cached(store):
            payload, why = tier.ready(store)
            report["rank_caches"][tier.key] = {"state": "ready" if payload else why, "bytes": tier.disk_bytes(store)}
        report["quality"] = {
            name: {"scheme": e.scheme, "layout": layout(e, store.manifest.group_size), "group_size": e.group_size,
                   "reason": e.reason,
                   **(e.error.to_json() if e.error else {})}
            for name, e in store.entries.items()
        }
    return report


def layout(entry: TensorEntry, store_group_size: int) -> str:
    """How a tensor is stored, as inspect names it: its scheme, with its group size where that is not the store's
    (`int3/g128` in a store of groups of 64)."""
    if entry.kind.grouped and entry.group_size != store_group_size:
        return f"{entry.scheme}/g{entry.group_size}"
    return entry.scheme


def verify(path: str | Path) -> list[str]:
    """What verify_report finds wrong: [] when all is well."""
    return verify_report(path)["problems"]


def verify_report(path: str | Path) -> dict:
    """Check what the model's format allows: an npy-dir's and its tiers' checksums, an Ollama model's blob
    digests; a format without checksums (GGUF, safetensors) its structure. Returns path, format, `checked` (what
    was checked, in words) and `problems` ([] when all is well); a file too damaged to open is itself a problem,
    so a directory with a manifest.json is checked as an npy-dir even when that manifest is unreadable."""
    path = locate(path)
    reader_class = NpyDirReader if is_npydir(path, damaged=True) else detect_format(path)
    report = {"path": str(path), "format": reader_class.format_name, "checked": reader_class.verifies}
    try:
        reader = reader_class(path)
    except FormatError as e:
        return {**report, "problems": [str(e)]}
    with reader:
        problems = reader.verify()
        if isinstance(reader, NpyDirReader):
            report["format_version"] = reader.store.version
            problems += [p for tier in [*ORDER, *RankTier.cached(reader.store)] for p in tier.verify(reader.store)]
        return {**report, "problems": problems}
