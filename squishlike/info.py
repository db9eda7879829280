"""What `squishlike inspect` and `squishlike verify` report about a model on disk."""

from __future__ import annotations

from pathlib import Path

from .hub import resolve
from .npydir import NpyDir, is_npydir
from .provider import WeightProvider
from .io.checksum import verify_files
from .io.sentinel import read_sentinel
from .tiers import ORDER, choice, ordered, tier_status


def inspect_model(path: str | Path) -> dict:
    """Format, config, tensor table; for an npy-dir also each tier's state and size, and the quality figures."""
    path = resolve(path)
    with WeightProvider.open(path) as provider:
        report = {
            "path": str(path),
            "format": provider.format,
            "config": provider.config.to_dict(),
            "tensors": [dict(row) for row in provider.listing()],
        }
    if is_npydir(path):
        store = NpyDir(path)
        status = tier_status(store)
        report["store"] = {
            "scheme": store.manifest.scheme,
            "runtime_dtype": store.runtime_dtype,
            "bytes": sum(r.size for r in store.part_files().values()),
            "policy": store.manifest.policy.to_json(),
            "int3_gate": store.manifest.int3_gate or {"passed": False, "reason": "store is not INT3"},
        }
        served, why = choice(store)
        report["load"] = {"tier": served, "reason": why}
        report["tiers"] = {
            tier.name: {"state": status[tier.name], "bytes": tier.disk_bytes(store), "wanted": tier.wanted(store)}
            for tier in ordered(ORDER)
        }
        report["quality"] = {
            name: {"scheme": e.scheme, "reason": e.reason, **(e.error.to_json() if e.error else {})}
            for name, e in store.entries.items()
        }
    return report


def verify(path: str | Path) -> list[str]:
    """Re-read every file of the store and of each ready tier against its checksum. [] means all is well."""
    store = NpyDir(resolve(path))
    problems = verify_files(store.path, store.file_records())
    for tier in ORDER:
        sentinel = store.path / tier.sentinel
        payload, why = read_sentinel(sentinel, store.fingerprint)
        if payload is not None:
            problems += [f"tier {tier.name}: {p}" for p in verify_files(sentinel.parent, payload["files"])]
        elif sentinel.exists():
            problems.append(f"tier {tier.name}: {sentinel} does not count ({why})")
    return problems
