"""`squishlike compress`: any model the provider reads -> an npy-dir (SPEC §2-3).

Streams tensor by tensor (peak memory ~ the largest tensor a few times over, never the whole model), writes into
a temp directory beside OUT, and publishes it with one rename at the end, so a failed or interrupted run leaves
nothing that looks like a model. Two runs aimed at one OUT: the second fails at once with DirectoryBusyError.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from . import quant
from .dtypes import MX_DTYPES, NP_STORAGE, to_mx, to_numpy
from .errors import OutputExistsError, QuantizationError
from .formats.npydir import FORMAT, FORMAT_VERSION, MANIFEST, SCHEMES, TENSORS, NpyDir, encode_key, rows_cols
from .hub import resolve_local
from .provider import WeightProvider
from .storage import (
    exclusive,
    file_record,
    make_temp_dir,
    publish_dir,
    read_json,
    remove_stale_temps,
    write_json,
    write_npy_stream,
)

FORMATS = ("int8", "int4", "int3")
GROUP_SIZES = {"int8": (32, 64, 128), "int4": (32, 64, 128), "int3": (32, 64)}
ALL_TIERS = ("mlx", "finalized", "int4", "int3")

# A tensor whose sampled relative error exceeds its scheme's limit is an outlier: kept exact (SPEC §2).
ERROR_LIMITS = {"int8": 0.05, "int4": 0.25, "int3": 0.45}
_SAMPLE_ROWS = 256  # rows sampled per tensor for the error statistics: cheap, and stable to a few percent


@dataclass
class CompressOptions:
    format: str = "int8"
    group_size: int = 64
    passthrough: tuple[str, ...] = ()  # fnmatch patterns of canonical names kept exact
    quantize_embeddings: bool = False
    clip_search: bool = False
    dtype: str | None = None  # runtime dtype; default: the source's float dtype, bfloat16 for quantized sources
    tiers: tuple[str, ...] | None = None  # cache policy; default: mlx + the store's quantized tier
    force: bool = False
    extra_manifest: dict = field(default_factory=dict)
    # Calibration (squishlike/calibrate.py; each runs the source model in float32 on data/calibration.txt):
    awq: bool = False  # activation-aware per-input-channel scaling, folded into norms / v / up
    mixed_precision: float = 0.0  # keep the most sensitive tensors at INT8 (INT4/INT3) or exact (INT8) within this
    # extra-size fraction of the quantized tensors' bytes
    int3_gate: bool = True  # INT3: measure the accuracy gate at compress time (SPEC §3)
    int3_max_ppl_increase: float = 0.08  # INT3: the gate's bound on the calibration-perplexity increase
    calibration_samples: int = 512  # input rows per linear kept for the AWQ error search
    calibration_max_tokens: int | None = None  # use only the first N calibration tokens (None: all)

    def validate(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown format {self.format!r}; choose one of {', '.join(FORMATS)}")
        if self.group_size not in GROUP_SIZES[self.format]:
            raise ValueError(
                f"group size {self.group_size} is not valid for {self.format}; "
                f"choose one of {', '.join(map(str, GROUP_SIZES[self.format]))}"
            )
        if self.dtype is not None and self.dtype not in NP_STORAGE:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(NP_STORAGE)}")
        if not 0 <= self.mixed_precision <= 1 or self.calibration_samples < 1:
            raise ValueError("mixed_precision must be in [0, 1] and calibration_samples at least 1")
        unknown = set(self.tiers or ()) - set(ALL_TIERS)
        if unknown:
            raise ValueError(f"unknown tier(s) {', '.join(sorted(unknown))}; choose from {', '.join(ALL_TIERS)}")


def compress(src: str | Path, out: str | Path, **options) -> Path:
    """Compress `src` (HF dir, MLX dir, GGUF file, Ollama model, cached HF repo id) into the npy-dir `out`."""
    opts = CompressOptions(**options)
    opts.validate()
    out = Path(out).expanduser().absolute()
    _check_output(out, opts.force)
    source = resolve_local(src) or src
    started = time.perf_counter()
    with WeightProvider.open(source) as provider:
        out.parent.mkdir(parents=True, exist_ok=True)
        with exclusive(out.parent, f"compressing into {out.name}", name=f".{out.name}.squishlike-lock"):
            _check_output(out, opts.force)  # it may have appeared while we waited
            remove_stale_temps(out.parent, out.name)  # what a killed run into OUT left (we hold its lock)
            tmp = make_temp_dir(out)
            try:
                from . import calibrate

                plan = calibrate.prepare(provider, opts, choose_scheme)  # None unless AWQ, mixed or INT3 ask
                if plan is not None:
                    opts.extra_manifest = {**plan.manifest(), **opts.extra_manifest}
                summary = _write_store(provider, tmp, opts, plan)
                if opts.format == "int3":
                    calibrate.write_int3_gate(provider, tmp, opts, plan)  # re-writes the manifest, atomically
                publish_dir(tmp, out)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    elapsed = time.perf_counter() - started
    before, after = summary["source_bytes"], summary["store_bytes"]
    print(
        f"compressed {src} -> {out}: {summary['tensors']} tensors ({summary['quantized']} quantized), "
        f"{before / 1e6:.1f} MB -> {after / 1e6:.1f} MB ({before / max(after, 1):.2f}x) in {elapsed:.1f} s",
        file=sys.stderr,
    )
    return out


def _check_output(out: Path, force: bool) -> None:
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not force:
        raise OutputExistsError(f"{out}: exists and is not empty; pass --force to replace it")
    if not NpyDir.is_npydir(out):
        # --force replaces only what squishlike made; it never deletes a stranger's files.
        raise OutputExistsError(f"{out}: exists and is not a squishlike npy-dir; refusing to replace it")


def runtime_dtype(provider: WeightProvider) -> str:
    """The dtype the model runs in: the source's own float dtype, or bfloat16 when the source is quantized."""
    infos = provider.reader.tensors()
    largest = max(infos.values(), key=lambda t: t.nbytes)
    return largest.dtype if largest.dtype in NP_STORAGE else "bfloat16"


