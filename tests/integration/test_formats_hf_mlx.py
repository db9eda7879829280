"""HF and MLX safetensors directories, built by mlx_lm itself from a tiny random llama, read back tensor by tensor."""

from __future__ import annotations

import json
import resource
import struct
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from squishlike.errors import FormatError
from squishlike.formats import detect_format, open_reader
from squishlike.formats.mlx import MLXReader
from squishlike.formats.safetensors import HFReader
from squishlike.model import build_model
from support.tiny_models import TINY_CONFIGS, make_hf_model

LLAMA = TINY_CONFIGS["llama"]
PROMPT = mx.array([[1, 5, 9, 200, 3, 77]])


def hf_llama(directory: Path, tokenizer_dir: Path, dtype: mx.Dtype = mx.float32, shards: int = 1) -> dict:
    """The suite's tiny llama (tests/support/tiny_models.py) as an HF directory, split into `shards` files and an index
    when more than one; returns the weights written (name -> mx.array)."""
    make_hf_model(directory, LLAMA, tokenizer_dir, dtype)
    single = directory / "model.safetensors"
    weights = mx.load(str(single))
    mx.eval(weights)
    if shards == 1:
        return weights
    names = sorted(weights)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: weights[name] for name in names[i::shards]}
        mx.save_safetensors(str(directory / shard), part, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single.unlink()
    return weights


def assert_bit_equal(a: mx.array, b: mx.array) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = {2: mx.uint16, 4: mx.uint32, 1: mx.uint8}[a.dtype.size]
    assert mx.array_equal(a.view(bits), b.view(bits)).item()


# ---------------------------------------------------------------------------------------------- HF


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shards", [1, 2])
def test_hf_reads_every_tensor_exactly(tmp_path, tokenizer_dir, dtype, shards):
    weights = hf_llama(tmp_path, tokenizer_dir, dtype, shards)
    assert detect_format(tmp_path) is HFReader
    with open_reader(tmp_path) as reader:
        infos = reader.tensors()
        assert set(infos) == set(weights)
        for name, expected in weights.items():
            assert infos[name].shape == expected.shape and infos[name].nbytes == expected.nbytes
            assert infos[name].dtype == str(dtype).removeprefix("mlx.core.") and not infos[name].quantized
            assert_bit_equal(reader.read(name), expected)
        assert reader.config()["hidden_size"] == LLAMA["hidden_size"]


def test_hf_side_files_are_copied(tmp_path, tokenizer_dir):
    hf_llama(tmp_path / "src", tokenizer_dir)
    (tmp_path / "src" / "chat_template.jinja").write_text("{{ messages }}")
    (tmp_path / "src" / "notes.txt").write_text("not a side file")
    written = HFReader(tmp_path / "src").write_side_files(tmp_path / "out")
    names = {p.name for p in written}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    assert "notes.txt" not in names and not (tmp_path / "out" / "notes.txt").exists()
    for p in written:
        assert p.read_bytes() == (tmp_path / "src" / p.name).read_bytes()


def raw_safetensors(path: Path, header: dict | bytes, data: bytes = b"", header_len: int | None = None) -> None:
    """A safetensors file written byte by byte, so its header can say anything."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


def test_hf_reading_one_tensor_reads_only_its_bytes(tmp_path):
    """Beside a 16-byte tensor lies a 1 GiB one (a sparse hole: no disk, but 1 GiB of memory if anything reads it)."""
    small = mx.array([1.5, -2.0, 3.25, 4.0])
    big_bytes = 1 << 30
    header = {
        "small": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "big": {"dtype": "F32", "shape": [big_bytes // 4], "data_offsets": [16, 16 + big_bytes]},
    }
    path = tmp_path / "model.safetensors"
    raw_safetensors(path, header, bytes(memoryview(small)))
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) + big_bytes)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))

    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with HFReader(tmp_path) as reader:
        assert reader.tensors()["big"].nbytes == big_bytes
        value = reader.read("small")
        mx.eval(value)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert mx.array_equal(value, small).item()
    assert grown < 128 << 10, f"peak memory grew by {grown >> 10} MiB reading a 16-byte tensor"


F32_PAIR = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
BAD_FILES = {
    "header length beyond the file": dict(header=F32_PAIR, data=bytes(8), header_len=10_000),
    "header length huge": dict(header=F32_PAIR, data=bytes(8), header_len=1 << 62),
    "invalid JSON header": dict(header=b'{"a": {"dtype": "F32", "shape": [2], ', data=bytes(8)),
    "overlapping offsets": dict(
        header={**F32_PAIR, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, data=bytes(12)
    ),
    "offsets out of range": dict(
        header={**F32_PAIR, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, data=bytes(12)
    ),
    "offsets not matching dtype x shape": dict(
        header={"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, data=bytes(8)
    ),
    "unknown dtype": dict(header={"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, data=bytes(8)),
    "dtype MLX cannot hold": dict(
        header={"a": {"dtype": "F8_E4M3", "shape": [8], "data_offsets": [0, 8]}}, data=bytes(8)
    ),
}


@pytest.mark.parametrize("case", BAD_FILES, ids=list(BAD_FILES))
def test_hf_bad_file_is_a_format_error_naming_it(tmp_path, case):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    raw_safetensors(tmp_path / "model.safetensors", **BAD_FILES[case])
    assert detect_format(tmp_path) is HFReader
    with pytest.raises(FormatError) as error:
        open_reader(tmp_path)
    assert str(tmp_path / "model.safetensors") in str(error.value)


def test_hf_index_naming_a_missing_shard(tmp_path, tokenizer_dir):
    hf_llama(tmp_path, tokenizer_dir, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FormatError) as error:
        HFReader(tmp_path)
    message = str(error.value)
    assert str(tmp_path / "model.safetensors.index.json") in message and "model-00002-of-00002" in message


def test_hf_index_placing_a_tensor_in_the_wrong_shard(tmp_path, tokenizer_dir):
    hf_llama(tmp_path, tokenizer_dir, shards=2)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, shard = next(iter(index["weight_map"].items()))
    other = next(s for s in index["weight_map"].values() if s != shard)
    index["weight_map"][name] = other
    index_path.write_text(json.dumps(index))
    with pytest.raises(FormatError, match=name):
        HFReader(tmp_path)


# ---------------------------------------------------------------------------------------------- MLX


def convert(tmp_path: Path, tokenizer_dir: Path, **quantize_args) -> tuple[Path, dict[str, mx.array]]:
    """An MLX directory written by mlx_lm.convert from a tiny HF llama; returns it and the HF weights."""
    weights = hf_llama(tmp_path / "hf", tokenizer_dir)
    mlx_lm.convert(str(tmp_path / "hf"), str(tmp_path / "mlx"), quantize=True, **quantize_args)
    return tmp_path / "mlx", weights


def stored(directory: Path) -> dict[str, mx.array]:
    """Every array of an MLX directory as mlx_lm saved it."""
    out = {}
    for path in directory.glob("model*.safetensors"):
        out.update(mx.load(str(path)))
    return out


def check_triples(directory: Path, hf_weights: dict[str, mx.array], expected_dtypes: dict[str, str]) -> None:
    """Each listed tensor has its HF shape; each triple dequantizes to exactly mx.dequantize of what is stored."""
    raw = stored(directory)
    quantization = json.loads((directory / "config.json").read_text())["quantization"]
    assert detect_format(directory) is MLXReader
    with MLXReader(directory) as reader:
        infos = reader.tensors()
        assert set(infos) == set(hf_weights)
        for name, info in infos.items():
            assert info.shape == hf_weights[name].shape
            layer = name.removesuffix(".weight")
            assert info.dtype == expected_dtypes.get(name, "float32"), name
            if not info.quantized:
                assert reader.read_quantized(name) is None
                assert_bit_equal(reader.read(name), raw[name])
                continue
            params = quantization.get(layer, quantization)
            mode = params.get("mode", "affine")
            expected = mx.dequantize(
                raw[name], raw[f"{layer}.scales"], raw.get(f"{layer}.biases"),
                group_size=params["group_size"], bits=params["bits"], mode=mode,
            )
            triple = reader.read_quantized(name)
            assert (triple.group_size, triple.bits, triple.mode) == (params["group_size"], params["bits"], mode)
            assert_bit_equal(triple.weight, raw[name])
            assert_bit_equal(triple.scales, raw[f"{layer}.scales"])
            assert (triple.biases is None) == (mode != "affine")
            assert_bit_equal(reader.read(name), expected)
            parts = [f"{layer}.weight", f"{layer}.scales", f"{layer}.biases"]
            assert info.nbytes == sum(raw[p].nbytes for p in parts if p in raw)


def quantized_layers(hf_weights: dict[str, mx.array]) -> list[str]:
    """The weights mlx_lm quantizes in a llama: every Linear and the embedding (norms stay float)."""
    return [n for n, w in hf_weights.items() if w.ndim == 2]


def test_mlx_4bit_directory_from_mlx_lm_convert(tmp_path, tokenizer_dir):
    directory, hf_weights = convert(tmp_path, tokenizer_dir, q_bits=4, q_group_size=64)
    check_triples(directory, hf_weights, dict.fromkeys(quantized_layers(hf_weights), "affine4"))


def test_mlx_per_layer_overrides(tmp_path, tokenizer_dir):
    def predicate(path, module):
        if path == "model.layers.0.mlp.down_proj":
            return {"group_size": 32, "bits": 8}
        return path != "model.layers.1.self_attn.v_proj"

    directory, hf_weights = convert(tmp_path, tokenizer_dir, q_bits=4, q_group_size=64, quant_predicate=predicate)
    quantization = json.loads((directory / "config.json").read_text())["quantization"]
    assert quantization["model.layers.0.mlp.down_proj"] == {"group_size": 32, "bits": 8}
    expected = dict.fromkeys(quantized_layers(hf_weights), "affine4")
    expected["model.layers.0.mlp.down_proj.weight"] = "affine8"
    del expected["model.layers.1.self_attn.v_proj.weight"]
    check_triples(directory, hf_weights, expected)


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8"])
def test_mlx_microscaling_modes(tmp_path, tokenizer_dir, mode):
    directory, hf_weights = convert(tmp_path, tokenizer_dir, q_mode=mode)
    check_triples(directory, hf_weights, dict.fromkeys(quantized_layers(hf_weights), mode))


def test_mlx_stored_parts_that_disagree_are_a_format_error(tmp_path, tokenizer_dir):
    directory, _ = convert(tmp_path, tokenizer_dir, q_bits=4, q_group_size=64)
    config = json.loads((directory / "config.json").read_text())
    config["quantization"]["bits"] = 8  # the stored words hold 4-bit values
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match="do not fit"):
        MLXReader(directory)


def test_mlx_model_from_reader_matches_mlx_lm_load(tmp_path, tokenizer_dir):
    directory, _ = convert(tmp_path, tokenizer_dir, q_bits=4, q_group_size=64)
    reference, _ = mlx_lm.load(str(directory))
    with MLXReader(directory) as reader:
        weights = {}
        for name in reader.tensors():
            triple = reader.read_quantized(name)
            if triple is None:
                weights[name] = reader.read(name)
                continue
            layer = name.removesuffix(".weight")
            weights[name], weights[f"{layer}.scales"], weights[f"{layer}.biases"] = (
                triple.weight, triple.scales, triple.biases
            )
        model = build_model(reader.config(), weights)
    assert mx.array_equal(model(PROMPT), reference(PROMPT)).item()
