"""Learning-rate schedule of the paper: linear warm-up, then cosine decay that reaches zero at `total_steps`."""

from __future__ import annotations

import math


def lr_at(step: int, base_lr: float, total_steps: int, warmup: int = 0, min_ratio: float = 0.0) -> float:
    """Learning rate used by the update of 0-based `step`.

    Warm-up ramps linearly so that the first update already moves (lr/warmup rather than 0); the cosine then
    runs from `base_lr` at the end of warm-up to ``min_ratio * base_lr`` at `total_steps`.
    """
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return base_lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