def choose_scheme(name: str, shape: tuple[int, ...], opts: CompressOptions) -> tuple[str, str]:
    """(scheme, reason) for one tensor, by rule. The reason is recorded in the manifest."""
    if any(fnmatch.fnmatchcase(name, p) for p in opts.passthrough):
        return "passthrough", "matches --passthrough"
    if len(shape) < 2 or not name.endswith(".weight"):
        return "passthrough", "1-D tensor (norm or bias)"
    if not opts.quantize_embeddings and name.split(".")[0] in ("token_embedding", "output", "position_embedding"):
        return "passthrough", "embedding / lm_head (pass --quantize-embeddings to quantize)"
    cols = shape[-1]
    need = 32 if opts.format == "int3" else opts.group_size
    if cols % opts.group_size or cols % need:
        return "passthrough", f"{cols} columns do not split into groups of {opts.group_size}"
    return opts.format, "linear weight"


def _quantize(array: np.ndarray, src_dtype: str, scheme: str, opts: CompressOptions, scale_dtype: str) -> dict:
    rows, cols = rows_cols(array.shape)
    w = array.reshape(rows, cols)
    if scheme == "int8":
        parts = quant.quantize_int8(w, src_dtype=src_dtype)
    else:
        fn = quant.quantize_int4 if scheme == "int4" else quant.quantize_int3
        parts = fn(w, src_dtype=src_dtype, group_size=opts.group_size, scale_dtype=scale_dtype, clip_search=opts.clip_search)
    return {p.suffix: a for p, a in zip(SCHEMES[scheme], parts)}


