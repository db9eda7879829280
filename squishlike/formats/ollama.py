"""Ollama's safetensors model store (docs/format.md §12): the layout Ollama's MLX engine reads.

    $OLLAMA_MODELS/manifests/<host>/<namespace>/<model>/<tag>   the manifest (JSON, schemaVersion 2)
    $OLLAMA_MODELS/blobs/sha256-<hex>                           content-addressed blobs, sha256 of their bytes

Every `application/vnd.ollama.image.tensor` layer is a safetensors blob holding one tensor under its HF name, a
quantized tensor in MLX layout (`{name}` uint32, `{name}.scale`, `{name}.bias` for affine) with `quant_type` and
`group_size` in `__metadata__` (or per tensor as `{name}.quant_type` / `{name}.group_size`), or a group of tensors
(the experts of one layer share one blob). config.json and the tokenizer files are `application/vnd.ollama.image.json`
layers named by their file name. A blob is checked against its digest the first time it is read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import mlx.core as mx

from ..errors import FormatError, IntegrityError, MissingTensorError
from ..io.atomic import copy_file
from ..io.files import read_json, regular_file
from ..io.checksum import file_checksum  # sha256, the digest Ollama names blobs by
from .base import FormatReader, QuantizedTensor, TensorInfo
from .mlx import QuantParams, quantized_shape
from ..config import CONFIG
from .safetensors import SafetensorsFile

TENSOR_MEDIA_TYPE = "application/vnd.ollama.image.tensor"
JSON_MEDIA_TYPE = "application/vnd.ollama.image.json"
MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"

# Ollama's quant_type names and the MLX layout each stands for (its default group size when none is recorded).
QUANT_TYPES = {
    "int4": QuantParams(64, 4, "affine"),
    "int8": QuantParams(64, 8, "affine"),
    "nvfp4": QuantParams(16, 4, "nvfp4"),
    "mxfp4": QuantParams(32, 4, "mxfp4"),
    "mxfp8": QuantParams(32, 8, "mxfp8"),
}

_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
# Components of a model reference. Never "." or "..", so a reference cannot point outside the store.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*(:[0-9]+)?")


def store_root(root: Path | str | None = None) -> Path:
    """`root`, else $OLLAMA_MODELS, else ~/.ollama/models."""
    return Path(root or os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def blob_path(root: Path, digest: str) -> Path:
    """blobs/sha256-<hex> for "sha256:<hex>"."""
    return Path(root) / "blobs" / digest.replace(":", "-", 1)


def manifest_path(root: Path, ref: str) -> Path | None:
    """manifests/<host>/<namespace>/<model>/<tag> for "model[:tag]", "namespace/model[:tag]" or
    "host/namespace/model[:tag]"; None when `ref` is not a model reference."""
    name, tag = ref, DEFAULT_TAG
    if ":" in ref.rsplit("/", 1)[-1]:  # a colon before the last "/" is a host's port, not a tag
        name, tag = ref.rsplit(":", 1)
    parts = name.split("/")
    if not 1 <= len(parts) <= 3:
        return None
    host, namespace, model = [DEFAULT_HOST, DEFAULT_NAMESPACE][: 3 - len(parts)] + parts
    if not _HOST.fullmatch(host) or not all(_NAME.fullmatch(p) for p in (namespace, model, tag)):
        return None
    return Path(root) / "manifests" / host / namespace / model / tag


def is_store(path: Path) -> bool:
    """An Ollama store root: manifests/ and blobs/ side by side."""
    return (path / "manifests").is_dir() and (path / "blobs").is_dir()


def store_models(root: Path) -> dict[str, Path]:
    """Every model in the store at `root`: its reference ("model:tag", "namespace/model:tag" outside the library
    namespace, "host/namespace/model:tag" on another host) -> its manifest file."""
    models = {}
    for manifest in sorted((root / "manifests").glob("*/*/*/*")):
        host, namespace, model, tag = manifest.relative_to(root / "manifests").parts
        name = [host, namespace, model]
        if host == DEFAULT_HOST:  # the short forms manifest_path() reads back
            name = name[2:] if namespace == DEFAULT_NAMESPACE else name[1:]
        if manifest.is_file():
            models[f"{'/'.join(name)}:{tag}"] = manifest
    return models


class OllamaReader(FormatReader):
    """One model of an Ollama store, opened by its manifest file or by the store root when it holds one model
    (resolve() turns "model:tag", or "STORE/model:tag", into the manifest's path)."""

    format_name = "ollama"
    naming = "hf"
    verifies = "checked the sha256 digest of every blob the manifest names"

    def __init__(self, path: Path):
        super().__init__(path)
        if is_store(self.path):
            self.path = self._only_model(self.path)
        manifest = read_json(self.path)
        layers = manifest.get("layers") if isinstance(manifest, dict) else None
        if not isinstance(layers, list) or manifest.get("schemaVersion") != 2:
            raise FormatError(self.path, "not an Ollama manifest (schemaVersion 2 with a list of layers)")
        if len(self.path.parents) < 5 or self.path.parents[3].name != "manifests":
            raise FormatError(self.path, "not at manifests/<host>/<namespace>/<model>/<tag> inside an Ollama store")
        self.root = self.path.parents[4]

        self._digests: dict[Path, str] = {}  # blob -> expected sha256 hex
        self._verified: set[Path] = set()
        self._json_layers: dict[str, Path] = {}  # file name -> blob
        self._files: list[SafetensorsFile] = []
        # tensor name -> (its blob, quantization or None, logical shape, bytes on disk)
        self._tensors: dict[str, tuple[SafetensorsFile, QuantParams | None, tuple[int, ...], int]] = {}
        for layer in layers:
            blob = self._blob(layer)
            if layer.get("mediaType") == JSON_MEDIA_TYPE:
                name = layer.get("name")
                if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
                    raise FormatError(self.path, f"JSON layer name {name!r} is not a plain file name")
                self._json_layers[name] = blob
            elif layer.get("mediaType") == TENSOR_MEDIA_TYPE:
                self._add_tensor_blob(self._open_tensor_blob(blob))

    @staticmethod
    def _only_model(root: Path) -> Path:
        models = store_models(root)
        if len(models) != 1:
            found = f"{len(models)} models ({', '.join(models)})" if models else "no model"
            raise FormatError(root, f"this Ollama store holds {found}; name one as {root}/MODEL:TAG")
        return next(iter(models.values()))

    def _blob(self, layer: dict) -> Path:
        """The blob a layer names, checked to exist with the size the manifest records."""
        digest = layer.get("digest") if isinstance(layer, dict) else None
        match = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
        if match is None:
            raise FormatError(self.path, f"layer {layer!r} has no sha256:<64 hex> digest")
        blob = blob_path(self.root, digest)
        if not blob.is_file():
            raise FormatError(self.path, f"layer {layer.get('name')!r} names blob {blob}, which does not exist")
        regular_file(blob, self.root)
        size = layer.get("size", blob.stat().st_size)
        if not isinstance(size, int) or isinstance(size, bool):
            raise FormatError(self.path, f"layer {layer.get('name')!r} has size {size!r}, not a byte count")
        if blob.stat().st_size != size:
            raise IntegrityError(blob, f"is {blob.stat().st_size} bytes, the manifest says {layer['size']} "
                                       f"for digest {digest}")
        self._digests[blob] = match.group(1)
        return blob

    def _open_tensor_blob(self, blob: Path) -> SafetensorsFile:
        try:
            return SafetensorsFile(blob)
        except FormatError:
            self._verify(blob)  # a damaged blob is reported as such: IntegrityError naming blob and digest
            raise

    def _add_tensor_blob(self, f: SafetensorsFile) -> None:
        self._files.append(f)
        quantized = [n for n in f.entries if f"{n}.scale" in f.entries]
        parts = {f"{n}.{suffix}" for n in quantized for suffix in ("scale", "bias")}
        for name in f.entries.keys() - parts:
            if name in self._tensors:
                raise FormatError(f.path, f"tensor {name} is also in blob {self._tensors[name][0].path.name}")
            if name in quantized:
                params = self._quant_params(f, name)
                bias = f.entries.get(f"{name}.bias")
                shape = quantized_shape(f.path, name, params, f.entries[name], f.entries[f"{name}.scale"], bias)
                nbytes = sum(f.info(n).nbytes for n in (name, f"{name}.scale", f"{name}.bias") if n in f.entries)
            else:
                params, shape, nbytes = None, f.entries[name][0], f.info(name).nbytes
            self._tensors[name] = (f, params, shape, nbytes)

    @staticmethod
    def _quant_params(f: SafetensorsFile, name: str) -> QuantParams:
        quant_type = f.metadata.get(f"{name}.quant_type", f.metadata.get("quant_type"))
        group_size = f.metadata.get(f"{name}.group_size", f.metadata.get("group_size"))
        if quant_type not in QUANT_TYPES:
            raise FormatError(f.path, f"tensor {name} has quant_type {quant_type!r}; known: {', '.join(QUANT_TYPES)}")
        params = QUANT_TYPES[quant_type]
        if group_size is None:
            return params
        if not str(group_size).isdigit():
            raise FormatError(f.path, f"tensor {name} has group_size {group_size!r}, not a number")
        return QuantParams(int(group_size), params.bits, params.mode)

    @classmethod
    def resolve(cls, ref: str, root: Path | None = None) -> Path | None:
        """The manifest file for "model:tag", "namespace/model:tag" or "host/namespace/model:tag" in the store at
        `root` (default $OLLAMA_MODELS, then ~/.ollama/models), or for "STORE/model:tag" in the store STORE;
        None when there is no such model."""
        if root is None and is_store(Path(ref).parent):
            root, ref = Path(ref).parent, Path(ref).name
        path = manifest_path(store_root(root), ref)
        return path if path is not None and path.is_file() else None

    @classmethod
    def detect(cls, path: Path) -> bool:
        """A manifest file with at least one tensor layer (GGUF-based Ollama models use other media types), or
        a store root."""
        path = Path(path)
        if path.is_dir():
            return is_store(path)
        if not path.is_file() or path.stat().st_size > 16 << 20:
            return False
        try:
            manifest = read_json(path)
        except FormatError:
            return False
        layers = manifest.get("layers") if isinstance(manifest, dict) else None
        return (
            isinstance(layers, list)
            and manifest.get("schemaVersion") == 2
            and any(isinstance(layer, dict) and layer.get("mediaType") == TENSOR_MEDIA_TYPE for layer in layers)
        )

    def verify(self) -> list[str]:
        problems = []
        for blob in self._digests:
            try:
                self._verify(blob)
            except IntegrityError as e:
                problems.append(str(e))
        return problems

    def _verify(self, blob: Path) -> None:
        """Check a blob against its digest, once per reader."""
        if blob in self._verified:
            return
        actual = file_checksum(blob, self.root)
        if actual != self._digests[blob]:
            raise IntegrityError(blob, f"sha256 is {actual}, the manifest's digest is sha256:{self._digests[blob]}")
        self._verified.add(blob)

    def config(self) -> dict:
        if CONFIG not in self._json_layers:
            raise FormatError(self.path, f"has no {CONFIG} layer")
        self._verify(self._json_layers[CONFIG])
        config = read_json(self._json_layers[CONFIG], self.root)
        if not isinstance(config, dict):
            raise FormatError(self._json_layers[CONFIG], f"the {CONFIG} layer is not a JSON object")
        return config

    def tensors(self) -> dict[str, TensorInfo]:
        return {
            name: TensorInfo(name, shape, params.dtype if params else f.info(name).dtype, nbytes, params is not None)
            for name, (f, params, shape, nbytes) in self._tensors.items()
        }

    def _entry(self, name: str) -> tuple[SafetensorsFile, QuantParams | None]:
        if name not in self._tensors:
            raise MissingTensorError(self.path, name)
        f, params, _, _ = self._tensors[name]
        self._verify(f.path)
        return f, params

    def read_quantized(self, name: str) -> QuantizedTensor | None:
        f, params = self._entry(name)
        if params is None:
            return None
        return QuantizedTensor(
            weight=f.read(name),
            scales=f.read(f"{name}.scale"),
            biases=f.read(f"{name}.bias") if params.mode == "affine" else None,
            group_size=params.group_size,
            bits=params.bits,
            mode=params.mode,
        )

    def file_of(self, name: str) -> Path:
        return self._tensors[name][0].path if name in self._tensors else self.path

    def read(self, name: str) -> mx.array:
        f, params = self._entry(name)
        return f.read(name) if params is None else self.read_quantized(name).dequantize()

    def write_side_files(self, dest: Path) -> list[Path]:
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        for name, blob in self._json_layers.items():
            self._verify(blob)
            copy_file(blob, dest / name)
        return [dest / name for name in self._json_layers]

    def close(self) -> None:
        for f in self._files:
            f.close()
