"""`squishlike compress`: any model the provider reads -> an npy-dir (docs/format.md §1-5).

Streams tensor by tensor (peak memory ~ the largest tensor a few times over, never the whole model), writes into
a temp directory beside OUT, and publishes it with one rename at the end, so a failed or interrupted run leaves
nothing that looks like a model. Two runs aimed at one OUT: the second fails at once with DirectoryBusyError.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from . import quant
from .compress_options import (ERROR_LIMITS, CompressOptions, choose_scheme, default_tiers, runtime_dtype,
                               source_dtype, weight_kinds)
from .config import load_config
from .dtypes import MX_DTYPES, to_numpy
from .errors import AccuracyGateError, FormatError, OutputExistsError, QuantizationError
from .npydir import ErrorStats, NpyDirWriter, Policy, Source, TensorEntry, encode_key, is_npydir, source_fingerprint
from .quant.schemes import SCHEMES, rows_cols
from .quant.tensor import QuantizedTensor
from .provider import WeightProvider
from . import resume
from .io.atomic import publish_dir, sweeping_temps
from .io.fault import fault_point
from .io.files import remove_inside
from .io.lock import exclusive
from .options import checks_options

_SAMPLE_ROWS = 256  # rows sampled per tensor for the error statistics: cheap, and stable to a few percent


@dataclass
class CompressReport:
    """What one compress run wrote: the CLI's result line and its --json."""

    path: Path
    source: str
    source_dtype: str  # the dtype of the source's largest tensor: "bfloat16", "Q4_1", ...
    scheme: str  # the uniform scheme asked for (CompressOptions.scheme): int8, int4 or int3
    tiers: tuple[str, ...]
    tensors: int
    quantized: int
    source_bytes: int
    store_bytes: int
    seconds: float

    def summary(self) -> str:
        before, after = self.source_bytes, max(self.store_bytes, 1)
        relation = (f"{before / after:.1f}x smaller than" if after <= before else f"{after / before:.1f}x the size of")
        return (f"{self.path}: the {self.scheme.upper()} store is {relation} the {self.source_dtype} source "
                f"({before / 1e6:.1f} MB -> {after / 1e6:.1f} MB); {self.tensors} tensors, {self.quantized} "
                f"quantized, in {self.seconds:.1f} s")

    def to_json(self) -> dict:
        return {**asdict(self), "path": str(self.path), "tiers": list(self.tiers)}


