"""A corpus of crafted, hostile model files, generated at test time (no binaries in the repository).

Each `Case` builds one crafted file (or directory) from a small valid base (a one-layer llama as an HF directory,
its npy-dir, the npy-dir with every tier built, an Ollama store, a raw GGUF) and says what squishlike must do with
it: raise a typed error (a subclass of squishlike.errors.SquishError) whose message names the crafted file, and
never execute anything (payloads that would create a PWNED marker file sit in several cases).

Used by tests/reliability/test_hostile_files.py (one test per case) and as the seed corpus of the fuzzers in fuzz/.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from squishlike.errors import (
    FormatError,
    IntegrityError,
    SquishError,
    TierNotReadyError,
    UnknownFormatError,
    UnsupportedArchitectureError,
)

MARKER = "PWNED"  # a payload that runs creates this file in the case's directory


@dataclass
class Base:
    """The valid models every case starts from (built once per test session)."""

    hf: Path  # HF directory: config.json, model.safetensors, tokenizer files
    npydir: Path  # its INT4 npy-dir, no tiers built
    built: Path  # the same with every tier built
    ollama_root: Path  # an Ollama store holding the model as tiny:latest
    ollama_manifest: Path
    weights_digest: str  # the clean load's weights (crash_harness.weights_digest)
    other: Path  # another store of the same architecture and options (other weights), every tier built
    packed: Path  # the HF directory's INT4 store as compress writes it by default: format 2, no tier built, so a
    # load takes the store's own quantized tier, read straight from its packs


@dataclass
class Case:
    name: str
    build: Callable[[Base, Path], Path]  # (base, empty case dir) -> the path squishlike is pointed at
    expect: type  # the typed error
    names: str = "{target}"  # what the message must contain; {target}, {case} are filled in
    action: str = "open"  # "open" (provider, every tensor), "load", "npydir", "sentinel:<tier>", "compress"
    groups: tuple[str, ...] = field(default_factory=tuple)
    also: tuple[str, ...] = ()  # other entry points that must refuse it as `action` does (same type, same names)


# ---------------------------------------------------------------------------------------------- raw builders


def st_raw(header: dict | None = None, data: bytes = b"", *, raw: bytes | None = None, length: int | None = None) -> bytes:
    """A safetensors file: u64 header length, the header, the data."""
    hb = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(hb) if length is None else length) + hb + data


def _u32(v: int) -> bytes:
    return struct.pack("<I", v)


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def _gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return _u64(len(b)) + b


# GGUF value types
G_U32, G_F32, G_STRING, G_ARRAY = 4, 6, 8, 9


def _gval(vtype: int, value) -> bytes:
    if vtype == G_U32:
        return _u32(value)
    if vtype == G_F32:
        return struct.pack("<f", value)
    if vtype == G_STRING:
        return _gstr(value)
    if vtype == G_ARRAY:
        subtype, items = value
        return _u32(subtype) + _u64(len(items)) + b"".join(_gval(subtype, i) for i in items)
    raise ValueError(vtype)


LLAMA_KV = [
    ("general.architecture", G_STRING, "llama"),
    ("llama.embedding_length", G_U32, 8),
    ("llama.block_count", G_U32, 1),
    ("llama.attention.head_count", G_U32, 2),
    ("llama.feed_forward_length", G_U32, 16),
    ("llama.vocab_size", G_U32, 4),
]
EMBD = ("token_embd.weight", [8, 4], 0, 0)  # name, dims (fastest first), type F32, offset


def gguf_raw(kvs=None, tensors=None, data: bytes | None = None, *, version: int = 3, magic: bytes = b"GGUF",
             n_tensors: int | None = None, n_kv: int | None = None, raw_kv: bytes | None = None,
             raw_tensors: bytes | None = None) -> bytes:
    kvs = LLAMA_KV if kvs is None else kvs
    tensors = [EMBD] if tensors is None else tensors
    out = magic + _u32(version) + _u64(len(tensors) if n_tensors is None else n_tensors)
    out += _u64(len(kvs) if n_kv is None else n_kv)
    out += raw_kv if raw_kv is not None else b"".join(_gstr(k) + _u32(t) + _gval(t, v) for k, t, v in kvs)
    if raw_tensors is not None:
        out += raw_tensors
    else:
        for name, dims, ttype, offset in tensors:
            out += _gstr(name) + _u32(len(dims)) + b"".join(_u64(d) for d in dims) + _u32(ttype) + _u64(offset)
    out += b"\0" * (-len(out) % 32)
    return out + (np.arange(32, dtype=np.float32).tobytes() if data is None else data)


# ---------------------------------------------------------------------------------------------- helpers


def hf_with(base: Base, d: Path, weights: bytes | None = None, config: dict | None = None,
            config_raw: bytes | None = None) -> Path:
    target = shutil.copytree(base.hf, d / "model")
    if weights is not None:
        (target / "model.safetensors").write_bytes(weights)
    if config is not None:
        (target / "config.json").write_text(json.dumps(config))
    if config_raw is not None:
        (target / "config.json").write_bytes(config_raw)
    return target


def hf_config(base: Base) -> dict:
    return json.loads((base.hf / "config.json").read_text())


def npy_copy(base: Base, d: Path, built: bool = False) -> Path:
    return shutil.copytree(base.built if built else base.npydir, d / "model", symlinks=True)


def manifest_edit(target: Path, fn: Callable[[dict], None]) -> Path:
    m = json.loads((target / "manifest.json").read_text())
    fn(m)
    (target / "manifest.json").write_text(json.dumps(m))
    return target


def first_entry(m: dict, scheme: str = "int4") -> dict:
    return next(e for e in m["tensors"].values() if e["scheme"] == scheme)


def part(target: Path, suffix: str = "q4", scheme: str = "int4") -> Path:
    m = json.loads((target / "manifest.json").read_text())
    return target / "tensors" / f"{first_entry(m, scheme)['key']}__{suffix}.npy"


def pack(target: Path, suffix: str = "q4", scheme: str = "int4") -> Path:
    """Format 2: the pack holding `part`'s part."""
    m = json.loads((target / "manifest.json").read_text())
    return target / first_entry(m, scheme)["files"][suffix]["pack"]


