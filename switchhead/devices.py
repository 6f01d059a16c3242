"""Which devices a model can run on: one check for every command and for `switchhead.load`."""

from __future__ import annotations

import torch

from switchhead.errors import SwitchheadError


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device` (default: cpu) as a torch.device, if a model can run there on this machine."""
    try:
        dev = torch.device(device or "cpu")
    except (RuntimeError, TypeError) as e:
        raise SwitchheadError(f"unknown device {device!r}: {e}") from None
    if dev.type not in ("cpu", "cuda", "mps"):  # e.g. meta, which holds no data
        raise SwitchheadError(f"device {device!r} cannot run a model; use cpu, cuda or mps")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SwitchheadError(f"device {device!r} requested but CUDA is not available")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise SwitchheadError(f"device {device!r} requested but MPS is not available")
    return dev
