"""Evaluation data: local files in their original formats, or the Hugging Face hub when it is reachable.

Layout of ``--data-dir DIR`` (the files as their authors released them):

    DIR/lambada/lambada_test.jsonl            OpenAI's LAMBADA test set (5153 lines, field "text")
    DIR/blimp/<paradigm>.jsonl                BLiMP, one file per paradigm (fields sentence_good, sentence_bad)
    DIR/cbt/cbtest_{CN,NE,P,V}_test_2500ex.txt  Children's Book Test (CBTest.tgz, data/)

The loaders below are called by lm-eval (``custom_dataset`` in the shipped task YAMLs) with the task's
metadata as keyword arguments; ``data_dir`` arrives there from ``TaskManager(metadata={"data_dir": ...})``.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from switchhead.errors import SwitchheadError
from switchhead.fileio import read_utf8
from switchhead.runtime.sampling import check_utf8

BLIMP_PARADIGMS = (
    "adjunct_island", "anaphor_gender_agreement", "anaphor_number_agreement", "animate_subject_passive",
    "animate_subject_trans", "causative", "complex_NP_island",
    "coordinate_structure_constraint_complex_left_branch", "coordinate_structure_constraint_object_extraction",
    "determiner_noun_agreement_1", "determiner_noun_agreement_2", "determiner_noun_agreement_irregular_1",
    "determiner_noun_agreement_irregular_2", "determiner_noun_agreement_with_adj_2",
    "determiner_noun_agreement_with_adj_irregular_1", "determiner_noun_agreement_with_adj_irregular_2",
    "determiner_noun_agreement_with_adjective_1", "distractor_agreement_relational_noun",
    "distractor_agreement_relative_clause", "drop_argument", "ellipsis_n_bar_1", "ellipsis_n_bar_2",
    "existential_there_object_raising", "existential_there_quantifiers_1", "existential_there_quantifiers_2",
    "existential_there_subject_raising", "expletive_it_object_raising", "inchoative", "intransitive",
    "irregular_past_participle_adjectives", "irregular_past_participle_verbs",
    "irregular_plural_subject_verb_agreement_1", "irregular_plural_subject_verb_agreement_2",
    "left_branch_island_echo_question", "left_branch_island_simple_question",
    "matrix_question_npi_licensor_present", "npi_present_1", "npi_present_2", "only_npi_licensor_present",
    "only_npi_scope", "passive_1", "passive_2", "principle_A_c_command", "principle_A_case_1",
    "principle_A_case_2", "principle_A_domain_1", "principle_A_domain_2", "principle_A_domain_3",
    "principle_A_reconstruction", "regular_plural_subject_verb_agreement_1",
    "regular_plural_subject_verb_agreement_2", "sentential_negation_npi_licensor_present",
    "sentential_negation_npi_scope", "sentential_subject_island", "superlative_quantifiers_1",
    "superlative_quantifiers_2", "tough_vs_raising_1", "tough_vs_raising_2", "transitive", "wh_island",
    "wh_questions_object_gap", "wh_questions_subject_gap", "wh_questions_subject_gap_long_distance",
    "wh_vs_that_no_gap", "wh_vs_that_no_gap_long_distance", "wh_vs_that_with_gap",
    "wh_vs_that_with_gap_long_distance",
)
CBT_SETS = ("CN", "NE", "P", "V")
CBT_CANDIDATES = 10
CBT_BLANK = "XXXXX"

LAMBADA_FILE = "lambada/lambada_test.jsonl"
HUB = {  # where lm-eval (or, for CBT, the datasets library) finds the same data on the hub
    "lambada": ("EleutherAI/lambada_openai", "default", "test"),
    "blimp": ("nyu-mll/blimp", None, "train"),
    "cbt": ("cam-cbt/cbt", None, "test"),
}
LAYOUT_HELP = ("pass --data-dir DIR holding lambada/lambada_test.jsonl, blimp/<paradigm>.jsonl and "
               "cbt/cbtest_{CN,NE,P,V}_test_2500ex.txt (see docs/EVAL.md)")


def blimp_file(paradigm: str) -> str:
    return f"blimp/{paradigm}.jsonl"


def cbt_file(subset: str) -> str:
    return f"cbt/cbtest_{subset}_test_2500ex.txt"


def required_files(task: str) -> list[str]:
    """Paths relative to the data directory that `task` (lambada, blimp or cbt) reads."""
    if task == "lambada":
        return [LAMBADA_FILE]
    if task == "blimp":
        return [blimp_file(p) for p in BLIMP_PARADIGMS]
    if task == "cbt":
        return [cbt_file(s) for s in CBT_SETS]
    raise SwitchheadError(f"unknown task {task!r}")


def check_data_dir(data_dir: str | Path, tasks: list[str]) -> Path:
    """Fail early, with the first missing file named, instead of deep inside lm-eval."""
    root = Path(data_dir)
    if root.exists() and not root.is_dir():
        raise SwitchheadError(f"--data-dir {root} is not a directory; {LAYOUT_HELP}")
    if not root.is_dir():
        raise SwitchheadError(f"data directory not found: {root}")
    for task in tasks:
        missing = [f for f in required_files(task) if not (root / f).is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise SwitchheadError(f"{task}: missing {root / missing[0]}{more}; expected layout: {LAYOUT_HELP}")
    return root


def check_data_files(data_dir: str | Path, tasks: list[str]) -> None:
    """Read every file that `tasks` will read, with the loaders' parsers, so that a malformed line is reported
    before the model is loaded rather than after; the loaders parse them again when lm-eval asks, which
    costs little next to the evaluation."""
    root = Path(data_dir)
    readers = {"lambada": read_lambada, "blimp": read_blimp, "cbt": parse_cbt}
    for task in tasks:
        for f in required_files(task):
            readers[task](root / f)


def use_local_data() -> None:
    """Keep `datasets` / `huggingface_hub` from touching the network (they read these at import time)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP connect to the hub, so that offline machines fail in seconds rather than after the
    hub client's retry loops (about 25 s per dataset)."""
    if _truthy("HF_HUB_OFFLINE") or _truthy("HF_DATASETS_OFFLINE"):
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        url = urlparse(endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError as e:  # a bad port or bracket: the hub client would fail on it too, less legibly
        raise SwitchheadError(f"HF_ENDPOINT={endpoint!r} is not a valid URL ({e})") from None
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


# --- parsers of the original files ------------------------------------------------------------------------

def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file (newline characters dropped; a leading byte-order mark ignored).

    A missing, unreadable or non-UTF-8 file is a `SwitchheadError` naming the file (and, for bad bytes, where
    they are), not a traceback from the decoder."""
    path = Path(path)
    if not path.is_file():
        raise SwitchheadError(f"data file not found: {path}")
    text = read_utf8(path)
    # the newlines open() would recognise (not str.splitlines's, which also splits at U+2028 and others)
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return lines[:-1] if lines and not lines[-1] else lines


def read_jsonl(path: str | Path, fields: tuple[str, ...],
               check: Callable[[dict], str | None] | None = None) -> list[dict]:
    """The JSON objects of a JSON Lines file, reduced to `fields` (all strings). `check(row)` returns what is
    wrong with a row (a phrase for the error message), or None."""
    path = Path(path)
    rows = []
    for n, line in enumerate(read_lines(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SwitchheadError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:  # an integer beyond Python's digit limit, absurd nesting
            raise SwitchheadError(f"{path}:{n}: not readable as JSON ({e})") from None
        if not isinstance(row, dict) or any(not isinstance(row.get(k), str) for k in fields):
            raise SwitchheadError(f"{path}:{n}: expected a JSON object with string field(s) {', '.join(fields)}")
        row = {k: row[k] for k in fields}
        for k in fields:  # JSON's \ud800 escapes decode to lone surrogates, which pyarrow cannot store
            check_utf8(row[k], f"{path}:{n}: field {k}")
        problem = check(row) if check is not None else None
        if problem:
            raise SwitchheadError(f"{path}:{n}: {problem}")
        rows.append(row)
    if not rows:
        raise SwitchheadError(f"{path}: no examples")
    return rows


def lambada_problem(row: dict) -> str | None:
    """lm-eval splits a LAMBADA passage at its last space into context and target word: both must be there
    (without a space the prompt function fails; with an empty last word the target is empty and always
    "predicted")."""
    context, space, word = row["text"].rpartition(" ")
    if not space or not context.strip() or not word.strip():
        return (f"a LAMBADA passage needs a context and a final word separated by a space, got "
                f"{_clip(row['text'])!r}")
    return None


def blimp_problem(row: dict) -> str | None:
    empty = [k for k in ("sentence_good", "sentence_bad") if not row[k].strip()]
    if empty:
        verb = "is" if len(empty) == 1 else "are"
        return f"a BLiMP pair needs two non-empty sentences, {' and '.join(empty)} {verb} empty"
    return None


def _clip(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[:n] + "..."


def read_lambada(path: str | Path) -> list[dict]:
    return read_jsonl(path, ("text",), lambada_problem)


def read_blimp(path: str | Path) -> list[dict]:
    return read_jsonl(path, ("sentence_good", "sentence_bad"), blimp_problem)


def parse_cbt(path: str | Path) -> list[dict]:
    """Examples of a CBT file: {"sentences": [20 context lines], "question", "answer", "options": [10]}.

    Each example is 20 numbered context lines and a 21st line ``question<TAB>answer<TAB><TAB>c1|...|c10``,
    examples separated by a blank line; the line numbers are dropped."""
    path = Path(path)
    file_lines = read_lines(path)
    examples: list[dict] = []
    block: list[tuple[int, str]] = []

    def finish() -> None:
        if not block:
            return
        first = block[0][0]
        if len(block) != 21:
            raise SwitchheadError(f"{path}:{first}: a CBT example has 21 numbered lines, this one has {len(block)}")
        lines = []
        for i, (n, line) in enumerate(block, 1):
            num, _, text = line.partition(" ")
            if num != str(i):
                raise SwitchheadError(f"{path}:{n}: expected line number {i}, got {num!r}")
            lines.append(text)
        parts = lines[-1].split("\t")
        if len(parts) != 4 or parts[2]:
            raise SwitchheadError(f"{path}:{block[-1][0]}: expected 'question<TAB>answer<TAB><TAB>candidates'")
        question, answer, _, cands = parts
        options = cands.split("|")
        if not answer.strip() or any(not c.strip() for c in options):
            raise SwitchheadError(f"{path}:{block[-1][0]}: empty answer or candidate (candidates are separated "
                                  f"by single '|')")
        where = f"{path}:{block[-1][0]}"
        if len(options) != CBT_CANDIDATES:
            raise SwitchheadError(f"{where}: expected {CBT_CANDIDATES} candidates, got {len(options)}")
        twice = next((c for i, c in enumerate(options) if c in options[:i]), None)
        if twice is not None:  # CBT's ten are distinct words: a repeat is a corrupt line, not a harder question
            raise SwitchheadError(f"{where}: candidate {_clip(twice)!r} appears twice")
        if answer not in options:
            raise SwitchheadError(f"{where}: the answer {_clip(answer)!r} is not among the candidates")
        if question.count(CBT_BLANK) != 1:  # the prompt splits the question at its (first) blank
            raise SwitchheadError(f"{where}: the question must hold the blank {CBT_BLANK} exactly once, it has "
                                  f"{question.count(CBT_BLANK)}")
        examples.append({"sentences": lines[:20], "question": question, "answer": answer, "options": options})
        block.clear()

    for n, line in enumerate(file_lines, 1):
        if line.strip():
            block.append((n, line))
        else:
            finish()
    finish()
    if not examples:
        raise SwitchheadError(f"{path}: no CBT examples")
    return examples


# --- loaders called by lm-eval ----------------------------------------------------------------------------

def _dataset(split: str, rows: list[dict]):
    import datasets

    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})


def _hub(task: str, name: str | None, what: str):
    path, default_name, split = HUB[task]
    if not hub_reachable():
        raise SwitchheadError(f"{what}: no data directory given and the Hugging Face hub is unreachable; "
                              f"{LAYOUT_HELP}")
    import datasets

    try:
        return datasets.load_dataset(path, name or default_name)
    except Exception as e:  # the hub client raises many unrelated types (HTTP, file, config errors)
        raise SwitchheadError(f"{what}: could not load {path} from the hub ({type(e).__name__}: {e}); "
                              f"{LAYOUT_HELP}") from None


def load_lambada(data_dir: str | None = None, **_):
    if not data_dir:
        return _hub("lambada", None, "lambada")
    return _dataset("test", read_lambada(Path(data_dir) / LAMBADA_FILE))


def load_blimp(paradigm: str, data_dir: str | None = None, **_):
    if not data_dir:
        return _hub("blimp", paradigm, f"blimp {paradigm}")
    return _dataset("train", read_blimp(Path(data_dir) / blimp_file(paradigm)))


def load_cbt(subset: str, data_dir: str | None = None, **_):
    if not data_dir:
        return _hub("cbt", subset, f"cbt {subset}")
    return _dataset("test", parse_cbt(Path(data_dir) / cbt_file(subset)))
