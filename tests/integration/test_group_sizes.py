"""Per-tensor group sizes (issue 33): a store whose tensors are grouped by 32, 64 and 128 columns (`bits=` rules
with a group size, as a bits-per-weight plan chooses them) records each tensor's own group size and is served by
every load path at it: the cold tier's dequantization, the dense tiers, the quantized tiers read from the store or
built (an mlx_lm model with per-layer entries), CPU layers, sharded_load and export for mlx_lm.load."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.nn as nn
import mlx_lm
import pytest
from support.options import ROUND_TO_NEAREST
from support.tiny_models import assert_same_weights, assert_serves_as_store, cosine, logits, quantized_layouts

import squishlike
from squishlike.compress_options import CompressOptions, choose_scheme
from squishlike.cpu_layers import CpuQuantizedLinear
from squishlike.exporter import export
from squishlike.info import inspect_model
from squishlike.npydir import NpyDir
from squishlike.load.sharded import sharded_load
from squishlike.tiers import order

TOKENS = [1, 5, 9, 20, 33, 7, 100, 250, 3, 42]
# The tiny llama's linears read 128 columns (down: 256): each width at a group size of its own; the rest (o, v,
# embedding, head) at the store's 4 bits in groups of 64
RULES = (("*.ffn.down.*", 3, 128), ("*.attention.q.*", 4, 128), ("*.ffn.up.*", 2, 32), ("*.ffn.gate.*", 8, 128),
         ("*.attention.k.*", 4, 32))
GROUP_OF = {"down_proj": (3, 128), "q_proj": (4, 128), "up_proj": (2, 32), "gate_proj": (8, 128), "k_proj": (4, 32)}


def expected(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {path: GROUP_OF.get(path.rsplit(".", 1)[-1], (4, 64)) for path in quantized_layouts(model)}


@pytest.fixture
def grouped(tiny_llama, tmp_path):
    return squishlike.compress(tiny_llama, tmp_path / "grouped", scheme="int4", bits=RULES,
                               tiers=("int4", "int8", "finalized", "mlx"), **ROUND_TO_NEAREST)


def test_each_tensor_records_its_group_size(grouped):
    store = NpyDir(grouped)
    down, q, v = (store.entries[f"layers.1.{part}.weight"] for part in ("ffn.down", "attention.q", "attention.v"))
    assert (down.scheme, down.group_size, q.scheme, q.group_size, v.group_size) == ("int3", 128, "int4", 128, 64)
    assert down.reason == "matches --bits *.ffn.down.*=3/128"
    assert store.manifest.group_size == 64  # the store's, for tensors no rule names
    # 128 columns in groups of 128: one scale and bias a row; the bytes at rest follow
    assert store.entries["layers.0.attention.q.weight"].part_spec("s4")[1] == (128, 1)


def test_a_rule_whose_groups_do_not_split_the_rows_keeps_the_tensor_exact():
    opts = CompressOptions(scheme="int4", bits=(("*", 3, 128),))
    assert choose_scheme("layers.0.ffn.up.weight", (64, 256), opts, "linear")[0] == "int3"
    assert choose_scheme("layers.0.ffn.up.weight", (64, 576), opts, "linear") == (
        "passthrough", "576 columns do not split into groups of 128")


@pytest.mark.parametrize("bits, message", [
    ((("*", 3, 96),), r"^bits=\*=3/96: group size 96 is not one of 32, 64, 128"),
    ((("*", 3, 128, 1),), r"^bits= holds \('\*', 3, 128, 1\), not a \(pattern, bits\) pair or"),
])
def test_rules_with_a_group_size_are_validated(tiny_llama, tmp_path, bits, message):
    with pytest.raises(ValueError, match=message):
        squishlike.compress(tiny_llama, tmp_path / "out", scheme="int4", bits=bits)
    assert not (tmp_path / "out").exists()


def test_every_tier_and_the_cpu_layers_serve_each_group_size(grouped):
    cold, _ = squishlike.load(grouped, tier="cold")
    from_store, _ = squishlike.load(grouped)  # the int4 tier, read straight from the store
    assert quantized_layouts(from_store) == expected(from_store)
    assert_same_weights(cold, from_store)
    for tier in ("int4", "int8", "finalized", "mlx"):  # built: the quantized tiers' files and the dense tiers
        model, _ = squishlike.load(grouped, tier=tier)
        assert_same_weights(cold, model)
        if tier in ("int4", "int8"):
            assert quantized_layouts(model) == expected(model)
    if order.device_kind() == "cpu":  # squishlike's own layers at each group size
        assert {type(m) for _, m in from_store.named_modules() if isinstance(m, nn.QuantizedLinear)} == {
            CpuQuantizedLinear}
        assert cosine(logits(from_store, TOKENS), logits(cold, TOKENS)) > 0.999


def test_the_built_tier_names_each_group_size_for_mlx_lm(grouped):
    squishlike.load(grouped, tier="int4")  # builds it
    quantization = json.loads((grouped / "squish_4bit" / "config.json").read_text())["quantization"]
    assert (quantization["bits"], quantization["group_size"]) == (4, 32)  # the smallest of its 4-bit tensors
    assert quantization["model.layers.0.self_attn.q_proj"] == {"group_size": 128, "bits": 4, "mode": "affine"}
    assert quantization["model.layers.0.mlp.down_proj"] == {"group_size": 128, "bits": 3, "mode": "affine"}
    assert "model.layers.0.self_attn.k_proj" not in quantization  # at the top level's width and group size
    tier, _ = squishlike.load(grouped, tier="int4")
    via_mlx_lm, _ = mlx_lm.load(str(grouped / "squish_4bit"))
    assert quantized_layouts(via_mlx_lm) == quantized_layouts(tier)
    assert_same_weights(tier, via_mlx_lm)


def test_sharded_load_reads_each_group_size(grouped):
    assert_same_weights(squishlike.load(grouped, tier="cold")[0], sharded_load(grouped)[0])


def test_export_keeps_each_group_size_for_mlx_lm(grouped, tmp_path):
    store_model, _ = squishlike.load(grouped)
    exported = export(grouped, "mlx", tmp_path / "mlx", quantize=True)
    config = json.loads((exported / "config.json").read_text())
    assert config["quantization"]["model.layers.1.mlp.up_proj"] == {"group_size": 32, "bits": 2, "mode": "affine"}
    assert_serves_as_store(mlx_lm.load(str(exported))[0], store_model, TOKENS)


def test_inspect_shows_each_width_and_group_size(grouped):
    report = inspect_model(grouped)
    assert report["quality"]["layers.0.ffn.down.weight"]["group_size"] == 128
    # the group size named where it is not the store's (64)
    assert report["store"]["widths"] == {"passthrough": 5, "int8g/g128": 2, "int4/g128": 2, "int4": 6,
                                         "int4/g32": 2, "int3/g128": 2, "int2/g32": 2}
    table = subprocess.run([sys.executable, "-m", "squishlike", "inspect", str(grouped)], capture_output=True,
                           text=True, check=True).stdout
    assert next(line for line in table.splitlines() if line.startswith("layers.0.ffn.down.weight")).split()[1] == \
        "int3/g128"


def test_cli_takes_a_group_size_in_a_rule(tiny_llama, tmp_path):
    def cli(*args: object, rc: int = 0) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "squishlike", *map(str, args)], capture_output=True, text=True)
        assert done.returncode == rc, done.stderr
        return done

    out = tmp_path / "out"
    cli("compress", tiny_llama, "-o", out, "--scheme", "int4", "--bits", "*.ffn.down.*=3/128", "--no-awq",
        "--no-gptq")
    downs = {(e.scheme, e.group_size) for name, e in NpyDir(out).entries.items() if ".ffn.down." in name}
    assert downs == {("int3", 128)}
    for bad, problem in (("*=3/128/2", "'*=3/128/2' is not PATTERN=BITS or PATTERN=BITS/GROUP_SIZE"),
                         ("*=3/96", "--bits *=3/96: group size 96 is not one of 32, 64, 128")):
        done = cli("compress", tiny_llama, "-o", tmp_path / "bad", "--scheme", "int4", "--bits", bad, rc=2)
        assert problem in done.stderr.splitlines()[-1]
        assert not (tmp_path / "bad").exists()
