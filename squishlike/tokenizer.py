"""The tokenizer `load` returns: mlx_lm's TokenizerWrapper, built in a fraction of mlx_lm's time on later loads.

mlx_lm builds it slowly: tokenizer.json is parsed twice in pure Python, the tokenizer class rebuilds its BPE from
Python objects, and TokenizerWrapper scans the whole vocabulary (get_vocab, convert_ids_to_tokens) to infer the
detokenizer's token map and the thinking/tool markers.

`write_facts` (run when a store is compressed) takes mlx_lm's own path and works out what it produced: the backend's
configuration without its vocabulary and merges, the attributes of the tokenizer, of its detokenizer and of the
wrapper (eos ids, thinking and tool markers, tool parser). It rebuilds a tokenizer from those facts and the
vocabulary and merges of tokenizer.json itself (read once, as plain JSON: the facts never repeat them), and keeps
the facts (as plain JSON, FACTS_FILE beside the tokenizer) only if the rebuilt tokenizer is identical to mlx_lm's:
the same backend serialization, special and added tokens, chat template, detokenizer state and token map, and
wrapper state. `load` rebuilds from the facts, keyed by a hash of the tokenizer files (tokenizer.json included),
of the load's arguments and of the library versions, so a stale file is ignored. Without usable facts (a tokenizer
the fast path cannot show identical, a source that is not a store) `load` takes mlx_lm's path, with a debug-level
log saying why; a load never writes. A store written before the facts left the vocabulary out (which held it as a
token list and the merges as id pairs) still loads from its facts.

The facts are data, never code, whoever wrote the file: `build` reads them with a strict parser (`_parse`) that
knows a fixed schema. The only objects a facts file can name are those of a closed table (OBJECTS: the streaming
detokenizer classes and the tool parsers mlx_lm ships), in the two places mlx_lm keeps one; attribute names never
shadow a method, property or class-level callable; nothing names a file. Anything else is a FormatError naming
the file.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import pkgutil
import re
from pathlib import Path
from types import FunctionType
from typing import Any

import mlx_lm
import tokenizers
import transformers
from huggingface_hub import is_offline_mode
import mlx_lm.tool_parsers
from mlx_lm.tokenizer_utils import (BPEStreamingDetokenizer, NaiveStreamingDetokenizer, SPMStreamingDetokenizer,
                                    TokenizerWrapper)
from mlx_lm.utils import load_tokenizer
from tokenizers import AddedToken, Tokenizer, models
from transformers import PreTrainedTokenizerFast

from .errors import FormatError
from .io.atomic import write_bytes, write_json
from .io.checksum import file_checksum
from .io.files import read_bytes, read_json, read_json_object
from .npydir import TOKENIZER_FACTS

log = logging.getLogger(__name__)

FACTS_FILE = TOKENIZER_FACTS
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
# The only objects a facts file may name: mlx_lm's streaming detokenizers (the class the detokenizer is) and the
# tool parsers it ships (the wrapper's _tool_parser), by the names `_encode` writes. The parsers' modules are listed
# here without being imported; `_decode` imports the one a file names.
DETOKENIZERS = {f"{c.__module__}:{c.__qualname__}": c
                for c in (NaiveStreamingDetokenizer, SPMStreamingDetokenizer, BPEStreamingDetokenizer)}
TOOL_PARSERS = {f"{mlx_lm.tool_parsers.__name__}.{m.name}:parse_tool_call"
                for m in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__)}
FACTS_KEYS = ("skeleton", "bpe_options", "added_tokens", "tokenizer", "detokenizer_class", "detokenizer",
              "detokenizer_rebuilt", "wrapper")
# What facts files written before they left the vocabulary to tokenizer.json also hold (the token list, the merges
# as pairs of its ids).
OLD_FACTS_KEYS = ("vocab", "merges")


# In JSON text: a string (its escapes kept) or a run of the whitespace JSON allows between tokens.
_STRING_OR_SPACE = re.compile(r'("[^"\\]*(?:\\.[^"\\]*)*")|[ \t\n\r]+')


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
        except FormatError:  # facts that break the schema: a tampered file, never half-used
            raise
        except Exception as e:  # tokenizers raises a bare Exception for a skeleton it cannot read
            log.warning("%s: %s unusable (%s: %s); loading the tokenizer through mlx_lm", directory, FACTS_FILE,
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


def compact(directory: Path) -> None:
    """Rewrite `directory`'s tokenizer.json without the whitespace between its JSON tokens, every token as written
    (so any JSON reader reads the very same document): tokenizers and transformers save it indented, which for
    SmolLM2 is 3.52 MB against 1.56 MB. A file that is absent or not UTF-8 JSON is left as it is, for mlx_lm's load
    to say what is wrong."""
    path = Path(directory) / "tokenizer.json"
    try:
        text = read_bytes(path, directory).decode()
        json.loads(text)
    except (FormatError, ValueError):  # absent, not a regular file, not UTF-8, not JSON
        return
    write_bytes(path, _STRING_OR_SPACE.sub(r"\1", text).encode())


def facts_key(directory: Path, tokenizer_config_extra: dict[str, Any] | None, eos_token_ids: Any) -> str:
    """A hash of everything mlx_lm's result depends on: the tokenizer files, the load's arguments, the versions."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        try:
            digest = file_checksum(directory / name, directory)
        except FormatError:  # absent, a link, not a regular file: never read
            digest = "-"
        h.update(f"{name}:{digest};".encode())
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
    """The TokenizerWrapper the facts describe (see work_out_facts), without scanning the vocabulary; FormatError
    naming FACTS_FILE when they break its schema (see _parse)."""
    facts = _parse(directory / FACTS_FILE, facts)
    backend = Tokenizer.from_str(facts["skeleton"])
    vocab, merges = _vocabulary(directory, facts)
    backend.model = models.BPE(vocab=vocab, merges=merges, **facts["bpe_options"])
    # Added after the model, so they take their ids beyond its vocabulary, in their recorded order.
    for fields in facts["added_tokens"]:
        added = AddedToken(**{k: v for k, v in fields.items() if k != "id"})
        (backend.add_special_tokens if added.special else backend.add_tokens)([added])
    state = facts["tokenizer"]
    init_kwargs = state["init_kwargs"]
    state["name_or_path"] = init_kwargs["name_or_path"] = str(directory)
    if init_kwargs["local_files_only"] is None:  # as from_pretrained: the caller's value, else offline mode's
        init_kwargs["local_files_only"] = is_offline_mode()
    tokenizer = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend  # as model-specific subclasses do: __init__ keeps a backend set before it runs
    tokenizer.__init__(**init_kwargs)
    # Then exactly the attributes mlx_lm's tokenizer ended with, those its class's own __init__ set included.
    tokenizer.__dict__.update(state)

    detokenizer_class = facts["detokenizer_class"]
    detokenizer = detokenizer_class.__new__(detokenizer_class)
    detokenizer.__dict__.update(facts["detokenizer"])
    if "_tokenizer" in facts["detokenizer_rebuilt"]:
        detokenizer._tokenizer = tokenizer
    if "tokenmap" in facts["detokenizer_rebuilt"]:
        detokenizer.tokenmap = _token_map(tokenizer, vocab, as_bytes=detokenizer_class is SPMStreamingDetokenizer)
    detokenizer.reset()

    wrapper = TokenizerWrapper.__new__(TokenizerWrapper)
    wrapper.__dict__.update(facts["wrapper"], _tokenizer=tokenizer, _detokenizer=detokenizer)
    return wrapper


