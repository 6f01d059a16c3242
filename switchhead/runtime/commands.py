"""What `switchhead generate` does, kept out of cli.py so the command itself stays a thin argument parser."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from switchhead.devices import resolve_device, set_threads
from switchhead.errors import SwitchheadError, brief, check_flag, is_int
from switchhead.fileio import as_path, read_utf8
from switchhead.runtime.backends import TorchBackend
from switchhead.runtime.engine import Generator
from switchhead.runtime.sampling import SamplingParams, seed_or_random, seed_plus


def load_generator(ckpt: str | None, device: str | None = None, onnx_dir: str | None = None,
                   threads: int | None = None) -> Generator:
    """A generator over a checkpoint (default: the built-in model) or an ONNX export; `threads`: ONNX Runtime's
    intra-op threads for an export, torch's (which are the process's: devices.set_threads) for a checkpoint; None
    leaves either's default."""
    from switchhead.model.checkpoint import load

    if ckpt is not None and onnx_dir is not None:
        raise SwitchheadError("give --ckpt or --onnx, not both")
    # Checked also for an export, which picks its own provider: a mistyped device must not pass unnoticed.
    device = resolve_device(device)
    if onnx_dir is not None:
        if not str(onnx_dir):  # not the built-in model: that one is PyTorch, and the user asked for ONNX
            raise SwitchheadError("--onnx needs a directory (an export of `switchhead export --onnx`)")
        from switchhead.export import load_backend

        backend = load_backend(onnx_dir, threads=threads)
        if backend.tokenizer is None:
            raise SwitchheadError(f"{onnx_dir} has no tokenizer.model; generation needs one to read text")
        return Generator(backend, backend.tokenizer)
    set_threads(threads)
    model, tokenizer = load(ckpt, device=device)  # no ckpt: the built-in default model
    if tokenizer is None:
        raise SwitchheadError(f"checkpoint {ckpt} has no tokenizer.model; generation needs one to read text")
    return Generator(TorchBackend(model), tokenizer)


def read_prompts_file(path: str | Path) -> list[tuple[int, str]]:
    """(line number, prompt) for the prompts of a file: one per non-blank line, or JSONL objects with a "prompt"
    field (decided by whether the first non-blank line is a JSON object)."""
    path = as_path(path, "--prompts-file")
    lines = [(n, ln) for n, ln in enumerate(read_utf8(path).splitlines(), 1) if ln.strip()]
    if not lines:
        raise SwitchheadError(f"prompts file {path} has no prompts")
    if not _is_json_object(lines[0][1]):
        return lines
    prompts = []
    for n, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SwitchheadError(f"{path}: line {n} is not valid JSON: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise SwitchheadError(f"{path}: line {n} needs a string \"prompt\" field")
        prompts.append((n, obj["prompt"]))
    return prompts


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def run_generate(prompt: str | None, ckpt: str | None, params: SamplingParams, prompts_file: str | None,
                 as_json: bool, device: str | None, batch_size: int, write: Callable[[str], None],
                 stdin=None, onnx_dir: str | None = None, threads: int | None = None) -> None:
    """Validate everything that can be checked cheaply before loading the model, then generate."""
    if not is_int(batch_size) or batch_size < 1:  # 1.5 failed only once the model was loaded
        raise SwitchheadError(f"batch-size must be an integer >= 1, got {brief(batch_size)}")
    if not isinstance(params, SamplingParams):
        raise SwitchheadError(f"params must be SamplingParams, got {type(params).__name__}")
    check_flag(as_json, "as_json")
    if prompt is not None and not isinstance(prompt, str):
        raise SwitchheadError(f"the prompt must be a str (several go in a prompts file), got {type(prompt).__name__}")
    if not callable(write):
        raise SwitchheadError(f"write must be a function taking text, got {type(write).__name__}")
    if prompt is not None and prompts_file:
        raise SwitchheadError("give a PROMPT or --prompts-file, not both")
    numbered = read_prompts_file(prompts_file) if prompts_file else None
    if numbered is None and prompt is None:
        stdin = stdin or sys.stdin
        if stdin is None:  # started with stdin closed (`<&-`)
            raise SwitchheadError("no PROMPT, no --prompts-file and no stdin to read a prompt from")
        try:
            text = stdin.read()
        except UnicodeDecodeError as e:  # a strict stdin; under surrogateescape, Generator.encode reports it
            raise SwitchheadError(f"the prompt on stdin is not valid UTF-8 ({e})") from None
        # The line end `echo` (or a Windows pipe: CRLF) adds is not part of the prompt, nor the byte order mark a
        # Windows editor starts a saved file with (as in prompts files and training text).
        text = text.removeprefix("\ufeff")
        prompt = text.removesuffix("\n").removesuffix("\r") if text.endswith("\n") else text
    gen = load_generator(ckpt, device, onnx_dir, threads)
    if numbered is not None:
        for n, p in numbered:  # fail before spending time on the earlier batches
            try:
                gen.encode(p)
            except SwitchheadError as e:
                raise SwitchheadError(f"{prompts_file}: line {n}: {e}") from None
        prompts = [p for _, p in numbered]
        # Seeds follow the prompt's place in the file, so the draws do not depend on --batch-size; seed + i wraps
        # modulo 2**64.
        base = seed_or_random(params.seed)
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            seeds = [seed_plus(base, start + i) for i in range(len(batch))]
            for r in gen.generate(batch, params, seeds=seeds):
                write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")
        return
    if as_json:
        (r,) = gen.generate([prompt], params)
        write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")
        return
    gen.generate([prompt], params, on_text=lambda _, piece: write(piece))
    write("\n")