class _Evil:
    """Unpickling this opens (creates) the marker file: proof that a pickle ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def npy_header_bytes(descr: str, shape, fortran: bool = False) -> bytes:
    header = "{" + f"'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {tuple(shape)!r}, " + "}"
    header += " " * (-(len(header) + 11) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode()


def ollama_edit(base: Base, d: Path, fn: Callable[[Path, dict], None]) -> Path:
    root = shutil.copytree(base.ollama_root, d / "store")
    manifest = root / base.ollama_manifest.relative_to(base.ollama_root)
    m = json.loads(manifest.read_text())
    fn(root, m)
    manifest.write_text(json.dumps(m))
    return manifest


def ollama_blob(root: Path, layer: dict) -> Path:
    return root / "blobs" / layer["digest"].replace(":", "-")


def tensor_layer(m: dict, suffix: str = "v_proj.weight") -> dict:
    return next(x for x in m["layers"] if x.get("name", "").endswith(suffix))


def _rewrite_blob(root: Path, layer: dict, data: bytes, fix_digest: bool) -> None:
    old = ollama_blob(root, layer)
    old.unlink()
    if fix_digest:
        layer["digest"] = "sha256:" + hashlib.sha256(data).hexdigest()
        layer["size"] = len(data)
    ollama_blob(root, layer).write_bytes(data)


def sentinel_edit(target: Path, rel: str, fn: Callable[[dict], dict | str]) -> Path:
    path = target / rel
    payload = json.loads(path.read_text())
    new = fn(payload)
    path.write_text(new if isinstance(new, str) else json.dumps(new))
    return target


def _set(d: dict, **kv) -> dict:
    d.update(kv)
    return d


# ---------------------------------------------------------------------------------------------- the corpus

F32x16 = np.arange(16, dtype=np.float32).tobytes()  # 64 bytes


def _st(header, data=F32x16):
    return lambda b, d: hf_with(b, d, st_raw(header, data))


def _st_raw(raw: bytes):
    return lambda b, d: hf_with(b, d, raw)


CASES: list[Case] = [
    # --- safetensors (inside an HF directory; the message names model.safetensors)
    Case("st-header-length-huge", _st_raw(st_raw(raw=b"{}", length=2**63 - 1)), FormatError, groups=("safetensors",)),
    Case("st-header-length-beyond-file", _st_raw(st_raw(raw=b'{"a": 1}', length=10_000)), FormatError),
    Case("st-shorter-than-its-length-field", _st_raw(b"\x05\x00\x00"), FormatError),
    Case("st-header-invalid-json", _st_raw(st_raw(raw=b'{"w": {"dtype": "F32", ')), FormatError),
    Case("st-header-not-utf8", _st_raw(st_raw(raw=b'{"\xff\xfe": 1}')), FormatError),
    Case("st-header-is-a-list", _st_raw(st_raw(raw=b"[1, 2, 3]")), FormatError),
    Case("st-offsets-overlap", _st({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]},
                                    "b": {"dtype": "F32", "shape": [8], "data_offsets": [16, 48]}}), FormatError),
    Case("st-offsets-out-of-range", _st({"a": {"dtype": "F32", "shape": [256], "data_offsets": [0, 1024]}}),
         FormatError),
    Case("st-offsets-not-dtype-times-shape", _st({"a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}},
                                                 F32x16[:60]), FormatError),
    Case("st-offsets-reversed", _st({"a": {"dtype": "F32", "shape": [0], "data_offsets": [64, 0]}}), FormatError),
    Case("st-offsets-leave-a-gap", _st({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                        "b": {"dtype": "F32", "shape": [4], "data_offsets": [48, 64]}}), FormatError),
    Case("st-unknown-dtype", _st({"a": {"dtype": "Q9_K", "shape": [16], "data_offsets": [0, 64]}}), FormatError),
    Case("st-dtype-mlx-cannot-hold", _st({"a": {"dtype": "F64", "shape": [8], "data_offsets": [0, 64]}}), FormatError),
    Case("st-shape-overflows", _st({"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 64]}}),
         FormatError),
    Case("st-shape-negative", _st({"a": {"dtype": "F32", "shape": [-4, -4], "data_offsets": [0, 64]}}), FormatError),
    Case("st-data-truncated", _st({"a": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}, F32x16[:40]),
         FormatError),
    Case("st-metadata-not-strings", _st({"__metadata__": {"format": 7},
                                         "a": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}), FormatError),
    Case("st-index-shard-outside-the-directory", lambda b, d: _index(b, d, "../evil.safetensors"), FormatError,
         names="model.safetensors.index.json"),
    Case("st-index-shard-absolute-path", lambda b, d: _index(b, d, "/etc/hostname"), FormatError,
         names="model.safetensors.index.json"),
    Case("st-index-missing-shard", lambda b, d: _index(b, d, "model-00002-of-00002.safetensors"), FormatError,
         names="model.safetensors.index.json"),
    Case("st-index-shard-name-too-long", lambda b, d: _index(b, d, "x" * 300 + ".safetensors"), FormatError,
         names="model.safetensors.index.json"),
    Case("st-index-not-json", lambda b, d: _index(b, d, None), FormatError, names="model.safetensors.index.json"),
    Case("st-tensor-shape-wrong-for-its-role", lambda b, d: _wrong_role(b, d), FormatError, names="{target}",
         action="load"),
    # --- .npy parts of an npy-dir (the message names the part; nothing is unpickled)
    Case("npy-object-dtype-pickle-payload", lambda b, d: _npy_pickle(b, d), FormatError, names="{part}",
         action="load"),
    Case("npy-wrong-dtype-for-its-role", lambda b, d: _npy_replace(b, d, lambda a: a.astype(np.float32)),
         FormatError, names="{part}", action="load"),
    Case("npy-wrong-shape-for-its-role", lambda b, d: _npy_replace(b, d, lambda a: a.reshape(-1)), FormatError,
         names="{part}", action="load"),
    Case("npy-bad-magic", lambda b, d: _npy_bytes(b, d, lambda raw: b"\x93NUMPX" + raw[6:]), FormatError,
         names="{part}", action="load"),
    Case("npy-data-truncated", lambda b, d: _npy_bytes(b, d, lambda raw: raw[:-33]), FormatError, names="{part}",
         action="load"),
    Case("npy-fortran-order", lambda b, d: _npy_fortran(b, d), FormatError, names="{part}", action="load"),
    Case("npy-header-shape-huge", lambda b, d: _npy_header(b, d, "|u1", (2**40, 2**40)), FormatError,
         names="{part}", action="load"),
    Case("npy-header-code-not-literal", lambda b, d: _npy_code_header(b, d), FormatError, names="{part}",
         action="load"),
    Case("npy-part-is-a-symlink-out-of-the-directory", lambda b, d: _npy_symlink(b, d), FormatError,
         names="{part}", action="load"),
    Case("npy-part-is-a-fifo", lambda b, d: _fifo(npy_copy(b, d), part), FormatError, names="{part}",
         action="load"),
    Case("side-file-is-a-fifo", lambda b, d: _fifo(npy_copy(b, d), lambda t: t / "tokenizer.json"), FormatError,
         names="tokenizer.json", action="load"),
    Case("sentinel-is-a-fifo", lambda b, d: _fifo(npy_copy(b, d, True), lambda t: t / ".squish_4bit_ready"),
         TierNotReadyError, names=".squish_4bit_ready", action="sentinel:int4"),
    # --- the npy-dir manifest
    Case("manifest-key-with-dotdot", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: _set(
        first_entry(m), key="..%2F..%2Fevil")), FormatError, names="manifest.json", action="load"),
    Case("manifest-key-raw-dotdot-slash", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: _set(
        first_entry(m), key="../../evil")), FormatError, names="manifest.json", action="load"),
    Case("manifest-key-too-long-for-the-filesystem", lambda b, d: _long_key(b, d), FormatError,
         names="manifest.json", action="load"),
    Case("manifest-key-absolute-path", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: _set(
        first_entry(m), key="/etc/hostname")), FormatError, names="manifest.json", action="load"),
    Case("manifest-side-file-dotdot", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: m["side_files"].update(
        {"../outside.json": {"size": 2, "sha256": "0" * 64}})), FormatError, names="manifest.json", action="load"),
    Case("manifest-side-file-absolute", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: m["side_files"].update(
        {"/etc/hostname": {"size": 2, "sha256": "0" * 64}})), FormatError, names="manifest.json", action="load"),
    Case("side-file-symlink-out-of-the-directory", lambda b, d: _side_symlink(b, d), FormatError,
         names="config.json", action="load"),
    Case("manifest-not-json", lambda b, d: _write(npy_copy(b, d) / "manifest.json", b'{"format": "squishlike-npy-dir",')
         .parent, FormatError, names="manifest.json", action="npydir"),
    Case("manifest-nested-too-deep", lambda b, d: _write(npy_copy(b, d) / "manifest.json",
                                                         b'{"format": "squishlike-npy-dir", "x": ' + b"[" * 100_000)
         .parent, FormatError, names="manifest.json", action="npydir"),
    Case("manifest-integer-too-long", lambda b, d: _write(npy_copy(b, d) / "manifest.json",
                                                          b'{"format": "squishlike-npy-dir", "x": ' + b"9" * 20_000 + b"}")
         .parent, FormatError, names="manifest.json", action="npydir"),
    Case("manifest-unknown-scheme", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: _set(
        first_entry(m), scheme="int2")), FormatError, names="manifest.json", action="npydir"),
    Case("manifest-group-size-zero", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: _set(
        first_entry(m), group_size=0)), FormatError, names="manifest.json", action="npydir"),
    Case("manifest-group-size-a-string", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: _set(
        first_entry(m), group_size="32")), FormatError, names="manifest.json", action="npydir"),
    Case("manifest-shape-negative", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: _set(
        first_entry(m), shape=[-64, -64])), FormatError, names="{target}", action="load"),
    Case("manifest-shape-beyond-its-files", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: _huge(m)),
         FormatError, names="manifest.json", action="load"),
    Case("manifest-tensor-not-in-the-architecture", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: m[
        "tensors"].update({"layers.0.evil.weight": {**m["tensors"]["output_norm.weight"],
                                                    "key": "layers.0.evil.weight"}})),
         FormatError, names="manifest.json", action="load"),
    Case("manifest-entry-not-an-object", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: m["tensors"].update(
        {next(iter(m["tensors"])): ["not", "an", "entry"]})), FormatError, names="manifest.json", action="npydir"),
    Case("manifest-unknown-format-version", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: _set(
        m, format_version=99)), FormatError, names="manifest.json", action="npydir"),
    Case("manifest-files-do-not-match-scheme", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: first_entry(m)[
        "files"].pop("z4")), FormatError, names="manifest.json", action="npydir"),
    Case("manifest-unknown-model-type", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: _set(
        m, model_type="evil_arch")), UnsupportedArchitectureError, names="{target}", action="load"),
    Case("manifest-unknown-runtime-dtype", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: _set(
        m, runtime_dtype="float8")), FormatError, names="manifest.json", action="npydir"),
    # --- sentinels (never trusted: the default load ignores them; a forced tier is refused naming the sentinel)
    Case("sentinel-not-json", lambda b, d: _write(npy_copy(b, d, True) / ".squish_ready", b'{"files": ').parent,
         TierNotReadyError, names=".squish_ready", action="sentinel:mlx"),
    Case("sentinel-lies-about-a-size", lambda b, d: sentinel_edit(npy_copy(b, d, True), ".squish_4bit_ready",
                                                                  lambda p: _lie(p, 1)),
         TierNotReadyError, names=".squish_4bit_ready", action="sentinel:int4"),
    Case("sentinel-names-a-file-outside", lambda b, d: sentinel_edit(npy_copy(b, d, True), ".squish_ready",
                                                                     lambda p: _set(p, files={"../../etc/hostname": {
                                                                         "size": 1, "sha256": "0"}})),
         TierNotReadyError, names=".squish_ready", action="sentinel:mlx"),
    Case("sentinel-names-an-absolute-path", lambda b, d: sentinel_edit(npy_copy(b, d, True), ".squish_ready",
                                                                       lambda p: _set(p, files={"/etc/hostname": {
                                                                           "size": 1, "sha256": "0"}})),
         TierNotReadyError, names=".squish_ready", action="sentinel:mlx"),
    Case("sentinel-size-not-a-number", lambda b, d: sentinel_edit(npy_copy(b, d, True), "finalized/.ready",
                                                                  lambda p: _lie(p, "big")),
         TierNotReadyError, names="finalized/.ready", action="sentinel:finalized"),
    Case("sentinel-of-another-manifest", lambda b, d: sentinel_edit(npy_copy(b, d, True), ".squish_4bit_ready",
                                                                    lambda p: _set(p, manifest_fingerprint="f" * 64)),
         TierNotReadyError, names=".squish_4bit_ready", action="sentinel:int4"),
    Case("tier-directory-symlinked-out", lambda b, d: _tier_dir_symlink(b, d), TierNotReadyError,
         names="finalized/.ready", action="sentinel:finalized"),
    # --- the tokenizer facts (issue 22): code, shadowed methods, files named; the manifest's record made true, so
    # only the strict parser stands between them and the load
    Case("facts-tool-parser-is-os-system", lambda b, d: _facts(b, d, lambda f: _wrapper_object(f, "os:system")),
         FormatError, names="squishlike_tokenizer.json", action="load"),
    Case("facts-tool-parser-reaches-exec-through-mlx-lm", lambda b, d: _facts(b, d, lambda f: _wrapper_object(
        f, "mlx_lm.utils:json.__builtins__.exec")), FormatError, names="squishlike_tokenizer.json", action="load"),
    Case("facts-detokenizer-is-os-abort-through-mlx-lm", lambda b, d: _facts(b, d, lambda f: _set(
        f, detokenizer_class={"object": "mlx_lm.utils:os.abort"})), FormatError, names="squishlike_tokenizer.json",
         action="load"),
    Case("facts-shadow-encode", lambda b, d: _facts(b, d, lambda f: _facts_attribute(f, "wrapper", "encode", "x")),
         FormatError, names="squishlike_tokenizer.json", action="load"),
    Case("facts-shadow-reset", lambda b, d: _facts(b, d, lambda f: _facts_attribute(f, "detokenizer", "reset", 0)),
         FormatError, names="squishlike_tokenizer.json", action="load"),
    Case("facts-init-kwargs-name-a-file-outside", lambda b, d: _facts(b, d, lambda f: _facts_init_kwarg(
        f, "tokenizer_file", str(d / "outside-tokenizer.json"))), FormatError, names="squishlike_tokenizer.json",
         action="load"),
    # --- side files edited in a store whose tiers are built: a warm load checks them as a cold one does
    Case("warm-tokenizer-json-edited", lambda b, d: _json_edit(npy_copy(b, d, True), "tokenizer.json", lambda t: t[
        "model"]["vocab"].update({"pwned": 0})), IntegrityError, names="tokenizer.json", action="load"),
    Case("warm-config-rope-theta-edited", lambda b, d: _json_edit(npy_copy(b, d, True), "config.json", lambda c: _set(
        c, rope_theta=12345.0)), IntegrityError, names="config.json", action="load"),
    Case("warm-facts-eos-edited", lambda b, d: _json_edit(npy_copy(b, d, True), "squishlike_tokenizer.json",
                                                          lambda f: _facts_attribute(f, "wrapper", "_eos_token_ids",
                                                                                     {"set": [0]})),
         IntegrityError, names="squishlike_tokenizer.json", action="load"),
    Case("warm-chat-template-planted", lambda b, d: _side(npy_copy(b, d, True), "chat_template.jinja", b"{{ 7*7 }}"),
         IntegrityError, names="chat_template.jinja", action="load"),
    Case("warm-generation-config-planted-fifo", lambda b, d: _fifo(npy_copy(b, d, True),
                                                                   lambda t: t / "generation_config.json"),
         SquishError, names="generation_config.json", action="load"),
    # --- links out of the store where squishlike writes (issue 22): never followed, the outside untouched
    Case("lock-file-dangling-link", lambda b, d: _link_to(npy_copy(b, d), ".squishlike.lock", _outside(d) / "made"),
         FormatError, names=".squishlike.lock", action="load"),
    Case("lock-file-link-to-a-file", lambda b, d: _link_to(npy_copy(b, d), ".squishlike.lock",
                                                           _write(_outside(d) / "victim", b"keep")),
         FormatError, names=".squishlike.lock", action="load"),
    Case("tier-directory-symlinked-out-cold", lambda b, d: _tier_dir_link(b, d, built=False), FormatError,
         names="finalized", action="load"),
    # --- GGUF
    Case("gguf-bad-magic", lambda b, d: _write(d / "model.gguf", gguf_raw(magic=b"GGUX")), UnknownFormatError),
    Case("gguf-unknown-version", lambda b, d: _write(d / "model.gguf", gguf_raw(version=99)), FormatError),
    Case("gguf-absurd-tensor-count", lambda b, d: _write(d / "model.gguf", gguf_raw(n_tensors=2**63)), FormatError),
    Case("gguf-absurd-kv-count", lambda b, d: _write(d / "model.gguf", gguf_raw(n_kv=2**62)), FormatError),
    Case("gguf-absurd-string-length", lambda b, d: _write(d / "model.gguf", gguf_raw(
        raw_kv=_u64(2**60) + b"general.architecture" + _u32(G_STRING) + _gstr("llama"), n_kv=1)), FormatError),
    Case("gguf-absurd-array-length", lambda b, d: _write(d / "model.gguf", gguf_raw(
        raw_kv=_gstr("tokenizer.ggml.tokens") + _u32(G_ARRAY) + _u32(G_STRING) + _u64(2**61), n_kv=1)), FormatError),
    Case("gguf-tensor-offset-beyond-file", lambda b, d: _write(d / "model.gguf", gguf_raw(
        tensors=[("token_embd.weight", [8, 4], 0, 1 << 40)])), FormatError),
    Case("gguf-unknown-tensor-type", lambda b, d: _write(d / "model.gguf", gguf_raw(
        tensors=[("token_embd.weight", [8, 4], 999, 0)])), FormatError),
    Case("gguf-unknown-value-type", lambda b, d: _write(d / "model.gguf", gguf_raw(
        raw_kv=_gstr("general.architecture") + _u32(77) + _gstr("llama"), n_kv=1)), FormatError),
    Case("gguf-truncated-in-metadata", lambda b, d: _write(d / "model.gguf", gguf_raw()[:60]), FormatError),
    Case("gguf-absurd-dimension-count", lambda b, d: _write(d / "model.gguf", gguf_raw(
        raw_tensors=_gstr("token_embd.weight") + _u32(2**31) + _u64(8))), FormatError),
    Case("gguf-dimensions-overflow", lambda b, d: _write(d / "model.gguf", gguf_raw(
        tensors=[("token_embd.weight", [2**62, 2**62], 0, 0)])), FormatError),
    Case("gguf-duplicate-tensor-names", lambda b, d: _write(d / "model.gguf", gguf_raw(
        tensors=[EMBD, EMBD])), FormatError),
    Case("gguf-no-architecture", lambda b, d: _write(d / "model.gguf", gguf_raw(kvs=LLAMA_KV[1:])), FormatError),
    Case("gguf-unknown-architecture", lambda b, d: _write(d / "model.gguf", gguf_raw(
        kvs=[("general.architecture", G_STRING, "evilarch")])), UnsupportedArchitectureError),
    Case("gguf-metadata-not-utf8", lambda b, d: _write(d / "model.gguf", gguf_raw(
        kvs=[("general.architecture", G_STRING, b"ll\xffma")])), FormatError),
    # --- Ollama
    Case("ollama-blob-digest-mismatch", lambda b, d: _ollama_tamper(b, d, fix_digest=False), IntegrityError,
         names="{blob}"),
    Case("ollama-manifest-names-a-missing-blob", lambda b, d: ollama_edit(b, d, lambda root, m: _set(
        tensor_layer(m), digest="sha256:" + "ab" * 32)), FormatError),
    Case("ollama-digest-not-sha256-hex", lambda b, d: ollama_edit(b, d, lambda root, m: _set(
        tensor_layer(m), digest="sha256:../../../etc/hostname")), FormatError),
    Case("ollama-blob-size-differs", lambda b, d: ollama_edit(b, d, lambda root, m: _set(
        tensor_layer(m), size=tensor_layer(m)["size"] + 1)), IntegrityError, names="{blob}"),
    Case("ollama-json-layer-name-leaves-the-store", lambda b, d: ollama_edit(b, d, lambda root, m: _set(
        next(x for x in m["layers"] if x.get("name") == "config.json"), name="../../config.json")), FormatError),
    Case("ollama-blob-is-hostile-safetensors", lambda b, d: _ollama_tamper(b, d, fix_digest=True), FormatError,
         names="{blob}"),
    # --- MLX quantized directories
    Case("mlx-quantization-group-size-not-a-number", lambda b, d: _mlx_config(b, d, {"group_size": {"x": 32}}),
         FormatError, names="config.json"),
    Case("mlx-quantization-unknown-mode", lambda b, d: _mlx_config(b, d, {"mode": "int9"}), FormatError,
         names="{target}"),
    Case("mlx-quantization-bits-do-not-fit", lambda b, d: _mlx_config(b, d, {"bits": 8}), FormatError,
         names="{target}"),
    # --- config.json
    Case("config-missing-required-keys", lambda b, d: hf_with(b, d, config={
        k: v for k, v in hf_config(b).items() if k not in ("hidden_size", "num_hidden_layers")}),
         FormatError, names="{target}"),
    Case("config-unknown-architecture", lambda b, d: hf_with(b, d, config={**hf_config(b), "model_type": "evil"}),
         UnsupportedArchitectureError, names="{target}"),
    Case("config-not-json", lambda b, d: hf_with(b, d, config_raw=b'{"model_type": "llama", '), FormatError,
         names="config.json"),
    Case("config-not-an-object", lambda b, d: hf_with(b, d, config_raw=b'["llama"]'), FormatError,
         names="config.json"),
    Case("config-sizes-not-numbers", lambda b, d: hf_with(b, d, config={**hf_config(b), "hidden_size": "64"}),
         FormatError, names="{target}"),
    Case("config-zero-heads", lambda b, d: hf_with(b, d, config={**hf_config(b), "num_attention_heads": 0}),
         FormatError, names="{target}"),
    Case("config-names-custom-model-code", lambda b, d: _model_file(hf_with(b, d, config={
        **hf_config(b), "model_file": "evil.py"})), UnsupportedArchitectureError, names="{target}", action="load"),
    Case("npydir-config-names-custom-model-code", lambda b, d: _npy_model_file(b, d),
         UnsupportedArchitectureError, names="{target}", action="load"),
    Case("tokenizer-config-names-custom-code", lambda b, d: _tokenizer_auto_map(b, d), FormatError,
         names="{target}", action="load"),
]


# Files squishlike itself wrote (cache tiers, stored parts) edited so that every size the sentinels and manifest
# record still holds: only the structural checks, or the checksums, can tell.
MLX_TIER = "squish_weights.safetensors"
INT4_TIER = "squish_4bit/model.safetensors"
Q = "model.layers.0.self_attn.q_proj.weight"
O = "model.layers.0.self_attn.o_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
FIN = "finalized/layers.0.attention.k.weight.npy"


def _tier_case(name: str, rel: str, edit, tier: str, expect: type = FormatError, names: str | None = None) -> Case:
    return Case(name, lambda b, d: _tier_edit(b, d, rel, edit), expect, names=names or "{target}/" + rel,
                action=f"sentinel:{tier}")


def _swap(a: str, b: str):
    def edit(h: dict) -> None:
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
    return edit


def _field(name: str, key: str, value):
    return lambda h: h[name].__setitem__(key, value)


CASES += [
    # --- a cache tier's safetensors file (a forced load refuses it naming the file; the default load rebuilds it)
    _tier_case("tier-mlx-offsets-overlap", MLX_TIER, _field(O, "data_offsets", [0, 16384]), "mlx"),
    _tier_case("tier-mlx-names-swapped", MLX_TIER, _swap(Q, O), "mlx"),
    _tier_case("tier-mlx-dtype-relabelled", MLX_TIER, _field(Q, "dtype", "I32"), "mlx"),
    _tier_case("tier-mlx-shape-transposed", MLX_TIER, _field(K, "shape", [64, 32]), "mlx"),
    _tier_case("tier-mlx-tensor-renamed", MLX_TIER, lambda h: h.__setitem__("model.evil.weight", h.pop(Q)), "mlx"),
    _tier_case("tier-mlx-name-twice", MLX_TIER, b"duplicate", "mlx"),
    _tier_case("tier-mlx-header-length-beyond-file", MLX_TIER, b"length", "mlx"),
    _tier_case("tier-mlx-header-not-json", MLX_TIER, b"garbage", "mlx"),
    _tier_case("tier-int4-scales-and-biases-swapped", INT4_TIER, _swap(
        "model.layers.0.self_attn.q_proj.scales", "model.layers.0.self_attn.q_proj.biases"), "int4"),
    _tier_case("tier-int4-scales-relabelled-bf16", INT4_TIER, _field(
        "model.layers.0.self_attn.q_proj.scales", "dtype", "BF16"), "int4"),
    _tier_case("tier-int4-words-relabelled-signed", INT4_TIER, _field(Q, "dtype", "I32"), "int4"),
    _tier_case("tier-int4-offsets-overlap", INT4_TIER, _field(
        "model.layers.0.self_attn.q_proj.scales", "data_offsets", [0, 128]), "int4"),
    # --- a tier file swapped for the same file of another store (same size, a valid sentinel): only the file's
    # identity, bound by the sentinel, tells; then its hash. Copied in place (same inode), or renamed in, or copied
    # in place with its mtime set back.
    Case("tier-int4-file-from-another-store", lambda b, d: _from_other(b, d, INT4_TIER, "int4"), IntegrityError,
         names="{target}/" + INT4_TIER, action="sentinel:int4"),
    Case("tier-int4-file-from-another-store-mtime-kept", lambda b, d: _from_other(b, d, INT4_TIER, "int4",
                                                                                    keep_mtime=True),
         IntegrityError, names="{target}/" + INT4_TIER, action="sentinel:int4"),
    Case("tier-mlx-file-from-another-store-renamed-in", lambda b, d: _from_other(b, d, MLX_TIER, "mlx", rename=True),
         IntegrityError, names="{target}/" + MLX_TIER, action="sentinel:mlx"),
    Case("tier-finalized-file-from-another-store", lambda b, d: _from_other(b, d, FIN, "finalized"), IntegrityError,
         names="{target}/" + FIN, action="sentinel:finalized"),
    # --- a tier file that is a symbolic link: never read through, wherever it leads (a copy in the store, or out)
    Case("tier-mlx-file-links-to-a-copy-in-the-store", lambda b, d: _tier_file_link(b, d, MLX_TIER, inside=True),
         TierNotReadyError, names=f"{MLX_TIER}: is a symbolic link", action="sentinel:mlx"),
    Case("tier-mlx-file-links-to-a-copy-outside", lambda b, d: _tier_file_link(b, d, MLX_TIER, inside=False),
         TierNotReadyError, names=f"{MLX_TIER}: is a symbolic link", action="sentinel:mlx"),
    Case("tier-int4-file-links-to-a-copy-in-the-store", lambda b, d: _tier_file_link(b, d, INT4_TIER, inside=True),
         TierNotReadyError, names=f"{INT4_TIER}: is a symbolic link", action="sentinel:int4"),
    Case("tier-mlx-file-is-a-fifo", lambda b, d: _fifo(npy_copy(b, d, True), lambda t: t / MLX_TIER),
         TierNotReadyError, names=".squish_ready", action="sentinel:mlx"),
    Case("tier-int4-config-quantization-group-size-a-float", lambda b, d: _tier_json(
        b, d, "squish_4bit/config.json", lambda c: c["quantization"].update(group_size=32.0)), FormatError,
         names="squish_4bit/config.json", action="sentinel:int4"),
    Case("tier-int4-config-claims-2e31-layers", lambda b, d: _tier_json(
        b, d, "squish_4bit/config.json", lambda c: c.update(num_hidden_layers=2**31)), FormatError,
         names="squish_4bit/config.json", action="sentinel:int4"),
    Case("npydir-config-claims-2e31-layers", lambda b, d: _tier_json(
        b, d, "config.json", lambda c: c.update(num_hidden_layers=2**31)), FormatError,
         names="{target}", action="load"),
    # --- finalized/: one .npy per tensor
    _tier_case("finalized-fortran-order-flipped", FIN, lambda h: h.replace("False", "True "), "finalized"),
    _tier_case("finalized-byte-order-flipped", FIN, lambda h: h.replace("<f4", ">f4"), "finalized"),
    _tier_case("finalized-dtype-relabelled", FIN, lambda h: h.replace("<f4", "<i4"), "finalized"),
    _tier_case("finalized-shape-transposed", FIN, lambda h: h.replace("(32, 64)", "(64, 32)"), "finalized"),
    _tier_case("finalized-object-dtype", FIN, lambda h: h.replace("'<f4'", "'|O' "), "finalized"),
    _tier_case("finalized-shape-huge", FIN, lambda h: h.replace("(32, 64)", "(2**40,)"), "finalized"),
    Case("finalized-part-is-a-fifo", lambda b, d: _fifo(npy_copy(b, d, True), lambda t: t / FIN),
         TierNotReadyError, names="finalized/.ready", action="sentinel:finalized"),
    # --- the store's parts, their records in the manifest kept true (only what they hold is hostile)
    Case("npy-scale-nan", lambda b, d: _part_values(b, d, "s4", np.nan), FormatError, names="{part:s4}",
         action="npydir"),
    Case("npy-scale-inf-on-load", lambda b, d: _part_values(b, d, "s4", np.inf), FormatError, names="{part:s4}",
         action="load"),
    Case("npy-offset-inf", lambda b, d: _part_values(b, d, "z4", -np.inf), FormatError, names="{part:z4}",
         action="npydir"),
    Case("npy-scale-byte-order-flipped", lambda b, d: _part_header(b, d, "s4", lambda h: h.replace("'<f", "'>f")),
         FormatError, names="{part:s4}", action="npydir"),
    Case("npy-codes-fortran-order", lambda b, d: _part_header(b, d, "q4", lambda h: h.replace("False", "True ")),
         FormatError, names="{part}", action="load"),
    Case("npy-trailing-bytes", lambda b, d: _part_bytes(b, d, "q4", lambda raw: raw + b"\0" * 64), FormatError,
         names="{part}", action="npydir"),
    Case("npy-passthrough-header-claims-1e12-elements", lambda b, d: _sparse_part(b, d), FormatError,
         names="token_embedding.weight__pt.npy", action="load"),
    Case("npy-passthrough-claims-1e12-elements-everywhere", lambda b, d: _sparse_part(b, d, manifest_too=True),
         FormatError, names="manifest.json", action="load"),
    Case("store-two-bytes-overwritten", lambda b, d: _overwrite(npy_copy(b, d), part), IntegrityError,
         names="{part}", action="load"),
    Case("store-parts-swapped", lambda b, d: _swap_parts(npy_copy(b, d)), IntegrityError,
         names="layers.0.attention.k.weight__q4.npy", action="load"),
    Case("store-side-file-damaged", lambda b, d: _overwrite(npy_copy(b, d), lambda t: t / "tokenizer.json"),
         IntegrityError, names="tokenizer.json", action="load"),
    Case("store-part-is-a-device", lambda b, d: _device(npy_copy(b, d), part), FormatError, names="{part}",
         action="load"),
    # --- the manifest's fields, each of the wrong JSON type
    *(Case(f"manifest-{what}", lambda b, d, fn=fn: manifest_edit(npy_copy(b, d), fn), FormatError,
           names="manifest.json", action="npydir") for what, fn in [
        ("policy-a-string", lambda m: _set(m, policy="all")),
        ("policy-tiers-not-names", lambda m: m["policy"].update(tiers=[1, 2])),
        ("source-a-list", lambda m: _set(m, source=["hf", "x"])),
        ("clip-search-a-string", lambda m: _set(m, clip_search="yes")),
        ("side-file-size-a-string", lambda m: m["side_files"]["config.json"].update(size="12")),
        ("shape-has-a-float", lambda m: _set(first_entry(m), shape=[float(x) for x in first_entry(m)["shape"]])),
        ("group-size-a-float", lambda m: _set(first_entry(m), group_size=32.0)),
        ("int3-gate-a-list", lambda m: _set(m, int3_gate=["passed"])),
        ("model-type-a-number", lambda m: _set(m, model_type=7)),
        ("tensors-a-list", lambda m: _set(m, tensors=list(m["tensors"]))),
        ("entry-without-scheme", lambda m: first_entry(m).pop("scheme")),
        ("file-record-sha-a-number", lambda m: first_entry(m)["files"]["q4"].update(sha256=12)),
        ("runtime-dtype-a-list", lambda m: _set(m, runtime_dtype=["float32"])),
        ("format-version-a-string", lambda m: _set(m, format_version="1")),
    ]),
    Case("manifest-claims-a-5gb-tensor", lambda b, d: manifest_edit(npy_copy(b, d), _five_gb), FormatError,
         names="manifest.json", action="load"),
    Case("manifest-is-a-fifo", lambda b, d: _fifo(npy_copy(b, d), lambda t: t / "manifest.json"), FormatError,
         names="manifest.json", action="npydir"),
    # --- config.json and generation_config.json of an HF directory
    Case("config-missing", lambda b, d: _unlink(hf_with(b, d), "config.json"), SquishError, names="{target}"),
    Case("config-empty", lambda b, d: hf_with(b, d, config_raw=b""), FormatError, names="config.json"),
    Case("config-truncated", lambda b, d: hf_with(b, d, config_raw=json.dumps(hf_config(b)).encode()[:40]),
         FormatError, names="config.json"),
    Case("config-claims-2e31-layers", lambda b, d: hf_with(b, d, config={**hf_config(b), "num_hidden_layers": 2**31}),
         FormatError, names="{target}", action="load"),
    Case("config-norm-eps-a-string", lambda b, d: hf_with(b, d, config={**hf_config(b), "rms_norm_eps": "tiny"}),
         FormatError, names="{target}"),
    Case("config-rope-theta-a-list", lambda b, d: hf_with(b, d, config={**hf_config(b), "rope_theta": [1e4]}),
         FormatError, names="{target}"),
    Case("config-tie-embeddings-a-string", lambda b, d: hf_with(b, d, config={
        **hf_config(b), "tie_word_embeddings": "no"}), FormatError, names="{target}"),
    Case("config-head-dim-a-float", lambda b, d: hf_with(b, d, config={**hf_config(b), "head_dim": 16.5}),
         FormatError, names="{target}"),
    Case("config-is-a-directory", lambda b, d: _replace_with_dir(hf_with(b, d), "config.json"), SquishError,
         names="{target}"),
    Case("config-links-to-a-device", lambda b, d: _link(hf_with(b, d), "config.json", "/dev/zero"), FormatError,
         names="config.json"),
    Case("config-links-out-of-the-directory", lambda b, d: _link_out(hf_with(b, d), "config.json"), FormatError,
         names="config.json"),
    Case("generation-config-eos-an-object", lambda b, d: _side(hf_with(b, d), "generation_config.json",
                                                               b'{"eos_token_id": {"id": 2}}'), FormatError,
         names="generation_config.json", action="load"),
    Case("generation-config-a-list", lambda b, d: _side(hf_with(b, d), "generation_config.json", b"[2]"),
         FormatError, names="generation_config.json", action="load"),
    Case("generation-config-is-a-fifo", lambda b, d: _fifo(hf_with(b, d), lambda t: t / "generation_config.json"),
         FormatError, names="generation_config.json", action="load"),
    Case("tokenizer-is-a-fifo", lambda b, d: _fifo(hf_with(b, d), lambda t: t / "tokenizer.json"), FormatError,
         names="tokenizer.json"),
    Case("st-weights-are-a-fifo", lambda b, d: _fifo(hf_with(b, d), lambda t: t / "model.safetensors"), FormatError,
         names="model.safetensors"),
    Case("st-weights-link-out-of-the-directory", lambda b, d: _link_out(hf_with(b, d), "model.safetensors"),
         FormatError, names="model.safetensors"),
    Case("st-index-is-a-fifo", lambda b, d: _fifo(hf_with(b, d), lambda t: t / "model.safetensors.index.json"),
         FormatError, names="model.safetensors.index.json"),
    Case("hf-cache-snapshot-links-into-another-repo", lambda b, d: _hf_cache(b, d, other_repo=True), FormatError,
         names="model.safetensors"),
    # --- MLX quantized directories
    Case("mlx-quantization-group-size-a-float", lambda b, d: _mlx_config(b, d, {"group_size": 32.0}), FormatError,
         names="config.json"),
    Case("mlx-per-layer-override-does-not-match", lambda b, d: _mlx_config(b, d, {
        "model.layers.0.self_attn.q_proj": {"group_size": 64, "bits": 4}}), FormatError, names="{target}"),
    Case("mlx-per-layer-override-bits-a-string", lambda b, d: _mlx_config(b, d, {
        "model.layers.0.self_attn.q_proj": {"group_size": 32, "bits": "4"}}), FormatError, names="{target}"),
    # --- GGUF
    Case("gguf-tensor-data-misaligned", lambda b, d: _write(d / "model.gguf", gguf_raw(
        tensors=[("token_embd.weight", [8, 4], 0, 4)], data=np.arange(64, dtype=np.float32).tobytes())),
         FormatError),
    Case("gguf-tensor-data-overlaps", lambda b, d: _write(d / "model.gguf", gguf_raw(
        tensors=[EMBD, ("output_norm.weight", [8], 0, 32)])), FormatError),
    Case("gguf-five-dimensions", lambda b, d: _write(d / "model.gguf", gguf_raw(
        tensors=[("token_embd.weight", [2, 2, 2, 2, 2], 0, 0)])), FormatError),
    Case("gguf-arrays-nested-deep", lambda b, d: _write(d / "model.gguf", gguf_raw(
        raw_kv=b"".join(_gstr(k) + _u32(t) + _gval(t, v) for k, t, v in LLAMA_KV) + _gstr("x") + _u32(G_ARRAY)
        + (_u32(G_ARRAY) + _u64(1)) * 5000 + _u32(G_U32) + _u64(1) + _u32(7), n_kv=len(LLAMA_KV) + 1)),
         FormatError),
    Case("gguf-alignment-zero", lambda b, d: _write(d / "model.gguf", gguf_raw(
        kvs=[*LLAMA_KV, ("general.alignment", G_U32, 0)])), FormatError),
    Case("gguf-claims-2e31-layers", lambda b, d: _write(d / "model.gguf", gguf_raw(
        kvs=[LLAMA_KV[0], ("llama.block_count", G_U32, 2**31 - 1), *LLAMA_KV[2:]])), FormatError, action="load"),
    Case("gguf-block-count-a-string", lambda b, d: _write(d / "model.gguf", gguf_raw(
        kvs=[LLAMA_KV[0], ("llama.block_count", G_STRING, "1"), *LLAMA_KV[2:]])), FormatError, action="load"),
    Case("gguf-is-a-fifo", lambda b, d: _fifo(_write(d / "model.gguf", gguf_raw()).parent, lambda t: t / "model.gguf")
         / "model.gguf", UnknownFormatError),
    # --- Ollama
    Case("ollama-config-claims-2e31-layers", lambda b, d: _ollama_config(b, d, lambda c: c.update(
        num_hidden_layers=2**31)), FormatError, action="load"),
    Case("ollama-config-layer-not-json", lambda b, d: _ollama_config(b, d, lambda c: b'{"model_type": '),
         FormatError, names="{config_blob}"),
    Case("ollama-config-layer-a-list", lambda b, d: _ollama_config(b, d, lambda c: b"[1, 2]"), FormatError,
         names="{config_blob}"),
    Case("ollama-blob-is-a-fifo", lambda b, d: ollama_edit(b, d, lambda root, m: _fifo(
        root, lambda r: ollama_blob(r, tensor_layer(m)))), FormatError),
    Case("ollama-blob-links-out-of-the-store", lambda b, d: ollama_edit(b, d, lambda root, m: _blob_link_out(
        root, tensor_layer(m), d)), FormatError, names="{blob}"),
    Case("ollama-layer-is-a-number", lambda b, d: ollama_edit(b, d, lambda root, m: m["layers"].append(5)),
         FormatError),
    Case("ollama-layer-size-a-string", lambda b, d: ollama_edit(b, d, lambda root, m: _set(
        tensor_layer(m), size=str(tensor_layer(m)["size"]))), FormatError),
]


NORM = "model.norm.weight"

CASES += [
    # --- issue 45: a float tensor whose header says integers (its byte count kept), in every format that can say so
    # (an npy-dir's manifest admits float dtypes only, and each part's header must say its dtype: npy-wrong-dtype-*)
    Case("st-linear-weight-relabelled-int32", lambda b, d: _relabelled(hf_with(b, d), "model.safetensors", Q),
         FormatError, names=f"{{target}}/model.safetensors: tensor {Q}", also=("load",)),
    Case("st-norm-relabelled-int32", lambda b, d: _relabelled(hf_with(b, d), "model.safetensors", NORM),
         FormatError, names=f"{{target}}/model.safetensors: tensor {NORM}", also=("load",)),
    Case("mlx-norm-relabelled-int32", lambda b, d: _relabelled(_mlx_config(b, d, {}), "model.safetensors", NORM),
         FormatError, names=f"{{target}}/model.safetensors: tensor {NORM}", also=("load",)),
    Case("ollama-tensor-relabelled-int32", lambda b, d: ollama_edit(b, d, _relabelled_blob), FormatError,
         names="{blob}: tensor", also=("load",)),
    Case("gguf-tensor-relabelled-int32", lambda b, d: _gguf_relabelled(b, d, "output_norm.weight"), FormatError,
         names="{target}: tensor output_norm.weight", also=("load",)),
    # --- issue 45: a model_type naming a module of mlx_lm.models that builds no model
    Case("config-model-type-names-a-module-that-is-no-model", lambda b, d: hf_with(b, d, config={
        **hf_config(b), "model_type": "cache"}), UnsupportedArchitectureError, names="{target}", also=("load",)),
    Case("manifest-model-type-names-a-module-that-is-no-model", lambda b, d: manifest_edit(npy_copy(b, d), lambda m: _set(
        m, model_type="rope_utils")), UnsupportedArchitectureError, names="{target}", action="load"),
    # --- issue 45: NaN or infinite scales and offsets, every record of them kept true, in a store loaded the default
    # way (its quantized tier read straight from the store, format 2 and format 1) and in a built int4 tier
    Case("pack-scale-nan-default-load", lambda b, d: _packed_value(b, d, "s4", np.nan), FormatError,
         names="{pack:s4}", action="load", also=("open",)),
    Case("pack-offset-inf-default-load", lambda b, d: _packed_value(b, d, "z4", -np.inf), FormatError,
         names="{pack:z4}", action="load", also=("open",)),
    Case("npy-scale-nan-default-load", lambda b, d: _packed_value(b, d, "s4", np.nan, format_1=True), FormatError,
         names="{part:s4}", action="load", also=("open",)),
    Case("npy-offset-inf-default-load", lambda b, d: _packed_value(b, d, "z4", np.inf, format_1=True), FormatError,
         names="{part:z4}", action="load", also=("open",)),
    Case("tier-int4-scale-nan-identity-kept", lambda b, d: _tier_scale(b, d, np.nan), FormatError,
         names="{target}/" + INT4_TIER, action="sentinel:int4"),
    # --- issue 45: a quantized MLX layer whose override MLX cannot build (affine groups of 16)
    Case("mlx-per-layer-override-group-size-16", lambda b, d: _mlx_group_16(b, d), FormatError,
         names="{target}: quantized tensor model.layers.0.self_attn.q_proj.weight", also=("load",)),
]


def _relabel_header(path: Path, name: str) -> None:
    """`name`'s dtype in the safetensors header of `path` made the signed integer of its width: its byte count, the
    file's size and every other byte kept."""
    raw = bytearray(path.read_bytes())
    length = struct.unpack_from("<Q", raw)[0]
    header = json.loads(raw[8:8 + length])
    header[name]["dtype"] = {"F32": "I32", "F16": "I16", "BF16": "I16"}[header[name]["dtype"]]
    text = json.dumps(header, separators=(",", ":"))
    assert len(text) <= length
    raw[8:8 + length] = text.ljust(length).encode()
    path.write_bytes(bytes(raw))


