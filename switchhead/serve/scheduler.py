"""Continuous batching over one `XLCache`: a thread runs decode steps for every active row and admits new
sequences between steps.

Each admitted sequence owns one row of a cache of ``max_batch`` rows. A step feeds every busy row at once:
rows still reading their prompt take the next slice of it (cut exactly where a solo `engine.feed` would cut
it: at the row's chunk boundary and at the prefill step), decoding rows take their last sampled token, free
rows take nothing. Because every row keeps its own chunk bookkeeping in the cache, its own sampling parameters
and its own `torch.Generator`, a sequence produces the same tokens as `Generator.generate` alone, whichever
sequences share its steps.

Results travel back as events through a callback (`Job.sink`) called on the scheduler thread; the HTTP layer
hands them to its event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from switchhead.errors import SwitchheadError, is_finite_number, is_int
from switchhead.model.lm import check_ids
from switchhead.runtime.engine import Detokenizer, Generator, StopText, feed
from switchhead.runtime.sampling import SamplingParams, TokenHistory, check_seed, choose

log = logging.getLogger(__name__)


@dataclass
class TokenInfo:
    """One generated token, for OpenAI's `logprobs`: its id, its log-probability under the model, the top
    alternatives as (id, logprob), and where its text starts in the (uncut) completion text."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    offset: int


@dataclass
class Piece:
    """Text released by one generated token (maybe ''); `info` is set when logprobs were asked for."""

    text: str
    info: TokenInfo | None = None


@dataclass
class Finished:
    """The sequence ended. `reason` is the engine's: "eos", "stop" or "length"."""

    reason: str
    text: str
    completion_tokens: int
    prompt_tokens: int


@dataclass
class Failed:
    """The sequence was dropped: kind "timeout" (past its deadline), "shutdown" (the server is stopping) or
    "internal" (a bug in admitting it or in a step)."""

    kind: str
    message: str


Event = Piece | Finished | Failed


@dataclass(eq=False)
class Job:
    """One sequence to generate. `ids` are the prompt's tokens (without the EOS prime); `params.seed` must be
    set. `sink` receives the events, on the scheduler thread, and must not block."""

    ids: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    logprobs: int | None = None
    deadline: float | None = None  # time.monotonic() after which the job fails with "timeout"
    cancelled: bool = False
    done: bool = False


@dataclass(eq=False)
class _Row:
    job: Job
    todo: list[int]  # tokens still to feed: the rest of the prompt, or the last sampled token
    detok: Detokenizer
    text: StopText
    rng: torch.Generator
    history: TokenHistory
    tokens: list[int] = field(default_factory=list)
    raw: int = 0  # characters released by the detokenizer so far (before stop-string cutting)


def _allocate_cache(backend, max_batch: int):
    """The server's cache, allocated once at start; too large a --max-batch is one line, not torch's trace."""
    try:
        return backend.new_cache(max_batch)
    except SwitchheadError as e:
        raise SwitchheadError(f"--max-batch {max_batch}: {e}; lower --max-batch") from None


