"""The tokenizer `load` returns: mlx_lm's TokenizerWrapper, built in a fraction of mlx_lm's time on later loads.

mlx_lm builds it slowly: tokenizer.json is parsed twice in pure Python, the tokenizer class rebuilds its BPE from
Python objects, and TokenizerWrapper scans the whole vocabulary (get_vocab, convert_ids_to_tokens) to infer the
detokenizer's token map and the thinking/tool markers.

`write_facts` (run when a store is compressed) takes mlx_lm's own path and works out what it produced: the backend's
configuration without its vocabulary, the vocabulary as a plain token list, the merges as id pairs, the attributes of
the tokenizer, of its detokenizer and of the wrapper (eos ids, thinking and tool markers, tool parser). It rebuilds a tokenizer from those facts
and keeps them (as plain JSON, FACTS_FILE beside the tokenizer) only if the rebuilt tokenizer is identical to
mlx_lm's: the same backend serialization, special and added tokens, chat template, detokenizer state and token map,
and wrapper state. `load` rebuilds from the facts, keyed by a hash of the tokenizer files, of the load's arguments
and of the library versions, so a stale file is ignored. Without usable facts (a tokenizer the fast path cannot
show identical, a source that is not a store) `load` takes mlx_lm's path, with a debug-level log saying why; a load
never writes.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
from pathlib import Path
from types import FunctionType
from typing import Any

import mlx_lm
import tokenizers
import transformers
from huggingface_hub import is_offline_mode
from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer, TokenizerWrapper
from mlx_lm.utils import load_tokenizer
from tokenizers import AddedToken, Tokenizer, models
from transformers import PreTrainedTokenizerFast

from .errors import FormatError
from .io.atomic import write_json
from .io.checksum import file_checksum
from .io.files import read_json, read_json_object

log = logging.getLogger(__name__)

FACTS_FILE = "squishlike_tokenizer.json"
# Every file mlx_lm's path reads for a local directory (config.json names the model's tokenizer defaults).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "config.json",
)
_BPE_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                "byte_fallback", "ignore_merges")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
# Attributes rebuilt rather than kept: the backend, the detokenizer's token map, the objects that hold the
# tokenizer. _vocab and _merges are what model-specific __init__s build their backend from; nothing reads them after.
_REBUILT = ("_tokenizer", "_detokenizer", "tokenmap", "_vocab", "_merges")


class NotIdentical(Exception):
    """The fast path cannot show this tokenizer identical to mlx_lm's; the message says what differs."""


def load(
    directory: Path, tokenizer_config_extra: dict[str, Any] | None = None, eos_token_ids: Any = None
) -> TokenizerWrapper:
    """mlx_lm's `load_tokenizer(directory, tokenizer_config_extra, eos_token_ids)`: rebuilt from FACTS_FILE when it
    holds facts for these very files and arguments, otherwise through mlx_lm."""
    directory = Path(directory)
    facts = _read_facts(directory, facts_key(directory, tokenizer_config_extra, eos_token_ids))
    if facts is not None:
        try:
            return build(directory, facts)
        except Exception as e:  # a damaged file: tokenizers raises a bare Exception for bad JSON
            log.debug("%s: %s unusable (%s: %s); loading the tokenizer through mlx_lm", directory, FACTS_FILE,
                      type(e).__name__, e)
    else:
        log.debug("%s: no %s for these tokenizer files and arguments; loading through mlx_lm", directory, FACTS_FILE)
    return load_tokenizer(directory, tokenizer_config_extra or {}, eos_token_ids=eos_token_ids)


def custom_code(directory: Path) -> str | None:
    """The custom tokenizer class that `directory`'s tokenizer_config.json needs code for (its auto_map's
    AutoTokenizer entry, when the tokenizer_class it names is not one transformers ships), or None."""
    try:
        config = read_json_object(Path(directory) / "tokenizer_config.json", directory)
    except FormatError:  # absent, unreadable, not an object: the tokenizer build says what is wrong
        return None
    auto_map = config.get("auto_map")
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    if not entry:
        return None
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    name = config.get("tokenizer_class")
    if isinstance(name, str) and tokenizer_class_from_name(name) is not None:
        return None  # transformers builds its own class and leaves the code unused, as load would
    return ", ".join(e for e in entry if isinstance(e, str)) if isinstance(entry, list) else str(entry)


def write_facts(
    directory: Path, tokenizer_config_extra: dict[str, Any] | None = None, eos_token_ids: Any = None
) -> list[Path]:
    """Keep FACTS_FILE in `directory` for later `load`s with these arguments: [FACTS_FILE], or [] (and a debug log)
    where there is no tokenizer or the fast path cannot show it identical to mlx_lm's."""
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        return []
    key = facts_key(directory, tokenizer_config_extra, eos_token_ids)
    try:
        wrapper = load_tokenizer(directory, tokenizer_config_extra or {}, eos_token_ids=eos_token_ids)
        facts = {"key": key, **work_out_facts(directory, wrapper, tokenizer_config_extra or {})}
    except Exception as e:  # tokenizers raises a bare Exception for a tokenizer it cannot read
        log.debug("%s: tokenizer fast path not used: %s: %s", directory, type(e).__name__, e)
        return []
    try:
        write_json(directory / FACTS_FILE, facts)
    except OSError as e:
        log.debug("%s: cannot keep %s: %s", directory, FACTS_FILE, e)
        return []
    return [directory / FACTS_FILE]