@checks_options
def compress(
    src: str | Path,
    out: str | Path,
    *,
    scheme: str | None = None,
    group_size: int | str = 64,
    passthrough: tuple[str, ...] = (),
    bits: tuple[tuple[str, int], ...] = (),
    quantize_embeddings: bool | None = None,
    clip_search: bool | None = None,
    dtype: str | None = None,
    tiers: tuple[str, ...] | None = None,
    force: bool = False,
    awq: bool | None = None,
    gptq: bool | None = None,
    refit_scales: bool = False,
    gptq_embedding: bool | None = None,
    gptq_tied_lookup: bool | None = None,
    mixed_precision: float = 0.0,
    int3_gate: bool = True,
    int3_max_ppl_increase: float = 0.08,
    calibration_samples: int = 512,
    calibration_max_tokens: int | None = None,
    bpw: float | None = None,
    sensitivity_from: str | Path | None = None,
    rotate: str = "none",
    distill_steps: int = 0,
    distill_rate: float = 6e-5,
    format: str | None = None,
) -> Path:
    """Compress `src` (HF dir, MLX dir, GGUF file, Ollama model, cached HF repo id) into the npy-dir `out`.

    Returns the absolute path of `out`. Options:

    - scheme: the quantization scheme of linear weights, "int8" (default), "int4" or "int3".
    - group_size: elements per scale along the input axis: 32, 64 or 128 (int3: 32 or 64); for int8 also "row",
      the per-row symmetric form (group-wise otherwise: MLX's 8-bit affine form).
    - passthrough: fnmatch patterns of canonical names (e.g. "layers.0.*") kept exact.
    - bits: (fnmatch pattern of canonical names, bits[, group size]) rules: a tensor the store quantizes takes the
      width of the first rule it matches, 2, 3, 4, 5, 6 or 8 (group-wise, at the rule's group size, else at
      group_size), e.g. (("*.ffn.down.*", 6, 128), ("*", 3)).
    - quantize_embeddings: quantize the token embedding and lm_head too, with the linears' scheme (as
      mlx_lm.convert -q does); False keeps them exact (about 2x the bytes of an INT4 store of a small model).
      None: on for int8 and int4, off for int3.
    - clip_search: group-wise per-group clip search (lower error, slower). None: on for int4.
    - dtype: the runtime dtype, "float32", "float16" or "bfloat16"; None: the source's float dtype, bfloat16 for a
      quantized source.
    - tiers: the caches the first load builds, from "mlx", "finalized", "int8", "int4", "int3" (a quantized tier
      only in a store holding tensors of its width); None: mlx plus the store's quantized tiers.
    - force: replace an existing npy-dir at `out` (never a directory squishlike did not write).

    Calibration options run the source model in float32 on the shipped calibration text; an INT4 store is
    calibrated by default (awq, gptq and clip_search None: on for int4, off otherwise):

    - awq: activation-aware per-input-channel scaling, folded into norms; the stored form stays plain.
    - gptq: round each linear (and the output head) column by column, spreading each rounding error onto the
      columns not yet rounded so that the layer's output on the calibration inputs changes least (group-wise
      schemes); the stored form stays plain.
    - refit_scales: after GPTQ (which it turns on), solve each group's scale and offset again for GPTQ's codes,
      by least squares on the linear's output error over the calibration inputs, kept where it beats GPTQ's grid
      (docs/design.md §7.7, with its cost). False by default.
    - gptq_embedding: GPTQ the token embedding of an untied model along its width, on the Hessian of what reads a
      looked-up row in the first layer (its linears through their norm, and the residual path), found from the
      model. None: on with gptq.
    - gptq_tied_lookup: a tied embedding (the output head too) is GPTQ'd on the head's calibration inputs with that
      Hessian added, each weighed by what an error in the matrix's rows costs at the model's output through that
      use, measured on the calibration text (docs/design.md §7.5). None: on with gptq; False: the head's inputs
      alone.
    - mixed_precision: keep the most sensitive tensors at more bits (INT8 in an INT4/INT3 store, exact in an INT8
      store) within this fraction of extra bytes over the quantized tensors, in [0, 1].
    - int3_gate: INT3 only: measure the accuracy gate; a store that fails it is not written. False skips the gate
      (the store is written, without its 3-bit tier).
    - int3_max_ppl_increase: the gate's bound on the calibration-perplexity increase (0.08: +8 %).
    - calibration_samples: input rows per linear kept for the AWQ error search (GPTQ's Hessians take every
      calibration position).
    - calibration_max_tokens: use only the first N calibration tokens (None: all).
    - bpw: a size target in bits per weight (every stored byte, scales and exact tensors included, times 8 over
      the parameter count: mlx_lm's measure), met within 1 %: each linear, the embedding and the head get the
      width among 2, 3, 4, 5, 6 and 8 bits (group-wise affine, MLX's packing) or exact that changes its layer's
      output least on the calibration inputs; calibrated as INT4 is. The measured sensitivities are kept in the
      manifest.
    - sensitivity_from: with bpw, a store of the same source (compressed with bpw) whose kept sensitivities plan
      the widths, instead of measuring them again.
    - rotate: "hadamard" rotates the model before anything is measured or rounded, exactly (the float model
      computes the same function): random orthogonal Hadamard matrices on the residual stream and on each head's
      values, folded into the weights (QuaRot, SpinQuant's R1 and R2), which spread outlier channels so that low
      widths round better; the store stays plain layers of the same architecture (a tied head gets its own copy,
      which a bpw target pays for); "heads" rotates each head's values alone (a tied head stays tied). Where a
      family's layers do not commute with it, the part that does not is skipped and the manifest's "rotation" says
      why. "none" (default) leaves the source as it is.
    - distill_steps: once the store is written, train its scales and offsets of widths below 8 bits, codes kept,
      for this many Adam steps on the KL to the float model's logits over the calibration text and 8,192 tokens the
      float model writes itself (mlx_lm's DWQ, one sample of 256 tokens a step), written back in the store's dtype.
      Its cost: a forward and backward pass of the whole model a step (docs/design.md §7.7). Group-wise stores
      only. 0 (default): off.
    - distill_rate: the learning rate of those steps.
    - format: the old name of `scheme`, still accepted with a DeprecationWarning ("format" names file formats).

    Raises ValueError for an invalid option value, UnknownOptionError for an option compress does not take,
    OutputExistsError when `out` holds something and `force` is not set, DirectoryBusyError when another process
    compresses into `out`, AccuracyGateError when an INT3 store fails its gate, and the errors of
    squishlike.errors for a source that cannot be read.
    """
    if format is not None:
        warnings.warn("compress(format=...) is now compress(scheme=...); format= will be removed",
                      DeprecationWarning, stacklevel=3)  # the caller's line: checks_options wraps this function
        scheme = format
    opts = CompressOptions(
        scheme=scheme,
        group_size=group_size,
        passthrough=passthrough,
        bits=bits,
        quantize_embeddings=quantize_embeddings,
        clip_search=clip_search,
        dtype=dtype,
        tiers=tiers,
        force=force,
        awq=awq,
        gptq=gptq,
        refit_scales=refit_scales,
        gptq_embedding=gptq_embedding,
        gptq_tied_lookup=gptq_tied_lookup,
        mixed_precision=mixed_precision,
        int3_gate=int3_gate,
        int3_max_ppl_increase=int3_max_ppl_increase,
        calibration_samples=calibration_samples,
        calibration_max_tokens=calibration_max_tokens,
        bpw=bpw,
        sensitivity_from=None if sensitivity_from is None else str(sensitivity_from),
        rotate=rotate,
        distill_steps=distill_steps,
        distill_rate=distill_rate,
    )
    return compress_with_report(src, out, opts).path


