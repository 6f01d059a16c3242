"""Command-line interface: parses arguments and prints; the library does the work."""

from __future__ import annotations

import _thread
import contextlib
import errno
import json
import os
import signal
import sys

import click
import click.utils

from switchhead.errors import SwitchheadError


class Terminated(BaseException):
    """SIGTERM, raised wherever the program is, as Ctrl-C raises KeyboardInterrupt: `finally` blocks and context
    managers (an atomic output directory's temporary) clean up before the process exits. A BaseException, so
    that no `except Exception` takes it for an error of its own."""


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def _signals_as_exceptions():
    """SIGTERM raises `Terminated` while a command runs (unless it is ignored, or we are not the main thread), and
    an interrupt raised where Python can only report it (a __del__ or weakref callback run by the garbage
    collector) is delivered again instead of being printed and lost: Ctrl-C always stops the command."""
    old_term = None
    with contextlib.suppress(ValueError):  # not the main thread: signals are the caller's
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            old_term = signal.signal(signal.SIGTERM, _raise_terminated)
    old_hook = sys.unraisablehook

    def redeliver(unraisable):
        signum = {KeyboardInterrupt: signal.SIGINT, Terminated: signal.SIGTERM}.get(type(unraisable.exc_value))
        if signum is None:
            old_hook(unraisable)
            return
        # From another thread: sent from here, the handler would raise at once, inside this hook, and be lost
        # again. The main thread gets it at its next step, back in ordinary code. (_thread: threading's start
        # waits for the thread in Python code, where the signal would land.)
        _thread.start_new_thread(os.kill, (os.getpid(), signum))

    sys.unraisablehook = redeliver
    try:
        yield
    finally:
        sys.unraisablehook = old_hook
        if old_term is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, old_term)


def _stopped(signum: int):
    """Exit as the shell reports a process stopped by `signum` (130 for Ctrl-C, 143 for SIGTERM), with one line."""
    newline = "\n" if sys.stderr.isatty() else ""  # the text streamed to a terminal may end mid-line
    with contextlib.suppress(OSError):
        click.echo(newline + ("interrupted" if signum == signal.SIGINT else "terminated"), err=True)
    sys.exit(128 + signum)


def _writing_stdout(e: OSError) -> bool:
    """Whether `e` was raised by a click.echo to standard output (every line the CLI prints goes through it)."""
    tb, found = e.__traceback__, False
    while tb is not None:
        if tb.tb_frame.f_code is click.utils.echo.__code__:
            found = not tb.tb_frame.f_locals.get("err")
        tb = tb.tb_next
    return found


def _usage_error(e: click.UsageError):
    """A mistyped option or value as one line, exit code 2 (click would add the usage line and a blank one)."""
    if isinstance(e, getattr(click.exceptions, "NoArgsIsHelpError", ())):  # `switchhead` alone: the help
        raise e
    where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
    click.echo(f"Error: {e.format_message()}{where}", err=True)
    sys.exit(2)


class Group(click.Group):
    """Turns user errors (including mistyped options and values) into one line on stderr and exit code 2 (no
    traceback). So is running out of memory, which
    a command's own checks cannot always foresee (activations grow with the batch and the prompt lengths), and
    standard output that cannot be written (a full disk). Ctrl-C and SIGTERM stop with exit code 130 or 143 and
    one line, after the command's cleanup ran; a reader that goes away (`| head`) ends it quietly (click: exit 1)."""

    def main(self, *args, **kwargs):
        with _signals_as_exceptions():
            try:
                return super().main(*args, **kwargs)
            except Terminated:
                _stopped(signal.SIGTERM)
            except OSError as e:
                if e.errno == errno.EPIPE or not _writing_stdout(e):  # a closed pipe: click's quiet exit
                    raise
                with contextlib.suppress(OSError, ValueError):  # nothing more reaches it, even at exit's flush
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, sys.stdout.fileno())
                click.echo(f"Error: cannot write to standard output: {e.strerror or e}", err=True)
                sys.exit(2)

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as e:
            _usage_error(e)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # before click's own handling, which says "Aborted!" with exit code 1
            _stopped(signal.SIGINT)
        except click.UsageError as e:
            _usage_error(e)
        except SwitchheadError as e:
            click.echo(f"Error: {e}", err=True)
            sys.exit(2)
        except (RuntimeError, MemoryError) as e:
            from switchhead.devices import out_of_memory

            if not out_of_memory(e):
                raise
            lines = str(e).strip().splitlines()
            command = self.get_command(ctx, ctx.invoked_subcommand or "")
            batch = command is not None and any(p.name == "batch_size" for p in command.params)
            click.echo(f"Error: out of memory ({lines[0] if lines else type(e).__name__})"
                       + ("; use a smaller --batch-size" if batch else ""), err=True)
            sys.exit(2)


