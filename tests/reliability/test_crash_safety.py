"""Crash safety: nothing lost, nothing half-trusted.

`compress` and the first load's cache build are killed with a real SIGKILL at write/rename boundaries of every kind
(through the fault hook in squishlike/io/fault.py) and at random moments, interrupted with SIGINT, starved of disk space
(RLIMIT_FSIZE, and a real full tmpfs where this machine lets us mount one) and pointed at read-only directories.
After each: the source is untouched, no sentinel counts over files that differ from it, and the next load (after a
re-run compress where OUT is absent) returns weights bit-identical to a clean build's, from every ready tier.

The trials run in children of a fork server (tests/support/crash_harness.py), on a one-layer llama. The long version
(every boundary killed, >= 50 random kills per operation, SIGINT at every boundary) is `python tests/fuzz/crash_sweep.py`, or this file with
SQUISHLIKE_LONG=1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from support.crash_harness import (
    lab_fixture,
    labels_of,
    lying_sentinels,
    random_delays,
    ready_tiers,
    serving_tier,
    store_part,
    tree_digest,
)

LONG = os.environ.get("SQUISHLIKE_LONG") == "1"
SEED = int(os.environ.get("SQUISHLIKE_CRASH_SEED", "7"))
# compress-unit: after a block's tensors and its saved state, before the checkpoint that commits them (resume.py)
BOUNDARY_KINDS = {"lock", "mkdtemp", "write", "before-rename", "renamed", "before-publish", "publish", "published",
                  "compress-unit"}


lab = lab_fixture()

# The CLI's flags for the lab's store layout (support.crash_harness.COMPRESS_OPTS), and no restart with OpenBLAS
# (which `--scheme int4` asks for), so that the child itself reports.
CLI_LAYOUT = ["--no-quantize-embeddings", "--no-awq", "--no-gptq", "--no-clip-search"]
NO_RESTART = {"SQUISHLIKE_OPENBLAS": "0"}


def at(n: int, action: str = "kill") -> dict:
    return {"SQUISHLIKE_FAULT_AT": "*", "SQUISHLIKE_FAULT_NTH": str(n), "SQUISHLIKE_FAULT_ACTION": action}


def assert_survived(records: list[dict], what: str) -> None:
    failed = [r for r in records if r["problems"]]
    lines = [f"  at {r.get('label') or r.get('kill_after')}: {r['problems']}" for r in failed[:12]]
    assert not failed, f"{len(failed)} of {len(records)} {what} broke an invariant:\n" + "\n".join(lines)


def kinds(labels: list[str]) -> set[str]:
    return {label.split(":", 1)[0] for label in labels}


def first_of_each_kind(labels: list[str]) -> list[int]:
    """1-based positions: the first and the last boundary of each kind (where the interesting edges are)."""
    first, last = {}, {}
    for i, label in enumerate(labels, 1):
        first.setdefault(label.split(":", 1)[0], i)
        last[label.split(":", 1)[0]] = i
    return sorted(set(first.values()) | set(last.values()))


def picks(labels: list[str]) -> list[int]:
    """The boundaries a kill sweep tries: every one with SQUISHLIKE_LONG=1 (and in tests/fuzz/crash_sweep.py);
    otherwise the first and last of each kind and every one of the publish step, where the store changes hands (a
    subprocess a kill: trying all of them was a minute of the suite)."""
    if LONG:
        return list(range(1, len(labels) + 1))
    publish = {n for n, label in enumerate(labels, 1) if label.split(":")[0] in ("before-publish", "publish", "published")}
    return sorted(set(first_of_each_kind(labels)) | publish)


# ---------------------------------------------------------------------------------------------- kill -9, at boundaries


def test_compress_killed_at_its_boundaries(lab):
    labels = lab.boundaries("compress")
    # side files and manifest (three boundaries each), one write per pack (three for the lab's one-layer model)
    assert len(labels) >= 25 and {"lock", "mkdtemp", "write", "before-publish", "published"} <= kinds(labels)
    assert any(label.startswith("write:pack-") for label in labels), labels
    assert kinds(labels) <= BOUNDARY_KINDS, labels
    records = [{**lab.compress_trial(env=at(n)), "label": labels[n - 1]} for n in picks(labels)]
    assert all(r["killed"] and r["signal"] == signal.SIGKILL for r in records), "a boundary was not reached"
    assert_survived(records, "kills of compress")
    states = Counter(r["state"] for r in records)
    # Before the final rename nothing is at OUT; after it, the complete store.
    assert set(states) == {"absent", "new"} and states["new"] == 1, states  # only "published:out" comes after


def test_force_recompress_killed_keeps_a_good_model(lab):
    """--force over an existing model: every boundary of the publish step and the first and last of every other
    kind (every boundary with SQUISHLIKE_LONG=1; the rest of the run is the same as the sweep above)."""
    labels = lab.boundaries("compress", force=True)
    records = [{**lab.compress_trial(env=at(n), force=True), "label": labels[n - 1]} for n in picks(labels)]
    assert all(r["killed"] for r in records)
    assert_survived(records, "kills of compress --force")
    # The old model stays whole at OUT until the one atomic exchange, the new one after it; never neither.
    assert {r["state"] for r in records} == {"old", "new"}


def test_first_load_killed_at_its_boundaries(lab):
    labels = lab.boundaries("load")
    assert len(labels) >= 25 and {"lock", "write", "before-publish", "published", "renamed"} <= kinds(labels)
    records = [{**lab.load_trial(env=at(n)), "label": labels[n - 1]} for n in picks(labels)]
    assert all(r["killed"] for r in records)
    assert_survived(records, "kills of the first load")
    # Killed before the first tier's sentinel: the next load rebuilds (cold); after it: a warm tier serves.
    assert {r["next_load"] for r in records} >= {"cold", serving_tier(lab.root / "reference")}


# ---------------------------------------------------------------------------------------------- kill -9, random moments


def test_random_kills(lab):
    """~10 kills at random moments in the normal suite (50+ per operation in tests/fuzz/crash_sweep.py)."""
    n = 60 if LONG else 5
    lab.boundaries("compress")
    lab.boundaries("load")  # measures both durations
    records = [lab.compress_trial(kill_after=d) for d in random_delays(n, lab.compress_seconds, SEED)]
    records += [lab.load_trial(kill_after=d) for d in random_delays(n, lab.load_seconds, SEED + 1)]
    assert_survived(records, "random kills")
    assert sum(r["killed"] for r in records) >= n  # most moments land inside the run, not after it


# ---------------------------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_cleans_up_and_leaves_old_state_or_new(lab):
    """SIGINT at boundaries of every kind (every boundary with SQUISHLIKE_LONG=1) and at random moments: the run
    stops with KeyboardInterrupt (the CLI's exit 130), removes its temp files, and leaves the old state or the new."""
    records = []
    for op in ("compress", "load"):
        labels = lab.boundaries(op)
        picks = range(1, len(labels) + 1) if LONG else first_of_each_kind(labels)
        trial = lab.compress_trial if op == "compress" else lab.load_trial
        for n in picks:
            rec = {**trial(env=at(n, "sigint")), "label": labels[n - 1]}
            assert rec["code"] == 130 and rec["result"]["error"] == "KeyboardInterrupt", rec
            records.append(rec)
        seconds = lab.compress_seconds if op == "compress" else lab.load_seconds
        for d in random_delays(20 if LONG else 3, seconds, SEED + 2):
            records.append(trial(kill_after=d, send_signal=signal.SIGINT))
    assert_survived(records, "interrupted runs")


def test_ctrl_c_between_a_temp_and_its_owner_leaves_no_temp(lab):
    """The window a random SIGINT once hit in CI: a temp directory made, its writer's `try` not yet entered. Every
    such boundary of compress and of the first load, deterministically."""
    records = []
    for op, trial in (("compress", lab.compress_trial), ("load", lab.load_trial)):
        labels = lab.boundaries(op)
        made = [n for n, label in enumerate(labels, 1) if label.startswith("mkdtemp:")]
        assert made, f"{op} makes no temp directory any more: {sorted(kinds(labels))}"
        for n in made:
            rec = {**trial(env=at(n, "sigint")), "label": labels[n - 1]}
            assert rec["code"] == 130 and rec["result"]["error"] == "KeyboardInterrupt", rec
            records.append(rec)
    assert_survived(records, "runs interrupted just after making a temp directory")


# What a Ctrl-C landing between a `with lock:`'s acquire and its body leaves behind (CPython does not promise
# __exit__ then): the interrupted thread still holds the lock. A random SIGINT in CI hit it inside a tier write, and
# the writer's abort then waited forever for a hashing thread that needed that lock.
_ABORT_WITH_A_LEAKED_LOCK = """
import sys
import numpy as np
from squishlike.io.stream import StreamWriter
writer = StreamWriter(sys.argv[1])
writer.write(np.ones(64 << 20, np.uint8))
writer._cond.acquire()  # never released, as after the interrupted `with self._cond:`
writer.abort()
print("aborted", flush=True)
# The hashing thread stays parked on the lock this script wedged on purpose; skip the interpreter's finalization,
# which can crash under such a thread (seen once: SIGSEGV after "aborted"), since abort returning is the claim.
import os
os._exit(0)
"""


def test_an_interrupted_writer_aborts_although_the_interrupt_left_its_lock_held(tmp_path):
    done = subprocess.run([sys.executable, "-c", _ABORT_WITH_A_LEAKED_LOCK, str(tmp_path / "part")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "aborted", done.stderr[-2000:]


def test_ctrl_c_in_the_cli_exits_130_and_says_so(lab, tmp_path):
    out = tmp_path / "out"
    r = lab.server.run({"op": "cli", "argv": ["compress", str(lab.src), "-o", str(out), "--scheme", "int4", *CLI_LAYOUT],
                        "env": {"SQUISHLIKE_FAULT_AT": "renamed:manifest.json", "SQUISHLIKE_FAULT_ACTION": "sigint",
                                **NO_RESTART},
                        "result": str(tmp_path / "r.json")})
    result = json.loads((tmp_path / "r.json").read_text())
    assert r["code"] == 130 and "interrupted" in result["stderr"], result
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# ---------------------------------------------------------------------------------------------- disk full


def test_disk_full_while_compressing(lab, tmp_path):
    """RLIMIT_FSIZE in the child (SIGXFSZ ignored, so write() fails with EFBIG): a clear error naming the file,
    nothing at OUT, no temp files left, the source untouched. The CLI says it and exits 1."""
    out = tmp_path / "out"
    r = lab.server.run({"op": "compress", "src": str(lab.src), "out": str(out), "opts": lab.opts,
                        "rlimit_fsize": 40_000, "result": str(tmp_path / "r.json")})
    result = json.loads((tmp_path / "r.json").read_text())
    assert r["code"] == 1 and "OSError" in result["mro"], result
    # EFBIG; or EINVAL where the writer uses O_DIRECT and the limit cuts an aligned block short (see RELIABILITY.md)
    assert any(m in result["message"] for m in ("File too large", "Invalid argument")), result["message"]
    assert ".safetensors" in result["message"], result["message"]  # it names the pack it could not write
    assert not out.exists() and not any(".tmp-" in p.name for p in tmp_path.iterdir())
    assert tree_digest(lab.src) == lab.src_digest

    r = lab.server.run({"op": "cli", "argv": ["compress", str(lab.src), "-o", str(out), "--scheme", "int4", *CLI_LAYOUT],
                        "rlimit_fsize": 40_000, "env": NO_RESTART, "result": str(tmp_path / "cli.json")})
    result = json.loads((tmp_path / "cli.json").read_text())
    assert r["code"] == 1 and "[Errno" in result["stderr"] and str(tmp_path) in result["stderr"], result
    assert not out.exists()


def test_disk_full_while_building_caches(lab, tmp_path):
    """The first load cannot write its bigger cache files: it still loads (from the store), warns, marks nothing
    ready that is not complete, leaves the store and the tiers it did build intact; a later load finishes the job."""
    out = shutil.copytree(lab.pristine, tmp_path / "out")
    reference = lab.root / "reference"
    files = {"int4": reference / "squish_4bit" / "model.safetensors", "mlx": reference / "squish_weights.safetensors"}
    # Which one is bigger depends on the model (each tensor starts on a 16 KiB boundary: tiny models pad a lot).
    fits, too_big = sorted(files, key=lambda tier: files[tier].stat().st_size)
    limit = (files[fits].stat().st_size + files[too_big].stat().st_size) // 2  # it, and every finalized/*.npy, fit
    assert files[fits].stat().st_size < limit < files[too_big].stat().st_size
    assert all(p.stat().st_size < limit for p in (reference / "finalized").iterdir())
    r = lab.server.run({"op": "load", "path": str(out), "rlimit_fsize": limit, "result": str(tmp_path / "r.json")})
    result = json.loads((tmp_path / "r.json").read_text())
    assert r["code"] == 0, result
    assert result["digest"] == lab.weights and result["tier"] == "cold"
    # (EFBIG, or EINVAL where the cache writer uses O_DIRECT and the limit cuts a block short)
    assert any(f"could not build tier {too_big}" in w and files[too_big].name in w and "[Errno" in w
               for w in result["warnings"]), result
    ready = ready_tiers(out)
    assert ready == {"int8": False, "int3": False, "finalized": True, fits: True, too_big: False}, ready
    assert not lying_sentinels(out) and store_part(out) == lab.store_digest
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]
    # A tier built beside the failure serves the next load (int4 or finalized, by the device), same weights.
    r = lab.server.run({"op": "load", "path": str(out), "result": str(tmp_path / "r2.json")})
    result = json.loads((tmp_path / "r2.json").read_text())
    assert r["code"] == 0 and result["tier"] == serving_tier(out) and result["digest"] == lab.weights


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real, small filesystem (tmpfs, 800 KiB) where this machine lets us mount one (root, CAP_SYS_ADMIN)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=800k", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); RLIMIT_FSIZE tests cover disk-full")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_real_disk_full_tmpfs(lab, small_tmpfs):
    """ENOSPC from a real full filesystem, for compress and for the cache build."""
    out = small_tmpfs / "out"
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\0" * (600 << 10))  # leave ~200 KiB: less than the store needs
    r = lab.server.run({"op": "compress", "src": str(lab.src), "out": str(out), "opts": lab.opts,
                        "result": str(lab.root / "tmpfs-r.json")})
    result = json.loads((lab.root / "tmpfs-r.json").read_text())
    assert r["code"] == 1 and "No space left" in result["message"], result
    assert sorted(p.name for p in small_tmpfs.iterdir() if ".tmp-" in p.name) == []
    assert not out.exists() and tree_digest(lab.src) == lab.src_digest

    filler.unlink()
    shutil.copytree(lab.pristine, out)  # ~340 KiB of store: the caches (~900 KiB) cannot all fit
    r = lab.server.run({"op": "load", "path": str(out), "result": str(lab.root / "tmpfs-r2.json")})
    result = json.loads((lab.root / "tmpfs-r2.json").read_text())
    assert r["code"] == 0 and result["digest"] == lab.weights, result
    assert any("No space left" in w for w in result["warnings"]), result["warnings"]
    assert not lying_sentinels(out) and store_part(out) == lab.store_digest


# ---------------------------------------------------------------------------------------------- read-only


@pytest.fixture
def read_only(tmp_path):
    """make(dir) turns `dir` read-only for the children: chmod for a normal user, a read-only bind mount as root."""
    mounts = []

    def make(directory: Path) -> Path:
        if os.geteuid() != 0:
            for p in [directory, *directory.rglob("*")]:
                if p.is_dir():
                    p.chmod(0o555)
            return directory
        subprocess.run(["mount", "--bind", str(directory), str(directory)], check=False, capture_output=True)
        done = subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], capture_output=True)
        if done.returncode != 0:
            subprocess.run(["umount", str(directory)], capture_output=True)
            pytest.skip("running as root without permission to mount: cannot make a directory read-only")
        mounts.append(directory)
        return directory

    yield make
    for m in mounts:
        subprocess.run(["umount", "-l", str(m)], capture_output=True)
    for p in tmp_path.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)


