"""Canonical-name access to a model's weights, whatever format holds them (docs/format.md §10, §12).

    with open_weights("model.gguf") as weights:
        q = weights.get("layers.3.attention.q.weight")   # canonical orientation, permutation undone
        model.load_weights([(weights.mlx_name(n), weights.get(n)) for n in weights.names()])

The reader (squishlike.formats) knows the file layout and spells names its own way; the architecture
(squishlike.arch) knows the model family: its rule table maps the reader's names (the column the reader's `naming`
picks) to canonical ones, and its adapters turn the stored values into canonical values. A family mlx_lm builds
but no table describes is read through its own `sanitize` (formats/sanitized.py) and named as mlx_lm names it.
"""

from __future__ import annotations

import tempfile
from os import PathLike
from pathlib import Path
from typing import Any

import mlx.core as mx

from .arch import Architecture, Need, Rule, architecture_for, mlx_named
from .config import ModelConfig
from .dtypes import FLOAT_DTYPES
from .errors import FormatError, MissingTensorError, UnsupportedArchitectureError
from .formats import FormatReader, QuantizedTensor, TensorInfo, open_reader
from .formats.sanitized import SanitizedReader
from .hub import existing_path, resolve
from .io.atomic import write_json

# Config keys that describe how a source stores its tensors quantized; the provider hands out dense tensors.
QUANTIZATION_KEYS = ("quantization", "quantization_config")


