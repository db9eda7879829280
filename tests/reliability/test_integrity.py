"""Integrity: `squishlike verify` checks every checksum and names what is wrong; load checks sizes and
headers cheaply, and a tier found damaged at load is skipped with a warning and rebuilt from the store.

Load does not re-hash the files of a tier it trusts (that would cost as much as the load): a sentinel binds them by
their identity (device, inode, size, mtime, ctime), which a load stats, and only a file whose identity changed (a
file replaced or rewritten, the store copied) is hashed before it is served. Damage that leaves the identity
alone (a bit flipped on the disk) is `verify`'s to find, and it does (test_verify_names_each_damaged_file).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
from support.crash_harness import (
    lab_fixture,
    load_in_process,
    lying_sentinels,
    ready_tiers,
    serving_tier,
    store_part,
)

from squishlike.errors import FormatError, IntegrityError
from squishlike.info import verify
from squishlike.io.checksum import CHECKSUM, FAST, HASHES, file_checksum, file_record
from squishlike.io.sentinel import IDENTITY, identity
from squishlike.npydir import NpyDir
from squishlike.tiers import ORDER, ordered

lab = lab_fixture()

# The lab's store (one layer, embeddings exact) in format 2: a pack per block, in the order compress adds them.
LAYER_PACK = "tensors/pack-00001.safetensors"  # layers.0.*
LAST_PACK = "tensors/pack-00002.safetensors"  # output_norm, output


@pytest.fixture
def built(lab, tmp_path) -> Path:
    """A copy of the clean build with every tier of its policy built."""
    return shutil.copytree(lab.root / "reference", tmp_path / "model")


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path, by: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:-by])


def set_sentinel(path: Path, **changes) -> None:
    payload = json.loads(path.read_text())
    payload.update(changes)
    path.write_text(json.dumps(payload))


def lie_about_size(sentinel: Path) -> None:
    payload = json.loads(sentinel.read_text())
    first = next(iter(payload["files"]))
    payload["files"][first]["size"] += 1
    sentinel.write_text(json.dumps(payload))


def cli(lab, tmp_path, *argv) -> tuple[int, str]:
    result = tmp_path / "cli.json"
    r = lab.server.run({"op": "cli", "argv": [str(a) for a in argv], "result": str(result)})
    out = json.loads(result.read_text())
    return r["code"], out["stdout"] + out["stderr"]


def test_verify_a_clean_model(lab, built, tmp_path):
    assert verify(built) == []
    assert ready_tiers(built) == {"int4": True, "int8": False, "int3": False, "mlx": True, "finalized": True}
    rc, text = cli(lab, tmp_path, "verify", built)
    assert rc == 0 and text.strip().startswith(f"{built}: OK (npydir format 2: checked the checksum of every file"), text


# (what is damaged, how, the file the report must name, words the report must contain)
DAMAGE = [
    ("store pack, bit flip", lambda m: flip(m / LAYER_PACK, -5), LAYER_PACK, "differs from the recorded checksum"),
    ("store pack, truncated", lambda m: truncate(m / LAYER_PACK), LAYER_PACK, "size"),
    ("store pack, missing", lambda m: (m / LAST_PACK).unlink(), LAST_PACK, "missing"),
    ("side file, bit flip", lambda m: flip(m / "tokenizer.json", 10), "tokenizer.json", "checksum"),
    ("mlx tier data, bit flip", lambda m: flip(m / "squish_weights.safetensors", -3),
     "squish_weights.safetensors", "tier mlx"),
    ("mlx tier, truncated", lambda m: truncate(m / "squish_weights.safetensors"),
     "squish_weights.safetensors: size differs", "tier mlx"),
    ("int4 tier weights, bit flip", lambda m: flip(m / "squish_4bit/model.safetensors", -7),
     "squish_4bit/model.safetensors", "tier int4"),
    ("int4 tier config, bit flip", lambda m: flip(m / "squish_4bit/config.json", 4),
     "squish_4bit/config.json", "tier int4"),
    ("finalized tier file, bit flip", lambda m: flip(m / "finalized/output.weight.npy", -1),
     "finalized/output.weight.npy", "tier finalized"),
    ("finalized tier file, missing", lambda m: (m / "finalized/output_norm.weight.npy").unlink(),
     "output_norm.weight.npy: missing", "tier finalized"),
    ("sentinel not JSON", lambda m: (m / ".squish_4bit_ready").write_text("{\"format_version\": 1,"),
     ".squish_4bit_ready", "not JSON"),
    ("sentinel empty", lambda m: (m / ".squish_ready").write_text(""), ".squish_ready", "does not count"),
    ("sentinel lies about a size", lambda m: lie_about_size(m / "finalized/.ready"), "finalized/.ready",
     "size differs"),
    ("sentinel of another manifest", lambda m: set_sentinel(m / ".squish_ready", manifest_fingerprint="0" * 64),
     ".squish_ready", "stale"),
    ("sentinel names a file outside", lambda m: set_sentinel(
        m / ".squish_ready", files={"../outside.bin": {"size": 3, "sha256": "0"}}), ".squish_ready", "outside"),
    ("sentinel of an unknown version", lambda m: set_sentinel(m / ".squish_4bit_ready", format_version=99),
     ".squish_4bit_ready", "version"),
]


@pytest.mark.parametrize("what,damage,names,words", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_verify_names_each_damaged_file(lab, built, tmp_path, what, damage, names, words):
    damage(built)
    problems = verify(built)
    assert len(problems) == 1, problems
    assert names in problems[0] and words in problems[0], problems
    assert str(built) in problems[0]
    rc, text = cli(lab, tmp_path, "verify", built)
    assert rc == 1 and names in text and "1 problem" in text, text


def test_verify_names_a_damaged_manifest(lab, built, tmp_path):
    (built / "manifest.json").write_text('{"format": "squishlike-npy-dir", "tensors": ')
    problems = verify(built)
    assert len(problems) == 1 and "manifest.json" in problems[0], problems
    rc, text = cli(lab, tmp_path, "verify", built)
    assert rc == 1 and "manifest.json" in text


def _make_first(model: Path, tier_name: str) -> None:
    """Unready every tier before `tier_name` in the decision order, so the load reaches it."""
    for tier in ordered(ORDER):
        if tier.name == tier_name:
            return
        (model / tier.sentinel).unlink(missing_ok=True)


# (tier, how its files are damaged, words of the warning)
AT_LOAD = [
    ("int4", lambda m: flip(m / "squish_4bit/model.safetensors", 20), "unreadable"),  # header bytes
    ("int4", lambda m: truncate(m / "squish_4bit/model.safetensors"), "size differs"),
    ("int4", lambda m: flip(m / "squish_4bit/config.json", 2), "unreadable"),
    ("mlx", lambda m: flip(m / "squish_weights.safetensors", 30), "unreadable"),
    ("mlx", lambda m: (m / "squish_weights.safetensors").unlink(), "missing"),
    ("finalized", lambda m: flip(m / "finalized/layers.0.ffn.up.weight.npy", 9), "unreadable"),
    ("finalized", lambda m: truncate(m / "finalized/token_embedding.weight.npy", 7), "size differs"),
]


@pytest.mark.parametrize("tier,damage,words", AT_LOAD, ids=[f"{t}-{w}-{i}" for i, (t, _, w) in enumerate(AT_LOAD)])
def test_damaged_tier_is_skipped_with_a_warning_and_rebuilt(lab, built, tier, damage, words):
    _make_first(built, tier)
    damage(built)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served, digest = load_in_process(built)
    messages = [str(w.message) for w in caught if f"tier {tier}" in str(w.message)]
    assert messages and words in messages[0] and str(built) in messages[0], [str(w.message) for w in caught]
    assert served == "cold" and digest == lab.weights  # never the damaged tier's weights
    # Rebuilt from the store: every tier of the policy is ready again and every checksum verifies.
    assert {k for k, v in ready_tiers(built).items() if v} == lab.built
    assert verify(built) == [] and not lying_sentinels(built) and store_part(built) == lab.store_digest
    served, digest = load_in_process(built)
    assert served == serving_tier(built) != "cold" and digest == lab.weights


def test_load_reads_no_tier_whose_size_is_wrong(lab, built):
    """Sizes are checked before a tier is used: a tier file one byte longer (appended garbage) is not loaded."""
    weights = {"int4": "squish_4bit/model.safetensors", "mlx": "squish_weights.safetensors"}[serving_tier(built)]
    with open(built / weights, "ab") as f:
        f.write(b"\0")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        served, digest = load_in_process(built)
    assert served == "cold" and digest == lab.weights


def test_damaged_store_part_fails_with_a_typed_error_naming_it(lab, tmp_path):
    """The cold path checks each pack's header against the layout the manifest gives its parts."""
    model = shutil.copytree(lab.pristine, tmp_path / "model")
    pack = model / LAYER_PACK
    data = bytearray(pack.read_bytes())
    data[8:9] = b"["  # the header is no JSON object any more
    pack.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=LAYER_PACK):
        load_in_process(model)
    assert not any(ready_tiers(model).values())  # nothing was built from it


