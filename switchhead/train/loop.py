"""The training loop: tokenizer, token streams, AdamW + cosine schedule, XL memory across steps, gradient
accumulation, mixed precision, periodic evaluation, atomic checkpoints, exact resume, and DDP under torchrun. What
it writes into ``--out`` and reads back on ``--resume`` is in `switchhead.train.rundir`.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from switchhead.devices import memory as device_memory
from switchhead.devices import native_half, out_of_memory, resolve_device
from switchhead.errors import CheckpointError, SwitchheadError, check_flag, is_finite_number, is_int
from switchhead.fileio import as_path, text_paths
from switchhead.model.accounting import count_params
from switchhead.model.checkpoint import save
from switchhead.model.config import ModelConfig, resolve_config
from switchhead.model.lm import TransformerLM, eval_mode
from switchhead.model.tokenizer import (
    MIN_VOCAB_SIZE,
    load_tokenizer,
    save_tokenizer,
    tokenizer_fingerprint,
    train_tokenizer,
)
from switchhead.runtime.sampling import check_seed, seed_plus
from switchhead.train.data import (
    LaneBatcher,
    TokenStream,
    check_cache_dir,
    check_data_files,
    default_cache_dir,
    eval_lanes,
    load_stream,
    stream_nll,
)
from switchhead.train.rundir import (
    CHECKPOINT_DIR,
    FINAL_DIR,
    METRICS_FILE,
    TOKENIZER_FILE,
    check_out_dir,
    compare_specs,
    lock_run_dir,
    read_resume_state,
    refuse_if_in_use,
    run_spec,
    truncate_metrics,
    write_run_spec,
)
from switchhead.train.schedule import lr_at
from switchhead.train.state import write_training_checkpoint

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class TrainOptions:
    """Everything `train` needs; the CLI maps its flags one to one onto these fields."""

    config: str | ModelConfig
    data: list[str]
    out: str
    tokenizer: str | None = None
    vocab_size: int = 8000
    steps: int = 100_000
    batch_size: int = 64
    grad_accum: int = 1  # pieces each process's lanes are run in per step, gradients summed (less memory)
    lr: float = 2.5e-4
    warmup: int = 0
    grad_clip: float | None = None  # None: the model config's grad_clip
    eval_data: list[str] = field(default_factory=list)
    eval_every: int = 1000
    eval_batch_size: int | None = None  # lanes the held-out stream is cut into; None: batch_size
    save_every: int = 1000
    log_every: int = 10
    resume: bool = False
    seed: int = 0
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = (
        None  # None: bfloat16 on a GPU that supports it, float16 on older GPUs, float32 on CPU
    )
    cache_dir: str | None = None
    progress: bool = True
    tokenizer_sentences: int = 200_000
    unwrap: bool = False  # join hard-wrapped lines into paragraphs (train and eval data, tokenizer training)


@dataclass
class TrainResult:
    out: Path
    final: Path | None
    step: int
    interrupted: bool
    last_loss: float | None
    val_ppl: float | None
    main_process: bool = True  # rank 0: the one process (of several under torchrun) that reports
    signal: int | None = None  # the signal that interrupted the run


# --- distributed helpers ---


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world() -> int:
    return dist.get_world_size() if _dist_on() else 1


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def _setup_distributed(device_opt: str | None) -> tuple[torch.device, bool]:
    """Join the torchrun process group when launched by torchrun; return (device, we_initialised_it)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _dist_on():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = torch.cuda.is_available() and (device_opt is None or device_opt.startswith("cuda"))
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        return device, True
    if device_opt is None:
        device_opt = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_device(device_opt), False


def check_fits(config: ModelConfig, device: torch.device) -> None:
    """Refuse, before the tokenizer and the data are prepared, a model whose fp32 weights, gradients and two
    AdamW moments alone (16 bytes per parameter) exceed the device's whole memory: building it would end in
    an allocation traceback, or the out-of-memory killer, only after that work."""
    params = count_params(config)["total"]
    need, mem = 16 * params, device_memory(device)
    if mem is not None and need > mem[0]:
        raise SwitchheadError(f"the model ({params:,} parameters) needs at least "
                              f"{need / 2**30:,.1f} GiB for its weights, gradients and AdamW state; {mem[1]}")


