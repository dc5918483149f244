"""The predictor of ``preload_policy: predictive``: decayed first-order transitions between
changes of model, and each model's inter-arrival time, on a fake clock."""

from __future__ import annotations

import pytest

from duomo.supervisor.core.background_loads import DECAY, TransitionModel

pytestmark = pytest.mark.unit


def test_repeats_are_not_transitions_and_a_cycle_is_learned() -> None:
    now = [0.0]
    model = TransitionModel(lambda: now[0])
    assert model.observe("a") is None  # the first request
    assert model.observe("a") is None  # the same model again
    for _ in range(20):
        for name in ("b", "c", "a"):
            now[0] += 1.0
            model.observe(name)
    assert model.likely_after("a") == {"b": 1.0}
    assert model.likely_after("b") == {"c": 1.0}
    assert model.likely_after("z") == {}
    assert model.gap_s["a"] == pytest.approx(3.0, rel=0.05)


def test_the_counts_decay_so_a_new_pattern_takes_over() -> None:
    model = TransitionModel()
    for _ in range(10):
        model.observe("a")
        model.observe("b")
    for _ in range(4):
        model.observe("a")
        model.observe("c")
    after_a = model.likely_after("a")
    assert after_a["c"] > 0.5 > after_a["b"]  # four recent cs outweigh ten old bs
    old_b = sum(DECAY**k for k in range(10)) * DECAY**4  # ten bs, then four decays
    new_c = sum(DECAY**k for k in range(4))
    assert after_a["c"] == pytest.approx(new_c / (new_c + old_b))
