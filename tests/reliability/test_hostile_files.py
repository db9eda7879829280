"""Hostile input: every crafted file of tests/support/hostile_corpus.py gets a typed error (squishlike.errors)
that names the file, and nothing in any of them is executed (no pickle, no model code, no tokenizer code).

Each case runs in its own process (forked by the harness's fork server, tests/support/crash_harness.py) with a
time limit and a memory limit, through every entry point: open_weights, inspect, verify, compress (INT8, no
tiers), export (an HF directory), the case's own action and load. So a crash, a hang or an allocation far past the
data's size fails the case instead of the test run. Whatever an entry point does with a hostile file, it either
raises a squishlike.errors type or gives the right answer (a load of a hostile npy-dir that succeeds, by
rebuilding a damaged cache, gives the clean weights; compress and export either name the file, or write exactly
what they write from the clean source: tests/fuzz/RELIABILITY.md counts each, and
test_reliability_md_states_the_true_counts keeps its counts true); and where nothing succeeded, nothing on disk
changed (compress and export write to a scratch directory outside it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from support.crash_harness import ForkServer, tree_state
from support.hostile_corpus import CASES, MARKER, OUTSIDE, build_base, fill

import squishlike
from squishlike.errors import FormatError

TIME_LIMIT = 60  # seconds for the seven entry points of one case
MEMORY_LIMIT = 1 << 30  # bytes beyond what the forked process holds: ~100x the tiny models' data
ENTRY_POINTS = ("open", "inspect", "verify", "compress", "export")
WRITERS = ("compress", "export")  # what they write goes to the case's scratch directory, outside the case's own


@pytest.fixture(scope="module")
def clean_outputs(base, tmp_path_factory):
    """What compress and export write from each clean source: a hostile case that succeeds must write one of
    these (the same weights and side files as the clean source it was crafted from)."""
    from support.crash_harness import act

    scratch = tmp_path_factory.mktemp("hostile-clean")
    return [act(action, source, scratch / f"{i}-{action}") for i, source in enumerate(
        (base.hf, base.npydir, base.ollama_manifest)) for action in WRITERS]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir):
    return build_base(tmp_path_factory.mktemp("hostile-base"), tokenizer_dir)


@pytest.fixture(scope="module")
def outcomes(base, tmp_path_factory):
    """case name -> (target, its directory, lstat state before, the child's status, each entry point's outcome),
    the cases run two at a time."""
    root = tmp_path_factory.mktemp("hostile")
    prepared, jobs = {}, []
    for case in CASES:
        d = root / case.name
        d.mkdir()
        target = case.build(base, d)
        actions = [*ENTRY_POINTS, *([case.action] if case.action not in (*ENTRY_POINTS, "load") else []), "load"]
        prepared[case.name] = (target, d, tree_state(d), tree_state(d / OUTSIDE))
        jobs.append({"op": "hostile", "path": str(target), "scratch": str(root / ".scratch" / case.name),
                     "actions": actions, "result": str(root / f".{case.name}.json"), "kill_after": TIME_LIMIT,
                     "memory_limit": MEMORY_LIMIT})
    results = {}
    with ForkServer() as server:
        for i in range(0, len(jobs), 2):
            for job, status in zip(jobs[i:i + 2], server.parallel(jobs[i:i + 2])):
                name = Path(job["result"]).name[1:-5]
                result = Path(job["result"])
                results[name] = (*prepared[name], status, json.loads(result.read_text()) if result.exists() else {})
    return results


def test_the_corpus_is_big_enough():
    assert len(CASES) >= 180 and len({c.name for c in CASES}) == len(CASES)


def test_reliability_md_states_the_true_counts(outcomes):
    """tests/fuzz/RELIABILITY.md states how many cases there are and how many compress and export both refuse: the
    figures went stale silently as the corpus grew, so a new case fails here until the doc says the new ones."""
    refused = sum(all("error" in outcomes[c.name][-1][a] for a in WRITERS) for c in CASES)
    doc = (Path(__file__).parents[1] / "fuzz" / "RELIABILITY.md").read_text()
    stated = re.search(r"Hostile input — (\d+) crafted files", doc), re.search(r"both\s+do in (\d+) cases", doc), \
        re.search(r"\((\d+) where one or both write", doc)
    assert all(stated), "RELIABILITY.md no longer states the counts in the words this test reads"
    assert [int(m.group(1)) for m in stated] == [len(CASES), refused, len(CASES) - refused], \
        f"RELIABILITY.md's hostile-input counts are stale: {len(CASES)} cases, {refused} refused by both writers"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_file_gets_a_typed_error_naming_it(case, base, outcomes):
    target, d, before, outside, status, attempts = outcomes[case.name]
    assert tree_state(d / OUTSIDE) == outside, "something was written, emptied or removed through a link"
    assert status["signal"] is None and not status["killed_by_us"], f"crashed or hung: {status}"
    assert status["code"] == 0, attempts
    for action in (case.action, *case.also):
        own = attempts[action]
        assert "error" in own, f"{action} accepted it: {own}"
        assert case.expect.__name__ in own["mro"], f"{action}: {own['error']}: {own['message']}"
        assert fill(case.names, target, d, base) in own["message"], f"{action}: {own['message']}"
    for action, outcome in attempts.items():
        if "error" in outcome:
            assert "SquishError" in outcome["mro"], f"{action}: untyped {outcome['error']}: {outcome['message']}"
    assert not list(d.rglob(MARKER)), "a hostile file executed code"
    load = attempts["load"]
    if case.action.startswith("sentinel:"):
        # A cache tier is never trusted: the default load ignores (or rebuilds) it and returns the clean weights.
        assert load.get("value") == base.weights_digest, load
    elif "value" in load and (d / "model" / "manifest.json").exists():
        assert load["value"] == base.weights_digest, "a hostile npy-dir loaded with different weights"
    if all("error" in o for o in attempts.values()):
        assert tree_state(d) == before, "a failed load changed the files on disk"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_compress_and_export_refuse_it_or_write_the_clean_output(case, base, outcomes, clean_outputs):
    """compress and export either refuse the file naming it, as the case's own entry point must (their typed
    errors are checked with the others above), or write exactly what they write from the clean source."""
    target, d, _, _, _, attempts = outcomes[case.name]
    for action in WRITERS:
        if "error" in attempts[action]:
            assert fill(case.names, target, d, base) in attempts[action]["message"], attempts[action]
        else:
            assert attempts[action]["value"] in clean_outputs, f"{action} wrote something else: {attempts[action]}"


def test_a_damaged_store_never_becomes_a_cache(base, tmp_path):
    """Two bytes overwritten in a stored part: the first load fails naming it, and builds no cache tier."""
    from squishlike.errors import IntegrityError
    from squishlike.npydir import NpyDir
    from squishlike.tiers import ORDER

    case = next(c for c in CASES if c.name == "store-two-bytes-overwritten")
    target = case.build(base, tmp_path)
    for _ in range(2):
        with pytest.raises(IntegrityError, match="__"):
            squishlike.load(target)
    store = NpyDir(target)
    assert not any(tier.ready(store)[0] for tier in ORDER)


def test_verify_hashes_a_cache_tier_and_rebuilds_it(base, tmp_path, monkeypatch):
    """A cache tier damaged in place with its identity kept (a bit flipped on the disk: same size, same file, so its
    sentinel still says ready) loads silently by default; with verify=True, or SQUISHLIKE_VERIFY=1, its checksum is
    checked, and it is rebuilt from the store."""
    import shutil

    from support.crash_harness import load_in_process

    from squishlike import tiers
    from squishlike.npydir import NpyDir

    for how in ("argument", "environment"):
        target = shutil.copytree(base.built, tmp_path / how)
        store = NpyDir(target)
        served = next(t for t in tiers.ordered(tiers.ORDER) if t.ready(store)[0] is not None)
        files = served.ready(store)[0]["files"]
        rel = max(files, key=lambda f: files[f]["size"])
        weights = (target / served.sentinel).parent / rel
        _rot(weights, target / served.sentinel)
        with pytest.warns(UserWarning, match=weights.name):
            if how == "argument":
                model, _ = squishlike.load(target, verify=True)
            else:
                monkeypatch.setenv("SQUISHLIKE_VERIFY", "1")
                model, _ = squishlike.load(target)
                monkeypatch.delenv("SQUISHLIKE_VERIFY")
        assert load_in_process(target) == (served.name, base.weights_digest)


def test_a_hugging_face_cache_snapshot_loads_through_its_links(base, tmp_path):
    """snapshots/<rev>/ -> blobs/ inside one repo is the one place a link is followed."""
    from support.crash_harness import weights_digest
    from support.hostile_corpus import _hf_cache

    model, _ = squishlike.load(_hf_cache(base, tmp_path))
    reference, _ = squishlike.load(base.hf)
    assert weights_digest(model) == weights_digest(reference)


def test_trust_remote_code_is_off_unless_asked(base, tmp_path):
    """mlx_lm's own loader honours model_file only with trust_remote_code=True; so do we, and by default the
    custom code neither runs nor is imported, on any path (HF directory, npy-dir)."""
    from squishlike.errors import SquishError

    for case in (c for c in CASES if "custom" in c.name):
        d = tmp_path / case.name
        d.mkdir()
        target = case.build(base, d)
        with pytest.raises(SquishError):
            squishlike.load(target)
        with pytest.raises(SquishError):
            squishlike.load(target, trust_remote_code=False)
        assert not list(d.rglob(MARKER))


def _link_out(store: Path, rel: str, outside: Path) -> None:
    """`store/rel` a link to `outside`, which holds what stood there (a tier's files, a share) or one file."""
    path = store / rel
    if path.exists():
        shutil.move(str(path), outside)
    else:
        outside.mkdir()
        (outside / "keep").write_text("not the store's")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(outside / "lock" if rel.endswith("lock") else outside)


def _prune(store: Path) -> None:
    from squishlike.npydir import NpyDir
    from squishlike.tiers.prune import prune

    prune(NpyDir(store), keep=())


def _verify(store: Path) -> None:
    from squishlike.info import verify

    verify(store)


def _sharded(store: Path) -> None:
    from squishlike.load.sharded import sharded_load

    sharded_load(store)


# (entry point, the link, whether the store has its tiers and share built, what happens: the error, or None)
LINKS = [
    ("load", "finalized", True, None),  # the next ready tier serves it
    ("load", "finalized", False, FormatError),  # the tier the first load would build
    ("load", ".squishlike.lock", False, FormatError),
    ("load", "shards", True, None),  # a load never reads shares
    ("prune", "finalized", True, None),  # the link removed, not what it leads to
    ("prune", ".squishlike.lock", True, FormatError),
    ("prune", "shards", True, None),  # a linked shards/ removed, never emptied
    ("prune", "shards/tensor-1-0", True, None),
    ("verify", "finalized", True, None),
    ("verify", "shards/tensor-1-0", True, None),
    ("sharded_load", "shards", True, FormatError),
    ("sharded_load", "shards/tensor-1-0", True, FormatError),
    ("sharded_load", "shards/.tensor-1-0.lock", False, FormatError),
    ("sharded_load", "shards/.tensor-1-0.lock", True, None),  # a ready share is read without the lock
    ("compress", "finalized", True, None),  # reads the store only
    ("export", "finalized", True, None),
]
ACTIONS = {"load": lambda s, out: squishlike.load(s), "prune": lambda s, out: _prune(s),
           "verify": lambda s, out: _verify(s),
           "sharded_load": lambda s, out: _sharded(s),
           "compress": lambda s, out: squishlike.compress(s, out, scheme="int8", tiers=()),
           "export": lambda s, out: squishlike.export(s, "hf", out)}


@pytest.fixture(scope="module")
def with_share(base, tmp_path_factory):
    """The built store with this process's share too (sharded_load of one process: layout tensor-1-0)."""
    store = shutil.copytree(base.built, tmp_path_factory.mktemp("share") / "model", symlinks=True)
    _sharded(store)
    assert (store / "shards" / "tensor-1-0" / ".ready").is_file()
    return store


@pytest.mark.parametrize("action, rel, built, expect", LINKS,
                         ids=[f"{a}-{r}-{'built' if b else 'fresh'}" for a, r, b, _ in LINKS])
def test_links_out_of_the_store_are_never_followed_to_write(action, rel, built, expect, base, with_share, tmp_path):
    """A link at any level of the store where squishlike writes (a tier directory, shards/, a share, a lock):
    each entry point either refuses it naming the link, or does its work; nothing outside the store is created,
    written, emptied or removed."""
    from support.crash_harness import tree_state, weights_digest

    from squishlike.tiers.background import wait_for_builds

    store = shutil.copytree(with_share if built else base.npydir, tmp_path / "model", symlinks=True)
    outside = tmp_path / OUTSIDE
    _link_out(store, rel, outside)
    before = tree_state(outside)
    if expect is None:
        result = ACTIONS[action](store, tmp_path / "out")
        if action == "load":
            assert weights_digest(result[0]) == base.weights_digest
        if action == "prune":
            assert not (store / rel).is_symlink() and not (store / rel).exists()
    else:
        with pytest.raises(expect, match=re.escape(str(store / rel.split("/.")[0]))):
            ACTIONS[action](store, tmp_path / "out")
    wait_for_builds()  # a first load's background build, done before the outside is looked at
    assert tree_state(outside) == before
    assert not (outside / "lock").exists()


@pytest.mark.parametrize("reference", ["a" * 5000, "model\0name", "/tmp/" + "b" * 300])
def test_an_unusable_path_is_a_typed_error(reference):
    from squishlike.errors import ModelNotFoundError

    for entry in (squishlike.load, squishlike.open_weights):
        with pytest.raises(ModelNotFoundError, match="not a usable path"):
            entry(reference)


def test_a_tier_copied_from_another_store_is_refused_and_rebuilt(base, tmp_path):
    """Every tier and share records the manifest it was built from (its sentinel's manifest_fingerprint): tiers
    copied in from a store of the same architecture with other weights never serve it; the load rebuilds them
    from this store."""
    from support.crash_harness import load_in_process

    from squishlike.npydir import NpyDir
    from squishlike.tiers import ORDER

    store = shutil.copytree(base.npydir, tmp_path / "model")
    for item in Path(base.other).iterdir():  # every cache tier's files and sentinels, not the store's own
        if not (store / item.name).exists():
            (shutil.copytree if item.is_dir() else shutil.copy)(item, store / item.name)
    copied = [tier.name for tier in ORDER if (store / tier.sentinel).exists()]
    assert copied and not any(tier.ready(NpyDir(store))[0] for tier in ORDER)
    assert load_in_process(store)[1] == base.weights_digest


@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith(("facts-", "warm-"))],
                         ids=lambda c: c.name)