def compress_with_report(src: str | Path, out: str | Path, opts: CompressOptions) -> CompressReport:
    """`compress` with its options as a CompressOptions; returns what was written."""
    opts.validate()
    out = Path(out).expanduser().absolute()
    _check_output(out, opts.force)
    started = time.perf_counter()
    with WeightProvider.open(src) as provider:
        out.parent.mkdir(parents=True, exist_ok=True)
        with (exclusive(out.parent, f"compressing into {out.name}", name=f".{out.name}.squishlike-lock"),
              sweeping_temps(out.parent, out.name)):
            _check_output(out, opts.force)  # it may have appeared while we waited
            key = resume.key_digest(source_fingerprint(Path(provider.reader.path)), asdict(opts))
            tmp = resume.partial_dir(out, key)
            try:
                with _rotated(provider, out, opts) as (source, written_opts):
                    writer, plan = _write_store(source, tmp, out, written_opts, key, origin=provider)
                    if opts.distill_steps:  # before the gate, which measures the store as it is published
                        from .calibration.distill import distill_store

                        distill_store(writer, provider, written_opts)
                    if opts.scheme == "int3":
                        _gate_int3(source, writer, out, written_opts, plan)
                resume.finish(tmp, writer.manifest)
                publish_dir(tmp, out)
            except KeyboardInterrupt:
                if tmp.is_dir():
                    print(f"compress: interrupted; the finished layers are kept in {tmp}: the same command goes "
                          "on from there", file=sys.stderr)
                raise
            except BaseException:
                with contextlib.suppress(OSError, FormatError):
                    remove_inside(tmp, out.parent)
                raise
        dtype = source_dtype(provider)
        source_bytes = sum(t.nbytes for t in provider.reader.tensors().values())
    manifest = writer.manifest
    return CompressReport(out, str(src), dtype, opts.scheme, manifest.policy.tiers, len(manifest.tensors),
                          sum(e.kind.quantized for e in manifest.tensors.values()), source_bytes,
                          sum(r.size for r in manifest.part_files().values()), round(time.perf_counter() - started, 1))


def _rotated(provider: WeightProvider, out: Path, opts: CompressOptions):
    """A context giving (the provider compress reads, the options it writes with): `provider` and `opts` as they
    are, or with `rotate`, the source's rotated copy (calibration/rotate.py, which imports MLX)."""
    if opts.rotate == "none":
        return contextlib.nullcontext((provider, opts))
    from .calibration.rotate import rotated

    return rotated(provider, out, opts)