def error_stats(original: np.ndarray, src_dtype: str, parts: dict, entry: dict, runtime: str) -> dict:
    """Relative error and cosine similarity of the dequantized tensor on evenly sampled rows."""
    rows, cols = rows_cols(entry["shape"])
    pick = np.unique(np.linspace(0, rows - 1, min(rows, _SAMPLE_ROWS)).astype(np.int64))
    sampled = {k: np.ascontiguousarray(v[pick]) for k, v in parts.items()}
    if entry["scheme"] == "int8":
        approx = quant.dequantize_int8(sampled["q"], sampled["s"], out_dtype="float32")
    else:
        fn = quant.dequantize_int4 if entry["scheme"] == "int4" else quant.dequantize_int3
        q, s, z = (sampled[p.suffix] for p in SCHEMES[entry["scheme"]])
        approx = fn(q, s, z, group_size=entry["group_size"], scale_dtype=runtime, out_dtype="float32")
    exact = as_float32(np.ascontiguousarray(original.reshape(rows, cols)[pick]), src_dtype).astype(np.float64).ravel()
    approx = approx.astype(np.float64).ravel()
    # Sums of products with einsum, not np.linalg.norm / np.dot: those call a multithreaded BLAS that, on a busy
    # 2-core machine, spins for milliseconds per call (25-50x slower here). Same float64 sums, rounded as before.
    diff = exact - approx
    norm = math.sqrt(np.einsum("i,i->", exact, exact))
    rel = float(math.sqrt(np.einsum("i,i->", diff, diff)) / norm) if norm > 0 else 0.0
    denom = norm * math.sqrt(np.einsum("i,i->", approx, approx))
    cosine = float(np.einsum("i,i->", exact, approx) / denom) if denom > 0 else 1.0
    return {"rel_error": round(rel, 6), "cosine": round(cosine, 6), "sampled_rows": int(len(pick))}


def as_float32(a: np.ndarray, name: str) -> np.ndarray:
    if name == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _write_store(provider: WeightProvider, tmp: Path, opts: CompressOptions, plan=None) -> dict:
    runtime = opts.dtype or runtime_dtype(provider)
    infos = provider.reader.tensors()
    names = provider.names()
    (tmp / TENSORS).mkdir()
    entries: dict[str, dict] = {}
    source_bytes = sum(t.nbytes for t in infos.values())
    bar = tqdm(total=source_bytes, unit="B", unit_scale=True, desc="compress", disable=None, file=sys.stderr)
    # A pipeline of two: while the main thread reads and quantizes tensor i+1 (the Rust kernels use every core),
    # a worker measures tensor i's error and writes its files (NumPy, hashing and the writes release the GIL).
    pool = ThreadPoolExecutor(1, thread_name_prefix="squishlike-store")
    pending: deque = deque()

    def finish_oldest() -> None:
        done_name, future, nbytes = pending.popleft()
        entries[done_name] = future.result()
        bar.update(nbytes)

    try:
        _quantize_all(provider, names, infos, tmp, opts, runtime, plan, pool, pending, finish_oldest)
        while pending:
            finish_oldest()
    finally:
        for _, future, _ in pending:
            future.cancel()
        pool.shutdown(wait=True)
    bar.close()

    return _finish_store(provider, tmp, opts, runtime, entries, source_bytes)


def _quantize_all(provider, names, infos, tmp, opts, runtime, plan, pool, pending, finish_oldest) -> None:
    for name in names:
        source_name = provider.source_name(name)
        info = infos.get(source_name)
        array, src_dtype = to_numpy(provider.get(name))
        array = np.ascontiguousarray(array)
        scheme, reason = choose_scheme(name, array.shape, opts)
        if plan is not None:  # calibration: AWQ-rewritten values (float32), mixed-precision scheme
            array, src_dtype = plan.apply(name, array, src_dtype)
            scheme, reason = plan.scheme(name, scheme, reason)
        entry = {
            "key": encode_key(name),
            "source_name": source_name,
            "shape": list(array.shape),
            "dtype": info.dtype if info else src_dtype,
            "scheme": scheme,
            "reason": reason,
        }
        if scheme != "passthrough":
            if scheme != "int8":  # INT8 scales are always float32, one per row
                entry.update(group_size=opts.group_size, scale_dtype=runtime)
            try:
                parts = _quantize(array, src_dtype, scheme, opts, runtime)
            except ValueError as e:
                raise QuantizationError(f"{provider.reader.path}: {name}: {e}") from None
        else:
            parts = None
        while len(pending) >= 2:  # at most one tensor waiting behind the one being finished: bounded memory
            finish_oldest()
        future = pool.submit(_finish_tensor, tmp, entry, array, src_dtype, parts, runtime)
        pending.append((name, future, info.nbytes if info else array.nbytes))