class _Path(click.ParamType):
    """A file or directory option. An empty value is refused: it would otherwise be read as the current directory
    (and, for a model, must not silently mean the built-in one)."""

    name = "path"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            flag = param.opts[0] if param is not None else "the path"
            raise SwitchheadError(f"{flag} needs a path, got an empty one")
        return value


PATH = _Path()


@click.group(cls=Group)
@click.version_option(package_name="switchhead")
def main():
    """switchhead: SwitchHead (mixture-of-experts attention) language models."""


def _fmt(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


@main.command()
@click.option("--config", "config_spec", help="Preset name or config JSON file.")
@click.option("--ckpt", type=PATH, help="Checkpoint directory.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def info(config_spec, ckpt, as_json):
    """Parameters, attention MACs/memory (paper formulas) and cache sizes of a model.

    With neither --config nor --ckpt, prints the table of all presets."""
    from switchhead.model.accounting import summary
    from switchhead.model.checkpoint import load_config
    from switchhead.model.config import PRESETS, resolve_config

    if config_spec is not None and ckpt is not None:
        raise SwitchheadError("give --config or --ckpt, not both")
    if config_spec == "" or ckpt == "":
        raise SwitchheadError("--config and --ckpt need a value (without either, info prints every preset)")
    if config_spec is None and ckpt is None:
        rows = [summary(c) for c in PRESETS.values()]
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        click.echo(f"{'preset':28s} {'attention':10s} {'params':>8s} {'MACs/layer':>10s} {'paper':>8s} "
                   f"{'floats/layer':>12s} {'paper':>8s} {'KV B/token':>10s}")
        for s in rows:
            click.echo(f"{s['name']:28s} {s['config']['attention']:10s} {_fmt(s['params']['total']):>8s} "
                       f"{_fmt(s['attention_macs_per_layer']):>10s} {_fmt(s['paper_attention_macs_per_layer']):>8s} "
                       f"{_fmt(s['attention_floats_per_layer']):>12s} "
                       f"{_fmt(s['paper_attention_floats_per_layer']):>8s} "
                       f"{_fmt(s['kv_cache_bytes_per_token_fp32']):>10s}")
        return
    cfg = resolve_config(config_spec) if config_spec else load_config(ckpt)
    s = summary(cfg)
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    c = s["config"]
    experts = ""
    if c["attention"] == "switchhead":
        experts = f", E={c['n_experts']} k={c['k']}, MoE {'/'.join(c['moe_projections']).upper() or 'none'}" + (
            ", shared selection" if c.get("shared_selection") else "")
    elif c["attention"] == "moa":
        experts = f", E={c['n_experts']} k={c['k']} query/output experts, shared K/V"
    click.echo(f"model: {s['name']}  ({c['attention']} attention, {c['n_heads']} heads x d_head {c['d_head']}"
               + experts
               + f"; {c['n_layers']} layers, d_model {c['d_model']}, {c['ff']} feed-forward, "
                 f"{c['positional']} positions, T={c['chunk_len']}, memory chunks {c['mem_chunks']})")
    click.echo("parameters:")
    for k, v in s["params"].items():
        click.echo(f"  {k:12s} {v:>13,d}  ({_fmt(v)})")
    click.echo("attention per layer and sequence (paper formulas):")
    click.echo(f"  MACs         {s['attention_macs_per_layer']:>13,d}  ({_fmt(s['attention_macs_per_layer'])}; "
               f"paper prints {_fmt(s['paper_attention_macs_per_layer'])})")
    click.echo(f"  memory       {s['attention_floats_per_layer']:>13,d}  floats "
               f"({_fmt(s['attention_floats_per_layer'])}; paper prints {_fmt(s['paper_attention_floats_per_layer'])})")
    click.echo("state per token, all layers (fp32):")
    click.echo(f"  KV cache     {s['kv_cache_bytes_per_token_fp32']:>13,d}  bytes")
    click.echo(f"  XL memory    {s['xl_memory_bytes_per_token_fp32']:>13,d}  bytes")


@main.command()
@click.option("--config", "config_spec", help="Preset name or model config JSON (required unless --resume).")
@click.option("--data", multiple=True, type=PATH,
              help="Training text file, or a directory: the .txt files under it, subdirectories included and "
                   "hidden ones skipped, in path order (repeatable; each file is one document, followed by the "
                   "tokenizer's EOS; a leading byte-order mark is dropped). Required unless --resume.")
@click.option("--out", required=True, type=PATH,
              help="Output directory (new, empty, or a run to --resume).")
@click.option("--tokenizer", type=PATH,
              help="SentencePiece model to use; default: train one on --data.")
@click.option("--vocab-size", type=int, default=8000, show_default=True, help="Size of the tokenizer trained "
              "on --data (an upper bound on small data). The model's vocab_size follows the tokenizer.")
@click.option("--unwrap/--no-unwrap", default=False, show_default=True,
              help="Join hard-wrapped lines into one line per paragraph (blank lines kept) before tokenizing "
                   "training and held-out text; for books that break lines every ~70 characters.")
@click.option("--steps", type=int, default=100_000, show_default=True, help="Total optimizer steps.")
@click.option("--batch-size", type=int, default=64, show_default=True,
              help="Global batch: number of contiguous token lanes (split across processes).")
@click.option("--grad-accum", type=int, default=1, show_default=True,
              help="Run each process's lanes in this many pieces per step, one after another, summing their "
                   "gradients: the same step with less activation memory (must divide the lanes per process).")
@click.option("--lr", type=float, default=2.5e-4, show_default=True, help="Peak learning rate (AdamW, wd 0).")
@click.option("--warmup", type=int, default=0, show_default=True,
              help="Linear warm-up steps before the cosine decay.")
@click.option("--grad-clip", type=float, help="Gradient-norm clip (0: off); default: the config's grad_clip.")
@click.option("--eval-data", multiple=True, type=PATH, help="Held-out text file(s) for validation "
              "perplexity (repeatable).")
@click.option("--eval-every", type=int, default=1000, show_default=True, help="Validate every N steps.")
@click.option("--eval-batch-size", type=int, help="Lanes the held-out text is cut into (more lanes: faster, "
              "slightly less context at lane starts); default: --batch-size.")
@click.option("--save-every", type=int, default=1000, show_default=True, help="Checkpoint every N steps.")
@click.option("--log-every", type=int, default=10, show_default=True, help="Write metrics every N steps.")
@click.option("--resume", is_flag=True,
              help="Continue the run in --out from its last checkpoint. Options not given are those the run "
                   "last ran with; those that define it (model config, --grad-clip, data, tokenizer, batch size, lr, "
                   "warm-up, seed) cannot change, the others (--steps, --save-every, --eval-data, --dtype, ...) "
                   "can.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", help="cpu, cuda, cuda:1, ...; default: cuda if available. Under torchrun each "
              "process uses its LOCAL_RANK GPU.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              help="Autocast dtype; default: bfloat16 on GPUs that support it (float16 with a grad scaler on "
                   "older ones), float32 on the CPU.")
@click.option("--cache-dir", type=PATH, help="Token cache (default $SWITCHHEAD_CACHE, else "
              "$XDG_CACHE_HOME/switchhead/tokens, ~/.cache/switchhead/tokens without it).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.pass_context
def train(ctx, **params):
    """Train a language model on text files.

    \b
    Writes into --out:
      final/          the finished model checkpoint (load with switchhead.load or --ckpt OUT/final)
      checkpoint/     the latest training state (also a loadable checkpoint); --resume continues from it
      metrics.jsonl   loss, gradient norm, lr, tokens/s per log step; val_loss/val_ppl per evaluation
      run.json, tokenizer.model
    SIGINT/SIGTERM save a checkpoint and stop. Several processes/GPUs:
    torchrun --nproc_per_node N -m switchhead.train ARGS
    """
    from click.core import ParameterSource

    from switchhead.train.loop import TrainOptions
    from switchhead.train.loop import train as run_training
    from switchhead.train.rundir import resume_defaults

    opts = {k: v for k, v in params.items() if ctx.get_parameter_source(k) != ParameterSource.DEFAULT}
    if "vocab_size" in opts and opts.get("tokenizer"):  # it would be silently ignored
        raise SwitchheadError("--vocab-size is the size of a tokenizer trained on --data; with --tokenizer the "
                              "given tokenizer's size is used: leave one of them out")
    opts["config"] = opts.pop("config_spec", None)
    opts["data"] = list(params["data"])
    opts["eval_data"] = list(params["eval_data"])
    opts["progress"] = not opts.pop("no_progress", False)
    if params["resume"]:
        # Options left out are those of the run being resumed, not the command-line defaults.
        opts = {**resume_defaults(params["out"]), **{k: v for k, v in opts.items() if v not in (None, [])}}
    for k, v in params.items():
        if k not in ("config_spec", "no_progress"):
            opts.setdefault(k, v)
    if not opts.get("config"):
        raise SwitchheadError("--config is required (a preset name or a config JSON file)")
    if not opts["data"]:
        raise SwitchheadError("--data is required (one or more text files)")
    result = run_training(TrainOptions(**opts))
    if result.interrupted:
        if result.main_process:  # under torchrun every process returns here: one reports
            click.echo(f"interrupted after step {result.step}; checkpoint saved in {result.out}/checkpoint "
                       "(continue with --resume)", err=True)
        sys.exit(128 + (result.signal or 2))  # the shell's status for a process stopped by that signal
    if result.final is not None and result.main_process:
        summary = f"done: {result.step} steps"
        if result.last_loss is not None:
            summary += f", train loss {result.last_loss:.4f}"
        if result.val_ppl is not None:
            summary += f", val ppl {result.val_ppl:.2f}"
        click.echo(f"{summary}; model in {result.final}")


@main.command()
@click.argument("prompt", required=False)
@click.option("--ckpt", type=PATH,
              help="Checkpoint directory (with tokenizer.model; default: the built-in model).")
@click.option("--onnx", "onnx_dir", type=PATH,
              help="Directory written by `switchhead export --onnx` (runs on ONNX Runtime instead of PyTorch).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens (0 = off).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass, in (0, 1].")
@click.option("--min-p", type=float, default=0.0, show_default=True,
              help="Drop tokens below min-p times the top probability, in [0, 1].")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
              help="Divide the logits of tokens in the prompt or the text so far (> 0; 1 = off).")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True,
              help="Subtract from the logit of every token generated so far, in [-2, 2] (OpenAI's).")
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
              help="Subtract this times its count so far from each generated token's logit, in [-2, 2].")
@click.option("--seed", type=int, help="Same seed, same text (default: random); 0 to 2**64-1. The i-th prompt of a "
              "prompts file (counting from 0, blank lines skipped) uses seed + i.")
@click.option("--stop", multiple=True,
              help="Stop before this string (repeatable; taken literally: in bash, $'\\n' is a newline).")
@click.option("--prompts-file", type=PATH, help="Text lines or JSONL with a \"prompt\" field; "
              "writes JSONL.")
@click.option("--batch-size", type=int, default=8, show_default=True, help="Prompts decoded together.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: text, token count, speeds.")
@click.option("--device", default="cpu", show_default=True,
              help="cpu, cuda, cuda:1, ... for a PyTorch model (--ckpt or the built-in one); an --onnx export "
                   "runs on ONNX Runtime's CUDA provider when usable, else on the CPU.")
@click.option("--threads", type=int, help="CPU threads for torch, or ONNX Runtime with --onnx (default: their "
              "choice; 1 is often faster for small models or on a busy machine).")
def generate(prompt, ckpt, onnx_dir, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
             presence_penalty, frequency_penalty, seed, stop, prompts_file, batch_size, as_json, device, threads):
    """Continue PROMPT (or stdin) with a trained model, streaming the text."""
    from switchhead.devices import set_threads
    from switchhead.runtime.commands import run_generate
    from switchhead.runtime.sampling import SamplingParams

    set_threads(threads)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty, seed=seed, stop=stop)

    def write(text: str) -> None:
        click.echo(text, nl=False)
        sys.stdout.flush()

    run_generate(prompt, ckpt, params, prompts_file, as_json, device, batch_size, write, onnx_dir=onnx_dir,
                 threads=threads)


