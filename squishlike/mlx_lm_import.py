"""`import mlx_lm` for `load`, without transformers' model registry until something asks for `AutoTokenizer`.

`import mlx_lm` runs `mlx_lm.tokenizer_utils`, whose first lines are `from transformers import AutoTokenizer` and,
at its end, `AutoTokenizer.register(NewlineTokenizer, ...)`. Resolving transformers' `AutoTokenizer` imports
`transformers.models`, whose `__init__` reads the source of every model transformers ships (about 1,650 files) to
build its lazy import table: ~0.5 s of CPU, a third of a whole `mlx_lm.load` process of SmolLM2 on the benchmark
VM (docs/design.md §3.5). A squishlike load never uses `AutoTokenizer`: its tokenizer is built from the store's
facts (squishlike/tokenizer.py), and it needs mlx_lm only for the model classes and `TokenizerWrapper`.

So while `load` imports mlx_lm, `transformers.AutoTokenizer` is a stand-in (`_Deferred`) that records mlx_lm's
`register` call. Afterwards transformers answers `AutoTokenizer` itself again, as always, and the real class is
imported by whatever first asks for it: mlx_lm's own tokenizer load (through the stand-in that
`mlx_lm.tokenizer_utils` keeps, which then replaces itself there with the real class), or any other code. Either
way the recorded registrations run as transformers' `tokenization_auto` module finishes importing
(`_RegisterOnImport`), so `AutoTokenizer` knows mlx_lm's `NewlineTokenizer` before anyone can use it, exactly as
after a plain `import mlx_lm`.

A process that imported mlx_lm, or resolved `AutoTokenizer`, before its first `load` has paid for the registry
already: then this is a plain `import mlx_lm`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any

AUTO_MODULE = "transformers.models.auto.tokenization_auto"  # where transformers defines AutoTokenizer
_lock = threading.Lock()


def import_mlx_lm() -> None:
    """`import mlx_lm`, leaving transformers' `AutoTokenizer` (and its model registry) to its first use."""
    if "mlx_lm" in sys.modules:
        return
    with _lock:
        import transformers

        if "mlx_lm" in sys.modules or AUTO_MODULE in sys.modules or "AutoTokenizer" in vars(transformers):
            import mlx_lm  # noqa: F401  the registry is paid for already (or mlx_lm is): nothing to defer

            return
        registrations: list[tuple[tuple, dict]] = []
        finder = _RegisterOnImport(registrations)
        sys.meta_path.insert(0, finder)
        stand_in = _Deferred(registrations)
        vars(transformers)["AutoTokenizer"] = stand_in  # what `from transformers import AutoTokenizer` binds
        try:
            import mlx_lm  # noqa: F401
        except BaseException:
            sys.meta_path.remove(finder)
            raise
        finally:
            vars(transformers).pop("AutoTokenizer", None)  # transformers' own lazy attribute again


class _Deferred:
    """transformers' `AutoTokenizer` to `mlx_lm.tokenizer_utils` until it uses it: `register` calls are recorded
    (they run when the real class is imported); any other attribute imports the real class, which then takes the
    stand-in's place in mlx_lm.tokenizer_utils."""

    def __init__(self, registrations: list[tuple[tuple, dict]]):
        self._registrations = registrations

    def register(self, *args: Any, **kwargs: Any) -> None:
        self._registrations.append((args, kwargs))

    def __getattr__(self, name: str) -> Any:
        from transformers.models.auto.tokenization_auto import AutoTokenizer  # the registrations run here


        tokenizer_utils = sys.modules["mlx_lm.tokenizer_utils"]
        if tokenizer_utils.AutoTokenizer is self:
            tokenizer_utils.AutoTokenizer = AutoTokenizer
        return getattr(AutoTokenizer, name)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds AUTO_MODULE as the import system would, and has it run the recorded registrations once it is
    executed; then leaves sys.meta_path (it is needed once per process)."""

    def __init__(self, registrations: list[tuple[tuple, dict]]):
        self.registrations = registrations

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != AUTO_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRegister(spec.loader, self.registrations)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """A module loader that runs the recorded `AutoTokenizer.register` calls after the module's own code."""

    def __init__(self, loader: importlib.abc.Loader, registrations: list[tuple[tuple, dict]]):
        self.loader, self.registrations = loader, registrations

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: the file loader's own
        return getattr(self.loader, name)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        for args, kwargs in self.registrations:
            module.AutoTokenizer.register(*args, **kwargs)
        self.registrations.clear()
