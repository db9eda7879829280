"""The grid refitted to GPTQ's codes (squishlike/calibration/rounding.py, compress's refit_scales): on a real
SmolLM2 weight and real inputs it lowers the output error GPTQ leaves; in a store of a tiny real mlx_lm model the
codes are GPTQ's own (so within range), every tier and mlx_lm's load of the export read the same weights; bad
values of the option are refused before anything is written."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from support.tiny_models import assert_same_weights

import squishlike
from squishlike import quant
from squishlike.calibration.gptq import gptq, inverse_hessian_factor
from squishlike.calibration.quantizer import Quantizer
from squishlike.calibration.rounding import codes_of, output_error, refit
from squishlike.npydir import NpyDir
from squishlike.provider import WeightProvider

ALL = ("mlx", "finalized", "int8", "int4", "int3")


@pytest.fixture(scope="module")
def smollm_linear(smollm_gguf):
    """SmolLM2's first down projection and real inputs to it: the SiLU-gated up projection of 512 of its token
    embeddings."""
    provider = WeightProvider.open(smollm_gguf)
    weight = {n: np.asarray(provider.get(f"layers.0.ffn.{n}.weight"), np.float32) for n in ("gate", "up", "down")}
    embeddings = np.asarray(provider.get("token_embedding.weight"), np.float32)
    x = embeddings[:: len(embeddings) // 512][:512]
    gate, up = x @ weight["gate"].T, x @ weight["up"].T
    return weight["down"], np.ascontiguousarray(gate / (1 + np.exp(-gate)) * up, np.float32)


@pytest.mark.parametrize("scheme", ["int4", "int3", "int2"])
def test_refit_lowers_the_output_error_gptq_leaves(smollm_linear, scheme):
    w, x = smollm_linear
    qz = Quantizer(scheme, 64, "bfloat16", clip_search=True)
    start = gptq(w, "float32", qz, inverse_hessian_factor(x))
    parts, errors = refit(w, x, qz, start)
    assert errors["gptq"] == pytest.approx(output_error(mx.array(w), mx.array(x), start, qz))
    assert errors["refit"] == pytest.approx(output_error(mx.array(w), mx.array(x), parts, qz))
    assert errors["refit"] < 0.95 * errors["gptq"]
    assert np.array_equal(parts[0], start[0])  # GPTQ's codes, on another grid
    assert [(p.shape, p.dtype) for p in parts] == [(p.shape, p.dtype) for p in start]
    assert not np.array_equal(parts[1], start[1])


def test_a_constant_group_keeps_a_grid_that_holds_it(smollm_linear):
    """A group whose weights are all one value has codes that cannot tell scale from offset: the damping keeps its
    grid, which still holds the value, and the result is finite."""
    w, x = smollm_linear
    w = w.copy()
    w[:, :64] = 0.25
    qz = Quantizer("int4", 64, "bfloat16", clip_search=True)
    parts, _ = refit(w, x, qz, gptq(w, "float32", qz, inverse_hessian_factor(x)))
    assert all(np.isfinite(p.astype(np.float32)).all() for p in parts[1:])
    stored = quant.dequantize("int4", *parts, group_size=64, scale_dtype="bfloat16", out_dtype="float32")
    np.testing.assert_allclose(stored[:, :64], 0.25, rtol=0.05)


def test_a_refitted_store_keeps_gptqs_codes_and_reads_the_same_everywhere(tmp_path, tiny_llama):
    plain = squishlike.compress(tiny_llama, tmp_path / "gptq", scheme="int4", calibration_max_tokens=512)
    out = squishlike.compress(tiny_llama, tmp_path / "refit", scheme="int4", refit_scales=True, tiers=ALL,
                              calibration_max_tokens=512)
    before, store = NpyDir(plain), NpyDir(out)
    record = store.manifest.extra["scale_refit"]
    assert "scale_refit" not in before.manifest.extra
    refitted = [n for n, e in record["tensors"].items() if e["refit"] < e["gptq"]]
    assert refitted and set(record["tensors"]) <= {n for n, e in store.entries.items() if "GPTQ" in e.reason}
    for name, entry in store.entries.items():
        if entry.scheme != "int4":
            continue
        codes = codes_of("int4", store.load_part(name, "q4"), entry.shape[-1])
        assert codes.max() <= 15
        assert np.array_equal(store.load_part(name, "q4"), before.load_part(name, "q4"))
        assert ("refitted" in entry.reason) == (name in refitted)
        changed = not np.array_equal(store.load_part(name, "s4"), before.load_part(name, "s4"))
        assert changed == (name in refitted)
    cold, _ = squishlike.load(out, tier="cold")
    for tier in ("int4", "mlx", "finalized"):
        assert_same_weights(cold, squishlike.load(out, tier=tier)[0])
    exported = squishlike.export(out, "mlx", tmp_path / "mlx", quantize=True, q_bits=4, q_group_size=64)
    assert_same_weights(squishlike.load(out, tier="int4")[0], mlx_lm.load(str(exported))[0])


def test_a_second_size_copies_no_tensor_rounded_without_the_refit(tmp_path, tiny_llama, capfd):
    """A `sensitivity_from` store's parts are copied only where this compress would write the same ones: with the
    refit on here and off there (or the other way), none are."""
    plain = squishlike.compress(tiny_llama, tmp_path / "plain", bpw=4.5)
    refitted = squishlike.compress(tiny_llama, tmp_path / "refit", bpw=4.5, refit_scales=True)
    for source, refit_scales in ((plain, True), (refitted, False)):
        capfd.readouterr()
        out = squishlike.compress(tiny_llama, tmp_path / f"again-{refit_scales}", bpw=5.5, sensitivity_from=source,
                                  refit_scales=refit_scales)
        copied = next(line for line in capfd.readouterr().err.splitlines() if "tensors keep the width" in line)
        assert copied.split()[1] == "0"
        assert ("scale_refit" in NpyDir(out).manifest.extra) == refit_scales


@pytest.mark.parametrize("options,message", [
    ({"refit_scales": "yes"}, "refit_scales='yes' is not True or False"),
    ({"refit_scales": True, "gptq": False}, "refit_scales=True refits the grid of GPTQ's codes, and GPTQ is off"),
])
def test_bad_values_are_refused_before_anything_is_written(tmp_path, tiny_llama, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        squishlike.compress(tiny_llama, tmp_path / "out", scheme="int4", **options)
    assert not (tmp_path / "out").exists()


def test_the_command_refuses_refit_without_gptq(tmp_path, tiny_llama):
    command = ["compress", str(tiny_llama), "-o", str(tmp_path / "out"), "--scheme", "int4", "--refit-scales",
               "--no-gptq"]
    done = subprocess.run([sys.executable, "-m", "squishlike", *command], capture_output=True, text=True)
    assert done.returncode == 2
    assert "--refit-scales refits the grid of GPTQ's codes, and GPTQ is off" in done.stderr
    assert not (tmp_path / "out").exists()