def _gate_int3(provider: WeightProvider, writer: NpyDirWriter, out: Path, opts: CompressOptions, plan) -> None:
    """Measure the INT3 gate on the unpublished store and record it in its manifest; a store that fails it is not
    written (docs/format.md §6.4)."""
    from .calibration import int3_gate

    gate = int3_gate(provider, writer.path, opts, plan)
    writer.record_int3_gate(gate)
    if opts.int3_gate and not gate["passed"]:
        raise AccuracyGateError(
            f"{out}: not written: the INT3 store fails its accuracy gate ({gate['reason']}). Options: scheme=int4; "
            f"or keep the most sensitive tensors at INT8 with mixed_precision=0.1; or accept the loss by raising "
            f"int3_max_ppl_increase={opts.int3_max_ppl_increase} explicitly"
        )


def _check_output(out: Path, force: bool) -> None:
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not is_npydir(out):  # force replaces only what squishlike made; it never deletes a stranger's files
        raise OutputExistsError(f"{out}: exists and is not a squishlike npy-dir; compress never replaces it, even "
                                "with force=True: choose a new or empty output")
    if not force:
        raise OutputExistsError(f"{out}: exists and holds an npy-dir; pass force=True to replace it")


def _quantize(array: np.ndarray, src_dtype: str, scheme: str, opts: CompressOptions, group_size: int,
              scale_dtype: str) -> dict:
    parts = quant.quantize(scheme, array.reshape(rows_cols(array.shape)), src_dtype=src_dtype,
                           group_size=group_size, scale_dtype=scale_dtype, clip_search=opts.clip_search)
    return dict(zip(SCHEMES[scheme].suffixes, parts))


def repack(triple: QuantizedTensor | None, scheme: str, runtime: str,
           group_size: int | None = None) -> dict[str, np.ndarray] | None:
    """An MLX affine triple as the grouped `scheme`'s parts, its codes, scales and offsets kept as they are
    (docs/format.md §4.5): a lossless repack, when its bits and group size are the scheme's (and `group_size`,
    where a plan chose one) and its scales are in the runtime dtype. None when any of that differs: the tensor is
    then quantized from its dequantized values."""
    kind = SCHEMES[scheme]
    if (
        triple is None
        or triple.mode != "affine"
        or triple.bits != kind.bits
        or triple.group_size not in kind.group_sizes
        or group_size not in (None, triple.group_size)
        or triple.scales.dtype != MX_DTYPES[runtime]
    ):
        return None
    codes = quant.from_mlx_words(scheme, np.asarray(triple.weight))
    scales, biases = (np.ascontiguousarray(to_numpy(p)[0]).reshape(codes.shape[0], -1)
                      for p in (triple.scales, triple.biases))
    return dict(zip(kind.suffixes, (codes, scales, biases)))


def error_stats(original: np.ndarray, src_dtype: str, parts: dict, entry: TensorEntry) -> ErrorStats:
    """Relative error and cosine similarity of the dequantized tensor on evenly sampled rows."""
    rows, cols = rows_cols(entry.shape)
    pick = np.unique(np.linspace(0, rows - 1, min(rows, _SAMPLE_ROWS)).astype(np.int64))
    sampled = [np.ascontiguousarray(parts[suffix][pick]) for suffix in entry.kind.suffixes]
    approx = quant.dequantize(entry.scheme, *sampled, group_size=entry.group_size, scale_dtype=entry.scale_dtype,
                              out_dtype="float32")
    exact = as_float32(np.ascontiguousarray(original.reshape(rows, cols)[pick]), src_dtype).astype(np.float64).ravel()
    approx = approx.astype(np.float64).ravel()
    # Sums of products with einsum, not np.linalg.norm / np.dot, whose multithreaded BLAS spins on a busy machine
    # (docs/design.md §6.2). Same float64 sums.
    diff = exact - approx
    norm = math.sqrt(np.einsum("i,i->", exact, exact))
    rel = float(math.sqrt(np.einsum("i,i->", diff, diff)) / norm) if norm > 0 else 0.0
    denom = norm * math.sqrt(np.einsum("i,i->", approx, approx))
    cosine = float(np.einsum("i,i->", exact, approx) / denom) if denom > 0 else 1.0
    return ErrorStats(round(rel, 6), round(cosine, 6), int(len(pick)))


