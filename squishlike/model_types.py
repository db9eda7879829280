"""Which mlx_lm module builds a config's `model_type`, found without importing it.

mlx_lm looks a model type up as the module `mlx_lm.models.<model_type>` (after its remappings) and takes that
module's `Model` and `ModelArgs`. Every other module in that package (`cache`, `base`, `rope_utils`,
`switch_layers`, ...) imports as well, so a config naming one would import it and then fail with a bare
AttributeError. Here a model type is a model only when its module's source defines both names at its top level:
read and parsed, never imported, so a config cannot make squishlike import a module that builds no model.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from typing import Any

from .errors import UnsupportedArchitectureError

PACKAGE = "mlx_lm.models"
MODEL_NAMES = ("Model", "ModelArgs")  # what mlx_lm takes from a model type's module
_MODULE_NAME = re.compile(r"[A-Za-z0-9_-]+")  # mlx_lm's module names: "llama", "lfm2-vl" (no dots, no paths)


def mlx_lm_module(config: dict[str, Any]) -> str:
    """The module of `PACKAGE` that builds `config`'s model (`config["model_type"]`, remapped as mlx_lm remaps it,
    by `architectures` too). UnsupportedArchitectureError (a ValueError, as mlx_lm's own refusal is) when there is
    no such module, or when it is no model: nothing is imported from `PACKAGE` but the package itself."""
    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING

    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise UnsupportedArchitectureError(f"model_type {model_type!r} is not a name")
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    module = next((MODEL_ARCHITECTURE_REMAPPING[(model_type, a)] for a in architectures
                   if isinstance(a, str) and (model_type, a) in MODEL_ARCHITECTURE_REMAPPING),
                  MODEL_REMAPPING.get(model_type, model_type))
    if not _is_model_module(module):
        raise UnsupportedArchitectureError(f"Model type {model_type} not supported.")
    return module


def mlx_lm_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx_lm's (Model, ModelArgs) for `config`, as `mlx_lm.utils._get_classes` returns them, once
    `mlx_lm_module` has found that its module builds a model."""
    from mlx_lm.utils import _get_classes

    mlx_lm_module(config)
    return _get_classes(config)


@functools.lru_cache(maxsize=None)
def _is_model_module(name: str) -> bool:
    """Whether `PACKAGE.name` exists and its source defines MODEL_NAMES at its top level (as a class, an
    assignment or an import)."""
    if not _MODULE_NAME.fullmatch(name):
        return False
    spec = importlib.util.find_spec(f"{PACKAGE}.{name}")  # imports PACKAGE, not the module
    if spec is None or spec.loader is None or not hasattr(spec.loader, "get_source"):
        return False
    try:
        tree = ast.parse(spec.loader.get_source(spec.name) or "")
    except (OSError, SyntaxError, ValueError):
        return False
    defined = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom):
            defined.update(alias.asname or alias.name for alias in node.names)
    return defined.issuperset(MODEL_NAMES)
