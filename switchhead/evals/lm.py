"""lm-eval model class over a switchhead model (registered as ``switchhead``).

Conventions (docs/EVAL.md explains them for readers of results):
- Every context starts a new document: the tokenizer's EOS id (our document separator) is prepended, so the
  first real token is scored given "start of document", exactly as the model saw document starts in training.
- Long inputs are never truncated: they are fed in windows of whole chunks with the Transformer-XL memory
  carried over, which is exactly the model's chunked forward.
- The model is reached through the runtime's `Backend` (PyTorch or ONNX Runtime): ``Backend.logits`` for
  scoring, the runtime's `Generator` (cached, batched) for generation -- the same code paths as
  ``switchhead generate``.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from switchhead.errors import SwitchheadError, brief, check_flag, is_int
from switchhead.runtime import Backend, Generator, SamplingParams, TorchBackend
from switchhead.runtime.sampling import check_utf8

# Bound on the logits materialised per forward call (floats), used to pick how many chunks one call covers.
_LOGITS_BUDGET = 1 << 25
DEFAULT_BATCH_SIZE = 64
DEFAULT_MAX_GEN_TOKS = 256

_active: weakref.ref | None = None


def active_model() -> SwitchheadLM:
    """The SwitchheadLM that scored requests most recently (tasks need its tokenizer for per-token metrics)."""
    model = _active() if _active is not None else None
    if model is None:
        raise SwitchheadError("this task's per-token metric needs a switchhead model (lm-eval model 'switchhead')")
    return model


def _device(device: str | None) -> str:
    # lm-eval's CLI passes device="cuda" by default; like its HF model, fall back to the CPU without one.
    # (switchhead's evaluate() refuses an explicit cuda without CUDA before constructing us.)
    if not device or (str(device).startswith("cuda") and not torch.cuda.is_available()):
        return "cpu"
    from switchhead.devices import resolve_device

    return str(resolve_device(device))  # an unknown name is a one-line error here, not a "corrupt checkpoint"


def _batch_size(value: object) -> int:
    # lm-eval passes its --batch_size through as typed: digits, or "auto"/"auto:N" (a GPU memory probe);
    # sequences here are short, a fixed size is fine for "auto".
    if value is None or (isinstance(value, str) and value.strip().startswith("auto")):
        return DEFAULT_BATCH_SIZE
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value)
    if not is_int(value) or value < 1:
        raise SwitchheadError(f"the batch size (batch_size) must be a positive integer or 'auto', got {brief(value)}")
    return value


def _max_gen_toks(value: object, what: str = "max_gen_toks") -> int:
    if not is_int(value) or value < 1:
        raise SwitchheadError(f"{what} must be an integer >= 1 (tokens to generate), got {brief(value)}")
    return value


def _request_args(req: object, i: int, method: str, names: tuple[str, ...], optional: int = 0) -> tuple:
    """The arguments of request `i`: `names` (the last `optional` of them may be missing), strings but for a
    generation's kwargs. One check per request: a malformed one is a message naming it, not a TypeError deep in
    the tokenizer."""
    args = getattr(req, "args", None)
    if not isinstance(args, (tuple, list)):
        raise SwitchheadError(f"{method}: requests must be lm_eval Instance objects (with .args), request {i} is "
                              f"a {type(req).__name__}")
    if not len(names) - optional <= len(args) <= len(names):
        raise SwitchheadError(f"{method}: request {i} must have the arguments ({', '.join(names)}), got "
                              f"{len(args)}: {brief(args)}")
    for name, arg in zip(names, args):
        if name == "gen_kwargs":
            continue
        if not isinstance(arg, str):
            raise SwitchheadError(f"{method}: request {i}'s {name} must be a string, got {type(arg).__name__} "
                                  f"{brief(arg)}")
        check_utf8(arg, f"{method}: request {i}'s {name}")  # a lone surrogate fails inside SentencePiece's binding
    return tuple(args)


def _until(value: object, i: int) -> tuple[str, ...]:
    """lm-eval's stop strings: one string or a list of them; empty ones would stop at once and are dropped."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(u, str) for u in value):
        raise SwitchheadError(f"generate_until: request {i}'s until must be a string or a list of strings, got "
                              f"{brief(value)}")
    return tuple(u for u in value if u)


