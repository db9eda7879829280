"""The pieces of squishlike.sharded_load that run without a launcher: exact slices of every scheme, the split
plan of a rank, and the rank tier's sentinel. A stand-in group (rank, size) splits the model as a rank would;
the launched tests are in tests/integration/test_sharded.py."""

from __future__ import annotations

import json
import logging
import re

import mlx.core as mx
import numpy as np
import pytest
from support.tiny_models import TINY_CONFIGS, flat_params, make_hf_model

import squishlike
from squishlike.npydir import NpyDir
from squishlike.npydir.slices import SliceReader, runs


class Group:
    """What a model's shard() and pipeline() ask of an mx.distributed.Group while loading: rank and size."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.fixture
def qwen2(tmp_path, tokenizer_dir):
    return make_hf_model(tmp_path / "src", TINY_CONFIGS["qwen2"], tokenizer_dir)


def test_runs():
    assert runs(np.array([0, 1, 2, 5, 6, 9])) == [(0, 3), (5, 7), (9, 10)]
    assert runs(np.array([], dtype=np.int64)) == []


# A mixed store (docs/format.md §4.7): every bitstream width and 8 bits beside the store's 4
MIXED = (("*.attention.q.*", 2), ("*.attention.k.*", 3), ("*.ffn.up.*", 5), ("*.ffn.gate.*", 6), ("*.ffn.down.*", 8))


@pytest.mark.parametrize("fmt,group_size,bits", [("int8", 32, ()), ("int4", 32, ()), ("int4", 128, ()),
                                                 ("int3", 64, ()), ("int4", 32, MIXED), ("int4", 128, MIXED)])
def test_slices_equal_the_whole_tensor_cut(tmp_path, qwen2, fmt, group_size, bits):
    """Any ascending indices along any axis, cuts inside a quantization group included: the same values as
    dequantizing the whole tensor and cutting it, and never more than the whole groups touched are read."""
    squishlike.compress(qwen2, tmp_path / fmt, scheme=fmt, group_size=group_size, bits=bits, tiers=[],
                        int3_gate=False)
    store = NpyDir(tmp_path / fmt)
    assert not bits or {"int2", "int3", "int5", "int6", "int8g"} < store.manifest.schemes
    reader = SliceReader(store)
    for name in store.entries:
        whole = store.dequantize(name)
        for axis in range(whole.ndim):
            n = whole.shape[axis]
            for index in (np.arange(n // 2), np.arange(n // 2, n), np.r_[0:3, n // 3:n // 2 + 5]):
                got = reader.read(name, axis, index)
                assert np.array_equal(got, whole.take(index, axis=axis)), (name, axis, index)
    with pytest.raises(ValueError, match="must ascend"):
        reader.read("layers.0.ffn.up.weight", 0, np.array([3, 2]))


def test_rows_and_columns_read_only_their_bytes(tmp_path, qwen2):
    squishlike.compress(qwen2, tmp_path / "int8", scheme="int8", group_size="row", tiers=[])
    store = NpyDir(tmp_path / "int8")
    reader = SliceReader(store)
    rows, cols = store.entries["layers.0.ffn.up.weight"].shape
    reader.read("layers.0.ffn.up.weight", 0, np.arange(rows // 2))
    assert reader.bytes_read == rows // 2 * cols + rows // 2 * 4  # int8 codes + one float32 scale per row
    reader.bytes_read = 0  # columns: copied out of a memory map, only the needed bytes of each row
    reader.read("layers.0.ffn.up.weight", 1, np.arange(cols // 2))
    assert reader.bytes_read == rows * (cols // 2) + rows * 4


def _records(caplog) -> list[dict]:
    return [r.shard_load for r in caplog.records if hasattr(r, "shard_load")]


@pytest.mark.parametrize("bits", [(), MIXED], ids=["int4", "mixed"])
def test_tensor_shares_rebuild_the_model(tmp_path, qwen2, caplog, bits):
    """Both ranks' shares, put back together along the axis each was cut, are the single-process weights; an INT4
    g128 store cut at column 64 of 128 (inside a group) included, and one with every width."""
    squishlike.compress(qwen2, tmp_path / "store", scheme="int4", group_size=128, bits=bits, tiers=["finalized"])
    whole = flat_params(squishlike.load(tmp_path / "store")[0])
    caplog.set_level(logging.DEBUG, logger="squishlike")
    shares = [flat_params(squishlike.sharded_load(tmp_path / "store", tensor_group=Group(r, 2))[0]) for r in range(2)]
    assert shares[0].keys() == whole.keys()
    for name, w in whole.items():
        a, b = shares[0][name], shares[1][name]
        if a.shape == w.shape:
            assert mx.array_equal(a, w).item() and mx.array_equal(b, w).item(), name
        else:
            axis = next(i for i, (x, y) in enumerate(zip(a.shape, w.shape)) if x != y)
            assert mx.array_equal(mx.concatenate([a, b], axis=axis), w).item(), name
    assert [r["tier"] for r in _records(caplog)] == ["store", "store"]


def test_pipeline_stage_reads_its_layers_only(tmp_path, qwen2, caplog):
    squishlike.compress(qwen2, tmp_path / "store", scheme="int8", tiers=[])
    caplog.set_level(logging.DEBUG, logger="squishlike")
    model, _ = squishlike.sharded_load(tmp_path / "store", pipeline_group=Group(0, 2))
    names = flat_params(model)
    assert not any(n.startswith("model.layers.0.") for n in names) and any(".layers.1." in n for n in names)
    store = NpyDir(tmp_path / "store")
    layer0 = sum(store.entry(name).files[suffix].size for pack in store.packs.values() for name, suffix in pack
                 if name.startswith("model.layers.0.") or name.startswith("layers.0."))
    (record,) = _records(caplog)
    total = sum((tmp_path / "store" / rel).stat().st_size for rel in store.part_files())
    assert record["bytes_read"] <= total - layer0


def test_rank_tier_is_taken_checked_and_rebuilt(tmp_path, qwen2, caplog):
    squishlike.compress(qwen2, tmp_path / "store", scheme="int8", tiers=[])
    caplog.set_level(logging.DEBUG, logger="squishlike")
    first = flat_params(squishlike.sharded_load(tmp_path / "store", tensor_group=Group(1, 2))[0])
    share = tmp_path / "store" / "shards" / "tensor-2-1"
    assert (share / ".ready").is_file() and not (tmp_path / "store" / "shards" / "tensor-2-0").exists()

    def load_again() -> str:
        caplog.clear()
        again = flat_params(squishlike.sharded_load(tmp_path / "store", tensor_group=Group(1, 2))[0])
        assert all(mx.array_equal(again[n], first[n]).item() for n in first)
        return _records(caplog)[0]["tier"]

    assert load_again() == "rank"
    # another split of the model (recorded in the sentinel's plan): not taken, rebuilt from the store
    sentinel = json.loads((share / ".ready").read_text())
    (share / ".ready").write_text(json.dumps({**sentinel, "plan": "0" * 64}))
    assert load_again() == "store"
    assert load_again() == "rank"
    # damaged weights under a valid sentinel size: warned about, read from the store, rebuilt
    weights = share / "weights.safetensors"
    weights.write_bytes(b"\0" * weights.stat().st_size)
    with pytest.warns(UserWarning, match="unreadable"):
        assert load_again() == "store"
    assert load_again() == "rank"
    # another layout has its own share
    squishlike.sharded_load(tmp_path / "store", pipeline_group=Group(1, 2))
    shares = sorted(p.name for p in share.parent.iterdir() if not p.name.endswith(".lock"))  # a lock per layout
    assert shares == ["pipeline-2-1", "tensor-2-1"]


def _header(path) -> tuple[int, dict]:
    """(header length, header) of a safetensors file."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return length, json.loads(raw[8:8 + length])


