"""The writer's checkpoints (docs/format.md §8): a writer killed mid-block and reopened keeps the blocks of its last
checkpoint, drops what came after, and the store it then finishes is the one a writer that never stopped writes,
byte for byte. A journal that cannot be trusted is refused with a typed error, and no published store holds one.

The tensors are real: those of the store kept from the format-1 writer, re-added block by block as compress adds
them. The kill is a real SIGKILL of a child process, at the fault point after the first bytes of a pack reach disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.fixtures import FORMAT1_STORE
from support.tiny_models import assert_same_weights

import squishlike
from squishlike.errors import JournalError
from squishlike.npydir import NpyDir, NpyDirWriter, TensorEntry
from squishlike.npydir.packs import block_of
from squishlike.npydir.writer import JOURNAL

REPO = Path(__file__).resolve().parents[2]

# The child: write the store from FORMAT1_STORE's tensors into ARGV[1], block by block with a checkpoint after
# each (compress's calls), reopening the directory first when ARGV[2] is "resume".
WRITE_BLOCKS = f"""
import sys
sys.path.insert(0, {str(REPO / 'tests')!r})
from pathlib import Path
from reliability.test_writer_resume import write_store
write_store(Path(sys.argv[1]), resume=sys.argv[2] == "resume")
"""


def blocks(store: NpyDir) -> list[list[str]]:
    """The store's tensors grouped as compress adds them: the layers in order, then the rest."""
    groups: dict[str | None, list[str]] = {}
    for name in store.entries:
        groups.setdefault(block_of(name), []).append(name)
    return [groups[b] for b in sorted(groups, key=lambda b: (b is None, int(b.split(".")[-2]) if b else 0))]


def write_store(out: Path, resume: bool = False) -> None:
    source = NpyDir(FORMAT1_STORE)
    if resume:
        writer = NpyDirWriter.reopen(out, source.runtime_dtype)
    else:
        out.mkdir()
        writer = NpyDirWriter(out, source.runtime_dtype)
    for block in blocks(source):
        if all(name in writer.tensors for name in block):
            continue  # finished before the interruption
        for name in block:
            old = source.entry(name)
            entry = TensorEntry(old.key, old.source_name, old.shape, old.dtype, old.scheme, old.reason,
                                group_size=old.group_size, scale_dtype=old.scale_dtype, error=old.error)
            parts = {suffix: np.array(source.load_part(name, suffix)) for suffix in old.kind.suffixes}
            if old.kind.quantized:
                writer.add_tensor(name, entry, parts, None, source.runtime_dtype)
            else:
                writer.add_tensor(name, entry, None, parts["pt"], old.stored_dtype)
        writer.checkpoint()
    for rel in source.manifest.side_files:
        shutil.copyfile(FORMAT1_STORE / rel, out / rel)
    writer.add_side_files([out / rel for rel in source.manifest.side_files])
    m = source.manifest
    writer.write_manifest(model_type=m.model_type, naming=m.naming, scheme=m.scheme, group_size=m.group_size,
                          clip_search=m.clip_search, source=m.source, policy=m.policy, extra=m.extra)


def child(out: Path, mode: str, **fault: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **fault}
    return subprocess.run([sys.executable, "-c", WRITE_BLOCKS, str(out), mode], env=env, capture_output=True,
                          text=True, timeout=300)


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def in_one_go(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one-go") / "store"
    write_store(out)
    return out


def test_a_writer_killed_mid_block_resumes_to_the_same_store(in_one_go, tmp_path):
    out = tmp_path / "store"
    # killed once the first bytes of the second layer's pack are on disk: layer 0 was checkpointed, layer 1 was not
    killed = child(out, "new", SQUISHLIKE_FAULT_AT="write:pack-00001.safetensors", SQUISHLIKE_FAULT_ACTION="kill")
    assert killed.returncode == -9, killed.stderr
    assert (out / "tensors" / "pack-00001.safetensors").exists()  # the interrupted block's partial pack
    journal = json.loads((out / JOURNAL).read_text())
    assert set(journal["packs"]) == {"tensors/pack-00000.safetensors"}
    assert {block_of(name) for name in journal["tensors"]} == {"layers.0."}

    reopened = NpyDirWriter.reopen(out, "bfloat16")
    assert set(reopened.tensors) == set(blocks(NpyDir(FORMAT1_STORE))[0])  # exactly the checkpoint's
    assert sorted(p.name for p in (out / "tensors").iterdir()) == ["pack-00000.safetensors"]

    resumed = child(out, "resume")
    assert resumed.returncode == 0, resumed.stderr
    assert tree(out) == tree(in_one_go)  # every pack and the manifest, byte for byte; no journal left
    model, _ = squishlike.load(out, tier="cold")
    reference, _ = squishlike.load(FORMAT1_STORE, tier="cold")
    assert_same_weights(model, reference)


def test_a_published_store_holds_no_journal(in_one_go):
    assert not (in_one_go / JOURNAL).exists()
    assert NpyDir(in_one_go).version == 2


def test_reopen_without_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "tensors").mkdir()
    with pytest.raises(JournalError, match=JOURNAL):
        NpyDirWriter.reopen(tmp_path, "bfloat16")


@pytest.mark.parametrize("damage", ["not json", "another dtype", "a pack missing", "a pack of another size",
                                    "an offset moved", "another version"])
def test_a_journal_that_disagrees_with_the_directory_is_refused(in_one_go, tmp_path, damage):
    out = tmp_path / "store"
    out.mkdir()
    writer = NpyDirWriter(out, "bfloat16")
    source = NpyDir(in_one_go)
    for name in blocks(source)[0]:
        entry = source.entry(name)
        parts = {suffix: np.array(source.load_part(name, suffix)) for suffix in entry.kind.suffixes}
        fresh = TensorEntry(entry.key, entry.source_name, entry.shape, entry.dtype, entry.scheme, entry.reason,
                            group_size=entry.group_size, scale_dtype=entry.scale_dtype)
        writer.add_tensor(name, fresh, parts if entry.kind.quantized else None, parts.get("pt"),
                          entry.stored_dtype or "bfloat16")
    writer.checkpoint()
    NpyDirWriter.reopen(out, "bfloat16")  # as written: resumable
    journal = json.loads((out / JOURNAL).read_text())
    dtype = "bfloat16"
    if damage == "not json":
        (out / JOURNAL).write_text("{")
    elif damage == "another dtype":
        dtype = "float16"
    elif damage == "a pack missing":
        (out / "tensors" / "pack-00000.safetensors").unlink()
    elif damage == "a pack of another size":
        with open(out / "tensors" / "pack-00000.safetensors", "ab") as f:
            f.write(b"\0")
    elif damage == "an offset moved":
        entry = next(iter(journal["tensors"].values()))
        next(iter(entry["files"].values()))["offset"] += 16384
        (out / JOURNAL).write_text(json.dumps(journal))
    elif damage == "another version":
        (out / JOURNAL).write_text(json.dumps({**journal, "journal_version": 99}))
    with pytest.raises(JournalError, match=JOURNAL):
        NpyDirWriter.reopen(out, dtype)
