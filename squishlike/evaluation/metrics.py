"""Pure metrics of a model on token windows, all in float32: perplexity, teacher-forced top-1 agreement and KL
against a reference, greedy-generation agreement, and the INT3 accuracy gate's verdict.

Logits are cast to float32 before the log-softmax; `prepare_for_eval` dequantizes quantized layers and casts
floating-point parameters to float32, because bf16 and quantized matmuls are very slow on CPU.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn

from .data import load_text

# Windowing. Non-overlapping windows of 1024 tokens: every token is fed through the model exactly once, so the
# cost is linear in the text length, and 1024 tokens of context is long enough that perplexity is close to what
# a longer context gives on prose made of ~500-word pieces. The first token of each window is not scored (it has
# no context inside the window). A smaller stride (overlapping windows) gives every scored token more context at
# a proportional extra cost; the overlap is then used as context only and never scored twice.
DEFAULT_WINDOW = 1024
# The whole shipped prose is ~6,200 SmolLM2 tokens. On 2 shared CPU cores with OpenBLAS a float32 forward pass
# of SmolLM2-135M runs at ~60-100 tokens/s, so this cap (the first third of the prose) keeps the teacher-forced
# part of a default comparison (two models) to ~40-60 s. None means no cap.
DEFAULT_MAX_TOKENS: int | None = 2048
DEFAULT_GEN_TOKENS = 32

# The INT3 accuracy gate (docs/format.md §6.4): candidate perplexity at most +8 % over the reference's.
GATE_MAX_INCREASE = 0.08


@dataclass(frozen=True)
class Window:
    """A slice of the tokenized text fed to the model in one forward pass.

    The model reads `tokens[:-1]`; the logits at input position i predict `tokens[i + 1]`. Only the targets
    `tokens[first_target:]` are scored (first_target >= 1); earlier tokens are context only.
    """

    tokens: tuple[int, ...]
    first_target: int = 1

    @property
    def n_scored(self) -> int:
        return max(0, len(self.tokens) - self.first_target)


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text`, with the tokenizer's default special tokens (a BOS where the tokenizer adds one)."""
    ids = tokenizer.encode(text)
    return [int(t) for t in ids]


def token_windows(
    tokenizer: Any,
    text: str,
    window: int = DEFAULT_WINDOW,
    stride: int | None = None,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
) -> list[Window]:
    """Tokenize `text` once and cut it into windows of at most `window` tokens.

    - `max_tokens` keeps only the first `max_tokens` tokens of the text (None: all of them).
    - `stride` (default: `window`, i.e. non-overlapping) is how far each window starts after the previous one.
      With stride < window the overlap is context only: every token after the first is scored exactly once.
      With stride == window the first token of each window has no context and is not scored.
    """
    if window < 2:
        raise ValueError("window must be at least 2 tokens")
    stride = window if stride is None else stride
    if not 1 <= stride <= window:
        raise ValueError("stride must be between 1 and window")
    tokens = _encode(tokenizer, text)
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    windows: list[Window] = []
    n = len(tokens)
    start = 0
    next_target = 1  # absolute index of the first token not yet scored
    while next_target < n:
        end = min(start + window, n)
        first = max(1, next_target - start)
        if end - first >= 1:
            windows.append(Window(tuple(tokens[start:end]), first))
        next_target = max(next_target, end)
        if end == n:
            break
        start += stride
    return windows


def _as_windows(windows: Sequence[Window] | Sequence[Sequence[int]]) -> list[Window]:
    """Accept Window objects or plain token sequences (plain sequences are scored from their second token)."""
    return [w if isinstance(w, Window) else Window(tuple(int(t) for t in w)) for w in windows]


# ----------------------------------------------------------------------------------------------------------
# Teacher-forced metrics
# ----------------------------------------------------------------------------------------------------------


def window_logprobs(model: nn.Module, window: Window) -> tuple[mx.array, mx.array]:
    """Float32 log-probabilities [n_scored, vocab] at the scored positions, and the target ids [n_scored]."""
    inputs = mx.array(window.tokens[:-1], dtype=mx.int32)[None]
    logits = model(inputs)[0].astype(mx.float32)
    logits = logits[window.first_target - 1 :]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = mx.array(window.tokens[window.first_target :], dtype=mx.int32)
    return logprobs, targets


def nll_sum(logprobs: mx.array, targets: mx.array) -> mx.array:
    return -mx.take_along_axis(logprobs, targets[:, None], axis=-1).sum()


def on_a_terminal(windows: list[Window], progress: bool) -> Iterable[Window]:
    """`windows`, with a progress bar on stderr when `progress` and stderr is a terminal (a forward pass per
    window can take seconds: a 0.5B model's 2,048 tokens take minutes on a CPU)."""
    from tqdm.auto import tqdm

    return tqdm(windows, desc="teacher-forced", unit="window", disable=None if progress else True, file=sys.stderr)


