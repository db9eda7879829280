"""Real processes, real kills: the harness behind tests/reliability/test_crash_safety.py, tests/reliability/test_concurrency.py and the long
sweeps in tests/fuzz/crash_sweep.py.

A *fork server* is a fresh Python process that imports squishlike (and mlx, mlx_lm, transformers) once, runs no
computation itself (MLX's thread pools do not survive fork), and then forks one child per job. A job runs
`squishlike.compress`, `squishlike.load` or the CLI in that child, with the fault hook's environment
(SQUISHLIKE_FAULT_AT / _NTH / _ACTION / _LOG, see squishlike/io/fault.py) or a SIGKILL sent by the server at a
random moment. Forking saves the ~2 s of imports per trial; the children are still separate processes killed with
a real SIGKILL, so nothing in them (no `finally`, no atexit) runs after the kill.

The checks (`check_after_crash`, `weights_digest`, ...) run in the test process, never in a killed one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FAULT_VARS = ("SQUISHLIKE_FAULT_AT", "SQUISHLIKE_FAULT_NTH", "SQUISHLIKE_FAULT_ACTION", "SQUISHLIKE_FAULT_LOG")

# A small but real model: one llama layer, every linear weight quantizable at group 32/64.
CRASH_CONFIG = dict(
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=1,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=384,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# Embeddings exact and no calibration: the trials need a store of a known layout and size (the disk-full limits
# are sized for it), not its accuracy.
COMPRESS_OPTS = dict(scheme="int4", group_size=32, tiers=["int4", "mlx", "finalized"], quantize_embeddings=False,
                     awq=False, gptq=False, clip_search=False)


# ---------------------------------------------------------------------------------------------- the server side


def _run_op(job: dict) -> Any:
    """What a forked child does. Returns a JSON-able result (written to job["result"] when given)."""
    op = job["op"]
    if op == "compress":
        import squishlike

        opts = dict(job.get("opts", {}))
        if "tiers" in opts and opts["tiers"] is not None:
            opts["tiers"] = tuple(opts["tiers"])
        squishlike.compress(job["src"], job["out"], **opts)
        return {"ok": True}
    if op == "load":
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, served = _load_recording_tier(job["path"], job.get("tier"))
        return {"tier": served, "digest": weights_digest(model), "warnings": [str(w.message) for w in caught]}
    if op == "cli":
        import contextlib
        import io

        from squishlike.cli import main

        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = main(job["argv"])
        return {"rc": rc, "stderr": err.getvalue(), "stdout": out.getvalue()}
    if op == "hostile":
        return {action: _attempt(action, Path(job["path"]), Path(job["scratch"])) for action in job["actions"]}
    if op == "sleep":  # for testing the harness itself
        time.sleep(job["seconds"])
        return {"ok": True}
    raise ValueError(f"unknown op {op!r}")


def act(action: str, target: Path, scratch: Path) -> Any:
    """Point one entry point of squishlike at `target`: "open" (open_weights, every tensor, the side files),
    "npydir" (NpyDir, every tensor dequantized), "load", "sentinel:<tier>" (load forcing that tier), "inspect",
    "verify", "compress" (an INT8 store, no tiers), "export" (an HF directory), both written under `scratch`.
    Returns the weights digest for a load, verify's problems, what compress or export wrote (output_digest),
    else None."""
    import mlx.core as mx

    import squishlike
    from squishlike.info import inspect_model, verify
    from squishlike.npydir import NpyDir

    if action == "open":
        with squishlike.open_weights(target) as provider:
            for name in provider.names():
                mx.eval(provider.get(name))
            provider.write_side_files(scratch / "side")
    elif action == "npydir":
        store = NpyDir(target)
        for name in store.entries:
            store.dequantize(name)
    elif action == "load":
        return weights_digest(squishlike.load(target)[0])
    elif action.startswith("sentinel:"):
        return weights_digest(squishlike.load(target, tier=action.split(":", 1)[1])[0])
    elif action == "inspect":
        inspect_model(target)
    elif action == "verify":
        return verify(target)
    elif action == "compress":
        # INT8 without calibration or tiers: the cheapest store that still reads every tensor of the source.
        out = squishlike.compress(target, scratch / "compressed", scheme="int8", tiers=())
        problems = verify(out)
        return {"problems": problems} if problems else output_digest(out)
    elif action == "export":
        return output_digest(squishlike.export(target, "hf", scratch / "exported"))
    else:
        raise ValueError(action)
    return None


def _attempt(action: str, target: Path, scratch: Path) -> dict:
    """act(), its outcome as JSON: {"value": ...} or the exception's type, base classes and message."""
    import warnings

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = act(action, target, scratch)
        return {"value": value, "warnings": [str(w.message) for w in caught]}
    except Exception as e:  # noqa: BLE001 - the caller judges every kind
        return {"error": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}