def test_damaged_side_file_fails_with_a_typed_error(lab, built):
    (built / "tokenizer.json").write_bytes(b"\xff\xfe not a tokenizer")
    with pytest.raises(FormatError, match=str(built)):
        load_in_process(built)
    assert any("tokenizer.json" in p for p in verify(built))


# ---------------------------------------------------------------------------------------------- which hash checks what

PART = LAYER_PACK


def overwrite_two_bytes(path: Path, offset: int = -9) -> None:
    """Damage that keeps the size: two bytes of data changed in place."""
    data = bytearray(path.read_bytes())
    data[offset:offset + 2] = bytes(b ^ 0x5A for b in data[offset:offset + 2])
    path.write_bytes(bytes(data))


def edit_records(model: Path, edit) -> None:
    """edit(path relative to the store, record) for every file record of the manifest, written back."""
    path = model / "manifest.json"
    manifest = json.loads(path.read_text())
    records = {**manifest["side_files"], **manifest["packs"]}
    for rel, record in records.items():
        edit(rel, record)
    path.write_text(json.dumps(manifest))


def without_xxh3(lab, dest: Path) -> Path:
    """The clean store as a squishlike that recorded SHA-256 alone wrote it."""
    model = shutil.copytree(lab.pristine, dest)
    edit_records(model, lambda rel, record: record.pop(FAST))
    return model