def test_verify_names_a_hostile_side_file(case, base, outcomes):
    """`squishlike verify` names what a load refuses in the side files: a facts file whose manifest record was
    made to match its hostile content, a side file edited, one the manifest does not record."""
    target, d, _, _, _, attempts = outcomes[case.name]
    verify = attempts["verify"]
    problems = [verify["message"]] if "error" in verify else verify["value"]
    assert any(fill(case.names, target, d, base) in p for p in problems), problems


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_sharded_load_verifies_a_share_when_asked(how, base, with_share, tmp_path, monkeypatch):
    """A rank share damaged in place with its identity kept (a bit flipped on the disk) is served as it is by
    default, as a tier is; with verify=True or SQUISHLIKE_VERIFY=1 its hash is checked, and it is rebuilt from the
    store."""
    from support.crash_harness import weights_digest

    from squishlike.load.sharded import sharded_load

    store = shutil.copytree(with_share, tmp_path / "model")
    share = store / "shards" / "tensor-1-0" / "weights.safetensors"
    _rot(share, share.with_name(".ready"))
    assert weights_digest(sharded_load(store)[0]) != base.weights_digest  # unchecked: the damage is served
    with pytest.warns(UserWarning, match=re.escape(str(share))):
        if how == "argument":
            model, _ = sharded_load(store, verify=True)
        else:
            monkeypatch.setenv("SQUISHLIKE_VERIFY", "1")
            model, _ = sharded_load(store)
    assert weights_digest(model) == base.weights_digest
    assert weights_digest(sharded_load(store)[0]) == base.weights_digest  # the rebuilt share


