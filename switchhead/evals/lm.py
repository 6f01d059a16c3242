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

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from switchhead.errors import SwitchheadError
from switchhead.runtime import Backend, Generator, SamplingParams, TorchBackend

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


@register_model("switchhead")
class SwitchheadLM(LM):
    """lm-eval model over a switchhead checkpoint (``ckpt=DIR``), ONNX export (``onnx=DIR``), or objects
    passed directly (``model=`` a TransformerLM or a runtime Backend, ``tokenizer=`` a SentencePieceProcessor)."""

    def __init__(self, ckpt: str | None = None, onnx: str | None = None, model=None, tokenizer=None,
                 batch_size: int | str | None = DEFAULT_BATCH_SIZE, device: str | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, progress: bool = True, threads: int | None = None,
                 **_ignored):
        super().__init__()
        if sum(x is not None for x in (ckpt, onnx, model)) != 1:
            raise SwitchheadError("give exactly one of ckpt=DIR, onnx=DIR or model=")
        device = _device(device)
        if ckpt is not None:
            from switchhead.model.checkpoint import load

            model, ckpt_tokenizer = load(ckpt, device=device)
            tokenizer = tokenizer or ckpt_tokenizer
            backend = TorchBackend(model)
        elif onnx is not None:
            from switchhead.export import load_backend

            backend = load_backend(onnx, threads=threads)  # ONNX Runtime's threads; torch's are global
            tokenizer = tokenizer or backend.tokenizer
        elif isinstance(model, torch.nn.Module):
            backend = TorchBackend(model.to(device))
        elif isinstance(model, Backend):
            backend = model
        else:
            raise SwitchheadError(f"model= must be a TransformerLM or a runtime Backend, got {type(model).__name__}")
        if tokenizer is None:
            raise SwitchheadError("evaluation needs the model's tokenizer, and none was found (a checkpoint keeps "
                                  "it as tokenizer.model)")
        if tokenizer.get_piece_size() > backend.config.vocab_size:
            raise SwitchheadError(f"the tokenizer has {tokenizer.get_piece_size()} pieces but the model only "
                                  f"{backend.config.vocab_size} outputs")
        if tokenizer.eos_id() < 0:
            raise SwitchheadError("the tokenizer has no EOS id (the document separator evaluation relies on)")
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_id()
        # SentencePiece's dummy prefix turns a document's first word "The" into "▁The", the same piece as
        # " The" inside text; a leading space at a document start is therefore already represented.
        first = tokenizer.encode("a", out_type=str)
        self._dummy_prefix = bool(first) and first[0].startswith("\u2581")
        # lm-eval may pass "auto" (a GPU memory probe); sequences here are short, a fixed size is fine.
        auto = batch_size is None or str(batch_size).startswith("auto")
        try:
            self.batch_size = DEFAULT_BATCH_SIZE if auto else int(batch_size)
        except ValueError:
            raise SwitchheadError(f"batch size must be a positive integer, got {batch_size!r}") from None
        if self.batch_size < 1:
            raise SwitchheadError(f"batch size must be positive, got {batch_size}")
        self.max_gen_toks = int(max_gen_toks)
        self.progress = str(progress).lower() not in ("false", "0", "no")
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
        results: list[tuple[float, bool] | None] = [None] * len(sequences)
        todo = []
        for i, (tokens, n_ctx) in enumerate(sequences):
            if n_ctx < 1:
                raise ValueError("n_context must be >= 1 (a token to predict from)")
            if len(tokens) <= n_ctx:
                results[i] = (0.0, True)
            else:
                todo.append(i)
        # Longest first: similar lengths share a batch (little padding) and memory problems show up at once.
        todo.sort(key=lambda i: -len(sequences[i][0]))
        with tqdm(total=len(sequences), desc=desc, disable=not self.progress, leave=False) as bar:
            bar.update(len(sequences) - len(todo))
            for start in range(0, len(todo), self.batch_size):
                batch = todo[start:start + self.batch_size]
                for i, r in zip(batch, self._score_batch([sequences[i] for i in batch])):
                    results[i] = r
                bar.update(len(batch))
        return results  # type: ignore[return-value]

    def _score_batch(self, seqs: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        T = self.backend.config.chunk_len
        B, L = len(seqs), max(len(t) for t, _ in seqs)
        # Right padding never influences real positions: attention is causal and chunks start at 0 for all.
        ids = torch.full((B, L), self.eos, dtype=torch.long)
        lengths = torch.tensor([len(t) for t, _ in seqs])
        first = torch.tensor([n for _, n in seqs])  # index of the first scored token
        for b, (t, _) in enumerate(seqs):
            ids[b, :len(t)] = torch.tensor(t)
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
        for req in requests:
            ctx, cont = self.encode_pair(*req.args[:2])
            seqs.append((ctx + cont, len(ctx)))
        return self._with_progress(disable_tqdm, self.score, seqs, "loglikelihood")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood: every token scored, the first one given the EOS start token."""
        seqs = []
        for req in requests:
            seqs.append(([self.eos] + self.encode(self._at_start(req.args[0])), 1))
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
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1] if len(req.args) > 1 else {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else [u for u in until if u]
            jobs.append((context, tuple(until), int(kwargs.get("max_gen_toks", self.max_gen_toks))))
        out: list[str | None] = [None] * len(jobs)
        generator = Generator(self.backend, self.tokenizer)
        groups: dict[tuple, list[int]] = {}
        for i, (_, until, max_new) in enumerate(jobs):
            groups.setdefault((until, max_new), []).append(i)
        with tqdm(total=len(jobs), desc="generate_until", disable=disable_tqdm or not self.progress,
                  leave=False) as bar:
            for (until, max_new), idx in groups.items():
                params = SamplingParams(max_new_tokens=max(1, max_new), temperature=0.0, stop=until)
                for start in range(0, len(idx), self.batch_size):
                    part = idx[start:start + self.batch_size]
                    # An empty context is a new document: the generator's EOS priming is all there is.
                    contexts = [self.encode(self._at_start(jobs[i][0])) if jobs[i][0] else [] for i in part]
                    for i, g in zip(part, generator.generate_ids(contexts, params)):
                        out[i] = g.text
                    bar.update(len(part))
        return out  # type: ignore[return-value]
