"""Learning-rate schedule of the paper: linear warm-up, then cosine decay that reaches zero at `total_steps`."""

from __future__ import annotations

import math

from switchhead.errors import SwitchheadError, is_finite_number, is_int


def lr_at(step: int, base_lr: float, total_steps: int, warmup: int = 0, min_ratio: float = 0.0) -> float:
    """Learning rate used by the update of 0-based `step`.

    Warm-up ramps linearly so that the first update already moves (lr/warmup rather than 0); the cosine then
    runs from `base_lr` at the end of warm-up to ``min_ratio * base_lr`` at `total_steps`.
    """
    for name, v in (("step", step), ("total_steps", total_steps), ("warmup", warmup)):
        if not is_int(v) or v < 0:
            raise SwitchheadError(f"lr_at: {name} must be an integer >= 0, got {v!r}")
    if not is_finite_number(base_lr) or base_lr < 0:
        raise SwitchheadError(f"lr_at: base_lr must be a finite number >= 0, got {base_lr!r}")
    if not is_finite_number(min_ratio) or not 0 <= min_ratio <= 1:
        raise SwitchheadError(f"lr_at: min_ratio must be a number in [0, 1], got {min_ratio!r}")
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return base_lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
