"""OpenAI's completions protocol: request validation into sampling parameters, and response shapes.

Validation is done by hand rather than by a pydantic model so that every rejection names the offending
parameter in OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``), which clients show
to users as is.
"""

from __future__ import annotations

import difflib
import time
import uuid
from dataclasses import dataclass, replace

from switchhead.errors import SwitchheadError, brief, is_finite_number, is_int
from switchhead.runtime.sampling import SamplingParams, check_logit_bias, seed_or_random, seed_plus

# The engine reports "eos" when the model ends the text; OpenAI calls every natural end "stop".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
MAX_LOGPROBS = 20
MAX_STOPS = 16
# Every field parse_completion reads, and OpenAI's `user` (an end-user id for OpenAI's abuse monitoring, which
# clients may send as a matter of course: accepted and ignored). Any other field is refused, so that a misspelt
# one ("temprature") is not silently replaced by its default.
FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty",
          "logit_bias", "top_k", "min_p", "repetition_penalty", "stop", "seed", "n", "stream", "stream_options",
          "logprobs", "echo", "suffix", "best_of", "user")


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def too_many(prompts: int, n: int, limit: int, why: str = "") -> APIError:
    """prompts x n over `limit`: blamed on n, or on the prompt list when each prompt has one completion."""
    why = f" ({why})" if why else ""
    return bad(f"{prompts} prompt{'s' if prompts > 1 else ''} x n={n} is {prompts * n} completions, more than "
               f"this server's limit of {limit} per request{why}", "n" if n > 1 else "prompt")


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 2048
    max_tokens: int = 2048  # per completion
    max_sequences: int = 64  # prompts x n in one request

    def __post_init__(self):
        for name in ("max_prompt_tokens", "max_tokens", "max_sequences"):
            if not is_int(v := getattr(self, name)) or v < 1:
                raise SwitchheadError(f"Limits.{name} must be an integer >= 1, got {v!r}")


@dataclass
class CompletionRequest:
    prompts: list[str]
    encoded: list[list[int]]
    params: SamplingParams  # seed always set: the base seed
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None

    def sequences(self) -> list[tuple[int, int, SamplingParams]]:
        """(choice index, prompt index, params with the sequence's seed), in OpenAI's choice order.

        Every prompt samples with the request's seed, as `Generator.generate` does for a batch; the j-th of n
        samples of a prompt uses seed + j (modulo 2**64, so any valid seed works with any n), so they differ."""
        out = []
        for i in range(len(self.prompts)):
            for j in range(self.n):
                p = self.params if j == 0 else _with_seed(self.params, seed_plus(self.params.seed, j))
                out.append((i * self.n + j, i, p))
        return out


def _with_seed(p: SamplingParams, seed: int) -> SamplingParams:
    return replace(p, seed=seed)


_KINDS = {"int": (is_int, "an integer"), "num": (is_finite_number, "a finite number"),
          "bool": (lambda v: isinstance(v, bool), "a boolean"), "str": (lambda v: isinstance(v, str), "a string"),
          "object": (lambda v: isinstance(v, dict), "an object")}


def _show(value) -> str:
    # A body may hold a 4000-digit number, a megabyte string or an array nested too deep for repr: quote only
    # the start of scalars, and name containers.
    if isinstance(value, (list, dict)):
        return "an array" if isinstance(value, list) else "an object"
    return brief(value)


def _param(key: str) -> str:
    # A key is any JSON string: a megabyte long, or a lone surrogate that the UTF-8 reply could not carry.
    return key if len(key) <= 60 and key.isprintable() else _show(key)


def _refuse_unknown(body: dict) -> None:
    unknown = [key for key in body if key not in FIELDS]
    if not unknown:
        return
    named = ", ".join(_show(key) for key in unknown[:5])
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    close = difflib.get_close_matches(unknown[0][:60], FIELDS, 1) if len(unknown) == 1 else []
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise bad(f"unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: {named}{more}{hint}",
              _param(unknown[0]), "unsupported_parameter")


def _get(body: dict, name: str, kind: str, default, param: str | None = None):
    """body[name] if it is of `kind`, `default` if absent or null; `param` is the API's name for the field."""
    value = body.get(name)
    if value is None:
        return default
    ok, what = _KINDS[kind]
    if not ok(value):
        param = param or name
        raise bad(f"'{param}' must be {what}, got {_show(value)}", param, "invalid_type")
    return value