@register_model("switchhead")
class SwitchheadLM(LM):
    """lm-eval model over a switchhead checkpoint (``ckpt=DIR``), ONNX export (``onnx=DIR``), or objects
    passed directly (``model=`` a TransformerLM or a runtime Backend, ``tokenizer=`` a SentencePieceProcessor)."""

    def __init__(self, ckpt: str | None = None, onnx: str | None = None, model=None, tokenizer=None,
                 batch_size: int | str | None = DEFAULT_BATCH_SIZE, device: str | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, progress: bool = True, threads: int | None = None,
                 **_ignored):
        super().__init__()
        given_tokenizer = tokenizer is not None
        if sum(x is not None for x in (ckpt, onnx, model)) != 1:
            raise SwitchheadError("give exactly one of ckpt=DIR, onnx=DIR or model=")
        # Checked before a checkpoint or export is loaded.
        self.batch_size = _batch_size(batch_size)
        self.max_gen_toks = _max_gen_toks(max_gen_toks)
        self.progress = check_flag(progress, "progress")
        if threads is not None:
            from switchhead.devices import check_threads

            check_threads(threads)
        where = _device(device) if device else None
        if ckpt is not None:
            from switchhead.model.checkpoint import load

            model, ckpt_tokenizer = load(ckpt, device=where or "cpu")
            tokenizer = ckpt_tokenizer if tokenizer is None else tokenizer
            backend = TorchBackend(model)
        elif onnx is not None:
            from switchhead.export import load_backend

            backend = load_backend(onnx, threads=threads)  # ONNX Runtime's threads; torch's are global
            tokenizer = backend.tokenizer if tokenizer is None else tokenizer
        elif isinstance(model, torch.nn.Module):
            # Module.to moves the caller's model in place: without a device asked for, it stays where it is.
            backend = TorchBackend(model.to(where) if where else model)
        elif isinstance(model, Backend):
            backend = model
        else:
            raise SwitchheadError(f"model= must be a TransformerLM or a runtime Backend, got {type(model).__name__}")
        if tokenizer is None:
            raise SwitchheadError("evaluation needs the model's tokenizer, and none was found (a checkpoint keeps "
                                  "it as tokenizer.model)")
        from switchhead.model.tokenizer import check_tokenizer

        check_tokenizer(tokenizer, backend.config.vocab_size,
                        "the tokenizer (tokenizer=)" if given_tokenizer else "the model's tokenizer")
        if tokenizer.eos_id() < 0:
            raise SwitchheadError("the tokenizer has no EOS id (the document separator evaluation relies on)")
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_id()
        # SentencePiece's dummy prefix turns a document's first word "The" into "▁The", the same piece as
        # " The" inside text; a leading space at a document start is therefore already represented.
        first = tokenizer.encode("a", out_type=str)
        self._dummy_prefix = bool(first) and first[0].startswith("\u2581")
        self._activate()

    def _activate(self) -> None:
        global _active
        _active = weakref.ref(self)

    # --- tokenisation -----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def _at_start(self, text: str) -> str:
        """`text` as the start of a document: one leading space is the dummy prefix's, whichever of context,
        continuation or document carries it, so where a text is split never changes its tokens."""
        return text[1:] if self._dummy_prefix and text.startswith(" ") else text

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids with the EOS prefix, continuation ids), split where the text is split.

        Trailing whitespace of the context moves to the continuation (as lm-eval does) so that the
        continuation's first piece is the word with its space, as it is tokenised in running text."""
        n_space = len(context) - len(context.rstrip())
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        if not context:
            continuation = self._at_start(continuation)
            return [self.eos], self.encode(continuation) if continuation else []
        context = self._at_start(context)
        ctx = self.encode(context)
        whole = self.encode(context + continuation)
        return [self.eos] + ctx, whole[len(ctx):]

    def continuation_length(self, context: str, continuation: str) -> int:
        return len(self.encode_pair(context, continuation)[1])

    # --- scoring ----------------------------------------------------------------------------------------
    def score(self, sequences: list[tuple[list[int], int]], desc: str = "scoring") -> list[tuple[float, bool]]:
        """For each (tokens, n_context): the summed log-probability of tokens[n_context:] given what precedes
        them, and whether each of those tokens is the argmax prediction. n_context >= 1."""
        self._activate()
        rows = self._check_sequences(sequences)
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        todo = []
        for i, (tokens, n_ctx) in enumerate(rows):
            if len(tokens) <= n_ctx:
                results[i] = (0.0, True)
            else:
                todo.append(i)
        # Longest first: similar lengths share a batch (little padding) and memory problems show up at once.
        todo.sort(key=lambda i: -len(rows[i][0]))
        with tqdm(total=len(rows), desc=desc, disable=not self.progress, leave=False) as bar:
            bar.update(len(rows) - len(todo))
            for start in range(0, len(todo), self.batch_size):
                batch = todo[start:start + self.batch_size]
                for i, r in zip(batch, self._score_batch([rows[i] for i in batch])):
                    results[i] = r
                bar.update(len(batch))
        return results  # type: ignore[return-value]

    def _check_sequences(self, sequences) -> list[tuple[torch.Tensor, int]]:
        """`sequences` with each one's tokens as a 1-D integer tensor (the one conversion scoring needs anyway),
        or a one-line error naming the first bad sequence: an id outside the vocabulary would otherwise fail deep
        in the forward (on CUDA as a device-side assert, after which the process cannot use the GPU)."""
        if not isinstance(sequences, (list, tuple)):
            raise SwitchheadError(f"score: sequences must be a list of (token ids, n_context) pairs, got "
                                  f"{type(sequences).__name__}")
        rows = []
        for i, seq in enumerate(sequences):
            if not isinstance(seq, (list, tuple)) or len(seq) != 2:
                raise SwitchheadError(f"score: sequence {i} must be a (token ids, n_context) pair, got {brief(seq)}")
            tokens, n_ctx = seq
            if not is_int(n_ctx) or n_ctx < 1:
                raise SwitchheadError(f"score: sequence {i}'s n_context must be an integer >= 1 (a token to predict "
                                      f"from), got {brief(n_ctx)}")
            try:
                ids = torch.as_tensor(tokens) if not isinstance(tokens, (str, bytes)) else None
            except (TypeError, ValueError, RuntimeError, OverflowError):  # not numbers, ragged, beyond int64
                ids = None
            if ids is not None and ids.ndim == 1 and not len(ids):
                ids = ids.long()  # [] reads as float
            if ids is None or ids.ndim != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise SwitchheadError(f"score: sequence {i}'s tokens must be a list of integer token ids, got "
                                      f"{brief(tokens)}")
            rows.append((ids, n_ctx))
        vocab = self.backend.config.vocab_size
        flat = torch.cat([ids.cpu().long() for ids, _ in rows]) if rows else torch.zeros(0, dtype=torch.long)
        if len(flat) and not (0 <= int(flat.min()) and int(flat.max()) < vocab):
            i, bad = next((i, ids) for i, (ids, _) in enumerate(rows) if len(ids) and
                          not (0 <= int(ids.min()) and int(ids.max()) < vocab))
            wrong = int(bad[(bad < 0) | (bad >= vocab)][0])
            raise SwitchheadError(f"score: sequence {i} has token id {wrong}, outside the model's vocabulary "
                                  f"(0 to {vocab - 1})")
        return rows

    def _score_batch(self, seqs: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        T = self.backend.config.chunk_len
        B, L = len(seqs), max(len(t) for t, _ in seqs)
        # Right padding never influences real positions: attention is causal and chunks start at 0 for all.
        ids = torch.full((B, L), self.eos, dtype=torch.long)
        lengths = torch.tensor([len(t) for t, _ in seqs])
        first = torch.tensor([n for _, n in seqs])  # index of the first scored token
        for b, (t, _) in enumerate(seqs):
            ids[b, :len(t)] = t
        total = torch.zeros(B, dtype=torch.float64)
        greedy = torch.ones(B, dtype=torch.bool)
        window = T * max(1, _LOGITS_BUDGET // (B * T * self.backend.config.vocab_size))
        state = None
        n_inputs = L - 1  # the last token is only a target
        for s in range(0, n_inputs, window):
            inp = ids[:, s:min(s + window, n_inputs)]
            logits, state = self.backend.logits(inp, state)
            pos = torch.arange(s + 1, s + 1 + inp.shape[1])  # positions of the predicted tokens
            mask = (pos[None, :] >= first[:, None]) & (pos[None, :] < lengths[:, None])
            if not mask.any():
                continue
            rows = logits[mask.to(logits.device)].float()
            targets = ids[:, s + 1:s + 1 + inp.shape[1]][mask].to(rows.device)
            lp = rows.gather(1, targets[:, None])[:, 0] - rows.logsumexp(1)
            hit = rows.argmax(1) == targets
            owner = torch.arange(B)[:, None].expand_as(mask)[mask]
            total.index_add_(0, owner, lp.double().cpu())
            greedy &= torch.zeros(B, dtype=torch.long).index_add_(0, owner, (~hit).long().cpu()) == 0
        return [(float(t), bool(g)) for t, g in zip(total, greedy)]

    # --- lm-eval API ------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        seqs = []
        for i, req in enumerate(requests):
            ctx, cont = self.encode_pair(*_request_args(req, i, "loglikelihood", ("context", "continuation")))
            seqs.append((ctx + cont, len(ctx)))
        return self._with_progress(disable_tqdm, self.score, seqs, "loglikelihood")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood: every token scored, the first one given the EOS start token."""
        seqs = []
        for i, req in enumerate(requests):
            (text,) = _request_args(req, i, "loglikelihood_rolling", ("text",))
            seqs.append(([self.eos] + self.encode(self._at_start(text)), 1))
        return [ll for ll, _ in self._with_progress(disable_tqdm, self.score, seqs, "loglikelihood_rolling")]

    def _with_progress(self, disable: bool, fn, *args):
        saved = self.progress
        self.progress = saved and not disable
        try:
            return fn(*args)
        finally:
            self.progress = saved

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding (sampling arguments are ignored) until a stop string, EOS or max_gen_toks, with the
        runtime's cached generator; requests sharing stop strings and length run in batches."""
        self._activate()
        jobs = []
        for i, req in enumerate(requests):
            args = _request_args(req, i, "generate_until", ("context", "gen_kwargs"), optional=1)
            context, kwargs = args[0], args[1] if len(args) > 1 and args[1] is not None else {}
            if not isinstance(kwargs, Mapping):
                raise SwitchheadError(f"generate_until: request {i}'s generation kwargs must be a dict (until, "
                                      f"max_gen_toks, ...), got {type(kwargs).__name__} {brief(kwargs)}")
            max_new = _max_gen_toks(kwargs.get("max_gen_toks", self.max_gen_toks),
                                    f"generate_until: request {i}'s max_gen_toks")
            jobs.append((context, _until(kwargs.get("until"), i), max_new))
        out: list[str | None] = [None] * len(jobs)
        generator = Generator(self.backend, self.tokenizer)
        groups: dict[tuple, list[int]] = {}
        for i, (_, until, max_new) in enumerate(jobs):
            groups.setdefault((until, max_new), []).append(i)
        with tqdm(total=len(jobs), desc="generate_until", disable=disable_tqdm or not self.progress,
                  leave=False) as bar:
            for (until, max_new), idx in groups.items():
                params = SamplingParams(max_new_tokens=max_new, temperature=0.0, stop=until)
                for start in range(0, len(idx), self.batch_size):
                    part = idx[start:start + self.batch_size]
                    # An empty context is a new document: the generator's EOS priming is all there is.
                    contexts = [self.encode(self._at_start(jobs[i][0])) if jobs[i][0] else [] for i in part]
                    for i, g in zip(part, generator.generate_ids(contexts, params)):
                        out[i] = g.text
                    bar.update(len(part))
        return out  # type: ignore[return-value]