def as_float32(a: np.ndarray, name: str) -> np.ndarray:
    if name == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _write_store(provider: WeightProvider, tmp: Path, out: Path, opts: CompressOptions, key: str,
                 origin: WeightProvider):
    """Quantize every tensor of the source `provider` reads into the npy-dir at `tmp` (compress's directory for
    `out`), one block after another (calibrating each first when the options ask for it), going on from the last
    finished block of a killed run of the same `key` (resume.key_digest) into `tmp`; returns its writer, the
    manifest written, and the calibration plan (None without calibration). `origin`: the source the user named
    (`provider` reads its rotated copy with `rotate`), which the manifest records."""
    from .model import new_model, parameter_shapes  # imports mlx_lm

    runtime = opts.dtype or runtime_dtype(provider)
    infos = provider.reader.tensors()
    writer = resume.open_writer(tmp, runtime, out, key)
    side_files = provider.write_side_files(tmp)  # first: what a load would refuse in them costs no tensor work
    tokenizer_files = _tokenizer_files(tmp)
    try:
        model = new_model(provider.dense_config(), provider.reader.path)
        provider.expect_shapes(parameter_shapes(model))  # nor is a tensor written that no load would bind
        kinds = weight_kinds(provider, model)  # the model decides what is quantized
        calibrator = _calibrator(provider, opts, tmp, origin)
        plan = calibrator.plan if calibrator is not None else None
        units = calibrator.units() if calibrator is not None else resume.block_units(provider.names())
        start = 0
        found = resume.latest(writer, [names for _, names in units]) if writer.tensors else None
        if found is not None and calibrator is not None:
            try:
                calibrator.restore(found[1], found[2], resume.state_path(tmp, found[0]))
            except FormatError as e:  # checked before any of it is taken: the calibrator is as new
                print(f"compress: not going on from a killed run: {e}; starting over", file=sys.stderr)
                found = None
        if found is not None:
            start = found[0]
            print(f"compress: going on from {units[start - 1][0]} of a killed run ({tmp})", file=sys.stderr)
        elif writer.tensors:  # nothing to go on from: start over
            tokenizer_files.result()
            remove_inside(tmp, out.parent)
            writer = resume.open_writer(tmp, runtime, out, key)
            side_files = provider.write_side_files(tmp)
            tokenizer_files = _tokenizer_files(tmp)
        done_bytes = sum(infos[provider.source_name(n)].nbytes
                         for n in writer.tensors if provider.source_name(n) in infos)
        with tqdm(total=sum(t.nbytes for t in infos.values()), initial=done_bytes, unit="B", unit_scale=True,
                  desc="compress", disable=None, file=sys.stderr) as bar:
            pipeline = _Pipeline(bar)
            try:
                for k in range(start, len(units)):
                    what, names = units[k]
                    bar.set_postfix_str(what, refresh=False)
                    if calibrator is not None:
                        calibrator.prepare(k)
                    for name in names:
                        info = infos.get(provider.source_name(name))
                        entry, array, src_dtype, parts, checked = _quantize_tensor(provider, name, info, opts, runtime,
                                                                                   plan, kinds.get(name))
                        nbytes = info.nbytes if info else array.nbytes
                        pipeline.submit(nbytes, _finish_tensor, writer, name, entry, array, src_dtype, parts, checked)
                    pipeline.drain()
                    if calibrator is not None:
                        calibrator.done(k)
                    saved = resume.save(tmp, k + 1, *(calibrator.state() if calibrator is not None else ({}, {})))
                    fault_point(f"compress-unit:{k}")
                    writer.checkpoint(saved)
                    resume.forget_before(tmp, k + 1)
            finally:
                pipeline.close()
        if calibrator is not None:
            opts.extra_manifest = {**calibrator.manifest(), **opts.extra_manifest}
        _finish_store(origin, writer, opts, side_files, tokenizer_files)
        return writer, plan
    except BaseException:
        wait([tokenizer_files])  # its thread writes into tmp, which the caller removes once this returns
        raise