def _rot(path: Path, sentinel: Path) -> None:
    """A bit of `path`, a tier file, flipped as a failing disk flips one: its bytes change and nothing records it.
    A write by a process changes the file's identity (its ctime at least), which a load would see; the sentinel is
    made to record the identity the file has after the flip, as if the flip had happened under it."""
    from squishlike.io.sentinel import IDENTITY, identity

    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40
    path.write_bytes(bytes(raw))
    payload = json.loads(sentinel.read_text())
    for rel, record in payload["files"].items():
        record[IDENTITY] = identity(os.lstat(sentinel.parent / rel))
    sentinel.write_text(json.dumps(payload))


def test_a_share_from_another_store_is_refused_and_rebuilt(base, with_share, tmp_path):
    """Another store's share of the same layout copied into this store's shards/KEY/ (its sentinel kept, the sizes
    equal): the files are not the ones the sentinel was written over, so the launch hashes them, warns naming the
    file, and reads and caches its own share from the store."""
    from support.crash_harness import weights_digest

    from squishlike.load.sharded import sharded_load

    other = shutil.copytree(base.other, tmp_path / "other", symlinks=True)
    _sharded(other)
    store = shutil.copytree(with_share, tmp_path / "model")
    _sharded(store)  # binds the copy's share to its own files, as a launch in place would have
    share = store / "shards" / "tensor-1-0" / "weights.safetensors"
    foreign = other / "shards" / "tensor-1-0" / "weights.safetensors"
    assert foreign.stat().st_size == share.stat().st_size and foreign.read_bytes() != share.read_bytes()
    shutil.copyfile(foreign, share)
    with pytest.warns(UserWarning, match=re.escape(f"{share}: xxh3 differs")):
        model, _ = sharded_load(store)
    assert weights_digest(model) == base.weights_digest
    assert weights_digest(sharded_load(store)[0]) == base.weights_digest  # the rebuilt share


