"""`squishlike.sharded_load`: the drop-in for `mlx_lm.sharded_load`, each rank reading only its share.

Run under `mlx.launch` (docs/format.md §14). mlx_lm builds the whole model lazily, slices it with the model's own
`shard()` (tensor parallelism) and `model.pipeline()` (pipeline parallelism), so every rank reads every weight it
slices. Here the model is split first, with no weights in it, and then asked which part of each weight it kept:

- Which tensors: the parameters of the split model (a pipeline stage has only its layers, plus the embeddings,
  the final norm and the head).
- Which part of each: a parameter whose shape changed was cut along one axis. The split is run a second time on
  a model whose parameters are index probes (each such parameter the indices along that axis, broadcast), so the
  kept indices come from the model's own `shard()`, segments included, not from a guess; a split that is not a
  selection along one axis is refused.
- An npy-dir then reads only those rows or columns of the stored parts and dequantizes only them
  (squishlike/npydir/slices.py), and caches the rank's share as the `rank` tier (squishlike/tiers/rank.py) for the
  next launch with the same layout. Any other source the provider reads gives whole tensors, which are cut here.
  An MLX-quantized source stays quantized, as mlx_lm keeps it: the model is quantized as stored before the split
  (mlx_lm too quantizes before `shard()`), so the split has the quantized sharded layers and the probes say how
  each part of a packed triple (words, scales, biases) is cut.
- Under `max_memory`, a share over it keeps its part of a MoE model's expert stacks in the store, streamed through
  the cache of experts `load` streams them through (experts.py), and the rest cached as a share of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..errors import FormatError, MissingTensorError, UnsupportedArchitectureError
from ..hub import resolve
from ..io.checksum import check_files
from ..npydir import MANIFEST, NpyDir, is_npydir
from .budget import Held, check_fits, held_bytes, parse_size, plan_budget

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

log = logging.getLogger("squishlike")

Selection = tuple[int, np.ndarray] | None  # (axis, the indices kept along it), or None: the whole tensor


@dataclass
class Plan:
    """What one rank keeps: the split model (its parameters placeholders) and, per mlx_lm parameter name, the part
    of the full tensor that parameter holds."""

    model: nn.Module
    kept: dict[str, Selection]
    key: str  # the layout: "tensor-2-0", "pipeline-2-1", "pipeline-2-1.tensor-2-0"

    @property
    def fingerprint(self) -> str:
        rows = [[name, *([] if s is None else [s[0], s[1].tolist()])] for name, s in sorted(self.kept.items())]
        return hashlib.sha256(json.dumps([self.key, rows]).encode()).hexdigest()


def sharded_load(
    path_or_hf_repo: str | Path,
    pipeline_group: mx.distributed.Group | None = None,
    tensor_group: mx.distributed.Group | None = None,
    return_config: bool = False,
    *,
    tokenizer_config: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    verify: bool | None = None,
    max_memory: int | str | None = None,
) -> tuple[nn.Module, TokenizerWrapper] | tuple[nn.Module, TokenizerWrapper, dict[str, Any]]:
    """This rank's share of the model and the tokenizer; same arguments and result as `mlx_lm.sharded_load`.

    With neither group, tensor parallelism over `mx.distributed.init()` where the model has `shard()`, else
    pipeline parallelism. An npy-dir is read slice by slice and its share cached per layout; any other source
    squishlike.load reads (HF, MLX, GGUF, Ollama) is read tensor by tensor (only the stage's, when pipelined), an
    MLX-quantized one kept quantized as mlx_lm keeps it.

    An npy-dir's side files are checked on every launch, as `squishlike.load` checks them; `verify=True` (or
    SQUISHLIKE_VERIFY=1) also checks every hash of the store's files before reading slices of them, and of a
    cached share before loading it (a damaged share is then rebuilt).

    `max_memory` (bytes, or a size such as "3GB") bounds this rank's memory as it bounds `load`'s: a share over it
    keeps its part of a MoE model's expert stacks in the store, read on demand into a cache of the bytes left
    (squishlike/load/experts.py), the rest resident (and cached as its own share); any other share over it is
    refused before anything is read. An npy-dir's only: another source's rank is refused over it."""
    import mlx.core as mx

    from ..model import model_tokenizer
    from ..tiers.base import keep_uncast
    from ..tiers.load import verify_wanted

    path = resolve(path_or_hf_repo)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if is_npydir(path):
            store = NpyDir(path)
            verify = verify_wanted(verify)
            store.check_side_files(verify)
            config, side_files, source = store.config(), store.path, store.path
            plan = plan_shards(config, store.path, pipeline_group, tensor_group, trust_remote_code)
            if max_memory is not None:
                plan = _stream_experts(store, plan, parse_size(max_memory))
            weights, tier, nbytes = _store_weights(store, plan, verify)
        else:
            from mlx_lm.utils import load_config

            from ..provider import WeightProvider

            if max_memory is not None:
                check_fits(path, parse_size(max_memory))
            provider = stack.enter_context(WeightProvider.open(path))
            side_files = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="squishlike-side-")))
            provider.write_side_files(side_files)
            config, source = load_config(side_files), provider.reader.path
            # An MLX-quantized source stays quantized, as mlx_lm keeps it: the config says so, and the stored
            # triples say which layers. Its reads are lazy (mx.load), so `stored` reads nothing until a kept
            # tensor is evaluated.
            stored = None
            if quantization := provider.quantization():
                config.update(quantization)
                stored = provider.mlx_weights()
            plan = plan_shards(config, side_files, pipeline_group, tensor_group, trust_remote_code, stored)
            weights, nbytes = _provider_weights(provider, plan, stored)
            tier = provider.format
        model = plan.model
        try:
            model.load_weights(list(weights.items()), strict=True)
        except ValueError as e:
            raise FormatError(source, f"the {plan.key} share does not fit the model: {e}") from e
        if is_npydir(path):  # what mlx_lm keeps in float32 in a bf16 model, from the store (tiers/base.py)
            keep_uncast(model, store, kept=plan.kept)
        mx.eval(model.parameters())
        tokenizer = model_tokenizer(config, side_files, source, tokenizer_config, trust_remote_code)
    seconds = time.perf_counter() - started
    log.debug("%s: %s share from %s, %d bytes read in %.3f s", source, plan.key, tier, nbytes, seconds,
              extra={"shard_load": {"layout": plan.key, "tier": tier, "bytes_read": nbytes, "seconds": seconds}})
    # Synchronize the ranks, as mlx_lm does, so none starts its first collective before the others are loaded.
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))
    return (model, tokenizer, config) if return_config else (model, tokenizer)


def plan_shards(
    config: dict[str, Any],
    model_dir: Path,
    pipeline_group: mx.distributed.Group | None,
    tensor_group: mx.distributed.Group | None,
    trust_remote_code: bool = False,
    stored: dict[str, mx.array] | None = None,
) -> Plan:
    """The model split for this rank, as mlx_lm.sharded_load splits it, and what each kept parameter holds.

    `stored`: a quantized source's weights by mlx_lm name (lazy; only names, shapes and dtypes are looked at). The
    model is then quantized as they are before it is split, as mlx_lm.sharded_load quantizes before `shard()`, so
    the split gives the same quantized sharded layers and the kept parts are of the packed triples."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..model import model_classes, quantize_as_stored

    model_class, args_class = model_classes(config, model_dir, trust_remote_code)

    def new_model() -> nn.Module:
        model = model_class(args_class.from_dict(config))
        if stored is not None:
            quantize_as_stored(model, config, stored)
        return model

    model = new_model()
    has_pipelining = hasattr(model, "model") and hasattr(model.model, "pipeline")
    has_tensor_parallel = hasattr(model, "shard")
    if pipeline_group is not None and not has_pipelining:
        raise ValueError("The model does not support pipelining but a pipeline_group was provided")
    if tensor_group is not None and not has_tensor_parallel:
        raise ValueError("The model does not support tensor parallelism but a tensor_group was provided")
    if not has_pipelining and not has_tensor_parallel:  # as mlx_lm.sharded_load refuses it, with the type named
        raise UnsupportedArchitectureError(f"mlx_lm cannot shard a {config.get('model_type')} model (it has neither "
                                           "shard() nor a pipeline()): the model does not support any sharding")
    if pipeline_group is tensor_group is None:
        if has_tensor_parallel:
            tensor_group = mx.distributed.init()
        else:
            pipeline_group = mx.distributed.init()
    key = ".".join(f"{mode}-{g.size()}-{g.rank()}" for mode, g in (("pipeline", pipeline_group),
                                                                     ("tensor", tensor_group)) if g is not None)

    def split(m: nn.Module) -> dict[str, mx.array]:
        if tensor_group is not None:
            m.shard(tensor_group)
        if pipeline_group is not None:
            m.model.pipeline(pipeline_group)
        return dict(tree_flatten(m.parameters()))

    full = {k: v.shape for k, v in tree_flatten(model.parameters())}
    local = split(model)
    axes = {}
    for name, value in local.items():
        cut = [a for a, (n, k) in enumerate(zip(full[name], value.shape)) if n != k]
        if len(cut) > 1 or value.ndim != len(full[name]):
            raise ValueError(f"{config.get('model_type')}: shard() turns {name} {list(full[name])} into "
                             f"{list(value.shape)}, not a cut along one axis; squishlike cannot read that share")
        if cut:
            axes[name] = cut[0]
    kept: dict[str, Selection] = dict.fromkeys(local)
    if axes:
        probed = _probe(new_model, split, full, axes, {name: local[name].shape[a] for name, a in axes.items()})
        for name, axis in axes.items():
            got = probed[name]
            line = np.array(mx.moveaxis(got, axis, 0).reshape(got.shape[axis], -1)[:, 0])
            expected = mx.broadcast_to(mx.array(line).reshape([-1 if a == axis else 1 for a in range(got.ndim)]),
                                       got.shape)
            if (len(line) != local[name].shape[axis] or not mx.array_equal(got, expected).item()
                    or np.any(np.diff(line) <= 0)):
                raise ValueError(f"{config.get('model_type')}: shard() of {name} is not a selection of ascending "
                                 f"indices along axis {axis}; squishlike cannot read that share")
            kept[name] = (axis, line)
    return Plan(model, kept, key)


