"""Generation end to end: detokenisation, stop strings, seeds, batching, and the `switchhead generate` CLI."""

import io
import json
import random
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from tiny import WORDS

import switchhead
from switchhead import PRESETS, TransformerLM
from switchhead.cli import main
from switchhead.errors import SwitchheadError
from switchhead.runtime import Backend, Detokenizer, Generator, SamplingParams, StopText, TorchBackend, XLCache
from switchhead.runtime.commands import load_generator, read_prompts_file, run_generate


@pytest.fixture(scope="module")
def model(sp):
    torch.manual_seed(0)
    m = TransformerLM(PRESETS["tiny-switchhead"].replace(vocab_size=sp.get_piece_size())).eval()
    with torch.no_grad():
        m.out.weight.mul_(3.0)  # peakier outputs than a fresh init, so greedy text is not all one token
        m.out.bias[sp.eos_id()] = -20.0  # generations run to their limits unless a test asks for EOS
    return m


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, model, sp):
    return str(switchhead.save(tmp_path_factory.mktemp("ck") / "model", model, sp))


@pytest.fixture(scope="module")
def gen(model, sp):
    return Generator(TorchBackend(model), sp)


# --- text plumbing -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [" the quick fox", " naïve café 漢字 🙂 ok", "\n  two  spaces", "x"])
def test_detokenizer_streams_exact_text(sp, text):
    context = sp.encode("over the river")
    ids = sp.encode("over the river" + text)[len(context):]
    assert sp.decode(context + ids) == "over the river" + text  # sanity: the split is on a piece boundary
    d = Detokenizer(sp, context)
    pieces = [d.push(i) for i in ids] + [d.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # multi-byte characters are released whole


def test_detokenizer_random_ids(sp):
    rng = random.Random(1)
    for _ in range(20):
        context = sp.encode("the fox")
        ids = [rng.randrange(2, sp.get_piece_size()) for _ in range(rng.randint(1, 15))]
        d = Detokenizer(sp, context)
        out = "".join(d.push(i) for i in ids) + d.flush()
        assert sp.decode(context) + out == sp.decode(context + ids)


def test_detokenizer_context_that_ends_inside_a_character(sp, model):
    # Token-id prompts may stop between a character's byte pieces; the character the new ids complete is text.
    ids = sp.encode("over naïve 漢字 done")
    assert sum(sp.is_byte(i) for i in ids) >= 6  # 漢 and 字 are three byte pieces each
    full = sp.decode(ids)
    for cut in range(1, len(ids)):
        d = Detokenizer(sp, ids[:cut])
        out = "".join(d.push(i) for i in ids[cut:]) + d.flush()
        stable = sp.decode(ids[:cut]).rstrip("\ufffd")  # the prompt's text, up to an unfinished character
        assert stable + out == full, cut
    ids = sp.encode("the é")
    assert [sp.is_byte(i) for i in ids[-2:]] == [True, True]  # é is two byte pieces
    params = SamplingParams(temperature=0, max_new_tokens=1, logit_bias={ids[-1]: 100.0})
    (r,) = Generator(TorchBackend(model), sp).generate_ids([ids[:-1]], params)
    assert r.tokens == ids[-1:] and r.text == "é"


def test_each_row_reports_its_own_decode_time(gen, sp):
    # EOS made likely (the fixture's bias is -20): rows end at different steps, each timed up to the step that
    # ended it.
    params = SamplingParams(temperature=1.0, max_new_tokens=40, logit_bias={sp.eos_id(): 24.0})
    rows = gen.generate(["the cat"] * 8, params, seeds=range(8))
    # Step that ended a row: an EOS is drawn without being kept, a last kept token ends its own step.
    ended = {id(r): len(r.tokens) - (r.finish_reason != "eos") for r in rows}
    pairs = [(a, b) for a in rows for b in rows if ended[id(a)] < ended[id(b)]]
    assert pairs
    assert all(a.decode_s < b.decode_s for a, b in pairs)
    assert len({r.decode_s for r in rows}) == len(set(ended.values()))


def test_stop_text_never_releases_a_partial_stop():
    s = StopText(["STOP", "xyz"])
    assert [s.add(p) for p in ["ab", "cS", "TO"]] == ["ab", "c", ""]  # "STO" may still become "STOP"
    assert s.add("x") == "STO"  # "STOx" cannot, but "x" may start "xyz"
    assert s.add("y") == "" and not s.stopped
    assert s.add("z!") == "" and s.stopped and s.text == "abcSTO"
    assert s.finish() == "" and s.add("more") == ""
    s = StopText(["STOP"])
    assert s.add("aST") == "a" and s.finish() == "ST"  # at the end, held text that never became a stop is kept


def test_stop_text_cuts_at_first_stop():
    s = StopText(["ld", "o w"])  # the earliest occurrence wins, not the first-listed stop
    out = s.add("hel") + s.add("lo world")
    assert s.stopped and s.text == "hell" and out == "hell"
    s = StopText([])
    assert s.add("abc") == "abc" and s.finish() == ""


def _stop_text_naive(stops, pieces):
    """What StopText must release, by brute force over the whole text after each piece."""
    text, released, out = "", 0, []
    for piece in pieces:
        text += piece
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            text = text[:min(hits)]
            out.append(text[released:])
            return out, text, True
        hold = max([n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)
        out.append(text[released:max(released, len(text) - hold)])
        released = max(released, len(text) - hold)
    return out, text, False


@pytest.mark.parametrize("seed", range(6))
def test_stop_text_against_brute_force(seed):
    # A two-letter alphabet makes overlapping, self-similar stops and long partial matches common.
    rng = random.Random(seed)
    word = lambda n: "".join(rng.choice("ab") for _ in range(n))  # noqa: E731
    for _ in range(200):
        stops = [word(rng.randint(1, 7)) for _ in range(rng.randint(1, 3))]
        pieces = [word(rng.randint(1, 3)) for _ in range(rng.randint(1, 12))]
        s = StopText(stops)
        got = [s.add(p) for p in pieces]
        want, text, stopped = _stop_text_naive(stops, pieces)
        assert got[:len(want)] == want and set(got[len(want):]) <= {""}, (stops, pieces)
        assert (s.stopped, s.text) == (stopped, text)
        if not stopped:
            assert s.finish() == text[sum(map(len, want)):]


# --- generation --------------------------------------------------------------------------------------------

def test_greedy_is_deterministic_and_matches_forward(gen, model, sp):
    p = SamplingParams(temperature=0, max_new_tokens=12)
    (a,), (b,) = gen.generate(["the fox"], p), gen.generate(["the fox"], p)
    assert a.text == b.text and a.tokens == b.tokens and len(a.tokens) == 12
    assert a.finish_reason == "length" and a.prompt_tokens == len(sp.encode("the fox"))
    # Greedy tokens must be the argmax of the plain forward over prime + prompt + generated tokens.
    ids = [sp.eos_id()] + sp.encode("the fox") + a.tokens
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0][0]
    n = len(ids) - len(a.tokens)
    logits[:, sp.unk_id()] = float("-inf")  # UNK is never sampled
    assert logits[n - 1:-1].argmax(-1).tolist() == a.tokens
    assert a.text == sp.decode(ids[1:])[len(sp.decode(ids[1:n])):]


def test_greedy_with_bias_and_penalties_matches_a_naive_loop(gen, model, sp):
    # The bias and the three penalties against plain Python over the full forward of everything so far: the
    # repetition penalty sees prompt and generated tokens, presence and frequency only generated ones.
    prompt = sp.encode("the lazy dogs")
    bias = {sp.encode("birds")[-1]: 4.0, prompt[0]: -1.0}
    p = SamplingParams(temperature=0, max_new_tokens=12, repetition_penalty=1.3, presence_penalty=1.5,
                       frequency_penalty=1.0, logit_bias=bias)
    (a,) = gen.generate_ids([prompt], p)
    assert gen.generate_ids(torch.tensor([prompt]), p)[0].tokens == a.tokens  # ids as a [1, t] tensor too
    ids, counts, want = [sp.eos_id()] + prompt, {}, []
    for _ in range(12):
        with torch.no_grad():
            row = model(torch.tensor([ids]))[0][0, -1].double().tolist()
        scores = []
        for tok, v in enumerate(row):
            if gen.banned is not None and gen.banned[tok]:
                v = float("-inf")
            v += bias.get(tok, 0.0)
            if tok in prompt or tok in counts:
                v = v / 1.3 if v > 0 else v * 1.3
            scores.append(v - 1.0 * counts.get(tok, 0) - (1.5 if tok in counts else 0.0))
        tok = max(range(len(scores)), key=scores.__getitem__)
        if tok == sp.eos_id():
            break
        want.append(tok)
        ids.append(tok)
        counts[tok] = counts.get(tok, 0) + 1
    assert a.tokens == want
    # Each of the four changes what this greedy run generates, so the comparison above covers each.
    for off in (dict(logit_bias=None), dict(repetition_penalty=1.0), dict(presence_penalty=0.0),
                dict(frequency_penalty=0.0)):
        assert gen.generate_ids([prompt], replace(p, **off))[0].tokens != a.tokens, off


@pytest.mark.parametrize("prefill_step", [None, 1, 3, 16])
def test_greedy_does_not_depend_on_prefill_step_chunk_phase_or_batch(model, sp, prefill_step):
    """Primed prompts of 1, T - 1, T, T + 1 and 2T tokens (T = 16), prefilled in steps of any size, alone and
    batched together: each row's greedy tokens are the argmax of the plain forward over everything so far, and
    generation crosses the next chunk boundary."""
    T, n_new = model.config.chunk_len, 18
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, sp.get_piece_size(), (n - 1,), generator=g).tolist()
               for n in (1, T - 1, T, T + 1, 2 * T)]  # the EOS prime makes them n tokens
    gen = Generator(TorchBackend(model), sp, prefill_step=prefill_step)
    p = SamplingParams(temperature=0, max_new_tokens=n_new)
    together = gen.generate_ids(prompts, p)
    for prompt, row in zip(prompts, together):
        ids, want = [sp.eos_id()] + prompt, []
        for _ in range(n_new):
            with torch.no_grad():
                logits = model(torch.tensor([ids]))[0][0, -1].masked_fill(gen.banned, float("-inf"))
            want.append(int(logits.argmax()))
            ids.append(want[-1])
        assert row.tokens == want, len(prompt)
        assert gen.generate_ids([prompt], p)[0].tokens == want, len(prompt)