def test_an_int8_tier_file_from_another_store_is_not_served_by_a_plain_load(base, tmp_path):
    """Two group-wise INT8 stores of one architecture, each with its squish_8bit/ built by a load: one's weights
    file copied over the other's (same size, sentinel kept). A plain load, which takes the 8-bit tier, hashes the
    replaced file, warns naming it, and returns the store's own weights, rebuilt from the store."""
    from support.crash_harness import load_in_process

    a, b = (squishlike.compress(source, tmp_path / name, scheme="int8", group_size=32, tiers=("int8",))
            for name, source in (("a", base.other), ("b", base.npydir)))
    load_in_process(a)
    served, own = load_in_process(b)
    assert load_in_process(b) == ("int8", own)
    weights = Path(b) / "squish_8bit" / "model.safetensors"
    shutil.copyfile(Path(a) / "squish_8bit" / "model.safetensors", weights)
    with pytest.warns(UserWarning, match=re.escape(f"{weights}: xxh3 differs")):
        assert load_in_process(b)[1] == own
    assert load_in_process(b) == ("int8", own)


def test_compress_never_locks_through_a_link(base, tmp_path):
    """compress locks OUT's parent with a file beside OUT: a link planted there (dangling, or to a file) is refused
    naming it, and nothing is created or written where it leads, nor at OUT."""
    outside = tmp_path / OUTSIDE
    outside.mkdir()
    (outside / "victim").write_text("keep")
    for target in (outside / "made", outside / "victim"):
        lock = tmp_path / ".out.squishlike-lock"
        lock.unlink(missing_ok=True)
        lock.symlink_to(target)
        with pytest.raises(FormatError, match=re.escape(str(lock))):
            squishlike.compress(base.hf, tmp_path / "out", scheme="int8", tiers=())
        assert sorted(p.name for p in outside.iterdir()) == ["victim"]
        assert (outside / "victim").read_text() == "keep" and not (tmp_path / "out").exists()


def test_a_model_type_that_is_no_model_is_refused_without_importing_it(base, tmp_path):
    """`model_type` naming a module of mlx_lm.models that builds no model (bitlinear_layers, which nothing else
    imports): open_weights and load refuse it as an unsupported architecture, and the module is never imported.
    In a fresh process, since another test's model may have imported it into this one."""
    import subprocess
    import sys

    target = shutil.copytree(base.hf, tmp_path / "model")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "model_type": "bitlinear_layers"}))
    script = f"""
import sys
import squishlike
from squishlike.errors import UnsupportedArchitectureError
for entry in (squishlike.open_weights, squishlike.load):
    try:
        entry({str(target)!r})
    except UnsupportedArchitectureError as e:
        assert {str(target)!r} in str(e) and "bitlinear_layers" in str(e), e
    else:
        raise AssertionError(entry)
assert "mlx_lm.models.bitlinear_layers" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
