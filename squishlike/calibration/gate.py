"""The INT3 accuracy gate: the written 3-bit store's perplexity on the calibration text against the source's, both
measured one block at a time (the store's blocks dequantized as the cold tier dequantizes them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..compress_options import CompressOptions
from ..dtypes import to_mx
from ..evaluation import passes_gate
from ..model import model_tokenizer, new_model
from ..npydir import NpyDir
from ..provider import WeightProvider
from ..tiers.base import mlx_names
from .blocks import BlockRunner
from .decision import Plan
from .stats import CALIBRATION_TEXT, calibration_windows, log


def store_perplexity(store: NpyDir, max_tokens: int | None) -> tuple[float, int]:
    """(perplexity of the store's model on the calibration text, tokens scored), one block in memory at a time."""
    canonical = {m: n for n, m in mlx_names(store).items()}
    model = new_model(store.config(), store.path)
    windows = calibration_windows(model_tokenizer(store.config(), store.path, store.path), max_tokens=max_tokens)

    def weights(names):
        for n in names:
            yield n, to_mx(store.dequantize(canonical[n]), store.runtime_dtype)

    runner = BlockRunner(model, list(canonical), weights, windows)
    hidden = runner.hidden
    for i in range(len(runner)):
        runner.load(i)
        hidden = runner.run(i, hidden)
        runner.release(i)
    return runner.perplexity(hidden), sum(w.n_scored for w in windows)


def int3_gate(provider: WeightProvider, store_dir: Path, opts: CompressOptions, plan: Plan | None) -> dict[str, Any]:
    """Perplexity of the written 3-bit store (loaded cold) and of the source on the calibration text; the verdict.

    Returns the manifest's "int3_gate" record: passed, candidate_ppl, reference_ppl, increase, bound, text,
    tokens, reason. A gate that cannot run (an architecture mlx_lm cannot build, ...) does not pass.
    """
    bound = float(opts.int3_max_ppl_increase)
    record: dict[str, Any] = {"passed": False, "bound": bound, "text": CALIBRATION_TEXT}
    if not opts.int3_gate:
        record["reason"] = "the INT3 accuracy gate was skipped (int3_gate=False)"
        return record
    try:
        started = time.perf_counter()
        reference_ppl = plan.reference_ppl if plan is not None else None
        if reference_ppl is None:
            raise RuntimeError("calibration did not measure the source's perplexity")
        candidate_ppl, tokens = store_perplexity(NpyDir(store_dir), opts.calibration_max_tokens)
    except Exception as e:  # noqa: BLE001 - the store is fine; only the gate could not decide
        record["reason"] = f"the INT3 accuracy gate could not run: {type(e).__name__}: {e}"
        return record
    increase = candidate_ppl / reference_ppl - 1.0
    passed = passes_gate(candidate_ppl, reference_ppl, bound)
    verdict = "within" if passed else "over"
    record.update(
        passed=passed,
        candidate_ppl=round(candidate_ppl, 6),
        reference_ppl=round(reference_ppl, 6),
        increase=round(increase, 6),
        tokens=tokens,
        seconds=round(time.perf_counter() - started, 1),
        reason=f"3-bit perplexity on the calibration text {candidate_ppl:.4f} is {increase:+.2%} against the "
        f"reference {reference_ppl:.4f}: {verdict} the bound of {bound:+.0%}",
    )
    log(f"INT3 gate: {'passed' if passed else 'failed'}: {record['reason']}")
    return record

