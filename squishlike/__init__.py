"""squishlike: store transformer weights compressed at rest, load them fast. A drop-in for `mlx_lm.load`.

    import squishlike
    squishlike.compress("model-dir", "model-int4", format="int4")
    model, tokenizer = squishlike.load("model-int4")     # same arguments and result as mlx_lm.load

The public API is these names; everything else is an implementation detail.
"""

from __future__ import annotations

from importlib import import_module

__version__ = "0.1.0"

# name -> module; imported on first use so `import squishlike` (and `squishlike --help`) stays fast.
_API = {
    "load": "loader",
    "compress": "compressor",
    "open_weights": "provider",
    "export": "exporter",
}

__all__ = [*_API, "__version__"]


def __getattr__(name: str):
    if name in _API:
        return getattr(import_module(f".{_API[name]}", __name__), name)
    raise AttributeError(f"module 'squishlike' has no attribute {name!r}")