def _relabelled(target: Path, rel: str, name: str) -> Path:
    _relabel_header(target / rel, name)
    return target


def _relabelled_blob(root: Path, m: dict) -> None:
    """The tensor layer's blob relabelled, its digest made true again."""
    layer = tensor_layer(m)
    blob = ollama_blob(root, layer)
    _relabel_header(blob, layer["name"])
    _rewrite_blob(root, layer, blob.read_bytes(), True)


def _gguf_relabelled(base: Base, d: Path, name: str) -> Path:
    """The HF model as a float32 GGUF, as llama.cpp's converter writes it, with `name`'s type field saying I32."""
    import gguf

    import squishlike
    from .fixtures.gguf_models import write_gguf

    with squishlike.open_weights(base.hf) as provider:
        weights = {n: np.asarray(provider.get(n)) for n in provider.names()}
        path = write_gguf(d / "model.gguf", provider.config, weights)
    raw = bytearray(path.read_bytes())
    record = raw.index(_gstr(name))
    type_at = record + len(_gstr(name)) + 4 + 8 * struct.unpack_from("<I", raw, record + len(_gstr(name)))[0]
    assert struct.unpack_from("<I", raw, type_at)[0] == gguf.GGMLQuantizationType.F32
    struct.pack_into("<I", raw, type_at, gguf.GGMLQuantizationType.I32)
    path.write_bytes(bytes(raw))
    return path


