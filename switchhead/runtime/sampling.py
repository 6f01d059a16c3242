"""Sampling as small pure functions on logits [B, V], plus validated parameters.

Order of application: logit bias, repetition penalty (as in Hugging Face's samplers), presence and frequency
penalties (OpenAI's), temperature, top-k, top-p, min-p, then one draw. Temperature 0 means greedy. Filters mark
removed tokens with -inf; each keeps at least the most likely token. Draws take uniforms from per-row generators
so that a row's draws never depend on which other rows share its batch (its logits can differ in the
last bits with the batch's shapes, which may flip a near-tie).

Seeds are integers in [0, 2**64), what `torch.Generator.manual_seed` takes. Where one seed yields several
(the i-th prompt of a prompts file, the j-th of n samples), they are ``seed_plus(seed, i)``: seed + i wrapped
modulo 2**64, so every seed the user may give works with any number of prompts or samples.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from switchhead.errors import SwitchheadError, is_finite_number, is_int
from switchhead.model.lm import check_ids

SEED_LIMIT = 1 << 64  # seeds are in [0, SEED_LIMIT): torch.Generator.manual_seed overflows beyond


def check_seed(seed, name: str = "seed") -> None:
    if not is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise SwitchheadError(f"{name} must be an integer in [0, 2**64 - 1], got {seed!r}")


def seed_or_random(seed: int | None) -> int:
    """`seed`, or a fresh random one where none was given."""
    return seed if seed is not None else int.from_bytes(os.urandom(4), "little")


def seed_plus(seed: int, i: int) -> int:
    """The seed of the i-th prompt or sample of a run seeded with `seed`: seed + i, modulo 2**64."""
    return (seed + i) % SEED_LIMIT


def check_utf8(text: str, what: str) -> None:
    """A `SwitchheadError` when `text` cannot be encoded as UTF-8: it has lone surrogates, as undecodable bytes
    become under Python's surrogateescape (command-line arguments, stdin) or as JSON's \\ud800 escapes give.
    The message names the first bad character by position and code point, never the text itself (which could
    not be printed either)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        bad = f"byte 0x{c - 0xDC00:02X}" if 0xDC80 <= c <= 0xDCFF else f"lone surrogate U+{c:04X}"
        raise SwitchheadError(f"{what} is not valid UTF-8 ({bad} at character {e.start})") from None


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit; stored as sorted (id, bias) pairs
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        # NumPy scalars (np.int64, np.float32, ...) are numbers too: stored as Python ones, then checked as those.
        for name in ("max_new_tokens", "top_k", "seed"):
            v = getattr(self, name)
            if isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
                object.__setattr__(self, name, int(v))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, numbers.Real) and not isinstance(v, (bool, int, float)):
                object.__setattr__(self, name, float(v))
        if not isinstance(self.stop_at_eos, bool):
            raise SwitchheadError(f"stop_at_eos must be True or False, got {self.stop_at_eos!r}")
        # One string is one stop string (as in the OpenAI API), not a sequence of one-character stops.
        stop = (self.stop,) if isinstance(self.stop, str) else () if self.stop is None else self.stop
        try:
            object.__setattr__(self, "stop", tuple(stop))
        except TypeError:
            raise SwitchheadError(f"stop must be a string or a list of strings, got {self.stop!r}") from None
        checks = [
            ("max_new_tokens", is_int(self.max_new_tokens) and self.max_new_tokens >= 1, ">= 1"),
            ("temperature", is_finite_number(self.temperature) and self.temperature >= 0, ">= 0 (0 = greedy)"),
            ("top_k", is_int(self.top_k) and self.top_k >= 0, ">= 0 (0 = off)"),
            ("top_p", is_finite_number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", is_finite_number(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", is_finite_number(self.repetition_penalty) and self.repetition_penalty > 0,
             "> 0"),
            ("presence_penalty", _in_range(self.presence_penalty, MAX_PENALTY), _RANGE),
            ("frequency_penalty", _in_range(self.frequency_penalty, MAX_PENALTY), _RANGE),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise SwitchheadError(f"{name.replace('_', '-')} must be {rule}, got {getattr(self, name)!r}")
        if any(not isinstance(s, str) for s in self.stop):
            raise SwitchheadError(f"stop strings must be strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise SwitchheadError("stop strings must be non-empty")
        for i, s in enumerate(self.stop):  # generated text is always valid UTF-8: such a stop could never match
            check_utf8(s, f"stop string {i}")
        if self.seed is not None:
            check_seed(self.seed)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))


# OpenAI's ranges for these parameters.
MAX_PENALTY = 2.0
MAX_BIAS = 100.0
_RANGE = f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"