def perplexity(model: nn.Module, tokens_windows: Sequence[Window] | Sequence[Sequence[int]],
               progress: bool = False) -> float:
    """Teacher-forced perplexity: exp of the mean negative log-likelihood over all scored positions."""
    total, count = 0.0, 0
    for window in on_a_terminal(_as_windows(tokens_windows), progress):
        if window.n_scored == 0:
            continue
        logprobs, targets = window_logprobs(model, window)
        nll = nll_sum(logprobs, targets)
        mx.eval(nll)
        total += float(nll.item())
        count += window.n_scored
    if count == 0:
        raise ValueError("no scored positions: the windows are empty or too short")
    return math.exp(total / count)


class ReferenceCache:
    """The reference side of `compare`, computed once and kept: float32 log-probabilities of every window.

    For comparing many candidates with one reference (benchmarks/quality.py): `compare(model, cache, windows)`
    then runs only the candidate. Memory: windows x positions x vocab x 4 bytes (SmolLM2, 2,048 tokens: ~400 MB).
    """

    def __init__(self, reference: nn.Module, windows: Sequence[Window] | Sequence[Sequence[int]]):
        self.windows = [w for w in _as_windows(windows) if w.n_scored > 0]
        self.logprobs: list[mx.array] = []
        for window in self.windows:
            logprobs, _ = window_logprobs(reference, window)
            mx.eval(logprobs)
            self.logprobs.append(logprobs)


def compare(
    model: nn.Module,
    reference: nn.Module | ReferenceCache,
    windows: Sequence[Window] | Sequence[Sequence[int]],
    progress: bool = False,
) -> dict[str, float | int]:
    """Teacher-forced comparison of `model` with `reference` on the same windows (`progress`: see on_a_terminal).

    One forward pass per window per model (none for the reference when it is a `ReferenceCache` of these
    windows). Returns:
    perplexity, reference_perplexity, top1_agreement (fraction of scored positions where both argmaxes are the
    same token), kl_mean (mean over scored positions of KL(reference || model) in nats, float32 log-softmax),
    kl_max (the largest per-position KL), positions and windows.
    """
    nll_model = nll_ref = kl_total = 0.0
    kl_max = 0.0
    agree = count = n_windows = 0
    scored = [w for w in _as_windows(windows) if w.n_scored > 0]
    if isinstance(reference, ReferenceCache) and reference.windows != scored:
        raise ValueError("the reference cache was computed on other windows")
    for i, window in enumerate(on_a_terminal(scored, progress)):
        lp_model, targets = window_logprobs(model, window)
        if isinstance(reference, ReferenceCache):
            lp_ref = reference.logprobs[i]
        else:
            lp_ref, _ = window_logprobs(reference, window)
        kl = (mx.exp(lp_ref) * (lp_ref - lp_model)).sum(axis=-1)
        same = (mx.argmax(lp_model, axis=-1) == mx.argmax(lp_ref, axis=-1)).sum()
        stats = [nll_sum(lp_model, targets), nll_sum(lp_ref, targets), kl.sum(), kl.max(), same]
        mx.eval(stats)
        nll_model += float(stats[0].item())
        nll_ref += float(stats[1].item())
        kl_total += float(stats[2].item())
        kl_max = max(kl_max, float(stats[3].item()))
        agree += int(stats[4].item())
        count += window.n_scored
        n_windows += 1
    if count == 0:
        raise ValueError("no scored positions: the windows are empty or too short")
    return {
        "perplexity": math.exp(nll_model / count),
        "reference_perplexity": math.exp(nll_ref / count),
        "top1_agreement": agree / count,
        "kl_mean": kl_total / count,
        "kl_max": kl_max,
        "positions": count,
        "windows": n_windows,
    }


# ----------------------------------------------------------------------------------------------------------
# Greedy generation
# ----------------------------------------------------------------------------------------------------------