def test_read_only_output_directory(lab, tmp_path, read_only):
    parent = tmp_path / "ro"
    parent.mkdir()
    read_only(parent)
    r = lab.server.run({"op": "cli", "argv": ["compress", str(lab.src), "-o", str(parent / "out")],
                        "result": str(tmp_path / "r.json")})
    result = json.loads((tmp_path / "r.json").read_text())
    assert r["code"] == 1 and str(parent) in result["stderr"], result
    assert "Read-only" in result["stderr"] or "Permission denied" in result["stderr"]
    assert not (parent / "out").exists()


def test_load_from_a_read_only_npy_dir(lab, tmp_path, read_only):
    """Nothing can be built: the load is served from the store (or a tier built earlier) and writes nothing."""
    fresh = read_only(shutil.copytree(lab.pristine, tmp_path / "fresh"))
    before = tree_digest(fresh, skip=())
    r = lab.server.run({"op": "load", "path": str(fresh), "result": str(tmp_path / "r.json")})
    result = json.loads((tmp_path / "r.json").read_text())
    assert r["code"] == 0 and result["tier"] == "cold" and result["digest"] == lab.weights, result
    assert tree_digest(fresh, skip=()) == before

    built = shutil.copytree(lab.pristine, tmp_path / "built")
    lab.server.run({"op": "load", "path": str(built)})
    read_only(built)
    r = lab.server.run({"op": "load", "path": str(built), "result": str(tmp_path / "r2.json")})
    result = json.loads((tmp_path / "r2.json").read_text())
    assert r["code"] == 0 and result["tier"] == serving_tier(built) != "cold" and result["digest"] == lab.weights, result