@main.command("eval")
@click.option("--tasks", help="Comma-separated: lambada, blimp, cbt.")
@click.option("--text", "texts", multiple=True, type=PATH,
              help="Also score this text file (repeatable): perplexity per token and bits per byte, with the XL "
                   "state carried through --batch-size lanes, as training's validation.")
@click.option("--unwrap/--no-unwrap", default=False, show_default=True,
              help="Join hard-wrapped lines of --text files into paragraphs first, as train --unwrap does.")
@click.option("--ckpt", type=PATH, help="Checkpoint directory (default: the built-in model).")
@click.option("--onnx", type=PATH, help="ONNX export directory (instead of --ckpt).")
@click.option("--data-dir", type=PATH, help="Local data (lambada/, blimp/, cbt/ in their original formats; "
              "see docs/EVAL.md). Default: the Hugging Face hub, when reachable.")
@click.option("--limit", type=int, help="Evaluate only the first N examples of each task (or paradigm).")
@click.option("--batch-size", type=int, default=64, show_default=True,
              help="Sequences per forward pass (for --text: the lanes each file is cut into).")
@click.option("--output", type=PATH,
              help="Write lm-eval's results JSON here (replacing an existing file only if it is earlier results).")
@click.option("--device", help="cpu, cuda, ...; default cpu. For a PyTorch model (--ckpt or the built-in one); an "
              "--onnx export runs on ONNX Runtime's CUDA provider when usable, else on the CPU.")
