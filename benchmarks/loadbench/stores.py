"""The npy-dirs the benchmark loads: compressed once with their caches built, fresh clones for first loads, and
which files each tier reads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def _run_script(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"benchmark setup step failed:\n{code}\n{done.stderr[-4000:]}")


def prepare_store(source: Path, out: Path, fmt: str, with_finalized: bool) -> Path:
    """A compressed npy-dir (default cache policy) whose caches are built, plus the finalized tier if asked."""
    from squishlike.npydir import NpyDir, is_npydir
    from squishlike.tiers import tier_status

    ready = is_npydir(out) and str(NpyDir(out).manifest.source.path) == str(source.absolute())
    if not ready:
        # Round to nearest: a load reads the same files whatever calibration chose their values, and calibrating
        # the benchmark's random-weight 1.5B model would take far longer than every figure it serves.
        _run_script(f"import squishlike; squishlike.compress({str(source)!r}, {str(out)!r}, scheme={fmt!r}, "
                    "awq=False, gptq=False, clip_search=False, force=True)")
    store = NpyDir(out)
    status = tier_status(store)
    for tier in _policy_tiers(store):  # the first load builds only the one this device takes: force each
        if status[tier.name] != "ready":
            _run_script(f"import squishlike; squishlike.load({str(out)!r}, tier={tier.name!r})")
    if with_finalized and tier_status(NpyDir(out))["finalized"] != "ready":
        _run_script(
            "from squishlike.npydir import NpyDir\n"
            "from squishlike.tiers import BY_NAME, COLD\n"
            f"store = NpyDir({str(out)!r}); BY_NAME['finalized'].build(store, COLD.load_dense(store)[1])")
    return out


def _policy_tiers(store) -> list:
    from squishlike.tiers import ORDER

    return [t for t in ORDER if t.wanted(store)]


def fresh_clone(store: Path, dest: Path) -> Path:
    """A hard-linked copy of an npy-dir's at-rest part (manifest, side files, tensors/) with no tier caches."""
    from squishlike.npydir import MANIFEST, TENSORS, NpyDir

    if dest.exists():
        shutil.rmtree(dest)
    (dest / TENSORS).mkdir(parents=True)
    manifest = NpyDir(store).manifest
    for rel in [MANIFEST, *manifest.side_files]:
        os.link(store / rel, dest / rel)
    for f in (store / TENSORS).iterdir():
        os.link(f, dest / TENSORS / f.name)
    return dest


def reset_fresh(dest: Path) -> None:
    """Back to a fresh npy-dir: remove every cache and sentinel (never the hard-linked store files)."""
    from squishlike.npydir import MANIFEST, TENSORS, NpyDir

    keep = {MANIFEST, TENSORS, *NpyDir(dest).manifest.side_files}
    for p in dest.iterdir():
        if p.name not in keep:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def tier_files(store: Path, tier: str) -> list[Path]:
    """The files a load from `tier` reads (weights only; config and tokenizer files are a few MB)."""
    if tier == "mlx":
        return [store / "squish_weights.safetensors"]
    if tier in ("int4", "int8", "int3"):  # the built tier, or the store's parts it is read from (order.FROM_STORE)
        return sorted((store / f"squish_{tier[-1]}bit").glob("*.safetensors")) or tier_files(store, "cold")
    if tier == "finalized":
        return sorted((store / "finalized").glob("*.npy"))
    return sorted(p for p in (store / "tensors").iterdir() if p.is_file())  # the packs (format 1: each part's .npy)


def all_files(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).rglob("*") if p.is_file())


def source_files(source: Path) -> list[Path]:
    return sorted(Path(source).glob("model*.safetensors"))


def size(paths: list[Path]) -> int:
    return sum(os.path.getsize(p) for p in paths)