# ---------------------------------------------------------------------------------------------- the hook itself


def test_fault_hook_is_inert_without_its_environment(lab, tmp_path):
    """Without SQUISHLIKE_FAULT_* nothing is logged or killed: a clean run passes every boundary."""
    out = tmp_path / "out"
    r = lab.server.run({"op": "compress", "src": str(lab.src), "out": str(out), "opts": lab.opts})
    assert r["code"] == 0 and store_part(out) == lab.store_digest
    log = tmp_path / "labels.log"
    r = lab.server.run({"op": "load", "path": str(out), "env": {"SQUISHLIKE_FAULT_LOG": str(log),
                                                                 "SQUISHLIKE_FAULT_AT": "no-such-boundary"}})
    assert r["code"] == 0 and len(labels_of(log)) >= 25


def test_trials_write_the_way_production_does(lab, monkeypatch):
    """The fault hook's environment changes nothing about how files are written: where the crash trials run, a
    watched writer uses O_DIRECT as an unwatched one does, and passes its write boundary on that path."""
    from squishlike.io.atomic import atomic_file

    def write(name: str) -> bool:
        with atomic_file(lab.root / name) as w:
            w.write(b"x" * 10_000)
        assert (lab.root / name).read_bytes() == b"x" * 10_000
        return w.direct

    if not write("unwatched.bin"):
        pytest.skip(f"{lab.root}: the filesystem refuses O_DIRECT, so production falls back to buffered writes")
    log = lab.root / "watched.log"
    monkeypatch.setenv("SQUISHLIKE_FAULT_LOG", str(log))
    monkeypatch.setenv("SQUISHLIKE_FAULT_AT", "no-such-boundary")
    assert write("watched.bin")
    assert labels_of(log) == ["write:watched.bin", "before-rename:watched.bin", "renamed:watched.bin"]


def test_sweep_script_runs(tmp_path):
    """tests/fuzz/crash_sweep.py (the long sweep) works; here with tiny counts."""
    tests_dir = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "fuzz.crash_sweep", "--random", "2", "--no-boundaries", "--json",
                           str(tmp_path / "s.json")], capture_output=True, text=True, timeout=300, cwd=tests_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["total"]["failed"] == 0 and summary["total"]["trials"] >= 4
