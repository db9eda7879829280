"""GGUF (llama.cpp's single-file format, v2 and v3), read with gguf-py, llama.cpp's own Python package.

A GGUF file is: magic `GGUF`, version, tensor count, metadata key/value count, the metadata (hyperparameters under
`{arch}.*`, the tokenizer under `tokenizer.ggml.*` and `tokenizer.chat_template`), one info record per tensor
(name, dims fastest-moving first, ggml type, offset), then the aligned tensor data. gguf-py memory-maps the file,
so reading a tensor touches only its bytes.

Names are llama.cpp's (`blk.3.attn_q.weight`): the "gguf" column of the architecture's rule table. Values are as
llama.cpp's converter wrote them (Llama Q/K permuted, Gemma norms +1); the provider's adapters undo that.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Collection, Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer, pre_tokenizers, processors

from ..arch import architecture_for_gguf
from ..config import ModelConfig
from ..errors import FormatError, MissingTensorError, SquishError
from ..io.atomic import atomic_path, write_bytes
from ..io.files import open_regular
from .base import FormatReader, TensorInfo

MAGIC = b"GGUF"
FLOAT_TYPES = {
    gguf.GGMLQuantizationType.F32: "float32",
    gguf.GGMLQuantizationType.F16: "float16",
    gguf.GGMLQuantizationType.BF16: "bfloat16",
}
# GGML's plain integer types, listed as stored (not quantized): the provider refuses one where the model's
# parameter is a float
INTEGER_TYPES = {
    gguf.GGMLQuantizationType.I8: "int8",
    gguf.GGMLQuantizationType.I16: "int16",
    gguf.GGMLQuantizationType.I32: "int32",
    gguf.GGMLQuantizationType.I64: "int64",
}

# GGUF metadata key (after `{arch}.`) for each required config field; vocab_size falls back to the tokenizer's size.
REQUIRED_CONFIG = {
    "hidden_size": "embedding_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "intermediate_size": "feed_forward_length",
}

# A GGUF's float type, when the whole file has one; a quantized file dequantizes to a runtime we pick: bfloat16
# has float32's range, so no family overflows in it.
FILE_DTYPES = {
    gguf.LlamaFileType.ALL_F32: "float32",
    gguf.LlamaFileType.MOSTLY_F16: "float16",
    gguf.LlamaFileType.MOSTLY_BF16: "bfloat16",
}

# tokenizer_config.json key -> the GGUF key (after `tokenizer.ggml.`) holding its id
SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
GENERATION_IDS = ("bos_token_id", "eos_token_id")  # generation_config.json keys, spelled as in GGUF

# `tokenizer.ggml.pre` values whose split transformers does not know (it would fall back to GPT-2's).
PRE_TOKENIZERS = {
    # llama.cpp's "smollm": every digit alone, then GPT-2's split, as SmolLM's own tokenizer.json does
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
}


_SCALAR_SIZES = {
    gguf.GGUFValueType.UINT8: 1, gguf.GGUFValueType.INT8: 1, gguf.GGUFValueType.BOOL: 1,
    gguf.GGUFValueType.UINT16: 2, gguf.GGUFValueType.INT16: 2,
    gguf.GGUFValueType.UINT32: 4, gguf.GGUFValueType.INT32: 4, gguf.GGUFValueType.FLOAT32: 4,
    gguf.GGUFValueType.UINT64: 8, gguf.GGUFValueType.INT64: 8, gguf.GGUFValueType.FLOAT64: 8,
}


_U64 = struct.Struct("<Q")
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays: llama.cpp writes none deeper than 2


class _Extents:
    """Walks a little-endian GGUF's header, metadata and tensor records, checking every length against the file.

    gguf-py slices its memory map, and a slice past the end is silently short: a truncated file or a tensor offset
    beyond the end would give short arrays, and an absurd array length would loop for billions of items. So the
    file is walked here first, and EOFError says where it ends too soon; gguf-py then reads a file whose every
    record fits. Unknown value types are left for gguf-py to name.
    """

    def __init__(self, data: bytes | mmap.mmap):
        self.data, self.pos = data, 0

    def check(self) -> None:
        self.skip(8)  # magic and version
        tensor_count, kv_count = self.take("QQ")
        for _ in range(kv_count):
            self.string()
            if not self.value(*self.take("I")):
                return
        for _ in range(tensor_count):
            name = self.string()
            (n_dims,) = self.take("I")
            if n_dims > MAX_DIMS:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions; GGML tensors have at most {MAX_DIMS}")
            self.skip(8 * n_dims + 4)  # dims, type
            (offset,) = self.take("Q")
            if offset > len(self.data) - self.pos:  # the data section starts further on still
                raise EOFError(f"tensor {name!r} starts at byte {offset} of the data, past the end of the file")

    def value(self, value_type: int, depth: int = 0) -> bool:
        """Step over one value; False for a type gguf-py will refuse."""
        if value_type == gguf.GGUFValueType.STRING:
            self.string()
        elif value_type in _SCALAR_SIZES:
            self.skip(_SCALAR_SIZES[value_type])
        elif value_type == gguf.GGUFValueType.ARRAY:
            item_type, length = self.take("IQ")
            if length > len(self.data) - self.pos:  # every item takes at least one byte
                raise EOFError(f"an array at byte {self.pos} claims {length} items, more than the file holds")
            if item_type in _SCALAR_SIZES:
                self.skip(length * _SCALAR_SIZES[item_type])
            elif item_type == gguf.GGUFValueType.STRING:
                self.strings(length)
            elif depth >= MAX_NESTING:
                raise ValueError(f"arrays nested more than {MAX_NESTING} deep at byte {self.pos}")
            else:
                return all(self.value(item_type, depth + 1) for _ in range(length))
        else:
            return False
        return True

    def string(self) -> str:
        (length,) = self.take("Q")
        start = self.pos
        self.skip(length)
        return bytes(self.data[start:self.pos]).decode("utf-8", errors="replace")

    def strings(self, count: int) -> None:
        """Step over `count` strings: a vocabulary's 100k+ tokens, so one tight loop."""
        data, end, pos, length_at = self.data, len(self.data), self.pos, _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise EOFError(f"a string at byte {pos} runs past the end of the file")
            pos += 8 + length_at(data, pos)[0]
        self.skip(pos - self.pos)  # the last string must end in the file too

    def take(self, fmt: str) -> tuple[int, ...]:
        start = self.pos
        self.skip(struct.calcsize("<" + fmt))
        return struct.unpack_from("<" + fmt, self.data, start)

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.data):
            raise EOFError(f"a read of {n} bytes at byte {self.pos} runs past the end of the file")
        self.pos += n