def _child(job: dict) -> None:
    """In the forked child: apply the job's environment, run, report, exit without running the server's cleanup."""
    code = 0
    result: Any
    try:
        for k in FAULT_VARS:
            os.environ.pop(k, None)
        # The operation ends when its call returns: a first load's build happens inside it, not on a thread
        # that this child's exit (os._exit, below) would cut short.
        os.environ["SQUISHLIKE_BACKGROUND_BUILD"] = "0"
        os.environ.update({k: str(v) for k, v in job.get("env", {}).items()})
        if job.get("rlimit_fsize") is not None:  # "disk full": no file may grow past this many bytes
            import resource

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so write() fails with EFBIG instead of killing us
            resource.setrlimit(resource.RLIMIT_FSIZE, (job["rlimit_fsize"], job["rlimit_fsize"]))
        if job.get("memory_limit") is not None:  # this much memory beyond what the process holds already
            import resource

            with open("/proc/self/status") as f:
                held = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
            limit = held + job["memory_limit"]
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        if "start_at" in job:  # a barrier for concurrent jobs: all begin at the same instant
            time.sleep(max(0.0, job["start_at"] - time.time()))
        result = _run_op(job)
    except BaseException as e:  # noqa: BLE001 - the child reports everything, including KeyboardInterrupt
        import traceback

        code = 130 if isinstance(e, KeyboardInterrupt) else 1
        result = {"error": type(e).__name__, "message": str(e), "mro": [c.__name__ for c in type(e).__mro__],
                  "traceback": traceback.format_exc()[-4000:]}
    if job.get("result"):  # atomically: a kill that lands after the op, while this is written, leaves no half file
        with open(job["result"] + ".part", "w") as f:
            json.dump(result, f)
        os.replace(job["result"] + ".part", job["result"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if not (isinstance(result, dict) and "rc" in result) else int(result["rc"]))


def _status(raw: int) -> dict:
    if os.WIFSIGNALED(raw):
        return {"signal": os.WTERMSIG(raw), "code": None}
    return {"signal": None, "code": os.WEXITSTATUS(raw)}


HANG_LIMIT = 120  # seconds a child may take to stop after a signal it can catch (SIGINT) before it counts as hung


def _serve_one(job: dict) -> dict:
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(job)
    kill_after = job.get("kill_after")
    signal_to_send = job.get("send_signal", signal.SIGKILL)
    killed = False
    if kill_after is not None:
        deadline = started + kill_after
        while True:  # poll, so a child that finished early is not "killed"
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                return {**_status(raw), "killed_by_us": False, "elapsed": time.monotonic() - started}
            if time.monotonic() >= deadline:
                os.kill(pid, signal_to_send)
                killed = True
                break
            time.sleep(min(0.002, max(0.0, deadline - time.monotonic())))
        # A child that catches the signal must still stop: one that hangs is killed and reported, so the test
        # fails naming the trial instead of waiting forever.
        give_up = time.monotonic() + HANG_LIMIT
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < give_up:
            time.sleep(0.01)
        if not done[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"signal": None, "code": None, "hung": True, "killed_by_us": True,
                    "elapsed": time.monotonic() - started}
        return {**_status(done[1]), "killed_by_us": True, "elapsed": time.monotonic() - started}
    _, raw = os.waitpid(pid, 0)
    return {**_status(raw), "killed_by_us": killed, "elapsed": time.monotonic() - started}


def _serve_many(jobs: list[dict]) -> list[dict]:
    """Fork every job at once; a job with "kill_after" gets its signal that many seconds after the start."""
    started = time.monotonic()
    pids = []
    for job in jobs:
        pid = os.fork()
        if pid == 0:
            _child(job)
        pids.append(pid)
    results: dict[int, dict] = {}
    killed: set[int] = set()
    while len(results) < len(pids):
        for i, (pid, job) in enumerate(zip(pids, jobs)):
            if i in results:
                continue
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                results[i] = {**_status(raw), "killed_by_us": i in killed, "elapsed": time.monotonic() - started}
            elif job.get("kill_after") is not None and i not in killed and \
                    time.monotonic() - started >= job["kill_after"]:
                os.kill(pid, job.get("send_signal", signal.SIGKILL))
                killed.add(i)
        time.sleep(0.005)
    return [results[i] for i in range(len(pids))]


def serve() -> None:
    """The fork server's main loop: one JSON job (or {"parallel": [jobs]}) per line in, one JSON line out."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever squishlike or a library prints goes to stderr, never into the protocol
    import mlx.core  # noqa: F401  - imports only: no computation may run in the server before a fork
    import mlx_lm.models.llama  # noqa: F401
    import mlx_lm.tokenizer_utils  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
    from transformers.models.auto import tokenization_auto  # noqa: F401
    import tqdm.auto  # noqa: F401
    import safetensors.numpy  # noqa: F401

    import squishlike.cli  # noqa: F401
    import squishlike.compressor  # noqa: F401
    import squishlike.info  # noqa: F401
    import squishlike.loader  # noqa: F401
    import squishlike.tiers  # noqa: F401
    from squishlike.formats import reader_classes

    reader_classes()

    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        job = json.loads(line)
        reply = {"results": _serve_many(job["parallel"])} if "parallel" in job else _serve_one(job)
        proto.write(json.dumps(reply) + "\n")


class ForkServer:
    """Client side: `with ForkServer() as fs: fs.run({"op": "compress", ...})`."""

    def __init__(self, log: Path | None = None):
        env = {k: v for k, v in os.environ.items() if k not in FAULT_VARS}
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))  # `support`
        self._log = open(log, "ab") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "support.crash_harness"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
        )
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError("the fork server did not start (see its log)")

    def run(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fork server died")
        return json.loads(line)

    def parallel(self, jobs: list[dict]) -> list[dict]:
        return self.run({"parallel": jobs})["results"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- the checks


def tree_digest(root: Path, skip=(".squishlike.lock",)) -> dict[str, str]:
    """relative path -> sha256 of every regular file under `root` (symlinks are recorded as their target)."""
    out = {}
    root = Path(root)
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.name in skip:
            continue
        if p.is_symlink():
            out[rel] = "symlink:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def tree_state(root: Path) -> dict[str, tuple]:
    """relative path -> (type and mode, size, mtime) of everything under `root`, from lstat only: never opens a
    file, so a FIFO or a terabyte sparse file costs nothing."""
    return {str(p.relative_to(root)): (st.st_mode, st.st_size, st.st_mtime_ns)
            for p in sorted(Path(root).rglob("*")) if p.name != ".squishlike.lock" for st in [p.lstat()]}


def output_digest(out: Path) -> str:
    """One sha256 over what compress or export wrote: an npy-dir's records of its tensors and side files (the
    rest of its manifest says when and from where), every file of any other directory. Equal outputs of two
    sources mean the same weights and side files, without the cost of loading either."""
    h = hashlib.sha256()
    if (out / "manifest.json").is_file():
        m = json.loads((out / "manifest.json").read_text())
        h.update(json.dumps([m["tensors"], m["side_files"]], sort_keys=True).encode())
        return h.hexdigest()
    for p in sorted(out.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(out)).encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def weights_digest(model) -> str:
    """One sha256 over every weight of an mlx_lm model, dense (quantized layers dequantized), in name order.

    The INT4 tier is a lossless repack of the store, so its dequantized weights hash the same as the cold tier's.
    """
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx.utils import tree_flatten

    dense = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            dense[f"{name}.weight"] = mx.dequantize(
                module.weight, module.scales, module.biases, group_size=module.group_size, bits=module.bits
            )
    for name, value in tree_flatten(model.parameters()):
        prefix = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) or (name.endswith(".weight") and f"{prefix}.weight" in dense):
            continue
        dense[name] = value
    h = hashlib.sha256()
    for name in sorted(dense):
        a = dense[name]
        h.update(name.encode())
        h.update(str(a.dtype).encode())
        h.update(str(a.shape).encode())
        h.update(np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes())
    return h.hexdigest()


def ready_tiers(out: Path) -> dict[str, bool]:
    from squishlike.npydir import NpyDir
    from squishlike.tiers import ORDER

    store = NpyDir(out)
    return {t.name: t.ready(store)[0] is not None for t in ORDER}


def serving_tier(out: Path) -> str:
    """The tier a load of `out` takes on this device: the first ready one in the device's order, else cold."""
    from squishlike.npydir import NpyDir
    from squishlike.tiers import ORDER, ordered

    store = NpyDir(out)
    return next((t.name for t in ordered(ORDER) if t.ready(store)[0] is not None), "cold")


