"""One rank of a sharded load, run by tests under `mlx.launch -n 2 --backend ring` (tests/integration/test_sharded.py).

    python shard_rank.py MODEL pipeline|tensor OUT [REFERENCE]

Loads MODEL with squishlike.sharded_load (and REFERENCE, a dense copy of the same weights, with
mlx_lm.sharded_load), runs both on TOKENS and writes OUT/rank{r}.npz (the logits) and OUT/rank{r}.json (what the
load logged: layout, the tier that served it, the stored bytes it read; and each model's module classes and
parameter digests).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

TOKENS = [1, 5, 9, 33, 70, 2, 11, 120, 7]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.loads: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "shard_load"):
            self.loads.append(record.shard_load)


def logits(model) -> np.ndarray:
    out = model(mx.array([TOKENS]))[0].astype(mx.float32)
    mx.eval(out)
    return np.array(out)


def describe(model) -> dict:
    """The class of the module at every path, and every parameter's dtype, shape and a digest of its bits: what
    must match between two loads of one share (quantized, sharded layers included)."""
    def digest(a: mx.array) -> str:
        bits = a.view({1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[a.dtype.size])
        return hashlib.sha256(np.array(bits).tobytes()).hexdigest()

    return {"modules": {path: type(m).__name__ for path, m in model.named_modules()},
            "parameters": {name: [str(v.dtype), list(v.shape), digest(v)]
                           for name, v in tree_flatten(model.parameters())}}


def main(model: str, mode: str, out: str, reference: str | None = None) -> None:
    from mlx_lm.utils import sharded_load

    import squishlike

    records = _Records()
    logger = logging.getLogger("squishlike")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(records)
    group = mx.distributed.init()
    groups = {f"{mode}_group": group}
    loaded = {"ours": squishlike.sharded_load(model, **groups)[0]}
    if reference is not None:
        loaded["mlx_lm"] = sharded_load(reference, **groups)[0]
    np.savez(Path(out) / f"rank{group.rank()}.npz", **{who: logits(m) for who, m in loaded.items()})
    report = {"loads": records.loads, "models": {who: describe(m) for who, m in loaded.items()}}
    (Path(out) / f"rank{group.rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