def _probe(new_model: Callable[[], nn.Module], split: Callable[[nn.Module], dict[str, mx.array]],
           full: dict[str, tuple[int, ...]], axes: dict[str, int], kept: dict[str, int]) -> dict[str, mx.array]:
    """The split of a model whose cut parameters (`axes`: name -> cut axis; `kept`: name -> its length after the
    cut) hold their indices along the cut axis. Each probe first has
    length 1 on every other axis (shard_linear cuts one axis and takes the other sizes from the weight, so this
    costs nothing); a model whose split depends on the other sizes (heads reshaped) gets full-size probes."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    def probes(thin: bool) -> dict[str, mx.array]:
        model = new_model()
        arrays = []
        for name, axis in axes.items():
            shape = full[name]
            line = mx.arange(shape[axis], dtype=mx.int32).reshape([-1 if a == axis else 1 for a in range(len(shape))])
            arrays.append((name, line if thin else mx.broadcast_to(line, shape)))
        model.update(tree_unflatten(arrays))
        return split(model)

    try:
        thin = probes(thin=True)
        if all(thin[name].size == thin[name].shape[axis] == kept[name] for name, axis in axes.items()):
            return thin
    except (ValueError, TypeError, IndexError, KeyError):
        pass
    return probes(thin=False)


def _store_weights(store: NpyDir, plan: Plan, verify: bool = False) -> tuple[dict[str, mx.array], str, int]:
    """The rank's weights from its cached share when ready, else read slice by slice and cached; `verify`: each
    file checked against every hash recorded first. Returns (weights by mlx_lm name, the tier that served them,
    stored bytes read)."""
    from ..dtypes import to_mx
    from ..npydir.slices import SliceReader
    from ..tiers.base import mlx_names
    from ..tiers.rank import RankTier

    canonical = {mlx: name for name, mlx in mlx_names(store).items()}
    for name in plan.kept:
        if name not in canonical:
            raise MissingTensorError(store.path / MANIFEST, name, "the model needs it and the store has no such tensor")
    shapes = {name: _kept_shape(store.entry(canonical[name]).shape, s) for name, s in plan.kept.items()}
    tier = RankTier(plan.key, plan.fingerprint, shapes)
    if (payload := tier.ready(store)[0]) is not None:
        try:
            tier.check_files(store, payload, verify)  # a share file replaced since it was written is hashed
            return tier.load(store).weights, tier.name, tier.nbytes(store)
        except (FormatError, OSError, ValueError, RuntimeError) as e:
            warnings.warn(f"{store.path / tier.sentinel}: unreadable ({e}); reading the store and rebuilding it")
            with contextlib.suppress(OSError):  # a read-only directory: nothing to rebuild into anyway
                tier.invalidate(store)
    if verify:
        check_files(store.path, store.file_records(), every=True)
    reader = SliceReader(store)
    dense = {}
    for name, selection in plan.kept.items():
        dense[canonical[name]] = reader.read(canonical[name], *(selection or ()))
    weights = {mlx: to_mx(dense[name], store.runtime_dtype) for mlx, name in canonical.items() if name in dense}
    try:
        with tier.lock(store):
            if tier.ready(store)[0] is None:  # another process with this layout may have built it meanwhile
                tier.build(store, dense)
    except OSError as e:  # read-only directory, disk full: this launch still has its weights
        warnings.warn(f"{store.path}: could not cache the {plan.key} share ({e})")
    return weights, "store", reader.bytes_read


def _stream_experts(store: NpyDir, plan: Plan, max_memory: int) -> Plan:
    """The plan of a rank under `max_memory`: `plan` itself when its share fits whole; else its expert stacks
    replaced in its model by ones streamed from the store (the part of each expert the rank keeps, in the store's
    quantized form), and the rest of the share to read, under its own layout key (cached beside the whole share,
    not over it). MemoryBudgetError, naming both sizes, when even that does not fit (budget.py)."""
    from mlx_lm.models.switch_layers import SwitchLinear

    from ..dtypes import NP_STORAGE
    from ..tiers.base import mlx_names
    from .experts import ExpertCache, stream_experts

    canonical = {mlx: name for name, mlx in mlx_names(store).items()}
    runtime = np.dtype(NP_STORAGE[store.runtime_dtype]).itemsize
    kept = {canonical[name]: s for name, s in plan.kept.items() if name in canonical}  # _store_weights names any other
    stacks = {path: canonical[f"{path}.weight"] for path, module in plan.model.named_modules()
              if isinstance(module, SwitchLinear) and f"{path}.weight" in plan.kept and f"{path}.weight" in canonical}
    streamed = {}
    for name in stacks.values():
        entry, selection = store.entry(name), kept[name]
        share = (1, 1) if selection is None else (len(selection[1]), entry.shape[selection[0]])
        streamed[name] = held_bytes(store, entry) * share[0] // share[1]
    tensors = {name: math.prod(_kept_shape(store.entry(name).shape, s)) * runtime for name, s in kept.items()}
    budget = plan_budget(store, max_memory, stacks, Held(tensors, streamed))
    if budget is None:
        return plan
    cache = ExpertCache(store, list(budget.stacks.values()), budget.cache, budget.gathered,
                        {name: kept[name] for name in budget.stacks.values()})
    stream_experts(plan.model, budget.stacks, cache)
    log.info("%s: the %s share's experts streamed from the store: %.2f GB resident, a cache of %.2f GB for %.2f GB "
             "of experts (max_memory %.2f GB)", store.path, plan.key, budget.resident / 1e9, budget.cache / 1e9,
             budget.experts / 1e9, max_memory / 1e9)
    rest = {name: s for name, s in plan.kept.items() if name.removesuffix(".weight") not in budget.stacks}
    return Plan(plan.model, rest, f"{plan.key}.experts-streamed")


def _kept_shape(shape: tuple[int, ...], selection: Selection) -> tuple[int, ...]:
    """The shape of what `selection` keeps of a tensor of `shape` (SliceReader.read's result)."""
    if selection is None:
        return tuple(shape)
    axis, index = selection
    kept = list(shape)
    kept[axis % len(kept)] = len(index)
    return tuple(kept)


def _provider_weights(
    provider: Any, plan: Plan, stored: dict[str, mx.array] | None
) -> tuple[dict[str, mx.array], int]:
    """The rank's weights from any provider source: each kept tensor read whole, then cut. Returns them with the
    bytes of the whole tensors read (as the source gives them: packed triples, else dequantized).

    `stored`: an MLX-quantized source's lazy weights (plan_shards'). Each part of a triple (packed words, scales,
    biases) is cut on its own, where the probes say `shard()` cuts it, so the parts are mlx_lm's bit for bit. Each
    is read whole, as mlx_lm reads every tensor it cuts (docs/format.md §14 says what reading less would take)."""
    import mlx.core as mx

    canonical = {provider.mlx_name(n): n for n in provider.names()}
    weights, nbytes = {}, 0
    for name, selection in plan.kept.items():
        if name not in (canonical if stored is None else stored):
            raise MissingTensorError(provider.reader.path, name, "the model needs it and the source has no such tensor")
        array = provider.get(canonical[name]) if stored is None else stored[name]
        nbytes += array.nbytes
        weights[name] = array if selection is None else mx.take(array, mx.array(selection[1]), axis=selection[0])
    return weights, nbytes
