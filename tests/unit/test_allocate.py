"""The width allocation of a size target (squishlike/calibration/mixed.py): each tensor's choice, the sum of
measured losses least within a byte budget. Checked against brute force on small cases."""

from __future__ import annotations

import itertools
import random

import pytest

from squishlike.calibration.mixed import Choice, _lower_hull, allocate, fitting, tensor_choices
from squishlike.calibration.quantizer import Quantizer
from squishlike.errors import BudgetError


def _widths(scale: float, params: int) -> list[Choice]:
    """A tensor's choices as quantization behaves: each extra bit about quarters the loss."""
    return [Choice(f"int{b}", params * (b * 64 + 32) // 512, scale * 4.0 ** -b) for b in (2, 3, 4, 5, 6, 8)]


def _best(choices: dict[str, list[Choice]], budget: int) -> float:
    """The least total loss within `budget`, by trying every combination."""
    best = float("inf")
    for combo in itertools.product(*choices.values()):
        if sum(c.nbytes for c in combo) <= budget:
            best = min(best, sum(c.loss for c in combo))
    return best


def test_the_hull_drops_choices_no_budget_would_pick():
    a, b, c, d = Choice("a", 10, 8.0), Choice("b", 20, 7.9), Choice("c", 30, 1.0), Choice("d", 40, 2.0)
    # b saves little for its bytes (below the line from a to c); d costs more and loses more than c
    assert _lower_hull([d, c, b, a]) == [a, c]


def test_allocation_meets_the_budget_and_spends_it_where_it_saves_most():
    choices = {"sensitive": _widths(100.0, 4096), "robust": _widths(1.0, 4096)}
    budget = choices["sensitive"][3].nbytes + choices["robust"][1].nbytes  # 5 bits and 3 bits
    chosen = allocate(choices, budget)
    assert sum(c.nbytes for c in chosen.values()) <= budget
    assert chosen["sensitive"].scheme > chosen["robust"].scheme  # the sensitive tensor has the more bits


@pytest.mark.parametrize("seed", range(20))
def test_allocation_is_near_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    choices = {f"t{i}": _widths(rng.uniform(0.1, 100), rng.choice([1024, 4096, 16384])) for i in range(4)}
    low = sum(cs[0].nbytes for cs in choices.values())
    high = sum(cs[-1].nbytes for cs in choices.values())
    budget = rng.randint(low, high)
    chosen = allocate(choices, budget)
    spent = sum(c.nbytes for c in chosen.values())
    assert spent <= budget
    # Greedy on convex hulls is optimal at the hull's corners; off them it may leave up to one step unspent: it is
    # never worse than the best plan with one (largest) step less to spend
    step = max(cs[i + 1].nbytes - cs[i].nbytes for cs in choices.values() for i in range(len(cs) - 1))
    assert sum(c.loss for c in chosen.values()) <= _best(choices, budget - step) * (1 + 1e-9)


def test_a_budget_below_the_cheapest_choices_is_refused():
    choices = {"t": _widths(1.0, 4096)}
    with pytest.raises(BudgetError, match="more than the"):
        allocate(choices, choices["t"][0].nbytes - 1)


def test_ties_are_broken_by_order_so_plans_repeat():
    choices = {f"t{i}": _widths(1.0, 4096) for i in range(5)}
    budget = sum(cs[0].nbytes for cs in choices.values()) + 2 * (choices["t0"][1].nbytes - choices["t0"][0].nbytes)
    chosen = allocate(choices, budget)
    assert [n for n, c in chosen.items() if c.scheme == "int3"] == ["t0", "t1"]


def test_groups_of_128_are_offered_where_they_split_the_rows_and_taken_where_cheaper():
    """A width in groups of 128 costs a quarter bit a weight less than in groups of 64: with the loss the same,
    the plan takes it, and spends the bytes saved on another tensor. Groups that do not split a tensor's rows
    are never offered to it."""
    offered = [Quantizer(s, g, "bfloat16") for s in ("int2", "int3") for g in (64, 128)]
    quantizers = {"down": fitting(offered, 1536), "q": fitting(offered, 576)}
    assert [(q.scheme, q.group_size) for q in quantizers["q"]] == [("int2", 64), ("int3", 64)]
    losses = {"down": (4.0, 4.0, 1.0, 1.0), "q": (4.0, 1.0)}
    choices = tensor_choices(losses, {"down": (576, 1536), "q": (576, 576)}, quantizers)
    assert [c.group_size for c in choices["down"]] == [64, 128, 64, 128]
    # down at 3 bits in groups of 128 (3.25 bits a weight) leaves q room for 3 bits: in groups of 64, down's 3.5
    # would not
    budget = choices["down"][3].nbytes + choices["q"][1].nbytes
    picked = allocate(choices, budget)
    assert (picked["down"].scheme, picked["down"].group_size, picked["q"].scheme) == ("int3", 128, "int3")