def overlap_second_tensor(path) -> None:
    """Rewrite the header in place (same length, same file size) so the second tensor's data starts where the
    first one's does: offsets that overlap, which mx.load alone reads without a word."""
    length, header = _header(path)
    first, second = sorted((e["data_offsets"], name) for name, e in header.items() if name != "__metadata__")[:2]
    (start, _), ((b0, b1), name) = first[0], second
    header[name]["data_offsets"] = [start, start + b1 - b0]
    blob = json.dumps(header, separators=(",", ":")).encode()
    assert len(blob) <= length
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(blob.ljust(length))


def test_rank_tier_with_overlapping_offsets_is_refused_naming_its_file(tmp_path, qwen2, caplog):
    from squishlike.errors import FormatError
    from squishlike.tiers.rank import RankTier

    squishlike.compress(qwen2, tmp_path / "store", scheme="int8", tiers=[])
    first = flat_params(squishlike.sharded_load(tmp_path / "store", tensor_group=Group(1, 2))[0])
    share = tmp_path / "store" / "shards" / "tensor-2-1"
    weights = share / "weights.safetensors"
    _, header = _header(weights)
    order = sorted((e["data_offsets"], name) for name, e in header.items() if name != "__metadata__")
    shapes = {name: tuple(header[name]["shape"]) for _, name in order}
    store = NpyDir(tmp_path / "store")
    tier = RankTier("tensor-2-1", json.loads((share / ".ready").read_text())["plan"], shapes)
    assert tier.ready(store)[0] is not None and tier.load(store).weights.keys() == shapes.keys()

    overlap_second_tensor(weights)
    assert tier.ready(store)[0] is not None  # same size: the sentinel still counts
    with pytest.raises(FormatError, match=f"{weights}: header entry"):
        tier.load(store)
    # sharded_load warns naming the file, reads its share from the store and rebuilds the tier (the edit gave the
    # file a new identity, so the launch finds it by its hash before its header is read)
    caplog.set_level(logging.DEBUG, logger="squishlike")
    with pytest.warns(UserWarning, match=re.escape(f"{weights}: xxh3 differs")):
        again = flat_params(squishlike.sharded_load(tmp_path / "store", tensor_group=Group(1, 2))[0])
    assert _records(caplog)[0]["tier"] == "store"
    assert all(mx.array_equal(again[n], first[n]).item() for n in first)
    assert tier.load(store).weights.keys() == shapes.keys()


