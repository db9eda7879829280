"""MLX model directories as mlx_lm writes them: an HF directory whose config.json carries "quantization".

    "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                     "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},   # per-layer override
                     "model.layers.1.mlp.down_proj": false}                         # left unquantized

A quantized layer `<p>` stores `<p>.weight` (uint32 words), `<p>.scales` and, in affine mode only, `<p>.biases`
(the per-group offsets, not a Linear bias, which stays `<p>.bias`). mxfp4/mxfp8/nvfp4 scales are uint8 exponents.
The triple is listed once, under its weight's name, with the logical (unpacked) shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..config import CONFIG, read_config
from ..errors import FormatError, MissingTensorError
from .base import QuantizedTensor, TensorInfo
from .safetensors import HFReader, dtype_name

MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")
# What QuantizedLinear.to_quantized falls back to when a per-layer override leaves group_size or bits out.
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}


@dataclass(frozen=True)
class QuantParams:
    group_size: int
    bits: int
    mode: str = "affine"

    @classmethod
    def from_dict(cls, params: dict) -> QuantParams:
        mode = params.get("mode", "affine")
        default_group, default_bits = MODE_DEFAULTS.get(mode, (None, None)) if isinstance(mode, str) else (None, None)
        return cls(params.get("group_size") or default_group, params.get("bits") or default_bits, mode)

    @property
    def dtype(self) -> str:
        """TensorInfo's dtype for a triple: "affine4", "affine8", "mxfp4", ..."""
        return f"affine{self.bits}" if self.mode == "affine" else self.mode


def quantized_shape(
    path: Path,
    name: str,
    params: QuantParams,
    weight: tuple[tuple[int, ...], mx.Dtype],
    scales: tuple[tuple[int, ...], mx.Dtype],
    biases: tuple[tuple[int, ...], mx.Dtype] | None,
) -> tuple[int, ...]:
    """The logical shape of an MLX-layout triple given as (shape, dtype) pairs; FormatError when the parts do not
    fit each other or `params` (mx.dequantize would fail later, or silently return the wrong values)."""

    def bad(problem: str) -> FormatError:
        return FormatError(path, f"quantized tensor {name} ({params.mode}, {params.bits} bits, group "
                                 f"{params.group_size}): {problem}")

    if params.mode not in MODES:
        raise bad(f"unknown quantization mode; MLX knows {', '.join(MODES)}")
    (w_shape, w_dtype), (s_shape, s_dtype) = weight, scales
    if w_dtype != mx.uint32:
        raise bad(f"packed weight is {dtype_name(w_dtype)}, not uint32")
    if params.mode == "affine":
        if biases is None:
            raise bad("affine mode needs biases, none stored")
        if not mx.issubdtype(s_dtype, mx.floating) or biases != (s_shape, s_dtype):
            raise bad("scales and biases must be floats of one shape and dtype")
    else:
        if biases is not None:
            raise bad("stores biases, which this mode does not have")
        if s_dtype != mx.uint8:
            raise bad(f"scales are {dtype_name(s_dtype)}, this mode stores uint8 exponents")
    if not w_shape or w_shape[:-1] != s_shape[:-1]:
        raise bad(f"weight shape {w_shape} and scales shape {s_shape} disagree")
    cols, remainder = divmod(w_shape[-1] * 32, params.bits)
    if remainder or cols != s_shape[-1] * params.group_size:
        raise bad(f"weight shape {w_shape} and scales shape {s_shape} do not fit these parameters")
    if (refused := mlx_refuses(params, cols)) is not None:
        raise bad(f"MLX's quantized layers refuse these parameters, so no load could build this one ({refused})")
    return (*w_shape[:-1], cols)


@functools.lru_cache(maxsize=None)
def mlx_refuses(params: QuantParams, cols: int) -> str | None:
    """What MLX says against a quantized layer of `cols` input columns with `params`, None when it takes them. A load
    builds each quantized layer with `nn.quantize`, whose layers quantize their initial weight with `mx.quantize`:
    asking `mx.quantize` the same, of a lazy array (it checks its arguments as the operation is built; nothing is
    allocated or computed), makes the provider refuse exactly what a load refuses, by MLX's own rule."""
    try:
        mx.quantize(mx.zeros((1, cols)), group_size=params.group_size, bits=params.bits, mode=params.mode)
    except (ValueError, TypeError, OverflowError) as e:
        return str(e)
    return None


class MLXReader(HFReader):
    """An HF directory (shards, index, side files as HFReader reads them) whose layers may be MLX triples."""

    format_name = "mlx"
    naming = "mlx"

    def __init__(self, path: Path):
        super().__init__(path)
        quantization = self.config().get("quantization")
        if not isinstance(quantization, dict):
            raise FormatError(self.path / CONFIG, "has no \"quantization\" object")
        default = QuantParams.from_dict(quantization)
        entries = {name: f.entries[name] for name, f in self._where.items()}
        # weight name -> (params, logical shape) for every stored triple
        self._triples: dict[str, tuple[QuantParams, tuple[int, ...]]] = {}
        for scales_name in [n for n in entries if n.endswith(".scales")]:
            layer = scales_name.removesuffix(".scales")
            if f"{layer}.weight" not in entries:
                continue
            override = quantization.get(layer)
            if override is False:
                raise FormatError(self.path, f"{layer} is stored quantized but config.json says it is not")
            params = QuantParams.from_dict(override) if isinstance(override, dict) else default
            if params.mode in MODES and not all(
                    isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (params.group_size, params.bits)):
                raise FormatError(self.path / CONFIG, f"{layer}: quantization group_size {params.group_size!r} and "
                                                      f"bits {params.bits!r} must be positive integers")
            shape = quantized_shape(
                self.path, f"{layer}.weight", params,
                entries[f"{layer}.weight"], entries[scales_name], entries.get(f"{layer}.biases"),
            )
            self._triples[f"{layer}.weight"] = (params, shape)

    @classmethod
    def detect(cls, path: Path) -> bool:
        if not HFReader.detect(path):
            return False
        try:
            return isinstance(read_config(path).get("quantization"), dict)
        except FormatError:
            return False

    def tensors(self) -> dict[str, TensorInfo]:
        infos = super().tensors()
        for weight, (params, shape) in self._triples.items():
            layer = weight.removesuffix(".weight")
            parts = [infos.pop(f"{layer}.scales"), infos.pop(f"{layer}.biases", None), infos[weight]]
            nbytes = sum(p.nbytes for p in parts if p is not None)
            infos[weight] = TensorInfo(weight, shape, params.dtype, nbytes, quantized=True)
        return infos

    def read_quantized(self, name: str) -> QuantizedTensor | None:
        if name not in self._where:
            raise MissingTensorError(self.path, name)
        if name not in self._triples:
            return None
        params, _ = self._triples[name]
        layer = name.removesuffix(".weight")
        return QuantizedTensor(
            weight=super().read(name),
            scales=super().read(f"{layer}.scales"),
            biases=super().read(f"{layer}.biases") if params.mode == "affine" else None,
            group_size=params.group_size,
            bits=params.bits,
            mode=params.mode,
        )

    def read(self, name: str) -> mx.array:
        triple = self.read_quantized(name)
        return super().read(name) if triple is None else triple.dequantize()
