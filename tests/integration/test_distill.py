"""End-to-end distillation of a store's grid (compress's distill_steps, squishlike/calibration/distill.py): on a
tiny real mlx_lm llama at 3 bits the held-out calibration KL falls, the store keeps its codes and changes its scales
and offsets, every tier and mlx_lm's load of the export read the same weights and give the same logits, the same
compress writes the same store, and bad values of the options are refused before anything is written."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx_lm
import numpy as np
import pytest
from support.tiny_models import assert_same_weights, assert_serves_as_store

import squishlike
from squishlike.npydir import NpyDir

OPTIONS = {"scheme": "int4", "bits": (("*", 3),), "calibration_max_tokens": 1024}  # 4 samples, one held out
DISTILL = {"distill_steps": 8, "distill_rate": 1e-4}
TOKENS = [1, 5, 9, 17, 33, 65, 129, 200]


@pytest.fixture(scope="module")
def stores(tmp_path_factory, tokenizer_dir):
    from support.tiny_models import TINY_CONFIGS, make_hf_model

    root = tmp_path_factory.mktemp("distill")
    source = make_hf_model(root / "llama", TINY_CONFIGS["llama"], tokenizer_dir)
    plain = squishlike.compress(source, root / "plain", **OPTIONS)
    distilled = squishlike.compress(source, root / "distilled", **OPTIONS, **DISTILL)
    return source, NpyDir(plain), NpyDir(distilled)


def test_the_held_out_loss_falls_and_the_manifest_says_how(stores):
    _, plain, distilled = stores
    record = distilled.manifest.extra["distill"]
    assert "distill" not in plain.manifest.extra
    assert (record["steps"], record["rate"], record["samples"], record["sampled"], record["tokens"]) == (
        8, 1e-4, 3, 2, 256)  # the 3 calibration samples twice, and 2 of 256 tokens the float model wrote
    assert record["held_out_kl"]["after"] < 0.9 * record["held_out_kl"]["before"]


def test_the_float_model_writes_the_same_samples_each_time_from_the_calibration_samples_first_tokens(stores,
                                                                                                   monkeypatch):
    from squishlike.calibration import distill
    from squishlike.calibration.distill import PROMPT_TOKENS, sampled_text
    from squishlike.compress_options import DISTILL_SAMPLE_TOKENS

    monkeypatch.setattr(distill, "SAMPLING_BATCH", 2)  # written in two batches, each with its own seed
    teacher, _ = mlx_lm.load(str(stores[0]))
    starts = [list(range(3, 3 + DISTILL_SAMPLE_TOKENS)), list(range(40, 40 + DISTILL_SAMPLE_TOKENS))]
    written = sampled_text(teacher, starts, 3)
    assert written == sampled_text(teacher, starts, 3)
    assert [len(sample) for sample in written] == [DISTILL_SAMPLE_TOKENS] * 3
    assert [sample[:PROMPT_TOKENS] for sample in written] == [start[:PROMPT_TOKENS] for start in starts + starts[:1]]
    assert written[0] != written[2]  # the same start, sampled on in the second batch


def test_the_codes_are_kept_and_the_grid_is_trained(stores):
    _, plain, distilled = stores
    changed = 0
    for name, entry in distilled.entries.items():
        assert entry.scheme == plain.entries[name].scheme
        if not entry.kind.quantized:
            assert np.array_equal(distilled.load_part(name, entry.kind.suffixes[0]),
                                  plain.load_part(name, entry.kind.suffixes[0]))
            continue
        codes, scales, offsets = entry.kind.suffixes
        assert np.array_equal(distilled.load_part(name, codes), plain.load_part(name, codes))
        changed += not np.array_equal(distilled.load_part(name, scales), plain.load_part(name, scales))
        changed += not np.array_equal(distilled.load_part(name, offsets), plain.load_part(name, offsets))
    assert changed == 2 * distilled.manifest.extra["distill"]["tensors"] > 0


def test_every_tier_and_mlx_lm_read_the_trained_grid(stores, tmp_path):
    _, _, distilled = stores
    cold, _ = squishlike.load(distilled.path, tier="cold")
    for tier in ("int4", "mlx"):  # the int4 tier holds the 3-bit tensors of an int4 store
        assert_same_weights(cold, squishlike.load(distilled.path, tier=tier)[0])
    exported = squishlike.export(distilled.path, "mlx", tmp_path / "mlx", quantize=True)
    assert_serves_as_store(mlx_lm.load(str(exported))[0], squishlike.load(distilled.path, tier="int4")[0], TOKENS)


def test_the_same_compress_writes_the_same_store(stores, tmp_path):
    source, _, distilled = stores
    again = NpyDir(squishlike.compress(source, tmp_path / "again", **OPTIONS, **DISTILL))
    for name, entry in distilled.entries.items():
        for suffix in entry.kind.suffixes:
            assert np.array_equal(again.load_part(name, suffix), distilled.load_part(name, suffix)), (name, suffix)


def test_a_compress_killed_while_it_writes_the_trained_grid_publishes_nothing_and_starts_over(stores, tmp_path):
    """Killed (SIGKILL) after two of the store's packs hold the trained grid and before the manifest records it:
    nothing is published, and the same command starts over and writes the store a run never killed writes."""
    source, _, distilled = stores
    out = tmp_path / "out"
    command = [sys.executable, "-m", "squishlike", "compress", str(source), "-o", str(out), "--scheme", "int4",
               "--bits", "*=3", "--calibration-tokens", "1024", "--distill-steps", "8", "--distill-rate", "1e-4"]
    env = dict(os.environ, SQUISHLIKE_OPENBLAS="0")
    killed = subprocess.run(command, env={**env, "SQUISHLIKE_FAULT_AT": "renamed:pack-00001.safetensors"},
                            capture_output=True, text=True, timeout=180)
    assert killed.returncode == -9, killed.stderr
    assert not out.exists()
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr
    assert "the store was written whole, not published (killed while it was distilled or gated); starting over" \
        in again.stderr, again.stderr
    store = NpyDir(out)
    assert store.manifest.packs == distilled.manifest.packs  # every byte of every pack, by its hashes


def test_a_second_size_copies_no_part_of_a_distilled_store(tmp_path, tiny_llama, capfd):
    """A `sensitivity_from` store's parts are copied only where this compress would round the same ones: a
    distilled store's grid was trained afterwards, so none are, whether this compress distills or not."""
    distilled = squishlike.compress(tiny_llama, tmp_path / "distilled", bpw=4.5, calibration_max_tokens=512,
                                    **DISTILL)
    for steps in (0, 2):
        capfd.readouterr()
        out = squishlike.compress(tiny_llama, tmp_path / f"again-{steps}", bpw=5.5, sensitivity_from=distilled,
                                  calibration_max_tokens=512, distill_steps=steps)
        copied = next(line for line in capfd.readouterr().err.splitlines() if "tensors keep the width" in line)
        assert copied.split()[1] == "0"
        assert ("distill" in NpyDir(out).manifest.extra) == bool(steps)


