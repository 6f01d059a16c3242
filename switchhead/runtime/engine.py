"""Generation loop shared by every backend: chunk-aware prefill, decoding, stopping, streaming text, batching."""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from switchhead.errors import SwitchheadError
from switchhead.model.lm import check_ids
from switchhead.model.tokenizer import check_tokenizer
from switchhead.runtime.backends import Backend
from switchhead.runtime.cache import XLCache
from switchhead.runtime.sampling import SamplingParams, TokenHistory, check_seed, check_utf8, choose, seed_or_random

# Tokens of context kept in front of new ids when detokenising incrementally: enough that the first new piece
# keeps its leading space (SentencePiece drops a leading '▁' at the start of a decode) and that byte-fallback
# pieces of one character are decoded together.
_DETOK_CONTEXT = 4


def feed(backend: Backend, cache: XLCache, rows: Sequence[Sequence[int]], step: int | None = None,
         keep: str = "last", trusted: bool = False) -> list[Tensor | None]:
    """Run every row's tokens through the cache; steps never cross a row's chunk boundary.

    `step` caps the tokens per step (default: the chunk length). Returns per row the logits of its last token
    ([V], keep="last") or of all its tokens ([n, V], keep="all"); None for rows given no tokens. `trusted`
    rows (checked prompts, sampled tokens) skip the id check, which a decode step need not pay for.
    """
    if len(rows) != cache.batch:
        raise SwitchheadError(f"feed got {len(rows)} rows for a cache of batch {cache.batch}")
    if not trusted:
        check_ids(rows, backend.config.vocab_size)
    step = cache.T if step is None else step
    if step < 1:
        raise SwitchheadError(f"step must be >= 1, got {step}")
    done = [0] * len(rows)
    out: list[list[Tensor]] = [[] for _ in rows]
    while any(done[b] < len(r) for b, r in enumerate(rows)):
        room = cache.room().tolist()
        counts = [min(len(r) - done[b], room[b], step) for b, r in enumerate(rows)]
        t = max(counts)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        for b, r in enumerate(rows):
            if counts[b]:
                ids[b, :counts[b]] = torch.as_tensor(r[done[b]:done[b] + counts[b]], dtype=torch.long)
        cache.begin(counts, t)
        logits = backend.forward(ids.to(cache.device), cache)
        cache.commit()
        for b, n in enumerate(counts):
            if n:
                out[b].append(logits[b, :n] if keep == "all" else logits[b, n - 1:n])
                done[b] += n
    return [(torch.cat(o) if keep == "all" else o[-1][0]) if o else None for o in out]


