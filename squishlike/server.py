"""`squishlike server`: mlx_lm's OpenAI-compatible HTTP server, serving several models at once, Ollama style.

mlx_lm's server keeps one model and swaps it on every request for another, clearing MLX's buffer cache each time.
Here every model that is asked for gets its own mlx_lm ResponseGenerator (its generation thread, batching and prompt
cache, unchanged), and a ModelManager decides what stays resident:

- Which models may be served (ModelPolicy): the `--model` the server was started with, the models under its
  `--model-dir` directories, and Hugging Face repo ids only with `--allow-hub`. Any other name gets the same 404,
  whatever exists on disk, so a client can neither probe the disk nor make the server build a tier cache in a
  directory it chose.
- How long: a model is loaded on its first request (or at start with `--preload`), and unloaded once idle for its
  keep-alive (`--keep-alive`, or a request's `keep_alive`), its memory then given back to the system.
- How many: resident models stay within `--max-memory`; a load evicts the least recently used idle models first.
  Their buffers stay in MLX's buffer cache (limited to the budget less the resident models), so the next load
  reuses them instead of faulting in fresh pages; the cache is cleared only when the budget needs the room.
- Who waits: models generate concurrently, each on its own thread, so a long generation never blocks a request
  for another resident model. A request that needs memory held by models that are generating waits for them at
  most `--max-wait` seconds, then gets HTTP 503.

`GET /api/ps` lists what is resident, its size and when it goes; the log says the same at each load and unload.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator, _run_http_server, load_processor

from .errors import ModelNotFoundError, ServerBusyError, SquishError
from .load.budget import files_bytes
from .load.experts import expert_cache
from .npydir import NpyDir, is_npydir
from .tiers.base import runtime_bytes

REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
MODEL_FILES = ("config.json", "manifest.json")  # a model directory holds one of these; a GGUF is one file
DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}


def parse_duration(value: Any) -> float | None:
    """A keep-alive as Ollama writes it: seconds (a number or "30s", "5m", "1h"); negative keeps the model forever
    (None). Raises ValueError naming the value."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = re.fullmatch(r"(-?\d+(?:\.\d+)?)\s*([smh]?)", str(value).strip())
        if match is None:
            raise ValueError(f"keep_alive={value!r}: expected seconds, or a duration such as '30s', '5m', '1h'")
        seconds = float(match[1]) * DURATION_UNITS[match[2]]
    return None if seconds < 0 else seconds


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class ServerOptions:
    """squishlike's own server flags (beside mlx_lm's)."""
    model_dirs: list[Path] = field(default_factory=list)
    allow_hub: bool = False
    max_memory: int = field(default_factory=lambda: physical_memory() // 2)
    keep_alive: float | None = 300.0
    max_wait: float = 60.0
    preload: bool = False


class ModelPolicy:
    """Which model names a request may use, and the path or repo id each stands for."""

    def __init__(self, default: str | None, model_dirs: list[Path], allow_hub: bool):
        self.default = default
        self.model_dirs = [Path(os.path.realpath(d)) for d in model_dirs]
        self.allow_hub = allow_hub

    def resolve(self, name: str) -> str:
        """The path or repo id `name` serves; ModelNotFoundError, the same for any name not served."""
        if self.default is not None and name in ("default_model", self.default):
            return self.default
        for directory in self.model_dirs:
            try:
                path = Path(os.path.realpath(directory / name))  # an absolute name replaces the directory
                if path.parent == directory and is_model(path):
                    return str(path)
            except (OSError, ValueError):  # a name too long for the system, a NUL byte
                continue
        if self.allow_hub and REPO_ID.fullmatch(name) and not os.path.lexists(name):
            return name
        served = "its --model and the models directly under its --model-dir directories"
        raise ModelNotFoundError(name, f"this server serves only {served}" + (" and Hub repo ids" * self.allow_hub))

    def listed(self) -> list[str]:
        """The names of the models this server can serve from disk: its --model, then each --model-dir's models."""
        names = [self.default] if self.default is not None else []
        for directory in self.model_dirs:
            names += sorted(p.name for p in directory.iterdir() if is_model(p))
        return names


def is_model(path: Path) -> bool:
    """A model directory (an npy-dir, an HF or MLX checkpoint) or a GGUF file, that is no link out of its place."""
    if path.is_symlink():
        return False
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and any((path / f).is_file() for f in MODEL_FILES)


@dataclass
class Resident:
    """A model in memory: its own mlx_lm generation thread, its size, and when it goes."""
    name: str
    generator: Any  # mlx_lm.server.ResponseGenerator
    nbytes: int
    keep_alive: float | None
    last_used: float = field(default_factory=time.time)
    in_flight: int = 0

    @property
    def expires_at(self) -> float | None:
        if self.in_flight or self.keep_alive is None:
            return None
        return self.last_used + self.keep_alive

    def describe(self) -> dict[str, Any]:
        expires = self.expires_at
        return {"name": self.name, "size": self.nbytes, "in_flight": self.in_flight,
                "last_used": iso(self.last_used), "expires_at": None if expires is None else iso(expires)}


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def model_nbytes(model: Any) -> int:
    """A model's memory: its parameters, and for a model whose experts are streamed (--max-memory) its cache of
    experts and the stack a call gathers beside it: the whole of its budget."""
    cache = expert_cache(model)
    streamed = cache.capacity + cache.gathered if cache else 0
    return sum(v.nbytes for _, v in tree_flatten(model.parameters())) + streamed


class ModelManager:
    """The models in memory, within a budget. Stands where mlx_lm's server has its one ResponseGenerator (the HTTP
    handler reads `cli_args` and `is_healthy` from it); `acquire` gives a request its model's generator."""

    def __init__(self, cli_args: Any, options: ServerOptions, load: Callable[..., Any]):
        self.cli_args = cli_args
        self.options = options
        self.policy = ModelPolicy(cli_args.model, options.model_dirs, options.allow_hub)
        self._load = load
        self._resident: OrderedDict[str, Resident] = OrderedDict()  # least recently used first
        self._sizes: dict[str, int] = {}  # what each model took when it was last loaded
        self._changed = threading.Condition()  # guards _resident; notified when a model is released or unloaded
        self._loading = threading.Lock()  # one load at a time, so that two never count the same free memory
        self._stopped = threading.Event()
        # Every load runs on this one thread: MLX gives each thread that evaluates its own streams, and keeps their
        # threads for the life of the process.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="squishlike-load")
        # MLX's own limit on its buffer cache: the slack a process running one model (generate) has
        self._least_mlx_cache = mx.set_cache_limit(options.max_memory)
        threading.Thread(target=self._unload_idle, name="squishlike-keep-alive", daemon=True).start()

    @property
    def is_healthy(self) -> bool:
        with self._changed:
            return all(r.generator.is_healthy for r in self._resident.values())

    def acquire(self, name: str, keep_alive: Any = None) -> Resident:
        """The resident model `name` names, loaded first if it is not, marked in use until `release`. A request
        for a resident model never waits for another model's load."""
        keep = self.options.keep_alive if keep_alive is None else parse_duration(keep_alive)
        path = self.policy.resolve(name)
        with self._changed:
            resident = self._use(path, keep)
        if resident is not None:
            return resident
        with self._loading:
            with self._changed:
                resident = self._use(path, keep)  # loaded by another request meanwhile
                if resident is not None:
                    return resident
                self._make_room(path)
            try:
                return self._load_resident(path, keep)
            except ModelNotFoundError as e:  # a repo id: its message names this machine's HF cache
                logging.error(str(e))
                raise ModelNotFoundError(name, "cannot be had from the Hugging Face Hub here; the server's log "
                                               "says why") from None

    def _use(self, path: str, keep_alive: float | None) -> Resident | None:
        """The resident model at `path`, marked in use (with _changed held); None if it is not resident."""
        resident = self._resident.get(path)
        if resident is not None:
            self._resident.move_to_end(path)
            resident.in_flight += 1
            resident.keep_alive = keep_alive
        return resident

    def release(self, resident: Resident) -> None:
        with self._changed:
            resident.in_flight -= 1
            resident.last_used = time.time()
            self._changed.notify_all()

    def resident(self) -> dict[str, Any]:
        """What `GET /api/ps` answers: the resident models, most recently used first, and the memory figures."""
        with self._changed:
            models = [r.describe() for r in reversed(self._resident.values())]
        return {"models": models, "budget": self.options.max_memory, "resident": sum(m["size"] for m in models),
                "mlx_cache": mx.get_cache_memory()}

    def preload(self) -> None:
        if self.policy.default is not None:
            self.release(self.acquire(self.policy.default))

    def stop_and_join(self) -> None:
        self._stopped.set()
        with self._changed:
            for path in list(self._resident):
                self._unload(path, "the server stops", release_memory=True)

    def _load_resident(self, path: str, keep_alive: float | None) -> Resident:
        started = time.perf_counter()
        tokenizer_config = {"trust_remote_code": self.cli_args.trust_remote_code}
        if self.cli_args.chat_template:
            tokenizer_config["chat_template"] = self.cli_args.chat_template
        loaded = self._loader.submit(self._load, path, tokenizer_config=tokenizer_config, return_config=True,
                                     trust_remote_code=self.cli_args.trust_remote_code).result()
        provider = ResidentProvider(self.cli_args, path, loaded)
        generator = ResponseGenerator(provider, LRUPromptCache(self.cli_args.prompt_cache_size))
        nbytes = model_nbytes(provider.model)
        resident = Resident(path, generator, nbytes, keep_alive, in_flight=1)  # for the request that asked
        with self._changed:
            self._resident[path] = resident
            self._sizes[path] = nbytes
            self._fit(path)
            self._bound_mlx_cache()
            total = sum(r.nbytes for r in self._resident.values())
        logging.info(f"loaded {path}: {gb(nbytes)} in {time.perf_counter() - started:.2f} s; resident "
                     f"{len(self._resident)} models, {gb(total)} of the {gb(self.options.max_memory)} budget")
        return resident

    def _make_room(self, path: str) -> None:
        """Unload idle models, least recently used first, until `path` fits the budget beside the rest: at the size
        it took when last loaded, or the size expected, a guess checked once it is loaded (`_fit`). Waits up to
        --max-wait for models that are generating to finish; then ServerBusyError."""
        needed = self._sizes.get(path) or expected_nbytes(path)
        deadline = time.monotonic() + self.options.max_wait
        while self._resident_nbytes() + needed > self.options.max_memory:
            idle = [p for p, r in self._resident.items() if not r.in_flight]
            if idle:
                self._unload(idle[0], f"to make room for {path}", release_memory=False)
            elif not self._resident or not self._changed.wait(max(0.0, deadline - time.monotonic())):
                if not self._resident:
                    break  # larger than the budget alone: it is served all the same, the only one resident
                raise ServerBusyError(f"{path}: no room within --max-memory while {', '.join(self._resident)} "
                                      f"generate; waited {self.options.max_wait:g} s (--max-wait)")
        if self._resident_nbytes() + mx.get_cache_memory() + needed > self.options.max_memory:
            give_back_memory()  # the cached buffers are not enough for it: give them back before it faults pages in

    def _fit(self, loaded: str) -> None:
        """After a load whose size was a guess: unload idle models but `loaded` until the budget holds."""
        while self._resident_nbytes() > self.options.max_memory:
            idle = [p for p, r in self._resident.items() if not r.in_flight and p != loaded]
            if not idle:
                break
            self._unload(idle[0], f"to make room for {loaded}", release_memory=True)

    def _resident_nbytes(self) -> int:
        return sum(r.nbytes for r in self._resident.values())

    def _bound_mlx_cache(self) -> None:
        """Let MLX's buffer cache hold what the budget leaves beside the resident models (with _changed held), and
        MLX's own limit at least. Freed buffers wait there, so an evicted model's serve the next load; but they are
        the process's memory all the same: a limit of the whole budget let a streamed model's prompt pass keep
        every gathered stack it freed, on top of the model (1.4 GB over a 3 GB budget, docs/design.md §9)."""
        mx.set_cache_limit(max(self._least_mlx_cache, self.options.max_memory - self._resident_nbytes()))

    def _unload(self, path: str, why: str, release_memory: bool) -> None:
        """Stop a model's generation thread and drop it (with _changed held); its buffers go to MLX's cache, or
        back to the system with `release_memory`."""
        resident = self._resident.pop(path)
        self._bound_mlx_cache()  # room for the buffers it frees, which the next load reuses
        resident.generator.stop_and_join()  # the thread drops the model and its prompt cache as it ends
        del resident
        gc.collect()
        if release_memory:
            give_back_memory()
        logging.info(f"unloaded {path} ({why}); resident {len(self._resident)} models, "
                     f"{gb(self._resident_nbytes())}, MLX cache {gb(mx.get_cache_memory())}")
        self._changed.notify_all()

    def _unload_idle(self) -> None:
        while not self._stopped.wait(0.25):
            with self._changed:
                now = time.time()
                for path, r in list(self._resident.items()):
                    if r.expires_at is not None and r.expires_at <= now:
                        self._unload(path, f"idle for its keep-alive of {r.keep_alive:g} s", release_memory=True)


def give_back_memory() -> None:
    """Return freed model memory to the system: MLX's buffer cache, and on Linux glibc's heap, which keeps the
    blocks MLX's CPU allocator freed until it is trimmed."""
    mx.clear_cache()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def expected_nbytes(path: str) -> int:
    """What a model never loaded here is expected to take: a store's tensors in their runtime dtype (what a dense
    tier holds, at most), another model's files on disk (0 for a repo id not downloaded yet)."""
    if is_npydir(path):
        return runtime_bytes(NpyDir(path))
    return files_bytes(path)


def gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


class ResidentProvider(ModelProvider):
    """mlx_lm's ModelProvider holding one loaded model: its generation thread's `load` returns it."""

    def __init__(self, cli_args: Any, path: str, loaded: tuple[Any, Any, dict[str, Any]]):
        super().__init__(cli_args)
        model, tokenizer, config = loaded
        if cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.model_key = (path, None, None)
        self.model, self.tokenizer = model, tokenizer
        self.processor = load_processor(model, config)
        self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))

    def load(self, model_path: str, adapter_path: str | None = None, draft_model_path: str | None = None):
        return self.model, self.tokenizer

    def load_default(self) -> None:
        pass


