"""Resource accounting: parameter counts, the paper's per-layer attention MACs/memory formulas, cache sizes,
and parameter matching between configurations."""

from __future__ import annotations

from collections.abc import Callable

import torch

from switchhead.errors import ConfigError, is_int
from switchhead.model.config import ModelConfig

# Figures printed in the paper for its configurations (attention MACs and memory in floats, per layer and
# sequence); None where the paper prints no number.
PAPER_FIGURES: dict[str, dict[str, float | None]] = {
    "transformer-47m": {"macs": 453.4e6, "floats": 3.5e6},
    "transformer-47m-2head": {"macs": None, "floats": 1.36e6},
    "switchhead-47m": {"macs": 203e6, "floats": None},
    "switchhead-47m-wt103": {"macs": 170.4e6, "floats": None},
    "transformer-262m": {"macs": 5.4e9, "floats": 21.0e6},
    "transformer-262m-4head": {"macs": None, "floats": 8.4e6},
    "switchhead-262m": {"macs": 2.4e9, "floats": 5.6e6},
}


def _config(config: object) -> ModelConfig:
    """`config` if it is a ModelConfig (a preset's name or a dict failed on a missing attribute)."""
    if not isinstance(config, ModelConfig):
        raise ConfigError(f"expected a ModelConfig (e.g. PRESETS[name]), got {type(config).__name__}")
    return config


def _element_bytes(n: object) -> int:
    if not is_int(n) or n < 1:  # a string came back repeated, 0 or a fraction as a size
        raise ConfigError(f"bytes_per_element must be an integer >= 1, got {n!r}")
    return n


def count_params(config: ModelConfig) -> dict[str, int]:
    """Parameters per component (embedding, attention, feedforward, norms, output) and the total.

    Counted from the real module tree built on the meta device, so it can never drift from the model; the
    layers are identical, so a one- and a two-layer model give every count for any depth."""
    _config(config)
    one, two = (_count_built(config.replace(n_layers=n)) for n in (1, 2))
    return {k: one[k] + (config.n_layers - 1) * (two[k] - one[k]) for k in one}


def _count_built(config: ModelConfig) -> dict[str, int]:
    from switchhead.model.lm import TransformerLM

    with torch.device("meta"):
        model = TransformerLM(config)
    parts = {"embedding": 0, "attention": 0, "feedforward": 0, "norms": 0, "output": 0}
    for name, p in model.named_parameters():
        if name.startswith("embed."):
            parts["embedding"] += p.numel()
        elif name.startswith("out."):
            parts["output"] += p.numel()
        elif ".attn." in name:
            parts["attention"] += p.numel()
        elif ".ff." in name:
            parts["feedforward"] += p.numel()
        else:
            parts["norms"] += p.numel()
    parts["total"] = sum(parts.values())
    return parts


def attention_macs(config: ModelConfig) -> int:
    """Multiply-accumulates of one attention layer for one sequence of T tokens (paper appendix formulas). Their
    last term projects the C*T relative positions (Transformer-XL); RoPE has no such projection, so its models
    count without it (the rotation itself, a few element-wise products, is left out as in the paper)."""
    h, t, dh, d, k = _config(config).n_heads, config.chunk_len, config.d_head, config.d_model, config.k
    c = 1 + config.mem_chunks
    pos = 2 * c * t * dh * d if config.positional == "xl" else 0
    if config.attention == "dense":
        return h * (4 * t * dh * d + 2 * c * t * t * dh + pos)
    if config.attention == "switchhead":
        # The paper's formula is for mixtures on V and O: each dense projection costs T*dh*d, each mixture
        # T*k*dh*(d+1). Counting per projection keeps the ablations (any subset of V, K, Q, O) honest.
        n_moe = len(config.moe_projections)
        return h * ((4 - n_moe) * t * dh * d + n_moe * t * k * dh * (d + 1) + 2 * c * t * t * dh + pos)
    return (2 * h + 2) * t * dh * d + 2 * h * c * t * t * dh + pos


def attention_memory(config: ModelConfig) -> int:
    """Floats of attention state of one layer for one sequence (paper appendix formulas; the projected relative
    positions, their last term, only for Transformer-XL positions)."""
    h, t, dh = _config(config).n_heads, config.chunk_len, config.d_head
    c = 1 + config.mem_chunks
    pos = 2 * c * t * dh if config.positional == "xl" else 0
    if config.attention == "moa":
        return (2 * h + 2) * t * dh + 2 * h * c * t * t + pos
    return h * (4 * t * dh + 2 * c * t * t + pos)


