"""The tokenizer fast path returns the very tokenizer mlx_lm's load_tokenizer builds, shown on four tokenizers: a
151k-entry Qwen2-style byte-level BPE, a SentencePiece-style one, SmolLM2's (from the GGUF) and the tiny models'."""

from __future__ import annotations

import json
import shutil

import pytest
from mlx_lm.utils import load_tokenizer
from support.tiny_models import TINY_CONFIGS, make_hf_model, make_qwen2_tokenizer, make_spm_tokenizer, make_tokenizer

import squishlike
from squishlike import tokenizer as fast_tokenizer
from squishlike.config import load_config
from squishlike.npydir import NpyDir
from squishlike.provider import WeightProvider

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "  Leading spaces, trailing spaces   ",
    "Größe, naïve café, déjà vu — «quotes» and ‘apostrophes’",
    "Привет, мир! Как дела?",
    "日本語のテキストと中文文本，你好世界。",
    "한국어 문장도 있습니다.",
    "مرحبا بالعالم",
    "Emoji: 🌍🚀👩‍💻 and a flag 🇫🇷, skin tone 👍🏽",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'fn main() { println!("{}", 1 << 3); }\t// tabs\tand\r\nCRLF',
    "Numbers 1234567890 3.14159 -42 1e-9",
    "<|im_start|>user\nhi<|im_end|> <think>inner</think> <tool_call>{}</tool_call>",
    "<s> </s> <unk> <start_of_turn>model\n<end_of_turn>",
    "<|endoftext|>",
    "",
]
MESSAGES = [
    {"role": "user", "content": "What is the capital of France? 🇫🇷"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan, 日本?"},
]
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
# What loader.py passes for a plain load: trust_remote_code off, the eos ids of config.json.
ARGUMENTS = {"trust_remote_code": False}


def _with_facts(directory, eos_token_ids=None):
    assert fast_tokenizer.write_facts(directory, ARGUMENTS, eos_token_ids) == [directory / fast_tokenizer.FACTS_FILE]
    return directory, eos_token_ids


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory, smollm_gguf):
    root = tmp_path_factory.mktemp("tokenizers")
    smollm = root / "smollm2"
    with WeightProvider.open(smollm_gguf) as provider:
        provider.write_side_files(smollm)
    return {
        "qwen2-151k": _with_facts(make_qwen2_tokenizer(root / "qwen2")),
        "sentencepiece": _with_facts(make_spm_tokenizer(root / "spm")),
        "smollm2": _with_facts(smollm, json.loads((smollm / "config.json").read_text()).get("eos_token_id")),
        "tiny": _with_facts(make_tokenizer(root / "tiny")),
    }


@pytest.fixture(params=["qwen2-151k", "sentencepiece", "smollm2", "tiny"])
def pair(request, tokenizers, monkeypatch):
    """(mlx_lm's tokenizer, the fast path's), the fast one built with mlx_lm's path made unusable."""
    directory, eos_token_ids = tokenizers[request.param]
    expected = load_tokenizer(directory, ARGUMENTS, eos_token_ids=eos_token_ids)

    def refuse(*args, **kwargs):
        raise AssertionError("the fast path fell back to mlx_lm")

    with monkeypatch.context() as m:
        m.setattr(fast_tokenizer, "load_tokenizer", refuse)
        actual = fast_tokenizer.load(directory, ARGUMENTS, eos_token_ids)
    return expected, actual


def test_encode_and_decode(pair):
    expected, actual = pair
    for text in CORPUS:
        for special in (True, False):
            ids = expected.encode(text, add_special_tokens=special)
            assert actual.encode(text, add_special_tokens=special) == ids, text
            assert actual.tokenize(text) == expected.tokenize(text)
            for skip in (True, False):
                assert actual.decode(ids, skip_special_tokens=skip) == expected.decode(ids, skip_special_tokens=skip)
    every_id = list(range(0, len(expected), 97))
    assert actual.decode(every_id) == expected.decode(every_id)
    assert actual.convert_ids_to_tokens(every_id) == expected.convert_ids_to_tokens(every_id)
    assert actual._tokenizer(CORPUS)["input_ids"] == expected._tokenizer(CORPUS)["input_ids"]