def test_seed_reproduces_and_changes_text(gen):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=20, seed=7)
    assert gen.generate(["birds"], p)[0].text == gen.generate(["birds"], p)[0].text
    other = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=20, seed=8)
    assert gen.generate(["birds"], p)[0].tokens != gen.generate(["birds"], other)[0].tokens


def test_batched_rows_equal_each_row_alone(gen):
    """Different lengths (one far beyond T=16, through memory), sampling with every filter on."""
    prompts = ["the", "lazy dogs sing", " ".join(WORDS * 4)]
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 1.0}, max_new_tokens=10)
    seeds = [11, 12, 13]
    together = gen.generate(prompts, p, seeds=seeds)
    for prompt, seed, r in zip(prompts, seeds, together):
        (alone,) = gen.generate([prompt], p, seeds=[seed])
        assert (alone.tokens, alone.text) == (r.tokens, r.text)
    assert together[2].prompt_tokens > 4 * 16


def test_stop_string_while_streaming(gen):
    base = gen.generate(["the river"], SamplingParams(temperature=0, max_new_tokens=16))[0].text
    stop = base[5:8]
    assert stop
    pieces = []
    (r,) = gen.generate(["the river"], SamplingParams(temperature=0, max_new_tokens=16, stop=[stop]),
                        on_text=lambda i, t: pieces.append(t))
    assert r.finish_reason == "stop" and r.text == base[:base.index(stop)]
    streamed = ""
    for piece in pieces:
        streamed += piece
        assert r.text.startswith(streamed)  # nothing of the stop string ever reached the stream
    assert streamed == r.text