# SamplingParams reports errors by its own (dashed) field names; these are the API's names for them.
_API_NAMES = {"max-new-tokens": "max_tokens", "temperature": "temperature", "top-k": "top_k", "top-p": "top_p",
              "min-p": "min_p", "repetition-penalty": "repetition_penalty", "presence-penalty": "presence_penalty",
              "frequency-penalty": "frequency_penalty", "logit-bias": "logit_bias", "seed": "seed", "stop": "stop"}


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's logit_bias: an object from token ids (as JSON keys: decimal strings) to biases."""
    bias = _get(body, "logit_bias", "object", None)
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad(f"'logit_bias' keys must be token ids (decimal integers), got {_show(key)}", "logit_bias")
        if not is_finite_number(value):
            raise bad(f"'logit_bias' values must be numbers, got {_show(value)} for token {key}", "logit_bias",
                      "invalid_type")
        out[int(key)] = value
    return out


def parse_completion(body, model_name: str, limits: Limits, encode, vocab_size: int) -> CompletionRequest:
    """Validate a /v1/completions body; `encode(text) -> ids` is the generator's encoder, `vocab_size` its
    model's (for logit_bias)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    _refuse_unknown(body)
    _get(body, "user", "str", None)  # OpenAI's end-user id: nothing to do with it here
    model = _get(body, "model", "str", None)  # typed first: `model: 5` is a malformed request, not a 404
    if model is not None and model != model_name:
        raise APIError(404, f"the model {_show(model)} does not exist; this server serves '{model_name}'",
                       "invalid_request_error", "model", "model_not_found")
    for name, kind, neutral in (("echo", "bool", False), ("suffix", "str", None), ("best_of", "int", 1)):
        # Typed first: `echo: 0` or `best_of: true` equal the neutral value in Python but are not valid.
        value = _get(body, name, kind, None)
        if value is not None and value != neutral:
            raise bad(f"'{name}' is not supported by this server", name, "unsupported_parameter")

    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif prompt is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    else:
        raise bad("'prompt' must be a string or a non-empty list of strings (token-id prompts are not "
                  "supported)", "prompt", "invalid_type")
    encoded = []
    for i, text in enumerate(prompts):
        if len(text) > 16 * limits.max_prompt_tokens:  # no token is 16 characters: refuse before encoding
            raise bad(f"prompt {i} is too long: at most {limits.max_prompt_tokens} tokens", "prompt",
                      "context_length_exceeded")
        try:
            ids = encode(text)
        except SwitchheadError as e:
            raise bad(f"prompt {i}: {e}", "prompt") from None
        if len(ids) > limits.max_prompt_tokens:
            raise bad(f"prompt {i} has {len(ids)} tokens, more than the limit of {limits.max_prompt_tokens}",
                      "prompt", "context_length_exceeded")
        encoded.append(ids)

    n = _get(body, "n", "int", 1)
    if n < 1:
        raise bad(f"'n' must be >= 1, got {n}", "n")
    if n * len(prompts) > limits.max_sequences:
        raise too_many(len(prompts), n, limits.max_sequences)
    max_tokens = _get(body, "max_tokens", "int", 16)
    if max_tokens > limits.max_tokens:
        raise bad(f"'max_tokens' is {max_tokens}, more than this server's limit of {limits.max_tokens}",
                  "max_tokens")
    top_k = _get(body, "top_k", "int", 0)
    top_k = 0 if top_k == -1 else top_k  # -1 means "off" in vLLM's dialect of this API
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise bad(f"at most {MAX_STOPS} stop strings", "stop")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise bad(f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {_show(logprobs)}", "logprobs")
    stream = _get(body, "stream", "bool", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
    include_usage = _get(options or {}, "include_usage", "bool", False, "stream_options.include_usage")
    seed = seed_or_random(_get(body, "seed", "int", None))
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens, temperature=_get(body, "temperature", "num", 1.0), top_k=top_k,
            top_p=_get(body, "top_p", "num", 1.0), min_p=_get(body, "min_p", "num", 0.0),
            repetition_penalty=_get(body, "repetition_penalty", "num", 1.0),
            presence_penalty=_get(body, "presence_penalty", "num", 0.0),
            frequency_penalty=_get(body, "frequency_penalty", "num", 0.0),
            logit_bias=_logit_bias(body), seed=seed, stop=stops)
        check_logit_bias(params, vocab_size)  # here, so that the request is refused before it is queued
    except SwitchheadError as e:
        msg = str(e)
        param = next((api for name, api in _API_NAMES.items() if msg.startswith(name)), None)
        for name, api in _API_NAMES.items():
            msg = msg.replace(name, api)
        raise bad(msg, param) from None
    return CompletionRequest(prompts, encoded, params, n, stream, include_usage, logprobs)


def completion_id() -> str:
    return "cmpl-" + uuid.uuid4().hex


def envelope(cid: str, created: int, model: str, choices: list[dict], usage: dict | None = None) -> dict:
    out = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "switchhead"}


def now() -> int:
    return int(time.time())