def test_models_without_sharding_are_refused_as_mlx_lm_refuses_them(tmp_path, tokenizer_dir):
    src = make_hf_model(tmp_path / "gemma", TINY_CONFIGS["gemma3_text"], tokenizer_dir)
    squishlike.compress(src, tmp_path / "store", scheme="int8", tiers=[])
    with pytest.raises(ValueError, match="does not support tensor parallelism"):
        squishlike.sharded_load(tmp_path / "store", tensor_group=Group(0, 2))
    with pytest.raises(ValueError, match="does not support any sharding"):
        squishlike.sharded_load(tmp_path / "store")
    assert not (tmp_path / "store" / "shards").exists()


def test_a_share_keeps_what_the_models_cast_rules_keep_in_float32(tmp_path, tokenizer_dir):
    """qwen3_5 as mlx_lm.convert writes it in bfloat16 keeps A_log in float32 (its cast_predicate): each rank's
    share holds its part of A_log in float32, the stored values, as the whole model from squishlike.load does."""
    import mlx_lm
    from support.arch_sweep import ARCH_CONFIGS

    source = make_hf_model(tmp_path / "f32", ARCH_CONFIGS["qwen3_5"], tokenizer_dir)
    mlx_lm.convert(str(source), mlx_path=str(tmp_path / "src"), dtype="bfloat16")
    store = squishlike.compress(tmp_path / "src", tmp_path / "store", scheme="int8", tiers=[])
    name = "language_model.model.layers.0.linear_attn.A_log"
    whole = flat_params(squishlike.load(store)[0])[name]
    assert whole.dtype == mx.float32
    for rank in range(2):
        share = flat_params(squishlike.sharded_load(store, tensor_group=Group(rank, 2))[0])
        assert share[name].dtype == mx.float32
        assert mx.array_equal(share[name], mx.split(whole, 2)[rank]).item()