def _amp_dtype(device: torch.device, dtype_opt: str | None) -> torch.dtype:
    if dtype_opt is None:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if not isinstance(dtype_opt, str) or dtype_opt not in DTYPES:
        raise SwitchheadError(f"unknown --dtype {dtype_opt!r}; choose from float32, bfloat16, float16")
    dtype = DTYPES[dtype_opt]
    if dtype == torch.float16 and device.type != "cuda":
        raise SwitchheadError("--dtype float16 needs a CUDA device (use bfloat16 or float32 on the CPU)")
    return dtype


# --- evaluation ---


@torch.no_grad()
def evaluate(
    model: TransformerLM,
    stream: TokenStream,
    n_lanes: int,
    device: torch.device,
    amp_dtype: torch.dtype = torch.float32,
    progress: str | None = None,
) -> dict[str, float]:
    """Per-token loss and perplexity over `stream`, chunk by chunk with XL memory (split across DDP ranks)."""
    if not isinstance(model, TransformerLM):
        raise SwitchheadError(f"evaluate needs a TransformerLM, got {type(model).__name__}")
    if not isinstance(stream, TokenStream):
        raise SwitchheadError(f"evaluate needs a TokenStream (switchhead.train.data), got {type(stream).__name__}")
    if not is_int(n_lanes) or n_lanes < 1:
        raise SwitchheadError(f"n_lanes must be a positive integer, got {n_lanes!r}")
    device = resolve_device(device)
    if amp_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise SwitchheadError(f"amp_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {amp_dtype!r}")
    if progress is not None and not isinstance(progress, str):
        raise SwitchheadError(f"progress must be a label (str) or None, got {type(progress).__name__}")
    rank, world = _rank(), _world()
    cfg = model.config
    lanes = range(rank, eval_lanes(n_lanes, len(stream), cfg.chunk_len), world)

    def logits(x: torch.Tensor, memory: torch.Tensor | None):
        with _autocast(device, amp_dtype):
            return model(x.to(device), memory)

    with eval_mode(model):
        nll, scored = stream_nll(logits, stream, n_lanes, cfg.chunk_len, lanes=list(lanes), progress=progress)
    # A rank without lanes (more ranks than lanes) still joins the all-reduce, with zeros.
    nll = torch.zeros((), dtype=torch.float64, device=device) if nll is None else nll
    count = torch.tensor(float(scored), dtype=torch.float64, device=device)
    if _dist_on():
        dist.all_reduce(nll)
        dist.all_reduce(count)
    loss = (nll / count).item()
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": int(count.item())}


def _autocast(device: torch.device, amp_dtype: torch.dtype):
    if amp_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp_dtype)


# --- RNG ---


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"].to(torch.uint8).cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8).cpu(), device)


def _gather_objects(obj) -> list:
    if not _dist_on():
        return [obj]
    out = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _gather_lanes(t: torch.Tensor | None) -> torch.Tensor | None:
    """Concatenate every rank's lanes (dim 1 of the memory) in rank order (ranks own consecutive lanes)."""
    if t is None or not _dist_on():
        return t
    parts = [torch.empty_like(t) for _ in range(_world())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=1)


def _param_checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum().item() for p in model.parameters()))


# --- the loop ---


class _StopFlag:
    """SIGINT/SIGTERM request a checkpoint and a clean stop after the current step; a second signal kills."""

    def __init__(self) -> None:
        self.requested = False
        self.signal: int | None = None
        self._old: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal = signum
        for sig, old in self._old.items():  # the next signal gets the default behaviour (hard stop)
            signal.signal(sig, old)

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals to the caller
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            with contextlib.suppress(ValueError):
                signal.signal(sig, old)


def train(opts: TrainOptions) -> TrainResult:
    """Train (or resume) a model as described by `opts`; see the module docstring for the output layout."""
    opts = _validated(opts)
    device, owns_group = _setup_distributed(opts.device)
    try:
        with contextlib.ExitStack() as held:
            return _train(opts, device, held)
    finally:
        if owns_group and _dist_on():
            dist.destroy_process_group()