def _in_range(value, limit: float) -> bool:
    return is_finite_number(value) and -limit <= value <= limit


def _bias_pairs(bias) -> tuple[tuple[int, float], ...] | None:
    """`logit_bias` as sorted (token id, bias) pairs (None when empty), or a SwitchheadError naming the entry."""
    if bias is None:
        return None
    if not isinstance(bias, (Mapping, tuple)):
        raise SwitchheadError(f"logit-bias must map token ids to numbers, got {type(bias).__name__}")
    pairs = tuple(bias.items()) if isinstance(bias, Mapping) else bias
    seen = set()
    for entry in pairs:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise SwitchheadError(f"logit-bias must map token ids to numbers, got {entry!r}")
        tok, value = entry
        if not is_int(tok) or tok < 0:
            raise SwitchheadError(f"logit-bias keys must be token ids (integers >= 0), got {tok!r}")
        if tok in seen:  # as pairs, one id may come twice: which bias applies would be an accident of sorting
            raise SwitchheadError(f"logit-bias names token {tok} twice")
        seen.add(tok)
        if not _in_range(value, MAX_BIAS):
            raise SwitchheadError(f"logit-bias values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {value!r} for "
                                  f"token {tok}")
    return tuple(sorted((int(t), float(v)) for t, v in pairs)) or None


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """A SwitchheadError when `params.logit_bias` names a token outside a vocabulary of `vocab_size` pieces."""
    outside = [t for t, _ in params.logit_bias or () if t >= vocab_size]
    if outside:
        raise SwitchheadError(f"logit-bias names token {outside[0]}, outside the vocabulary (ids 0..{vocab_size - 1})")


def repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL-style penalty on tokens already in the context (`seen` [B, V] bool): positive logits are divided
    by `penalty`, negative ones multiplied, so a penalty > 1 always makes a seen token less likely."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def presence_frequency_penalty(logits: Tensor, counts: Tensor, presence: float, frequency: float) -> Tensor:
    """OpenAI's penalties on tokens already generated (`counts` [B, V]: how often each was): frequency * count
    plus presence once a token occurs is subtracted from its logit (negative values encourage repeats)."""
    if presence == 0.0 and frequency == 0.0:
        return logits
    c = counts.to(logits.dtype)
    return logits - frequency * c - presence * (c > 0).to(logits.dtype)