class WeightProvider:
    """One model's tensors under canonical names. Open with `WeightProvider.open(path)` (or `open_weights`)."""

    def __init__(self, reader: FormatReader):
        self.reader = reader
        try:
            self.config = ModelConfig.from_dict(reader.config(), reader.path)
        except UnsupportedArchitectureError as e:  # a GGUF's unknown architecture: say which model names it
            if str(reader.path) in str(e):
                raise
            raise UnsupportedArchitectureError(f"{reader.path}: {e}") from None
        try:
            self.arch: Architecture = architecture_for(self.config.model_type)
        except UnsupportedArchitectureError:
            # No rule table: mlx_lm's own names. An npy-dir of such a model stores them already ("canonical" to
            # its reader); any other source is read through the model's sanitize, which raises a typed error
            # naming the path when mlx_lm has no such model either.
            if reader.naming != "canonical":
                reader = self.reader = SanitizedReader(reader)
            self.arch = mlx_named(self.config.model_type, reader.tensors())
        stored = reader.tensors()
        # A table family's config has its layer count (config.REQUIRED), which sizes its rows: every layer stores
        # at least one tensor. Any other family's layers are the model mlx_lm built for the sanitize view.
        layers = self.config.num_hidden_layers if self.arch.canonical_names == "canonical" else None
        if layers is not None and layers > len(stored):
            raise FormatError(reader.path, f"config says num_hidden_layers={layers}, more layers than the "
                                           f"{len(stored)} tensors it stores")
        rows = self.arch.expanded_rules(layers)
        # The table column the file's names are in: the reader's, or mlx_lm's where an unquantized directory
        # written by mlx_lm holds names that differ from HF's (GPT-2's `model.` prefix).
        found = {naming: sum(getattr(r, naming) in stored for r in rows) for naming in (reader.naming, "mlx")}
        self.naming = max(found, key=found.get)
        # canonical name -> rule row, for the rows whose tensor the file has, in model order
        self._rules: dict[str, Rule] = {r.canonical: r for r in rows if getattr(r, self.naming) in stored}
        self._check_needed()
        self._check_dense_dtypes(stored)
        self._model_shapes: dict[str, tuple[int, ...]] = {}

    @classmethod
    def open(cls, path: str | PathLike, *, ollama_root: str | PathLike | None = None) -> WeightProvider:
        """Open a model file or directory in any format squishlike reads, an Ollama `name:tag`, or a Hugging Face
        repo id (downloaded as mlx_lm.load downloads it, squishlike.hub)."""
        reader = open_reader(locate(path, ollama_root))
        try:
            return cls(reader)
        except BaseException:  # an unsupported or incomplete model: let go of the file before saying so
            reader.close()
            raise

    @property
    def format(self) -> str:
        return self.reader.format_name

    def names(self) -> list[str]:
        """Canonical names present in the source, in model order."""
        return list(self._rules)

    def has(self, name: str) -> bool:
        return name in self._rules

    def source_name(self, name: str) -> str:
        """The name the file gives the canonical tensor `name`."""
        return getattr(self._rule(name), self.naming)

    def mlx_name(self, name: str) -> str:
        """The mlx_lm model parameter `name` binds to (after the model's `sanitize`)."""
        return self._rule(name).mlx

    def expect_shapes(self, model_shapes: dict[str, tuple[int, ...]]) -> None:
        """From now on, refuse (FormatError naming the file) a tensor `get` or `get_quantized` reads whose shape
        cannot be that of the model parameter it binds to; `model_shapes`: mlx_lm parameter name -> shape.

        Loading checks this as it builds the model; compress and export, which never bind the weights to one,
        check it here, before they write what no load would accept. A permutation of the model's shape passes: a
        model's `sanitize` may move the axes of a tensor it keeps under the same name (convolution weights)."""
        self._model_shapes = dict(model_shapes)

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        expected = self._model_shapes.get(self.mlx_name(name))
        if expected is not None and sorted(shape) != sorted(expected):
            raise FormatError(self.reader.path, f"tensor {self.source_name(name)} has shape {tuple(shape)}, which "
                                                f"cannot be the model's {self.mlx_name(name)} of shape "
                                                f"{tuple(expected)} (config.json describes a different model)")

    def get(self, name: str) -> mx.array:
        """The canonical tensor `name`, dequantized if stored quantized, in its canonical orientation and values."""
        array = self.reader.read(self.source_name(name))
        array = self.arch.to_canonical(self.naming, name, array, self.config)
        self._check_shape(name, array.shape)
        return array

    def get_quantized(self, name: str) -> QuantizedTensor | None:
        """The MLX quantized triple when the file stores `name` so and its values need no adapter (an adapter works
        on values, not on packed data: a permuted GGUF Q is dequantized by `get` instead). Else None."""
        if self.arch.adapters_for(self.naming, name):
            return None
        triple = self.reader.read_quantized(self.source_name(name))
        if triple is not None:
            self._check_shape(name, triple.shape)
        return triple

    def quantization(self) -> dict[str, Any]:
        """The source config's entries (QUANTIZATION_KEYS) that describe the triples `mlx_weights` keeps quantized:
        an MLX source's "quantization" (per-layer overrides under mlx_lm module paths) as config.json holds it;
        {} for a source mlx_lm would not load quantized."""
        config = self.config.to_dict()
        if not isinstance(config.get("quantization"), dict):
            return {}
        return {key: config[key] for key in QUANTIZATION_KEYS if key in config}

    def mlx_weights(self) -> dict[str, mx.array]:
        """Every tensor under its mlx_lm parameter name, as mlx_lm.load holds it for the config `quantization()`
        describes: a triple of an MLX source stays quantized, bit for bit; every other tensor is `get`'s."""
        keep_quantized = bool(self.quantization())
        weights: dict[str, mx.array] = {}
        for name in self.names():
            triple = self.get_quantized(name) if keep_quantized else None
            if triple is None:
                weights[self.mlx_name(name)] = self.get(name)
            else:
                weights.update(triple.parameters(self.mlx_name(name).removesuffix(".weight")))
        return weights

    def fuse(self, *names: str) -> mx.array:
        """The canonical tensors `names` stacked by rows (Q+K+V, gate+up)."""
        return mx.concatenate([self.get(name) for name in names], axis=0)

    def fuse_quantized(self, *names: str) -> QuantizedTensor | None:
        """`fuse` on quantized triples, part by part (weights, scales, biases), giving again a valid triple.
        None unless every tensor is available quantized with the same group size, bits and mode."""
        parts = [self.get_quantized(name) for name in names]
        if any(p is None for p in parts) or len({(p.group_size, p.bits, p.mode) for p in parts}) != 1:
            return None
        first = parts[0]
        return QuantizedTensor(
            weight=mx.concatenate([p.weight for p in parts], axis=0),
            scales=mx.concatenate([p.scales for p in parts], axis=0),
            biases=None if first.biases is None else mx.concatenate([p.biases for p in parts], axis=0),
            group_size=first.group_size,
            bits=first.bits,
            mode=first.mode,
        )

    def listing(self) -> list[dict[str, Any]]:
        """A row per canonical tensor, for `squishlike inspect`: `canonical`, `source` (the file's name), `dtype`
        (stored float type or quant type: "bfloat16", "Q4_1", "affine4" ...), `shape` (as the file stores it:
        GPT-2's HF Conv1D weights are [in, out] there) and `nbytes` (on disk)."""
        stored = self.reader.tensors()
        names = self.names()
        infos = [stored[self.source_name(name)] for name in names]
        return [
            {"canonical": name, "source": info.name, "dtype": info.dtype, "shape": info.shape, "nbytes": info.nbytes}
            for name, info in zip(names, infos)
        ]

    def dense_config(self) -> dict:
        """The config.json dict for the tensors `get` returns: dequantized, so without the source's quantization."""
        # A tableless family's config goes to mlx_lm as the source wrote it: its ModelArgs are the only judge.
        config = self.config.to_dict() if self.arch.canonical_names == "canonical" else dict(self.reader.config())
        for key in QUANTIZATION_KEYS:
            config.pop(key, None)
        return config

    def write_side_files(self, dest: str | PathLike) -> list[Path]:
        """Tokenizer files, generation config, chat template as the reader rebuilds them, and a config.json that
        describes the tensors `get` returns (dense_config)."""
        from .config import load_config

        dest = Path(dest)
        written = self.reader.write_side_files(dest)
        write_json(dest / "config.json", self.dense_config())
        try:  # what load refuses (a generation config it cannot use) no compress or export may write: say it here
            load_config(dest)
        except FormatError as e:  # it names the copy in `dest`; the user knows the source
            raise FormatError(self.reader.path, f"{Path(e.path).name}: {e.problem}") from None
        from .tokenizer import custom_code  # transformers: whoever writes side files builds a tokenizer next

        if (code := custom_code(dest)) is not None:
            raise FormatError(self.reader.path, f"tokenizer_config.json names custom tokenizer code ({code}), a "
                                                "class transformers does not ship; squishlike neither copies nor "
                                                "runs code, so nothing it writes could build this tokenizer")
        return sorted(set(written) | {dest / "config.json"})

    def build_model(
        self,
        *,
        tokenizer_config: dict[str, Any] | None = None,
        model_config: dict[str, Any] | None = None,
        lazy: bool = False,
        trust_remote_code: bool = False,
    ) -> tuple[Any, Any, dict[str, Any]]:
        """(mlx_lm model, tokenizer, config) of the model this provider reads, its side files (config, tokenizer)
        written to a temporary directory for mlx_lm to read. An MLX-quantized source stays quantized, as
        mlx_lm.load keeps it."""
        from .config import load_config
        from .model import assemble  # imports mlx_lm

        weights = self.mlx_weights()
        with tempfile.TemporaryDirectory(prefix="squishlike-side-") as side_files:
            self.write_side_files(Path(side_files))
            config = {**load_config(Path(side_files)), **self.quantization()}
            model, tokenizer = assemble(config, weights, Path(side_files), self.reader.path,
                                        tokenizer_config=tokenizer_config, model_config=model_config, lazy=lazy,
                                        trust_remote_code=trust_remote_code,
                                        sanitized=isinstance(self.reader, SanitizedReader))
        return model, tokenizer, config

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> WeightProvider:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _rule(self, name: str) -> Rule:
        rule = self._rules.get(name)
        if rule is None:
            raise MissingTensorError(self.reader.path, name, f"no such tensor in this {self.config.model_type} model")
        return rule

    def _check_dense_dtypes(self, stored: dict[str, TensorInfo]) -> None:
        """Refuse (FormatError naming the file and the tensor) a tensor stored as it is, not as a quantized triple,
        in a dtype that is not a float, when the model's parameter it binds to is a float: a float tensor whose
        header was relabelled as integers (its byte count unchanged), whose bits would reach the model as integer
        values. Which parameters are floats, the model says: its mlx_lm model, built empty (no memory), asked only
        when such a tensor is stored, since some are not (BitNet's packed weights are uint8 parameters). A
        triple's packed words are its reader's to check (formats/mlx.py quantized_shape)."""
        dense = {name: stored[getattr(rule, self.naming)] for name, rule in self._rules.items()}
        suspects = {name: info for name, info in dense.items() if not info.quantized and info.dtype not in FLOAT_DTYPES}
        if not suspects:
            return
        from mlx.utils import tree_flatten

        from .model import new_model  # imports mlx_lm

        model = new_model(self.dense_config(), self.reader.path)
        expected = {name: array.dtype for name, array in tree_flatten(model.parameters())}
        for name, info in suspects.items():
            dtype = expected.get(self.mlx_name(name))
            if dtype is not None and mx.issubdtype(dtype, mx.floating):
                raise FormatError(self.reader.file_of(info.name), f"tensor {info.name} is stored as {info.dtype}, "
                                  f"but it is the model's {self.mlx_name(name)}, a floating-point parameter: a "
                                  "float's bytes relabelled as integers, or a malformed file")

    def _check_needed(self) -> None:
        # Every row the family always has, and the output projection unless tied to the embedding.
        needed = {Need.ALWAYS} | ({Need.WHEN_UNTIED} if not self.config.tie_word_embeddings else set())
        for r in self.arch.expanded_rules(self.config.num_hidden_layers):
            if r.need in needed and r.canonical not in self._rules:
                source = getattr(r, self.naming)
                problem = f"tensor is missing (the file would call it {source})"
                raise MissingTensorError(self.reader.path, r.canonical, problem)


def locate(path: str | PathLike, ollama_root: str | PathLike | None = None) -> Path:
    """`path` when it exists, else the manifest of the Ollama model it names (`name:tag` in the store at
    `ollama_root`, default Ollama's own; or `STORE/name:tag`), else the snapshot of the Hugging Face repo it names
    (squishlike.hub). What is none of these stays a path, and open_reader names the path it could not find."""
    from .formats.ollama import OllamaReader  # imported on use, as the format registry imports readers

    if (existing := existing_path(path)) is not None:
        return existing
    root = Path(ollama_root) if ollama_root is not None else None
    return OllamaReader.resolve(str(path), root) or Path(resolve(str(path)))


open_weights = WeightProvider.open