def lying_sentinels(out: Path) -> list[str]:
    """Every sentinel that counts as ready but whose files do not match their recorded size and checksum."""
    from squishlike.io.checksum import verify_files
    from squishlike.npydir import NpyDir
    from squishlike.tiers import ORDER

    store = NpyDir(out)
    problems = []
    for tier in ORDER:
        payload, _ = tier.ready(store)
        if payload is not None:
            sentinel = store.path / tier.sentinel
            problems += [f"{tier.name}: {p}" for p in verify_files(sentinel.parent, payload["files"])]
    return problems


def store_part(out: Path) -> dict[str, str]:
    """The digest of the at-rest store only: manifest, tensors/, side files (what a cache build must never touch)."""
    digest = tree_digest(out)
    keep = {"manifest.json", "config.json", "tokenizer.json", "tokenizer_config.json"}
    return {k: v for k, v in digest.items() if k.startswith("tensors/") or k in keep}


def _load_recording_tier(path, tier: str | None = None):
    """(model, the tier that served it, or None) for squishlike.load(path, tier=tier) in this process."""
    import squishlike
    import squishlike.loader as loader

    served = []
    original = loader.load_weights

    def recording(*a, **k):
        loaded = original(*a, **k)
        served.append(loaded.tier)
        return loaded

    loader.load_weights = recording
    try:
        model, _ = squishlike.load(path, tier=tier)
    finally:
        loader.load_weights = original
    return model, (served[0] if served else None)


