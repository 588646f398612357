import math
import random

import pytest

from rlaif.algo.stats import length_controlled_win_rate, wilson_interval


def test_wilson_known_values():
    lo, hi = wilson_interval(5, 10)  # half and half
    assert math.isclose(lo, 0.2366, abs_tol=1e-3) and math.isclose(hi, 0.7634, abs_tol=1e-3)
    lo, hi = wilson_interval(10, 10)  # all wins
    assert hi == 1.0 and math.isclose(lo, 0.7225, abs_tol=1e-3)
    lo, hi = wilson_interval(0, 10)  # all losses
    assert lo == 0.0 and math.isclose(hi, 0.2775, abs_tol=1e-3)


def test_ties_count_half():
    # 6 wins, 4 ties, 10 losses -> 8 successes of 20
    assert wilson_interval(6 + 0.5 * 4, 20) == wilson_interval(8, 20)
    lo, hi = wilson_interval(8, 20)
    assert lo < 0.4 < hi


@pytest.mark.parametrize("n", [1, 20, 400])
def test_wilson_contains_point_estimate_and_shrinks(n):
    lo, hi = wilson_interval(0.6 * n, n)
    assert lo <= 0.6 <= hi
    if n == 400:
        assert hi - lo < 0.1


def test_length_control_removes_a_planted_length_bias():
    rng = random.Random(0)
    len_a = [rng.randint(10, 60) for _ in range(600)]
    len_b = [rng.randint(5, 45) for _ in range(600)]
    outcomes = [1.0 if a > b else 0.0 if a < b else 0.5 for a, b in zip(len_a, len_b)]  # the longer answer wins
    raw = sum(outcomes) / len(outcomes)
    lc = length_controlled_win_rate(outcomes, len_a, len_b)
    assert raw > 0.65 and abs(lc - 0.5) < 0.08


def test_length_control_keeps_a_real_advantage():
    rng = random.Random(1)
    len_a = [rng.randint(10, 60) for _ in range(600)]
    len_b = [rng.randint(10, 60) for _ in range(600)]
    outcomes = [1.0 if rng.random() < 0.8 else 0.0 for _ in range(600)]  # wins regardless of length
    lc = length_controlled_win_rate(outcomes, len_a, len_b)
    assert abs(lc - sum(outcomes) / 600) < 0.05


def test_sample_std_is_undefined_below_two_values():
    import torch

    from rlaif.algo.stats import sample_std

    assert sample_std(torch.tensor([0.7])) is None and sample_std(torch.tensor([])) is None
    assert sample_std(torch.tensor([1.0, 3.0])) == pytest.approx(2 ** 0.5)