class TokenHistory:
    """What the logit bias and the penalties of `params` need to know of B rows, kept up to date with `add`:
    the tokens in each row's context, prompt included (repetition penalty), and how often each row generated
    each token (presence and frequency penalties, which, as in OpenAI's API and vLLM, count only generated
    tokens). Only what `params` uses is kept; with none of them `active` is False and `adjust` is the identity."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompts: Sequence[Sequence[int]]):
        if not isinstance(params, SamplingParams):
            raise SwitchheadError(f"params must be SamplingParams, got {type(params).__name__}")
        if not is_int(vocab_size) or vocab_size < 1:
            raise SwitchheadError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
        if isinstance(prompts, (str, bytes, Tensor)) or not isinstance(prompts, Sequence):
            raise SwitchheadError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        prompts = [ids.tolist() if isinstance(ids, Tensor) and ids.dim() == 1 else
                   list(ids) if not isinstance(ids, (str, bytes)) and isinstance(ids, Sequence) else ids
                   for ids in prompts]
        for ids in prompts:
            if not isinstance(ids, list):
                raise SwitchheadError(f"each prompt must be a list of token ids, got {type(ids).__name__}")
        self.params, self.rows, self.vocab_size = params, len(prompts), vocab_size
        self.seen = self.counts = self.bias = None
        if params.repetition_penalty != 1.0:  # the one use of the prompts' ids, checked here
            check_ids(prompts, vocab_size)  # -1 would mark the last token seen, 1.7 token 1
            self.seen = torch.zeros(self.rows, vocab_size, dtype=torch.bool)
            for b, ids in enumerate(prompts):
                self.seen[b, torch.as_tensor(ids, dtype=torch.long)] = True
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            self.counts = torch.zeros(self.rows, vocab_size, dtype=torch.int32)
        if params.logit_bias:
            check_logit_bias(params, vocab_size)
            self.bias = torch.zeros(vocab_size, dtype=torch.float64)
            ids, values = zip(*params.logit_bias)
            self.bias[list(ids)] = torch.tensor(values, dtype=torch.float64)
        self.active = self.seen is not None or self.counts is not None or self.bias is not None

    def add(self, row: int, token: int) -> None:
        """Row `row` generated `token`."""
        if not self.active:
            return
        if not is_int(row) or not 0 <= row < self.rows or not is_int(token) or not 0 <= token < self.vocab_size:
            raise SwitchheadError(f"TokenHistory.add needs a row in [0, {self.rows}) and a token id in "
                                  f"[0, {self.vocab_size}), got row {row!r}, token {token!r}")
        if self.seen is not None:
            self.seen[row, token] = True
        if self.counts is not None:
            self.counts[row, token] += 1

    def adjust(self, logits: Tensor) -> Tensor:
        """Logits [B, V] with the bias and the penalties applied (in the logits' dtype)."""
        x, p = logits, self.params
        if self.bias is not None:
            x = x + self.bias.to(x.device, x.dtype)
        if self.seen is not None:
            x = repetition_penalty(x, self.seen.to(x.device), p.repetition_penalty)
        if self.counts is not None:
            x = presence_frequency_penalty(x, self.counts.to(x.device), p.presence_penalty, p.frequency_penalty)
        return x


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits per row (ties with the k-th are kept); k = 0 or k >= V keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filter: keep the most likely tokens until their probability reaches p (the smallest such set,
    in order of decreasing probability)."""
    if p >= 1.0:
        return logits
    probs, order = logits.softmax(-1).sort(-1, descending=True)
    before = probs.cumsum(-1) - probs  # probability mass strictly ahead of each token
    drop_sorted = before >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: Tensor, min_p: float) -> Tensor:
    """Keep tokens whose probability is at least min_p times the most likely token's."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))


def _penalised(logits: Tensor, params: SamplingParams, history: TokenHistory | None,
               temperature: float = 1.0) -> Tensor:
    """Logits [B, V] after the bias, the penalties and the temperature, in float64 with +inf clamped to the
    largest float: any accepted penalty or temperature can overflow float32 (a logit / 1e-300 is inf, and a
    banned token's -inf / inf is NaN), and one NaN row made the draw fall through to token 0."""
    x = logits.double()
    if history is not None:
        x = history.adjust(x)
    return (x / temperature).clamp(max=torch.finfo(x.dtype).max)


def processed_logits(logits: Tensor, params: SamplingParams, history: TokenHistory | None = None) -> Tensor:
    """All filters of `params` applied to logits [B, V] (temperature > 0), in float64."""
    # Tiny temperatures behave like 1e-6: the ranking is settled long before, and far below it every logit
    # would hit the clamp and tie.
    x = _penalised(logits, params, history, max(params.temperature, 1e-6))
    x = top_k_filter(x, params.top_k)
    x = top_p_filter(x, params.top_p)
    return min_p_filter(x, params.min_p)


def draw(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF draw per row: the first token whose cumulative probability reaches u * total, u in (0, 1].

    Tokens of probability 0 are never chosen (u > 0 and the CDF is flat across them)."""
    cdf = probs.cumsum(-1)
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    return (cdf < target).sum(-1).clamp_max(probs.shape[-1] - 1)


def choose(logits: Tensor, params: SamplingParams, history: TokenHistory | None,
           generators: list[torch.Generator] | None) -> Tensor:
    """Next token per row [B] from the last-position logits [B, V]; `history` holds the rows' past tokens for
    the penalties (None or inactive: none apply)."""
    if not isinstance(logits, Tensor) or logits.dim() != 2 or 0 in logits.shape:
        raise SwitchheadError(f"choose needs last-position logits [B, V] with B, V >= 1, got "
                              f"{tuple(getattr(logits, 'shape', ())) or type(logits).__name__}")
    rows = logits.shape[0]
    if history is not None and history.rows != rows:
        raise SwitchheadError(f"the history holds {history.rows} rows; the logits have {rows}")
    if params.temperature != 0 and (not isinstance(generators, Sequence) or len(generators) != rows
                                    or not all(isinstance(g, torch.Generator) for g in generators)):
        # one draw per generator: a wrong count gave as many tokens as generators, not as rows
        raise SwitchheadError(f"sampling needs one torch.Generator per row ({rows}), got "
                              f"{len(generators) if isinstance(generators, Sequence) else type(generators).__name__}")
    if history is not None and not history.active:
        history = None
    if params.temperature == 0:  # without a penalty nothing can overflow: no float64 copy per decode step
        return (logits if history is None else _penalised(logits, params, history)).argmax(-1)
    probs = processed_logits(logits, params, history).softmax(-1)
    # 1 - U[0, 1) lies in (0, 1]: a draw of exactly 0 could otherwise pick a zero-probability first token.
    u = torch.stack([1.0 - torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    return draw(probs, u.to(probs.device))
