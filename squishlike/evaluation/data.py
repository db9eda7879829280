"""The texts that ship with squishlike (squishlike/data/): the evaluation prose, the calibration text and the
prompts of the greedy-generation comparison."""

from __future__ import annotations

import importlib.resources
import json

# Shipped texts, by name (files in squishlike/data/).
DATA_FILES: dict[str, str] = {
    "eval_prose": "eval_prose.txt",
    "calibration": "calibration.txt",
    "eval_prompts": "eval_prompts.json",
}


def load_text(name: str = "eval_prose") -> str:
    """The text of a shipped data file: "eval_prose", "calibration" or "eval_prompts" (raw JSON)."""
    if name not in DATA_FILES:
        raise ValueError(f"unknown data file {name!r}; known: {sorted(DATA_FILES)}")
    resource = importlib.resources.files("squishlike").joinpath("data", DATA_FILES[name])
    return resource.read_text(encoding="utf-8")


def load_prompts() -> list[str]:
    """The shipped prompts for greedy-generation agreement."""
    prompts = json.loads(load_text("eval_prompts"))
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("eval_prompts.json must be a JSON list of strings")
    return prompts