class Scheduler:
    """Owns the cache and the model; `submit` and `cancel` may be called from any thread."""

    def __init__(self, generator: Generator, max_batch: int = 8, max_queue: int = 64):
        if not isinstance(generator, Generator):
            raise SwitchheadError(f"Scheduler needs a Generator, got {type(generator).__name__}")
        if not is_int(max_batch) or max_batch < 1:
            raise SwitchheadError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not is_int(max_queue) or max_queue < 0:
            raise SwitchheadError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.gen, self.backend = generator, generator.backend
        self.max_batch, self.max_queue = max_batch, max_queue
        self.cache = _allocate_cache(self.backend, max_batch)
        self.rows: list[_Row | None] = [None] * max_batch
        self.pending: deque[Job] = deque()
        self.busy = 0  # rows in use; read by submit under the lock, written by the scheduler thread under it
        self.steps = 0
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # --- called from other threads ------------------------------------------------------------------------

    def start(self) -> None:
        self.gen.warmup()
        self._thread = threading.Thread(target=self._loop, name="switchhead-scheduler", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """Is the scheduler thread running? Nothing is generated (and no deadline enforced) without it."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def request_stop(self) -> None:
        """Stop without waiting: the sequences in flight, queued or submitted later end with a "shutdown"
        failure, so that their requests are answered (a stream gets its error event) instead of cut off."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    @property
    def capacity(self) -> int:
        """The most sequences one `submit` can ever take (a row each and a full queue, on an idle server)."""
        return self.max_batch + self.max_queue

    def submit(self, jobs: list[Job]) -> bool:
        """Queue all of `jobs` or none: False when more than `max_queue` sequences would be left waiting for a
        row, always when there are more than `capacity` of them. A malformed job is a `SwitchheadError` here,
        before anything is queued: on the scheduler thread it would fail every sequence sharing its step."""
        if not isinstance(jobs, (list, tuple)):
            raise SwitchheadError(f"submit takes a list of Jobs, got {type(jobs).__name__}")
        for job in jobs:
            self._check(job)
        with self._cond:
            if not self._stop and self._thread is None:
                raise SwitchheadError("the scheduler is not running: call start() before submit()")
            if self._stop:
                for job in jobs:
                    self._finish(job, Failed("shutdown", "server shutting down"))
                return True
            free = self.max_batch - self.busy
            if max(0, len(self.pending) + len(jobs) - free) > self.max_queue:
                return False
            self.pending.extend(jobs)
            self._cond.notify_all()
        return True

    def _check(self, job: Job) -> None:
        if not isinstance(job, Job):
            raise SwitchheadError(f"submit takes a list of Jobs, got an item of type {type(job).__name__}")
        if not isinstance(job.ids, (list, tuple)):
            raise SwitchheadError(f"Job.ids must be a list of token ids, got {type(job.ids).__name__}")
        check_ids([job.ids], self.backend.config.vocab_size)
        if not job.ids and not self.gen.prime:
            raise SwitchheadError("an empty prompt needs a tokenizer with an EOS id to start from")
        if not isinstance(job.params, SamplingParams):
            raise SwitchheadError(f"Job.params must be SamplingParams, got {type(job.params).__name__}")
        check_seed(job.params.seed, "Job.params.seed")  # each row's draws come from its own seeded generator
        if job.logprobs is not None and (not is_int(job.logprobs) or job.logprobs < 0):
            raise SwitchheadError(f"Job.logprobs must be None or an integer >= 0, got {job.logprobs!r}")
        if job.deadline is not None and not is_finite_number(job.deadline):
            raise SwitchheadError(f"Job.deadline must be None or a time.monotonic() value, got {job.deadline!r}")
        if not callable(job.sink):
            raise SwitchheadError(f"Job.sink must be callable, got {type(job.sink).__name__}")

    def cancel(self, job: Job) -> None:
        """Stop `job` (client gone): its row is freed before the next step."""
        with self._cond:
            job.cancelled = True
            self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            return {"active": self.busy, "queued": len(self.pending), "max_batch": self.max_batch,
                    "max_queue": self.max_queue, "steps": self.steps}

    # --- the scheduler thread -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self.busy and not self.pending:
                    self._cond.wait()
                if self._stop:
                    break
                self._drop_finished()
                self._admit()
            if not self.busy:
                continue
            try:
                self._step()
            except Exception as e:  # a bug in a step: fail the sequences in flight, keep serving the rest
                log.exception("decode step failed")
                with self._cond:
                    for b, row in enumerate(self.rows):
                        if row is not None:
                            self._free(b, Failed("internal", f"generation step failed: {e!r}"))
                    self.cache = None  # freed first: the memory check counts what is available
                    self.cache = self.backend.new_cache(self.max_batch)
        with self._cond:
            for b, row in enumerate(self.rows):
                if row is not None:
                    self._free(b, Failed("shutdown", "server shutting down"))
            while self.pending:
                self._finish(self.pending.popleft(), Failed("shutdown", "server shutting down"))

    def _drop_finished(self) -> None:
        now = time.monotonic()
        for b, row in enumerate(self.rows):
            if row is None:
                continue
            if row.job.cancelled:
                self._free(b, None)
            elif row.job.deadline is not None and now > row.job.deadline:
                self._free(b, Failed("timeout", "request timed out"))
        keep = deque()
        for job in self.pending:
            if job.cancelled:
                job.done = True
            elif job.deadline is not None and now > job.deadline:
                self._finish(job, Failed("timeout", "request timed out while queued"))
            else:
                keep.append(job)
        self.pending = keep

    def _admit(self) -> None:
        for b in range(self.max_batch):
            while self.pending and self.rows[b] is None:
                job = self.pending.popleft()
                try:
                    self.rows[b] = self._row(b, job)
                except Exception as e:  # a job this thread cannot take (a bug upstream): fail it, serve the rest
                    log.exception("admitting a job failed")
                    self._finish(job, Failed("internal", f"admitting the request failed: {e!r}"))
                else:
                    self.busy += 1
            if not self.pending:
                return

    def _row(self, b: int, job: Job) -> _Row:
        self.cache.reset_row(b)
        prompt = self.gen.prime + list(job.ids)
        # As in the engine: the prompt (not the EOS prime) counts as already seen.
        history = TokenHistory(job.params, self.backend.config.vocab_size, [job.ids])
        return _Row(job, prompt, Detokenizer(self.gen.sp, prompt), StopText(job.params.stop),
                    torch.Generator().manual_seed(job.params.seed), history)

    def _free(self, b: int, event: Event | None) -> None:
        row = self.rows[b]
        self.rows[b] = None
        self.busy -= 1
        if event is not None:
            self._finish(row.job, event)
        row.job.done = True

    @staticmethod
    def _finish(job: Job, event: Event) -> None:
        job.done = True
        try:
            job.sink(event)
        except Exception:  # a sink whose consumer is gone must not take the scheduler down
            log.exception("event sink failed")

    def _step(self) -> None:
        room = self.cache.room().tolist()
        step = self.gen.prefill_step or self.cache.T
        slices: list[list[int]] = [[] for _ in self.rows]
        for b, row in enumerate(self.rows):
            if row is not None and row.todo:
                n = min(len(row.todo), room[b], step)
                slices[b], row.todo = row.todo[:n], row.todo[n:]
        # Every slice fits its row's room and the step, so this is exactly one forward.
        last = feed(self.backend, self.cache, slices, trusted=True)  # encoded prompts and sampled tokens
        self.steps += 1
        ended: list[tuple[int, Event]] = []
        for b, row in enumerate(self.rows):
            if row is None or last[b] is None or row.todo:
                continue
            event = self._sample(row, last[b])
            if event is not None:
                ended.append((b, event))
        if ended:
            with self._cond:
                for b, event in ended:
                    self._free(b, event)

    def _sample(self, row: _Row, logits: Tensor) -> Finished | None:
        """Choose the row's next token and emit its text, with the engine's rules; a Finished when it ends."""
        job, p = row.job, row.job.params
        x = logits[None]
        if self.gen.banned is not None:
            x = x.masked_fill(self.gen.banned.to(x.device), float("-inf"))
        tok = int(choose(x, p, row.history, [row.rng])[0])
        if p.stop_at_eos and tok == self.gen.eos:
            return self._end(row, "eos")
        info = None
        if job.logprobs is not None:
            lp = x[0].float().log_softmax(-1)
            k = min(job.logprobs, lp.shape[-1])
            top = lp.topk(k) if k else None
            pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            info = TokenInfo(tok, float(lp[tok]), pairs, row.raw)
        row.tokens.append(tok)
        row.history.add(0, tok)
        raw = row.detok.push(tok)
        row.raw += len(raw)
        self._emit(row, Piece(row.text.add(raw), info))
        if row.text.stopped:
            return self._end(row, "stop")
        if len(row.tokens) >= p.max_new_tokens:
            return self._end(row, "length")
        row.todo = [tok]
        return None

    def _end(self, row: _Row, reason: str) -> Finished:
        tail = "" if row.text.stopped else row.text.add(row.detok.flush())
        tail += row.text.finish()
        if tail:
            self._emit(row, Piece(tail))
        return Finished(reason, row.text.text, len(row.tokens), len(row.job.ids))

    def _emit(self, row: _Row, piece: Piece) -> None:
        if piece.text or piece.info is not None:
            try:
                row.job.sink(piece)
            except Exception:
                log.exception("event sink failed")
