"""`squishlike compress`: any model the provider reads -> an npy-dir (SPEC §2-3).

Streams tensor by tensor (peak memory ~ the largest tensor a few times over, never the whole model), writes into
a temp directory beside OUT, and publishes it with one rename at the end, so a failed or interrupted run leaves
nothing that looks like a model. Two runs aimed at one OUT: the second fails at once with DirectoryBusyError.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from . import quant
from .compress_options import CompressOptions, choose_scheme, runtime_dtype
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
    remove_stale_temps,
    write_json,
    write_npy_stream,
)

# A tensor whose sampled relative error exceeds its scheme's limit is an outlier: kept exact (SPEC §2).
ERROR_LIMITS = {"int8": 0.05, "int4": 0.25, "int3": 0.45}
_SAMPLE_ROWS = 256  # rows sampled per tensor for the error statistics: cheap, and stable to a few percent


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
                plan = _calibration_plan(provider, opts)
                if plan is not None:
                    opts.extra_manifest = {**plan.manifest(), **opts.extra_manifest}
                summary = _write_store(provider, tmp, opts, plan)
                if opts.format == "int3":
                    from .calibration import write_int3_gate

                    write_int3_gate(provider, tmp, opts, plan)  # re-writes the manifest, atomically
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


def _calibration_plan(provider: WeightProvider, opts: CompressOptions):
    """The calibration plan when the options ask for one (AWQ, mixed precision, the INT3 gate), else None;
    calibration runs the source model, so it is imported only then."""
    if not (opts.awq or opts.mixed_precision > 0 or (opts.format == "int3" and opts.int3_gate)):
        return None
    from .calibration import prepare

    return prepare(provider, opts)


def _check_output(out: Path, force: bool) -> None:
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not force:
        raise OutputExistsError(f"{out}: exists and is not empty; pass --force to replace it")
    if not NpyDir.is_npydir(out):
        # --force replaces only what squishlike made; it never deletes a stranger's files.
        raise OutputExistsError(f"{out}: exists and is not a squishlike npy-dir; refusing to replace it")


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
    side_files = {p.name: file_record(p) for p in provider.write_side_files(tmp)}
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
