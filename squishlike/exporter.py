"""Write any model squishlike reads as an HF directory, an MLX directory or a model in an Ollama store.

Flags follow `mlx_lm.convert`: -q quantizes, --q-bits / --q-group-size default per --q-mode as mlx_lm's do
(affine 4 bits group 64, mxfp4 4/32, mxfp8 8/32, nvfp4 4/16). The source is read through the WeightProvider, so
every format exports alike; a quantized source is written dequantized unless -q asks for quantization.

- hf: model.safetensors (sharded past 5 GiB) under HF names and orientation, config.json, tokenizer files.
- mlx: what `mlx_lm.convert` writes: the mlx_lm model is built, quantized by mlx_lm's own `quantize_model`
  (so its per-layer choices and the "quantization" config are mlx_lm's), and its parameters saved. A layer the
  source already stores quantized that way (an INT4 store at -q's 4 bits) keeps the source's own values; with -q
  and no --q-bits every affine triple keeps its own width (a mixed store: per-layer "quantization" entries).
- ollama: content-addressed safetensors blobs (quantized ones in MLX layout with quant_type / group_size metadata,
  the experts of one layer in one blob), the config and tokenizer files as JSON layers, and the manifest last.

Directories are written to a temporary sibling and renamed into place; Ollama blobs are renamed to their digest
once complete and the manifest is written last, so a failed export leaves nothing that looks complete.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from tqdm import tqdm

from .config import CONFIG
from .dtypes import MX_DTYPES
from .errors import OutputExistsError, QuantizationError
from .formats import EXPORT_TARGETS
from .formats.mlx import MODE_DEFAULTS, QuantParams
from .formats.ollama import (
    CONFIG_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    MANIFEST_MEDIA_TYPE,
    QUANT_TYPES,
    TENSOR_MEDIA_TYPE,
    blob_path,
    manifest_path,
)
from .formats.safetensors import INDEX, SINGLE_FILE, tensor_of, write_safetensors, write_tensors
from .io.atomic import atomic_path, make_temp_dir, publish_dir, publish_file, stream_file, temp_name, write_json
from .io.checksum import CHECKSUM
from .io.stream import StreamWriter
from .model import build_model, new_model, parameter_shapes
from .provider import WeightProvider

Target = Literal["hf", "mlx", "ollama"]
MAX_SHARD_BYTES = 5 << 30  # mlx_lm's and transformers' default shard size


def export(
    src: str | Path,
    to: Target,
    dest: str | Path,
    *,
    quantize: bool = False,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    q_mode: str = "affine",
    force: bool = False,
    ollama_name: str | None = None,
    dtype: str | None = None,
) -> Path:
    """Export `src` (any format squishlike reads) to `dest`; returns the directory (hf, mlx) or manifest (ollama).

    For "ollama", `dest` is the store root and the model is named `ollama_name` ("name[:tag]", default: the
    source's file or directory name). An existing non-empty `dest` (or, for Ollama, an existing manifest of that
    name) raises OutputExistsError unless `force`. `dtype` ("float32", "float16", "bfloat16") casts the float
    weights and the config's torch_dtype; None keeps the dtype the source's tensors read as (float32 for a
    dequantized GGUF).
    """
    if to not in EXPORT_TARGETS:
        raise ValueError(f"cannot export to {to!r}; choose one of {', '.join(EXPORT_TARGETS)}")
    if q_mode not in MODE_DEFAULTS:
        raise QuantizationError(f"unknown quantization mode {q_mode!r}; choose one of {', '.join(MODE_DEFAULTS)}")
    if quantize and to == "hf":
        raise QuantizationError("an HF directory holds unquantized weights; quantize=True applies to to=mlx and "
                                "to=ollama")
    if dtype is not None and dtype not in MX_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not a float dtype; choose one of {', '.join(MX_DTYPES)}")
    params = QuantParams.from_dict({"mode": q_mode, "bits": q_bits, "group_size": q_group_size}) if quantize else None

    dest = Path(dest)
    if to != "ollama" and dest.exists() and not force and (not dest.is_dir() or any(dest.iterdir())):
        raise OutputExistsError(f"{dest}: exists and is not empty; pass force=True to replace it")

    with WeightProvider.open(src) as provider:
        # The architecture's mlx_lm model, built empty (no memory), as compress and load build it: a config that
        # names custom model code, or a model_type mlx_lm has no model for, is refused before anything is written.
        # Each tensor is checked against the parameter it binds to as it is read: nothing a load would refuse.
        provider.expect_shapes(parameter_shapes(new_model(provider.dense_config(), provider.reader.path)))
        if to == "ollama":
            name = ollama_name or default_ollama_name(Path(src))
            return export_ollama(provider, dest, name, params, force=force, dtype=dtype)
        tmp = make_temp_dir(dest)
        try:
            if to == "hf":
                write_hf(provider, tmp, dtype)
            else:
                write_mlx(provider, tmp, params, dtype, own_widths=q_bits is None)
            publish_dir(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest


def names_as(provider: WeightProvider, naming: str) -> dict[str, str]:
    """The `naming` column's name -> canonical name, for every tensor, in model order."""
    return {provider.arch.name(naming, canonical): canonical for canonical in provider.names()}


