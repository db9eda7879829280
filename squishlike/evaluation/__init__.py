"""Model evaluation: perplexity on shipped prose and agreement with a reference model (`squishlike eval`).

What it reports:

- perplexity on `data/eval_prose.txt` (original prose that ships with the project);
- against a reference model (default: the source recorded in the manifest), on the same token windows:
  the reference's perplexity, teacher-forced top-1 agreement (fraction of predicted positions where the argmax
  of both models is the same token), and the mean KL(reference || model) of the next-token distributions;
- greedy-generation agreement over `data/eval_prompts.json` (see `sequence_agreement`).

`metrics` holds the pure metric functions, `run` the whole evaluation and its report, `data` the shipped texts.
All metrics are computed in float32; on Linux CPU preload OpenBLAS for speed (see squishlike/openblas.py).
"""

from .data import load_prompts, load_text
from .metrics import (
    DEFAULT_GEN_TOKENS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_WINDOW,
    GATE_MAX_INCREASE,
    STOP,
    ReferenceCache,
    Window,
    compare,
    decode_generation,
    greedy_agreement,
    greedy_generations,
    nll_sum,
    passes_gate,
    perplexity,
    prepare_for_eval,
    sequence_agreement,
    text_perplexity,
    token_windows,
    window_logprobs,
)
from .run import evaluate, format_report, load_float32, reference_from_manifest

__all__ = [
    "DEFAULT_GEN_TOKENS", "DEFAULT_MAX_TOKENS", "DEFAULT_WINDOW", "GATE_MAX_INCREASE", "STOP", "ReferenceCache",
    "Window", "compare", "decode_generation", "evaluate", "format_report", "greedy_agreement", "greedy_generations",
    "load_float32", "load_prompts", "load_text", "nll_sum", "passes_gate", "perplexity", "prepare_for_eval",
    "reference_from_manifest", "sequence_agreement", "text_perplexity", "token_windows", "window_logprobs",
]
