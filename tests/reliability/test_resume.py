"""A killed compress goes on from its last finished block (squishlike/resume.py), and ends with the store a run
that was never killed writes: killed for real (SIGKILL through the fault hook) between a block's saved state and
its checkpoint, and interrupted with Ctrl-C."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import squishlike

OPTIONS = ["--scheme", "int4", "--calibration-tokens", "128"]  # calibrated: AWQ, GPTQ, clip search


def cli_compress(src, out, *, fault: str | None = None, action: str = "kill", extra=()):
    env = dict(os.environ, SQUISHLIKE_OPENBLAS="0")
    if fault:
        env.update(SQUISHLIKE_FAULT_AT=fault, SQUISHLIKE_FAULT_ACTION=action)
    return subprocess.run([sys.executable, "-m", "squishlike", "compress", str(src), "-o", str(out), *OPTIONS,
                           *extra], env=env, capture_output=True, text=True)


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
