"""The GGUF reader: tiny GGUFs written by gguf-py's GGUFWriter, broken files, and the real SmolLM2 GGUF checked
against llama.cpp's own predictions (tests/support/fixtures/smollm2_llamacpp_reference.json)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from support.fixtures.gguf_models import CONFIGS, random_model, write_gguf
from mlx_lm.utils import _get_classes, load_tokenizer

from squishlike.errors import FormatError, MissingTensorError
from squishlike.formats import detect_format
from squishlike.formats.gguf import GGUFReader
from squishlike.provider import WeightProvider, open_weights

Q = gguf.GGMLQuantizationType
FIXTURES = Path(__file__).resolve().parents[1] / "support" / "fixtures"
TOKENS = [[1, 5, 9, 120, 31, 7, 64, 100, 3, 3, 127, 17]]  # < 128: the tiny GPT-2 vocabulary

# mean |error| / mean |w| of each type on the tiny model's weights (a wrong block layout gives ~1.4)
ROUNDING = {
    Q.F32: 0, Q.F16: 1e-3, Q.BF16: 5e-3, Q.Q8_0: 0.01, Q.Q6_K: 0.03, Q.Q5_0: 0.05, Q.Q5_1: 0.05, Q.Q4_0: 0.1,
    Q.Q4_1: 0.1,
}


def model_from(provider: WeightProvider, read=None):
    """An mlx_lm model (float32) built from the provider's weights; `read(name)` replaces `provider.get`."""
    config = provider.config.to_dict()
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    read = read or provider.get
    model.load_weights([(provider.mlx_name(n), read(n).astype(mx.float32)) for n in provider.names()])
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("qtype", list(ROUNDING), ids=lambda q: q.name)
def test_every_type_reads_back_as_ggufs_own_dequantization(tmp_path, qtype):
    _, config, weights = random_model("llama")
    path = write_gguf(tmp_path / "tiny.gguf", config, weights, lambda name, array: qtype)
    reference = gguf.GGUFReader(path)
    with GGUFReader(path) as reader:
        infos = reader.tensors()
        for tensor in reference.tensors:
            ours = reader.read(tensor.name)
            expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            assert ours.shape == infos[tensor.name].shape == expected.shape
            np.testing.assert_array_equal(np.asarray(ours.astype(mx.float32)), expected)
        matrix = infos["blk.0.ffn_down.weight"]
        assert matrix.shape == (256, 512)  # numpy order: reversed GGUF dims
        assert matrix.quantized == (qtype not in (Q.F32, Q.F16, Q.BF16))
        assert matrix.dtype == {Q.F32: "float32", Q.F16: "float16", Q.BF16: "bfloat16"}.get(qtype, qtype.name)
        as_stored = {Q.F16: mx.float16, Q.BF16: mx.bfloat16}.get(qtype, mx.float32)  # quantized: float32
        assert reader.read("blk.0.ffn_down.weight").dtype == as_stored
    # and close to the weights that went in: the layout is right, not only equal to itself
    with open_weights(path) as provider:
        for name, w in weights.items():
            error = mx.abs(provider.get(name).astype(mx.float32) - w).mean() / mx.abs(w).mean()
            assert error.item() <= (ROUNDING[qtype] if w.ndim == 2 else 0), name


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_gguf_gives_the_models_own_logits(tmp_path, model_type):
    """Written as llama.cpp's converter writes (Llama Q/K permuted, Gemma norms +1), read back canonical."""
    model, config, weights = random_model(model_type)
    path = write_gguf(tmp_path / "tiny.gguf", config, weights)
    expected = model(mx.array(TOKENS))
    with open_weights(path) as provider:
        assert provider.format == "gguf"
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "vocab_size", "max_position_embeddings", "rms_norm_eps", "layer_norm_eps", "rope_theta"):
            assert getattr(provider.config, key) == getattr(config, key), key
        assert mx.allclose(model_from(provider)(mx.array(TOKENS)), expected, atol=1e-5)
        if model_type in ("llama", "mistral", "gemma3_text"):
            # the values really are stored differently: taken as stored, the logits change
            as_stored = model_from(provider, read=lambda n: provider.reader.read(provider.source_name(n)))
            assert not mx.allclose(as_stored(mx.array(TOKENS)), expected, atol=1e-2)