def _finish_tensor(tmp: Path, entry: dict, array: np.ndarray, src_dtype: str, parts: dict | None,
                   runtime: str) -> dict:
    """Error statistics, the outlier check, and the tensor's files: the manifest entry, complete."""
    scheme = entry["scheme"]
    if scheme != "passthrough":
        entry["error"] = error_stats(array, src_dtype, parts, entry, runtime)
        if entry["error"]["rel_error"] > ERROR_LIMITS[scheme]:
            entry.update(scheme="passthrough", reason=f"outliers: relative error {entry['error']['rel_error']:.3f} "
                         f"> {ERROR_LIMITS[scheme]} for {scheme}")
            for k in ("group_size", "scale_dtype"):
                entry.pop(k, None)
    if entry["scheme"] == "passthrough":
        if entry["dtype"] not in NP_STORAGE and src_dtype != runtime:
            # Dequantized from a quantized source (a GGUF Q8_0 embedding): its float32 values hold no more than the
            # runtime dtype it is cast to at load, so store that (the same mx rounding, half the bytes at rest).
            array, src_dtype = to_numpy(to_mx(array, src_dtype).astype(MX_DTYPES[runtime]))
        parts = {"pt": array}
        entry["stored_dtype"] = src_dtype
    # Inside the temp directory that publish_dir fsyncs and renames as a whole: no per-file temp name and fsync.
    entry["files"] = {
        suffix: write_npy_stream(tmp / TENSORS / f"{entry['key']}__{suffix}.npy", part, atomic=False)
        for suffix, part in parts.items()
    }
    return entry


def _finish_store(provider, tmp: Path, opts, runtime: str, entries: dict, source_bytes: int) -> dict:
    from . import tokenizer  # mlx_lm and transformers: imported only once a store is written

    written = provider.write_side_files(tmp)
    # For loads with load()'s default arguments: trust_remote_code off, the eos ids of config.json.
    eos_token_ids = read_json(tmp / "config.json").get("eos_token_id")
    written += tokenizer.write_facts(tmp, {"trust_remote_code": False}, eos_token_ids)
    side_files = {p.name: file_record(p) for p in written}
    schemes = {e["scheme"] for e in entries.values()}
    tiers = opts.tiers if opts.tiers is not None else ("mlx", *[s for s in ("int4", "int3") if s in schemes])
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_type": provider.config.model_type,
        "runtime_dtype": runtime,
        "scheme": opts.format,
        "group_size": opts.group_size,
        "clip_search": opts.clip_search,
        "source": {
            "path": str(Path(provider.reader.path).absolute()),
            "format": provider.format,
            "fingerprint": source_fingerprint(Path(provider.reader.path)),
        },
        "policy": {"tiers": list(tiers)},
        "side_files": side_files,
        "tensors": entries,
        **opts.extra_manifest,
    }
    write_json(tmp / MANIFEST, manifest)
    return {
        "tensors": len(entries),
        "quantized": sum(e["scheme"] != "passthrough" for e in entries.values()),
        "source_bytes": source_bytes,
        "store_bytes": sum(r["size"] for e in entries.values() for r in e["files"].values()),
    }


def source_fingerprint(path: Path) -> str:
    """Names, sizes and mtimes of the source's files: cheap, and changes whenever the source does."""
    files = sorted(p for p in ([path] if path.is_file() else path.iterdir()) if p.is_file())
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()