def facts_key(directory: Path, tokenizer_config_extra: dict[str, Any] | None, eos_token_ids: Any) -> str:
    """A hash of everything mlx_lm's result depends on: the tokenizer files, the load's arguments, the versions."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = directory / name
        h.update(f"{name}:{file_checksum(path) if path.is_file() else '-'};".encode())
    versions = [mlx_lm.__version__, transformers.__version__, tokenizers.__version__]
    arguments = [tokenizer_config_extra or {}, eos_token_ids, versions]
    h.update(json.dumps(arguments, sort_keys=True, default=repr).encode())
    return h.hexdigest()


def _read_facts(directory: Path, key: str) -> dict | None:
    try:
        facts = read_json(directory / FACTS_FILE, directory)  # never a FIFO: it would block
    except FormatError:  # missing, not a regular file, not JSON: work them out again
        return None
    return facts if isinstance(facts, dict) and facts.get("key") == key else None


def build(directory: Path, facts: dict) -> TokenizerWrapper:
    """The TokenizerWrapper the facts describe (see work_out_facts), without scanning the vocabulary."""
    backend = Tokenizer.from_str(facts["skeleton"])
    tokens = facts["vocab"]
    ids = facts["merges"]
    token = tokens.__getitem__
    backend.model = models.BPE(
        vocab=dict(zip(tokens, range(len(tokens)))),
        merges=list(zip(map(token, ids[::2]), map(token, ids[1::2]))),
        **facts["bpe_options"],
    )
    # Added after the model, so they take their ids beyond its vocabulary, in their recorded order.
    for fields in facts["added_tokens"]:
        added = AddedToken(**{k: v for k, v in fields.items() if k != "id"})
        (backend.add_special_tokens if added.special else backend.add_tokens)([added])
    state = _decode(facts["tokenizer"])
    init_kwargs = state["init_kwargs"]
    state["name_or_path"] = init_kwargs["name_or_path"] = str(directory)
    if init_kwargs["local_files_only"] is None:  # as from_pretrained: the caller's value, else offline mode's
        init_kwargs["local_files_only"] = is_offline_mode()
    tokenizer = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend  # as model-specific subclasses do: __init__ keeps a backend set before it runs
    tokenizer.__init__(**init_kwargs)
    # Then exactly the attributes mlx_lm's tokenizer ended with, those its class's own __init__ set included.
    tokenizer.__dict__.update(state)

    detokenizer_class = _decode(facts["detokenizer_class"])
    detokenizer = detokenizer_class.__new__(detokenizer_class)
    detokenizer.__dict__.update(_decode(facts["detokenizer"]))
    if "_tokenizer" in facts["detokenizer_rebuilt"]:
        detokenizer._tokenizer = tokenizer
    if "tokenmap" in facts["detokenizer_rebuilt"]:
        detokenizer.tokenmap = _token_map(tokenizer, tokens, as_bytes=detokenizer_class is SPMStreamingDetokenizer)
    detokenizer.reset()

    wrapper = TokenizerWrapper.__new__(TokenizerWrapper)
    wrapper.__dict__.update(_decode(facts["wrapper"]), _tokenizer=tokenizer, _detokenizer=detokenizer)
    return wrapper


def work_out_facts(directory: Path, wrapper: TokenizerWrapper, tokenizer_config_extra: dict[str, Any]) -> dict:
    """The facts that rebuild `wrapper` (mlx_lm's, for `directory` and these arguments); NotIdentical unless the
    rebuild is identical."""
    tokenizer = wrapper._tokenizer
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise NotIdentical(f"{type(tokenizer).__name__} is not a tokenizers-backed tokenizer")
    overridden = [
        name for klass in type(tokenizer).__mro__[: type(tokenizer).__mro__.index(PreTrainedTokenizerFast)]
        for name, value in vars(klass).items()
        if isinstance(value, (FunctionType, property, classmethod, staticmethod)) and name != "__init__"
    ]
    if overridden:
        raise NotIdentical(f"{type(tokenizer).__name__} overrides {', '.join(overridden)}")
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state["model"]
    if model.get("type") != "BPE":
        raise NotIdentical(f"the tokenizer model is {model.get('type')}, not BPE")
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    if [model["vocab"][t] for t in tokens] != list(range(len(tokens))):
        raise NotIdentical("the vocabulary ids are not 0..n-1")
    index = model["vocab"]
    merges = [index[t] for pair in model["merges"] for t in (pair.split(" ") if isinstance(pair, str) else pair)]
    skeleton = {**state, "model": {**model, "vocab": {}, "merges": []}, "added_tokens": []}

    detokenizer = wrapper._detokenizer
    facts = {
        "skeleton": json.dumps(skeleton, ensure_ascii=False),
        "vocab": tokens,
        "merges": merges,
        "bpe_options": {name: model[name] for name in _BPE_OPTIONS if model.get(name) is not None},
        "added_tokens": sorted(state["added_tokens"], key=lambda t: t["id"]),
        "tokenizer": _encode(_without_location(_kept(tokenizer), tokenizer_config_extra)),
        "detokenizer_class": _encode(type(detokenizer)),
        "detokenizer": _encode(_kept(detokenizer)),
        "detokenizer_rebuilt": [name for name in _REBUILT if name in vars(detokenizer)],
        "wrapper": _encode(_kept(wrapper)),
    }
    facts = json.loads(json.dumps(facts))  # exactly what a later load reads back
    check_identical(wrapper, build(directory, facts))
    return facts


def check_identical(expected: TokenizerWrapper, actual: TokenizerWrapper) -> None:
    """NotIdentical naming the first thing in which `actual` differs from `expected`."""
    a, b = expected._tokenizer, actual._tokenizer
    comparisons = {
        "backend": (a.backend_tokenizer.to_str(), b.backend_tokenizer.to_str()),
        "special tokens": (a.special_tokens_map, b.special_tokens_map),
        "added tokens": (repr(a.added_tokens_decoder), repr(b.added_tokens_decoder)),
        "length": (len(a), len(b)),
        "attributes": (_comparable(a), _comparable(b)),
        "detokenizer class": (type(expected._detokenizer), type(actual._detokenizer)),
        "detokenizer attributes": (_comparable(expected._detokenizer), _comparable(actual._detokenizer)),
        "detokenizer token map": (getattr(expected._detokenizer, "tokenmap", None),
                                  getattr(actual._detokenizer, "tokenmap", None)),
        "wrapper attributes": (_comparable(expected), _comparable(actual)),
    }
    for what, (want, got) in comparisons.items():
        if want != got:
            raise NotIdentical(f"the rebuilt tokenizer's {what} differs")


def _kept(obj: object) -> dict[str, Any]:
    return {k: v for k, v in vars(obj).items() if k not in _REBUILT}


def _without_location(state: dict[str, Any], tokenizer_config_extra: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer's attributes less where and how it was loaded (None, for `build` to set from the directory
    and the environment at hand), so a store's facts do not depend on where or in what environment it was made."""
    init_kwargs = {**state["init_kwargs"], "name_or_path": None}
    if "local_files_only" not in tokenizer_config_extra:
        init_kwargs["local_files_only"] = None
    return {**state, "name_or_path": None, "init_kwargs": init_kwargs}


def _comparable(obj: object) -> dict[str, str]:
    return {k: repr(v) for k, v in _kept(obj).items()}


def _token_map(tokenizer: PreTrainedTokenizerFast, vocab: list[str], as_bytes: bool) -> list:
    """The detokenizers' map from id to token (as text, or as the bytes SentencePiece byte tokens stand for),
    built from the vocabulary list instead of convert_ids_to_tokens over every id."""
    tokens = vocab + [None] * (len(tokenizer) - len(vocab))
    for i, token in tokenizer.backend_tokenizer.get_added_tokens_decoder().items():
        tokens[i] = token.content
    if not as_bytes:
        return tokens
    # As SPMStreamingDetokenizer: byte tokens carry their value in hex.
    return [bytes([int(t[3:5], 16)]) if t.startswith("<0x") else t.encode("utf-8") for t in tokens]


def _encode(value: Any) -> Any:
    """`value` as plain JSON; tuples, sets, bytes and module-level functions or classes tagged so _decode restores
    them exactly. NotIdentical for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"set": [_encode(v) for v in sorted(value)]}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, AddedToken):
        return {"added_token": {k: getattr(value, k) for k in _ADDED_TOKEN_FIELDS}}
    if isinstance(value, dict):
        return {"dict": [[_encode(k), _encode(v)] for k, v in value.items()]}
    qualified = f"{getattr(value, '__module__', '')}:{getattr(value, '__qualname__', '')}"
    try:
        if _decode({"object": qualified}) is value:
            return {"object": qualified}
    except (ImportError, AttributeError, ValueError):
        pass
    raise NotIdentical(f"cannot keep {value!r} as JSON")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    (tag, content), = value.items()
    if tag == "tuple":
        return tuple(_decode(v) for v in content)
    if tag == "set":
        return {_decode(v) for v in content}
    if tag == "bytes":
        return bytes.fromhex(content)
    if tag == "added_token":
        return AddedToken(**content)
    if tag == "dict":
        return {_decode(k): _decode(v) for k, v in content}
    if tag == "object":
        module, _, name = content.partition(":")
        if module.partition(".")[0] != "mlx_lm":  # as mlx_lm itself, import only its own parsers and templates
            raise ValueError(f"{content} is not mlx_lm's")
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj
    raise ValueError(f"unknown tag {tag!r}")