class Detokenizer:
    """Incremental SentencePiece decoding: `push` a token id, get the text it completes (maybe '').

    Text is only released once it is stable: the decode of the recent ids must extend what was already
    released and must not end in U+FFFD (an unfinished multi-byte character from byte-fallback pieces)."""

    def __init__(self, sp, context: Sequence[int] = ()):
        self.sp = sp
        self.ids = list(context[-_DETOK_CONTEXT:])
        self.prefix = 0  # decoding starts here (context in front keeps spaces right)
        self.read = len(self.ids)  # ids before this are already released

    def push(self, token: int) -> str:
        if not isinstance(token, numbers.Integral) or isinstance(token, bool) or \
                not 0 <= token < self.sp.get_piece_size():
            raise SwitchheadError(f"token id {token!r} is outside the vocabulary [0, {self.sp.get_piece_size()})")
        self.ids.append(int(token))
        return self._release(final=False)

    def flush(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        before = self.sp.decode(self.ids[self.prefix:self.read])
        now = self.sp.decode(self.ids[self.prefix:])
        if not now.startswith(before):
            # Context ids may end inside a character (token ids cut between its byte pieces): the U+FFFD of its
            # bytes was never text, the character the new pieces complete is. Without this nothing is ever released.
            same = next((i for i, (a, b) in enumerate(zip(before, now)) if a != b), min(len(before), len(now)))
            if not before[same:].strip("\ufffd"):
                before = before[:same]
        if len(now) <= len(before) or not now.startswith(before) or (now.endswith("\ufffd") and not final):
            return ""
        self.prefix = max(self.read, len(self.ids) - _DETOK_CONTEXT)
        self.read = len(self.ids)
        return now[len(before):]


class StopText:
    """Accumulates generated text, cuts it at the first stop string, and releases only text that can no
    longer turn out to be the start of a stop string.

    Each stop string is matched as a Knuth-Morris-Pratt automaton fed one character at a time, so a step costs
    what its new text costs, however long the stop strings or the text so far (a rescan of the text's tail at
    every token grew with the cube of the length for long stop strings)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self._fallback = [_prefix_function(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # per stop: its longest prefix that the text ends with
        self.text = ""
        self.released = 0
        self.stopped = False

    def add(self, piece: str) -> str:
        if self.stopped or not piece:
            return ""
        base = len(self.text)
        self.text += piece
        first = None  # the earliest start of a stop string that ends in this piece
        for j, (s, fallback) in enumerate(zip(self.stops, self._fallback)):
            m = self._matched[j]
            for i, ch in enumerate(piece):
                while m and s[m] != ch:
                    m = fallback[m - 1]
                if s[m] == ch:
                    m += 1
                if m == len(s):
                    start = base + i + 1 - m
                    first = start if first is None else min(first, start)
                    break
            self._matched[j] = m
        if first is not None:
            self.text = self.text[:first]
            self.stopped = True
            return self._release(first)
        return self._release(len(self.text) - max(self._matched, default=0))

    def finish(self) -> str:
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        out = self.text[self.released:end]
        self.released = max(self.released, end)
        return out


def _prefix_function(s: str) -> list[int]:
    """For each prefix s[:i+1], the length of its longest proper prefix that is also its suffix."""
    pi = [0] * len(s)
    for i in range(1, len(s)):
        k = pi[i - 1]
        while k and s[k] != s[i]:
            k = pi[k - 1]
        pi[i] = k + (s[k] == s[i])
    return pi


@dataclass
class Generation:
    prompt: str
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    finish_reason: str = "length"
    seed: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def to_dict(self) -> dict:
        return {
            "prompt": self.prompt, "text": self.text, "tokens": len(self.tokens), "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason, "seed": self.seed,
            "prefill_tokens_per_s": _rate(self.prompt_tokens, self.prefill_s),
            "decode_tokens_per_s": _rate(len(self.tokens), self.decode_s),
        }


def _describe(value: object) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} of shape {tuple(shape)}" if shape is not None else repr(value)[:60]


def _rate(n: int, s: float) -> float | None:
    return round(n / s, 2) if s > 0 else None


def _banned_ids(sp, eos: int, vocab: int) -> Tensor | None:
    """Ids that are never sampled: UNK (it decodes to ' ⁇ ', not text) and control pieces other than EOS."""
    ids = [i for i in range(vocab)
           if sp.is_unknown(i) or (sp.is_control(i) and i != eos)]
    if not ids:
        return None
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[ids] = True
    return mask


class Generator:
    """Text in, text out, over any `Backend` and a SentencePiece tokenizer.

    Prompts are primed with the tokenizer's EOS id when it has one: in training streams EOS separates
    documents, so a prompt then starts the way every training document does.
    """

    def __init__(self, backend: Backend, tokenizer, prime_eos: bool = True, prefill_step: int | None = None):
        if not isinstance(backend, Backend):
            raise SwitchheadError(f"Generator needs a Backend (e.g. TorchBackend(model)), got {type(backend).__name__}")
        if tokenizer is None:
            raise SwitchheadError("Generator needs the model's SentencePiece tokenizer (its tokenizer.model)")
        check_tokenizer(tokenizer, backend.config.vocab_size)
        self.backend, self.sp = backend, tokenizer
        self.eos = tokenizer.eos_id()
        self.prime = [self.eos] if prime_eos and self.eos >= 0 else []
        if prefill_step is not None and (not isinstance(prefill_step, numbers.Integral) or
                                         isinstance(prefill_step, bool) or prefill_step < 1):
            raise SwitchheadError(f"prefill_step must be an integer >= 1 or None, got {prefill_step!r}")
        self.prefill_step = prefill_step
        self.banned = _banned_ids(tokenizer, self.eos, backend.config.vocab_size)
        self._warm = False

    def warmup(self) -> None:
        """One throwaway step, so one-time costs (lazy imports, op registration, allocator growth) do not
        land in the first request's prefill timing."""
        if not self._warm:
            feed(self.backend, self.backend.new_cache(1), [[max(self.eos, 0)]], trusted=True)
            self._warm = True

    def encode(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise SwitchheadError(f"a prompt must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise SwitchheadError("empty prompt: give some text to continue")
        check_utf8(prompt, "prompt")  # SentencePiece cannot take lone surrogates
        ids = self.sp.encode(prompt)
        if not ids:
            raise SwitchheadError("the prompt encodes to no tokens")
        return ids

    def generate(self, prompts: Sequence[str], params: SamplingParams, seeds: Sequence[int] | None = None,
                 on_text: Callable[[int, str], None] | None = None) -> list[Generation]:
        """Generate for a batch of prompts at once. Row i samples with ``seeds[i]`` (default: params.seed, or
        a random seed; every seed in [0, 2**64 - 1]); its random draws do not depend on the other rows
        (its logits may, in the last bits: batched products round differently).
        `on_text(i, text)` streams text. A single string is one prompt."""
        if isinstance(prompts, str):
            prompts = [prompts]
        elif not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
            raise SwitchheadError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}")
        return self.generate_ids([self.encode(p) for p in prompts], params, seeds, on_text, prompts)

    def generate_ids(self, encoded: Sequence[Sequence[int]], params: SamplingParams,
                     seeds: Sequence[int] | None = None, on_text: Callable[[int, str], None] | None = None,
                     prompts: Sequence[str] | None = None) -> list[Generation]:
        """`generate` for prompts given as token ids; an empty prompt starts a new document (needs EOS)."""
        # Token ids as tensors or arrays (a [B, t] tensor, rows of one) become plain ints, as check_ids expects.
        if getattr(encoded, "ndim", 2) != 2 or isinstance(encoded, (str, bytes)) or not isinstance(
                encoded, Sequence) and not hasattr(encoded, "tolist"):
            raise SwitchheadError(f"encoded must be rows of token ids (a list of lists or a [batch, tokens] "
                                  f"tensor), got {_describe(encoded)}")
        rows = [ids.tolist() if hasattr(ids, "tolist") else ids for ids in encoded]
        if bad := next((r for r in rows if isinstance(r, (str, bytes)) or not isinstance(r, Sequence)), None):
            raise SwitchheadError(f"each row of encoded must be a list of token ids, got {_describe(bad)} "
                                  f"(text goes to generate)")
        encoded = [list(r) for r in rows]
        if not encoded:
            return []
        check_ids(encoded, self.backend.config.vocab_size)
        if not isinstance(params, SamplingParams):
            raise SwitchheadError(f"params must be SamplingParams, got {type(params).__name__}")
        if not self.prime and not all(encoded):
            raise SwitchheadError("an empty prompt needs a tokenizer with an EOS id to start from")
        prompts = prompts if prompts is not None else [self.sp.decode(ids) for ids in encoded]
        if seeds is None:
            seeds = [seed_or_random(params.seed)] * len(prompts)
        elif not isinstance(seeds, Sequence) or isinstance(seeds, (str, bytes)):
            raise SwitchheadError(f"seeds must be a list of integers, one per prompt, got {_describe(seeds)}")
        if len(seeds) != len(prompts):
            raise SwitchheadError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        for s in seeds:
            check_seed(s)
        results = [Generation(p, prompt_tokens=len(ids), seed=int(s)) for p, ids, s in zip(prompts, encoded, seeds)]
        return self._run(encoded, params, results, on_text)

    def _run(self, encoded, params, results, on_text):
        B, V = len(encoded), self.backend.config.vocab_size
        history = TokenHistory(params, V, encoded)  # the prompts, not the EOS prime, count as seen
        self.warmup()
        cache = self.backend.new_cache(B)
        gens = [torch.Generator().manual_seed(r.seed) for r in results]
        t0 = time.perf_counter()
        last = torch.stack(feed(self.backend, cache, [self.prime + ids for ids in encoded], self.prefill_step,
                                trusted=True))  # checked by generate_ids
        prefill_s = time.perf_counter() - t0
        detoks = [Detokenizer(self.sp, self.prime + ids) for ids in encoded]
        texts = [StopText(params.stop) for _ in encoded]
        active = [True] * B

        def emit(b: int, piece: str) -> None:
            piece = texts[b].add(piece)
            if piece and on_text is not None:
                on_text(b, piece)

        t0 = time.perf_counter()
        ended = [0.0] * B  # each row's decode time: until the step that finished it, not the batch's last
        while any(active):
            running = active.copy()
            if self.banned is not None:
                last = last.masked_fill(self.banned.to(last.device), float("-inf"))
            nxt = choose(last, params, history, gens).tolist()
            for b in range(B):
                if not active[b]:
                    continue
                tok, r = nxt[b], results[b]
                if params.stop_at_eos and tok == self.eos:
                    r.finish_reason, active[b] = "eos", False
                    continue
                r.tokens.append(tok)
                history.add(b, tok)
                emit(b, detoks[b].push(tok))
                if texts[b].stopped:
                    r.finish_reason, active[b] = "stop", False
                elif len(r.tokens) >= params.max_new_tokens:
                    active[b] = False
            now = time.perf_counter() - t0
            ended = [now if was and not still else e for was, still, e in zip(running, active, ended)]
            if not any(active):
                break
            ids = [[nxt[b]] if active[b] else [] for b in range(B)]
            step = feed(self.backend, cache, ids, trusted=True)
            last = torch.stack([s if s is not None else last[b] for b, s in enumerate(step)])
        for b, r in enumerate(results):
            if not texts[b].stopped:
                emit(b, detoks[b].flush())
            tail = texts[b].finish()
            if tail and on_text is not None:
                on_text(b, tail)
            r.text = texts[b].text
            r.prefill_s, r.decode_s = prefill_s, ended[b]
        return results