def test_every_file_written_records_both_hashes(built):
    """Store files (hashed while written, or re-read for side files) and tier files (hashed while written) all
    record SHA-256 and XXH3, and each is the hash of the file as it lies on disk; tier files also record the
    identity of a file (io/sentinel.py; test_a_sentinel_binds_the_files_it_was_written_over)."""
    records = NpyDir(built).file_records()
    bound = set()
    for tier in ORDER:
        sentinel = built / tier.sentinel
        if sentinel.exists():
            payload = json.loads(sentinel.read_text())
            records.update({str(sentinel.parent.relative_to(built) / rel): r for rel, r in payload["files"].items()})
            bound |= {str(sentinel.parent.relative_to(built) / rel) for rel in payload["files"]}
    assert PART in records and "tokenizer.json" in records and "squish_weights.safetensors" in records
    for rel, record in records.items():
        if rel in bound:  # this copy's files are new ones: the identity recorded is that of the store copied
            bound_to = record.pop(IDENTITY)
            assert len(bound_to) == 5 and all(isinstance(n, int) for n in bound_to), rel
        assert set(record) == {"size", *HASHES} and len(record[FAST]) == 32, rel
        assert record == file_record(built / rel), rel


def test_first_load_catches_damage_with_the_fast_hash(lab, tmp_path):
    """Two bytes of a part overwritten and its recorded SHA-256 made to match them: only the XXH3 can tell,
    and the first load, which checks only that, fails naming the part."""
    model = shutil.copytree(lab.pristine, tmp_path / "model")
    overwrite_two_bytes(model / PART)
    edit_records(model, lambda rel, r: r.update({CHECKSUM: file_checksum(model / rel)}) if rel == PART else None)
    with pytest.raises(IntegrityError, match=f"{PART}: {FAST} differs"):
        load_in_process(model)
    assert not any(ready_tiers(model).values())  # nothing was built from it


def test_first_load_checks_sha256_only_when_asked(lab, tmp_path, monkeypatch):
    """A wrong SHA-256 beside a right XXH3: the plain first load does not read it (that is the time saved);
    SQUISHLIKE_VERIFY=1 and `verify` check every recorded hash and name the file."""
    model = shutil.copytree(lab.pristine, tmp_path / "model")
    edit_records(model, lambda rel, r: r.update({CHECKSUM: "0" * 64}) if rel == PART else None)
    monkeypatch.setenv("SQUISHLIKE_VERIFY", "1")
    with pytest.raises(IntegrityError, match=f"{PART}: {CHECKSUM} differs"):
        load_in_process(model)
    assert not any(ready_tiers(model).values())
    monkeypatch.delenv("SQUISHLIKE_VERIFY")
    served, digest = load_in_process(model)
    assert served == "cold" and digest == lab.weights
    problems = verify(model)
    assert len(problems) == 1 and PART in problems[0] and f"{CHECKSUM} differs" in problems[0], problems


