"""Typed errors. Every message names the file (or directory) and what is wrong with it.

Each class also derives from the builtin a caller would naturally catch (ValueError, FileNotFoundError, ...),
so code written against `mlx_lm.load` keeps working.
"""

from __future__ import annotations

from os import PathLike


class SquishError(Exception):
    """Base of every error squishlike raises on purpose."""


class FormatError(SquishError, ValueError):
    """A file is malformed, truncated, or uses a dtype / quant type / layout we do not read."""

    def __init__(self, path: str | PathLike, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class IntegrityError(FormatError):
    """A checksum or digest does not match what the manifest, sentinel or Ollama manifest says."""


class JournalError(FormatError):
    """An interrupted writer's journal cannot be resumed from (missing, unreadable, or not what the directory
    holds): compress starts over."""


class UnknownFormatError(FormatError):
    """Nothing on disk looks like a model format squishlike reads."""


class UnsupportedArchitectureError(SquishError, ValueError):
    """The config names a model architecture we have no rule table (or no mlx_lm class) for."""


class MissingTensorError(SquishError, KeyError):
    """A tensor the architecture needs is absent from the source."""

    def __init__(self, path: str | PathLike, name: str, problem: str = "tensor is missing"):
        self.path = str(path)
        self.name = name
        super().__init__(f"{self.path}: {name}: {problem}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class ModelNotFoundError(SquishError, FileNotFoundError):
    """A model reference is neither a local path nor a Hugging Face repo that can be had (offline and not cached,
    no such repo, gated, no such revision)."""

    def __init__(self, ref: str, problem: str):
        self.ref = ref
        self.problem = problem
        super().__init__(f"{ref}: {problem}")

    def __str__(self) -> str:  # FileNotFoundError would format it as "[Errno ...]"
        return self.args[0]


class IncompatibleVersionError(SquishError, RuntimeError):
    """An installed package is outside the versions a squishlike seam into it was tested on."""


class OutputExistsError(SquishError, FileExistsError):
    """compress/export refuses to write into an existing, non-empty output without force=True, and compress
    never replaces a directory that is not an npy-dir."""


class ServerBusyError(SquishError, RuntimeError):
    """`squishlike server`: the memory a request's model needs is held by models still generating (HTTP 503)."""


class TierNotReadyError(SquishError, RuntimeError):
    """A tier was forced with tier=... but its sentinel is missing, stale or invalid."""


class DirectoryBusyError(SquishError, RuntimeError):
    """Another process holds the lock on this directory (two compress runs aimed at one OUT)."""


class EnvironmentSwitchError(SquishError, ValueError):
    """A SQUISHLIKE_* environment switch holds something other than 1 or 0 (squishlike/environment.py)."""


class QuantizationError(SquishError, ValueError):
    """Input to a quantizer is unusable (NaN/inf, bad group size, shape)."""


class AccuracyGateError(SquishError, RuntimeError):
    """A store failed the accuracy gate its format requires (INT3, docs/format.md §6.4); it was not written."""


class UnknownOptionError(SquishError, TypeError):
    """A keyword argument the function does not take (a typo); the message lists the valid ones."""


class BudgetError(SquishError, ValueError):
    """A size target no choice of widths can meet (below the smallest store the model can have)."""


class MemoryBudgetError(SquishError, MemoryError):
    """A model cannot be loaded within the memory budget it was given (max_memory): checked before anything is
    read, naming what it needs and what was given."""

    def __init__(self, path: str | PathLike, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