def test_tokenizer_in_the_metadata_becomes_side_files(tmp_path):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    _, config, weights = random_model("llama")
    alphabet = list(bytes_to_unicode().values())
    tokenizer = {
        "model": "gpt2",
        "pre": "default",
        "tokens": [*alphabet, "hi", "<s>", "</s>"],
        "token_type": [1] * 257 + [3, 3],
        "merges": ["h i"],
        "bos_token_id": 257,
        "eos_token_id": 258,
        "add_bos_token": True,
    }
    path = write_gguf(tmp_path / "tiny.gguf", config, weights, tokenizer=tokenizer)
    with open_weights(path) as provider:
        written = provider.write_side_files(tmp_path / "side")
    assert sorted(p.name for p in written) == sorted(
        ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"]
    )
    assert json.loads((tmp_path / "side" / "generation_config.json").read_text()) == {
        "bos_token_id": 257, "eos_token_id": 258
    }
    loaded = load_tokenizer(tmp_path / "side")
    assert loaded.encode("hi hi") == [257, 256, alphabet.index("Ġ"), 256]  # BOS first, as add_bos_token says
    assert loaded.decode(loaded.encode("hi hi"), skip_special_tokens=True) == "hi hi"
    assert loaded.eos_token_id == 258


# --- broken files: FormatError naming the file ---------------------------------------------------------------------


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    _, config, weights = random_model("llama")
    return write_gguf(tmp_path / "tiny.gguf", config, weights, tokenizer={"tokens": ["a", "b", "c"]})


def patch(path: Path, offset: int, value: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + len(value)] = value
    path.write_bytes(bytes(data))


def tensor_record_offset(path: Path, index: int = -1) -> int:
    """Where tensor `index`'s info record holds its ggml type (u32), followed by its data offset (u64)."""
    tensor = gguf.GGUFReader(path).tensors[index]
    return tensor.field.offset + 8 + len(tensor.name.encode()) + 4 + 8 * len(tensor.shape)


def assert_format_error(path: Path, match: str) -> None:
    with pytest.raises(FormatError, match=match) as error:
        GGUFReader(path)
    assert str(path) in str(error.value)


def test_bad_magic(tiny_gguf):
    patch(tiny_gguf, 0, b"GGUX")
    assert_format_error(tiny_gguf, "bad magic")
    assert not GGUFReader.detect(tiny_gguf)


def test_detected_by_content_not_by_name(tiny_gguf):
    renamed = tiny_gguf.rename(tiny_gguf.with_name("weights.bin"))
    assert detect_format(renamed) is GGUFReader


def test_unknown_version(tiny_gguf):
    patch(tiny_gguf, 4, (4).to_bytes(4, "little"))
    assert_format_error(tiny_gguf, "version 4")


def test_version_2_reads(tiny_gguf):
    expected = GGUFReader(tiny_gguf).read("blk.1.attn_q.weight")
    patch(tiny_gguf, 4, (2).to_bytes(4, "little"))
    reader = GGUFReader(tiny_gguf)
    assert reader.version == 2
    assert mx.array_equal(reader.read("blk.1.attn_q.weight"), expected)


@pytest.mark.parametrize("where", ["metadata", "tensor infos", "tensor data", "last byte"])
def test_truncated(tiny_gguf, where):
    reference = gguf.GGUFReader(tiny_gguf)
    data_end = max(t.data_offset + t.n_bytes for t in reference.tensors)
    cut = {
        "metadata": 100,
        "tensor infos": reference.tensors[-1].field.offset + 4,
        "tensor data": data_end // 2,
        "last byte": data_end - 1,
    }[where]
    tiny_gguf.write_bytes(tiny_gguf.read_bytes()[:cut])
    assert_format_error(tiny_gguf, "unreadable GGUF")


def test_tensor_offset_beyond_the_file(tiny_gguf):
    patch(tiny_gguf, tensor_record_offset(tiny_gguf) + 4, (1 << 40).to_bytes(8, "little"))
    assert_format_error(tiny_gguf, "past the end of the file")


def test_unknown_tensor_type(tiny_gguf):
    patch(tiny_gguf, tensor_record_offset(tiny_gguf), (200).to_bytes(4, "little"))
    assert_format_error(tiny_gguf, "200")


def test_absurd_counts(tiny_gguf):
    original = tiny_gguf.read_bytes()
    patch(tiny_gguf, 8, (1 << 62).to_bytes(8, "little"))  # tensor count
    assert_format_error(tiny_gguf, "past the end of the file")
    tiny_gguf.write_bytes(original)
    field = gguf.GGUFReader(tiny_gguf).fields["tokenizer.ggml.tokens"]
    patch(tiny_gguf, field.offset + 8 + len(field.name) + 4 + 4, (1 << 60).to_bytes(8, "little"))  # array length
    assert_format_error(tiny_gguf, "claims 1152921504606846976 items")


def test_absurd_length_of_a_number_array(tmp_path):
    # gguf-py steps over a number array item by item, each read past the end silently empty: it would loop 2**60
    # times. The walk before it refuses the length.
    key = b"llama.rope.dimension_sections"
    header = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    record = len(key).to_bytes(8, "little") + key + int(gguf.GGUFValueType.ARRAY).to_bytes(4, "little")
    record += int(gguf.GGUFValueType.INT32).to_bytes(4, "little") + (1 << 60).to_bytes(8, "little")
    path = tmp_path / "numbers.gguf"
    path.write_bytes(header + record + bytes(16))
    assert_format_error(path, "claims 1152921504606846976 items")


