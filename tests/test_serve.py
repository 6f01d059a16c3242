"""`switchhead serve`: a real uvicorn server on 127.0.0.1 (a free port), driven by the official openai client and
by raw HTTP; served text is compared with `Generator.generate` run on a separately loaded copy of the model."""

import json
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch
import uvicorn
from click.testing import CliRunner
from tiny import WORDS, batch_past_available_memory, needs_meminfo

import switchhead
from switchhead import PRESETS, TransformerLM
from switchhead.cli import main
from switchhead.errors import SwitchheadError
from switchhead.runtime import SamplingParams
from switchhead.runtime.cache import XLCache
from switchhead.runtime.commands import load_generator
from switchhead.runtime.engine import Generator
from switchhead.serve import scheduler as scheduler_module
from switchhead.serve.app import ServeConfig, create_app
from switchhead.serve.protocol import Limits
from switchhead.serve.scheduler import Failed, Finished, Job, Scheduler
from switchhead.serve.server import check_options

MODEL = "tiny"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, sp):
    torch.manual_seed(0)
    m = TransformerLM(PRESETS["tiny-switchhead"].replace(vocab_size=sp.get_piece_size())).eval()
    with torch.no_grad():
        m.out.weight.mul_(3.0)  # peakier outputs than a fresh init, so greedy text is not all one token
        m.out.bias[sp.eos_id()] = -20.0  # completions run to max_tokens unless a test asks otherwise
    return str(switchhead.save(tmp_path_factory.mktemp("ck") / "model", m, sp))


@pytest.fixture(scope="module")
def ref(ckpt):
    """The reference: the engine on its own copy of the model, never touched by the server's thread."""
    return load_generator(ckpt)


@contextmanager
def serving(ckpt, onnx_dir=None, **options):
    gen = load_generator(ckpt, onnx_dir=onnx_dir)
    app = create_app(gen, ServeConfig(model_name=MODEL, **options))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # loopback only; port 0 lets the OS pick a free one
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        assert thread.is_alive() and time.monotonic() - t0 < 20, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def server(ckpt):
    with serving(ckpt, max_batch=4, max_queue=16, limits=Limits(max_prompt_tokens=256, max_tokens=4096)) as s:
        yield s


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def solo(ref, prompt, **kw):
    (r,) = ref.generate([prompt], SamplingParams(**kw))
    return r


def health(url):
    return httpx.get(url + "/health").json()


def wait_idle(url, limit=10.0):
    t0 = time.monotonic()
    while True:
        h = health(url)
        if h["active"] == 0 and h["queued"] == 0:
            return h
        assert time.monotonic() - t0 < limit, f"rows not freed: {h}"
        time.sleep(0.05)


# --- the openai client ---------------------------------------------------------------------------------------

def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = health(url)
    assert h["status"] == "ok" and h["max_batch"] == 4


def test_greedy_completion_equals_engine(client, ref):
    r = client.completions.create(model=MODEL, prompt="the quick fox", max_tokens=12, temperature=0)
    want = solo(ref, "the quick fox", max_new_tokens=12, temperature=0)
    (c,) = r.choices
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert c.text == want.text and c.finish_reason == "length" and c.index == 0
    assert r.usage.prompt_tokens == want.prompt_tokens and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == want.prompt_tokens + 12


def test_seeded_sampling_equals_engine_and_seed_matters(client, ref):
    kw = dict(temperature=0.9, top_p=0.9, seed=5, presence_penalty=0.5, frequency_penalty=-0.4)
    extra = {"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.2}
    r = client.completions.create(model=MODEL, prompt="birds sing", max_tokens=20, extra_body=extra,
                                  logit_bias={"7": 3.0, "12": -100}, **kw)
    want = solo(ref, "birds sing", max_new_tokens=20, logit_bias={7: 3.0, 12: -100}, **extra, **kw)
    assert r.choices[0].text == want.text
    for off in ("presence_penalty", "frequency_penalty"):  # each reaches the sampler: the text depends on it
        assert want.text != solo(ref, "birds sing", max_new_tokens=20, logit_bias={7: 3.0, 12: -100}, **extra,
                                 **{**kw, off: 0.0}).text, off
    assert want.text != solo(ref, "birds sing", max_new_tokens=20, **extra, **kw).text
    other = client.completions.create(model=MODEL, prompt="birds sing", max_tokens=20, extra_body=extra,
                                      **{**kw, "seed": 6})
    assert other.choices[0].text != want.text


def test_prompt_list_gives_one_choice_each(client, ref):
    prompts = ["the", "lazy dogs sing", " ".join(WORDS * 3)]  # the last one runs through XL memory (T=16)
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0.8, seed=3)
    want = ref.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.8, seed=3))
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [w.text for w in want]
    assert r.usage.prompt_tokens == sum(w.prompt_tokens for w in want)