@click.option("--threads", type=int, default=1, show_default=True, help="CPU threads for the forward passes: "
              "evaluation is many small forwards, where more threads mostly add synchronisation (and thrash "
              "on shared cores).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def eval_(tasks, texts, unwrap, ckpt, onnx, data_dir, limit, batch_size, output, device, threads, no_progress):
    """Zero-shot evaluation through lm-eval: LAMBADA (acc, perplexity), BLiMP (mean acc over the 67
    paradigms, and each paradigm), CBT (per-token-normalised acc and lm-eval's acc, mean over CN/NE/P/V);
    and held-out perplexity of text files (--text)."""
    from switchhead.evals.run import evaluate, format_table, parse_tasks

    if tasks is None and not texts:
        raise SwitchheadError("give --tasks (lambada, blimp, cbt) and/or --text FILE")
    names = parse_tasks(tasks) if tasks is not None else None
    if ckpt is not None and onnx is not None:
        raise SwitchheadError("give --ckpt DIR or --onnx DIR, not both")
    # Neither: evaluate() uses the built-in model, and records it as such.
    results = evaluate(names, texts=list(texts), ckpt=ckpt, onnx=onnx, data_dir=data_dir, limit=limit,
                       batch_size=batch_size, output=output, progress=not no_progress, device=device, threads=threads,
                       unwrap=unwrap)
    click.echo(format_table(results))
    if output:
        click.echo(f"results written to {output}", err=True)


@main.command()
@click.option("--ckpt", type=PATH,
              help="Checkpoint directory (with tokenizer.model; default: the built-in model).")
@click.option("--text", help="Text to inspect.")
@click.option("--text-file", type=PATH, help="Read the text from this UTF-8 file.")
@click.option("--out", required=True, type=PATH, help="Directory for the PNGs and index.html.")
@click.option("--layers", help="Comma-separated layer indices (default: all).")
@click.option("--heads", help="Comma-separated head indices for the per-head figures (default: all).")
@click.option("--window", type=int, default=64, show_default=True,
              help="Query tokens per figure (and twice as many key columns), to keep labels readable.")
@click.option("--json", "as_json", is_flag=True, help="Also write the raw numbers to OUT/attention.json.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def inspect(ckpt, text, text_file, out, layers, heads, window, as_json, no_progress):
    """Attention maps and expert selections of a model on a text (the paper's analysis figures).

    Writes per layer the max-over-heads map, per head the map with its O (queries) and V (keys)
    selection-score strips, per layer an expert-usage histogram, and OUT/index.html showing them all."""
    from switchhead.analysis import run_inspect

    r = run_inspect(ckpt, text, text_file, out, layers, heads, as_json, window, progress=not no_progress)
    click.echo(f"{r.n_tokens} tokens in {r.n_chunks} chunk(s), layers {r.layers}, heads {r.heads}: "
               f"{len(r.figures)} figures (at most {r.window} query tokens each)")
    if r.json_path is not None:
        click.echo(f"raw numbers: {r.json_path}")
    click.echo(f"open {r.index}")


@main.command("export")
@click.option("--onnx", "to_onnx", is_flag=True, help="Export to ONNX (the only target so far).")
@click.option("--ckpt", type=PATH, help="Checkpoint directory (default: the built-in model).")
@click.option("--out", type=PATH, help="Output directory (default: CKPT-onnx next to the checkpoint; "
              "./switchhead-default-onnx for the built-in model).")
@click.option("--opset", type=int, default=18, show_default=True, help="ONNX opset (18 is supported).")
@click.option("--dtype", default="fp32", show_default=True, help="fp32 or fp16 weights and activations.")
@click.option("--quantize", help="int8: ONNX Runtime dynamic quantisation of the dense matmuls.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def export_(to_onnx, ckpt, out, opset, dtype, quantize, no_progress):
    """Write model.onnx, layout.json, config.json and tokenizer.model into a new directory (atomically).

    Run it with `switchhead generate --onnx DIR`; the format is described in docs/EXPORT.md."""
    from switchhead.export import export

    if not to_onnx:
        raise SwitchheadError("no export target given: pass --onnx (the only supported target)")
    from switchhead.export.exporter import DATA_FILE, MODEL_FILE

    r = export(ckpt, out, dtype=dtype, quantize=quantize, opset=opset, progress=not no_progress)
    files = f"{MODEL_FILE} + {DATA_FILE}" if (r.out / DATA_FILE).exists() else MODEL_FILE
    click.echo(f"wrote {r.out} ({files} {r.model_bytes / 1e6:.1f} MB, {dtype}"
               + (f", {quantize}" if quantize else "") + f", opset {opset})")


@main.command()
@click.option("--ckpt", type=PATH,
              help="Checkpoint directory (with tokenizer.model; default: the built-in model).")
@click.option("--onnx", "onnx_dir", type=PATH, help="ONNX export directory (instead of --ckpt).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--max-batch", type=int, default=8, show_default=True, help="Sequences decoded together.")
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="Sequences that may wait for a batch row; beyond that requests get 503.")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds a request may take, queueing included (0 = no limit); then 504.")
@click.option("--max-prompt-tokens", type=int, default=2048, show_default=True,
              help="Longer prompts are refused with 400.")
@click.option("--max-tokens", type=int, default=2048, show_default=True, help="Largest max_tokens accepted.")
@click.option("--model-name", help="Model id in the API (default: the checkpoint directory's name, the run's for "
              "a training run's final/ or checkpoint/, 'switchhead' for the built-in model).")
@click.option("--device", default="cpu", show_default=True,
              help="cpu, cuda, cuda:1, ... for a PyTorch model (--ckpt or the built-in one); an --onnx export "
                   "runs on ONNX Runtime's CUDA provider when usable, else on the CPU.")
@click.option("--threads", type=int, help="CPU threads for torch, or ONNX Runtime with --onnx (default: their "
              "choice).")
def serve(ckpt, onnx_dir, host, port, max_batch, max_queue, timeout, max_prompt_tokens, max_tokens, model_name,
          device, threads):
    """OpenAI-compatible HTTP server (/v1/completions, /v1/models, /health) with continuous batching.

    See docs/SERVE.md."""
    from switchhead.devices import set_threads
    from switchhead.serve.server import run_server

    set_threads(threads)
    run_server(ckpt, onnx_dir, host, port, max_batch, max_queue, timeout, max_prompt_tokens, max_tokens,
               model_name=model_name, device=device, threads=threads)
