"""`switchhead eval`: run the shipped tasks through lm-eval, score held-out text, and summarise the results."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

from tqdm import tqdm

from switchhead.errors import SwitchheadError, is_int
from switchhead.evals import data
from switchhead.fileio import as_path, check_creatable, require_dir, text_paths, write_atomic

TASKS_DIR = Path(__file__).parent / "tasks"
# Short names used by the CLI -> the lm-eval task or group names shipped in TASKS_DIR. Prefixed so that they
# never collide with lm-eval's own tasks when both are indexed (TaskManager with include_defaults=True).
TASKS = {"lambada": "switchhead_lambada", "blimp": "switchhead_blimp", "cbt": "switchhead_cbt"}
# Keys every results dict of lm_eval.simple_evaluate has (0.4.x), so in every file we or lm-eval's CLI wrote.
RESULTS_KEYS = ("results", "configs", "versions", "config")
_RESULTS_MAX_BYTES = 64 << 20  # without samples (never logged here) a results file is far smaller


def parse_tasks(spec: str | list[str]) -> list[str]:
    if not isinstance(spec, str) and not (isinstance(spec, (list, tuple)) and all(isinstance(t, str) for t in spec)):
        raise SwitchheadError(f"tasks must be a string such as 'lambada,blimp' or a list of names, got {spec!r}")
    names = [t.strip() for t in (spec.split(",") if isinstance(spec, str) else spec) if t.strip()]
    if not names:
        raise SwitchheadError(f"no task given; choose from {', '.join(TASKS)}")
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise SwitchheadError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


def task_manager(data_dir: str | Path | None = None):
    """An lm-eval TaskManager over the shipped tasks only (indexing lm-eval's thousands of YAML files costs
    seconds and is not needed), with the data directory passed to the dataset loaders."""
    from lm_eval.tasks import TaskManager

    meta = {"data_dir": str(Path(data_dir).resolve())} if data_dir else {}
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=meta)


def evaluate(tasks: str | list[str] | None, *, texts: str | Path | list[str | Path] | None = None,
             ckpt: str | None = None, onnx: str | None = None, model=None, tokenizer=None,
             data_dir: str | Path | None = None, limit: int | None = None, batch_size: int = 64,
             output: str | Path | None = None, progress: bool = True, bootstrap_iters: int = 0,
             device: str | None = None, threads: int | None = None, unwrap: bool = False) -> dict:
    """Evaluate a checkpoint, an ONNX export or a model object (none of them: the built-in model) on the named
    tasks (lambada, blimp, cbt) and the perplexity of each of `texts` (`text.py`; lanes = `batch_size`); returns
    lm-eval's results dict, with the text rows under "text" (also written to `output` as JSON when given; `unwrap`
    reads the texts as `train --unwrap` does). Inputs are validated before anything slow happens. `threads` sets
    torch's intra-op CPU threads for the process, and ONNX Runtime's for an export (None: leave as is)."""
    texts = [] if texts is None else text_paths(texts)
    names = parse_tasks(tasks) if tasks or not texts else []
    if limit is not None and (not is_int(limit) or limit < 1):
        raise SwitchheadError(f"--limit must be a positive number of examples per task, got {limit}")
    # Options that would silently do nothing are refused, so that a typo in a command line is seen.
    if limit is not None and not names:
        raise SwitchheadError("--limit applies to --tasks, and no task was given")
    if unwrap and not texts:
        raise SwitchheadError("--unwrap applies to --text files, and none was given")
    # as the CLI refuses it: check_data_dir would read "" as the current directory, the loaders as no directory
    if isinstance(data_dir, str) and not data_dir.strip():
        raise SwitchheadError("--data-dir needs a path, got an empty one")
    for what, path in (("data_dir", data_dir), ("ckpt", ckpt), ("onnx", onnx), ("output", output)):
        if path is not None:
            as_path(path, what)  # a number here would be a TypeError deep in pathlib
    if data_dir is not None and not names:
        raise SwitchheadError("--data-dir applies to --tasks, and no task was given")
    if not is_int(batch_size) or batch_size < 1:
        raise SwitchheadError(f"the batch size (--batch-size) must be a positive integer, got {batch_size!r}")
    if texts:
        from switchhead.train.data import check_data_files

        texts = check_data_files(texts, "text")
    if names and data_dir is not None:
        data.check_data_dir(data_dir, names)
        data.use_local_data()  # before lm_eval imports `datasets`
    elif names and not data.hub_reachable():
        raise SwitchheadError(f"no --data-dir given and the Hugging Face hub is unreachable; {data.LAYOUT_HELP}")
    builtin = ckpt is None and onnx is None and model is None
    if builtin:
        from switchhead.model.checkpoint import resolve_checkpoint

        ckpt = str(resolve_checkpoint(None))
    if ckpt is not None:
        require_dir(ckpt, "checkpoint directory")
    if device is not None:
        from switchhead.devices import resolve_device

        # SwitchheadLM falls back to the CPU, as lm-eval's CLI asks for cuda by default; a user who asked for
        # cuda here must learn it is missing rather than wait for a CPU run.
        resolve_device(device)
    if output is not None:
        check_output(output)
    if data_dir is not None and names:
        data.check_data_files(data_dir, names)

    from switchhead.devices import set_threads

    set_threads(threads)
    from switchhead.evals.lm import SwitchheadLM

    lm = SwitchheadLM(ckpt=ckpt, onnx=onnx, model=model, tokenizer=tokenizer, batch_size=batch_size,
                      device=device, progress=progress, threads=threads)
    if names:
        import lm_eval

        # lm-eval logs a warning per task for custom datasets and per-request details at INFO.
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
        with _quiet_lm_eval():
            results = lm_eval.simple_evaluate(
                model=lm, tasks=[TASKS[n] for n in names], task_manager=task_manager(data_dir),
                # lm-eval slices with islice, which refuses a stop beyond sys.maxsize (more than any data has)
                limit=None if limit is None else min(limit, sys.maxsize),
                bootstrap_iters=bootstrap_iters, log_samples=False)
        if results is None:  # non-zero ranks under torch.distributed
            return {}
    else:  # the same keys, so that the file reads as results (and a later run may replace it)
        results = {"results": {}, "configs": {}, "versions": {}, "config": {}}
    if texts:
        from switchhead.evals.text import text_perplexity

        results["text"] = text_perplexity(lm.backend, lm.tokenizer, texts, batch_size, progress, unwrap=unwrap)
    # What was evaluated and how: lm-eval records nothing of a model passed as an object.
    results["config"].update(model="switchhead", model_args=_model_args(None if builtin else ckpt, onnx, model),
                             batch_size=batch_size, limit=limit)
    results["switchhead"] = {"ckpt": None if ckpt is None else str(ckpt), "onnx": None if onnx is None else str(onnx),
                             "builtin_model": builtin,
                             "batch_size": batch_size, "limit": limit, "unwrap": unwrap,
                             # Where it ran, not what was asked for (no --device means the CPU).
                             "device": str(lm.backend.device),
                             "providers": getattr(lm.backend, "providers", None)}
    if output is not None:
        write_atomic(output, json.dumps(results, indent=2, default=_jsonable))
    return results


def _model_args(ckpt, onnx, model) -> str:
    if onnx is not None:
        return f"onnx={onnx}"
    if ckpt is not None:
        return f"ckpt={ckpt}"
    return "model=<object>" if model is not None else "ckpt=<built-in model>"


def check_output(output: str | Path) -> None:
    """A one-line error where `output` cannot take the results: a directory, a path that cannot be created, or
    an existing file other than an earlier results JSON (a user's file is never overwritten)."""
    path = Path(output)
    if path.is_dir():
        raise SwitchheadError(f"--output must be a file path, {output} is a directory")
    # Path() drops a trailing separator: "results/", meant as a directory, would become a file "results"
    if str(output).endswith(("/", os.sep)):
        raise SwitchheadError(f"--output must be a file path, {output} ends with a separator")
    check_creatable(output, "--output")
    # only regular files: /dev/stdout or a FIFO is written to, not replaced (and reading a FIFO would block)
    if path.is_file() and not is_results_file(path):
        raise SwitchheadError(f"--output {output} exists and is not an earlier results JSON; not overwriting it "
                              f"(remove it or choose another path)")


def is_results_file(path: str | Path) -> bool:
    """Whether `path` holds a results JSON as `evaluate` (or lm-eval's CLI) writes it."""
    try:
        if Path(path).stat().st_size > _RESULTS_MAX_BYTES:
            return False
        obj = json.loads(Path(path).read_bytes())
    except (OSError, ValueError, RecursionError):  # unreadable, not text, not JSON, absurdly nested
        return False
    return isinstance(obj, dict) and all(k in obj for k in RESULTS_KEYS) and isinstance(obj["results"], dict)


def _quiet_lm_eval() -> contextlib.ExitStack:
    """Two things lm-eval would print on the terminal that say nothing about our evaluation:

    - it records the git commit of the current directory by running `git describe` with the terminal as its
      stderr, so outside a repository every evaluation printed git's "fatal: not a git repository". Same
      command and result here, stderr dropped (None where there is no repository or no git);
    - building each task's requests shows an unlabelled progress bar per task, even with --no-progress (72
      for lambada + blimp + cbt, each over in milliseconds); the model's own bar reports the real work."""
    import lm_eval.api.task
    import lm_eval.evaluator

    def git_hash() -> str | None:
        try:
            done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
        except (OSError, subprocess.CalledProcessError):
            return None
        return done.stdout.strip()

    stack = contextlib.ExitStack()
    for module, name, quiet in ((lm_eval.evaluator, "get_git_commit_hash", git_hash),
                                (lm_eval.api.task, "tqdm", functools.partial(tqdm, disable=True))):
        if hasattr(module, name):  # a later lm-eval may have dropped or renamed it: then nothing to quieten
            stack.enter_context(mock.patch.object(module, name, quiet))
    return stack


def _jsonable(o):
    try:
        return o.item()
    except AttributeError:
        return str(o)


def summary_rows(results: dict) -> list[tuple[str, str, float, float | None]]:
    """(task, metric, value, stderr) rows: each task or group in lm-eval's order, a group followed by its
    members."""
    res = results.get("results", {})
    members = results.get("group_subtasks", {})
    nested = {t for subs in members.values() for t in subs}
    order: list[str] = []
    for name in list(res) + list(members):
        if name not in nested and name not in order:
            order += [name] + [t for t in members.get(name, []) if t not in order]
    rows = []
    for task in order:
        for key, value in res.get(task, {}).items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            err = res[task].get(f"{metric}_stderr,{filt}")
            rows.append((task, metric, float(value), err if isinstance(err, (int, float)) else None))
    texts = results.get("text", [])
    names = [Path(text["file"]).name for text in texts]
    for text, short in zip(texts, names):
        name = f"text {short if names.count(short) == 1 else text['file']}"  # the whole path where names clash
        rows += [(name, metric, float(text[metric]), None) for metric in TEXT_METRICS]
    return rows


TEXT_METRICS = ("tokens", "lanes", "loss", "perplexity", "bits_per_byte")


def format_table(results: dict) -> str:
    rows = summary_rows(results)
    width = max([len("task")] + [len(r[0]) for r in rows])
    lines = [f"{'task':{width}s}  {'metric':14s} {'value':>10s} {'stderr':>8s}"]
    for task, metric, value, err in rows:
        e = "-" if err is None or (isinstance(err, float) and math.isnan(err)) else f"{err:.4f}"
        v = f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4e}"
        if metric in ("tokens", "lanes"):  # counts of the text rows
            v = f"{int(value)}"
        lines.append(f"{task:{width}s}  {metric:14s} {v:>10s} {e:>8s}")
    return "\n".join(lines)