def test_eos_ends_generation(model, sp):
    torch.manual_seed(0)
    m = TransformerLM(model.config).eval()
    with torch.no_grad():
        m.out.bias[sp.eos_id()] = 50.0
    (r,) = Generator(TorchBackend(m), sp).generate(["the fox"], SamplingParams(temperature=0))
    assert r.finish_reason == "eos" and r.tokens == [] and r.text == ""


def test_stop_at_eos_false_keeps_eos_and_runs_to_the_limit(model, sp):
    # The same model that ends at once above: without stop_at_eos its greedy EOS tokens are kept and generation
    # runs to max_new_tokens, each step the argmax of the plain forward over everything so far.
    torch.manual_seed(0)
    m = TransformerLM(model.config).eval()
    with torch.no_grad():
        m.out.bias[sp.eos_id()] = 50.0
    gen = Generator(TorchBackend(m), sp)
    (r,) = gen.generate(["the fox"], SamplingParams(temperature=0, max_new_tokens=5, stop_at_eos=False))
    ids, want = [sp.eos_id()] + sp.encode("the fox"), []
    for _ in range(5):
        with torch.no_grad():
            want.append(int(m(torch.tensor([ids]))[0][0, -1].masked_fill(gen.banned, float("-inf")).argmax()))
        ids.append(want[-1])
    assert r.finish_reason == "length" and r.tokens == want == [sp.eos_id()] * 5


