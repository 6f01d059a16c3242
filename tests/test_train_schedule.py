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


def _naive_lr(step, base, total, warmup, min_ratio):
    """The documented recipe written out independently: linear warm-up from base/warmup to base over `warmup`
    updates, then a half cosine from base to min_ratio*base reached at `total` and held from there on."""
    if step < warmup:
        return base * (step + 1) / warmup
    done = min(step - warmup, total - warmup) / max(1, total - warmup)
    return base * min_ratio + base * (1 - min_ratio) * (1 + math.cos(math.pi * done)) / 2


@pytest.mark.parametrize("total, warmup, min_ratio", [(100, 0, 0.0), (110, 10, 0.0), (37, 5, 0.25), (8, 3, 0.1),
                                                      (1, 0, 0.0)])
def test_every_step_follows_the_recipe_and_holds_past_the_end(total, warmup, min_ratio):
    # Steps past --steps (a resumed run whose schedule was shortened, a caller looping one step too far) must not
    # climb the cosine back up: the rate stays at its floor.
    for step in range(total + 30):
        want = _naive_lr(step, 3e-4, total, warmup, min_ratio)
        assert lr_at(step, 3e-4, total, warmup=warmup, min_ratio=min_ratio) == pytest.approx(want, abs=1e-18), step
    assert lr_at(total + 29, 3e-4, total, warmup=warmup, min_ratio=min_ratio) == pytest.approx(3e-4 * min_ratio,
                                                                                               abs=1e-18)


@pytest.mark.parametrize("args,message", [
    ((-1, 1.0, 10), "step must be an integer >= 0, got -1"),
    ((1.5, 1.0, 10), "step must be an integer >= 0, got 1.5"),
    ((1, "1e-3", 10), "base_lr must be a finite number >= 0, got '1e-3'"),
    ((1, float("nan"), 10), "base_lr must be a finite number >= 0"),
    ((1, 1.0, None), "total_steps must be an integer >= 0, got None"),
    ((1, 1.0, 10, -2), "warmup must be an integer >= 0, got -2"),
    ((1, 1.0, 10, 0, 1.5), "min_ratio must be a number in [0, 1], got 1.5"),
])
def test_bad_arguments_are_one_line_errors(args, message):
    from switchhead.errors import SwitchheadError

    with pytest.raises(SwitchheadError) as e:
        lr_at(*args)
    assert message in str(e.value)
