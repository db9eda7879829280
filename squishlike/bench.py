"""Load-time benchmarks, every figure a whole fresh process (`squishlike bench`, benchmarks/bench_load.py).

A timed load is a child process (`python -m squishlike.bench --child load ...`): interpreter start, imports, the
load with the weights evaluated (eager, as mlx_lm.load with lazy=False) and the tokenizer ready. The parent
takes the time from spawn to the moment the child reports it is ready (CLOCK_MONOTONIC is shared by all
processes); the child reports its own phases and memory. A first forward pass is timed separately, after the
ready mark, as proof that the weights work. Timing inside one warm process would hide the imports and reuse
memory, which is not what a user who starts a model sees.

One run measures, alternating the configurations round by round (A B C ... A B C ...):
- warm loads (the files' pages cached): mlx_lm.load of the source directory and each squishlike tier;
- cold loads: the files' pages evicted with posix_fadvise(DONTNEED), checked gone with mincore, before each run;
- the first load of a fresh npy-dir (the cold path dequantizes the store and builds the caches of its policy);
- the floors, in the same run: the memory floor (a fresh process reading the same bytes into fresh memory, the
  fastest way we know: huge pages, one thread per core), the disk floor (sequential read bandwidth from
  evicted pages) and the startup floor (interpreter, import mlx_lm and transformers, the tokenizer: what any
  drop-in for mlx_lm.load does besides the weights, so its ratio to mlx_lm.load bounds every speedup);
- compress time and throughput (MB/s of bf16 source) with its peak memory.
Per figure: median, min, max of the runs, the peak RSS above the startup floor's (compress: above the child's
own after its imports), the bytes on disk.

Fresh memory on the VMs this project runs on is slow and its speed depends on history (SPEC §7; the VM hands free
2 MiB blocks back to the host about 2 s after they are freed, and touching them again costs a host fault per
4 KiB). Runs follow each other back to back, so every configuration starts right after another process freed a
similar amount of memory. `--prime` makes that explicit: before each timed run the parent touches and frees as
much memory as the run needs, so every child starts with recently used memory.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import mmap
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

LOADERS = ("squishlike", "mlx_lm")
PROMPT = "The capital of France is"
GB = 1e9


# =============================================================================================== child side


def _rss_now() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _peak_rss_bytes() -> int:
    """This process's peak RSS. On Linux VmHWM of /proc/self/status: ru_maxrss of an exec'd child also counts
    its parent's peak (the kernel carries the old address space's high-water mark across exec)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def _timed(module, name: str, into: dict, key: str, keep=None) -> None:
    """Wrap module.name so its duration (summed) lands in into[key]; `keep(result)` may record more."""
    original = getattr(module, name, None)
    if original is None:
        return

    def wrapper(*a, **k):
        t = time.monotonic()
        result = original(*a, **k)
        into[key] = into.get(key, 0.0) + time.monotonic() - t
        if keep is not None:
            keep(result)
        return result

    setattr(module, name, wrapper)


def _child_load(loader: str, path: str, tier: str | None, forward: bool) -> dict:
    """In the fresh process: import, load eagerly, tokenizer ready; then, apart, one forward pass."""
    t0 = time.monotonic()
    rss_start = _rss_now()
    phases: dict = {}
    import mlx.core as mx

    if loader == "mlx_lm":
        import mlx_lm.utils as utils
        from mlx_lm import load

        _timed(utils, "load_model", phases, "weights_s")
        _timed(utils, "load_tokenizer", phases, "tokenizer_s")
    else:
        import squishlike.loader as loader_module
        from squishlike import load

        _timed(loader_module, "load_weights", phases, "weights_s", keep=lambda r: phases.__setitem__("tier", r.tier))
        _timed(loader_module, "_model", phases, "model_s")
        _timed(loader_module, "_tokenizer", phases, "tokenizer_s")
    t_import = time.monotonic()
    rss_import = _rss_now()
    model, tokenizer = load(path) if loader == "mlx_lm" else load(path, tier=tier)
    t_ready = time.monotonic()
    if loader != "mlx_lm":
        with contextlib.suppress(ImportError, AttributeError):
            from squishlike.tiers import fastmem

            if fastmem.last_populate:
                phases["populate"] = dict(fastmem.last_populate)
    report = {"ready_at": t_ready, "import_s": t_import - t0, "load_s": t_ready - t_import, **phases,
              "rss_start": rss_start, "rss_after_import": rss_import, "rss_peak": _peak_rss_bytes()}
    if forward:
        tokens = tokenizer.encode(PROMPT)
        logits = model(mx.array([tokens]))[0, -1].astype(mx.float32)
        mx.eval(logits)
        report["forward_s"] = time.monotonic() - t_ready
        report["forward"] = {"tokens": len(tokens), "finite": bool(mx.isfinite(logits).all().item()),
                             "argmax": int(mx.argmax(logits).item()),
                             "logit_norm": float(mx.sqrt(mx.sum(logits * logits)).item())}
    return report