def test_unk_is_never_sampled(model, sp):
    torch.manual_seed(0)
    m = TransformerLM(model.config).eval()
    with torch.no_grad():
        m.out.bias[sp.unk_id()] = 50.0
    (r,) = Generator(TorchBackend(m), sp).generate(["the fox"], SamplingParams(temperature=1.0, max_new_tokens=8,
                                                                                seed=0))
    assert len(r.tokens) == 8 and sp.unk_id() not in r.tokens and "\u2047" not in r.text


def test_empty_prompt_is_a_user_error(gen):
    for bad in ["", "   "]:
        with pytest.raises(SwitchheadError, match="empty prompt"):
            gen.generate([bad], SamplingParams())


def test_prompt_that_is_not_utf8_is_a_user_error(gen):
    # Undecodable command-line or stdin bytes arrive as lone surrogates (surrogateescape), as does JSON's "\ud800".
    for bad, where in [("Hello \udcff\udcfe world", "byte 0xFF at character 6"),
                       ("Hello \ud800 there", "lone surrogate U+D800 at character 6")]:
        with pytest.raises(SwitchheadError, match="prompt is not valid UTF-8") as e:
            gen.generate([bad], SamplingParams(max_new_tokens=2))
        assert f"({where})" in str(e.value)


def test_seeds_cover_the_generator_range(gen):
    p = SamplingParams(temperature=1.0, max_new_tokens=4)
    (r,) = gen.generate(["birds"], p, seeds=[2**64 - 1])
    assert r.seed == 2**64 - 1 and len(r.tokens) == 4
    for bad in [2**64, -1]:
        with pytest.raises(SwitchheadError, match="seed"):
            gen.generate(["birds"], p, seeds=[bad])


# --- CLI ---------------------------------------------------------------------------------------------------

def _run(args, input=None):
    return CliRunner().invoke(main, ["generate", *args], input=input)