class Handler(APIHandler):
    """mlx_lm's handler, with each completion served by its model's own generator, /v1/models listing what the
    policy serves, and /api/ps what is resident."""

    def handle_completion(self, request: Any, stop_words: list[str]) -> None:
        manager = self.response_generator
        try:
            resident = manager.acquire(self.requested_model, self.body.get("keep_alive"))
        except ModelNotFoundError as e:
            return self._reply(404, {"error": str(e)})
        except ServerBusyError as e:
            return self._reply(503, {"error": str(e)})
        except (SquishError, ValueError, OSError) as e:  # a bad keep_alive; a store that does not load
            return self._reply(400 if isinstance(e, ValueError) else 500, {"error": str(e)})
        self.response_generator = resident.generator  # mlx_lm's handle_completion asks it for the tokens
        try:
            super().handle_completion(request, stop_words)
        finally:
            self.response_generator = manager
            manager.release(resident)

    def handle_models_request(self) -> None:
        names = self.response_generator.policy.listed()
        names += [m["name"] for m in self.response_generator.resident()["models"] if m["name"] not in names]
        self._reply(200, {"object": "list",
                          "data": [{"id": n, "object": "model", "created": self.created} for n in names]})

    def do_GET(self) -> None:
        if self.path == "/api/ps":
            return self._reply(200, self.response_generator.resident())
        super().do_GET()

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        self._set_completion_headers(status)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())
        self.wfile.flush()


def serve(host: str, port: int, cli_args: Any, options: ServerOptions, load: Callable[..., Any]) -> None:
    """Serve mlx_lm's HTTP API on host:port with a ModelManager (what mlx_lm.server.run does with one model)."""
    if cli_args.adapter_path or cli_args.draft_model:
        raise ValueError("adapter_path and draft_model are not served with model management; use `mlx_lm server`")
    manager = ModelManager(cli_args, options, load)
    if options.preload:
        manager.preload()
    _run_http_server(host, port, manager, handler_class=Handler)