def test_type_gguf_py_cannot_dequantize(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "ints.gguf", "llama")
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.int32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(FormatError, match=r"ints\.gguf: token_embd\.weight: tensor type I32 is not supported"):
        GGUFReader(tmp_path / "ints.gguf").read("token_embd.weight")
    with pytest.raises(MissingTensorError, match="output.weight"):
        GGUFReader(tmp_path / "ints.gguf").read("output.weight")


# --- the real SmolLM2-135M GGUF ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm(smollm_gguf):
    with open_weights(smollm_gguf) as provider:
        yield provider, model_from(provider)


@pytest.mark.smollm
def test_smollm2_config_and_names(smollm):
    provider, _ = smollm
    config = provider.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert (config.hidden_size, config.vocab_size, config.tie_word_embeddings) == (576, 49152, True)
    names = provider.names()
    for n in range(30):
        for part in ("attention_norm", "attention.q", "attention.k", "attention.v", "attention.output", "ffn_norm",
                     "ffn.gate", "ffn.up", "ffn.down"):
            assert f"layers.{n}.{part}.weight" in names
    assert names[0] == "token_embedding.weight" and names[-1] == "output_norm.weight"
    assert not provider.has("output.weight")
    rows = {row["canonical"]: row for row in provider.listing()}
    assert rows["token_embedding.weight"]["dtype"] == "Q8_0"
    assert rows["layers.0.attention.q.weight"] == {
        "canonical": "layers.0.attention.q.weight", "source": "blk.0.attn_q.weight", "dtype": "Q4_1",
        "shape": (576, 576), "nbytes": 576 * 576 // 32 * 20,
    }


@pytest.mark.smollm
def test_smollm2_tokenizer_from_metadata(smollm, tmp_path):
    provider, _ = smollm
    provider.write_side_files(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    text = "In 2024, the harbour town of St. Ives counted 12345 visitors!"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert ids[:6] == [788, 216, 34, 32, 34, 36]  # llama.cpp's "smollm" split: one token per digit
    reference = json.loads((FIXTURES / "smollm2_llamacpp_reference.json").read_text())
    assert tokenizer.encode((FIXTURES / "reference_prose.txt").read_text()) == reference["tokens"]  # as llama.cpp
    hi = [{"role": "user", "content": "Hi"}]
    chat = tokenizer.apply_chat_template(hi, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in chat and chat.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.smollm
def test_smollm2_answers_paris(smollm, tmp_path):
    from mlx_lm import generate

    provider, model = smollm
    provider.write_side_files(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    assert "Paris" in generate(model, tokenizer, prompt, max_tokens=12)


def teacher_forced(model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(top-1 prediction, log-probability of the actual next token) at every position but the last."""
    logits = model(mx.array([tokens]))[0, :-1].astype(mx.float32)
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    actual = mx.take_along_axis(log_probs, mx.array(tokens[1:])[:, None], axis=-1)[:, 0]
    return np.asarray(mx.argmax(logits, axis=-1)), np.asarray(actual)


# On 2 CPU cores mlx's float32 matmuls are slow (~8 s per 64 tokens for SmolLM2): compare a prefix of the fixture.
REFERENCE_TOKENS = 128


@pytest.mark.smollm
def test_smollm2_agrees_with_llama_cpp(smollm, smollm_gguf):
    _, model = smollm
    reference = json.loads((FIXTURES / "smollm2_llamacpp_reference.json").read_text())
    assert hashlib.sha256(smollm_gguf.read_bytes()).hexdigest() == reference["model_sha256"], "not the recorded file"
    tokens = reference["tokens"][:REFERENCE_TOKENS]
    top1, log_probs = teacher_forced(model, tokens)
    agreement = float(np.mean(top1 == np.array(reference["top1"][: len(top1)])))
    ours = math.exp(-log_probs.mean())
    theirs = math.exp(-np.mean(reference["log_prob_next"][: len(log_probs)]))
    assert agreement >= 0.90, agreement
    assert abs(ours / theirs - 1) <= 0.02, (ours, theirs)


@pytest.mark.smollm
def test_smollm2_without_the_inverse_permutation_is_far_worse(smollm):
    provider, _ = smollm
    reference = json.loads((FIXTURES / "smollm2_llamacpp_reference.json").read_text())
    tokens = reference["tokens"][:64]
    as_stored = model_from(provider, read=lambda n: provider.reader.read(provider.source_name(n)))
    top1, log_probs = teacher_forced(as_stored, tokens)
    theirs = math.exp(-np.mean(reference["log_prob_next"][: len(log_probs)]))
    assert math.exp(-log_probs.mean()) > 3 * theirs  # measured: 245 against 53
    assert np.mean(top1 == np.array(reference["top1"][: len(top1)])) < 0.6  # measured: 0.38 (0.98 unpermuted)