@pytest.mark.parametrize("options,message", [
    ({"distill_steps": -1}, "distill_steps=-1 is not a number of steps"),
    ({"distill_steps": 4, "distill_rate": 0.0}, "distill_rate=0.0 is not a learning rate"),
    ({"distill_steps": 4, "distill_rate": -1e-4}, "distill_rate=-0.0001 is not a learning rate"),
    ({"distill_steps": 4, "scheme": "int8"}, "a int8g store \\(scheme='int8'\\) holds none"),
    ({"distill_steps": 4, "calibration_max_tokens": 200}, "needs two samples of 256 calibration tokens"),
])
def test_bad_values_are_refused_before_anything_is_written(tmp_path, tiny_llama, options, message):
    with pytest.raises(ValueError, match=message):
        squishlike.compress(tiny_llama, tmp_path / "out", **{"scheme": "int4", **options})
    assert not (tmp_path / "out").exists()


def test_the_command_refuses_a_negative_step_count(tmp_path, tiny_llama):
    command = ["compress", str(tiny_llama), "-o", str(tmp_path / "out"), "--scheme", "int4", "--distill-steps", "-2"]
    done = subprocess.run([sys.executable, "-m", "squishlike", *command], capture_output=True, text=True)
    assert done.returncode == 2
    assert "--distill-steps -2 is not a number of steps" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
