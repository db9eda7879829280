"""Concurrency: processes that meet on one directory.

- Four processes load the same fresh npy-dir at the same instant: none fails, all four get the same weights as a
  clean build, and each tier is built exactly once (counted from the fault hook's boundary log, per process).
- Two compress runs aimed at one OUT: one wins, the other gets a clear error (DirectoryBusyError while the winner
  runs, OutputExistsError after), and OUT is the winner's complete store.
- A process killed while it holds the build lock does not block the next one (flock dies with its holder).

Real processes (children of tests/support/crash_harness.py's fork server), started together at a barrier.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict

import pytest
from support.crash_harness import lab_fixture, lying_sentinels, ready_tiers, store_part

from squishlike.info import verify

lab = lab_fixture()

# The boundary that completes each tier: the last rename of its build.
TIER_DONE = {"int4": "renamed:.squish_4bit_ready", "mlx": "renamed:.squish_ready", "finalized": "published:finalized"}


def results(paths) -> list[dict]:
    return [json.loads(p.read_text()) for p in paths]


def builds_per_tier(log) -> dict[str, Counter]:
    """tier -> Counter(pid -> times that process completed a build of it)."""
    per = defaultdict(Counter)
    for line in log.read_text().splitlines():
        pid, label = line.split(" ", 1)
        for tier, done in TIER_DONE.items():
            if label == done:
                per[tier][pid] += 1
    return per


@pytest.mark.parametrize("hold", [None, "before-publish:squish_4bit", "renamed:squish_weights.safetensors"])
def test_four_processes_load_a_fresh_npy_dir(lab, tmp_path, hold):
    """`hold`: the builder pauses 0.4 s at this boundary, lock held, so the others surely arrive mid-build."""
    out = lab.root / f"fresh-{hold or 'race'}".replace(":", "_")
    import shutil

    shutil.copytree(lab.pristine, out)
    log = tmp_path / "boundaries.log"
    env = {"SQUISHLIKE_FAULT_LOG": str(log)}
    if hold:
        env.update(SQUISHLIKE_FAULT_AT=hold, SQUISHLIKE_FAULT_ACTION="pause:0.4")
    start = time.time() + 0.3
    paths = [tmp_path / f"r{i}.json" for i in range(4)]
    runs = lab.server.parallel([{"op": "load", "path": str(out), "env": env, "start_at": start, "result": str(p)}
                                for p in paths])
    got = results(paths)
    assert [r["code"] for r in runs] == [0, 0, 0, 0], got
    assert all(r["digest"] == lab.weights for r in got), [r["tier"] for r in got]
    served = Counter(r["tier"] for r in got)
    assert served["cold"] == 1, served  # one process built; the others took a finished tier
    per = builds_per_tier(log)
    assert {t: sum(c.values()) for t, c in per.items()} == {"int4": 1, "mlx": 1, "finalized": 1}, per
    assert len({pid for c in per.values() for pid in c}) == 1  # ... all by the same process
    assert {k for k, v in ready_tiers(out).items() if v} == lab.built
    assert not lying_sentinels(out) and not verify(out) and store_part(out) == lab.store_digest
    shutil.rmtree(out)


def test_waiting_loader_takes_the_built_tier_and_builds_nothing(lab, tmp_path):
    import shutil

    out = shutil.copytree(lab.pristine, lab.root / "wait")
    log = tmp_path / "boundaries.log"
    start = time.time() + 0.3
    builder = {"op": "load", "path": str(out), "start_at": start, "result": str(tmp_path / "a.json"),
               "env": {"SQUISHLIKE_FAULT_LOG": str(log), "SQUISHLIKE_FAULT_AT": "lock:*",
                       "SQUISHLIKE_FAULT_ACTION": "pause:1.0"}}
    waiter = {"op": "load", "path": str(out), "start_at": start + 0.5, "result": str(tmp_path / "b.json"),
              "env": {"SQUISHLIKE_FAULT_LOG": str(log)}}
    runs = lab.server.parallel([builder, waiter])
    a, b = results([tmp_path / "a.json", tmp_path / "b.json"])
    assert [r["code"] for r in runs] == [0, 0], (a, b)
    assert a["tier"] == "cold" and b["tier"] != "cold" and a["digest"] == b["digest"] == lab.weights
    assert sum(sum(c.values()) for c in builds_per_tier(log).values()) == 3  # three tiers, built once each
    shutil.rmtree(out)


def test_lock_holder_killed_does_not_block_the_next_load(lab, tmp_path):
    import shutil

    out = shutil.copytree(lab.pristine, lab.root / "killed-holder")
    start = time.time() + 0.3
    holder = {"op": "load", "path": str(out), "start_at": start, "kill_after": 1.2,
              "env": {"SQUISHLIKE_FAULT_AT": "lock:*", "SQUISHLIKE_FAULT_ACTION": "pause:60"}}
    other = {"op": "load", "path": str(out), "start_at": start + 0.6, "result": str(tmp_path / "b.json")}
    t = time.monotonic()
    runs = lab.server.parallel([holder, other])
    assert runs[0]["killed_by_us"] and runs[0]["signal"] == 9
    b = json.loads((tmp_path / "b.json").read_text())
    assert runs[1]["code"] == 0 and b["digest"] == lab.weights and b["tier"] == "cold", b
    assert time.monotonic() - t < 30  # it waited for the holder's death, not for the 60 s pause
    assert {k for k, v in ready_tiers(out).items() if v} == lab.built and not lying_sentinels(out)
    shutil.rmtree(out)


@pytest.mark.parametrize("round_", range(3))
def test_two_compress_runs_at_one_out_race(lab, tmp_path, round_):
    out = tmp_path / "out"
    start = time.time() + 0.3
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    runs = lab.server.parallel([{"op": "compress", "src": str(lab.src), "out": str(out), "opts": lab.opts,
                                 "start_at": start, "result": str(p)} for p in paths])
    got = results(paths)
    codes = sorted(r["code"] for r in runs)
    assert codes == [0, 1], got
    loser = got[[r["code"] for r in runs].index(1)]
    assert loser["error"] in ("DirectoryBusyError", "OutputExistsError"), loser
    assert str(out.parent) in loser["message"] and "out" in loser["message"]  # names the directory and OUT
    assert not verify(out) and store_part(out) == lab.store_digest
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_second_compress_while_first_runs_is_told_so(lab, tmp_path):
    """Deterministic overlap: the first run holds its lock (paused at a boundary) while the second starts."""
    out = tmp_path / "out"
    start = time.time() + 0.3
    first = {"op": "compress", "src": str(lab.src), "out": str(out), "opts": lab.opts, "start_at": start,
             "env": {"SQUISHLIKE_FAULT_AT": "mkdtemp:out", "SQUISHLIKE_FAULT_ACTION": "pause:1.5"},
             "result": str(tmp_path / "a.json")}
    second = {"op": "cli", "argv": ["compress", str(lab.src), "-o", str(out), "--scheme", "int4"],
              "start_at": start + 0.5, "result": str(tmp_path / "b.json")}
    third = {"op": "compress", "src": str(lab.src), "out": str(out), "opts": lab.opts, "start_at": start + 0.6,
             "result": str(tmp_path / "c.json")}
    runs = lab.server.parallel([first, second, third])
    a, b, c = results([tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"])
    assert runs[0]["code"] == 0, a
    assert runs[1]["code"] == 1 and "another process is compressing into out" in b["stderr"], b
    assert runs[2]["code"] == 1 and c["error"] == "DirectoryBusyError" and str(out.parent) in c["message"], c
    assert not verify(out) and store_part(out) == lab.store_digest
    # After the winner: a plain second run is refused because OUT exists (the CLI's usage error, exit 2).
    r = lab.server.run({"op": "cli", "argv": ["compress", str(lab.src), "-o", str(out)],
                        "result": str(tmp_path / "d.json")})
    d = json.loads((tmp_path / "d.json").read_text())
    assert r["code"] == 2 and "exists" in d["stderr"] and str(out) in d["stderr"], d
