"""`squishlike eval`: load a model and its reference in float32, measure them on the shipped texts, report."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.nn as nn

from .data import load_prompts, load_text
from .metrics import (
    DEFAULT_GEN_TOKENS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_WINDOW,
    Window,
    compare,
    decode_generation,
    greedy_generations,
    perplexity,
    prepare_for_eval,
    sequence_agreement,
    token_windows,
)


def reference_from_manifest(model_path: str | Path) -> str | None:
    """The source model recorded in an npy-dir's manifest, if there is one and it still exists."""
    from ..npydir import read_source

    source = read_source(Path(model_path))
    return str(source.path) if source is not None and Path(source.path).exists() else None


def load_float32(path: str | Path) -> tuple[nn.Module, Any]:
    """Load a model and its tokenizer, prepared for evaluation (dequantized, float32)."""
    from ..loader import load

    model, tokenizer = load(path)
    return prepare_for_eval(model), tokenizer


def _timed(timings: dict[str, float], key: str, fn: Callable, *args) -> Any:
    """fn(*args), its wall time recorded as timings[key]."""
    started = time.perf_counter()
    result = fn(*args)
    timings[key] = time.perf_counter() - started
    return result


def _perplexity_alone(model: nn.Module, windows: list[Window], progress: bool) -> dict[str, Any]:
    return {"perplexity": perplexity(model, windows, progress), "positions": sum(w.n_scored for w in windows),
            "windows": len(windows)}


def _greedy_comparison(model: nn.Module, reference: nn.Module, tokenizer: Any, prompts: list[str],
                       gen_tokens: int) -> dict[str, Any]:
    """Greedy continuations of both models on `prompts`: their agreement, and each pair as text."""
    ours = greedy_generations(model, tokenizer, prompts, gen_tokens)
    theirs = greedy_generations(reference, tokenizer, prompts, gen_tokens)
    return {
        "greedy_agreement": sequence_agreement(ours, theirs),
        "greedy_exact": sum(a == b for a, b in zip(ours, theirs)),
        "greedy_prompts": len(prompts),
        "gen_tokens": gen_tokens,
        "greedy_samples": [
            {"prompt": p, "model": decode_generation(tokenizer, a), "reference": decode_generation(tokenizer, b)}
            for p, a, b in zip(prompts, ours, theirs)
        ],
    }


def evaluate(
    model_path: str | Path,
    reference_path: str | Path | None = None,
    *,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    window: int = DEFAULT_WINDOW,
    stride: int | None = None,
    gen_tokens: int = DEFAULT_GEN_TOKENS,
    prompts: Sequence[str] | None = None,
    text: str | None = None,
    quiet: bool = False,
    loader: Callable[[str | Path], tuple[nn.Module, Any]] = load_float32,
) -> dict[str, Any]:
    """Evaluate the model at `model_path`, against `reference_path` (default: the manifest's source) if any.

    Perplexity is measured on the shipped eval prose (or `text`), its first `max_tokens` tokens, in windows of
    `window` tokens; the reference comparison adds reference perplexity, top-1 agreement, mean KL and greedy
    agreement over the shipped prompts (or `prompts`), `gen_tokens` tokens each. The model's own tokenizer
    tokenizes everything (the reference must share its vocabulary).

    Returns the result as a JSON-serialisable dict (`format_report` writes it for people); progress goes to
    stderr unless `quiet`.
    """

    def log(message: str) -> None:
        if not quiet:
            print(message, file=sys.stderr, flush=True)

    from ..formats import detect_format
    from ..provider import locate

    for path in (model_path, reference_path):  # a wrong path is named before a load that can take minutes
        if path is not None:
            detect_format(locate(path))
    timings: dict[str, float] = {}
    model, tokenizer = _timed(timings, "load_model_s", loader, model_path)
    log(f"loaded {model_path} in {timings['load_model_s']:.1f} s")
    if reference_path is None:
        reference_path = reference_from_manifest(model_path)
    prose = load_text("eval_prose") if text is None else text
    windows = token_windows(tokenizer, prose, window=window, stride=stride, max_tokens=max_tokens)
    result: dict[str, Any] = {
        "model": str(model_path),
        "reference": None if reference_path is None else str(reference_path),
        "text": "eval_prose" if text is None else "custom",
        "max_tokens": max_tokens,
        "window": window,
        "stride": window if stride is None else stride,
    }
    if reference_path is None:
        result.update(_timed(timings, "perplexity_s", _perplexity_alone, model, windows, not quiet))
    else:
        reference, _ = _timed(timings, "load_reference_s", loader, reference_path)
        log(f"loaded reference {reference_path} in {timings['load_reference_s']:.1f} s")
        result.update(_timed(timings, "compare_s", compare, model, reference, windows, not quiet))
        log(f"teacher-forced comparison in {timings['compare_s']:.1f} s")
        prompt_list = list(load_prompts() if prompts is None else prompts)
        result.update(_timed(timings, "greedy_s", _greedy_comparison, model, reference, tokenizer, prompt_list,
                             gen_tokens))
        result["perplexity_increase"] = result["perplexity"] / result["reference_perplexity"] - 1.0
        log(f"greedy generation in {timings['greedy_s']:.1f} s")
    result["timings"] = timings
    return result


def format_report(result: dict[str, Any]) -> str:
    """A short human-readable report of an `evaluate` result."""
    lines = [f"model:      {result['model']}"]
    windows = f"{result['windows']} window" + ("s" if result["windows"] != 1 else "")
    lines.append(f"text:       {result['text']}, {result['positions']} scored tokens in {windows}")
    lines.append(f"perplexity: {result['perplexity']:.4f}")
    if result.get("reference") is not None:
        increase = result["perplexity"] / result["reference_perplexity"] - 1.0
        lines += [
            f"reference:  {result['reference']}",
            f"reference perplexity: {result['reference_perplexity']:.4f} ({increase:+.2%})",
            f"top-1 agreement:      {result['top1_agreement']:.4f}",
            f"mean KL(ref || model): {result['kl_mean']:.6f} nats (max {result['kl_max']:.4f})",
            f"greedy agreement:     {result['greedy_agreement']:.4f} "
            f"({result['greedy_exact']}/{result['greedy_prompts']} prompts identical, {result['gen_tokens']} tokens each)",
        ]
    else:
        lines.append("reference:  none (no --reference given and no source recorded in a manifest)")
    return "\n".join(lines)