def test_special_and_added_tokens(pair):
    expected, actual = pair
    assert len(actual) == len(expected)
    assert actual.vocab_size == expected.vocab_size
    assert actual.special_tokens_map == expected.special_tokens_map
    assert actual.all_special_ids == expected.all_special_ids
    assert actual.get_added_vocab() == expected.get_added_vocab()
    assert repr(actual.added_tokens_decoder) == repr(expected.added_tokens_decoder)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "add_bos_token", "padding_side"):
        assert getattr(actual, name) == getattr(expected, name), name


def test_chat_template_with_and_without_tools(pair):
    expected, actual = pair
    assert actual.has_chat_template == expected.has_chat_template
    assert actual.chat_template == expected.chat_template
    if not expected.has_chat_template:  # the tiny models' tokenizer: both refuse alike
        for tokenizer in (expected, actual):
            with pytest.raises(ValueError, match="chat template"):
                tokenizer.apply_chat_template(MESSAGES, tokenize=False)
        return
    for kwargs in ({}, {"tools": TOOLS}, {"add_generation_prompt": True}, {"enable_thinking": False}):
        for tokenize in (False, True):
            want = expected.apply_chat_template(MESSAGES, tokenize=tokenize, **kwargs)
            assert actual.apply_chat_template(MESSAGES, tokenize=tokenize, **kwargs) == want


def test_eos_ids_and_inferred_markers(pair):
    expected, actual = pair
    assert actual.eos_token_ids == expected.eos_token_ids
    for name in ("think_start", "think_end", "think_start_tokens", "think_end_tokens", "tool_call_start",
                 "tool_call_end", "tool_call_start_tokens", "tool_call_end_tokens", "tool_parser",
                 "structural_markers", "has_thinking", "has_tool_calling", "response_initial_state"):
        assert getattr(actual, name) == getattr(expected, name), name


def test_streaming_detokenizer(pair):
    expected, actual = pair
    assert type(actual.detokenizer) is type(expected.detokenizer)
    for text in CORPUS:
        streams = []
        for tokenizer in (expected, actual):
            detokenizer = tokenizer.detokenizer
            seen = []
            for token in tokenizer.encode(text, add_special_tokens=False):
                detokenizer.add_token(token)
                seen.append((detokenizer.text, detokenizer.last_segment))
            detokenizer.finalize()
            streams.append((seen, detokenizer.text, detokenizer.tokens))
        assert streams[1] == streams[0], text


def test_stale_facts_are_ignored(tokenizers, tmp_path):
    directory = shutil.copytree(tokenizers["tiny"][0], tmp_path / "tiny")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert fast_tokenizer.load(directory, ARGUMENTS).apply_chat_template(MESSAGES, tokenize=False) == (
        load_tokenizer(directory, ARGUMENTS).apply_chat_template(MESSAGES, tokenize=False)
    )
    # Other arguments than the facts were worked out for are a different key too.
    other = {**ARGUMENTS, "model_max_length": 77}
    assert fast_tokenizer.load(directory, other).model_max_length == 77


def test_a_load_never_writes(tmp_path):
    directory = make_tokenizer(tmp_path / "tiny")
    before = sorted(p.name for p in directory.iterdir())
    fast_tokenizer.load(directory, ARGUMENTS)
    assert sorted(p.name for p in directory.iterdir()) == before


def test_what_cannot_be_shown_identical_falls_back(tmp_path, caplog):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    with caplog.at_level("DEBUG", logger="squishlike.tokenizer"):
        assert fast_tokenizer.write_facts(tmp_path, ARGUMENTS) == []
    assert "WordLevel, not BPE" in caplog.text
    assert fast_tokenizer.load(tmp_path, ARGUMENTS).encode("hello there world") == [1, 0, 2]