class _PlainGGUFReader(gguf.GGUFReader):
    """gguf-py's reader over a plain NumPy view of the mapped file, not its np.memmap: gguf-py slices the map for
    every metadata value (SmolLM2's vocabulary and merges: 250,000 slices) and its dequantizers for every 16 rows,
    and each slice of a memmap runs a Python __array_finalize__. Opening SmolLM2 took 2.1 s, 0.7 s so; reading its
    quantized tensors 2.5 s, 1.6 s. The same bytes, still mapped (the view holds the map)."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.ndarray) -> None:  # gguf-py's __init__ sets its np.memmap here
        self._plain = np.asarray(mapped)


def _check_tensor_data(reader: gguf.GGUFReader, size: int) -> None:
    """Every tensor's data aligned, inside the file, and overlapping no other tensor's (ValueError otherwise)."""
    end_of_previous, previous = 0, None
    for t in sorted(reader.tensors, key=lambda t: t.data_offset):
        if t.data_offset % reader.alignment:
            raise ValueError(f"tensor {t.name!r} starts at byte {t.data_offset}, not aligned to {reader.alignment}")
        if t.data_offset < end_of_previous:
            raise ValueError(f"tensor {t.name!r} overlaps the data of {previous!r}")
        end_of_previous, previous = t.data_offset + int(t.n_bytes), t.name
        if end_of_previous > size or t.data.nbytes != int(t.n_bytes):
            raise ValueError(f"tensor {t.name!r} runs past the end of the file")


class GGUFReader(FormatReader):
    """One .gguf file. `metadata` holds every key/value as GGUF spells it (`llama.block_count`, ...)."""

    format_name = "gguf"
    naming = "gguf"

    def __init__(self, path: Path):
        super().__init__(path)
        with open_regular(self.path) as f:
            magic, version = f.read(len(MAGIC)), f.read(4)
            size = os.fstat(f.fileno()).st_size
        if magic != MAGIC:
            raise FormatError(self.path, f"bad magic {magic!r}, a GGUF file starts with {MAGIC!r}")
        if len(version) == 4 and int.from_bytes(version, "little") & 0xFFFF == 0:  # a version written big-endian
            raise FormatError(self.path, "big-endian GGUF files are not supported")
        try:
            with open_regular(self.path) as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _Extents(data).check()
            self._gguf = _PlainGGUFReader(self.path)
            _check_tensor_data(self._gguf, size)
        except (ValueError, KeyError, IndexError, EOFError, UnicodeDecodeError, OverflowError) as e:
            # gguf-py raises these for a bad version, unknown value or tensor type, duplicate or truncated records
            raise FormatError(self.path, f"unreadable GGUF: {e}") from e
        self._tensors = {t.name: t for t in self._gguf.tensors}
        try:
            self.metadata: dict[str, Any] = {
                key: _value(field) for key, field in self._gguf.fields.items() if not key.startswith("GGUF.")
            }
        except (ValueError, IndexError, OverflowError) as e:  # UnicodeDecodeError is a ValueError
            raise FormatError(self.path, f"unreadable GGUF metadata: {e}") from e

    @classmethod
    def detect(cls, path: Path) -> bool:
        path = Path(path)
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC

    @property
    def version(self) -> int:
        return int(self._gguf.fields["GGUF.version"].contents())

    def config(self) -> dict:
        return config_from_metadata(self.metadata, self._tensors, self.path).to_dict()

    def tensors(self) -> dict[str, TensorInfo]:
        return {
            t.name: TensorInfo(
                name=t.name,
                shape=tuple(reversed([int(d) for d in t.shape])),
                dtype={**FLOAT_TYPES, **INTEGER_TYPES}.get(t.tensor_type, t.tensor_type.name),
                nbytes=int(t.n_bytes),
                quantized=t.tensor_type not in FLOAT_TYPES and t.tensor_type not in INTEGER_TYPES,
            )
            for t in self._gguf.tensors
        }

    def read(self, name: str) -> mx.array:
        """F32, F16 and BF16 as stored; every type gguf-py dequantizes (Q4_0 ... Q8_0, Q2_K ... Q6_K, IQ*) as
        float32."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise MissingTensorError(self.path, name)
        try:
            return self._read_tensor(name, tensor)
        except FormatError:
            raise
        except (OverflowError, ValueError, TypeError, IndexError) as e:  # dims MLX cannot hold, a short block ...
            raise FormatError(self.path, f"{name}: unreadable tensor ({type(e).__name__}: {e})") from None

    def _read_tensor(self, name: str, tensor) -> mx.array:
        if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return mx.array(tensor.data)
        if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:
            # gguf-py hands BF16 over as raw bytes; numpy has no bfloat16, MLX does.
            shape = tuple(reversed([int(d) for d in tensor.shape]))
            return mx.array(tensor.data.view(np.uint16).reshape(shape)).view(mx.bfloat16)
        try:
            return mx.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        except NotImplementedError as e:
            raise FormatError(self.path, f"{name}: tensor type {tensor.tensor_type.name} is not supported") from e

    def write_side_files(self, dest: Path) -> list[Path]:
        """config.json and, when the metadata holds a tokenizer, tokenizer.json, tokenizer_config.json (with the
        chat template), special_tokens_map.json and generation_config.json."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        files = {"config.json": self.config()}
        written = []
        if "tokenizer.ggml.tokens" in self.metadata:
            tokenizer, tokenizer_config = self._tokenizer()
            with atomic_path(dest / "tokenizer.json") as tmp:
                tokenizer.save(str(tmp))
            written.append(dest / "tokenizer.json")
            files["tokenizer_config.json"] = tokenizer_config
            files["special_tokens_map.json"] = {k: v for k, v in tokenizer_config.items() if k in SPECIAL_TOKENS}
            ids = {key: self.metadata.get(f"tokenizer.ggml.{key}") for key in GENERATION_IDS}
            files["generation_config.json"] = {key: value for key, value in ids.items() if value is not None}
        for file, content in files.items():
            write_bytes(dest / file, (json.dumps(content, indent=2, ensure_ascii=False) + "\n").encode())
            written.append(dest / file)
        return written

    def _tokenizer(self) -> tuple[Tokenizer, dict[str, Any]]:
        """The metadata's tokenizer as a `tokenizers.Tokenizer`, and its tokenizer_config.json dict.

        transformers knows how to turn llama.cpp's vocabulary into a fast tokenizer; its own `get_gguf_tokenizer`
        imports torch, so we gather the metadata it wants ourselves, with its key renames.
        """
        # imported here: transformers takes most of a second to import
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        def renamed(group: str) -> dict:
            keys = {name: f"tokenizer.{key}" for key, name in GGUF_TOKENIZER_MAPPING[group].items()}
            return {name: self.metadata[key] for name, key in keys.items() if key in self.metadata}

        tokenizer_dict = renamed("tokenizer")
        try:
            tokenizer, _ = convert_gguf_tokenizer(self.metadata.get("general.architecture"), tokenizer_dict)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a vocabulary it rejects
            raise FormatError(self.path, f"cannot rebuild the tokenizer: {e}") from e
        pre_tokenizer = PRE_TOKENIZERS.get(tokenizer_dict.get("pre_tokenizer_type"))
        if pre_tokenizer is not None:
            tokenizer.pre_tokenizer = pre_tokenizer()

        config = renamed("tokenizer_config")
        if tokenizer_dict.get("tokenizer_type") == "llama":
            # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
            config.setdefault("add_bos_token", True)
        tokens = tokenizer_dict["tokens"]
        for token, id_key in SPECIAL_TOKENS.items():
            token_id = self.metadata.get(f"tokenizer.ggml.{id_key}")
            if token_id is not None and token_id < len(tokens):
                config[token] = tokens[token_id]
        if config.get("add_bos_token") and "bos_token" in config:
            # Put into the tokenizer itself, so every loader adds it, not only those that read add_bos_token.
            bos = config["bos_token"]
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, self.metadata["tokenizer.ggml.bos_token_id"])],
            )
        config["tokenizer_class"] = "PreTrainedTokenizerFast"  # tokenizer.json as written, no class-specific fixups
        return tokenizer, config


def _value(field: gguf.ReaderField) -> Any:
    value = field.contents()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        # the shortest decimal that is this float32: 1e-05 in config.json, not 9.999999747378752e-06
        return float(str(np.float32(value)))
    return value


def config_from_metadata(
    metadata: Mapping[str, Any], tensor_names: Collection[str], path: str | PathLike = "model.gguf"
) -> ModelConfig:
    """The model config GGUF metadata (key -> value) describes; tied when `output.weight` is not in `tensor_names`.

    Keys are read as `{arch}.{key}` first, then as `{key}`. FormatError (naming `path`) lists missing keys.
    """
    try:
        return _config_from_metadata(metadata, tensor_names, path)
    except SquishError:
        raise
    except (TypeError, ValueError, ZeroDivisionError, AttributeError, KeyError, OverflowError) as e:
        # hostile metadata: a count of zero, a string where a number belongs, ...
        raise FormatError(path, f"GGUF metadata does not describe a model: {type(e).__name__}: {e}") from None


def _config_from_metadata(metadata: Mapping[str, Any], tensor_names: Collection[str], path) -> ModelConfig:
    gguf_arch = metadata.get("general.architecture")
    if gguf_arch is None:
        raise FormatError(path, "GGUF metadata has no general.architecture")
    if not isinstance(gguf_arch, str):
        raise FormatError(path, f"GGUF general.architecture is {gguf_arch!r}, not a name")
    family = architecture_for_gguf(gguf_arch)

    def get(key: str) -> Any:
        return metadata.get(f"{gguf_arch}.{key}", metadata.get(key))

    missing = [f"{gguf_arch}.{key}" for key in REQUIRED_CONFIG.values() if get(key) is None]
    vocab_size = get("vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    if not vocab_size:
        missing.append(f"{gguf_arch}.vocab_size (or tokenizer.ggml.tokens)")
    if missing:
        raise FormatError(path, f"GGUF metadata is missing required keys: {', '.join(missing)}")

    config = {name: get(key) for name, key in REQUIRED_CONFIG.items()}
    config.update(
        model_type=family.model_type,
        vocab_size=vocab_size,
        num_key_value_heads=get("attention.head_count_kv"),
        head_dim=get("attention.key_length") or config["hidden_size"] // config["num_attention_heads"],
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        layer_norm_eps=get("attention.layer_norm_epsilon"),
        rope_theta=get("rope.freq_base"),
        max_position_embeddings=get("context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
        torch_dtype=FILE_DTYPES.get(metadata.get("general.file_type"), "bfloat16"),
    )
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor")}
        if original := get("rope.scaling.original_context_length"):
            config["rope_scaling"]["original_max_position_embeddings"] = original
    if family.gguf_config is not None:
        config.update(family.gguf_config(get, config))
    return ModelConfig.from_dict({k: v for k, v in config.items() if v is not None}, path)