def test_streaming_equals_non_streaming(client, ref):
    want = solo(ref, "over the river", max_new_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="over the river", max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert "".join(texts) == want.text and len(texts) > 2  # streamed in pieces, not one blob
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_stream_is_server_sent_events_ending_in_done(url):
    body = {"model": MODEL, "prompt": "the fox", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all(e["object"] == "text_completion" for e in events)


def test_stop_string_and_eos_finish_with_stop(client, ref):
    base = solo(ref, "the river", max_new_tokens=16, temperature=0).text
    stop = base[5:8]
    r = client.completions.create(model=MODEL, prompt="the river", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == base[:base.index(stop)] and r.choices[0].finish_reason == "stop"
    s = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="the river", max_tokens=16, temperature=0, stop=stop, stream=True))
    assert s == base[:base.index(stop)]


def test_logprobs(client, ckpt):
    r = client.completions.create(model=MODEL, prompt="the quick fox", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen <= 0
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(chosen) and top[tok] == pytest.approx(chosen)
    assert "".join(lp.tokens) == r.choices[0].text  # ASCII text: every token has its own text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_logprobs_end_with_the_text_at_a_stop_string(client):
    """The tokens that spell a stop string are not part of the completion: no logprob entries for them."""
    full = client.completions.create(model=MODEL, prompt="the quick fox", max_tokens=12, temperature=0, logprobs=1)
    toks, offsets = full.choices[0].logprobs.tokens, full.choices[0].logprobs.text_offset
    stop = toks[5] + toks[6]
    cut = full.choices[0].text.find(stop)
    want = [t for t, o in zip(toks, offsets) if o < cut]
    assert 0 < len(want) < len(toks)
    r = client.completions.create(model=MODEL, prompt="the quick fox", max_tokens=12, temperature=0, logprobs=1,
                                  stop=[stop])
    assert r.choices[0].text == full.choices[0].text[:cut] and r.choices[0].logprobs.tokens == want
    assert max(r.choices[0].logprobs.text_offset) < cut
    chunks = list(client.completions.create(model=MODEL, prompt="the quick fox", max_tokens=12, temperature=0,
                                            logprobs=1, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text[:cut]
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == want


def test_n_samples_differ(client, ref):
    r = client.completions.create(model=MODEL, prompt="dogs", max_tokens=10, temperature=1.0, seed=9, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == solo(ref, "dogs", max_new_tokens=10, temperature=1.0, seed=9).text
    assert r.choices[1].text == solo(ref, "dogs", max_new_tokens=10, temperature=1.0, seed=10).text


def test_n_samples_seeds_wrap_at_2_64(url, ref):
    body = {"model": MODEL, "prompt": "dogs", "max_tokens": 6, "temperature": 1.0, "seed": 2**64 - 1, "n": 2}
    r = httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    want = [solo(ref, "dogs", max_new_tokens=6, temperature=1.0, seed=seed).text for seed in (2**64 - 1, 0)]
    assert [c["text"] for c in r.json()["choices"]] == want  # sample j uses seed + j, modulo 2**64


# --- batching --------------------------------------------------------------------------------------------------

def test_concurrent_requests_equal_their_solo_results(url, client, ref):
    """6 requests at once on 4 rows: some wait for a row, rows are reused, prompts and lengths differ."""
    cases = [("the", 0.0, 0, 20), ("lazy dogs sing", 0.9, 1, 14), (" ".join(WORDS * 2), 1.0, 2, 9),
             ("birds", 0.7, 3, 25), ("a river at dawn", 0.0, 4, 6), ("fox fox", 1.2, 5, 17)]
    before = health(url)["steps"]

    def one(case):
        prompt, temp, seed, n = case
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=temp,
                                         seed=seed).choices[0].text

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(one, cases))
    for (prompt, temp, seed, n), text in zip(cases, got):
        assert text == solo(ref, prompt, max_new_tokens=n, temperature=temp, seed=seed).text, prompt
    steps = health(url)["steps"] - before
    # Batched: far fewer steps than the 91 tokens + prompt chunks that one-at-a-time decoding would need.
    assert steps < 91
    wait_idle(url)


def test_a_job_that_cannot_be_admitted_fails_alone(ckpt, ref, monkeypatch):
    """A job the scheduler thread cannot set up (here one whose detokenizer cannot be built) fails as
    "internal"; the thread lives on and serves the jobs queued with it and after it."""
    gen = load_generator(ckpt)
    scheduler = Scheduler(gen, max_batch=2)
    greedy = SamplingParams(max_new_tokens=5, temperature=0, seed=0)
    want = solo(ref, "the fox", max_new_tokens=5, temperature=0).text
    ids = gen.encode("the fox")
    poison = next(t for t in range(gen.backend.config.vocab_size) if t not in ids + gen.prime)
    real = scheduler_module.Detokenizer

    def detokenizer(sp, context):
        if poison in context:
            raise RuntimeError("cannot decode this prompt")
        return real(sp, context)

    monkeypatch.setattr(scheduler_module, "Detokenizer", detokenizer)

    def end(q):
        while not isinstance(event := q.get(timeout=10), (Finished, Failed)):
            pass
        return event

    bad, good, later = queue.Queue(), queue.Queue(), queue.Queue()
    scheduler.start()
    try:
        assert scheduler.submit([Job([poison], SamplingParams(repetition_penalty=1.2, seed=0), bad.put),
                                 Job(ids, greedy, good.put)])
        failed = end(bad)
        assert isinstance(failed, Failed) and failed.kind == "internal" and "cannot decode" in failed.message
        assert end(good).text == want
        assert scheduler.submit([Job(ids, greedy, later.put)]) and end(later).text == want
        assert scheduler.stats()["active"] == 0
    finally:
        scheduler.stop()


def _malformed_jobs(vocab):
    params, sink = SamplingParams(max_new_tokens=3, seed=0), (lambda event: None)
    return [
        (Job([vocab], params, sink), f"token id {vocab} is outside the vocabulary"),
        (Job([-1], params, sink), "token id -1 is outside"),
        (Job([1.0], params, sink), "token id 1.0 is outside"),
        (Job("the fox", params, sink), "Job.ids must be a list of token ids, got str"),
        (Job([1], {"seed": 0}, sink), "Job.params must be SamplingParams, got dict"),
        (Job([1], SamplingParams(), sink), "Job.params.seed must be an integer"),
        (Job([1], params, sink, logprobs=-1), "Job.logprobs must be None or an integer >= 0, got -1"),
        (Job([1], params, sink, logprobs="3"), "Job.logprobs must be None or an integer >= 0, got '3'"),
        (Job([1], params, sink, deadline="soon"), "Job.deadline must be None or a time.monotonic() value"),
        (Job([1], params, sink, deadline=float("nan")), "Job.deadline must be None"),
        (Job([1], params, None), "Job.sink must be callable, got NoneType"),
        ("not a job", "submit takes a list of Jobs, got an item of type str"),
    ]


def test_submit_refuses_malformed_jobs_and_queues_nothing(ckpt, ref):
    """Checked on the caller's thread: on the scheduler thread a malformed job would fail every sequence
    sharing its step (a bad id breaks the whole batched forward) or kill the thread (a string deadline)."""
    gen = load_generator(ckpt)
    scheduler, events = Scheduler(gen, max_batch=2), queue.Queue()
    ok = Job(gen.encode("the fox"), SamplingParams(max_new_tokens=4, temperature=0, seed=0), events.put)
    with pytest.raises(SwitchheadError, match=r"not running: call start\(\) before submit\(\)"):
        scheduler.submit([ok])
    scheduler.start()
    try:
        with pytest.raises(SwitchheadError, match="submit takes a list of Jobs, got Job"):
            scheduler.submit(ok)
        for job, message in _malformed_jobs(gen.backend.config.vocab_size):
            with pytest.raises(SwitchheadError) as e:
                scheduler.submit([ok, job])  # all or nothing: the good job is not queued either
            assert message in str(e.value) and "\n" not in str(e.value)
            assert scheduler.stats()["queued"] == 0 and events.empty()
        assert scheduler.alive()
        assert scheduler.submit([ok])
        while not isinstance(event := events.get(timeout=10), (Finished, Failed)):
            pass
        assert event.text == solo(ref, "the fox", max_new_tokens=4, temperature=0).text
    finally:
        scheduler.stop()


def test_submit_refuses_an_empty_prompt_without_an_eos_prime(ckpt):
    """Without the EOS prime an empty prompt has nothing to predict from; the scheduler thread would spin
    on it forever."""
    loaded = load_generator(ckpt)
    gen = Generator(loaded.backend, loaded.sp, prime_eos=False)
    scheduler = Scheduler(gen, max_batch=1)
    scheduler.start()
    try:
        with pytest.raises(SwitchheadError, match="an empty prompt needs a tokenizer with an EOS id"):
            scheduler.submit([Job([], SamplingParams(seed=0), lambda event: None)])
        assert (scheduler.stats()["active"], scheduler.stats()["queued"]) == (0, 0)
    finally:
        scheduler.stop()


@pytest.mark.parametrize("build,message", [
    (lambda gen: Scheduler(gen, max_batch=0), "max_batch must be an integer >= 1, got 0"),
    (lambda gen: Scheduler(gen, max_batch="2"), "max_batch must be an integer >= 1, got '2'"),
    (lambda gen: Scheduler(gen, max_queue=-1), "max_queue must be an integer >= 0, got -1"),
    (lambda gen: Scheduler(gen, max_queue=None), "max_queue must be an integer >= 0, got None"),
    (lambda gen: Scheduler(gen.backend), "Scheduler needs a Generator, got TorchBackend"),
    (lambda gen: ServeConfig(timeout_s=0), "timeout_s must be a number of seconds > 0, or None"),
    (lambda gen: ServeConfig(timeout_s="60"), "timeout_s must be a number of seconds > 0"),
    (lambda gen: ServeConfig(max_body_bytes=-1), "max_body_bytes must be an integer >= 1, got -1"),
    (lambda gen: ServeConfig(max_batch=True), "max_batch must be an integer >= 1, got True"),
    (lambda gen: ServeConfig(model_name=5), "model_name must be a non-empty string, got 5"),
    (lambda gen: ServeConfig(model_name=" "), "model_name must be a non-empty string"),
    (lambda gen: ServeConfig(limits={"max_tokens": 5}), "limits must be a Limits, got dict"),
    (lambda gen: Limits(max_tokens=0), "Limits.max_tokens must be an integer >= 1, got 0"),
    (lambda gen: Limits(max_prompt_tokens=2.5), "Limits.max_prompt_tokens must be an integer >= 1, got 2.5"),
    (lambda gen: create_app(gen, {"max_batch": 2}), "create_app's config must be a ServeConfig, got dict"),
    (lambda gen: check_options("8000", 1, 0, 0, 1, 1), "--port must be an integer in [0, 65535], got '8000'"),
    (lambda gen: check_options(True, 1, 0, 0, 1, 1), "--port must be an integer in [0, 65535], got True"),
    (lambda gen: check_options(80, 1, 0, -1, 1, 1), "--timeout must be a number of seconds >= 0"),
    (lambda gen: check_options(80, 1, 0, 0, 1, 0), "--max-tokens must be an integer >= 1, got 0"),
])
def test_server_settings_of_the_wrong_kind_are_one_line_errors(ref, build, message):
    with pytest.raises(SwitchheadError) as e:
        build(ref)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_scheduler_keeps_eos_without_stop_at_eos(ckpt, ref):
    """With stop_at_eos=False the scheduler, like the engine, keeps a sampled EOS and runs to max_new_tokens."""
    gen = load_generator(ckpt)
    eos = gen.eos
    params = SamplingParams(max_new_tokens=4, temperature=0, seed=0, stop_at_eos=False, logit_bias={eos: 100.0})
    (want,) = ref.generate_ids([gen.encode("the fox")], params)
    assert want.tokens == [eos] * 4 and want.finish_reason == "length"
    scheduler, events = Scheduler(gen, max_batch=1), queue.Queue()
    scheduler.start()
    try:
        assert scheduler.submit([Job(gen.encode("the fox"), params, events.put)])
        while not isinstance(event := events.get(timeout=10), (Finished, Failed)):
            pass
        assert isinstance(event, Finished), event
        assert (event.reason, event.completion_tokens, event.text) == ("length", 4, want.text)
    finally:
        scheduler.stop()


def test_full_queue_answers_503(ckpt):
    with serving(ckpt, max_batch=1, max_queue=1, limits=Limits(max_tokens=100_000)) as (url, _):
        long = {"model": MODEL, "prompt": "the fox", "max_tokens": 100_000, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as c, c.stream("POST", url + "/v1/completions", json=long) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: a dropped iterator closes the connection, which cancels
            next(lines)  # it holds the only row now
            with c.stream("POST", url + "/v1/completions", json=long) as second:  # waits in the queue
                assert second.status_code == 200
                r = c.post(url + "/v1/completions", json={**long, "stream": False})
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
                assert health(url)["queued"] == 1
            # A client that leaves while still queued is dropped from the queue; the first keeps its row.
            t0 = time.monotonic()
            while (h := health(url))["queued"]:
                assert time.monotonic() - t0 < 5, h
                time.sleep(0.05)
            assert h["active"] == 1
            next(lines)
        wait_idle(url)


def test_timeout_frees_the_row(ckpt):
    with serving(ckpt, max_batch=2, timeout_s=0.3, limits=Limits(max_tokens=100_000)) as (url, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": "the", "max_tokens": 100_000}, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        wait_idle(url)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_the_row(url, stream):
    body = {"model": MODEL, "prompt": "the fox", "max_tokens": 4000, "temperature": 0, "stream": stream}
    if stream:
        with httpx.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            next(lines)
            assert health(url)["active"] == 1
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=0.5)
    steps = health(url)["steps"]
    wait_idle(url, limit=5.0)
    # Freed long before its 4000 tokens: the scheduler stopped stepping.
    assert health(url)["steps"] - steps < 4000
    time.sleep(0.2)
    assert health(url)["active"] == 0


def test_onnx_backend_serves_what_it_generates(ckpt, tmp_path):
    from switchhead.export import export

    out = str(export(ckpt, tmp_path / "onnx").out)
    ref = load_generator(None, onnx_dir=out)
    cases = [("the quick fox", 0.0, 1), ("lazy dogs", 0.9, 2), (" ".join(WORDS * 2), 1.0, 3)]
    with serving(None, onnx_dir=out, max_batch=2) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda c: client.completions.create(
                model=MODEL, prompt=c[0], max_tokens=10, temperature=c[1], seed=c[2]).choices[0].text, cases))
    for (prompt, temp, seed), text in zip(cases, got):
        assert text == solo(ref, prompt, max_new_tokens=10, temperature=temp, seed=seed).text


# --- bad input ---------------------------------------------------------------------------------------------------

BAD = [
    (b"{not json", "invalid_json", None),
    (b"[1, 2]", "invalid_type", None),
    ({"model": MODEL}, "missing_required_parameter", "prompt"),
    ({"prompt": ""}, "invalid_value", "prompt"),
    ({"prompt": "   "}, "invalid_value", "prompt"),
    ({"prompt": []}, "invalid_type", "prompt"),
    ({"prompt": [1, 2, 3]}, "invalid_type", "prompt"),
    ({"prompt": "the " * 600}, "context_length_exceeded", "prompt"),
    ({"prompt": "x" * 100_000}, "context_length_exceeded", "prompt"),
    ({"prompt": "the", "max_tokens": 0}, "invalid_value", "max_tokens"),
    ({"prompt": "the", "max_tokens": "5"}, "invalid_type", "max_tokens"),
    ({"prompt": "the", "max_tokens": 10**9}, "invalid_value", "max_tokens"),
    ({"prompt": "the", "temperature": -1}, "invalid_value", "temperature"),
    ({"prompt": "the", "temperature": True}, "invalid_type", "temperature"),
    ({"prompt": "the", "top_p": 0}, "invalid_value", "top_p"),
    ({"prompt": "the", "top_k": 1.5}, "invalid_type", "top_k"),
    ({"prompt": "the", "min_p": 2}, "invalid_value", "min_p"),
    ({"prompt": "the", "repetition_penalty": 0}, "invalid_value", "repetition_penalty"),
    ({"prompt": "the", "seed": -3}, "invalid_value", "seed"),
    ({"prompt": "the", "seed": 2**64}, "invalid_value", "seed"),
    (b'{"prompt": "Hello \\ud800 there"}', "invalid_value", "prompt"),
    (b'{"prompt": ["the", "x\\udcff"]}', "invalid_value", "prompt"),
    (b'{"prompt": "the", "stop": "\\ud800"}', "invalid_value", "stop"),
    ({"prompt": "the", "stop": [""]}, "invalid_value", "stop"),
    ({"prompt": "the", "stop": 5}, "invalid_type", "stop"),
    ({"prompt": "the", "logprobs": 99}, "invalid_value", "logprobs"),
    ({"prompt": "the", "n": 0}, "invalid_value", "n"),
    ({"prompt": "the", "n": 1000}, "invalid_value", "n"),
    ({"prompt": "the", "echo": True}, "unsupported_parameter", "echo"),
    ({"prompt": "the", "presence_penalty": 2.5}, "invalid_value", "presence_penalty"),
    ({"prompt": "the", "frequency_penalty": "1"}, "invalid_type", "frequency_penalty"),
    ({"prompt": "the", "logit_bias": [1]}, "invalid_type", "logit_bias"),
    ({"prompt": "the", "logit_bias": {"the": 1}}, "invalid_value", "logit_bias"),
    ({"prompt": "the", "logit_bias": {"-1": 1}}, "invalid_value", "logit_bias"),
    ({"prompt": "the", "logit_bias": {"100000": 1}}, "invalid_value", "logit_bias"),  # past the vocabulary
    ({"prompt": "the", "logit_bias": {"5": "up"}}, "invalid_type", "logit_bias"),
    ({"prompt": "the", "logit_bias": {"5": 101}}, "invalid_value", "logit_bias"),
    ({"prompt": "the", "stream": "yes"}, "invalid_type", "stream"),
    # JSON that Python's parser refuses: over its 4300-digit integer limit, deeper than its recursion limit.
    (b'{"prompt": "the", "n": ' + b"1" * 5000 + b"}", "invalid_json", None),
    (b"[" * 5000 + b"]" * 5000, "invalid_json", None),
    ({"prompt": "the", "temperature": 10**400}, "invalid_type", "temperature"),  # valid JSON, no float
    ({"prompt": "the", "stream": True, "stream_options": {"include_usage": "no"}}, "invalid_type",
     "stream_options.include_usage"),
    ({"prompt": "the", "stream_options": {"include_usage": 1}}, "invalid_type", "stream_options.include_usage"),
    ({"prompt": "the", "echo": 0}, "invalid_type", "echo"),  # == False in Python, but not a boolean
    ({"prompt": "the", "best_of": True}, "invalid_type", "best_of"),
    ({"prompt": "the", "model": 5}, "invalid_type", "model"),  # a malformed request, not an unknown model (404)
    ({"prompt": "the", "model": ["tiny"]}, "invalid_type", "model"),
    ({"prompt": "the", "user": 7}, "invalid_type", "user"),
    # Unknown fields, misspelt ones among them, are refused rather than left at their defaults.
    ({"prompt": "a", "max_tokens": 2, "foo": 1, "seed": 1}, "unsupported_parameter", "foo"),
    ({"prompt": "the", "temprature": 0.5}, "unsupported_parameter", "temprature"),
    ({"prompt": "the", "max_token": 3}, "unsupported_parameter", "max_token"),
    (b'{"prompt": "the", "\\ud800": 1}', "unsupported_parameter", "'\\ud800'"),  # quoted: UTF-8 cannot carry it
    # More completions than --max-batch 4 + --max-queue 16 (under the 64 of Limits): never admitted, so not a 503.
    ({"prompt": "the", "n": 21}, "invalid_value", "n"),
    ({"prompt": ["the"] * 21}, "invalid_value", "prompt"),
]


@pytest.mark.parametrize("body,code,param", BAD)
def test_bad_request_is_400_with_openai_error(url, body, code, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    r = httpx.post(url + "/v1/completions", **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == code and err["param"] == param
    assert err["message"]


def test_unknown_field_is_400_naming_it(url, client, ref):
    """A misspelt field would otherwise fall back to its default unnoticed; every documented field, OpenAI's `user`
    and the extensions sent through the openai client's extra_body are still accepted."""
    r = httpx.post(url + "/v1/completions", json={"prompt": "the", "temprature": 0.5, "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["code"], err["param"]) == ("unsupported_parameter", "temprature"), r.text
    assert "'temprature'" in err["message"] and "did you mean 'temperature'" in err["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "the", **{f"x{i}": 1 for i in range(8)}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x0"
    assert "'x0', 'x1', 'x2', 'x3', 'x4' and 3 more" in r.json()["error"]["message"]
    every = {"model": MODEL, "prompt": "the fox", "max_tokens": 6, "temperature": 0.8, "top_p": 0.9,
             "presence_penalty": 0.1, "frequency_penalty": 0.1, "logit_bias": {"7": 1}, "top_k": 40, "min_p": 0.01,
             "repetition_penalty": 1.1, "stop": ["zzz"], "seed": 4, "n": 1, "stream": False,
             "stream_options": None, "logprobs": None, "echo": False, "suffix": None, "best_of": 1, "user": "u-1"}
    r = httpx.post(url + "/v1/completions", json=every, timeout=30)
    assert r.status_code == 200, r.text
    want = solo(ref, "the fox", max_new_tokens=6, temperature=0.8, top_p=0.9, presence_penalty=0.1,
                frequency_penalty=0.1, logit_bias={7: 1}, top_k=40, min_p=0.01, repetition_penalty=1.1,
                stop=["zzz"], seed=4).text
    assert r.json()["choices"][0]["text"] == want
    r = client.completions.create(model=MODEL, prompt="the fox", max_tokens=6, temperature=0.8, top_p=0.9, seed=4,
                                  presence_penalty=0.1, frequency_penalty=0.1, logit_bias={"7": 1}, stop=["zzz"],
                                  user="u-1", n=1, echo=False, best_of=1, extra_body={
                                      "top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1})
    assert r.choices[0].text == want
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="the", extra_body={"max_token": 3})
    assert (e.value.body["code"], e.value.body["param"]) == ("unsupported_parameter", "max_token")


@pytest.mark.parametrize("max_batch,max_queue,fits,too_many,param", [
    (2, 4, {"n": 6}, {"n": 7}, "n"),
    (1, 0, {}, {"n": 2}, "n"),
    (1, 0, {}, {"prompt": ["Hi", "Ho"]}, "prompt"),
])
def test_request_past_batch_plus_queue_is_400_not_503(ckpt, max_batch, max_queue, fits, too_many, param):
    """The queue refuses more than --max-batch + --max-queue sequences even on an idle server: a 503 with Retry-After
    would have clients retry it forever."""
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    with serving(ckpt, max_batch=max_batch, max_queue=max_queue) as (url, _):
        r = httpx.post(url + "/v1/completions", json={**base, **too_many}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and "retry-after" not in r.headers, r.text
        assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_value", param)
        limit = max_batch + max_queue
        assert f"limit of {limit} per request (--max-batch {max_batch} + --max-queue {max_queue})" in err["message"]
        # A client that retries 503s (after Retry-After) gets the 400 at once, not an error after its retries.
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=3, timeout=30)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**{**base, **too_many})
        # As many as fit are served, on an idle server.
        r = httpx.post(url + "/v1/completions", json={**base, **fits}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == fits.get("n", 1), r.text


def test_array_nested_as_deep_as_the_parser_allows_is_400(url):
    """Quoting such a value in the error message (repr) would recurse deeper than parsing it did."""
    with httpx.Client(base_url=url) as c:
        for depth in range(1000, 0, -1):
            r = c.post("/v1/completions", content=b'{"prompt": "the", "n": ' + b"[" * depth + b"]" * depth + b"}")
            if r.status_code != 400 or r.json()["error"]["code"] != "invalid_json":
                break
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and depth > 100, (depth, r.text)


def test_other_errors_have_openai_shape(url, client):
    r = httpx.post(url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # Quoted in the message as a repr: a lone surrogate cannot be written in the UTF-8 reply as is.
    r = httpx.post(url + "/v1/completions", content=b'{"model": "\\ud800", "prompt": "x"}')
    assert r.status_code == 404 and "'\\ud800'" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/nothing").json()["error"]["code"] == "not_found"
    r = httpx.post(url + "/v1/completions", content=b"{" + b" " * (2 << 20) + b"}")
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="the", temperature=-2)
    assert e.value.body["param"] == "temperature"


def test_many_bad_requests_then_a_good_one(url, client, ref):
    with httpx.Client(base_url=url) as c:
        for i in range(300):
            body, _, _ = BAD[i % len(BAD)]
            r = c.post("/v1/completions", content=body if isinstance(body, bytes) else json.dumps(body))
            assert r.status_code == 400
    assert wait_idle(url)["status"] == "ok"
    r = client.completions.create(model=MODEL, prompt="the quick fox", max_tokens=12, temperature=0)
    assert r.choices[0].text == solo(ref, "the quick fox", max_new_tokens=12, temperature=0).text


# --- command line ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--max-batch", "0"], "--max-batch must be an integer >= 1, got 0"),
    (["--port", "70000"], "--port must be an integer in [0, 65535], got 70000"),
    (["--ckpt", "a", "--onnx", "b"], "not both"),
    (["--ckpt", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
    (["--model-name", " "], "--model-name is empty"),
    (["--device", ""], "the device is empty"),
])
def test_cli_bad_options_are_one_line_exit_2(args, message):
    r = CliRunner().invoke(main, ["serve", *args])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("max_batch,message", [
    (10**11, "--max-batch 100000000000: the KV cache for 100000000000 sequences needs 1638400000000000 bytes"),
    (10**30, "more than 2**63 bytes; lower --max-batch"),  # past torch's int64 sizes
])
def test_cli_max_batch_too_large_for_memory_is_one_line_exit_2(ckpt, max_batch, message):
    r = CliRunner().invoke(main, ["serve", "--ckpt", ckpt, "--port", "0", "--max-batch", str(max_batch)])
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output


@needs_meminfo
def test_cli_max_batch_past_available_memory_is_refused_before_allocating(ckpt):
    """The cache is allocated layer by layer, so the allocator grants one larger than the memory available now,
    and zeroing it then ends in swapping or the OOM killer: it is refused before anything is allocated."""
    cfg = switchhead.load(ckpt)[0].config
    row = XLCache(cfg, 1).nbytes
    max_batch = batch_past_available_memory(row)
    r = CliRunner().invoke(main, ["serve", "--ckpt", ckpt, "--port", "0", "--max-batch", str(max_batch)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert f"the KV cache for {max_batch} sequences needs {max_batch * row} bytes" in r.output
    assert "GiB available; lower --max-batch" in r.output


def test_cli_address_that_cannot_be_listened_on_is_one_line_exit_2(ckpt):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        for host, port, message in [("127.0.0.1", taken.getsockname()[1], "in use"),
                                    ("999.1.1.1", 8000, "cannot listen on 999.1.1.1:8000")]:
            r = CliRunner().invoke(main, ["serve", "--ckpt", str(ckpt), "--host", host, "--port", str(port)])
            assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output
    finally:
        taken.close()


def test_stopped_scheduler_is_reported_not_waited_on(ckpt):
    """If the generation loop is not running, /health says so and requests get 503 at once instead of hanging."""
    with serving(ckpt, max_batch=1) as (url, app):
        assert httpx.get(url + "/health").status_code == 200
        app.state.scheduler.stop()
        h = httpx.get(url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "stopped"
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "scheduler_stopped"


def test_sigterm_answers_the_requests_in_flight_and_exits_cleanly(ckpt, tmp_path):
    """The command's server on SIGTERM: a stream in flight gets its error event (503 shutting_down) instead of
    being cut off, and the process ends within seconds without logging a traceback."""
    import os
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = open(tmp_path / "stderr.txt", "w+")  # noqa: SIM115 - read after the process ends
    proc = subprocess.Popen([sys.executable, "-m", "switchhead", "serve", "--ckpt", ckpt, "--port", str(port),
                             "--max-tokens", "100000", "--threads", "1"], stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None and time.monotonic() - t0 < 60, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"model": "x", "prompt": "the", "max_tokens": 100000, "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "model": "model"}, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        os.kill(proc.pid, signal.SIGTERM)
        # uvicorn re-raises the signal it caught once it has shut down; the CLI then exits as the shell reports a
        # process stopped by SIGTERM (128 + 15), with one line.
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    err.seek(0)
    log = err.read()
    assert "Traceback" not in log and log.splitlines()[-1] == "terminated", log
    assert len(events) >= 4 and json.loads(events[-1])["error"]["code"] == "shutting_down", events[-3:]


def test_default_model_name_is_the_model_directory_or_its_run(tmp_path, monkeypatch):
    from switchhead.serve.app import default_model_name

    run = tmp_path / "my-model"
    for d in (run / "final", run / "checkpoint", tmp_path / "plain", tmp_path / "final"):
        d.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    assert default_model_name(str(run / "final"), None) == "my-model"  # every run's model lies in final/
    assert default_model_name(None, str(run / "checkpoint")) == "my-model"
    assert default_model_name(str(tmp_path / "final"), None) == "final"  # no run around it
    assert default_model_name(str(tmp_path / "plain"), None) == "plain"
    monkeypatch.chdir(run / "final")
    assert default_model_name(".", None) == "my-model"
    assert default_model_name(None, None) == "switchhead"