def _validated(opts: TrainOptions) -> TrainOptions:
    """`opts` checked, with `data` and `eval_data` as lists of Paths (one str or Path is one file)."""
    if not isinstance(opts, TrainOptions):
        raise SwitchheadError(f"train takes TrainOptions, got {type(opts).__name__}")
    if not isinstance(opts.config, (str, os.PathLike, ModelConfig)) or not str(opts.config):
        raise SwitchheadError(f"--config must be a preset name, a config file or a ModelConfig, got {opts.config!r}")
    opts = replace(opts, data=text_paths(opts.data, "--data"), eval_data=text_paths(opts.eval_data, "--eval-data"))
    as_path(opts.out, "--out")
    for name in ("tokenizer", "cache_dir"):
        if getattr(opts, name) is not None:
            as_path(getattr(opts, name), f"--{name.replace('_', '-')}")
    for name in ("device", "dtype"):
        if (v := getattr(opts, name)) is not None and not isinstance(v, str):
            raise SwitchheadError(f"--{name} must be a string or None, got {type(v).__name__}")
    for name in ("resume", "progress", "unwrap"):
        check_flag(getattr(opts, name), name)
    _validate(opts)
    return opts


def _validate(opts: TrainOptions) -> None:
    for name in ("steps", "batch_size", "grad_accum", "eval_every", "save_every", "log_every"):
        v = getattr(opts, name)
        if not is_int(v) or v < 1:
            raise SwitchheadError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    if opts.eval_batch_size is not None and (not is_int(opts.eval_batch_size) or opts.eval_batch_size < 1):
        raise SwitchheadError(f"--eval-batch-size must be a positive integer, got {opts.eval_batch_size!r}")
    if not is_int(opts.vocab_size) or opts.vocab_size < 1:
        raise SwitchheadError(f"--vocab-size must be a positive integer, got {opts.vocab_size!r}")
    if opts.tokenizer is None and not opts.resume and opts.vocab_size < MIN_VOCAB_SIZE:  # before any work
        raise SwitchheadError(f"--vocab-size must be at least {MIN_VOCAB_SIZE} for a tokenizer trained on the data "
                              f"(byte fallback needs 256 pieces), got {opts.vocab_size}")
    if not is_finite_number(opts.lr) or not opts.lr > 0:
        raise SwitchheadError(f"--lr must be a positive finite number, got {opts.lr}")
    if opts.lr > _MAX_LR:  # AdamW's first step is 10 * lr: past this it cannot even be applied to float32 weights
        raise SwitchheadError(f"--lr must be at most {_MAX_LR:.1e} (AdamW's step overflows float32), got {opts.lr}")
    if not is_int(opts.warmup) or opts.warmup < 0:
        raise SwitchheadError(f"--warmup must be an integer >= 0, got {opts.warmup!r}")
    if opts.warmup > opts.steps:
        raise SwitchheadError(f"--warmup {opts.warmup} is longer than the run (--steps {opts.steps}): the learning "
                              f"rate would never reach --lr")
    if not is_int(opts.tokenizer_sentences) or opts.tokenizer_sentences < 1:
        raise SwitchheadError(f"tokenizer_sentences must be a positive integer, got {opts.tokenizer_sentences!r}")
    check_seed(opts.seed, "--seed")
    if opts.grad_clip is not None and (not is_finite_number(opts.grad_clip) or opts.grad_clip < 0):
        raise SwitchheadError(
            f"--grad-clip must be a finite number >= 0 (0 disables clipping), got {opts.grad_clip}"
        )


_MAX_LR = float(torch.finfo(torch.float32).max) / 20