def _read_into(paths: list[str], buffer, threads: int, chunk: int = 64 << 20) -> int:
    """Read the files back to back into `buffer` (None: into small reused buffers), `threads` at a time."""
    jobs, offset = [], 0
    for p in paths:
        size = os.path.getsize(p)
        jobs += [(p, o, min(chunk, size - o), offset + o) for o in range(0, size, chunk)]
        offset += size
    errors: list = []

    def work(i: int) -> None:
        fds: dict = {}
        scratch = None if buffer is not None else memoryview(mmap.mmap(-1, chunk))
        view = memoryview(buffer) if buffer is not None else None
        try:
            for p, o, n, at in jobs[i::threads]:
                fd = fds.get(p)
                if fd is None:
                    fd = fds[p] = os.open(p, os.O_RDONLY)
                dest = view[at:at + n] if view is not None else scratch[:n]
                done = 0
                while done < n:
                    got = os.preadv(fd, [dest[done:]], o + done)
                    if got == 0:
                        raise OSError(f"{p}: short read")
                    done += got
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            for fd in fds.values():
                os.close(fd)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return offset


def _child_startup(path: str) -> dict:
    """The startup floor: what every drop-in for mlx_lm.load does besides reading weights (interpreter, import
    mlx_lm and with it transformers, the tokenizer), so no load can be faster than this process."""
    t0 = time.monotonic()
    rss_start = _rss_now()
    import mlx_lm.utils as utils

    t_import = time.monotonic()
    rss_import = _rss_now()
    utils.load_tokenizer(Path(path), {})
    t_ready = time.monotonic()
    return {"ready_at": t_ready, "import_s": t_import - t0, "tokenizer_s": t_ready - t_import,
            "rss_start": rss_start, "rss_after_import": rss_import, "rss_peak": _peak_rss_bytes()}


def _child_floor(paths: list[str], threads: int, pages: str) -> dict:
    """The memory floor: the files' bytes read into one fresh mapping (huge pages or 4 KiB), `threads` readers."""
    t0 = time.monotonic()
    total = sum(os.path.getsize(p) for p in paths)
    buffer = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):
        buffer.madvise(mmap.MADV_HUGEPAGE if pages == "huge" else mmap.MADV_NOHUGEPAGE)
    t = time.monotonic()
    _read_into(paths, buffer, threads)
    t_ready = time.monotonic()
    return {"ready_at": t_ready, "read_s": t_ready - t, "startup_s": t - t0, "bytes": total,
            "rss_start": 0, "rss_after_import": 0, "rss_peak": _peak_rss_bytes()}


def _child_disk(paths: list[str], threads: int) -> dict:
    """The disk floor: evicted files read sequentially into small reused buffers (bandwidth, not memory)."""
    t = time.monotonic()
    total = _read_into(paths, None, threads, chunk=16 << 20)
    t_ready = time.monotonic()
    return {"ready_at": t_ready, "read_s": t_ready - t, "bytes": total, "rss_peak": _peak_rss_bytes()}


def _child_compress(src: str, out: str, fmt: str, clip: bool) -> dict:
    t0 = time.monotonic()
    rss_start = _rss_now()
    import squishlike

    t_import = time.monotonic()
    rss_import = _rss_now()
    squishlike.compress(src, out, format=fmt, clip_search=clip, force=True)
    t_ready = time.monotonic()
    return {"ready_at": t_ready, "import_s": t_import - t0, "compress_s": t_ready - t_import,
            "rss_start": rss_start, "rss_after_import": rss_import, "rss_peak": _peak_rss_bytes()}