def _calibrator(provider: WeightProvider, opts: CompressOptions, side_files: Path, origin: WeightProvider):
    """The block-by-block calibration when the options ask for one (AWQ, GPTQ, mixed precision, the INT3 gate),
    else None; it runs the source model, so it is imported only then."""
    if not opts.calibrates:
        return None
    from .calibration import Calibrator

    return Calibrator(provider, opts, side_files, origin=Path(origin.reader.path))


class _Pipeline:
    """A pipeline of two: while the main thread reads and quantizes tensor i+1 (the Rust kernels use every core),
    a worker measures tensor i's error and writes its files (NumPy, hashing and the writes release the GIL). At
    most one tensor waits behind the one being finished, so memory stays bounded; one worker finishes them in
    order, so the manifest lists them in the source's order."""

    def __init__(self, bar: tqdm):
        self._bar = bar
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="squishlike-store")
        self._pending: deque = deque()

    def submit(self, nbytes: int, finish, *args) -> None:
        while len(self._pending) >= 2:
            self._finish_oldest()
        self._pending.append((self._pool.submit(finish, *args), nbytes))

    def drain(self) -> None:
        while self._pending:
            self._finish_oldest()

    def close(self) -> None:
        for future, _ in self._pending:
            future.cancel()
        self._pool.shutdown(wait=True)

    def _finish_oldest(self) -> None:
        future, nbytes = self._pending.popleft()
        future.result()
        self._bar.update(nbytes)


def _quantize_tensor(provider: WeightProvider, name: str, info, opts: CompressOptions, runtime: str, plan,
                     kind: str | None):
    """(manifest entry, values, their dtype, quantized parts or None, whether the outlier check is done) of one
    tensor, by the scheme rules (`kind`: its weight_kinds entry). A source triple the scheme can hold as it is is
    repacked (`repack`), never rounded a second time; a tensor the store the plan came from holds as this compress
    writes it (`Plan.unchanged`) is copied from there."""
    if plan is not None and (unchanged := plan.unchanged_parts(name)) is not None:
        return _unchanged_tensor(provider, name, info, opts, plan, kind, *unchanged)
    triple = provider.get_quantized(name)
    array, src_dtype = to_numpy(provider.get(name) if triple is None else triple.dequantize())
    array = np.asarray(array, order="C")  # not ascontiguousarray, which makes a 0-d array 1-d
    scheme, reason = choose_scheme(name, array.shape, opts, kind)
    if plan is not None:  # calibration: AWQ-rewritten values (float32), mixed-precision scheme
        if plan.rewrites(name):
            triple = None
        scheme, reason = plan.scheme(name, scheme, reason)
        array, src_dtype = plan.apply(name, array, src_dtype, scheme)
    dtype = info.dtype if info else src_dtype
    entry = TensorEntry(encode_key(name), provider.source_name(name), array.shape, dtype, scheme, reason)
    if not entry.kind.quantized:
        return entry, array, src_dtype, None, False
    planned = plan is not None and plan.sized(name)  # a size target chose its width and group size: they stay
    group_size = plan.group_size(name, opts.group_for(name)) if planned else opts.group_for(name)
    parts = repack(triple, scheme, runtime, group_size if planned else None)
    if parts is not None:
        entry.group_size, entry.scale_dtype = triple.group_size, runtime
        entry.reason += f"; the source's own {triple.bits}-bit values, repacked without rounding"
        return entry, array, src_dtype, parts, False
    if entry.kind.grouped:  # per-row INT8 scales are always float32, one per row
        entry.group_size, entry.scale_dtype = group_size, runtime
    # A size target's width stays, outlier or not: the plan chose it knowing its loss, and the bytes of an exact
    # tensor would break the target
    parts = None
    if not (planned and plan.compensates(name, scheme)):  # the plain rounding, unless GPTQ replaces it unchecked
        try:
            parts = _quantize(array, src_dtype, scheme, opts, entry.group_size or 0, runtime)
        except ValueError as e:
            raise QuantizationError(f"{provider.reader.path}: {name}: {e}") from None
    if plan is None or (not planned and error_stats(array, src_dtype, parts, entry).rel_error > ERROR_LIMITS[scheme]):
        return entry, array, src_dtype, parts, False
    # GPTQ trades error in the weights for error in the layer's output: whether a tensor is an outlier is decided
    # on its plain rounding, just above, not on the compensated weights.
    compensated = plan.quantize(name, array, src_dtype, scheme)
    if compensated is None:
        return entry, array, src_dtype, parts, planned
    entry.reason += plan.compensation(name)
    return entry, array, src_dtype, dict(zip(entry.kind.suffixes, compensated)), True


