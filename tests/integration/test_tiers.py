"""compress -> npy-dir -> every tier -> an mlx_lm model, on tiny real-architecture models."""

from __future__ import annotations

import json
import logging

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from support.format1 import as_format_1
from support.options import ROUND_TO_NEAREST
from support.tiny_models import assert_same_weights, cosine, disk_bytes, logits

import squishlike
from squishlike.cpu_layers import CpuQuantizedLinear, use_cpu_kernels
from squishlike.errors import TierNotReadyError
from squishlike.npydir import NpyDir
from squishlike.tiers import BY_NAME, ORDER, order
from squishlike.tiers.load import load_weights
from squishlike.tiers.prune import prune
from squishlike.tiers.order import ordered

TOKENS = [1, 5, 9, 20, 33, 7, 100, 250, 3, 42]
ALL = ("mlx", "finalized", "int8", "int4", "int3")


def test_int8_every_tier_bit_identical_and_close_to_source(tiny_model, tmp_path):
    out = squishlike.compress(tiny_model, tmp_path / "int8", scheme="int8", tiers=ALL)
    reference, _ = mlx_lm.load(str(tiny_model))

    cold, tokenizer = squishlike.load(out)  # first load: cold path, builds every tier the policy names
    assert {t.name: t.ready(NpyDir(out))[0] is not None for t in ORDER} == {
        "int4": False, "int8": True, "int3": False, "mlx": True, "finalized": True}
    assert cosine(logits(cold, TOKENS), logits(reference, TOKENS)) >= 0.999
    for tier in ("int8", "mlx", "finalized", "cold"):
        model, _ = squishlike.load(out, tier=tier)
        assert_same_weights(cold, model)
    assert tokenizer.encode("The capital of France") == mlx_lm.load(str(tiny_model))[1].encode("The capital of France")


@pytest.mark.parametrize("fmt,group", [("int8", 64), ("int8", 128), ("int4", 64), ("int4", 32), ("int3", 32)])
def test_quantized_tier_is_lossless_repack(tiny_llama, tmp_path, fmt, group):
    out = squishlike.compress(tiny_llama, tmp_path / fmt, scheme=fmt, group_size=group, tiers=ALL, int3_gate=False)
    if fmt == "int3":  # the gate decides; force it open here to test the repack itself
        _open_int3_gate(out)
    cold, _ = squishlike.load(out)
    quantized, _ = squishlike.load(out, tier=fmt)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in quantized.named_modules())
    assert_same_weights(cold, quantized)
    assert_same_weights(cold, squishlike.load(out, tier="mlx")[0])
    # The quantized tier is a complete mlx_lm model directory.
    via_mlx_lm, _ = mlx_lm.load(str(out / f"squish_{fmt[-1]}bit"))
    assert_same_weights(via_mlx_lm, quantized)
    if order.device_kind() == "cpu":  # the same layers as squishlike's model (cpu_layers.py), so the same outputs
        use_cpu_kernels(via_mlx_lm)
    assert mx.array_equal(logits(via_mlx_lm, TOKENS), logits(quantized, TOKENS)).item()


def test_int8_default_policy_and_per_row_form(tiny_llama, tmp_path):
    """Group-wise INT8 is the default and its store's policy holds the 8-bit tier, which a GPU takes first; `row`
    keeps the per-row form, whose every tier is still bit-identical and which has no native tier."""
    grouped = squishlike.compress(tiny_llama, tmp_path / "g64", scheme="int8")
    store = NpyDir(grouped)
    assert store.manifest.policy.tiers == ("mlx", "int8")
    assert store.entries["layers.0.ffn.down.weight"].scheme == "int8g"
    assert next(t.name for t in ordered(ORDER, "gpu") if t.wanted(store)) == "int8"
    squishlike.load(grouped)
    assert load_weights(store).tier == "int8"  # read from the store: nothing was built
    assert _ready(store) == set()

    per_row = squishlike.compress(tiny_llama, tmp_path / "row", scheme="int8", group_size="row", tiers=ALL)
    store = NpyDir(per_row)
    assert store.manifest.policy.tiers == ALL and store.manifest.group_size == 0
    assert store.entries["layers.0.ffn.down.weight"].scheme == "int8"
    cold, _ = squishlike.load(per_row)
    assert {t.name for t in ORDER if t.ready(store)[0] is not None} == {"mlx", "finalized"}
    for tier in ("mlx", "finalized"):
        assert_same_weights(cold, squishlike.load(per_row, tier=tier)[0])