def _packed_value(base: Base, d: Path, suffix: str, value: float, format_1: bool = False) -> Path:
    """The default store (base.packed) with one value of the first INT4 tensor's part `suffix` set to `value`, in
    its pack (or, `format_1`, in its own .npy), and the manifest's record of that file made true again."""
    from squishlike.io.checksum import file_record
    from squishlike.npydir import NpyDir
    from .format1 import as_format_1

    target = shutil.copytree(base.packed, d / "model")
    if format_1:
        return _set_part_value(as_format_1(target), suffix, value)
    store = NpyDir(target)
    name = next(n for n, e in store.entries.items() if e.scheme == "int4")
    dtype, _ = store.entries[name].part_spec(suffix)
    path, offset = pack(target, suffix), store.entries[name].files[suffix].offset
    raw = bytearray(path.read_bytes())
    raw[offset + 3 * dtype.itemsize:offset + 4 * dtype.itemsize] = np.array([value], np.float32).astype(dtype).tobytes()
    path.write_bytes(bytes(raw))
    return manifest_edit(target, lambda m: m["packs"].update({str(path.relative_to(target)): file_record(path)}))


def _tier_scale(base: Base, d: Path, value: float) -> Path:
    """A value of the int4 tier's first scales set to `value` in place, as a failing disk would (its sentinel made
    to record the file's identity after the write, so that only the value tells)."""
    from squishlike.io.sentinel import IDENTITY, identity

    target = _loaded_copy(base, d, "int4")
    path = target / INT4_TIER
    raw = bytearray(path.read_bytes())
    length = struct.unpack_from("<Q", raw)[0]
    header = json.loads(raw[8:8 + length])
    entry = header["model.layers.0.self_attn.q_proj.scales"]
    dtype = {"F32": np.float32, "F16": np.float16}[entry["dtype"]]
    at = 8 + length + entry["data_offsets"][0] + 3 * np.dtype(dtype).itemsize
    raw[at:at + np.dtype(dtype).itemsize] = np.array([value], dtype).tobytes()
    path.write_bytes(bytes(raw))
    sentinel_edit(target, ".squish_4bit_ready", lambda p: _set(p, files={
        rel: {**record, IDENTITY: identity(os.lstat(target / rel))} for rel, record in p["files"].items()}))
    return target