def _unchanged_tensor(provider: WeightProvider, name: str, info, opts: CompressOptions, plan, kind: str | None,
                      earlier: TensorEntry, parts: dict[str, np.ndarray]):
    """`_quantize_tensor`'s answer for a tensor copied from the store the plan came from (`earlier`: its entry
    there; `parts`: its parts): this store's entry, with the error statistics of those very parts."""
    scheme, reason = plan.scheme(name, *choose_scheme(name, earlier.shape, opts, kind))
    entry = TensorEntry(encode_key(name), provider.source_name(name), earlier.shape, info.dtype, scheme,
                        reason + (plan.compensation(name) if plan.compensates(name, scheme) else ""),
                        group_size=earlier.group_size, scale_dtype=earlier.scale_dtype, error=earlier.error)
    return entry, None, None, parts, True


def _finish_tensor(writer: NpyDirWriter, name: str, entry: TensorEntry, array: np.ndarray, src_dtype: str,
                   parts: dict | None, checked: bool) -> TensorEntry:
    """Error statistics and the outlier check (unless `checked` already), then the tensor's files (the writer):
    the manifest entry, complete."""
    scheme = entry.scheme
    if entry.kind.quantized and entry.error is None:  # (a copied tensor's are known)
        entry.error = error_stats(array, src_dtype, parts, entry)
        if not checked and entry.error.rel_error > ERROR_LIMITS[scheme]:
            entry.scheme = "passthrough"
            entry.reason = f"outliers: relative error {entry.error.rel_error:.3f} > {ERROR_LIMITS[scheme]} for {scheme}"
            entry.group_size = entry.scale_dtype = None
    return writer.add_tensor(name, entry, parts if entry.kind.quantized else None, array, src_dtype)


def _tokenizer_files(directory: Path) -> Future:
    """tokenizer.json compacted and the tokenizer's facts written, on a thread beside the tensors' work (mostly
    Python holding the GIL, where the tensors' is Rust and NumPy releasing it: 2.7 s of a SmolLM2 compress's 6.5);
    the future of the files it wrote."""
    from . import tokenizer  # mlx_lm and transformers (imported already, on this thread: MLX streams are per thread)

    def work() -> list[Path]:
        # For loads with load()'s default arguments: trust_remote_code off, and the eos ids a load passes, those of
        # config.json with generation_config.json's over them (config.load_config, as mlx_lm.load reads them).
        eos_token_ids = load_config(directory).get("eos_token_id")
        tokenizer.compact(directory)  # before the facts, whose key hashes the file as the store holds it
        return tokenizer.write_facts(directory, {"trust_remote_code": False}, eos_token_ids)

    pool = ThreadPoolExecutor(1, thread_name_prefix="squishlike-tokenizer")
    future = pool.submit(work)
    pool.shutdown(wait=False)  # the thread ends with its one task
    return future


def _finish_store(provider: WeightProvider, writer: NpyDirWriter, opts: CompressOptions, written: list[Path],
                  tokenizer_files: Future) -> None:
    """The side files' records and the manifest: the store complete; `provider` reads the source it records."""
    writer.add_side_files(written + tokenizer_files.result())
    tiers = opts.tiers if opts.tiers is not None else default_tiers(opts, {e.scheme for e in writer.tensors.values()})
    source = Path(provider.reader.path)
    writer.write_manifest(
        model_type=provider.config.model_type,
        naming=provider.arch.canonical_names,
        scheme=opts.stored_scheme,
        group_size=opts.groups,
        clip_search=opts.clip_search,
        source=Source(str(source.absolute()), provider.format, source_fingerprint(source)),
        policy=Policy(tuple(tiers), "order" if opts.tiers is None else "all"),  # tiers named: the user wants each
        extra=opts.extra_manifest,
    )

