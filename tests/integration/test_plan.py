"""One decision per load (docs/format.md §9): the decision tree makes a plan once, and memory preparation, the load and
`inspect` read it. Counted with the interpreter's own profiler hook, on real loads of real stores."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
from support.fixtures import FORMAT1_STORE
from support.options import ROUND_TO_NEAREST

import squishlike
from squishlike.info import inspect_model
from squishlike.npydir import NpyDir
from squishlike.tiers import BUILT, COLD_PATH, STORE, decide
from squishlike.tiers import base as tiers_base
from squishlike.tiers import quantized as tiers_quantized

ASKED = {"ready", "serves_from_store"}  # the questions a walk of the order asks each tier
TIER_FILES = {tiers_base.__file__, tiers_quantized.__file__}


def questions_asked(fn) -> Counter:
    """How many times `fn()` asks a tier each question, by (question, tier class)."""
    asked: Counter = Counter()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name in ASKED and code.co_filename in TIER_FILES:
            asked[(code.co_name, type(frame.f_locals.get("self")).__name__)] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return asked


@pytest.mark.parametrize("tiers", [None, ("mlx",)], ids=["from the store", "a built tier"])
def test_a_load_asks_each_tier_once(tiny_llama, tmp_path, tiers):
    out = squishlike.compress(tiny_llama, tmp_path / "int4", scheme="int4", tiers=tiers, **ROUND_TO_NEAREST)
    squishlike.load(out)  # a first load builds what the policy asks for
    plan = decide(NpyDir(out))
    assert plan.source == (STORE if tiers is None else BUILT)
    asked = questions_asked(lambda: squishlike.load(out))
    assert asked and max(asked.values()) == 1, asked  # main's load asked int4 eight times
    assert inspect_model(out)["load"] == {"tier": plan.tier.name, "reason": plan.why}


def test_the_plan_says_what_the_load_does(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "int4", scheme="int4", tiers=("mlx", "finalized"),
                              **ROUND_TO_NEAREST)
    store = NpyDir(out)
    plan = decide(store)
    assert plan.source == COLD_PATH and [t.name for t in plan.builds] == ["mlx", "finalized"]
    assert plan.files(store) and plan.nbytes(store) > 0
    model, _ = squishlike.load(out)
    after = decide(NpyDir(out))
    assert after.source == BUILT and after.tier.name == "mlx" and after.payload["files"]
    forced = decide(NpyDir(out), "finalized")
    assert forced.forced and forced.source == BUILT
    with pytest.raises(ValueError, match="unknown tier"):
        decide(store, "fast")


def test_a_format_1_store_is_planned_and_inspected_with_its_version():
    store = NpyDir(FORMAT1_STORE)
    assert store.version == 1
    plan = decide(store)
    assert plan.source == STORE and plan.nbytes(store) == sum(r.size for r in store.part_files().values())
    report = inspect_model(FORMAT1_STORE)
    assert report["store"]["format_version"] == 1 and report["load"]["tier"] == "int4"
