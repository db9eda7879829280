"""Keyword options of the public API: a misspelt one is named with the valid ones, not only rejected."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from .errors import UnknownOptionError

P = ParamSpec("P")
R = TypeVar("R")


def checks_options(function: Callable[P, R]) -> Callable[P, R]:
    """Wrap `function` so that an unknown keyword raises UnknownOptionError naming it, the closest valid
    option, and every valid one; the signature (and so help() and type checkers) stays the function's own."""
    parameters = inspect.signature(function).parameters
    valid = [name for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY]

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        for name in kwargs:
            if name not in parameters:
                close = difflib.get_close_matches(name, valid, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise UnknownOptionError(
                    f"{function.__name__}() has no option {name!r}; {hint}valid options: {', '.join(valid)}"
                )
        return function(*args, **kwargs)

    return wrapper
