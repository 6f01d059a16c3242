"""LR schedule: linear warm-up, then cosine from the peak to zero at the last step."""

import math

import pytest

from switchhead.train.schedule import lr_at


def test_cosine_without_warmup():
    lrs = [lr_at(s, 1.0, 100) for s in range(101)]
    assert lrs[0] == 1.0
    assert lrs[50] == pytest.approx(0.5)
    assert lrs[100] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # monotone decay
    assert lr_at(25, 2.5e-4, 100) == pytest.approx(2.5e-4 * 0.5 * (1 + math.cos(math.pi / 4)))


def test_warmup_then_cosine():
    lrs = [lr_at(s, 2.0, 110, warmup=10) for s in range(110)]
    assert lrs[0] == pytest.approx(0.2) and lrs[9] == pytest.approx(2.0)
    assert all(b > a for a, b in zip(lrs[:10], lrs[1:10]))  # strictly increasing during warm-up
    assert lrs[10] == pytest.approx(2.0)
    assert lrs[60] == pytest.approx(1.0)  # half-way through the cosine
    assert lr_at(110, 2.0, 110, warmup=10) == pytest.approx(0.0, abs=1e-12)
    assert lr_at(60, 2.0, 110, warmup=10, min_ratio=0.1) == pytest.approx(0.2 + 1.8 * 0.5)