def _train(opts: TrainOptions, device: torch.device, held: contextlib.ExitStack) -> TrainResult:
    rank, world = _rank(), _world()
    is_main = rank == 0
    out = Path(opts.out)
    amp_dtype = _amp_dtype(device, opts.dtype)
    if opts.batch_size % world:
        raise SwitchheadError(
            f"--batch-size {opts.batch_size} must be divisible by the number of processes ({world})"
        )
    per_rank = opts.batch_size // world
    if per_rank % opts.grad_accum:
        raise SwitchheadError(
            f"--grad-accum {opts.grad_accum} must divide the {per_rank} lanes each process runs "
            f"(--batch-size {opts.batch_size} / {world} process{'es' if world > 1 else ''})"
        )
    micro = per_rank // opts.grad_accum

    base_config = opts.config if isinstance(opts.config, ModelConfig) else resolve_config(opts.config)
    check_fits(base_config.replace(vocab_size=opts.vocab_size), device)  # the tokenizer's size is not known yet
    data_files = check_data_files(opts.data, "training data")
    eval_files = check_data_files(opts.eval_data, "evaluation data") if opts.eval_data else []
    refuse_if_in_use(out)
    old_spec = check_out_dir(out, opts.resume)  # with --resume, a run with its checkpoint; else None
    ckpt_dir = out / CHECKPOINT_DIR
    cache_dir = Path(opts.cache_dir) if opts.cache_dir else default_cache_dir()
    check_cache_dir(cache_dir, "--cache-dir" if opts.cache_dir else "token cache directory")
    _barrier()  # every rank has checked the directory before rank 0 starts writing into it

    # Tokenizer: the run's own copy when resuming; else the given one; else trained by rank 0 on the data.
    tok_path = out / TOKENIZER_FILE
    if old_spec is not None and tok_path.is_file():
        sp = load_tokenizer(tok_path)
        if opts.tokenizer is not None and tokenizer_fingerprint(
            load_tokenizer(opts.tokenizer)
        ) != tokenizer_fingerprint(sp):
            raise SwitchheadError(
                "cannot resume: --tokenizer differs from the tokenizer the run started with"
            )
    elif opts.tokenizer is not None:
        sp = load_tokenizer(opts.tokenizer)
    else:
        # Trained in memory and written only once every check has passed, so a refused run leaves no trace;
        # rank 0 trains and the others receive its model, so all ranks tokenize identically.
        proto = [None]
        if is_main:
            if opts.progress:  # SentencePiece reports nothing while it trains
                tqdm.write(f"training a tokenizer (vocab size up to {opts.vocab_size}) on the data ...",
                           file=sys.stderr)
            proto[0] = train_tokenizer(
                data_files, opts.vocab_size, max_sentences=opts.tokenizer_sentences, seed=opts.seed,
                unwrap=opts.unwrap,
            ).serialized_model_proto()
        if _dist_on():
            dist.broadcast_object_list(proto, src=0)
        sp = spm.SentencePieceProcessor(model_proto=proto[0])
    config = base_config.replace(vocab_size=sp.get_piece_size())
    if opts.grad_clip is not None:
        config = config.replace(grad_clip=opts.grad_clip)

    spec = run_spec(opts, config, tokenizer_fingerprint(sp), data_files, world)
    if old_spec is not None:
        compare_specs(old_spec, spec)

    # Token caches: rank 0 builds them, the others then map the finished files.
    if is_main:
        load_stream(sp, data_files + eval_files, cache_dir, unwrap=opts.unwrap, progress=opts.progress)
    _barrier()
    stream = load_stream(sp, data_files, cache_dir, unwrap=opts.unwrap)
    my_lanes = tuple(range(rank * per_rank, (rank + 1) * per_rank))
    batcher = LaneBatcher(stream, opts.batch_size, config.chunk_len, lanes=my_lanes)
    eval_stream = load_stream(sp, eval_files, cache_dir, unwrap=opts.unwrap) if eval_files else None

    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        lock_run_dir(out, held)
        check_out_dir(out, opts.resume)  # again: another run may have finished here while this one was preparing
        if old_spec is None:  # a new run, or one started over where the last stopped before its first checkpoint
            # run.json first: it marks the directory as a run, which a crash before the tokenizer is written
            # then leaves startable again (a lone tokenizer.model would make it a stranger's directory).
            write_run_spec(out, spec)
            save_tokenizer(sp, tok_path)
        elif not tok_path.is_file():
            save_tokenizer(sp, tok_path)
    _barrier()

    # The same seed on every rank gives identical initial weights (DDP also broadcasts rank 0's); dropout then
    # draws from a per-rank stream so ranks do not repeat each other's masks.
    torch.manual_seed(opts.seed)
    model = TransformerLM(config).to(device)
    stream_seed = seed_plus(opts.seed * 1000, 1 + rank)  # wraps modulo 2**64, as torch's seeds must
    torch.manual_seed(stream_seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(stream_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.0)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

    start_step, memory = 0, None
    # This log interval's per-step losses and gradient norms, left on the device (no sync per step). A checkpoint
    # keeps them, so that the first log line after a resume averages the same steps as an uninterrupted run's.
    losses: list[torch.Tensor] = []
    norms: list[torch.Tensor] = []
    if opts.resume:
        state, trainer_tensors = read_resume_state(ckpt_dir, model, opt, config, opts.batch_size)
        interval = state.get("log_interval_by_rank")
        if isinstance(interval, list) and len(interval) == world and isinstance(interval[rank], dict):
            losses = [torch.tensor(float(v), device=device) for v in interval[rank].get("losses", [])]
            norms = [torch.tensor(float(v), device=device) for v in interval[rank].get("grad_norms", [])]
        if state.get("scaler"):
            try:
                scaler.load_state_dict(state["scaler"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise CheckpointError(f"cannot resume: the grad-scaler state in {ckpt_dir} is malformed: {e}") from None
        start_step = state["step"]
        if start_step > opts.steps:
            raise SwitchheadError(
                f"cannot resume: the checkpoint in {ckpt_dir} is at step {start_step}, past --steps {opts.steps} "
                "(training cannot go back; pass --steps above it to continue)"
            )
        if "memory" in trainer_tensors:
            memory = trainer_tensors["memory"][:, my_lanes[0] : my_lanes[-1] + 1].to(device)
        if state.get("world_size") == world:
            if f"rng.{rank}.cpu" not in trainer_tensors:  # every checkpoint has one per process
                raise CheckpointError(f"cannot resume: the RNG state of process {rank} is missing in {ckpt_dir}")
            try:
                _set_rng_state(
                    {k.split(".")[-1]: v for k, v in trainer_tensors.items() if k.startswith(f"rng.{rank}.")},
                    device,
                )
            except (RuntimeError, TypeError, ValueError) as e:
                raise CheckpointError(f"cannot resume: the RNG state in {ckpt_dir} is malformed: {e}") from None
        elif is_main:
            tqdm.write(
                f"note: resuming with {world} processes instead of {state.get('world_size')}; dropout "
                "masks will differ from the uninterrupted run"
            )
        if is_main and spec != old_spec:
            # What may change on a resume (--steps, --save-every, --eval-data, ...) is recorded once the checkpoint
            # has been read, so that a later plain --resume continues with it rather than with the first run's.
            write_run_spec(out, spec)
    if is_main and device.type == "cpu" and amp_dtype == torch.bfloat16 and not native_half(torch.bfloat16):
        tqdm.write("note: this CPU has no bf16 instructions (avx512_bf16, amx_bf16), so PyTorch multiplies bf16 "
                   "matrices slowly here: --dtype float32 trains much faster on it", file=sys.stderr)
    if is_main and old_spec is not None:
        truncate_metrics(out / METRICS_FILE, start_step)
    elif is_main:  # a run started over where one stopped before its first checkpoint
        (out / METRICS_FILE).unlink(missing_ok=True)

    train_model = model
    if _dist_on():
        from torch.nn.parallel import DistributedDataParallel

        train_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )

    clip = config.grad_clip
    tokens_per_step = opts.batch_size * config.chunk_len
    metrics = open(out / METRICS_FILE, "a") if is_main else None  # noqa: SIM115 - closed in finally
    bar = tqdm(
        total=opts.steps,
        initial=start_step,
        disable=not (is_main and opts.progress),
        dynamic_ncols=True,
        desc="train",
        unit="step",
    )
    last_loss = val_ppl = None
    step = start_step
    interrupted = False
    saved_step = start_step if opts.resume else None

    def kept() -> str:
        return f"{ckpt_dir} still holds step {saved_step}" if saved_step is not None else "no checkpoint was written"

    def diverged(at: int, problem: str) -> SwitchheadError:
        return SwitchheadError(
            f"training diverged at step {at}: {problem}; stopped without saving it ({kept()}); "
            f"start a new run with a lower --lr than {opts.lr:g}"
        )

    def out_of_memory_at(at: int, evaluating: bool) -> SwitchheadError:
        # check_fits counts weights, gradients and optimizer state up front; activations grow with the batch
        # and are only known once a step runs.
        if evaluating:
            shape, advice = f"{opts.eval_batch_size or opts.batch_size} lanes", "a smaller --eval-batch-size"
        else:
            shape, advice = f"{opts.batch_size} lanes", "a smaller --batch-size"
            if micro > 1:  # the same optimisation step in smaller pieces
                advice = f"a larger --grad-accum (dividing {per_rank}) or {advice}"
        pieces = f", in {opts.grad_accum} pieces" if opts.grad_accum > 1 and not evaluating else ""
        return SwitchheadError(
            f"out of memory on {device} in {'the evaluation after ' if evaluating else ''}step {at} "
            f"({shape} x {config.chunk_len} tokens{pieces}); stopped ({kept()}); use {advice}"
            + ("" if device.type == "cpu" or amp_dtype != torch.float32 else " or --dtype bfloat16")
        )

    def accumulate_gradients(x: torch.Tensor, y: torch.Tensor, prev: torch.Tensor | None):
        """Forward and backward of this process's lanes in --grad-accum pieces of `micro` lanes, each piece with
        its lanes' memory: the gradient of the mean loss over all lanes (sigma-MoE entropy regularisers see one
        piece's batch, as they see one process's under DDP). Returns the mean LM loss (left on the device) and
        the lanes' new memory."""
        pieces, new_memory = [], []
        for i in range(opts.grad_accum):
            lanes = slice(i * micro, (i + 1) * micro)
            # DDP all-reduces the gradients in the last piece's backward only.
            last = i == opts.grad_accum - 1
            with contextlib.nullcontext() if last or not _dist_on() else train_model.no_sync():
                with _autocast(device, amp_dtype):
                    logits, piece_memory = train_model(x[lanes], None if prev is None else prev[:, lanes])
                    lm_loss = F.cross_entropy(logits.float().flatten(0, 1), y[lanes].flatten())
                    loss = lm_loss + model.aux_loss().float()
                scaler.scale(loss / opts.grad_accum).backward()
            pieces.append(lm_loss.detach())
            new_memory.append(piece_memory)
        if opts.grad_accum == 1:
            return pieces[0], new_memory[0]
        return torch.stack(pieces).mean(), None if new_memory[0] is None else torch.cat(new_memory, 1)

    def log(record: dict) -> None:
        if metrics is not None:
            try:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            except OSError as e:  # a full disk: one line, and the last checkpoint stays as it is
                raise SwitchheadError(f"cannot write {out / METRICS_FILE}: {e.strerror or e}") from None

    def checkpoint(step_done: int) -> None:
        nonlocal saved_step
        # Collective: every rank contributes its lanes' memory and its RNG state; rank 0 alone writes.
        full_memory = _gather_lanes(memory)
        rngs = _gather_objects({k: v.tolist() for k, v in _rng_state(device).items()})
        sums = _gather_objects(_param_checksum(model))
        interval = _gather_objects({"losses": [float(v) for v in losses], "grad_norms": [float(v) for v in norms]})
        # A sum of float32 values in float64 cannot overflow: it is finite exactly when every weight is.
        # Checked before every save: the loss is only looked at every --log-every steps, and a finite loss says
        # nothing of the update it drove.
        if not all(math.isfinite(s) for s in sums):
            raise diverged(step_done, "the weights are not finite")
        if len(set(sums)) != 1:
            raise RuntimeError(f"DDP ranks diverged: parameter checksums {sums}")
        if is_main:
            tensors = {} if full_memory is None else {"memory": full_memory}
            for r, st in enumerate(rngs):
                for k, v in st.items():
                    tensors[f"rng.{r}.{k}"] = torch.tensor(v, dtype=torch.uint8)
            epoch, pos = batcher.position(step_done)
            state = {
                "step": step_done,
                "epoch": epoch,
                "epoch_step": pos,
                "tokens_seen": step_done * tokens_per_step,
                "world_size": world,
                "param_checksums_by_rank": sums,
                "log_interval_by_rank": interval,
                "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                "run": spec,
            }
            write_training_checkpoint(ckpt_dir, model, sp, opt, state, tensors)
        _barrier()
        saved_step = step_done

    evaluating = False
    try:
        with _StopFlag() as stop:
            model.train()
            t_last, timed_steps = time.perf_counter(), 0  # steps this process ran since t_last
            for step in range(start_step, opts.steps):
                if batcher.position(step)[1] == 0:
                    memory = None  # a new epoch starts every lane over: the old memory is not its context
                x, y = batcher.batch(step)
                x = torch.from_numpy(np.ascontiguousarray(x)).to(device, non_blocking=True)
                y = torch.from_numpy(np.ascontiguousarray(y)).to(device, non_blocking=True)
                lr = lr_at(step, opts.lr, opts.steps, opts.warmup)
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.zero_grad(set_to_none=True)
                lm_loss, memory = accumulate_gradients(x, y, memory)
                scaler.unscale_(opt)  # (a no-op without a grad scaler) the norm is that of the true gradients
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
                if clip > 0:
                    torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip, grad_norm)
                scaler.step(opt)
                scaler.update()
                losses.append(lm_loss)
                norms.append(grad_norm)
                done, timed_steps = step + 1, timed_steps + 1

                if done % opts.log_every == 0 or done == opts.steps:
                    per_step = torch.stack(losses)
                    if _dist_on():
                        dist.all_reduce(per_step)
                        per_step /= world
                    values = per_step.tolist()
                    first = done - len(values)
                    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
                    if bad is not None:
                        raise diverged(first + bad + 1, f"the training loss is {values[bad]}")
                    last_loss = sum(values) / len(values)
                    # Before clipping, after DDP's all-reduce (the same on every rank); an fp16 step the grad
                    # scaler skipped for overflow has none.
                    finite = [v for v in torch.stack(norms).tolist() if math.isfinite(v)]
                    now = time.perf_counter()
                    tps = timed_steps * tokens_per_step / max(now - t_last, 1e-9)
                    log(
                        {
                            "step": done,
                            "loss": last_loss,
                            "lr": lr,
                            "grad_norm": sum(finite) / len(finite) if finite else None,
                            "tokens": done * tokens_per_step,
                            "tokens_per_s": round(tps, 1),
                            "time": time.time(),
                        }
                    )
                    bar.set_postfix(
                        loss=f"{last_loss:.4f}", tok_s=f"{tps:,.0f}", lr=f"{lr:.2e}", refresh=False
                    )
                    losses, norms, t_last, timed_steps = [], [], now, 0
                bar.update(1)

                if eval_stream is not None and (done % opts.eval_every == 0 or done == opts.steps):
                    evaluating, t_eval = True, time.perf_counter()
                    ev = evaluate(model, eval_stream, opts.eval_batch_size or opts.batch_size, device, amp_dtype,
                                  progress="validation" if opts.progress and is_main else None)
                    evaluating = False
                    t_last += time.perf_counter() - t_eval  # tokens/s counts training steps only
                    if not math.isfinite(ev["val_loss"]):
                        raise diverged(done, f"the validation loss is {ev['val_loss']}")
                    val_ppl = ev["val_ppl"]
                    log({"step": done, **ev})
                    if is_main:
                        tqdm.write(f"step {done}: val loss {ev['val_loss']:.4f}, val ppl {val_ppl:.2f}")

                stop_now = stop.requested
                if _dist_on():  # every rank must agree, or a lone rank would wait forever in the collectives
                    flag = torch.tensor(float(stop_now), device=device)
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                    stop_now = bool(flag.item())
                if stop_now and done < opts.steps:
                    checkpoint(done)
                    interrupted = True
                    step = done
                    break
                if done % opts.save_every == 0 or done == opts.steps:
                    t_save = time.perf_counter()
                    checkpoint(done)
                    t_last += time.perf_counter() - t_save
                step = done
    except (RuntimeError, MemoryError) as exc:
        if not out_of_memory(exc):
            raise
        raise out_of_memory_at(step + 1, evaluating) from None
    finally:
        bar.close()
        if metrics is not None:
            with contextlib.suppress(OSError):  # each record was flushed: only a failed write's is left to lose
                metrics.close()

    final = None
    if not interrupted:
        if is_main:
            final = save(out / FINAL_DIR, model, sp)
        _barrier()
        final = out / FINAL_DIR
    return TrainResult(
        out=out, final=final, step=step, interrupted=interrupted, last_loss=last_loss, val_ppl=val_ppl,
        main_process=is_main, signal=stop.signal if interrupted else None,
    )
