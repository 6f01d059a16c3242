"""Prompt and scoring functions referenced by the shipped task YAMLs (``!function``).

Plain Python instead of Jinja templates: lm-eval renders a template per document, which made LAMBADA+BLiMP
6-7x slower when measured on this machine class.
"""

from __future__ import annotations

from switchhead.evals.data import CBT_BLANK

# --- LAMBADA (lm-eval lambada_openai: the last space-separated word is the target) --------------------------

def lambada_context(doc: dict) -> str:
    return doc["text"].rsplit(" ", 1)[0]


def lambada_target(doc: dict) -> str:
    return " " + doc["text"].rsplit(" ", 1)[1]


# --- BLiMP (lm-eval semantics: empty context, both sentences scored in full) ------------------------------

def empty_context(doc: dict) -> str:
    return ""


def blimp_choices(doc: dict) -> list[str]:
    return [doc["sentence_good"], doc["sentence_bad"]]


# --- CBT ---------------------------------------------------------------------------------------------------

def _split_question(doc: dict) -> tuple[str, str]:
    before, _, after = doc["question"].partition(CBT_BLANK)
    return before.rstrip(" "), after


def cbt_context(doc: dict) -> str:
    """The 20 story lines and the question up to the blank (the authors' context)."""
    before, _ = _split_question(doc)
    return " ".join(doc["sentences"] + ([before] if before else []))


def cbt_choices(doc: dict) -> list[str]:
    """Each candidate followed by the rest of the question (lm-eval adds the separating space)."""
    _, after = _split_question(doc)
    return [c + after for c in doc["options"]]


def cbt_target(doc: dict) -> int:
    return doc["options"].index(doc["answer"])


def cbt_process_results(doc: dict, results: list) -> dict:
    """lm-eval's acc (argmax of the summed log-probability) and the authors' headline metric: the argmax of
    the mean log-probability per token of each continuation.

    The token counts need the model's tokenizer, which lm-eval does not pass to tasks: they come from the
    `SwitchheadLM` that scored the requests (the most recently used one)."""
    from switchhead.evals.lm import active_model

    lls = [r[0] for r in results]
    gold = cbt_target(doc)
    context = cbt_context(doc)
    counter = active_model()
    per_token = [ll / max(1, counter.continuation_length(context, " " + c))
                 for ll, c in zip(lls, cbt_choices(doc))]
    return {"acc_per_token": float(_argmax(per_token) == gold), "acc": float(_argmax(lls) == gold)}


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)
