"""squishlike: store transformer weights compressed at rest, load them fast. A drop-in for `mlx_lm.load`.

    import squishlike
    squishlike.compress("model-dir", "model-int4", scheme="int4")
    model, tokenizer = squishlike.load("model-int4")     # same arguments and result as mlx_lm.load

The public API is the names in `__all__`: `load`, `sharded_load` (under `mlx.launch`), `compress`,
`open_weights`, `export`, `__version__`, and the `errors` module whose exceptions they raise. Everything else is
an implementation detail.
"""

from __future__ import annotations

from importlib import import_module

__version__ = "0.1.0"

# name -> module that defines it; imported on first use so `import squishlike` (and `squishlike --help`) stays fast.
_API = {
    "load": "loader",
    "sharded_load": "load.sharded",
    "compress": "compressor",
    "open_weights": "provider",
    "export": "exporter",
}

__all__ = [*_API, "errors", "__version__"]

# The package squishlike/load/ (load-side code) shares its name with the function `load`. Importing a subpackage
# sets it as an attribute of its parent, which would hide the function from __getattr__ below; imported here
# first (it imports nothing itself) and the attribute removed, later imports of it find it in sys.modules and
# leave this namespace alone.
from . import load as _load_package  # noqa: E402

del load, _load_package  # noqa: F821


def __getattr__(name: str) -> object:
    if name in _API:
        return getattr(import_module(f".{_API[name]}", __name__), name)
    if name == "errors":
        return import_module(".errors", __name__)
    raise AttributeError(f"module 'squishlike' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
