"""The top-k expert projection op (see `ops`)."""

from switchhead.kernels.ops import expert_projection

__all__ = ["expert_projection"]