def test_a_store_without_xxh3_loads_and_is_checked_with_sha256(lab, tmp_path):
    old = without_xxh3(lab, tmp_path / "old")
    served, digest = load_in_process(old)
    assert served == "cold" and digest == lab.weights
    assert verify(old) == []
    served, digest = load_in_process(old)  # the tier its first load built
    assert served == serving_tier(old) != "cold" and digest == lab.weights

    damaged = without_xxh3(lab, tmp_path / "damaged")
    overwrite_two_bytes(damaged / PART)
    with pytest.raises(IntegrityError, match=f"{PART}: {CHECKSUM} differs"):
        load_in_process(damaged)
    assert not any(ready_tiers(damaged).values())


# ---------------------------------------------------------------------------------------------- identities


def bound(store: Path) -> dict[str, bool]:
    """Each ready tier (and rank share): whether its sentinel records the identity of every file it names as the
    file has it now (nothing for a load to hash)."""
    from squishlike.io.sentinel import moved
    from squishlike.tiers.rank import RankTier

    found = {}
    for tier in [*ORDER, *RankTier.cached(NpyDir(store))]:
        payload, _ = tier.ready(NpyDir(store))
        if payload is not None and tier.name != "cold":
            found[tier.sentinel] = moved(store / tier.sentinel, payload) == {}
    return found


def test_a_sentinel_binds_the_files_it_was_written_over(lab, tmp_path):
    """Every tier a first load writes (dense ones on its background thread), and a rank share, records the
    identity its files have once published: the next load stats them and hashes nothing."""
    from squishlike.load.sharded import sharded_load
    from squishlike.tiers.background import wait_for_builds

    store = shutil.copytree(lab.pristine, tmp_path / "model")
    load_in_process(store)
    wait_for_builds()
    sharded_load(store)
    found = bound(store)
    assert set(found) == {".squish_4bit_ready", ".squish_ready", "finalized/.ready", "shards/tensor-1-0/.ready"}
    assert all(found.values()), found


@pytest.mark.parametrize("how", ["cp -a", "cp"])
def test_a_copied_store_is_hashed_once_then_bound_to_its_new_files(lab, tmp_path, how):
    """A store copied with its tiers (`cp -a` keeps mtimes but not inodes, `cp` keeps neither): its sentinels
    name files with other identities. The first load hashes the files of the tier it serves, finds them intact,
    serves them without a warning and records their new identities; the next load only stats them."""
    copy = shutil.copy2 if how == "cp -a" else shutil.copy
    store = shutil.copytree(lab.root / "reference", tmp_path / "model", copy_function=copy)
    serving = serving_tier(store)
    sentinel = next(t.sentinel for t in ORDER if t.name == serving)
    assert not bound(store)[sentinel]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_in_process(store) == (serving, lab.weights)
    assert bound(store)[sentinel]
    assert verify(store) == []


def test_a_copied_store_whose_lock_is_held_is_hashed_at_each_load(lab, tmp_path):
    """Where the tier's lock cannot be had at once (a writer holds it; a read-only store), a load that hashed a
    moved file serves it without waiting, and records nothing: the next load hashes it again."""
    from squishlike.io.lock import DirectoryLock

    store = shutil.copytree(lab.root / "reference", tmp_path / "model")
    serving = serving_tier(store)
    sentinel = store / next(t.sentinel for t in ORDER if t.name == serving)
    before = sentinel.read_bytes()
    with DirectoryLock(store):
        for _ in range(2):
            assert load_in_process(store) == (serving, lab.weights)
            assert sentinel.read_bytes() == before
    assert load_in_process(store) == (serving, lab.weights)
    assert bound(store)[str(sentinel.relative_to(store))]


def test_a_file_rewritten_in_place_with_its_mtime_set_back_is_hashed(lab, built):
    """The recorded identity holds the ctime, which no one can set back: a tier file rewritten in place (same
    inode, same size) and given back its mtime still differs, so its hash is checked and the tier rebuilt."""
    load_in_process(built)  # binds the copy's files
    weights = built / "squish_4bit/model.safetensors"
    assert serving_tier(built) == "int4" and bound(built)[".squish_4bit_ready"]
    before = weights.stat()
    flip(weights, -7)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_ino == before.st_ino and weights.stat().st_mtime_ns == before.st_mtime_ns
    with pytest.warns(UserWarning, match=re.escape(f"{weights}: {FAST} differs")):
        served, digest = load_in_process(built)
    assert served == "cold" and digest == lab.weights