def kv_heads(config: ModelConfig) -> int:
    """Key/value heads per layer: MoA shares one K/V head among its query experts."""
    return 1 if config.attention == "moa" else config.n_heads


def cache_layout(config: ModelConfig) -> tuple[int, int, int, int, bool]:
    """What a generation cache's buffers and bookkeeping depend on: layers, K/V heads, head width, chunk length and
    whether there is memory. Two configs that agree on it can share a cache."""
    return config.n_layers, kv_heads(config), config.d_head, config.chunk_len, config.mem_chunks > 0


def kv_cache_bytes_per_token(config: ModelConfig, bytes_per_element: int = 4) -> int:
    """Generation cache per token, all layers: K and V after projection."""
    return 2 * kv_heads(_config(config)) * config.d_head * config.n_layers * _element_bytes(bytes_per_element)


def xl_memory_bytes_per_token(config: ModelConfig, bytes_per_element: int = 4) -> int:
    """Training-time XL memory per token: one d_model layer input per layer (0 without memory)."""
    return _config(config).mem_chunks * config.d_model * config.n_layers * _element_bytes(bytes_per_element)


def match_params(config: ModelConfig, target: int | ModelConfig, field: str = "d_head",
                 valid: Callable[[int], bool] | None = None) -> ModelConfig:
    """Return `config` with integer `field` (d_head or d_ff) chosen so that its total parameter count is as
    close as possible to `target` (a count or another config), among the values `valid` accepts."""
    _config(config)
    if field not in ("d_head", "d_ff"):
        raise ConfigError(f"can only match parameters by d_head or d_ff, not {field!r}")
    if field == "d_ff" and config.ff != "dense":  # no parameter depends on it: any value would be "closest"
        raise ConfigError(f"d_ff sets no parameter of a {config.ff} feedforward; match by d_head")
    if not isinstance(target, ModelConfig) and (not is_int(target) or target < 1):
        raise ConfigError(f"target must be a parameter count (an integer >= 1) or a ModelConfig, got {target!r}")
    if valid is not None and not callable(valid):
        raise ConfigError(f"valid must be a function of the value, got {type(valid).__name__}")
    goal = count_params(target)["total"] if isinstance(target, ModelConfig) else target
    # RoPE refuses a d_head that is no multiple of 4, so the search only ever builds multiples of 4.
    step = 4 if field == "d_head" and config.positional == "rope" else 1
    ok = valid or (lambda v: True)
    limit = (1 << 20) // step

    def total(u: int) -> int:
        return count_params(config.replace(**{field: u * step}))["total"]

    lo, hi = 1, 2
    while total(hi) < goal:
        lo, hi = hi, hi * 2
        if hi > limit:
            raise ConfigError(f"cannot reach {goal} parameters by growing {field}")
    while hi - lo > 1:  # parameters grow monotonically with d_head and d_ff
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) < goal else (lo, mid)
    # By monotonicity the best accepted value is the nearest accepted one on either side of the crossing.
    below = next((u for u in range(lo, 0, -1) if ok(u * step)), None)
    above = next((u for u in range(hi, limit + 1) if ok(u * step)), None)
    candidates = [u for u in (below, above) if u is not None]
    if not candidates:
        raise ConfigError(f"no {field} up to {limit * step} is accepted by `valid`")
    best = min(candidates, key=lambda u: abs(total(u) - goal))
    return config.replace(**{field: best * step})


def summary(config: ModelConfig) -> dict:
    """Everything `switchhead info` prints, as plain JSON-able data."""
    macs, floats = attention_macs(config), attention_memory(config)
    paper = PAPER_FIGURES.get(config.name, {})
    return {
        "name": config.name,
        "config": config.to_dict(),
        "params": count_params(config),
        "attention_macs_per_layer": macs,
        "attention_floats_per_layer": floats,
        "paper_attention_macs_per_layer": paper.get("macs"),
        "paper_attention_floats_per_layer": paper.get("floats"),
        "kv_cache_bytes_per_token_fp32": kv_cache_bytes_per_token(config),
        "xl_memory_bytes_per_token_fp32": xl_memory_bytes_per_token(config),
    }