def _child_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m squishlike.bench --child")
    p.add_argument("--child", nargs="+", required=True)
    p.add_argument("--tier")
    p.add_argument("--forward", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pages", default="huge")
    p.add_argument("--clip", action="store_true")
    a = p.parse_args(argv)
    kind, rest = a.child[0], a.child[1:]
    if kind in LOADERS:  # the original form: --child LOADER PATH
        report = _child_load(kind, rest[0], a.tier, a.forward)
    elif kind == "load":
        report = _child_load(rest[0], rest[1], a.tier, a.forward)
    elif kind == "startup":
        report = _child_startup(rest[0])
    elif kind == "floor":
        report = _child_floor(rest, a.threads, a.pages)
    elif kind == "disk":
        report = _child_disk(rest, a.threads)
    elif kind == "compress":
        report = _child_compress(rest[0], rest[1], rest[2], a.clip)
    else:
        raise SystemExit(f"unknown child kind {kind!r}")
    print(json.dumps(report))


# =============================================================================================== parent side


def _spawn(args: list[str], env: dict | None = None) -> dict:
    """Run a child; wall_s = spawn -> the child's ready mark, exit_s = spawn -> exit."""
    cmd = [sys.executable, "-m", "squishlike.bench", "--child", *args]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    ended = time.monotonic()
    if done.returncode != 0:
        raise RuntimeError(f"benchmark child {' '.join(args)} failed (rc {done.returncode}):\n{done.stderr[-4000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return {"wall_s": report.pop("ready_at") - started, "exit_s": ended - started, **report}


def measure_load(path: str | Path, *, loader: str = "squishlike", tier: str | None = None,
                 forward: bool = False, env: dict | None = None) -> dict:
    """Load `path` in a fresh process; return wall seconds (spawn to model and tokenizer ready), the child's
    phase timings (import_s, load_s, weights_s, tokenizer_s, forward_s) and memory (rss_start, rss_after_import,
    rss_peak bytes; rss_peak_bytes and rss_base_bytes are the older names of the first and last)."""
    if loader not in LOADERS:
        raise ValueError(f"unknown loader {loader!r}")
    args = ["load", loader, str(path)] + (["--tier", tier] if tier else []) + (["--forward"] if forward else [])
    report = _spawn(args, env)
    report["rss_peak_bytes"], report["rss_base_bytes"] = report["rss_peak"], report["rss_start"]  # older names
    return report


# ---------------------------------------------------------------------------------------------- page cache


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_bytes(paths: list[Path]) -> int:
    """How many bytes of these files are in the page cache (mincore over a read-only mapping)."""
    libc = _libc()
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {p}")
            try:
                vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {p}")
                total += sum(1 for v in bytes(vec) if v & 1) * page
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return total


def evict(paths: list[Path], tries: int = 5) -> int:
    """Drop the files' pages from the page cache; returns the bytes still resident after (0 is the goal)."""
    left = 0
    for _ in range(tries):
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        left = resident_bytes(paths)
        if left == 0:
            break
        time.sleep(0.2)
    return left


def warm(paths: list[Path]) -> None:
    _read_into([str(p) for p in paths], None, 2, chunk=16 << 20)


def prime_memory(nbytes: int) -> None:
    """Touch and free `nbytes` of huge-page memory, so the next process starts with recently used memory."""
    if nbytes <= 0 or not sys.platform.startswith("linux"):
        return
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):
        m.madvise(mmap.MADV_HUGEPAGE)
    import numpy as np

    touch = np.frombuffer(m, np.uint8)
    touch[::4096] = 1
    del touch
    m.close()


# ---------------------------------------------------------------------------------------------- models

QWEN_1_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28,
    "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "max_window_layers": 28, "use_sliding_window": False, "sliding_window": 32768, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _qwen_tensors(c: dict):
    h, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    kv_rows = kv * (h // heads)
    yield "model.embed_tokens.weight", (c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (h,)
        for proj, rows in (("q", h), ("k", kv_rows), ("v", kv_rows)):
            yield p + f"self_attn.{proj}_proj.weight", (rows, h)
            yield p + f"self_attn.{proj}_proj.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, h)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)


def _built(dest: Path) -> bool:
    """Whether a benchmark input was built completely (see _build_into)."""
    return (dest / ".complete").is_file()


@contextlib.contextmanager
def _build_into(dest: Path):
    """Build a benchmark input in a temporary sibling of `dest` (yielded, not created); only when the body finishes
    is it marked complete and renamed to `dest`, so an interrupted build is redone, never half used."""
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    yield tmp
    (tmp / ".complete").write_text("")
    os.replace(tmp, dest)


def build_qwen_like(dest: Path, tokenizer_from: Path | None, config: dict = QWEN_1_5B, seed: int = 0) -> Path:
    """An HF directory with the exact shapes of a Qwen2-class model and random bf16 weights (N(0, 0.02), norms 1).

    Values are drawn once into a 64 MiB pool and each tensor takes a slice at a random offset: load and compress
    times depend on sizes and dtypes, not on the values, and this builds 3 GB in seconds."""
    import numpy as np

    dest = Path(dest)
    if _built(dest):
        return dest
    with _build_into(dest) as tmp:
        tmp.mkdir(parents=True)
        rng = np.random.default_rng(seed)
        bits = (rng.standard_normal(1 << 25, dtype=np.float32) * 0.02).view(np.uint32)
        pool = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even bf16
        tensors = list(_qwen_tensors(config))
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in tensors:
            n = math.prod(shape) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(tmp / "model.safetensors", "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            for name, shape in tensors:
                n = math.prod(shape)
                if len(shape) == 1:
                    f.write((np.full(n, 0x3F80, np.uint16) if "norm" in name else pool[:n]).tobytes())
                    continue
                start = int(rng.integers(0, len(pool)))
                while n:
                    take = min(n, len(pool) - start)
                    f.write(memoryview(pool[start:start + take]))
                    n -= take
                    start = 0
            os.fsync(f.fileno())
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        if tokenizer_from is not None:
            for name in TOKENIZER_FILES:
                if (tokenizer_from / name).is_file():
                    shutil.copy2(tokenizer_from / name, tmp / name)
        else:
            _small_tokenizer(tmp)
    return dest


def _small_tokenizer(dest: Path) -> None:
    """A small byte-level BPE trained on the shipped calibration text, for when SmolLM2 is not installed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = (Path(__file__).parent / "data" / "calibration.txt").read_text()
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(), trainer)
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|im_start|>"}))


def build_smollm_source(dest: Path) -> Path:
    """The embedded SmolLM2-135M (GGUF) as an MLX directory in bfloat16, its release dtype: mlx_lm.load's input."""
    dest = Path(dest)
    if _built(dest):
        return dest
    import mlx.core as mx

    import squishlike
    from squishlike.default_model import default_model_path

    with _build_into(dest) as tmp:
        squishlike.export(default_model_path(), "mlx", tmp)
        for f in sorted(tmp.glob("model*.safetensors")):
            weights, metadata = mx.load(str(f), return_metadata=True)
            if any(v.dtype == mx.float32 for v in weights.values()):  # the GGUF dequantizes to float32
                weights = {k: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v for k, v in weights.items()}
                mx.save_safetensors(str(f), weights, metadata=metadata or {"format": "mlx"})
            del weights
    return dest


# ---------------------------------------------------------------------------------------------- stores


def _run_script(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"benchmark setup step failed:\n{code}\n{done.stderr[-4000:]}")


def prepare_store(source: Path, out: Path, fmt: str, with_finalized: bool) -> Path:
    """A compressed npy-dir (default cache policy) whose caches are built, plus the finalized tier if asked."""
    from squishlike.formats.npydir import NpyDir
    from squishlike.tiers import tier_status

    ready = NpyDir.is_npydir(out) and NpyDir(out).manifest.get("source", {}).get("path") == str(source.absolute())
    if not ready:
        _run_script(f"import squishlike; squishlike.compress({str(source)!r}, {str(out)!r}, format={fmt!r}, force=True)")
    store = NpyDir(out)
    status = tier_status(store)
    if any(status[t.name] != "ready" for t in _policy_tiers(store)):
        _run_script(f"import squishlike; squishlike.load({str(out)!r})")  # the first load builds the caches
    if with_finalized and tier_status(NpyDir(out))["finalized"] != "ready":
        _run_script(
            "from squishlike.formats.npydir import NpyDir\n"
            "from squishlike.tiers import BY_NAME, COLD\n"
            f"store = NpyDir({str(out)!r}); BY_NAME['finalized'].build(store, COLD.load_dense(store)[1])")
    return out


def _policy_tiers(store) -> list:
    from squishlike.tiers import ORDER

    return [t for t in ORDER if t.wanted(store)]


def fresh_clone(store: Path, dest: Path) -> Path:
    """A hard-linked copy of an npy-dir's at-rest part (manifest, side files, tensors/) with no tier caches."""
    from squishlike.formats.npydir import MANIFEST, TENSORS, NpyDir

    if dest.exists():
        shutil.rmtree(dest)
    (dest / TENSORS).mkdir(parents=True)
    manifest = NpyDir(store).manifest
    for rel in [MANIFEST, *manifest.get("side_files", {})]:
        os.link(store / rel, dest / rel)
    for f in (store / TENSORS).iterdir():
        os.link(f, dest / TENSORS / f.name)
    return dest


def reset_fresh(dest: Path) -> None:
    """Back to a fresh npy-dir: remove every cache and sentinel (never the hard-linked store files)."""
    from squishlike.formats.npydir import MANIFEST, TENSORS, NpyDir

    keep = {MANIFEST, TENSORS, *NpyDir(dest).manifest.get("side_files", {})}
    for p in dest.iterdir():
        if p.name not in keep:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def tier_files(store: Path, tier: str) -> list[Path]:
    """The files a load from `tier` reads (weights only; config and tokenizer files are a few MB)."""
    if tier == "mlx":
        return [store / "squish_weights.safetensors"]
    if tier in ("int4", "int3"):
        return sorted((store / f"squish_{tier[-1]}bit").glob("*.safetensors"))
    if tier == "finalized":
        return sorted((store / "finalized").glob("*.npy"))
    return sorted((store / "tensors").glob("*.npy"))


def all_files(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).rglob("*") if p.is_file())


def source_files(source: Path) -> list[Path]:
    return sorted(Path(source).glob("model*.safetensors"))


def _size(paths: list[Path]) -> int:
    return sum(os.path.getsize(p) for p in paths)


# ---------------------------------------------------------------------------------------------- the run


class Config:
    """One figure: how to run it once, and what it is compared with."""

    def __init__(self, key: str, label: str, group: str, run, *, files=(), weight_bytes=0, prime=0, evict=(),
                 before=None, floor=None, disk=None, baseline=None, load=None):
        self.key, self.label, self.group, self._run = key, label, group, run
        self.files, self.weight_bytes, self.prime, self.evict = list(files), weight_bytes, prime, list(evict)
        self.before, self.floor, self.disk, self.baseline, self.load = before, floor, disk, baseline, load
        self.runs: list[dict] = []
        self.forward: dict | None = None

    def once(self, prime: bool) -> dict:
        if self.before is not None:
            self.before()
        left = evict(self.evict) if self.evict else None
        if prime and self.prime:
            prime_memory(self.prime)
        report = self._run()
        if left is not None:
            report["resident_before"] = left
        self.runs.append(report)
        return report


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


WARM_KEYS = ("mlx_lm", "int4", "mlx", "finalized", "cold-tier-int8", "cold-tier-int4")
QUICK_KEYS = ("mlx_lm", "int4", "mlx", "finalized", "cold-tier-int4")


def _plan(source: Path, work: Path, quick: bool, cold: bool, do_compress: bool, name: str) -> list[Config]:
    int8 = prepare_store(source, work / f"{name}-int8", "int8", with_finalized=True)
    int4 = prepare_store(source, work / f"{name}-int4", "int4", with_finalized=False)
    fresh8 = fresh_clone(int8, work / f"{name}-int8-fresh")
    fresh4 = fresh_clone(int4, work / f"{name}-int4-fresh")
    src_files = source_files(source)
    src_bytes = _size(src_files)
    slack = 256 << 20
    configs: list[Config] = []

    def load(loader, path, tier=None):
        return lambda: measure_load(path, loader=loader, tier=tier)

    def floor_of(files, pages="huge"):
        return lambda: _spawn(["floor", *map(str, files), "--pages", pages])

    loads = [
        ("mlx_lm", "mlx_lm.load (source dir)", "mlx_lm", source, None, src_files),
        ("int4", "squishlike int4 tier", "squishlike", int4, "int4", tier_files(int4, "int4")),
        ("mlx", "squishlike mlx tier", "squishlike", int8, "mlx", tier_files(int8, "mlx")),
        ("finalized", "squishlike finalized tier", "squishlike", int8, "finalized", tier_files(int8, "finalized")),
        ("cold-tier-int8", "squishlike cold tier (int8 store, no build)", "squishlike", int8, "cold",
         tier_files(int8, "cold")),
        ("cold-tier-int4", "squishlike cold tier (int4 store, no build)", "squishlike", int4, "cold",
         tier_files(int4, "cold")),
    ]
    loads = [entry for entry in loads if entry[0] in (QUICK_KEYS if quick else WARM_KEYS)]
    in_memory = {k: src_bytes for k in WARM_KEYS}
    in_memory["int4"] = _size(tier_files(int4, "int4"))
    for key, label, loader, path, tier, files in loads:
        configs.append(Config(key, label, "warm", load(loader, path, tier), files=files, weight_bytes=in_memory[key],
                              prime=in_memory[key] + slack, baseline="mlx_lm", load=(loader, path, tier),
                              floor=[f"floor-{key}"] + (["floor-4k-mlx"] if key in ("mlx", "mlx_lm") else [])))
        configs.append(Config(f"floor-{key}", f"memory floor: {label} bytes", "floor", floor_of(files),
                              files=files, weight_bytes=_size(files), prime=_size(files) + slack))
    configs.append(Config("startup", "startup floor: interpreter, import mlx_lm, tokenizer (no weights)", "warm",
                          lambda: _spawn(["startup", str(source)]), baseline="mlx_lm"))
    if not quick:
        mlx_files = tier_files(int8, "mlx")
        configs.append(Config("floor-4k-mlx", "memory floor, 4 KiB pages: mlx tier bytes", "floor",
                              floor_of(mlx_files, "4k"), files=mlx_files, weight_bytes=src_bytes,
                              prime=src_bytes + slack))
    firsts = [("first-int8", "first load, fresh int8 npy-dir (builds the mlx tier)", fresh8),
              ("first-int4", "first load, fresh int4 npy-dir (builds the mlx + int4 tiers)", fresh4)]
    for key, label, store in firsts[1:] if quick else firsts:
        configs.append(Config(key, label, "first", load("squishlike", store), files=tier_files(store, "cold"),
                              weight_bytes=src_bytes, prime=src_bytes + slack, baseline="mlx_lm",
                              before=lambda s=store: reset_fresh(s)))
    if cold:
        for key, label, loader, path, tier, files in loads:
            if key == "cold-tier-int8" or (quick and key not in ("mlx_lm", "mlx")):
                continue
            configs.append(Config(f"evicted-{key}", f"{label}, evicted", "cold", load(loader, path, tier),
                                  files=files, weight_bytes=in_memory[key], prime=in_memory[key] + slack,
                                  evict=all_files(path), disk=f"disk-{key}", baseline="evicted-mlx_lm"))
            configs.append(Config(f"disk-{key}", f"disk floor: {label} files", "disk",
                                  lambda f=files: _spawn(["disk", *map(str, f)]), files=files, evict=files))
    if do_compress:
        for fmt, clip in [("int4", False)] if quick else [("int8", False), ("int4", False), ("int4", True)]:
            tag = f"{fmt}{'-clip' if clip else ''}"
            out = work / f"{name}-compress-{tag}"
            configs.append(Config(
                f"compress-{tag}", f"compress {fmt}{' + clip search' if clip else ''}", "compress",
                lambda fmt=fmt, clip=clip, out=out: _spawn(
                    ["compress", str(source), str(out), fmt] + (["--clip"] if clip else [])),
                files=src_files, weight_bytes=src_bytes))
    return configs


def largest_tensor_bytes(files: list[Path]) -> int:
    """The largest tensor of safetensors files, from their headers."""
    largest = 0
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                largest = max(largest, v["data_offsets"][1] - v["data_offsets"][0])
    return largest


def run_benchmark(model: str, workdir: Path, runs: int = 5, quick: bool = False, cold: bool = True,
                  do_compress: bool = True, prime: bool = False, forward: bool = True, out_dir: Path | None = None,
                  log=print) -> dict:
    """Prepare the models and stores under `workdir`, run every figure, write JSON, Markdown and PNG."""
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if model == "smollm":
        source, name = build_smollm_source(workdir / "smollm2-135m-bf16"), "smollm2"
    elif model in ("qwen1.5b", "qwen"):
        tokenizer = None
        with contextlib.suppress(FileNotFoundError, ImportError, RuntimeError):
            tokenizer = build_smollm_source(workdir / "smollm2-135m-bf16")
        source, name = build_qwen_like(workdir / "qwen2-1.5b-shaped-bf16", tokenizer), "qwen1.5b"
    else:
        source, name = Path(model).absolute(), Path(model).name
        if not source_files(source):
            raise FileNotFoundError(f"{model}: no model*.safetensors there (or give one of: smollm, qwen1.5b)")
    log(f"source: {source} ({_size(source_files(source)) / GB:.2f} GB); preparing the stores ...")
    configs = _plan(source, workdir, quick, cold, do_compress, name)
    for c in configs:
        if not c.evict:
            warm(c.files)
    for group in ("warm", "first", "cold", "compress"):
        members = [c for c in configs if c.group == group or (group, c.group) in (("warm", "floor"), ("cold", "disk"))]
        count = 1 if group == "compress" and quick else runs
        for r in range(count):
            for c in members:
                rep = c.once(prime)
                log(f"  [{group} {r + 1}/{count}] {c.label:62} {rep['wall_s']:7.2f} s")
    if forward:
        for c in configs:
            if c.group == "warm" and c.load is not None:
                loader, path, tier = c.load
                c.forward = measure_load(path, loader=loader, tier=tier, forward=True)
                log(f"  [forward] {c.label:62} {c.forward.get('forward_s', 0):7.2f} s")
    result = _results(configs, source, workdir, name, runs, prime, time.monotonic() - started)
    out_dir = Path(out_dir or workdir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{name}{'-quick' if quick else ''}"
    table = markdown(result)
    chart = plot(result, out_dir / f"{stem}.png")
    result["outputs"] = {"json": str(out_dir / f"{stem}.json"), "markdown": str(out_dir / f"{stem}.md"),
                         "chart": str(chart) if chart else None}
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out_dir / f"{stem}.md").write_text(table)
    log("\n" + table)
    log(f"wrote {out_dir / (stem + '.json')}, {out_dir / (stem + '.md')}"
        + (f", {chart}" if chart else " (no chart: matplotlib is not installed; pip install 'squishlike[bench]')"))
    return result


def _results(configs, source, workdir, name, runs, prime, elapsed) -> dict:
    figures = {}
    # A load's memory is counted above the startup floor's peak (a process with the interpreter, mlx_lm,
    # transformers and the tokenizer, and no weights): squishlike imports mlx_lm inside load, mlx_lm.load's
    # caller before it, so "after the imports" would not be the same point in both.
    startup = next((c for c in configs if c.key == "startup" and c.runs), None)
    startup_peak = statistics.median(r["rss_peak"] for r in startup.runs) if startup else None
    for c in configs:
        if not c.runs:
            continue
        fig = {"label": c.label, "group": c.group, "wall_s": _summary([r["wall_s"] for r in c.runs]),
               "bytes_on_disk": _size(c.files), "weight_bytes": c.weight_bytes, "runs": c.runs}
        for k in ("weights_s", "tokenizer_s", "import_s", "load_s", "read_s", "compress_s"):
            vals = [r[k] for r in c.runs if k in r]
            if vals:
                fig[k] = _summary(vals)
        if c.group in ("warm", "first", "cold", "compress"):
            if startup_peak is not None and c.group != "compress" and c.key != "startup":
                fig["rss_above_baseline"] = max(r["rss_peak"] for r in c.runs) - startup_peak
            else:
                fig["rss_above_baseline"] = max(r["rss_peak"] - r["rss_after_import"] for r in c.runs)
            fig["rss_above_start"] = max(r["rss_peak"] - r["rss_start"] for r in c.runs)
        if c.evict:
            fig["resident_before_max"] = max(r.get("resident_before", 0) for r in c.runs)
        if c.forward is not None:
            fig["forward"] = {"forward_s": c.forward.get("forward_s"), **c.forward.get("forward", {})}
        tiers = {r["tier"] for r in c.runs if r.get("tier")}
        if tiers:
            fig["tier_served"] = sorted(tiers)
        figures[c.key] = fig
    for c in configs:
        fig = figures.get(c.key)
        if fig is None:
            continue
        if c.baseline in figures:
            fig["speedup_vs_mlx_lm"] = figures[c.baseline]["wall_s"]["median"] / fig["wall_s"]["median"]
        floors = [figures[k] for k in (c.floor if isinstance(c.floor, (list, tuple)) else [c.floor]) if k in figures]
        if floors:  # the floor is the faster way of reading those bytes into fresh memory
            floor = min(floors, key=lambda f: f["read_s"]["median"])
            fig["vs_memory_floor"] = {
                "process": fig["wall_s"]["median"] / floor["wall_s"]["median"],
                "weights": fig.get("weights_s", fig["wall_s"])["median"] / floor["read_s"]["median"],
                "floor": floor["label"]}
        if c.disk in figures:
            disk = figures[c.disk]
            bandwidth = disk["bytes_on_disk"] / disk["read_s"]["median"]
            rate = fig["bytes_on_disk"] / fig.get("weights_s", fig["wall_s"])["median"]
            fig["cold_read"] = {"bytes_per_s": rate, "disk_floor_bytes_per_s": bandwidth,
                                "vs_disk_floor": rate / bandwidth}
        if c.group == "compress":
            fig["throughput_mb_s"] = c.weight_bytes / 1e6 / fig["compress_s"]["median"]
    largest = largest_tensor_bytes(source_files(source))
    return {"model": name, "source": str(source), "workdir": str(workdir), "runs": runs, "primed": prime,
            "largest_tensor_bytes": largest, "machine": machine(), "elapsed_s": elapsed, "figures": figures,
            "targets": targets(figures, largest)}


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    with contextlib.suppress(Exception):
        import mlx.core as mx
        import mlx_lm

        info["mlx"], info["mlx_lm"] = mx.__version__, mlx_lm.__version__
    with contextlib.suppress(OSError):
        info["memory_gb"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    with contextlib.suppress(OSError):
        info["thp"] = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    return info


def targets(f: dict, largest: int = 0) -> list[dict]:
    """The issue's targets, each with the measured figure and whether it holds."""
    out = []

    def add(what, value, limit, ok, unit="x"):
        out.append({"target": what, "measured": value, "limit": limit, "unit": unit, "met": bool(ok)})

    def get(key, *path):
        v = f.get(key)
        for p in path:
            if v is None:
                return None
            v = v.get(p)
        return v

    if (s := get("startup", "speedup_vs_mlx_lm")) is not None:  # not a target: the bound on the ones below
        out.append({"target": "bound: no drop-in load beats the startup floor (interpreter, imports, tokenizer)",
                    "measured": s, "limit": None, "unit": "x", "met": None})
    if (s := get("mlx", "speedup_vs_mlx_lm")) is not None:
        add("mlx tier load >= 4x faster than mlx_lm.load (warm)", s, 4, s >= 4)
    if (r := get("mlx", "vs_memory_floor", "weights")) is not None:
        add("mlx tier weights within 1.5x of the memory floor (same bytes)", r, 1.5, r <= 1.5)
    if (r := get("mlx", "vs_memory_floor", "process")) is not None:
        add("mlx tier whole process within 1.5x of the memory-floor process", r, 1.5, r <= 1.5)
    if (s := get("int4", "speedup_vs_mlx_lm")) is not None:
        add("int4 tier load >= 8x faster than mlx_lm.load", s, 8, s >= 8)
    if (s := get("finalized", "speedup_vs_mlx_lm")) is not None:
        add("finalized tier load >= 2x faster than mlx_lm.load", s, 2, s >= 2)
    for key, fig in f.items():
        if fig["group"] == "cold" and "cold_read" in fig and key != "evicted-mlx_lm":
            r = fig["cold_read"]["vs_disk_floor"]
            add(f"{fig['label']}: reads at >= 0.7x the disk floor", r, 0.7, r >= 0.7)
    for key, fig in f.items():
        if fig["group"] in ("warm", "first", "cold") and "rss_above_baseline" in fig and fig["weight_bytes"]:
            r = fig["rss_above_baseline"] / fig["weight_bytes"]
            if key not in ("mlx_lm", "evicted-mlx_lm"):
                add(f"{fig['label']}: peak RSS <= 1.2x weight bytes", r, 1.2, r <= 1.2)
    for key, fig in f.items():
        if fig["group"] == "compress":
            if "clip" not in key:
                add(f"{fig['label']}: >= 150 MB/s of bf16 source", fig["throughput_mb_s"], 150,
                    fig["throughput_mb_s"] >= 150, "MB/s")
            if largest:
                add(f"{fig['label']}: peak RSS <= largest tensor x4 + 512 MB", fig["rss_above_baseline"] / GB,
                    (largest * 4 + 512e6) / GB, fig["rss_above_baseline"] <= largest * 4 + 512e6, "GB")
    for key in ("first-int8", "first-int4"):
        if key in f and "mlx_lm" in f:
            r = f[key]["wall_s"]["median"] / f["mlx_lm"]["wall_s"]["median"]
            add(f"{f[key]['label']}: <= 2x mlx_lm.load", r, 2, r <= 2)
    return out


# ---------------------------------------------------------------------------------------------- output


def markdown(result: dict) -> str:
    f = result["figures"]
    m = result["machine"]
    lines = [
        f"### {result['model']}: load times, each a whole fresh process ({result['runs']} runs per figure, "
        f"{'memory primed before each run' if result['primed'] else 'back to back'})",
        "",
        f"{m.get('cpus')} CPUs, {m.get('memory_gb', 0):.0f} GB, {m.get('platform')}, mlx {m.get('mlx')}, "
        f"mlx_lm {m.get('mlx_lm')}. Source: `{Path(result['source']).name}`.",
        "",
        "| figure | median s | min s | max s | vs mlx_lm.load | weights s | vs memory floor (weights / process) "
        "| cold read vs disk floor | peak RSS above the startup floor's | RSS / weight bytes | bytes on disk |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, fig in f.items():
        if fig["group"] not in ("warm", "first", "cold"):
            continue
        w = fig["wall_s"]
        speed = f"{fig['speedup_vs_mlx_lm']:.2f}x" if "speedup_vs_mlx_lm" in fig else ""
        weights = f"{fig['weights_s']['median']:.2f}" if "weights_s" in fig else ""
        vf = fig.get("vs_memory_floor")
        floor = f"{vf['weights']:.2f}x / {vf['process']:.2f}x" if vf else ""
        cr = fig.get("cold_read")
        cold = f"{cr['bytes_per_s'] / GB:.2f} GB/s ({cr['vs_disk_floor']:.2f}x)" if cr else ""
        rss = fig.get("rss_above_baseline")
        ratio = f"{rss / fig['weight_bytes']:.2f}" if rss and fig["weight_bytes"] else ""
        lines.append(f"| {fig['label']} | {w['median']:.2f} | {w['min']:.2f} | {w['max']:.2f} | {speed} | {weights} "
                     f"| {floor} | {cold} | {rss / GB if rss else 0:.2f} GB | {ratio} | "
                     f"{fig['bytes_on_disk'] / GB:.2f} GB |")
    floors = [(k, fig) for k, fig in f.items() if fig["group"] in ("floor", "disk")]
    if floors:
        lines += ["", "| floor | read s (median / min / max) | GB/s | process s (median) | bytes |",
                  "|---|---:|---:|---:|---:|"]
        for key, fig in floors:
            r = fig["read_s"]
            lines.append(f"| {fig['label']} | {r['median']:.2f} / {r['min']:.2f} / {r['max']:.2f} "
                         f"| {fig['bytes_on_disk'] / r['median'] / GB:.2f} | {fig['wall_s']['median']:.2f} "
                         f"| {fig['bytes_on_disk'] / GB:.2f} GB |")
    comp = [(k, fig) for k, fig in f.items() if fig["group"] == "compress"]
    if comp:
        lines += ["", "| compress | median s (in process) | min / max | MB/s of bf16 source | process s "
                  "| peak RSS above baseline |", "|---|---:|---:|---:|---:|---:|"]
        for key, fig in comp:
            c = fig["compress_s"]
            lines.append(f"| {fig['label']} | {c['median']:.2f} | {c['min']:.2f} / {c['max']:.2f} "
                         f"| {fig['throughput_mb_s']:.0f} | {fig['wall_s']['median']:.2f} "
                         f"| {fig['rss_above_baseline'] / GB:.2f} GB |")
    fwd = [(k, fig) for k, fig in f.items() if "forward" in fig]
    if fwd:
        lines += ["", "| first forward pass (after load, not in load time) | s | logits finite | argmax |",
                  "|---|---:|:-:|---:|"]
        for key, fig in fwd:
            fw = fig["forward"]
            lines.append(f"| {fig['label']} | {fw.get('forward_s') or 0:.2f} | {fw.get('finite')} "
                         f"| {fw.get('argmax')} |")
    if result.get("targets"):
        lines += ["", "| target | measured | limit | met |", "|---|---:|---:|:-:|"]
        for t in result["targets"]:
            unit = "" if t["unit"] == "x" else f" {t['unit']}"
            fmt = ".2f" if t["unit"] != "MB/s" else ".0f"
            limit = f"{t['limit']:{fmt}}{unit if unit else 'x'}" if t["limit"] is not None else ""
            met = "" if t["met"] is None else "yes" if t["met"] else "NO"
            lines.append(f"| {t['target']} | {t['measured']:{fmt}}{unit if unit else 'x'} | {limit} | {met} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    f = result["figures"]
    rows = [(fig["label"], fig["wall_s"], "floor" if key == "startup" else fig["group"]) for key, fig in f.items()
            if fig["group"] in ("warm", "first", "cold", "floor", "disk")]  # the startup floor is a floor
    colors = {"warm": "#4c72b0", "first": "#dd8452", "cold": "#55a868", "floor": "#8c8c8c", "disk": "#b0b0b0"}
    fig, ax = plt.subplots(figsize=(10, 0.38 * len(rows) + 1.5))
    ys = list(range(len(rows)))[::-1]
    for y, (label, w, group) in zip(ys, rows):
        ax.barh(y, w["median"], color=colors[group],
                xerr=[[w["median"] - w["min"]], [w["max"] - w["median"]]], capsize=3)
        ax.text(w["max"] + 0.05, y, f"{w['median']:.2f} s", va="center", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.set_xlabel("seconds, whole fresh process (median; bars: min-max)")
    ax.set_title(f"{result['model']}: load time (warm / first load / evicted / floors)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- CLI


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="smollm (the embedded SmolLM2-135M, default), qwen1.5b (a model with the shapes of a "
                             "1.5B Qwen2, random bf16 weights, built here), or the path of an HF/MLX directory")
    parser.add_argument("--model", dest="model_option", default=None, help="same as MODEL")
    parser.add_argument("--workdir", type=Path, default=Path("squishlike-bench"),
                        help="where the models, stores and results go (default: ./squishlike-bench)")
    parser.add_argument("--out", type=Path, default=None, help="where the JSON, Markdown and PNG go (default: workdir)")
    parser.add_argument("--runs", type=int, default=5, help="fresh-process runs per figure (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run of a minute or two: SmolLM2, 2 runs, fewer figures")
    parser.add_argument("--no-cold", action="store_true", help="skip the evicted-page-cache figures")
    parser.add_argument("--no-compress", action="store_true", help="skip the compress figures")
    parser.add_argument("--no-forward", action="store_true", help="skip the first forward pass")
    parser.add_argument("--prime", action="store_true",
                        help="touch and free as much memory as a run needs before each run (see the module doc)")


def run_bench(args: argparse.Namespace) -> int:
    model = args.model or args.model_option or "smollm"
    runs = args.runs
    if args.quick:
        model = args.model or args.model_option or "smollm"
        runs = min(runs, 2) if args.runs == 5 else runs
    if runs < 1:
        raise ValueError("--runs must be at least 1")
    run_benchmark(model, args.workdir, runs=runs, quick=args.quick, cold=not args.no_cold,
                  do_compress=not args.no_compress, prime=args.prime, forward=not args.no_forward,
                  out_dir=args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="squishlike bench", description=__doc__.split("\n\n")[0])
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    if "--child" in sys.argv[1:]:
        _child_main(sys.argv[1:])
    else:
        sys.exit(main())