@pytest.mark.parametrize("generation_eos", [None, [1, 2]])
def test_compress_keeps_the_facts_and_load_uses_them(tmp_path, monkeypatch, generation_eos):
    """Also where generation_config.json sets the eos ids (as SmolLM2's does): a load passes those, config.json's
    with them over it, and the facts must be for those arguments."""
    source = make_hf_model(tmp_path / "src", TINY_CONFIGS["llama"], make_tokenizer(tmp_path / "tok"))
    if generation_eos is not None:
        (source / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    store = squishlike.compress(source, tmp_path / "store", scheme="int8", tiers=("mlx",))
    assert fast_tokenizer.FACTS_FILE in NpyDir(store).manifest.side_files
    expected = load_tokenizer(store, ARGUMENTS, eos_token_ids=load_config(store).get("eos_token_id"))
    assert generation_eos is None or set(generation_eos) <= expected.eos_token_ids
    monkeypatch.setattr(fast_tokenizer, "load_tokenizer", None)  # any fallback to mlx_lm fails the load
    _, tokenizer = squishlike.load(store)
    assert tokenizer.encode(CORPUS[2]) == expected.encode(CORPUS[2])
    assert tokenizer.eos_token_ids == expected.eos_token_ids


def test_an_auto_map_is_refused_only_when_its_class_needs_code(tmp_path):
    """tokenizer_config.json's auto_map names code; transformers runs it only for a tokenizer_class it does not
    ship. Such a source is refused before anything is written (squishlike copies no code: no store of it could
    build its tokenizer); one whose class transformers ships compresses and loads as without the auto_map."""
    from squishlike.errors import FormatError

    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    config_file = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = {"AutoTokenizer": ["custom_tok.CustomTokenizer", None]}
    config_file.write_text(json.dumps(config))  # its tokenizer_class is transformers' own
    source = make_hf_model(tmp_path / "src", TINY_CONFIGS["llama"], tokenizer_dir)
    store = squishlike.compress(source, tmp_path / "store", scheme="int8", tiers=("mlx",))
    assert squishlike.load(store)[1].encode(CORPUS[2]) == load_tokenizer(source, ARGUMENTS).encode(CORPUS[2])

    config["tokenizer_class"] = "CustomTokenizer"
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match="custom_tok.CustomTokenizer") as refused:
        squishlike.compress(source, tmp_path / "refused", scheme="int8")
    assert str(source) in str(refused.value)
    assert not (tmp_path / "refused").exists()


def test_facts_leave_the_vocabulary_to_tokenizer_json(tokenizers):
    """The facts hold what mlx_lm's path works out, not what tokenizer.json already holds (their key pins it)."""
    for directory, _ in tokenizers.values():
        facts = json.loads((directory / fast_tokenizer.FACTS_FILE).read_text())
        assert "vocab" not in facts and "merges" not in facts


def test_facts_of_a_store_written_before_still_load(tokenizers, tmp_path, monkeypatch):
    """Facts as stores written before held them: the vocabulary as a token list, the merges as pairs of its ids."""
    directory, eos_token_ids = tokenizers["smollm2"]
    old = shutil.copytree(directory, tmp_path / "old")
    model = json.loads((old / "tokenizer.json").read_text())["model"]
    vocab = model["vocab"]
    facts = json.loads((old / fast_tokenizer.FACTS_FILE).read_text())
    facts["vocab"] = sorted(vocab, key=vocab.get)
    pairs = (pair.split(" ") if isinstance(pair, str) else pair for pair in model["merges"])
    facts["merges"] = [vocab[token] for pair in pairs for token in pair]
    (old / fast_tokenizer.FACTS_FILE).write_text(json.dumps(facts))
    expected = load_tokenizer(old, ARGUMENTS, eos_token_ids=eos_token_ids)
    monkeypatch.setattr(fast_tokenizer, "load_tokenizer", None)  # any fallback to mlx_lm fails the load
    fast_tokenizer.check_identical(expected, fast_tokenizer.load(old, ARGUMENTS, eos_token_ids))