def _vocabulary(directory: Path, facts: dict) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE's vocabulary (token -> id) and merges (pairs of tokens): those of tokenizer.json, whose hash the
    facts' key holds, or, in a store written before the facts left them out, the facts' own."""
    if "vocab" in facts:
        tokens, ids = facts["vocab"], facts["merges"]
        token = tokens.__getitem__
        return dict(zip(tokens, range(len(tokens)))), list(zip(map(token, ids[::2]), map(token, ids[1::2])))
    # tokenizer.json is data either way: a file whose model breaks this shape makes BPE raise, and load then takes
    # mlx_lm's path, which reads the same file.
    model = read_json_object(directory / "tokenizer.json", directory)["model"]
    merges = [tuple(pair.split(" ")) if isinstance(pair, str) else tuple(pair) for pair in model["merges"]]
    return model["vocab"], merges


def facts_problem(directory: Path) -> str | None:
    """What makes `directory`'s FACTS_FILE one no load would use (unreadable, or breaking the schema), or None;
    for `verify`, whose hashes cannot tell a hostile file whose record was made to match."""
    try:
        _parse(directory / FACTS_FILE, read_json(directory / FACTS_FILE, directory))
    except FormatError as e:
        return str(e)
    return None


def _parse(path: Path, facts: Any) -> dict[str, Any]:
    """The facts as `build` uses them (the three objects' attributes decoded, the detokenizer class looked up),
    checked against the schema: FormatError naming `path` and the first thing wrong."""

    def check(ok: bool, problem: str) -> None:
        if not ok:
            raise FormatError(path, f"{problem}; not a facts file squishlike wrote")

    # "key" (which files and arguments the facts are for) is the file's, checked by _read_facts before this.
    keys = set(facts) - {"key"} if isinstance(facts, dict) else set()
    check(keys in (set(FACTS_KEYS), {*FACTS_KEYS, *OLD_FACTS_KEYS}), f"holds other keys than {FACTS_KEYS}")
    check(isinstance(facts["skeleton"], str), "skeleton is not a string")
    if "vocab" in facts:  # a store written before the facts left the vocabulary to tokenizer.json
        tokens, ids = facts["vocab"], facts["merges"]
        check(isinstance(tokens, list) and all(isinstance(t, str) for t in tokens), "vocab is not a list of strings")
        check(isinstance(ids, list) and len(ids) % 2 == 0
              and all(type(i) is int and 0 <= i < len(tokens) for i in ids), "merges are not pairs of vocabulary ids")
    options = facts["bpe_options"]
    check(isinstance(options, dict) and set(options) <= set(_BPE_OPTIONS)
          and all(_is_scalar(v) for v in options.values()), f"bpe_options are not among {_BPE_OPTIONS}")
    added = facts["added_tokens"]
    check(isinstance(added, list) and all(
        isinstance(t, dict) and set(t) <= {"id", *_ADDED_TOKEN_FIELDS} and isinstance(t.get("content"), str)
        and all(_is_scalar(v) for v in t.values()) for t in added), "added_tokens are not plain token records")
    rebuilt = facts["detokenizer_rebuilt"]
    check(isinstance(rebuilt, list) and set(rebuilt) <= set(_REBUILT), f"detokenizer_rebuilt is not among {_REBUILT}")
    detokenizer_class = _decode(facts["detokenizer_class"], path, "detokenizer_class", DETOKENIZERS.keys())
    check(detokenizer_class in DETOKENIZERS.values(), "detokenizer_class is not one of mlx_lm's detokenizers")
    state = _attributes(path, "tokenizer", facts["tokenizer"], PreTrainedTokenizerFast)
    init_kwargs = state.get("init_kwargs")
    check(isinstance(init_kwargs, dict) and all(isinstance(k, str) for k in init_kwargs),
          "tokenizer.init_kwargs is not a table of keyword arguments")
    for where, table in (("tokenizer", state), ("tokenizer.init_kwargs", init_kwargs)):
        named = [k for k, v in table.items() if v is not None and _names_a_file(k)]
        check(not named, f"{where} names a file ({', '.join(named)})")
    return {**facts, "detokenizer_class": detokenizer_class, "tokenizer": state,
            "detokenizer": _attributes(path, "detokenizer", facts["detokenizer"], detokenizer_class),
            # The wrapper hands what it does not define to the tokenizer: a name either defines is never data.
            "wrapper": _attributes(path, "wrapper", facts["wrapper"], TokenizerWrapper, PreTrainedTokenizerFast,
                                   objects=TOOL_PARSERS,
                                   object_attribute="_tool_parser")}


def _attributes(path: Path, where: str, value: Any, *classes: type, objects: Any = (),
                object_attribute: str | None = None) -> dict[str, Any]:
    """An object's attributes: plain identifiers that are not among _REBUILT and never shadow what `classes` (or
    classes above them) define as a method, property or other callable; values are data, except
    `object_attribute`, which may name one of `objects`."""
    if not (isinstance(value, dict) and set(value) == {"dict"} and isinstance(value["dict"], list)
            and all(isinstance(item, list) and len(item) == 2 for item in value["dict"])):
        raise FormatError(path, f"{where} is not a table of attributes")
    attributes = {}
    for name, item in value["dict"]:
        shadowed = [getattr(c, name, None) for c in classes] if isinstance(name, str) else []
        if (not isinstance(name, str) or not name.isidentifier() or name.startswith("__") or name in _REBUILT
                or any(callable(c) or hasattr(c, "__get__") for c in shadowed)):
            raise FormatError(path, f"{where} sets attribute {name!r}, which no {classes[0].__name__} of mlx_lm's "
                                    "holds as data")
        attributes[name] = _decode(item, path, f"{where}.{name}", objects if name == object_attribute else ())
    return attributes


def _names_a_file(key: str) -> bool:
    """Whether a tokenizer keyword argument or attribute tells transformers to read a file or take an object."""
    return key.endswith(("_file", "_files", "_path", "_object")) and key != "name_or_path"


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


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
    skeleton = {**state, "model": {**model, "vocab": {}, "merges": []}, "added_tokens": []}

    detokenizer = wrapper._detokenizer
    facts = {
        "skeleton": json.dumps(skeleton, ensure_ascii=False),
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


def _token_map(tokenizer: PreTrainedTokenizerFast, vocab: dict[str, int], as_bytes: bool) -> list:
    """The detokenizers' map from id to token (as text, or as the bytes SentencePiece byte tokens stand for),
    built from the vocabulary instead of convert_ids_to_tokens over every id."""
    tokens: list = [None] * len(tokenizer)
    for token, i in vocab.items():
        tokens[i] = token
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
    if qualified in DETOKENIZERS.keys() | TOOL_PARSERS:  # _parse checks each is where mlx_lm keeps one
        return {"object": qualified}
    raise NotIdentical(f"cannot keep {value!r} as JSON")


def _decode(value: Any, path: Path, where: str, objects: Any = ()) -> Any:
    """A value `_encode` wrote, restored; FormatError naming `path` and `where` for any other. Only names among
    `objects` are looked up, and only there."""
    if isinstance(value, list):
        return [_decode(v, path, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise FormatError(path, f"{where}: {sorted(value)} is not one tagged value")
    (tag, content), = value.items()
    try:
        if tag == "tuple":
            return tuple(_decode(v, path, where) for v in content)
        if tag == "set":
            return {_decode(v, path, where) for v in content}
        if tag == "bytes":
            return bytes.fromhex(content)
        if tag == "added_token":
            if not (isinstance(content, dict) and set(content) <= set(_ADDED_TOKEN_FIELDS)
                    and all(_is_scalar(v) for v in content.values())):
                raise FormatError(path, f"{where}: not an added token's fields")
            return AddedToken(**content)
        if tag == "dict":
            return {_decode(k, path, where): _decode(v, path, where) for k, v in content}
    except (TypeError, ValueError) as e:  # a content of the wrong shape; FormatError is a ValueError
        raise e if isinstance(e, FormatError) else FormatError(path, f"{where}: malformed {tag} ({e})") from None
    if tag == "object" and content in objects:
        module, _, name = content.partition(":")
        return getattr(importlib.import_module(module), name)
    raise FormatError(path, f"{where}: {tag!r} {content!r} is not a value a facts file may hold")