def test_prune_leaves_no_file_of_any_tier(tiny_llama, tmp_path):
    """Every cache tier, built by a first load, then pruned: each file a build wrote is one its tier declares
    (Tier.sentinel, Tier.paths), and prune leaves none of them behind; the store is what compress wrote."""
    built = set()
    for fmt in ("int8", "int4", "int3"):  # each quantized tier needs a store of its own scheme
        out = squishlike.compress(tiny_llama, tmp_path / fmt, scheme=fmt, tiers=("mlx", "finalized", fmt),
                                  int3_gate=False)
        if fmt == "int3":
            _open_int3_gate(out)
        store_files = _files(out)
        squishlike.load(out)  # a policy that names its tiers: the first load builds every one
        store = NpyDir(out)
        ready = [t for t in ORDER if t.ready(store)[0] is not None]
        assert {t.name for t in ready} == {"mlx", "finalized", fmt}
        written = _files(out) - store_files - {".squishlike.lock"}
        assert written and all(any(t.owns(rel) for t in ready) for rel in written), written
        freed = prune(store, keep=())
        assert all(freed[t.name] > 0 for t in ready)
        assert not any(t.owns(rel) for t in ORDER for rel in _files(out)), _files(out) - store_files
        assert _files(out) - {".squishlike.lock"} == store_files
        built.update(t.name for t in ready)
    assert built == {t.name for t in ORDER}  # a tier added to ORDER must be built and pruned here too


def test_prune_removes_every_rank_share_under_its_lock(tiny_llama, tmp_path):
    """Rank shares are caches too (docs/format.md §14): prune removes each layout's share, ready or stale, with its
    temporaries and lock file, holding that layout's lock (a launch building it finishes first), unless `keep` names
    "rank"; the store is untouched and the next launch reads and caches its share again."""
    import shutil
    import threading

    from squishlike.io.lock import DirectoryLock
    from squishlike.load.sharded import sharded_load

    out = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int4", tiers=("int4",), **ROUND_TO_NEAREST)
    reference, _ = sharded_load(out)
    store_files = _files(out)
    shards = out / "shards"
    shutil.copytree(shards / "tensor-1-0", shards / "pipeline-2-1")  # another layout's share
    (shards / ".tensor-2-0.tmp-1-2").mkdir()  # what a killed build of a third layout left
    (shards / ".tensor-2-0.lock").touch()
    share_bytes = sum(p.stat().st_size for key in ("tensor-1-0", "pipeline-2-1") for p in (shards / key).iterdir())

    assert "rank" not in prune(NpyDir(out), keep=("rank",)) and (shards / "tensor-1-0" / ".ready").is_file()
    freed = {}
    with DirectoryLock(shards, ".pipeline-2-1.lock"):  # a launch building that share holds it: prune waits
        pruning = threading.Thread(target=lambda: freed.update(prune(NpyDir(out), keep=("int4",))))
        pruning.start()
        pruning.join(timeout=2)
        assert pruning.is_alive() and (shards / "pipeline-2-1" / ".ready").is_file()
    pruning.join(timeout=60)
    assert freed["rank"] == share_bytes > 0
    assert not shards.exists()
    assert _files(out) - {".squishlike.lock"} == {p for p in store_files if not p.startswith("shards/")}
    again, _ = sharded_load(out)
    assert_same_weights(reference, again)
    assert (shards / "tensor-1-0" / ".ready").is_file()