@pytest.mark.parametrize("name", ["qwen2-151k", "smollm2"])
def test_compact_tokenizer_json_is_the_same_document(tokenizers, tmp_path, name):
    """What compress does to the store's tokenizer.json: only the whitespace between JSON tokens goes (byte-level
    vocabularies hold the quotes and backslashes a careless minifier would break)."""
    directory = shutil.copytree(tokenizers[name][0], tmp_path / name)
    before = (directory / "tokenizer.json").read_bytes()
    assert b'\\"' in before and b"\\\\" in before  # escaped quotes and backslashes inside strings
    fast_tokenizer.compact(directory)
    after = (directory / "tokenizer.json").read_bytes()
    assert json.loads(after) == json.loads(before)
    assert len(after) < 0.6 * len(before)
    (directory / "tokenizer.json").write_text("{not json")  # left for mlx_lm's load to say what is wrong
    fast_tokenizer.compact(directory)
    assert (directory / "tokenizer.json").read_text() == "{not json"


def test_damaged_facts_fall_back(tokenizers, tmp_path):
    directory = shutil.copytree(tokenizers["tiny"][0], tmp_path / "tiny")
    facts_file = directory / fast_tokenizer.FACTS_FILE
    facts = json.loads(facts_file.read_text())
    expected = load_tokenizer(directory, ARGUMENTS)
    facts_file.write_text(json.dumps({**facts, "skeleton": "{not json"}))
    tokenizer = fast_tokenizer.load(directory, ARGUMENTS)
    assert type(tokenizer.detokenizer) is type(expected.detokenizer)
    assert tokenizer.encode(CORPUS[8]) == expected.encode(CORPUS[8])


def _attribute(facts: dict, part: str, name: str, value) -> dict:
    return {**facts, part: {"dict": [*facts[part]["dict"], [name, value]]}}


def test_facts_that_name_code_or_files_are_refused(tokenizers, tmp_path):
    """The exploits of issue 22: a facts file naming a callable (through mlx_lm's modules or any other), shadowing
    a method, or naming a file to read; each a FormatError naming the facts file, nothing called or read."""
    from squishlike.errors import FormatError

    directory = shutil.copytree(tokenizers["tiny"][0], tmp_path / "tiny")
    facts_file = directory / fast_tokenizer.FACTS_FILE
    facts = json.loads(facts_file.read_text())
    outside = tmp_path / "outside.json"
    shutil.copy(directory / "tokenizer.json", outside)
    with_parser = lambda name: {**facts, "wrapper": {"dict": [  # noqa: E731
        [k, {"object": name} if k == "_tool_parser" else v] for k, v in facts["wrapper"]["dict"]]}}
    hostile = {
        "tool parser os.system": with_parser("os:system"),
        "tool parser exec via mlx_lm": with_parser("mlx_lm.utils:json.__builtins__.exec"),
        "detokenizer class os.abort via mlx_lm": {**facts, "detokenizer_class": {"object": "mlx_lm.utils:os.abort"}},
        "an object in the tokenizer's state": _attribute(facts, "tokenizer", "x", {"object": "os:system"}),
        "encode shadowed": _attribute(facts, "wrapper", "encode", "x"),
        "reset shadowed": _attribute(facts, "detokenizer", "reset", 1),
        "decode shadowed": _attribute(facts, "tokenizer", "decode", None),
        "a dunder": _attribute(facts, "tokenizer", "__class__", "x"),
        "a tokenizer_file": {**facts, "tokenizer": {"dict": [
            [k, {"dict": [*v["dict"], ["tokenizer_file", str(outside)]]} if k == "init_kwargs" else v]
            for k, v in facts["tokenizer"]["dict"]]}},
        "an unknown key": {**facts, "extra": 1},
        "an old store's vocabulary without its merges": {**facts, "vocab": ["a"]},
        "an old store's vocabulary that is not tokens": {**facts, "vocab": [{"object": "os:system"}], "merges": []},
        "an old store's merges beyond its vocabulary": {**facts, "vocab": ["a", "b"], "merges": [0, 2]},
        "an unknown tag": {**facts, "detokenizer": {"pickle": "80"}},
    }
    for what, content in hostile.items():
        facts_file.write_text(json.dumps(content))
        with pytest.raises(FormatError, match=fast_tokenizer.FACTS_FILE):
            fast_tokenizer.load(directory, ARGUMENTS)
            pytest.fail(f"{what}: accepted")