def _mlx_group_16(base: Base, d: Path) -> Path:
    """A real MLX 4-bit directory whose q_proj is held in groups of 16 (each group-of-32 scale and offset twice: the
    same weights) with the per-layer override that says so: a layer MLX does not build."""
    from safetensors.numpy import load_file, save_file

    target = _mlx_config(base, d, {})
    weights = load_file(str(target / "model.safetensors"))
    layer = Q.removesuffix(".weight")
    for part_name in ("scales", "biases"):
        weights[f"{layer}.{part_name}"] = np.repeat(weights[f"{layer}.{part_name}"], 2, axis=-1)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "mlx"})
    config = json.loads((target / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        if key in config:
            config[key][layer] = {"group_size": 16, "bits": 4}
    (target / "config.json").write_text(json.dumps(config))
    return target


def _tier_edit(base: Base, d: Path, rel: str, edit) -> Path:
    """Edit the header of a tier file in place, keeping the file's size (so its sentinel still says "ready").
    `edit`: a function of the safetensors header dict (or of the .npy header text), or one of the raw edits
    b"duplicate", b"length", b"garbage" of a safetensors header."""
    target = npy_copy(base, d, True)
    path = target / rel
    raw = bytearray(path.read_bytes())
    if rel.endswith(".npy"):
        length = struct.unpack_from("<H", raw, 8)[0]
        text = edit(raw[10:10 + length].decode("latin1").rstrip("\n"))
        raw[10:10 + length] = (text.ljust(length - 1) + "\n").encode("latin1")[:length]
        path.write_bytes(bytes(raw))
        return target
    length = struct.unpack_from("<Q", raw)[0]
    header = json.loads(raw[8:8 + length])
    if edit == b"duplicate":  # o_proj's entry renamed q_proj (names of the same length): q_proj twice
        raw[8:8 + length] = raw[8:8 + length].replace(f'"{O}"'.encode(), f'"{Q}"'.encode())
        path.write_bytes(bytes(raw))
        return target
    if edit == b"length":
        struct.pack_into("<Q", raw, 0, len(raw))
        path.write_bytes(bytes(raw))
        return target
    elif edit == b"garbage":
        text = "{" + "\x01" * 16
    else:
        edit(header)
        text = json.dumps(header, separators=(",", ":"))
    assert len(text) <= length, "the edited header must fit in the original's length"
    raw[8:8 + length] = text.ljust(length).encode()
    path.write_bytes(bytes(raw))
    return target


def _loaded_copy(base: Base, d: Path, tier: str) -> Path:
    """A copy of the built store, loaded once from `tier` (forced), as a store is after its first load: whatever a
    load records about the tier's files on disk is recorded for this copy's own files."""
    import squishlike

    target = npy_copy(base, d, True)
    squishlike.load(target, tier=tier)
    return target


def _from_other(base: Base, d: Path, rel: str, tier: str, rename: bool = False, keep_mtime: bool = False) -> Path:
    """`rel`, a file of `tier`, replaced by the same file of base.other (same size, other weights), its sentinel
    kept: copied over it in place (as `cp` does: same inode), or renamed over it; `keep_mtime` sets its
    modification time back to the replaced file's."""
    target = _loaded_copy(base, d, tier)
    path, foreign = target / rel, base.other / rel
    before = path.stat()
    assert foreign.stat().st_size == before.st_size and foreign.read_bytes() != path.read_bytes()
    if rename:
        shutil.copyfile(foreign, path.with_name(".incoming"))
        os.replace(path.with_name(".incoming"), path)
    else:
        shutil.copyfile(foreign, path)
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    return target


def _tier_file_link(base: Base, d: Path, rel: str, inside: bool) -> Path:
    """`rel`, a file of a tier, replaced by a symbolic link to a copy of it, in the store or outside it."""
    target = _loaded_copy(base, d, "int4" if rel == INT4_TIER else "mlx")
    copy = (target / ".copy" if inside else _outside(d) / "copy") / Path(rel).name
    copy.parent.mkdir(exist_ok=True)
    shutil.move(str(target / rel), copy)
    (target / rel).symlink_to(copy)
    return target


def _tier_json(base: Base, d: Path, rel: str, edit) -> Path:
    """Edit a JSON file of a built npy-dir, keeping its size (compact JSON padded with spaces)."""
    target = npy_copy(base, d, True)
    path = target / rel
    size = path.stat().st_size
    value = json.loads(path.read_text())
    edit(value)
    text = json.dumps(value, separators=(",", ":"))
    assert len(text) <= size
    path.write_text(text.ljust(size))
    return target


def _rerecord(target: Path, rel: str) -> None:
    """Make the manifest's record of `rel` true again after an edit: only the edit's content is hostile."""
    raw = (target / rel).read_bytes()
    record = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}

    def edit(m: dict) -> None:
        for entry in m["tensors"].values():
            for suffix in entry["files"]:
                if f"{entry['key']}__{suffix}.npy" == Path(rel).name:
                    entry["files"][suffix] = record
    manifest_edit(target, edit)


def _part_values(base: Base, d: Path, suffix: str, value: float) -> Path:
    return _set_part_value(npy_copy(base, d), suffix, value)


def _set_part_value(target: Path, suffix: str, value: float) -> Path:
    """Format 1: a value of the first INT4 tensor's part `suffix` set to `value`, its manifest record made true."""
    p = part(target, suffix)
    a = np.load(p)
    a.flat[3] = value
    np.save(p, a, allow_pickle=False)
    _rerecord(target, str(p.relative_to(target)))
    return target


def _part_header(base: Base, d: Path, suffix: str, edit) -> Path:
    target = npy_copy(base, d)
    p = part(target, suffix)
    raw = bytearray(p.read_bytes())
    length = struct.unpack_from("<H", raw, 8)[0]
    text = edit(raw[10:10 + length].decode("latin1").rstrip("\n"))
    raw[10:10 + length] = (text.ljust(length - 1) + "\n").encode("latin1")[:length]
    p.write_bytes(bytes(raw))
    _rerecord(target, str(p.relative_to(target)))
    return target


def _part_bytes(base: Base, d: Path, suffix: str, fn) -> Path:
    target = npy_copy(base, d)
    p = part(target, suffix)
    p.write_bytes(fn(p.read_bytes()))
    _rerecord(target, str(p.relative_to(target)))
    return target


def _sparse_part(base: Base, d: Path, manifest_too: bool = False) -> Path:
    """A passthrough part whose header claims 10**12 elements, on a sparse file of that size."""
    target = npy_copy(base, d)
    p = target / "tensors" / "token_embedding.weight__pt.npy"
    header = npy_header_bytes("<f4", (10**6, 10**6))
    with open(p, "wb") as f:
        f.write(header)
        f.truncate(len(header) + 4 * 10**12)
    if manifest_too:
        def edit(m: dict) -> None:
            entry = m["tensors"]["token_embedding.weight"]
            entry["shape"] = [10**6, 10**6]
            entry["files"]["pt"]["size"] = len(header) + 4 * 10**12
        manifest_edit(target, edit)
    return target


def _five_gb(m: dict) -> None:
    """A passthrough tensor claiming 5 GB, its record claiming a file that big: only the real file is small."""
    entry = m["tensors"]["token_embedding.weight"]
    entry["shape"] = [65536, 20480]
    entry["files"]["pt"]["size"] = 65536 * 20480 * 4 + 128


def _overwrite(target: Path, where) -> Path:
    """Two bytes of a stored file overwritten: its size, and every record of it, unchanged."""
    p = where(target)
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 2] = bytes(x ^ 0x5A for x in raw[len(raw) // 2:len(raw) // 2 + 2])
    p.write_bytes(bytes(raw))
    return target


def _swap_parts(target: Path) -> Path:
    """Two parts of the same dtype and shape (k and v of one layer) exchanged: each is a valid file for the other."""
    k = target / "tensors" / "layers.0.attention.k.weight__q4.npy"
    v = target / "tensors" / "layers.0.attention.v.weight__q4.npy"
    k_raw, v_raw = k.read_bytes(), v.read_bytes()
    k.write_bytes(v_raw)
    v.write_bytes(k_raw)
    return target


def _device(target: Path, where) -> Path:
    p = where(target)
    p.unlink()
    p.symlink_to("/dev/zero")
    return target


def _unlink(target: Path, rel: str) -> Path:
    (target / rel).unlink()
    return target


def _replace_with_dir(target: Path, rel: str) -> Path:
    (target / rel).unlink()
    (target / rel).mkdir()
    return target


def _link(target: Path, rel: str, to: str) -> Path:
    (target / rel).unlink()
    (target / rel).symlink_to(to)
    return target


def _link_out(target: Path, rel: str) -> Path:
    """`rel` replaced by a link to an identical copy outside the model directory."""
    outside = target.parent / f"outside-{rel}"
    shutil.move(str(target / rel), outside)
    (target / rel).symlink_to(outside)
    return target


def _side(target: Path, rel: str, data: bytes) -> Path:
    (target / rel).write_bytes(data)
    return target


def _hf_cache(base: Base, d: Path, other_repo: bool = False) -> Path:
    """A Hugging Face cache: snapshots/<rev>/<file> links to ../../blobs/<hash>; with `other_repo`, the weights
    link into another repo's blobs instead."""
    repo = d / "hub" / "models--tiny--llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in sorted(base.hf.iterdir()):
        blobs = (d / "hub" / "models--evil--repo" if other_repo and f.name == "model.safetensors" else repo) / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def _ollama_config(base: Base, d: Path, edit) -> Path:
    """The config.json layer rewritten (its digest and size kept true): `edit` changes the dict, or returns bytes."""
    def fn(root: Path, m: dict) -> None:
        layer = next(x for x in m["layers"] if x.get("name") == "config.json")
        config = json.loads(ollama_blob(root, layer).read_bytes())
        data = edit(config)
        _rewrite_blob(root, layer, data if isinstance(data, bytes) else json.dumps(config).encode(), True)
    return ollama_edit(base, d, fn)


def _blob_link_out(root: Path, layer: dict, d: Path) -> None:
    blob = ollama_blob(root, layer)
    outside = d / "outside-blob"
    shutil.move(str(blob), outside)
    blob.symlink_to(outside)

for _case in CASES:  # a damaged safetensors file inside an HF directory: the message names that file
    if _case.name.startswith("st-") and _case.names == "{target}" and _case.action == "open":
        _case.names = "{target}/model.safetensors"


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _index(base: Base, d: Path, shard: str | None) -> Path:
    target = hf_with(base, d)
    index = target / "model.safetensors.index.json"
    if shard is None:
        index.write_text('{"weight_map": {')
    else:
        index.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": shard}}))
    return target


def _wrong_role(base: Base, d: Path) -> Path:
    from safetensors.numpy import load_file, save_file

    target = hf_with(base, d)
    tensors = load_file(str(target / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[name] = np.zeros((3, 3), tensors[name].dtype)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _npy_replace(base: Base, d: Path, fn) -> Path:
    target = npy_copy(base, d)
    p = part(target)
    np.save(p, fn(np.load(p)), allow_pickle=False)
    return target


def _npy_bytes(base: Base, d: Path, fn) -> Path:
    target = npy_copy(base, d)
    p = part(target)
    p.write_bytes(fn(p.read_bytes()))
    return target


def _npy_pickle(base: Base, d: Path) -> Path:
    target = npy_copy(base, d)
    p = part(target)
    evil = np.empty(1, dtype=object)
    evil[0] = _Evil(d / MARKER)
    with open(p, "wb") as f:
        np.lib.format.write_array(f, evil, allow_pickle=True)
    return target


def _npy_fortran(base: Base, d: Path) -> Path:
    target = npy_copy(base, d)
    p = part(target)
    a = np.load(p)
    np.save(p, np.asfortranarray(a), allow_pickle=False)  # same dtype and shape, column-major
    return target


def _npy_header(base: Base, d: Path, descr: str, shape) -> Path:
    target = npy_copy(base, d)
    part(target).write_bytes(npy_header_bytes(descr, shape) + b"\0" * 64)
    return target


def _npy_code_header(base: Base, d: Path) -> Path:
    target = npy_copy(base, d)
    code = f"__import__('os').open({str(d / MARKER)!r}, 65)"
    header = "{'descr': '|u1', 'fortran_order': False, 'shape': " + code + ", }"
    header += " " * (-(len(header) + 11) % 64) + "\n"
    part(target).write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + b"\0" * 64)
    return target


def _npy_symlink(base: Base, d: Path) -> Path:
    target = npy_copy(base, d)
    p = part(target)
    outside = d / "outside.npy"
    shutil.copy(p, outside)  # the right dtype and shape: only where it lives is wrong
    p.unlink()
    p.symlink_to(outside)
    return target


def _side_symlink(base: Base, d: Path) -> Path:
    target = npy_copy(base, d)
    outside = d / "outside-config.json"
    shutil.copy(target / "config.json", outside)
    (target / "config.json").unlink()
    (target / "config.json").symlink_to(outside)
    return target


def _tier_dir_symlink(base: Base, d: Path) -> Path:
    target = npy_copy(base, d, True)
    outside = d / "elsewhere"
    shutil.move(str(target / "finalized"), outside)
    (target / "finalized").symlink_to(outside, target_is_directory=True)
    return target


OUTSIDE = "elsewhere"  # a case's directory outside its model, where links lead: nothing may change in it


def _outside(d: Path) -> Path:
    (d / OUTSIDE).mkdir(exist_ok=True)
    return d / OUTSIDE


def _link_to(target: Path, rel: str, to: Path) -> Path:
    (target / rel).unlink(missing_ok=True)
    (target / rel).symlink_to(to)
    return target


def _tier_dir_link(base: Base, d: Path, built: bool) -> Path:
    """finalized/ a link to a directory outside (holding a copy of the tier when `built`)."""
    target = npy_copy(base, d, built)
    if built:
        shutil.rmtree(_outside(d))
        shutil.move(str(target / "finalized"), d / OUTSIDE)
    manifest_edit(target, lambda m: m["policy"].update(tiers=["finalized"]))  # the tier the cold path builds
    return _link_to(target, "finalized", _outside(d))


def _json_edit(target: Path, rel: str, fn) -> Path:
    content = json.loads((target / rel).read_text())
    content = fn(content) or content
    (target / rel).write_text(json.dumps(content))
    return target


def _facts(base: Base, d: Path, fn) -> Path:
    """The store's facts file edited by `fn`, and the manifest's record of it made true."""
    target = _json_edit(npy_copy(base, d, True), "squishlike_tokenizer.json", fn)
    raw = (target / "squishlike_tokenizer.json").read_bytes()
    return manifest_edit(target, lambda m: m["side_files"].update({"squishlike_tokenizer.json": {
        "size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}}))


def _facts_attribute(facts: dict, part: str, name: str, value) -> dict:
    return _set(facts, **{part: {"dict": [*facts[part]["dict"], [name, value]]}})


def _facts_init_kwarg(facts: dict, name: str, value) -> dict:
    return _set(facts, tokenizer={"dict": [[k, {"dict": [*v["dict"], [name, value]]} if k == "init_kwargs" else v]
                                           for k, v in facts["tokenizer"]["dict"]]})


def _wrapper_object(facts: dict, name: str) -> dict:
    return _set(facts, wrapper={"dict": [[k, {"object": name} if k == "_tool_parser" else v]
                                         for k, v in facts["wrapper"]["dict"]]})


def _long_key(base: Base, d: Path) -> Path:
    """A tensor whose name (so its key, so its file name) is longer than a file name may be."""
    target = npy_copy(base, d)

    def edit(m: dict) -> None:
        name = "output_norm.weight"
        long = name + "." + "x" * 300
        entry = m["tensors"].pop(name)
        entry["key"] = long
        m["tensors"][long] = entry
    return manifest_edit(target, edit)


def _mlx_config(base: Base, d: Path, quantization: dict) -> Path:
    """A real MLX 4-bit directory whose config.json's "quantization" says something else."""
    from squishlike.exporter import export

    target = Path(export(base.hf, "mlx", d / "mlx", quantize=True, q_bits=4, q_group_size=32))
    config = json.loads((target / "config.json").read_text())
    config["quantization"].update(quantization)
    (target / "config.json").write_text(json.dumps(config))
    return target


def _fifo(target: Path, where) -> Path:
    """Replace a file with a named pipe: reading it would block forever."""
    p = where(target)
    p.unlink(missing_ok=True)
    os.mkfifo(p)
    return target


def _huge(m: dict) -> None:
    """A passthrough tensor claiming 2**40 elements, its record claiming a file that big: only the file is small."""
    entry = m["tensors"]["token_embedding.weight"]
    entry["shape"] = [2**20, 2**20]
    entry["files"]["pt"]["size"] = 2**42 + 128


def _lie(payload: dict, how) -> dict:
    first = next(iter(payload["files"]))
    payload["files"][first]["size"] = payload["files"][first]["size"] + how if isinstance(how, int) else how
    return payload


def _ollama_tamper(base: Base, d: Path, fix_digest: bool) -> Path:
    def fn(root: Path, m: dict) -> None:
        layer = tensor_layer(m)
        data = bytearray(ollama_blob(root, layer).read_bytes())
        if fix_digest:  # a blob whose digest matches, but whose safetensors header lies about its offsets
            _rewrite_blob(root, layer, st_raw({"x": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}},
                                              F32x16), True)
        else:
            data[-1] ^= 0xFF
            ollama_blob(root, layer).write_bytes(bytes(data))
    return ollama_edit(base, d, fn)


EVIL_PY = "import pathlib\npathlib.Path(__file__).with_name('PWNED').write_text('ran')\nModel = ModelArgs = None\n"


def _model_file(target: Path) -> Path:
    (target / "evil.py").write_text(EVIL_PY)
    return target


def _npy_model_file(base: Base, d: Path) -> Path:
    target = npy_copy(base, d)
    config = json.loads((target / "config.json").read_text())
    config["model_file"] = "evil.py"
    raw = json.dumps(config).encode()
    (target / "config.json").write_bytes(raw)
    _model_file(target)
    # keep the manifest's record of config.json true, so only the model_file is hostile
    manifest_edit(target, lambda m: m["side_files"].update(
        {"config.json": {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}}))
    return target


def _tokenizer_auto_map(base: Base, d: Path) -> Path:
    target = hf_with(base, d)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["evil_tok.EvilTokenizer", None]}
    cfg["tokenizer_class"] = "EvilTokenizer"
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    (target / "evil_tok.py").write_text(EVIL_PY + "class EvilTokenizer: pass\n")
    return target


def fill(template: str, target: Path, d: Path, base: Base) -> str:
    """The text a case's message must contain."""
    values = {"target": str(target), "case": str(d)}
    npy = target if target.is_dir() else target.parent
    if "{part}" in template:
        values["part"] = str(part(npy))
    for suffix in ("s4", "z4"):
        if f"{{part:{suffix}}}" in template:
            template = template.replace(f"{{part:{suffix}}}", str(part(npy, suffix)))
        if f"{{pack:{suffix}}}" in template:
            template = template.replace(f"{{pack:{suffix}}}", str(pack(npy, suffix)))
    if "{config_blob}" in template:
        m = json.loads(target.read_text())
        values["config_blob"] = str(ollama_blob(target.parents[4], next(
            x for x in m["layers"] if x.get("name") == "config.json")))
    if "{blob}" in template:
        m = json.loads(target.read_text())
        values["blob"] = str(ollama_blob(target.parents[4], tensor_layer(m)))
    return template.format(**values)


def build_base(root: Path, tokenizer_dir: Path) -> Base:
    """The valid models the cases start from (a few seconds, once)."""
    from .crash_harness import CRASH_CONFIG, load_in_process
    from .format1 import as_format_1
    from squishlike.exporter import export
    from .tiny_models import make_hf_model

    root.mkdir(parents=True, exist_ok=True)
    hf = make_hf_model(root / "hf", CRASH_CONFIG, tokenizer_dir)
    npydir = _compress(hf, root / "npydir")
    as_format_1(npydir)  # the cases edit a part's own .npy: format 1's layout (the format-2 packs: test_npydir)
    built = shutil.copytree(npydir, root / "built")
    _, digest = load_in_process(built)
    manifest = export(hf, "ollama", root / "ollama", ollama_name="tiny:latest")
    other = _compress(make_hf_model(root / "other-hf", CRASH_CONFIG, tokenizer_dir, seed=7), root / "other")
    load_in_process(other)
    packed = _compress(hf, root / "packed", tiers=None)
    return Base(hf, npydir, built, root / "ollama", Path(manifest), digest, other, packed)


def _compress(hf: Path, out: Path, tiers: tuple[str, ...] | None = ("int4", "mlx", "finalized")) -> Path:
    """The base's store of `hf`, no tier built yet, with the policy `tiers` names (None: compress's default).
    Embeddings exact (the cases edit a passthrough tensor's record) and no calibration: the cases need a store's
    structure, not its accuracy."""
    import squishlike

    policy = {} if tiers is None else {"tiers": tiers}
    return Path(squishlike.compress(hf, out, scheme="int4", group_size=32, quantize_embeddings=False, awq=False,
                                    gptq=False, clip_search=False, **policy))


def write_corpus(base: Base, dest: Path) -> list[Path]:
    """Every case's crafted file, built under dest/<case name>/ (for fuzz seed corpora and for inspection)."""
    out = []
    for case in CASES:
        d = dest / case.name
        d.mkdir(parents=True, exist_ok=True)
        out.append(case.build(base, d))
    return out


__all__ = ["Base", "CASES", "Case", "MARKER", "OUTSIDE", "build_base", "fill", "gguf_raw", "st_raw", "write_corpus"]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
