"""The INT3 accuracy gate: the written 3-bit store's perplexity on the calibration text against the source's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..compress_options import CompressOptions
from ..evaluation import passes_gate, perplexity, prepare_for_eval
from ..npydir import NpyDir
from ..model import assemble
from ..provider import WeightProvider
from ..tiers.load import load_weights
from .plan import Plan
from .stats import CALIBRATION_TEXT, calibration_windows, log, source_model


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
            model, tokenizer = source_model(provider)
            reference_ppl = perplexity(model, calibration_windows(tokenizer, max_tokens=opts.calibration_max_tokens))
            del model
        store = NpyDir(store_dir)
        loaded = load_weights(store, "cold")
        candidate, tokenizer = assemble(loaded.config, loaded.weights, store.path, store.path)
        candidate = prepare_for_eval(candidate)
        windows = calibration_windows(tokenizer, max_tokens=opts.calibration_max_tokens)
        candidate_ppl = perplexity(candidate, windows)
        del candidate
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
        tokens=sum(w.n_scored for w in windows),
        seconds=round(time.perf_counter() - started, 1),
        reason=f"3-bit perplexity on the calibration text {candidate_ppl:.4f} is {increase:+.2%} against the "
        f"reference {reference_ppl:.4f}: {verdict} the bound of {bound:+.0%}",
    )
    log(f"INT3 gate: {'passed' if passed else 'failed'}: {record['reason']}")
    return record

