"""A killed compress goes on from its last finished block (squishlike/resume.py), and ends with the store a run
that was never killed writes: killed for real (SIGKILL through the fault hook) between a block's saved state and
its checkpoint, and interrupted with Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import squishlike

OPTIONS = ["--scheme", "int4", "--calibration-tokens", "128"]  # calibrated: AWQ, GPTQ, clip search


def cli_compress(src, out, *, fault: str | None = None, action: str = "kill", extra=()):
    env = dict(os.environ, SQUISHLIKE_OPENBLAS="0")
    if fault:
        env.update(SQUISHLIKE_FAULT_AT=fault, SQUISHLIKE_FAULT_ACTION=action)
    return subprocess.run([sys.executable, "-m", "squishlike", "compress", str(src), "-o", str(out), *OPTIONS,
                           *extra], env=env, capture_output=True, text=True, timeout=180)  # a hang fails


def written(out) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    return {"tensors": manifest["tensors"], "awq": manifest["awq"], "gptq": manifest["gptq"]}


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tokenizer_dir):
    from support.tiny_models import TINY_CONFIGS, make_hf_model

    root = tmp_path_factory.mktemp("resume")
    src = make_hf_model(root / "llama", {**TINY_CONFIGS["llama"], "num_hidden_layers": 3}, tokenizer_dir)
    done = cli_compress(src, root / "clean")
    assert done.returncode == 0, done.stderr
    return src, written(root / "clean")


@pytest.mark.parametrize("unit,resumed_at", [(1, "embeddings"), (2, "layer 0")])
def test_a_killed_compress_goes_on_from_its_last_checkpoint(clean, tmp_path, unit, resumed_at):
    src, want = clean
    out = tmp_path / "out"
    killed = cli_compress(src, out, fault=f"compress-unit:{unit}")
    assert killed.returncode == -9, killed.stderr
    assert not out.exists()
    [partial] = tmp_path.glob(".out.partial-*")
    again = cli_compress(src, out)
    assert again.returncode == 0, again.stderr
    assert f"going on from {resumed_at} of a killed run" in again.stderr
    assert written(out) == want  # bit for bit what a run never killed writes
    assert not partial.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert not list(out.glob(".resume-*")) and not (out / ".journal.json").exists()
    squishlike.load(out)


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_moe"])
def test_a_resumed_compress_keeps_what_calibration_found_from_the_model(tmp_path, tokenizer_dir, model_type):
    """gemma3's AWQ folds into norms that scale by 1 + w (an offset the saved state keeps); a MoE's experts are
    GPTQ'd one by one and its router has no fold (both recorded in the manifest): killed after its first layer and
    resumed, the store is the one a run never killed writes."""
    from support.arch_sweep import ARCH_CONFIGS
    from support.tiny_models import make_hf_model

    src = make_hf_model(tmp_path / model_type, {**ARCH_CONFIGS[model_type], "num_hidden_layers": 3}, tokenizer_dir)
    assert cli_compress(src, tmp_path / "clean").returncode == 0
    killed = cli_compress(src, tmp_path / "out", fault="compress-unit:2")
    assert killed.returncode == -9, killed.stderr
    again = cli_compress(src, tmp_path / "out")
    assert again.returncode == 0 and "going on from layer 0 of a killed run" in again.stderr, again.stderr
    assert written(tmp_path / "out") == written(tmp_path / "clean")


def test_ctrl_c_keeps_the_finished_blocks_and_other_options_start_over(clean, tmp_path):
    src, want = clean
    out = tmp_path / "out"
    stopped = cli_compress(src, out, fault="compress-unit:2", action="sigint")
    assert stopped.returncode == 130, stopped.stderr
    assert "the same command goes on from there" in stopped.stderr and not out.exists()
    [partial] = tmp_path.glob(".out.partial-*")
    other = cli_compress(src, out, extra=["--no-awq"])  # other options: the kept blocks are not theirs
    assert other.returncode == 0, other.stderr
    assert "going on from" not in other.stderr and not partial.exists()
    assert "awq" not in json.loads((out / "manifest.json").read_text())


# ---------------------------------------------------------------------------------------------- issue 44
# A killed compress's directory is not trusted: whatever was planted or edited in it, the run that goes on
# touches nothing outside OUT's parent (inotify watches it: nothing opened, listed, written or deleted), never
# publishes OUT as a link or with a link in it, and writes exactly the store a run never killed writes, going on
# from the directory only where everything in it is what the journal records (and saying why it starts over).

PLAIN = ["--scheme", "int8", "--no-awq", "--no-gptq"]  # no calibration: units are the blocks


def plain_compress(src, out, **kwargs):
    return cli_compress(src, out, extra=PLAIN, **kwargs)


@pytest.fixture(scope="module")
def plain(clean, tmp_path_factory):
    src, _ = clean
    out = tmp_path_factory.mktemp("plain") / "clean"
    done = plain_compress(src, out)
    assert done.returncode == 0, done.stderr
    return src, out


def killed_partial(compress, src, parent, fault: str):
    """The directory `compress` (into parent/out) leaves when killed at `fault`: killed once per module, copied for
    each test (its name keys the source and the options, not where it lies)."""
    killed = compress(src, parent / "out", fault=fault)
    assert killed.returncode == -9, killed.stderr
    [partial] = parent.glob(".out.partial-*")
    return partial


@pytest.fixture(scope="module")
def plain_killed(plain, tmp_path_factory):
    return killed_partial(plain_compress, plain[0], tmp_path_factory.mktemp("plain-killed"), "compress-unit:3")


@pytest.fixture(scope="module")
def calibrated_killed(clean, tmp_path_factory):
    return killed_partial(cli_compress, clean[0], tmp_path_factory.mktemp("calibrated-killed"), "compress-unit:2")


def same_store(out, want) -> None:
    """`out` is the store `want` is, byte for byte (its manifest but for when it was written), and holds nothing
    else: no link, no stray file."""
    from squishlike.io.files import plain_tree

    assert not out.is_symlink() and plain_tree(out) is None
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert files == sorted(str(p.relative_to(want)) for p in want.rglob("*"))
    for rel in files:
        if rel != "manifest.json" and (want / rel).is_file():
            assert (out / rel).read_bytes() == (want / rel).read_bytes(), rel
    assert written_plain(out) == written_plain(want)


def written_plain(out) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    return {k: manifest[k] for k in ("tensors", "packs", "side_files")}


def _move_out(partial, rel, outside):
    """`partial/rel` moved to `outside` and replaced by a link to it."""
    target = outside / rel.replace("/", "_")
    os.rename(partial / rel, target)
    os.symlink(target, partial / rel)


def _victims(partial, outside):
    """`.resume-K.npz.tmp` for every K to come: links to a file outside, which a save through them would truncate."""
    (outside / "victim").write_text("not the compress's")
    for k in range(1, 8):
        os.symlink(outside / "victim", partial / f".resume-{k}.npz.tmp")


def _fifo_state(partial, outside):
    state = sorted(partial.glob(".resume-*.json"))[0]
    state.unlink()
    os.mkfifo(state)


def _stray(partial, outside):
    (partial / "notes.txt").write_text("planted")
    (partial / ".tmp-1-2-config.json").write_text("{}")
    (partial / "tensors" / ".tmp-1-2-pack").write_text("x")


def _flip_pack(partial, outside):
    pack = partial / "tensors" / "pack-00001.safetensors"
    data = bytearray(pack.read_bytes())
    data[-1] ^= 0xFF
    pack.write_bytes(bytes(data))


def _swap_packs(partial, outside):
    """Two packs of one layout (layers 0 and 1) swapped, with their journal records swapped too."""
    a, b = (partial / "tensors" / f"pack-0000{i}.safetensors" for i in (1, 2))
    os.rename(a, partial / "swap")
    os.rename(b, a)
    os.rename(partial / "swap", b)
    journal = json.loads((partial / ".journal.json").read_text())
    packs = journal["packs"]
    ra, rb = (f"tensors/{p.name}" for p in (a, b))
    packs[ra], packs[rb] = packs[rb], packs[ra]
    (partial / ".journal.json").write_text(json.dumps(journal))


TAMPERING = {
    "untouched": lambda partial, outside: None,  # the control: a copy of the killed run's directory goes on
    "partial-directory-is-a-link": lambda partial, outside: _move_out(partial.parent, partial.name, outside),
    "tensors-is-a-link": lambda partial, outside: _move_out(partial, "tensors", outside),
    "pack-is-a-link": lambda partial, outside: _move_out(partial, "tensors/pack-00000.safetensors", outside),
    "state-file-is-a-link": lambda partial, outside: _move_out(
        partial, sorted(p.name for p in partial.glob(".resume-*.json"))[0], outside),
    "journal-is-a-link": lambda partial, outside: _move_out(partial, ".journal.json", outside),
    "npz-temp-is-a-link": _victims,
    "state-file-is-a-fifo": _fifo_state,
    "stray-files": _stray,
    "pack-bytes-flipped": _flip_pack,
    "packs-swapped-with-their-records": _swap_packs,
}


@pytest.mark.parametrize("how", TAMPERING)
def test_a_tampered_partial_directory_is_never_trusted(plain, plain_killed, tmp_path, how):
    from support.watch import Watch, needs_inotify

    if needs_inotify.args[0]:
        pytest.skip(needs_inotify.kwargs["reason"])
    src, want = plain
    parent = tmp_path / "parent"
    parent.mkdir()
    out = parent / "out"
    partial = Path(shutil.copytree(plain_killed, parent / plain_killed.name))
    outside = tmp_path / "outside"
    outside.mkdir()
    TAMPERING[how](partial, outside)
    watch = Watch(outside)
    try:
        again = plain_compress(src, out)  # a FIFO read would block: cli_compress's timeout fails it
    finally:
        events = watch.events()
    assert again.returncode == 0, again.stderr
    assert events == []  # nothing outside opened, listed, written or deleted
    same_store(out, want)
    assert sorted(p.name for p in parent.iterdir()) == ["out"]
    if how in ("untouched", "stray-files"):  # (a stray file is removed, the finished blocks kept)
        assert "compress: going on from" in again.stderr and "starting over" not in again.stderr, again.stderr
    else:
        assert "starting over" in again.stderr and "compress: going on from" not in again.stderr


def _state(partial, edit_json=None, edit_arrays=None):
    import numpy as np

    [state] = [p for p in partial.glob(".resume-*.json")
               if int(p.name.split("-")[1].split(".")[0]) == json.loads(
                   (partial / ".journal.json").read_text())["resume"]["units"]]
    if edit_json is not None:
        data = json.loads(state.read_text())
        edit_json(data)
        state.write_text(json.dumps(data))
    if edit_arrays is not None:
        npz = state.with_suffix(".npz")
        with np.load(npz) as f:
            arrays = {k: f[k] for k in f.files}
        edit_arrays(arrays)
        with open(npz, "wb") as f:
            np.savez(f, **arrays)


def _promote(scheme):
    def edit(state):
        state["promote"] = {"layers.2.ffn.down.weight": scheme}
    return edit


def _scale_hidden(arrays):
    for k in arrays:
        if k.startswith("hidden."):
            arrays[k] = arrays[k] * 1.5


STATE_EDITS = {
    "untouched": lambda p: None,  # the control: a copy of the killed run's directory goes on
    "hidden-states-edited": lambda p: _state(p, edit_arrays=_scale_hidden),
    "promotion-plan-edited": lambda p: _state(p, edit_json=_promote("int8")),
    "unknown-scheme-in-the-plan": lambda p: _state(p, edit_json=_promote("int9")),
}


@pytest.mark.parametrize("how", STATE_EDITS)
def test_an_edited_saved_state_starts_over_to_the_clean_store(clean, calibrated_killed, tmp_path, how):
    src, want = clean
    out = tmp_path / "out"
    partial = Path(shutil.copytree(calibrated_killed, tmp_path / calibrated_killed.name))
    STATE_EDITS[how](partial)
    again = cli_compress(src, out)
    assert again.returncode == 0, again.stderr
    if how == "untouched":
        assert "compress: going on from layer 0" in again.stderr and "starting over" not in again.stderr
    else:
        assert "starting over" in again.stderr and "compress: going on from" not in again.stderr
    assert written(out) == want
