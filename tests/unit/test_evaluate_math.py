import math

import pytest

from rlaif.stages.evaluate import wilson_interval


def test_wilson_known_values():
    lo, hi = wilson_interval(5, 10)
    assert math.isclose(lo, 0.2366, abs_tol=1e-3) and math.isclose(hi, 0.7634, abs_tol=1e-3)
    lo, hi = wilson_interval(10, 10)
    assert hi == 1.0 and math.isclose(lo, 0.7225, abs_tol=1e-3)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and math.isclose(hi, 0.2775, abs_tol=1e-3)


@pytest.mark.parametrize("n", [1, 20, 400])
def test_wilson_contains_point_estimate_and_shrinks(n):
    lo, hi = wilson_interval(0.6 * n, n)
    assert lo <= 0.6 <= hi
    if n == 400:
        assert hi - lo < 0.1