def load_in_process(path: Path, tier: str | None = None) -> tuple[str, str]:
    """(tier that served, weights digest) for squishlike.load(path) in this process."""
    model, served = _load_recording_tier(path, tier)
    return served, weights_digest(model)


def labels_of(log: Path) -> list[str]:
    if not log.exists():
        return []
    return [line.split(" ", 1)[1] for line in log.read_text().splitlines() if " " in line]


def random_delays(n: int, duration: float, seed: int) -> list[float]:
    """`n` kill moments spread over [0, 1.1 * duration]: stratified, so early, middle and late moments all occur."""
    rng = random.Random(seed)
    span = duration * 1.1
    return [span * (i + rng.random()) / n for i in range(n)]


def copy_store(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


# ---------------------------------------------------------------------------------------------- trials


class CrashLab:
    """A tiny source model, its clean build (the reference), and trials that kill compress or the first load.

    Every trial returns a record whose "problems" list names each broken invariant (empty: the trial passed):
    the source is untouched; OUT is absent, the old model, or a complete store whose checksums verify; no sentinel
    counts as ready over files that differ from it; the next load (and a re-run compress where OUT is absent)
    succeeds, with weights bit-identical to the clean build's, from every tier that is ready afterwards.
    """

    def __init__(self, root: Path, server: ForkServer):
        import squishlike
        from .tiny_models import make_hf_model, make_tokenizer

        self.root, self.server = Path(root), server
        self.src = make_hf_model(self.root / "src", CRASH_CONFIG, make_tokenizer(self.root / "tokenizer"))
        self.src_digest = tree_digest(self.src)
        self.opts = dict(COMPRESS_OPTS)
        self.pristine = squishlike.compress(self.src, self.root / "pristine", **self._py_opts())
        self.store_digest = store_part(self.pristine)
        reference = copy_store(self.pristine, self.root / "reference")
        tier, self.weights = load_in_process(reference)
        assert tier == "cold"
        warm_tier, warm = load_in_process(reference)
        assert warm_tier != "cold" and warm == self.weights, "clean build: warm tier differs from cold"
        self.built = {k for k, v in ready_tiers(reference).items() if v}
        # An older, different good model (INT8, caches built) for --force runs to replace.
        self.old_model = squishlike.compress(self.src, self.root / "old-int8", scheme="int8", tiers=("mlx",))
        load_in_process(self.old_model)
        self.old_digest = tree_digest(self.old_model)
        self.compress_seconds = self.load_seconds = 0.0
        self._n = 0

    def _py_opts(self, **extra) -> dict:
        opts = {**self.opts, **extra}
        opts["tiers"] = tuple(opts["tiers"])
        return opts

    def _trial_dir(self) -> Path:
        self._n += 1
        d = self.root / "trials" / f"{self._n:04d}"
        d.mkdir(parents=True)
        return d

    # -- enumeration and timing

    def boundaries(self, op: str, force: bool = False) -> list[str]:
        """Every fault-hook label a clean `op` ("compress" or "load") passes, in order."""
        d = self._trial_dir()
        log = d / "labels.log"
        if op == "compress":
            out = d / "out"
            if force:
                copy_store(self.old_model, out)
            r = self.server.run({"op": "compress", "src": str(self.src), "out": str(out),
                                 "opts": {**self.opts, "force": force}, "env": {"SQUISHLIKE_FAULT_LOG": str(log)}})
            self.compress_seconds = r["elapsed"]
        else:
            out = copy_store(self.pristine, d / "out")
            r = self.server.run({"op": "load", "path": str(out), "env": {"SQUISHLIKE_FAULT_LOG": str(log)}})
            self.load_seconds = r["elapsed"]
        assert r["code"] == 0, r
        labels = labels_of(log)
        shutil.rmtree(d, ignore_errors=True)
        return labels

    # -- trials

    def compress_trial(self, *, env: dict | None = None, kill_after: float | None = None, force: bool = False,
                       send_signal: int = signal.SIGKILL, keep: bool = False) -> dict:
        import squishlike
        from squishlike.npydir import is_npydir
        from squishlike.info import verify

        d = self._trial_dir()
        out = d / "out"
        if force:
            copy_store(self.old_model, out)
        job = {"op": "compress", "src": str(self.src), "out": str(out), "opts": {**self.opts, "force": force},
               "env": env or {}, "result": str(d / "result.json")}
        if kill_after is not None:
            job.update(kill_after=kill_after, send_signal=int(send_signal))
        r = self.server.run(job)
        rec = {"op": "compress", "force": force, "env": env, "kill_after": kill_after, **r, "problems": []}
        problems = rec["problems"]
        result = json.loads((d / "result.json").read_text()) if (d / "result.json").exists() else None
        rec["result"] = result
        rec["killed"] = r["signal"] is not None
        if r.get("hung"):
            problems.append(f"compress did not stop within {HANG_LIMIT} s of the signal (killed): {result}")
        elif r["signal"] is None and r["code"] not in (0, 130):
            problems.append(f"compress failed instead of dying: {result}")
        if tree_digest(self.src) != self.src_digest:
            problems.append("the source model changed")
        # The state it left.
        if not out.exists():
            rec["state"] = "absent"
            if force:
                problems.append("the good model at OUT was lost")
        elif force and tree_digest(out) == self.old_digest:
            rec["state"] = "old"
        elif is_npydir(out):
            rec["state"] = "new"
            problems += [f"verify: {p}" for p in verify(out)]
            if store_part(out) != self.store_digest:
                problems.append("OUT is an npy-dir whose store differs from a clean build")
        else:
            rec["state"] = "broken"
            problems.append(f"OUT exists but is neither the old model nor a complete npy-dir: {sorted(tree_digest(out))}")
        if rec["state"] == "broken":
            return rec
        problems += lying_sentinels(out) if is_npydir(out) else []
        if r["signal"] is None and r["code"] == 130:  # Ctrl-C: the run must have cleaned up after itself
            litter = [p.name for p in d.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
            if litter:
                problems.append(f"interrupted compress left temp files: {litter}")
        # Recovery: the next compress (always, so stale temp files must not get in its way), then two loads.
        try:
            squishlike.compress(self.src, out, **self._py_opts(force=out.exists()))
        except Exception as e:  # noqa: BLE001
            problems.append(f"the next compress failed: {type(e).__name__}: {e}")
            return rec
        litter = [p.name for p in d.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
        if litter:
            problems.append(f"the next compress left a killed run's temp files behind: {litter}")
        problems += self._check_loads(out, rec)
        if not problems and not keep:
            shutil.rmtree(d, ignore_errors=True)
        return rec

    def load_trial(self, *, env: dict | None = None, kill_after: float | None = None,
                   send_signal: int = signal.SIGKILL, keep: bool = False) -> dict:
        d = self._trial_dir()
        out = copy_store(self.pristine, d / "out")
        job = {"op": "load", "path": str(out), "env": env or {}, "result": str(d / "result.json")}
        if kill_after is not None:
            job.update(kill_after=kill_after, send_signal=int(send_signal))
        r = self.server.run(job)
        rec = {"op": "load", "env": env, "kill_after": kill_after, **r, "problems": []}
        problems = rec["problems"]
        result = json.loads((d / "result.json").read_text()) if (d / "result.json").exists() else None
        rec["result"] = result
        rec["killed"] = r["signal"] is not None
        if r.get("hung"):
            problems.append(f"load did not stop within {HANG_LIMIT} s of the signal (killed): {result}")
        elif r["signal"] is None and r["code"] == 0 and result["digest"] != self.weights:
            problems.append(f"the load itself returned other weights (tier {result['tier']})")
        elif r["signal"] is None and r["code"] not in (0, 130):
            problems.append(f"load failed instead of dying: {result}")
        if store_part(out) != self.store_digest:
            problems.append("the at-rest store changed")
        if tree_digest(self.src) != self.src_digest:
            problems.append("the source model changed")
        problems += lying_sentinels(out)
        if r["signal"] is None and r["code"] == 130:
            litter = [p.name for p in out.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
            if litter:
                problems.append(f"interrupted load left temp files: {litter}")
        problems += self._check_loads(out, rec)
        if not problems and not keep:
            shutil.rmtree(d, ignore_errors=True)
        return rec

    def _check_loads(self, out: Path, rec: dict) -> list[str]:
        problems = []
        try:
            tier, digest = load_in_process(out)
            rec["next_load"] = tier
            if digest != self.weights:
                problems.append(f"the next load (tier {tier}) returned other weights than a clean build")
            ready = ready_tiers(out)
            if tier == "cold" and {k for k, v in ready.items() if v} != self.built:
                problems.append(f"a cold load did not rebuild the caches: {ready}")
            for name, ok in ready.items():
                if ok:
                    forced, digest = load_in_process(out, name)
                    if digest != self.weights:
                        problems.append(f"tier {name} is ready but holds other weights")
            problems += lying_sentinels(out)
        except Exception as e:  # noqa: BLE001
            problems.append(f"the next load failed: {type(e).__name__}: {e}")
        return problems


def lab_fixture():
    """A module-scoped pytest fixture `lab`: a CrashLab with its own fork server, cleaned up afterwards."""
    import pytest

    @pytest.fixture(scope="module")
    def lab(tmp_path_factory):
        # A real disk directory, never tmpfs: the trials must write the way production does, with O_DIRECT.
        root = tmp_path_factory.mktemp("lab")
        server = ForkServer(log=root / "server.log")
        try:
            yield CrashLab(root, server)
        finally:
            server.close()

    return lab


def summarize(records: list[dict]) -> dict:
    return {
        "trials": len(records),
        "killed_mid_run": sum(r["killed"] for r in records),
        "interrupted": sum(r.get("code") == 130 for r in records),
        "survived": sum(not r["problems"] for r in records),
        "failed": [r for r in records if r["problems"]],
    }


if __name__ == "__main__":
    serve()