def read_as(provider: WeightProvider, naming: str, canonical: str, dtype: str | None = None) -> mx.array:
    """A canonical tensor with the values the `naming` format stores (orientation, permutation, offsets); a float
    tensor cast to `dtype` when one is given."""
    array = provider.arch.from_canonical(naming, canonical, provider.get(canonical), provider.config)
    if dtype is not None and mx.issubdtype(array.dtype, mx.floating):
        array = array.astype(MX_DTYPES[dtype])
    return array


def dense_config(provider: WeightProvider, dtype: str | None) -> dict:
    """The config.json of the exported tensors: the source's, dequantized, with `dtype` as torch_dtype if given."""
    return {**provider.dense_config(), **({"torch_dtype": dtype} if dtype else {})}


def write_side_files(provider: WeightProvider, out: Path, dtype: str | None) -> None:
    provider.write_side_files(out)
    write_json(out / CONFIG, dense_config(provider, dtype))


def progress(total: int, what: str) -> tqdm:
    return tqdm(total=total, desc=what, unit="tensor", disable=not sys.stderr.isatty())


def write_shards(out: Path, names: list[str], read: Callable[[str], mx.array], metadata: dict[str, str]) -> None:
    """model.safetensors, or 5 GiB shards + model.safetensors.index.json, tensors read one by one.

    A shard is written once it is full and then dropped, so memory holds at most one shard even where the source
    reads eagerly. Shards get their final "-of-N" names at the end, when N is known (`out` is still private).
    """
    shards: list[Path] = []
    weight_map: dict[str, str] = {}
    shard: dict[str, mx.array] = {}

    def flush() -> None:
        shards.append(out / f"shard-{len(shards)}.safetensors")
        write_safetensors(shards[-1], [tensor_of(k, v) for k, v in shard.items()], metadata, atomic=False)
        weight_map.update(dict.fromkeys(shard, shards[-1].name))
        shard.clear()

    with progress(len(names), "writing tensors") as bar:
        for name in names:
            array = read(name)
            mx.eval(array)
            if shard and sum(a.nbytes for a in shard.values()) + array.nbytes > MAX_SHARD_BYTES:
                flush()
            shard[name] = array
            bar.update()
        flush()

    if len(shards) == 1:
        shards[0].rename(out / SINGLE_FILE)
        return
    final = {p.name: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, p in enumerate(shards)}
    for p in shards:
        p.rename(out / final[p.name])
    total = sum((out / f).stat().st_size for f in final.values())
    weight_map = {name: final[shard] for name, shard in weight_map.items()}
    write_json(out / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_hf(provider: WeightProvider, out: Path, dtype: str | None = None) -> None:
    write_side_files(provider, out, dtype)
    canonical = names_as(provider, "hf")
    write_shards(out, list(canonical), lambda name: read_as(provider, "hf", canonical[name], dtype), {"format": "pt"})


def write_mlx(provider: WeightProvider, out: Path, params: QuantParams | None, dtype: str | None = None,
              own_widths: bool = False) -> None:
    """`own_widths` (-q without --q-bits): a layer the source stores as an affine triple keeps its own bits and
    group size (a mixed store's widths, as per-layer "quantization" entries), not -q's default bits."""
    from mlx_lm.utils import quantize_model, save_config

    config = dense_config(provider, dtype)
    names = names_as(provider, "mlx")
    weights = {name: read_as(provider, "mlx", canonical, dtype) for name, canonical in names.items()}
    model = build_model(config, weights, lazy=True)
    if params is not None:
        predicate = stored_widths(provider, model, params) if own_widths and params.mode == "affine" else None
        model, config = quantize_model(model, config, params.group_size, params.bits, mode=params.mode,
                                       quant_predicate=predicate)
        model.load_weights(list(own_quantized(provider, model).items()), strict=False)
    provider.write_side_files(out)
    parameters = dict(tree_flatten(model.parameters()))
    write_shards(out, list(parameters), parameters.__getitem__, {"format": "mlx"})
    with atomic_path(out / CONFIG) as tmp:  # after the side files, whose config.json it replaces
        save_config(config, tmp)


def stored_widths(provider: WeightProvider, model: nn.Module,
                  params: QuantParams) -> Callable[[str, nn.Module], bool | dict]:
    """A quant_predicate for mlx_lm's quantize_model: the model's own (its routers' 8 bits, ...), except that a layer
    the source stores as an affine triple of another group size or bits than `params` is quantized as that triple,
    which quantize_model then records as the layer's own "quantization" entry."""
    canonical = names_as(provider, "mlx")
    model_predicate = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        name = canonical.get(f"{path}.weight")
        triple = provider.get_quantized(name) if name is not None else None
        if triple is not None and triple.mode == "affine" and (triple.group_size, triple.bits) != (
                params.group_size, params.bits):
            return {"group_size": triple.group_size, "bits": triple.bits, "mode": "affine"}
        return model_predicate(path, module) if model_predicate is not None else True

    return predicate


def own_quantized(provider: WeightProvider, model: nn.Module) -> dict[str, mx.array]:
    """The source's own triples (an INT4 store's, an MLX directory's) for the layers `model` holds quantized with
    the same group size, bits, mode and scale dtype, by parameter name: written as stored, where quantizing their
    dequantized values again would round a second time."""
    canonical = names_as(provider, "mlx")
    parameters: dict[str, mx.array] = {}
    for path, module in model.named_modules():
        name = canonical.get(f"{path}.weight")
        if name is None or not hasattr(module, "scales"):
            continue
        triple = provider.get_quantized(name)
        if triple is not None and (triple.group_size, triple.bits, triple.mode, triple.scales.dtype) == (
            module.group_size, module.bits, module.mode, module.scales.dtype
        ):
            parameters.update(triple.parameters(path))
    return parameters


# ---------------------------------------------------------------------------------------------- Ollama

# Experts of one layer share a blob (Ollama's x/create ExpertGroupPrefix).
_EXPERT_GROUP = re.compile(
    r"((?:model\.language_model\.|language_model(?:\.model)?\.|model\.)?layers\.\d+"
    r"\.(?:mlp\.experts|mlp\.shared_experts|mlp\.switch_mlp|moe\.experts))\..*\.weight"
)
_ROUTER = re.compile(r".*\.mlp\.gate\.weight")


def expert_group(name: str) -> str | None:
    """The blob (manifest layer name) an expert weight shares with its layer's other experts; None for others."""
    match = _EXPERT_GROUP.fullmatch(name)
    return match.group(1) if match else None


def ollama_quantizes(name: str, shape: tuple[int, ...], params: QuantParams) -> bool:
    """Ollama's choice of what to quantize (x/create GetTensorQuantization, without its int4->int8 promotion of
    k/v/down projections: the caller picked the bits): Linear weights of at least 1024 elements whose rows divide
    into groups, 2-D or stacked experts in 3-D; never embeddings, norms, biases or MoE router gates."""
    stacked_experts = len(shape) == 3 and expert_group(name) is not None
    return (
        name.endswith(".weight")
        and (len(shape) == 2 or stacked_experts)
        and "embed" not in name
        and "norm" not in name
        and _ROUTER.fullmatch(name) is None
        and shape[-1] % params.group_size == 0
        and math.prod(shape) >= 1024
    )


def ollama_quant_type(params: QuantParams) -> str:
    for quant_type, known in QUANT_TYPES.items():
        if (known.bits, known.mode) == (params.bits, params.mode):
            return quant_type
    raise QuantizationError(
        f"Ollama stores {', '.join(QUANT_TYPES)}; {params.mode} with {params.bits} bits has no quant_type"
    )


def default_ollama_name(src: Path) -> str:
    """The source's file or directory name, lower-cased, as an Ollama model name (tag latest)."""
    stem = src.name.removesuffix(".gguf").lower()
    return re.sub(r"[^a-z0-9._-]+", "-", stem).strip("-._") or "model"


def write_blob(root: Path, write: Callable[[StreamWriter], object]) -> tuple[str, int]:
    """A blob written by `write(writer)` under a temp name, published as blobs/sha256-<hex> once complete (its
    digest is the checksum the writer keeps); returns (digest, size)."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(blobs / "blob")
    try:
        with stream_file(tmp) as w:
            write(w)
        record = w.record()
        digest = f"sha256:{record[CHECKSUM]}"
        publish_file(tmp, blob_path(root, digest))  # same bytes if it was there already
    finally:
        tmp.unlink(missing_ok=True)
    return digest, record["size"]


def write_ollama_model(
    root: Path,
    model_name: str,
    names: list[str],
    read: Callable[[str], mx.array],
    side_files: Path,
    params: QuantParams | None = None,
    *,
    force: bool = False,
) -> Path:
    """A model in the Ollama store at `root`: tensors `names` (HF names, values from `read`), the files in
    `side_files` as JSON layers, quantized with `params` where Ollama would quantize. Returns the manifest path."""
    manifest = manifest_path(root, model_name)
    if manifest is None:
        raise ValueError(f"{model_name!r} is not an Ollama model name ([host/][namespace/]model[:tag])")
    if manifest.exists() and not force:
        raise OutputExistsError(f"{manifest}: model {model_name} exists; pass force=True to replace it")
    quant_type = ollama_quant_type(params) if params is not None else ""

    blobs: dict[str, list[str]] = {}  # manifest layer name -> tensor names in its blob
    for name in names:
        blobs.setdefault(expert_group(name) or name, []).append(name)
    layers = []
    with progress(len(names), f"writing {model_name}") as bar:
        for layer_name, members in blobs.items():
            tensors, metadata = {}, {}
            for name in members:
                array = read(name)
                if params is None or not ollama_quantizes(name, array.shape, params):
                    tensors[name] = array
                else:
                    weight, scales, *biases = mx.quantize(
                        array, group_size=params.group_size, bits=params.bits, mode=params.mode
                    )
                    tensors.update({name: weight, f"{name}.scale": scales})
                    if biases and biases[0] is not None:
                        tensors[f"{name}.bias"] = biases[0]
                    # A blob of one tensor records its quantization once; a shared blob per tensor.
                    prefix = f"{name}." if len(members) > 1 else ""
                    metadata.update({f"{prefix}quant_type": quant_type, f"{prefix}group_size": str(params.group_size)})
                bar.update()
            mx.eval(tensors)
            digest, size = write_blob(
                root, lambda w: write_tensors(w, [tensor_of(k, v) for k, v in tensors.items()], metadata or None)
            )
            layers.append({"mediaType": TENSOR_MEDIA_TYPE, "digest": digest, "size": size, "name": layer_name})

    for path in sorted(p for p in side_files.iterdir() if p.is_file()):
        digest, size = write_blob(root, lambda w: w.write(path.read_bytes()))
        layers.append({"mediaType": JSON_MEDIA_TYPE, "digest": digest, "size": size, "name": path.name})

    # The image config Ollama reads first: its MLX engine serves models whose format is "safetensors".
    model_config = {"model_format": "safetensors", "file_type": quant_type, "capabilities": ["completion"]}
    digest, size = write_blob(root, lambda w: w.write(json.dumps(model_config).encode()))
    manifest.parent.mkdir(parents=True, exist_ok=True)
    write_json(manifest, {  # last: until now nothing names the new blobs
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": digest, "size": size},
        "layers": layers,
    })
    return manifest


def export_ollama(
    provider: WeightProvider, root: Path, model_name: str, params: QuantParams | None, *, force: bool = False,
    dtype: str | None = None,
) -> Path:
    canonical = names_as(provider, "hf")
    side = make_temp_dir(root / "side-files")
    try:
        write_side_files(provider, side, dtype)
        return write_ollama_model(
            root, model_name, list(canonical), lambda name: read_as(provider, "hf", canonical[name], dtype), side,
            params, force=force,
        )
    finally:
        shutil.rmtree(side, ignore_errors=True)

