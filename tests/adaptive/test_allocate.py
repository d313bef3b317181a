import itertools

import pytest

from hf_actq.adaptive.allocate import Candidate, Item, allocate


def _item(name, sensitivity, numel=1000):
    # Uniform-rounding-like candidates: bytes ~ bits, variance ~ sensitivity * (2^b - 1)^-2.
    return Item(
        name,
        tuple(
            Candidate({"bits": b}, numel * b // 8 + 16, sensitivity * (2**b - 1) ** -2.0)
            for b in (8, 4, 2, 1)
        ),
    )


def test_meets_the_budget_with_counted_bytes():
    items = [_item(f"s{i}", 10.0**i) for i in range(5)]
    for budget in (5 * 1016, 3000, 1500, 710):  # the cheapest is 5 * 141
        choice, met = allocate(items, budget)
        assert met and sum(c.nbytes for c in choice.values()) <= budget


def test_a_more_sensitive_slot_of_the_same_size_gets_at_least_as_many_bits():
    items = [_item("calm", 1.0), _item("touchy", 50.0), _item("middling", 7.0)]
    for budget in range(500, 3100, 100):
        choice, _ = allocate(items, budget)
        bits = {name: c.setting["bits"] for name, c in choice.items()}
        assert bits["touchy"] >= bits["middling"] >= bits["calm"], budget


def test_deterministic_and_ties_go_to_the_first_item():
    items = [_item("a", 1.0), _item("b", 1.0)]
    first, _ = allocate(items, 1200)
    again, _ = allocate(list(items), 1200)
    assert first == again
    assert first["a"].setting["bits"] <= first["b"].setting["bits"]


def test_unordered_candidates_and_an_impossible_budget():
    # A cheaper candidate that is also more accurate is taken directly.
    odd = Item("odd", (Candidate({"k": 1}, 100, 5.0), Candidate({"k": 2}, 50, 1.0)))
    choice, met = allocate([odd], 60)
    assert met and choice["odd"].setting == {"k": 2}
    choice, met = allocate([_item("x", 1.0)], 10)
    assert not met and choice["x"].setting == {"bits": 1}


def test_greedy_is_close_to_the_exhaustive_optimum():
    items = [_item(f"s{i}", s) for i, s in enumerate((0.5, 3.0, 40.0, 9.0))]
    budget = 1800
    choice, _ = allocate(items, budget)
    greedy = sum(c.variance for c in choice.values())
    best = min(
        sum(c.variance for c in combo)
        for combo in itertools.product(*(item.candidates for item in items))
        if sum(c.nbytes for c in combo) <= budget
    )
    assert greedy == pytest.approx(best, rel=0.5)