def _files(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _open_int3_gate(out) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["int3_gate"] = {"passed": True, "reason": "forced open by the test"}
    (out / "manifest.json").write_text(json.dumps(manifest))


def _ready(store: NpyDir) -> set[str]:
    return {t.name for t in ORDER if t.ready(store)[0] is not None}


@pytest.mark.parametrize("device,first,second", [("cpu", "int4", "mlx"), ("gpu", "int4", "mlx")])
def test_decision_tree_order_and_stale_sentinels(tiny_llama, tmp_path, monkeypatch, device, first, second):
    monkeypatch.setattr(order, "device_kind", lambda: device)
    out = squishlike.compress(tiny_llama, tmp_path / "int4", scheme="int4", tiers=("mlx", "finalized", "int4"))
    store = NpyDir(out)
    assert load_weights(store).tier == "cold"
    assert _ready(store) == {"mlx", "finalized", "int4"}  # a policy naming its tiers: the first load builds each
    assert load_weights(store).tier == first
    (out / BY_NAME[first].sentinel).unlink()
    assert load_weights(store).tier == second
    (out / BY_NAME[second].sentinel).write_text("")  # empty sentinel never counts
    (out / BY_NAME[first].sentinel).write_text(json.dumps({"format_version": 1, "manifest_fingerprint": "0" * 64,
                                                          "files": {"x.npy": {"size": 1}}}))
    remaining = ({"mlx", "finalized", "int4"} - {first, second}).pop()
    assert load_weights(store).tier == remaining
    for tier in ("mlx", "finalized", "int4"):
        BY_NAME[tier].remove(store)
    # Nothing valid left: cold again, and the cold path rebuilds the first tier of the order.
    assert load_weights(store).tier == "cold"
    assert load_weights(store).tier == first

    # A changed manifest makes every existing sentinel stale.
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["note"] = "edited"
    (out / "manifest.json").write_text(json.dumps(manifest))
    store = NpyDir(out)
    assert all(t.ready(store)[0] is None for t in ORDER)
    assert load_weights(store).tier == "cold"


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_first_and_later_loads_return_the_same_model(tiny_llama, tmp_path, monkeypatch, caplog, device):
    monkeypatch.setattr(order, "device_kind", lambda: device)
    out = squishlike.compress(tiny_llama, tmp_path / "int4", scheme="int4")
    store_bytes = disk_bytes(out)
    with caplog.at_level(logging.INFO, logger="squishlike"):
        first, _ = squishlike.load(out)
    # On either device the store is the int4 model: nothing written.
    assert [r for r in caplog.records if "wrote the cache tier" in r.getMessage()] == []
    assert _ready(NpyDir(out)) == set() and disk_bytes(out) <= 1.1 * store_bytes
    later, _ = squishlike.load(out)
    assert load_weights(NpyDir(out)).tier == "int4"
    assert _ready(NpyDir(out)) == set()
    assert load_weights(NpyDir(out), tier="mlx").tier == "mlx"  # a forced tier of the policy is built on demand
    assert "mlx" in _ready(NpyDir(out))

    def classes(model):
        return [(path, type(m)) for path, m in model.named_modules()]

    assert classes(first) == classes(later)
    # On mlx[cpu] the layers take its fast matmuls (cpu_layers.py); a GPU runs MLX's own.
    assert any(cls is (CpuQuantizedLinear if device == "cpu" else nn.QuantizedLinear) for _, cls in classes(first))
    assert mx.array_equal(logits(first, TOKENS), logits(later, TOKENS)).item()


@pytest.mark.parametrize("fmt,group", [("int4", 64), ("int4", 32), ("int8", 64), ("int3", 32)])
def test_quantized_tier_is_read_from_the_store(tiny_llama, tmp_path, monkeypatch, fmt, group):
    """The quantized tiers come first on every device, and the store is the quantized model: its parts are read as
    MLX's arrays, bit for bit what the built tier holds, and no second copy of the weights is written."""
    out = squishlike.compress(tiny_llama, tmp_path / fmt, scheme=fmt, group_size=group, int3_gate=False,
                              passthrough=("layers.1.mlp.*",), **ROUND_TO_NEAREST)
    if fmt == "int3":
        _open_int3_gate(out)
    built = BY_NAME[fmt]
    assert NpyDir(out).manifest.policy.tiers == ("mlx", fmt)  # the default policy: mlx and the native tier
    with monkeypatch.context() as m:  # a device that builds its quantized tiers, for the copy to compare with
        m.setitem(order.FROM_STORE, order.device_kind(), False)
        squishlike.load(out, tier=built.name)  # a forced tier the policy names is built
    store = NpyDir(out)
    from_built = built.load(store)
    built.remove(store)
    before = _files(out)
    loaded = load_weights(store)
    assert loaded.tier == built.name and _files(out) == before
    assert set(loaded.weights) == set(from_built.weights)
    for name, array in from_built.weights.items():
        assert loaded.weights[name].dtype == array.dtype and mx.array_equal(loaded.weights[name], array).item(), name
    model, _ = squishlike.load(out)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    assert mx.allclose(logits(model, TOKENS), logits(squishlike.load(out, tier="cold")[0], TOKENS), atol=0.05).item()
    assert squishlike.load(out, tier=built.name)[0] is not None and _files(out) == before  # forced: from the store


@pytest.mark.parametrize("version", [1, 2])
def test_store_read_refuses_damaged_parts(tiny_llama, tmp_path, version):
    """Read from the store, a part is checked as a built tier's file is: its size and its header against the
    manifest at every load (format 2: the header of the pack holding it), and with verify every hash the manifest
    records."""
    from squishlike.errors import FormatError, IntegrityError

    out = squishlike.compress(tiny_llama, tmp_path / "int4", scheme="int4", **ROUND_TO_NEAREST)
    if version == 1:
        as_format_1(out)
    store = NpyDir(out)
    entry = store.entries["layers.0.attention.q.weight"]
    codes = store.part_path("layers.0.attention.q.weight", entry.kind.suffixes[0])
    data = codes.read_bytes()
    codes.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # a flipped byte: only a hash sees it
    assert load_weights(NpyDir(out)).tier == "int4"
    with pytest.raises(IntegrityError, match=codes.name):
        load_weights(NpyDir(out), verify=True)
    codes.write_bytes(data[:-16])  # truncated
    with pytest.raises(FormatError, match="bytes; a " if version == 1 else "bytes; its header describes"):
        load_weights(NpyDir(out))
    if version == 1:
        other_shape = data.replace(b"'shape': (", b"'shape': (1, ", 1)
    else:
        other_shape = data.replace(b'"dtype":"U8"', b'"dtype":"I8"', 1)  # relabelled codes, the header as long
    codes.write_bytes(other_shape)
    with pytest.raises(FormatError, match="its role needs" if version == 1 else "squishlike wrote"):
        load_weights(NpyDir(out))
    assert not any(p.name.startswith("squish_") for p in out.iterdir())


def test_forced_tier_not_ready_is_a_clear_error(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "int8", scheme="int8")
    with pytest.raises(TierNotReadyError, match="tier 'finalized' is not ready"):
        squishlike.load(out, tier="finalized")
    with pytest.raises(ValueError, match="unknown tier"):
        squishlike.load(out, tier="fast")


def test_load_options_match_mlx_lm(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "int8", scheme="int8")
    model, tokenizer, config = squishlike.load(out, return_config=True, model_config={"rope_theta": 500.0})
    assert config["rope_theta"] == 500.0 and model.args.rope_theta == 500.0
    lazy_model, _ = squishlike.load(out, lazy=True)
    assert cosine(logits(lazy_model, TOKENS), logits(squishlike.load(out)[0], TOKENS)) > 0.9999
    text = mlx_lm.generate(model, tokenizer, "The capital", max_tokens=4)
    assert isinstance(text, str)


def test_passthrough_rules_recorded(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "int4", scheme="int4", passthrough=("layers.0.*",),
                              quantize_embeddings=False)
    entries = NpyDir(out).entries
    assert entries["layers.0.attention.q.weight"].scheme == "passthrough"
    assert entries["layers.0.attention.q.weight"].reason == "matches --passthrough"
    assert entries["layers.1.attention.q.weight"].scheme == "int4"
    assert entries["token_embedding.weight"].scheme == "passthrough"
    assert entries["token_embedding.weight"].reason.endswith("--no-quantize-embeddings)")
    assert entries["output_norm.weight"].scheme == "passthrough"
    q = entries["layers.1.ffn.down.weight"]
    assert 0 < q.error.rel_error < 0.25 and q.error.cosine > 0.95
    # Every manifest name round-trips through its key, and the packs it lists exist.
    for name, e in entries.items():
        for record in e.files.values():
            assert (out / record.pack).is_file()


def test_every_tensor_of_a_cache_file_starts_on_a_16k_boundary(tiny_llama, tmp_path):
    """So Metal can wrap a mapping of the file without a copy; mx.load (the CPU path) reads the gaps fine."""
    out = squishlike.compress(tiny_llama, tmp_path / "int4", scheme="int4", tiers=("mlx", "int4"))
    cold, _ = squishlike.load(out)
    for path in (out / "squish_weights.safetensors", out / "squish_4bit" / "model.safetensors"):
        raw = path.read_bytes()
        start = 8 + int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:start])
        header.pop("__metadata__")
        assert start % (16 << 10) == 0 and len(header) >= len(NpyDir(out).entries)
        assert all(entry["data_offsets"][0] % (16 << 10) == 0 for entry in header.values())
        assert set(mx.load(str(path))) == set(header)
    for tier in ("mlx", "int4"):
        assert_same_weights(cold, squishlike.load(out, tier=tier)[0])
    # A tier file packed the old way (no gaps) is not the one this tier wrote: damaged, skipped, rebuilt.
    packed = out / "squish_weights.safetensors"
    mx.save_safetensors(str(packed), mx.load(str(packed)), metadata={"format": "mlx"})
    BY_NAME["int4"].remove(NpyDir(out))  # the tier a load takes before mlx
    with pytest.warns(UserWarning, match="tier mlx is damaged"):
        assert load_weights(NpyDir(out)).tier == "cold"


def test_memory_reserved_ahead_is_what_the_store_read_fills(tiny_llama, tmp_path, monkeypatch):
    """A load that reads its quantized tier from the store reserves about the parts' bytes ahead, not the dense
    model's: a dense-sized reservation would be faulted-in memory the load never fills."""
    from squishlike import memory
    from squishlike.tiers.base import runtime_bytes
    from squishlike.tiers.prepare import prepare_memory

    out = squishlike.compress(tiny_llama, tmp_path / "int4", scheme="int4", **ROUND_TO_NEAREST)
    store = NpyDir(out)
    asked = []
    monkeypatch.setattr(memory, "reserve", lambda nbytes: asked.append(nbytes) or False)
    prepare_memory(store)
    parts = sum(record.size for entry in store.entries.values() for record in entry.files.values())
    assert asked == [parts] and parts < runtime_bytes(store) / 2