def test_cli_streams_greedy_text(ckpt, gen):
    want = gen.generate(["the fox"], SamplingParams(temperature=0, max_new_tokens=8))[0].text
    r = _run(["the fox", "--ckpt", ckpt, "--temperature", "0", "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    assert r.stdout == want + "\n"
    r = _run(["--ckpt", ckpt, "--temperature", "0", "--max-new-tokens", "8"], input="the fox\n")
    assert r.exit_code == 0 and r.stdout == want + "\n"
    p = SamplingParams(temperature=0, max_new_tokens=8, presence_penalty=-2.0, frequency_penalty=-2.0)
    penalised = gen.generate(["the fox"], p)[0].text  # negative: repeats its first two tokens
    r = _run(["the fox", "--ckpt", ckpt, "--temperature", "0", "--max-new-tokens", "8", "--presence-penalty", "-2",
              "--frequency-penalty", "-2"])
    assert r.exit_code == 0 and r.stdout == penalised + "\n" and penalised != want


def test_cli_json_and_long_prompt(ckpt):
    long_prompt = " ".join(WORDS * 10)  # far longer than T = 16 tokens
    r = _run([long_prompt, "--ckpt", ckpt, "--json", "--max-new-tokens", "5", "--seed", "3", "--top-k", "5"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["tokens"] == 5 and out["prompt_tokens"] > 10 * 16 and isinstance(out["text"], str)
    assert out["prefill_tokens_per_s"] > 0 and out["decode_tokens_per_s"] > 0 and out["seed"] == 3


@pytest.mark.parametrize("jsonl", [False, True])
def test_cli_prompts_file_matches_single_runs(ckpt, tmp_path, jsonl):
    prompts = ["the fox", "birds sing in trees near a river", "dawn"]
    f = tmp_path / ("p.jsonl" if jsonl else "p.txt")
    f.write_text("\n".join(json.dumps({"prompt": p, "id": i}) if jsonl else p for i, p in enumerate(prompts)) + "\n")
    args = ["--ckpt", ckpt, "--max-new-tokens", "6", "--seed", "40", "--temperature", "0.8"]
    r = _run(["--prompts-file", str(f), "--batch-size", "2", *args])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == prompts
    for i, row in enumerate(rows):  # row i samples with seed + i, whatever the batch size
        single = json.loads(_run([prompts[i], "--json", *args[:-4], "--seed", str(40 + i), *args[-2:]]).stdout)
        assert single["text"] == row["text"]


def test_cli_prompts_file_seeds_wrap_at_2_64(ckpt, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("the fox\nbirds\n")
    args = ["--ckpt", ckpt, "--max-new-tokens", "6", "--temperature", "0.8"]
    r = _run(["--prompts-file", str(f), "--seed", str(2**64 - 1), *args])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["seed"] for row in rows] == [2**64 - 1, 0]  # seed + 1, modulo 2**64
    assert rows[1]["text"] == json.loads(_run(["birds", "--json", "--seed", "0", *args]).stdout)["text"]


def _bad_ckpts(tmp_path, model):
    missing = tmp_path / "missing"
    corrupt = tmp_path / "corrupt"
    switchhead.save(corrupt, model, None)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    no_tok = tmp_path / "no_tok"
    switchhead.save(no_tok, model, None)
    nan = tmp_path / "nan"  # save refuses NaN weights: damaged afterwards
    switchhead.save(nan, model, None)
    weights = load_file(str(nan / "model.safetensors"))
    weights["embed.weight"][0, 0] = float("nan")
    save_file(weights, str(nan / "model.safetensors"))
    return {"not found": missing, "corrupt": corrupt, "no tokenizer": no_tok, "nan": nan}


@pytest.mark.parametrize("args,message", [
    (["", "--ckpt", "CKPT"], "empty prompt"),
    (["hi", "--ckpt", "CKPT", "--temperature", "-1"], "temperature"),
    (["hi", "--ckpt", "CKPT", "--top-p", "0"], "top-p"),
    (["hi", "--ckpt", "CKPT", "--top-p", "1.5"], "top-p"),
    (["hi", "--ckpt", "CKPT", "--top-k", "-2"], "top-k"),
    (["hi", "--ckpt", "CKPT", "--min-p", "2"], "min-p"),
    (["hi", "--ckpt", "CKPT", "--repetition-penalty", "0"], "repetition-penalty"),
    (["hi", "--ckpt", "CKPT", "--presence-penalty", "2.5"], "presence-penalty must be in [-2, 2], got 2.5"),
    (["hi", "--ckpt", "CKPT", "--frequency-penalty", "nan"], "frequency-penalty must be in [-2, 2], got nan"),
    (["hi", "--ckpt", "CKPT", "--max-new-tokens", "0"], "max-new-tokens"),
    (["hi", "--ckpt", "CKPT", "--prompts-file", "nonexistent.txt"], "prompts"),
    (["hi", "--ckpt", "CKPT", "--seed", str(2**64)], "seed"),
    (["caf\udce9", "--ckpt", "CKPT"], "prompt is not valid UTF-8 (byte 0xE9 at character 3)"),
    (["hi", "--ckpt", "CKPT", "--stop", "\udcff"], "stop string 0 is not valid UTF-8"),
    (["hi", "--ckpt", "BAD:not found"], "not found"),
    (["hi", "--ckpt", "BAD:corrupt"], "corrupt"),
    (["hi", "--ckpt", "BAD:no tokenizer"], "tokenizer"),
    (["hi", "--ckpt", "BAD:nan"], "has NaN or infinite values"),
    (["hi", "--ckpt", "CKPT", "--threads", "0"], "--threads must be an integer between 1 and 1024, got 0"),
    (["hi", "--ckpt", "CKPT", "--threads", "100000"], "--threads must be an integer between 1 and 1024, got 100000"),
    (["hi", "--ckpt", "CKPT", "--device", "meta"], "device 'meta' cannot run a model; use cpu, cuda or mps"),
])
def test_cli_bad_input_is_one_line_exit_2(ckpt, tmp_path, model, args, message):
    bad = _bad_ckpts(tmp_path, model) if any(a.startswith("BAD:") for a in args) else {}
    args = [ckpt if a == "CKPT" else str(bad[a[4:]]) if a.startswith("BAD:") else a for a in args]
    r = _run(args)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("Error:") and message in err[0], r.stderr


@pytest.mark.parametrize("exc", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB. GPU 0"),
                                 RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't "
                                              "allocate memory: you tried to allocate 9")], ids=["cuda", "cpu"])
def test_cli_out_of_memory_is_one_line_exit_2(ckpt, monkeypatch, exc):
    """Memory running out mid-generation (here: torch's linear layer refusing, as it does when a batch of long
    prompts needs more than the device has) is one line, with the torch message's first line."""
    import torch.nn.functional as F

    def linear(*args, **kwargs):
        raise exc

    monkeypatch.setattr(F, "linear", linear)
    r = _run(["--ckpt", ckpt, "the fox"])
    assert r.exit_code == 2, (r.output, r.exception)
    first = str(exc).splitlines()[0]
    assert r.output.strip() == f"Error: out of memory ({first}); use a smaller --batch-size"


def test_cli_other_runtime_errors_keep_their_traceback(ckpt, monkeypatch):
    import torch.nn.functional as F

    def linear(*args, **kwargs):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(F, "linear", linear)
    r = _run(["--ckpt", ckpt, "the fox"])
    assert isinstance(r.exception, RuntimeError) and "shapes cannot be multiplied" in str(r.exception)


@pytest.mark.parametrize("text,message", [
    ('{"prompt": "a"}\n \n\n\n{"prompt": "b\\ud800"}\n', "line 5: prompt is not valid UTF-8 (lone surrogate U+D800"),
    ('{"prompt": "a"}\n\n{"prompt": "  "}\n', "line 3: empty prompt"),
    ('{"prompt": "a"}\n\n\n{"text": "b"}\n', 'line 4 needs a string "prompt" field'),
    ('{"prompt": "a"}\n\n{"prompt": "b"\n', "line 3 is not valid JSON"),
], ids=["surrogate", "jsonl-empty", "jsonl-field", "jsonl-syntax"])
def test_cli_prompts_file_errors_name_the_file_line(ckpt, tmp_path, text, message):
    f = tmp_path / "prompts.txt"
    f.write_text(text, encoding="utf-8")
    r = _run(["--ckpt", ckpt, "--prompts-file", str(f)])
    assert r.exit_code == 2 and r.stdout == "", r.output  # nothing generated for the earlier lines either
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"Error: {f}") and message in err[0], r.stderr


def test_cli_prompts_file_that_is_not_utf8_is_one_line_exit_2(ckpt, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_bytes("a river\n\nthe café\n".encode("latin-1"))
    r = _run(["--ckpt", ckpt, "--prompts-file", str(f)])
    assert r.exit_code == 2 and r.stdout == "", r.output
    err = r.stderr.strip().splitlines()
    assert err == [f"Error: cannot read {f}: not valid UTF-8 (byte 0xe9 at offset 16, line 3); text files must be "
                   "UTF-8"], r.stderr


def test_cli_stdin_that_is_not_utf8_is_one_line_exit_2(ckpt):
    r = _run(["--ckpt", ckpt], input=b"caf\xe9\n")  # the test runner's stdin decodes strictly
    assert r.exit_code == 2, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("Error: the prompt on stdin is not valid UTF-8"), r.stderr


@pytest.mark.parametrize("jsonl", [False, True])
def test_cli_prompts_file_with_a_byte_order_mark(ckpt, tmp_path, jsonl):
    prompts = ["the fox", "dawn"]
    f = tmp_path / "p.txt"
    lines = [json.dumps({"prompt": p}) if jsonl else p for p in prompts]
    f.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())  # as Windows editors save UTF-8
    r = _run(["--ckpt", ckpt, "--prompts-file", str(f), "--max-new-tokens", "1"])
    assert r.exit_code == 0, r.output
    assert [json.loads(line)["prompt"] for line in r.stdout.splitlines()] == prompts


def _generate_from_stdin(ckpt, stdin) -> list[str]:
    out = []
    run_generate(None, ckpt, SamplingParams(max_new_tokens=1), None, True, None, 1, out.append, stdin=stdin)
    return out


def test_stdin_prompt_drops_its_line_end(ckpt):
    # Untranslated, as a pipe delivers them (the test runner's stdin would turn CRLF into LF).
    for text in ("the fox\n", "the fox\r\n", "the fox"):
        (row,) = _generate_from_stdin(ckpt, io.StringIO(text, newline=""))
        assert json.loads(row)["prompt"] == "the fox", text
    (row,) = _generate_from_stdin(ckpt, io.StringIO("the fox\r", newline=""))  # no line end: all of it is prompt
    assert json.loads(row)["prompt"] == "the fox\r"


def test_stdin_prompt_drops_a_byte_order_mark(ckpt):
    """A file saved by a Windows editor, piped in: its mark is not text, and a file of nothing else is empty."""
    (row,) = _generate_from_stdin(ckpt, io.StringIO("\ufeffthe fox\r\n", newline=""))
    assert json.loads(row)["prompt"] == "the fox"
    (row,) = _generate_from_stdin(ckpt, io.StringIO("the \ufefffox", newline=""))  # only a leading one
    assert json.loads(row)["prompt"] == "the \ufefffox"
    with pytest.raises(SwitchheadError, match="empty"):
        _generate_from_stdin(ckpt, io.StringIO("\ufeff\n", newline=""))


def test_closed_stdin_is_an_error(ckpt, monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)  # what Python gives a process started with fd 0 closed
    with pytest.raises(SwitchheadError, match="no PROMPT, no --prompts-file and no stdin"):
        _generate_from_stdin(ckpt, None)


# --- the library API with bad arguments ---------------------------------------------------------------------

def test_library_calls_with_bad_arguments_are_one_clear_error(model, sp, gen, ckpt):
    from tiny import word_tokenizer

    from switchhead.runtime import feed

    V = model.config.vocab_size
    params = SamplingParams(temperature=0, max_new_tokens=3)
    other = word_tokenizer(WORDS, vocab_size=sp.get_piece_size() + 7)
    cases = [
        (lambda: Generator(TorchBackend(model), other), "pieces but the model's vocab_size"),
        (lambda: Generator(model, sp), "Generator needs a Backend"),
        (lambda: Generator(TorchBackend(model), None), "needs the model's SentencePiece tokenizer"),
        (lambda: Generator(TorchBackend(model), "tokenizer.model"),
         "the tokenizer must be a sentencepiece.SentencePieceProcessor (e.g. what load returns), got str"),
        (lambda: gen.generate([None], params), "a prompt must be a string, got NoneType"),
        (lambda: gen.generate(["the fox"], None), "params must be SamplingParams"),
        (lambda: gen.generate(None, params), "prompts must be a string or a list of strings, got NoneType"),
        (lambda: gen.generate(b"the fox", params), "prompts must be a string or a list of strings, got bytes"),
        (lambda: TransformerLM("tiny-switchhead"), "TransformerLM needs a ModelConfig"),
        (lambda: switchhead.save(ckpt + "-other", None), "save needs a TransformerLM, got NoneType"),
        (lambda: gen.generate_ids([[V]], params), f"token id {V} is outside the vocabulary"),
        (lambda: gen.generate_ids([[3, -1]], params), "token id -1 is outside"),
        (lambda: gen.generate_ids([[3, 2.0]], params), "token id 2.0 is outside"),
        (lambda: TorchBackend(model).logits(torch.tensor([[1, V]])), f"token id {V} is outside"),
        (lambda: TorchBackend(model).logits(torch.tensor([[1.0]])), "token ids must be an integer tensor"),
        (lambda: model([[1, 2]]), "input_ids must be a tensor [batch, tokens], got list"),
        (lambda: switchhead.load(5), "a checkpoint path must be a str or Path, got int"),
        (lambda: TorchBackend(model).logits(torch.tensor([[1]]), TorchBackend(model).new_cache(1)),
         "state must be what this backend's logits returned, got XLCache"),
        (lambda: Backend.logits(TorchBackend(model), torch.tensor([[1]]), (None, None)),
         "state must be what this backend's logits returned, got tuple"),
        (lambda: feed(TorchBackend(model), TorchBackend(model).new_cache(1), [[-1]]), "token id -1"),
        (lambda: SamplingParams(stop=[1]), "stop strings must be strings"),
        (lambda: SamplingParams(stop=5), "stop must be a string or a list of strings"),
        (lambda: switchhead.save(ckpt + "-other", model, other), "pieces but the model's vocab_size"),
        (lambda: switchhead.load(""), "the checkpoint path is empty"),
        (lambda: switchhead.load(ckpt, device="meta"), "device 'meta' cannot run a model"),
        (lambda: switchhead.load(ckpt, dtype="float16"), "dtype must be a floating-point torch.dtype"),
        (lambda: switchhead.load(ckpt, dtype=torch.int64), "dtype must be a floating-point torch.dtype"),
        (lambda: TorchBackend("tiny-switchhead"), "TorchBackend needs a TransformerLM"),
        (lambda: Generator(TorchBackend(model), sp, prefill_step="4"), "prefill_step must be an integer >= 1"),
        (lambda: Generator(TorchBackend(model), sp, prefill_step=0), "prefill_step must be an integer >= 1"),
        (lambda: gen.generate(["the fox"], params, seeds=1), "seeds must be a list of integers, one per prompt"),
        (lambda: gen.generate_ids(torch.tensor([3, 4]), params), "encoded must be rows of token ids"),
        (lambda: gen.generate_ids(5, params), "encoded must be rows of token ids"),
        (lambda: gen.generate_ids(["the fox"], params), "each row of encoded must be a list of token ids, got "
                                                        "'the fox' (text goes to generate)"),
        (lambda: gen.generate_ids([3, 4], params), "each row of encoded must be a list of token ids, got 3"),
        (lambda: TorchBackend(model).new_cache("2"), "cache batch size must be an integer >= 1, got '2'"),
        (lambda: TorchBackend(model).new_cache(True), "cache batch size must be an integer >= 1"),
        (lambda: XLCache(model.config, 1, dtype="float32"), "cache dtype must be"),
        (lambda: XLCache("tiny-switchhead", 1), "XLCache needs the model's ModelConfig"),
        (lambda: Detokenizer(sp).push(V), f"token id {V} is outside the vocabulary [0, {V})"),
        (lambda: Detokenizer(sp).push("a"), "token id 'a' is outside the vocabulary"),
        (lambda: Detokenizer(sp).push(-1), "token id -1 is outside the vocabulary"),
    ]
    for call, message in cases:
        with pytest.raises(SwitchheadError, match=re.escape(message)):
            call()
    assert not Path(ckpt + "-other").exists()


def test_one_string_is_one_prompt_or_one_stop(gen):
    params = SamplingParams(temperature=0, max_new_tokens=6)
    (one,), (listed,) = gen.generate("the fox", params), gen.generate(["the fox"], params)
    assert (one.prompt, one.tokens) == (listed.prompt, listed.tokens)
    assert SamplingParams(stop="\n\n").stop == ("\n\n",) and SamplingParams(stop=None).stop == ()


@pytest.mark.parametrize("flag,message", [("--ckpt", "--ckpt needs a path, got an empty one"),
                                          ("--onnx", "--onnx needs a path, got an empty one"),
                                          ("--prompts-file", "--prompts-file needs a path")])
def test_cli_empty_model_path_is_not_the_builtin_model(flag, message):
    r = _run([flag, "", "hi"])
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert r.stderr.startswith(f"Error: {message}") and r.stderr.count("\n") == 1, r.stderr


def test_run_generate_refuses_bad_arguments_before_loading_the_model(tmp_path):
    """Each is refused before the model is read: the checkpoint does not even exist (else its error would come)."""
    missing, p = str(tmp_path / "nothing"), SamplingParams(max_new_tokens=1)
    cases = [
        (dict(batch_size=1.5), "batch-size must be an integer >= 1, got 1.5"),  # failed after loading
        (dict(batch_size=0), "batch-size must be an integer >= 1, got 0"),
        (dict(as_json="no"), "as_json must be True or False, got 'no'"),
        (dict(params={"temperature": 0}), "params must be SamplingParams, got dict"),
        (dict(prompt=["a", "b"]), "the prompt must be a str (several go in a prompts file), got list"),
        (dict(write=None), "write must be a function taking text, got NoneType"),
    ]
    for change, message in cases:
        args = dict(prompt="hi", ckpt=missing, params=p, prompts_file=None, as_json=False, device=None,
                    batch_size=1, write=print)
        args.update(change)
        with pytest.raises(SwitchheadError, match=re.escape(message)):
            run_generate(**args)
    with pytest.raises(SwitchheadError, match="--prompts-file must be a str or Path, got int"):
        read_prompts_file(5)


def test_load_generator_applies_threads_to_a_checkpoint(ckpt):
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        load_generator(ckpt, threads=want)  # was accepted and ignored for a PyTorch model
        assert torch.get_num_threads() == want
        for bad in (0, 2.0, "2"):
            with pytest.raises(SwitchheadError, match="threads must be an integer between 1 and"):
                load_generator(ckpt, threads=bad)
    finally:
        torch.set_num_threads(before)
