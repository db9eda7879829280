"""The npy-dir format module: the scheme table against the Rust crate, the NumPy spec and mx.quantize; the
manifest's lossless round trip; and its strict validation, one typed error per kind of damage."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import rust_quant

import squishlike
from squishlike.errors import FormatError
from squishlike.npydir import SCHEMES, Manifest, NpyDir, Role, read_source
from squishlike.quant import reference as ref
from squishlike.quant.schemes import WIDTHS
from support.fixtures import FORMAT1_STORE

# ---------------------------------------------------------------------------------------------------------------
# the scheme table


@pytest.mark.parametrize("scheme", ["int8", "int8g", "int4", "int3", "int2", "int5", "int6"])
def test_scheme_table_is_the_rust_crates(scheme):
    rust, table = rust_quant.SCHEMES[scheme], SCHEMES[scheme]
    assert (table.bits, table.group_sizes, table.block, table.block_words) == (
        rust["bits"], tuple(rust["group_sizes"]), rust["block"], rust["block_words"])
    assert table.word == np.dtype(rust["word"])


@pytest.mark.parametrize("scheme,levels,group_sizes,pack", [
    ("int8g", ref.INT8G_LEVELS, ref.INT8G_GROUP_SIZES, np.ascontiguousarray),  # one code per byte
    ("int4", ref.INT4_LEVELS, ref.INT4_GROUP_SIZES, ref.pack_int4),
    *((f"int{b}", 2**b - 1, ref.INT3_GROUP_SIZES, functools.partial(ref.pack_bits, bits=b)) for b in (2, 3, 5, 6)),
])
def test_scheme_table_agrees_with_the_numpy_spec(scheme, levels, group_sizes, pack):
    table = SCHEMES[scheme]
    assert 2**table.bits - 1 == levels and table.group_sizes == group_sizes
    for cols in (32, 64, 96, 256):
        packed = pack(np.zeros((3, cols), np.uint8))
        assert packed.dtype == table.word and packed.shape == (3, table.packed_cols(cols))
        assert table.unpacked_cols(packed.shape[1]) == cols


@pytest.mark.parametrize("scheme", ["int8g", "int4", "int3", "int2", "int5", "int6"])
def test_scheme_table_agrees_with_mx_quantize(scheme):
    """The group sizes are exactly those mx.quantize takes, and the packed width fills its uint32 words."""
    table = SCHEMES[scheme]
    w = mx.random.normal((4, 256))
    accepted = []
    for group in (8, 16, 32, 64, 128, 256):
        try:
            words, _, _ = mx.quantize(w, group_size=group, bits=table.bits)
        except ValueError:
            continue
        accepted.append(group)
        assert words.shape[-1] == table.uint32_cols(256)
    assert tuple(accepted) == table.group_sizes


def test_widths_name_the_group_wise_scheme_of_each_width():
    assert {bits: SCHEMES[scheme].bits for bits, scheme in WIDTHS.items()} == {b: b for b in WIDTHS}
    assert all(SCHEMES[scheme].grouped for scheme in WIDTHS.values())


def test_part_specs_follow_the_tensor_shape():
    int4 = SCHEMES["int4"]
    assert [p.role for p in int4.parts] == [Role.CODES, Role.GROUP_SCALES, Role.GROUP_SCALES]
    assert int4.part_spec(Role.CODES, (2, 3, 64)) == (np.dtype(np.uint8), (6, 32))
    assert int4.part_spec(Role.GROUP_SCALES, (2, 3, 64), group_size=32, scale_dtype="bfloat16") == (
        np.dtype(np.uint16), (6, 2))
    assert SCHEMES["int8"].part_spec(Role.ROW_SCALES, (5, 7)) == (np.dtype(np.float32), (5,))
    assert SCHEMES["passthrough"].part_spec(Role.STORED, (5, 7), stored_dtype="float16") == (
        np.dtype(np.float16), (5, 7))


# ---------------------------------------------------------------------------------------------------------------
# the manifest


@pytest.fixture(scope="module")
def stores(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    from support.tiny_models import TINY_CONFIGS, make_hf_model

    root = tmp_path_factory.mktemp("npydir")
    src = make_hf_model(root / "src", TINY_CONFIGS["llama"], tokenizer_dir)
    options = {"int8": {"scheme": "int8", "group_size": "row"}, "int8g": {"scheme": "int8"},
               "int4": {"scheme": "int4"}, "int3": {"scheme": "int3"}}  # by the scheme they store
    return {
        scheme: squishlike.compress(src, root / scheme, int3_gate=False, passthrough=("layers.0.*",), **kwargs)
        for scheme, kwargs in options.items()
    }


@pytest.mark.parametrize("scheme", ["int8", "int8g", "int4", "int3"])
def test_manifest_round_trip_is_lossless(stores, scheme):
    path = stores[scheme] / "manifest.json"
    raw = json.loads(path.read_text())
    manifest = Manifest.from_json(raw, path)
    assert manifest.to_json() == raw
    assert manifest.schemes == {scheme, "passthrough"} and manifest.scheme == scheme
    entry = manifest.tensors["layers.1.attention.q.weight"]
    assert entry.scheme == scheme and entry.error is not None and entry.error.rel_error < 0.5
    assert (entry.group_size is not None) == (scheme != "int8")
    assert manifest.format_version == 2
    assert set(manifest.part_files()) == {r.pack for e in manifest.tensors.values() for r in e.files.values()}
    assert all((stores[scheme] / rel).is_file() for rel in manifest.part_files())
    # one pack per block: the two layers, and the tensors before and after them
    assert len(manifest.part_files()) == 4


def test_manifest_of_a_store_written_before_xxh3_still_reads(stores):
    """A record without the fast hash is valid and stays without it: the cold path then checks SHA-256."""
    path = stores["int4"] / "manifest.json"
    raw = json.loads(path.read_text())
    for record in [*raw["side_files"].values(), *raw["packs"].values()]:
        assert len(record.pop("xxh3")) == 32
    manifest = Manifest.from_json(raw, path)
    assert manifest.to_json() == raw
    assert all(set(r.hashes) == {"sha256"} for r in manifest.part_files().values())


def test_manifest_keeps_unknown_top_level_records(stores):
    path = stores["int4"] / "manifest.json"
    raw = json.loads(path.read_text()) | {"awq": {"applied": False}, "int3_gate": {"passed": False}}
    manifest = Manifest.from_json(raw, path)
    assert manifest.extra["awq"] == {"applied": False} and manifest.int3_passed is False
    assert manifest.to_json() == raw


def test_read_source_names_the_model_compressed(stores):
    source = read_source(stores["int4"])
    assert source == NpyDir(stores["int4"]).manifest.source
    assert Path(source.path).is_dir() and source.format == "hf" and len(source.fingerprint) == 64
    assert read_source(stores["int4"] / "tensors") is None


def _first(m: dict, scheme: str) -> dict:
    return next(e for e in m["tensors"].values() if e["scheme"] == scheme)


DAMAGE = {
    "tensors not a table": lambda m: m.update(tensors=[]),
    "model_type missing": lambda m: m.pop("model_type"),
    "source not an object": lambda m: m.update(source="/somewhere"),
    "source without fingerprint": lambda m: m["source"].pop("fingerprint"),
    "policy tiers not a list": lambda m: m["policy"].update(tiers="mlx"),
    "group_size a bool": lambda m: m.update(group_size=True),
    "side file in a subdirectory": lambda m: m["side_files"].update({"a/b.json": {"size": 1, "sha256": "0"}}),
    "side file record without size": lambda m: next(iter(m["side_files"].values())).pop("size"),
    "entry without key": lambda m: _first(m, "int4").pop("key"),
    "key of another tensor": lambda m: _first(m, "int4").update(key="output_norm.weight"),
    "shape not a list": lambda m: _first(m, "int4").update(shape=12),
    "int4 without scale_dtype": lambda m: _first(m, "int4").pop("scale_dtype"),
    "int4 scale_dtype unknown": lambda m: _first(m, "int4").update(scale_dtype="int8"),
    "group_size not dividing the columns": lambda m: _first(m, "int4").update(group_size=48),
    "passthrough without stored_dtype": lambda m: _first(m, "passthrough").pop("stored_dtype"),
    "pack without sha256": lambda m: next(iter(m["packs"].values())).pop("sha256"),
    "pack xxh3 a number": lambda m: next(iter(m["packs"].values())).update(xxh3=12),
    "an extra part": lambda m: _first(m, "int4")["files"].update(q3=_first(m, "int4")["files"]["q4"]),
    "part too small for its shape": lambda m: _first(m, "int4")["files"]["q4"].update(size=1),
    "part larger than its shape": lambda m: _first(m, "int4")["files"]["q4"].update(
        size=_first(m, "int4")["files"]["q4"]["size"] + 1),
    "part size negative": lambda m: _first(m, "int4")["files"]["s4"].update(size=-1),
    "part at another offset": lambda m: _first(m, "int4")["files"]["s4"].update(
        offset=_first(m, "int4")["files"]["q4"]["offset"]),
    "part offset a string": lambda m: _first(m, "int4")["files"]["s4"].update(offset="0"),
    "part in an unlisted pack": lambda m: _first(m, "int4")["files"]["s4"].update(pack="tensors/pack-09999.safetensors"),
    "part without its pack": lambda m: _first(m, "int4")["files"]["s4"].pop("pack"),
    "pack holding no part": lambda m: m["packs"].update({"tensors/pack-09999.safetensors": {"size": 1, "sha256": "0"}}),
    "pack outside tensors/": lambda m: m["packs"].update({"../pack-00000.safetensors": {"size": 1, "sha256": "0"}}),
    "pack of another size": lambda m: next(iter(m["packs"].values())).update(size=1 << 20),
    "packs not a table": lambda m: m.update(packs=[]),
    "a format version not written yet": lambda m: m.update(format_version=3),
    "format version a bool": lambda m: m.update(format_version=True),
    "error stats not an object": lambda m: _first(m, "int4").update(error=0.1),
}

# Format 1 (one .npy per part), on the store kept from the format-1 writer.
FORMAT1_DAMAGE = {
    "part without sha256": lambda m: _first(m, "int4")["files"]["q4"].pop("sha256"),
    "part xxh3 a number": lambda m: _first(m, "int4")["files"]["q4"].update(xxh3=12),
    "an extra part": lambda m: _first(m, "int4")["files"].update(q3={"size": 1, "sha256": "0"}),
    "part too small for its shape": lambda m: _first(m, "int4")["files"]["q4"].update(size=1),
}


INT8G_DAMAGE = {
    "per-row parts under int8g": lambda e: e.update(files={"q": e["files"]["q8"], "s": e["files"]["s8"]}),
    "int8g codes too small": lambda e: e["files"]["q8"].update(size=e["files"]["q8"]["size"] // 2),
    "int8g group size of no group": lambda e: e.update(group_size=0),
    "int8g without scale_dtype": lambda e: e.pop("scale_dtype"),
}


@pytest.mark.parametrize("damage", sorted(INT8G_DAMAGE))
def test_strict_validation_of_group_wise_int8_entries(stores, damage):
    path = stores["int8g"] / "manifest.json"
    raw = copy.deepcopy(json.loads(path.read_text()))
    INT8G_DAMAGE[damage](_first(raw, "int8g"))
    with pytest.raises(FormatError, match="manifest.json"):
        Manifest.from_json(raw, path)


@pytest.mark.parametrize("damage", sorted(FORMAT1_DAMAGE))
def test_strict_validation_of_format_1_names_the_manifest(damage):
    path = FORMAT1_STORE / "manifest.json"
    raw = copy.deepcopy(json.loads(path.read_text()))
    assert raw["format_version"] == 1
    Manifest.from_json(copy.deepcopy(raw), path)  # as written: valid
    FORMAT1_DAMAGE[damage](raw)
    with pytest.raises(FormatError, match="manifest.json"):
        Manifest.from_json(raw, path)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_strict_validation_names_the_manifest(stores, damage, tmp_path):
    path = stores["int4"] / "manifest.json"
    raw = copy.deepcopy(json.loads(path.read_text()))
    DAMAGE[damage](raw)
    with pytest.raises(FormatError, match="manifest.json"):
        Manifest.from_json(raw, path)