def _prompt_tokens(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt as a chat turn when the tokenizer has a chat template, else as plain text."""
    if getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        return [int(t) for t in ids]
    return _encode(tokenizer, prompt)


STOP = -1  # marks, in a greedy continuation, that the model emitted an end-of-sequence token


def greedy_generations(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    max_tokens: int = DEFAULT_GEN_TOKENS,
    *,
    batched: bool = True,
) -> list[list[int]]:
    """Greedy (argmax) continuations of each prompt, as token ids.

    A continuation ends after `max_tokens` tokens, or at an end-of-sequence token, which is then recorded as a
    final `STOP` (-1), so that stopping (or not stopping) is part of what two models must agree on.

    `batched` (default) runs all prompts together through `mlx_lm.batch_generate` (greedy sampler): one decode
    step reads the weights once for every prompt, ~5x faster than one prompt at a time on CPU. `batched=False`
    uses `mlx_lm.stream_generate` with a temperature-0 sampler, prompt by prompt. On SmolLM2-135M (float32)
    both gave identical tokens for all shipped prompts.
    """
    from mlx_lm import batch_generate, stream_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt_ids = [_prompt_tokens(tokenizer, p) for p in prompts]
    if not prompt_ids:
        return []
    eos = set(tokenizer.eos_token_ids)
    outputs: list[list[int]] = []
    if batched:
        n = min(len(prompt_ids), 16)
        try:
            response = batch_generate(
                model,
                tokenizer,
                prompt_ids,
                max_tokens=max_tokens,
                return_token_ids=True,
                prefill_batch_size=n,
                completion_batch_size=n,
            )
        except ValueError:  # a model whose attention cannot take a batch (mlx_lm's gemma2: its mask does not
            # broadcast over the batch's heads): prompt by prompt, the same tokens
            return greedy_generations(model, tokenizer, prompts, max_tokens, batched=False)
        for tokens in response.token_ids:
            # batch_generate drops the stop token; a continuation shorter than max_tokens stopped at EOS.
            tokens = [int(t) for t in tokens]
            outputs.append(tokens + [STOP] if len(tokens) < max_tokens else tokens)
        return outputs
    sampler = make_sampler(temp=0.0)
    for ids in prompt_ids:
        tokens = []
        for response in stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens, sampler=sampler):
            tokens.append(STOP if response.finish_reason == "stop" and response.token in eos else int(response.token))
        outputs.append(tokens)
    return outputs


def decode_generation(tokenizer: Any, tokens: Sequence[int]) -> str:
    """Text of a greedy continuation (the STOP marker dropped)."""
    return tokenizer.decode([t for t in tokens if t != STOP])


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def sequence_agreement(candidates: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    """Pooled prefix agreement: sum over prompts of the length of the common prefix of the candidate's and the
    reference's continuation, divided by the total length of the reference continuations.

    1.0 means every continuation is identical; a continuation that diverges at its k-th token counts k - 1
    agreeing tokens, and everything after the first divergence counts as disagreement.
    """
    if len(candidates) != len(references):
        raise ValueError("candidates and references differ in number")
    total = sum(len(r) for r in references)
    if total == 0:
        return 1.0
    return sum(_common_prefix(c, r) for c, r in zip(candidates, references)) / total


def greedy_agreement(
    model: nn.Module,
    reference: nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    max_tokens: int = DEFAULT_GEN_TOKENS,
    *,
    batched: bool = True,
) -> float:
    """Greedy-generation agreement of `model` with `reference` over `prompts` (see `sequence_agreement`):
    the fraction of the reference's greedily generated tokens (up to `max_tokens` per prompt, plus the STOP
    marker when it emitted EOS) that `model` reproduces position by position before its first divergence."""
    if not prompts:
        raise ValueError("no prompts")
    ours = greedy_generations(model, tokenizer, prompts, max_tokens, batched=batched)
    theirs = greedy_generations(reference, tokenizer, prompts, max_tokens, batched=batched)
    return sequence_agreement(ours, theirs)


# ----------------------------------------------------------------------------------------------------------
# The INT3 accuracy gate
# ----------------------------------------------------------------------------------------------------------


def text_perplexity(
    model: nn.Module,
    tokenizer: Any,
    name: str = "calibration",
    *,
    window: int = DEFAULT_WINDOW,
    max_tokens: int | None = None,
) -> float:
    """Perplexity of `model` on a whole shipped text (default: the calibration text, as the INT3 gate uses it:
    ~2,300 SmolLM2 tokens, ~25 s for SmolLM2-135M in float32 with OpenBLAS). Pass a model prepared with
    `prepare_for_eval`: quantized layers are ~15x slower on CPU."""
    return perplexity(model, token_windows(tokenizer, load_text(name), window=window, max_tokens=max_tokens))


def passes_gate(candidate_ppl: float, reference_ppl: float, max_increase: float = GATE_MAX_INCREASE) -> bool:
    """True when the candidate's perplexity is at most `max_increase` (default +8 %) above the reference's.

    Non-finite perplexities never pass.
    """
    if not (math.isfinite(candidate_ppl) and math.isfinite(reference_ppl)) or reference_ppl <= 0:
        return False
    return candidate_ppl <= reference_ppl * (1.0 + max_increase)


def prepare_for_eval(model: nn.Module) -> nn.Module:
    """Make `model` fast to evaluate on CPU without changing what it computes beyond float rounding:
    quantized layers (MLX 4-bit/3-bit tiers) are dequantized to plain layers, then every floating-point
    parameter is cast to float32. On SmolLM2-135M 4-bit, a 512-token window took 79 s through
    `quantized_matmul` and 4.8 s dequantized, with the same perplexity to 4 decimals."""
    from mlx_lm.utils import dequantize_model

    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model
