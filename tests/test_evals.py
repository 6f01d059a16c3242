"""switchhead.evals: lm-eval results cross-checked against direct computations with the model's forward.

Everything is synthetic and built here: a SentencePiece model trained on generated text, a tiny SwitchHead
model (chunk_len 16) with one word favoured so that greedy checks are not all failures, and data files in the
original formats written into a temporary directory.
"""

from __future__ import annotations

import io
import json
import math
import random
import re

import pytest
import sentencepiece as spm
import torch
from click.testing import CliRunner

from switchhead.cli import main
from switchhead.errors import SwitchheadError
from switchhead.evals import data
from switchhead.evals.run import evaluate
from switchhead.model import PRESETS, TransformerLM, save

NAMES = ["mary", "john", "alice", "tom", "lucy", "peter"]
NOUNS = ["dog", "cat", "bird", "ball", "house", "tree", "garden", "river", "book", "apple"]
VERBS = ["saw", "found", "liked", "chased", "painted", "carried"]
FAVOURITE = "mary"
IDIOMS = ["once upon a time", "the sun rises in the east", "the end of the story", "as quick as a fox"]


def sentence(rng: random.Random) -> str:
    if rng.random() < 0.3:
        return rng.choice(IDIOMS) + " ."
    return f"{rng.choice(NAMES)} {rng.choice(VERBS)} the {rng.choice(NOUNS)} ."


def passage(rng: random.Random, n: int) -> str:
    return " ".join(sentence(rng) for _ in range(n))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(checkpoint dir, data dir, model, tokenizer)."""
    # Two intra-op threads on two shared, busy cores make tiny forwards ~50x slower (measured: 1 s vs 20 ms).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("evals")
    rng = random.Random(0)
    corpus = [passage(rng, rng.randint(1, 6)) for _ in range(3000)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=buf, vocab_size=340, model_type="bpe", byte_fallback=True,
        unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, character_coverage=1.0, hard_vocab_limit=False,
        normalization_rule_name="identity", num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())

    torch.manual_seed(0)
    model = TransformerLM(PRESETS["tiny-switchhead"].replace(vocab_size=sp.get_piece_size()))
    # A random model almost never predicts a passage's last word; favouring one word-piece makes the greedy
    # check succeed for the passages that end in that word and fail for the others (training would do the
    # same but costs minutes on a loaded 2-core machine).
    (favourite,) = sp.encode(FAVOURITE)
    with torch.no_grad():
        model.out.bias[favourite] += 12.0
    model.eval()
    ckpt = save(root / "ckpt", model, sp)

    d = root / "data"
    (d / "lambada").mkdir(parents=True)
    with open(d / data.LAMBADA_FILE, "w") as f:
        for i in range(24):
            text = passage(rng, 1 + i % 5)  # mostly longer than one 16-token chunk
            if i % 2:
                text += " " + FAVOURITE
            f.write(json.dumps({"text": text}) + "\n")
    (d / "blimp").mkdir()
    for j, p in enumerate(data.BLIMP_PARADIGMS):
        with open(d / data.blimp_file(p), "w") as f:
            for _ in range(2 + j % 4):  # unequal sizes: the group mean must be unweighted
                good = sentence(rng)
                words = good.split()
                bad = " ".join(words[1:2] + words[:1] + words[2:]) if rng.random() < 0.5 else " ".join(words[::-1])
                f.write(json.dumps({"sentence_good": good, "sentence_bad": bad, "UID": p}) + "\n")
    (d / "cbt").mkdir()
    for k, subset in enumerate(data.CBT_SETS):
        (d / data.cbt_file(subset)).write_text(cbt_file_text(random.Random(k), 3))
    yield ckpt, d, model, sp
    torch.set_num_threads(threads)


def cbt_file_text(rng: random.Random, n: int) -> str:
    blocks = []
    for _ in range(n):
        lines = [f"{i} {sentence(rng)}" for i in range(1, 21)]
        answer = rng.choice(NOUNS)
        options = sorted(set(rng.sample(NOUNS, 9)) - {answer})[:9] + [answer]
        while len(options) < 10:
            options.append(rng.choice(NAMES))
        question = f"{rng.choice(NAMES)} {rng.choice(VERBS)} the XXXXX near the river ."
        lines.append(f"21 {question}\t{answer}\t\t{'|'.join(sorted(options))}")
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks) + "\n"


# --- direct computations (model forward only) ---------------------------------------------------------------

@torch.inference_mode()
def token_logprobs(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(ids[t+1] | ids[:t+1]) and whether ids[t+1] is the argmax, for every t, from one forward call over
    the whole sequence (the model chunks it with XL memory itself)."""
    logits, _ = model(torch.tensor([ids[:-1]]))
    lp = torch.log_softmax(logits[0].double(), -1)
    tgt = torch.tensor(ids[1:])
    return lp.gather(1, tgt[:, None])[:, 0], logits[0].argmax(-1) == tgt


def direct_pair(model, sp, context: str, continuation: str) -> tuple[float, bool, int]:
    """Sum log-prob, greedy flag and length of the continuation after EOS + context (split where the
    text splits: the continuation starts with its space)."""
    eos = sp.eos_id()
    if context:
        ctx = sp.encode(context)
        whole = sp.encode(context + continuation)
        assert whole[:len(ctx)] == ctx
        ids, n = [eos] + whole, len(whole) - len(ctx)
    else:  # at a document start the dummy prefix is the space
        ids = [eos] + sp.encode(continuation.removeprefix(" "))
        n = len(ids) - 1
    lp, hit = token_logprobs(model, ids)
    return float(lp[-n:].sum()), bool(hit[-n:].all()), n


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


# --- the full lm-eval run, through lm-eval's own entry point and the registered model name ------------------

@pytest.fixture(scope="module")
def results(env):
    ckpt, d, _, _ = env
    import lm_eval

    import switchhead.evals
    from switchhead.evals.data import use_local_data

    use_local_data()
    res = lm_eval.simple_evaluate(
        model="switchhead", model_args=f"ckpt={ckpt},progress=False", batch_size=5,
        tasks=["switchhead_lambada", "switchhead_blimp", "switchhead_cbt"],
        task_manager=switchhead.evals.task_manager(d), bootstrap_iters=0)
    return res["results"]


def test_lambada_matches_direct_greedy_check(env, results):
    _, d, model, sp = env
    accs, lls = [], []
    for doc in read_jsonl(d / data.LAMBADA_FILE):
        ctx, last = doc["text"].rsplit(" ", 1)
        ll, hit, _ = direct_pair(model, sp, ctx, " " + last)
        accs.append(hit)
        lls.append(ll)
    r = results["switchhead_lambada"]
    assert 0 < sum(accs) < len(accs), "the test model should get some but not all passages right"
    assert r["acc,none"] == pytest.approx(sum(accs) / len(accs), abs=1e-12)
    assert r["perplexity,none"] == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-4)


def test_blimp_matches_direct_pairwise_comparison(env, results):
    _, d, model, sp = env
    per_paradigm = {}
    for p in data.BLIMP_PARADIGMS:
        rows = read_jsonl(d / data.blimp_file(p))
        correct = [direct_pair(model, sp, "", " " + r["sentence_good"])[0]
                   > direct_pair(model, sp, "", " " + r["sentence_bad"])[0] for r in rows]
        per_paradigm[p] = sum(correct) / len(correct)
        assert results[f"switchhead_blimp_{p}"]["acc,none"] == pytest.approx(per_paradigm[p], abs=1e-12), p
    values = list(per_paradigm.values())
    assert len(set(values)) > 1
    mean = sum(values) / len(values)
    assert results["switchhead_blimp"]["acc,none"] == pytest.approx(mean, abs=1e-9)


@pytest.mark.parametrize("lanes", [1, 3])
def test_text_perplexity_matches_a_naive_loop_per_lane(env, tmp_path, lanes):
    import copy

    import naive
    import numpy as np

    from switchhead.evals.text import text_perplexity
    from switchhead.runtime import TorchBackend

    _, _, model, sp = env
    text = " ".join(passage(random.Random(5), 4) for _ in range(5))
    path = tmp_path / "held.txt"
    path.write_text(text)
    m64 = copy.deepcopy(model).double()
    (row,) = text_perplexity(TorchBackend(m64), sp, [path], lanes, progress=False)
    # The file is one document followed by EOS. Its tokens but the first are cut into `lanes` contiguous lanes of
    # targets, each lane starting from the token before its first target, and scored over chunks with memory by
    # the float64 loop.
    stream = np.array(sp.encode(text) + [sp.eos_id()])
    lane_len, nll = -(-(len(stream) - 1) // lanes), 0.0
    assert lane_len > 3 * m64.config.chunk_len  # several chunks per lane
    for b in range(lanes):
        ids = torch.from_numpy(stream[b * lane_len:(b + 1) * lane_len + 1])
        logp = naive.lm_forward(m64, ids).log_softmax(-1)
        nll -= float(logp[:-1].gather(1, ids[1:, None]).sum())
    count = len(stream) - 1  # every token but the first: bits per byte cover the whole file
    assert (row["tokens"], row["lanes"]) == (count, lanes)
    assert row["loss"] == pytest.approx(nll / count, rel=1e-10)
    assert row["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-10)
    assert row["bits_per_byte"] == pytest.approx(nll / math.log(2) / len(text.encode()), rel=1e-10)


def test_text_perplexity_of_a_short_file_scores_every_token(env, tmp_path):
    """More lanes than the file has chunks: one lane per chunk, and no token but the first goes unscored
    (so bits per byte, over the whole file's size, are not flattered by tokens left out)."""
    from switchhead.evals.text import text_perplexity
    from switchhead.runtime import TorchBackend

    _, _, model, sp = env
    path = tmp_path / "short.txt"
    path.write_text(passage(random.Random(7), 4))
    n = len(sp.encode(path.read_text())) + 1
    chunk_len = model.config.chunk_len
    assert n > 2 * chunk_len
    (row,) = text_perplexity(TorchBackend(model), sp, [path], 64, progress=False)
    assert row["tokens"] == n - 1 and row["lanes"] == -(-(n - 1) // chunk_len)


def test_cli_text_perplexity_same_for_checkpoint_and_onnx_export(env, tmp_path):
    from switchhead.export import export

    ckpt, _, _, _ = env
    path = tmp_path / "held.txt"
    path.write_text("\n".join(passage(random.Random(6), 3) for _ in range(4)))
    onnx = export(str(ckpt), tmp_path / "onnx").out
    rows = {}
    for flag, where in (("--ckpt", ckpt), ("--onnx", onnx)):
        out = tmp_path / f"{flag[2:]}.json"
        r = run_cli("--text", str(path), flag, str(where), "--batch-size", "2", "--output", str(out), "--no-progress")
        assert r.exit_code == 0, r.output
        assert re.search(r"text held.txt\s+perplexity\s+\d", r.output), r.output
        results = json.loads(out.read_text())
        (rows[flag],) = results["text"]
        # The file says what was evaluated, and how.
        assert results["config"]["model_args"] == f"{flag[2:]}={where}" and results["config"]["batch_size"] == 2
        assert results["switchhead"][flag[2:]] == str(where) and results["switchhead"]["unwrap"] is False
        assert results["switchhead"]["device"] == "cpu"  # where it ran, though no --device was given
        providers = results["switchhead"]["providers"]
        assert providers is None if flag == "--ckpt" else providers[-1] == "CPUExecutionProvider"
    assert rows["--ckpt"]["tokens"] == rows["--onnx"]["tokens"] and rows["--ckpt"]["lanes"] == 2
    assert rows["--onnx"]["loss"] == pytest.approx(rows["--ckpt"]["loss"], rel=1e-5)
    # The text-only results file is an earlier results file: a later run may replace it.
    r = run_cli("--text", str(path), "--ckpt", str(ckpt), "--output", str(tmp_path / "ckpt.json"), "--no-progress")
    assert r.exit_code == 0 and json.loads((tmp_path / "ckpt.json").read_text())["text"][0]["lanes"] > 2


def test_cli_text_errors(env, tmp_path):
    ckpt, _, _, _ = env
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    for args, message in [
        ((), "give --tasks (lambada, blimp, cbt) and/or --text FILE"),
        (("--text", str(tmp_path / "nope.txt")), "text file not found"),
        (("--text", str(tmp_path / "empty.txt")), "text file is empty"),
        (("--text", str(tmp_path / "latin1.txt")), "not valid UTF-8"),
        (("--text", str(tmp_path / "empty.txt"), "--batch-size", "0"), "batch size"),
        (("--text", str(tmp_path / "empty.txt"), "--limit", "5"), "--limit applies to --tasks, and no task was"),
        (("--text", str(tmp_path / "empty.txt"), "--data-dir", str(tmp_path)), "--data-dir applies to --tasks, and no"),
        (("--tasks", "lambada", "--unwrap"), "--unwrap applies to --text files, and none was given"),
    ]:
        r = run_cli(*args, "--ckpt", str(ckpt))
        assert r.exit_code == 2 and message in r.output, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1 and r.output.startswith("Error:"), r.output


def test_cbt_parser(env):
    _, d, _, _ = env
    examples = data.parse_cbt(d / data.cbt_file("CN"))
    assert len(examples) == 3
    ex = examples[0]
    assert len(ex["sentences"]) == 20 and len(ex["options"]) == 10 and ex["answer"] in ex["options"]
    assert not ex["sentences"][0][0].isdigit(), "line numbers are dropped"
    assert "XXXXX" in ex["question"]


def test_cbt_parser_reads_the_original_format(tmp_path):
    line21 = ("21 Do you think she will see that young XXXXX sitting under the tree ? '\tman\t\t"
              "birds|food|maiden|man|middle|place|sight|south|wash|wings")
    text = "\n".join([f"{i} Line {i} ." for i in range(1, 21)] + [line21]) + "\n\n"
    path = tmp_path / "cbt.txt"
    path.write_text(text * 2)
    examples = data.parse_cbt(path)
    assert len(examples) == 2
    assert examples[0]["sentences"][19] == "Line 20 ."
    assert examples[0]["answer"] == "man" and examples[0]["options"][3] == "man"
    from switchhead.evals import prompts

    assert prompts.cbt_context(examples[0]).endswith("Line 20 . Do you think she will see that young")
    assert prompts.cbt_choices(examples[0])[3] == "man sitting under the tree ? '"
    path.write_text(text.replace("\tman\t\t", "\tboy\t\t"))
    with pytest.raises(SwitchheadError, match="candidates"):
        data.parse_cbt(path)


def test_cbt_scoring_matches_direct_computation(env, results):
    _, d, model, sp = env
    means = {"acc_per_token": [], "acc": []}
    for subset in data.CBT_SETS:
        tok_hits, raw_hits = [], []
        for ex in data.parse_cbt(d / data.cbt_file(subset)):
            before, after = ex["question"].split("XXXXX")
            context = " ".join(ex["sentences"]) + " " + before.rstrip()
            scores = [direct_pair(model, sp, context, " " + c + after) for c in ex["options"]]
            gold = ex["options"].index(ex["answer"])
            per_token = [ll / n for ll, _, n in scores]
            tok_hits.append(max(range(10), key=per_token.__getitem__) == gold)
            raw_hits.append(max(range(10), key=lambda i: scores[i][0]) == gold)
        r = results[f"switchhead_cbt_{subset}"]
        assert r["acc_per_token,none"] == pytest.approx(sum(tok_hits) / len(tok_hits), abs=1e-12)
        assert r["acc,none"] == pytest.approx(sum(raw_hits) / len(raw_hits), abs=1e-12)
        means["acc_per_token"].append(sum(tok_hits) / len(tok_hits))
        means["acc"].append(sum(raw_hits) / len(raw_hits))
    for metric, values in means.items():
        assert results["switchhead_cbt"][f"{metric},none"] == pytest.approx(sum(values) / 4, abs=1e-9)


# --- the model class directly -------------------------------------------------------------------------------

class Req:
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def lm(env):
    from switchhead.evals import SwitchheadLM

    _, _, model, sp = env
    return SwitchheadLM(model=model, tokenizer=sp, batch_size=3, progress=False)


def test_long_context_loglikelihood_equals_chunked_forward(env, lm):
    _, _, model, sp = env
    rng = random.Random(5)
    reqs = [(passage(rng, n), " " + sentence(rng)) for n in (12, 1, 7, 3, 20)]
    assert len(sp.encode(reqs[0][0])) > 4 * model.config.chunk_len
    got = lm.loglikelihood([Req(c, x) for c, x in reqs])
    for (ctx, cont), (ll, greedy) in zip(reqs, got):
        want, want_greedy, _ = direct_pair(model, sp, ctx, cont)
        assert ll == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy
    # a manual chunk loop that carries the memory: the definition of "XL memory, never truncated"
    ids = [sp.eos_id()] + sp.encode(reqs[0][0] + reqs[0][1])
    n = len(ids) - 1 - len(sp.encode(reqs[0][0]))
    T, memory, parts = model.config.chunk_len, None, []
    with torch.inference_mode():
        for s in range(0, len(ids) - 1, T):
            logits, memory = model(torch.tensor([ids[s:min(s + T, len(ids) - 1)]]), memory)
            parts.append(logits[0])
    lp = torch.log_softmax(torch.cat(parts).double(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert got[0][0] == pytest.approx(float(lp[-n:].sum()), abs=1e-4)


def test_scores_do_not_depend_on_batching_order_or_window(env, lm, monkeypatch):
    """Token sequences ending just before, at and after chunk boundaries (T = 16), continuations of one token
    and empty ones: each score equals the forward's own log-softmax sum whatever the batch size, the order of the
    requests and the window a forward call covers (down to one chunk)."""
    import switchhead.evals.lm as eval_lm
    from switchhead.evals import SwitchheadLM

    _, _, model, sp = env
    T, g = model.config.chunk_len, torch.Generator().manual_seed(11)
    seqs = []
    for n, n_ctx in [(2, 1), (T, 1), (T, T - 1), (T + 1, T), (T + 1, T + 1), (2 * T, 5), (2 * T + 1, 2 * T),
                     (3 * T + 2, T), (4 * T, 4 * T - 1)]:
        seqs.append(([sp.eos_id()] + torch.randint(2, sp.get_piece_size(), (n - 1,), generator=g).tolist(), n_ctx))
    want = []
    for ids, n_ctx in seqs:
        if len(ids) <= n_ctx:
            want.append((0.0, True))
            continue
        lp, hit = token_logprobs(model, ids)
        want.append((float(lp[n_ctx - 1:].sum()), bool(hit[n_ctx - 1:].all())))
    for budget in (eval_lm._LOGITS_BUDGET, 1):
        monkeypatch.setattr(eval_lm, "_LOGITS_BUDGET", budget)
        for batch_size in (1, 4, 64):
            scorer = SwitchheadLM(model=model, tokenizer=sp, batch_size=batch_size, progress=False)
            order = list(range(len(seqs)))
            random.Random(batch_size).shuffle(order)
            got = dict(zip(order, scorer.score([seqs[i] for i in order])))
            for i, (ll, greedy) in enumerate(want):
                assert got[i][0] == pytest.approx(ll, abs=1e-4), (budget, batch_size, seqs[i][1])
                assert got[i][1] == greedy, (budget, batch_size, seqs[i][1])


def test_empty_context_and_rolling(env, lm):
    _, _, model, sp = env
    text = passage(random.Random(9), 8)
    (ll, _), = lm.loglikelihood([Req("", " " + text)])
    lp, _ = token_logprobs(model, [sp.eos_id()] + sp.encode(text))
    assert ll == pytest.approx(float(lp.sum()), abs=1e-4)
    rolling = lm.loglikelihood_rolling([Req(text), Req("tom saw the dog .")])
    assert isinstance(rolling[0], float)
    assert rolling[0] == pytest.approx(float(lp.sum()), abs=1e-4)


def test_generate_until_equals_full_recompute(env, lm):
    _, _, model, sp = env
    context = passage(random.Random(3), 2) + " once upon"
    out, = lm.generate_until([Req(context, {"until": ["\n"], "max_gen_toks": 40})])
    ids = [sp.eos_id()] + sp.encode(context)
    n_ctx = len(ids)
    with torch.inference_mode():
        for _ in range(40):
            nxt = int(model(torch.tensor([ids]))[0][0, -1].argmax())
            if nxt == sp.eos_id():
                break
            ids.append(nxt)
    want = sp.decode(ids[1:])[len(sp.decode(ids[1:n_ctx])):]
    assert out == want
    assert len(sp.encode(context)) + 1 < 2 * model.config.chunk_len < len(ids), "crosses chunk boundaries"
    stop = want.split()[1]
    out2, = lm.generate_until([Req(context, {"until": [stop], "max_gen_toks": 40})])
    assert out2 == want[:want.index(stop)]


def test_generate_until_from_an_empty_context_starts_a_document(env, lm):
    _, _, model, sp = env
    ids = [sp.eos_id()]
    with torch.inference_mode():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
            if ids[-1] == sp.eos_id():
                ids.pop()
                break
    out, = lm.generate_until([Req("", {"until": [], "max_gen_toks": 12})])
    assert out == sp.decode(ids[1:])


def test_model_argument_must_be_a_model_or_backend(env):
    from switchhead.evals import SwitchheadLM
    from switchhead.runtime import TorchBackend

    _, _, model, sp = env
    with pytest.raises(SwitchheadError, match="TransformerLM or a runtime Backend"):
        SwitchheadLM(model=object(), tokenizer=sp)
    assert SwitchheadLM(model=TorchBackend(model), tokenizer=sp, progress=False).backend.model is model


def one_line_error(message: str, fn, *args, **kwargs) -> None:
    with pytest.raises(SwitchheadError, match=re.escape(message)) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"tokenizer": "tokenizer.model"}, "the tokenizer (tokenizer=) must be a sentencepiece.SentencePieceProcessor"),
    ({"batch_size": 2.7}, "the batch size (batch_size) must be a positive integer or 'auto', got 2.7"),
    ({"batch_size": True}, "the batch size (batch_size) must be a positive integer or 'auto', got True"),
    ({"batch_size": [4]}, "the batch size (batch_size) must be a positive integer or 'auto', got [4]"),
    ({"batch_size": "four"}, "the batch size (batch_size) must be a positive integer or 'auto', got 'four'"),
    ({"batch_size": 0}, "the batch size (batch_size) must be a positive integer or 'auto', got 0"),
    ({"max_gen_toks": "abc"}, "max_gen_toks must be an integer >= 1 (tokens to generate), got 'abc'"),
    ({"max_gen_toks": None}, "max_gen_toks must be an integer >= 1 (tokens to generate), got None"),
    ({"max_gen_toks": 0}, "max_gen_toks must be an integer >= 1 (tokens to generate), got 0"),
    ({"max_gen_toks": -5}, "max_gen_toks must be an integer >= 1 (tokens to generate), got -5"),
    ({"progress": "off"}, "progress must be True or False, got 'off'"),
    ({"threads": "2"}, "threads must be an integer between 1 and"),
    ({"threads": 0}, "threads must be an integer between 1 and"),
])
def test_lm_bad_arguments(env, kwargs, message):
    from switchhead.evals import SwitchheadLM

    _, _, model, sp = env
    one_line_error(message, SwitchheadLM, **{"model": model, "tokenizer": sp, **kwargs})


def test_lm_batch_size_as_lm_eval_passes_it(env):
    # lm-eval's --batch_size reaches the model as typed: digits or auto[:N].
    from switchhead.evals import SwitchheadLM
    from switchhead.evals.lm import DEFAULT_BATCH_SIZE

    _, _, model, sp = env
    for given, want in (("8", 8), (" 3 ", 3), ("auto", DEFAULT_BATCH_SIZE), ("auto:4", DEFAULT_BATCH_SIZE),
                        (None, DEFAULT_BATCH_SIZE), (5, 5)):
        assert SwitchheadLM(model=model, tokenizer=sp, batch_size=given, progress=False).batch_size == want


def test_evaluate_refuses_a_tokenizer_that_is_not_one(env, tmp_path):
    _, _, model, _ = env
    path = tmp_path / "held.txt"
    path.write_text(passage(random.Random(1), 2))
    one_line_error("the tokenizer (tokenizer=) must be a sentencepiece.SentencePieceProcessor", evaluate, None,
                   texts=[path], model=model, tokenizer=str(path), progress=False)


def test_model_without_a_device_stays_where_it_is(sp, monkeypatch):
    """Module.to moves the caller's model in place: a model on a GPU would silently end up on the CPU."""
    from switchhead.evals import SwitchheadLM

    config = PRESETS["tiny-switchhead"].replace(vocab_size=sp.get_piece_size())
    with torch.device("meta"):  # stands for a model on another device, e.g. a GPU: .to("cpu") would fail on it
        meta = TransformerLM(config)
    lm = SwitchheadLM(model=meta, tokenizer=sp, progress=False)
    assert lm.backend.model is meta and lm.backend.device.type == "meta"

    model, moved = TransformerLM(config), []
    monkeypatch.setattr(model, "to", lambda *args, **kwargs: moved.append(args) or model, raising=False)
    SwitchheadLM(model=model, tokenizer=sp, progress=False)
    assert moved == []
    SwitchheadLM(model=model, tokenizer=sp, device="cpu", progress=False)  # an explicit device is honoured
    assert moved == [("cpu",)]


@pytest.mark.parametrize("method, request_args, message", [
    ("loglikelihood", ("a", None), "loglikelihood: request 0's continuation must be a string, got NoneType"),
    ("loglikelihood", ("a", 3), "loglikelihood: request 0's continuation must be a string, got int"),
    ("loglikelihood", (b"a", "b"), "loglikelihood: request 0's context must be a string, got bytes"),
    ("loglikelihood", ("a",), "loglikelihood: request 0 must have the arguments (context, continuation), got 1"),
    ("loglikelihood", ("a", "b", "c"), "loglikelihood: request 0 must have the arguments (context, continuation)"),
    ("loglikelihood", None, "loglikelihood: requests must be lm_eval Instance objects (with .args), request 0 is "
                            "a tuple"),
    ("loglikelihood_rolling", (3,), "loglikelihood_rolling: request 0's text must be a string, got int"),
    ("loglikelihood_rolling", ("a", "b"), "loglikelihood_rolling: request 0 must have the arguments (text), got 2"),
    ("generate_until", (None, {}), "generate_until: request 0's context must be a string, got NoneType"),
    ("generate_until", ("a", {"until": 5}), "generate_until: request 0's until must be a string or a list of "
                                            "strings, got 5"),
    ("generate_until", ("a", {"until": [None, "x"]}), "until must be a string or a list of strings, got [None, "),
    ("generate_until", ("a", ["x"]), "generate_until: request 0's generation kwargs must be a dict"),
    ("generate_until", ("a", "x"), "generate_until: request 0's generation kwargs must be a dict"),
    ("generate_until", ("a", {"max_gen_toks": 0}), "generate_until: request 0's max_gen_toks must be an integer "
                                                   ">= 1 (tokens to generate), got 0"),
    ("generate_until", ("a", {"max_gen_toks": "abc"}), "request 0's max_gen_toks must be an integer >= 1"),
    ("generate_until", ("a", {"max_gen_toks": 2.5}), "request 0's max_gen_toks must be an integer >= 1"),
    ("loglikelihood", ("the fox", " \ud800"), "loglikelihood: request 0's continuation is not valid UTF-8 (lone "
                                              "surrogate U+D800 at character 1)"),
    ("loglikelihood_rolling", ("a\udce9",), "loglikelihood_rolling: request 0's text is not valid UTF-8 (byte 0xE9"),
    ("generate_until", ("a\ud800", {"max_gen_toks": 2}), "generate_until: request 0's context is not valid UTF-8"),
])
def test_malformed_requests_are_clear_errors(lm, method, request_args, message):
    requests = [("tom saw", " the dog")] if request_args is None else [Req(*request_args)]
    one_line_error(message, getattr(lm, method), requests)


def test_generate_until_takes_one_stop_string_and_skips_empty_ones(lm):
    context = "mary saw the"
    (free,) = lm.generate_until([Req(context, {"until": [], "max_gen_toks": 6})])
    stop = free.split()[0]
    assert lm.generate_until([Req(context, {"until": stop, "max_gen_toks": 6}),
                              Req(context, {"until": ["", stop], "max_gen_toks": 6}),
                              Req(context, {"until": None, "max_gen_toks": 6})]) == [
        free[:free.index(stop)], free[:free.index(stop)], free]


@pytest.mark.parametrize("sequence, message", [
    (([1, 2, 999], 1), "score: sequence 0 has token id 999, outside the model's vocabulary (0 to "),
    (([1, -3, 2], 1), "score: sequence 0 has token id -3, outside the model's vocabulary (0 to "),
    (([1, 2, 3], 0), "score: sequence 0's n_context must be an integer >= 1 (a token to predict from), got 0"),
    (([1, 2, 3], 1.5), "score: sequence 0's n_context must be an integer >= 1"),
    (([1, 2, 3], True), "score: sequence 0's n_context must be an integer >= 1"),
    ((["a", "b"], 1), "score: sequence 0's tokens must be a list of integer token ids, got ['a', 'b']"),
    (([1.5, 2.0], 1), "score: sequence 0's tokens must be a list of integer token ids"),
    (("ab", 1), "score: sequence 0's tokens must be a list of integer token ids"),
    ([1, 2, 3], "score: sequence 0 must be a (token ids, n_context) pair, got [1, 2, 3]"),
])
def test_score_refuses_bad_sequences(lm, sequence, message):
    one_line_error(message.replace("sequence 0", "sequence 1"), lm.score, [([1, 2, 3], 1), sequence])


@pytest.mark.parametrize("change, message", [
    ({"backend": "MODEL"}, "backend must be a switchhead.runtime Backend (wrap a model in TorchBackend(model)), "
                           "got TransformerLM"),
    ({"tokenizer": "x"}, "tokenizer must be a sentencepiece.SentencePieceProcessor"),
    ({"tokenizer": None}, "tokenizer must be a sentencepiece.SentencePieceProcessor"),
    ({"lanes": 2.5}, "lanes must be an integer >= 1, got 2.5"),
    ({"lanes": "2"}, "lanes must be an integer >= 1, got '2'"),
    ({"lanes": 0}, "lanes must be an integer >= 1, got 0"),
    ({"lanes": -1}, "lanes must be an integer >= 1, got -1"),
    ({"paths": "HELD+3"}, "paths[1] must be a str or Path, got int"),
    ({"paths": 3}, "paths must be a file path (str or Path) or a list of them, got int"),
    ({"paths": "EMPTY"}, "empty.txt is empty: no tokens to score"),
])
def test_text_perplexity_bad_arguments(env, tmp_path, change, message):
    from switchhead.evals.text import text_perplexity
    from switchhead.runtime import TorchBackend

    _, _, model, sp = env
    held, empty = tmp_path / "held.txt", tmp_path / "empty.txt"
    held.write_text(passage(random.Random(2), 2))
    empty.write_text("")
    subst = {"MODEL": model, "HELD+3": [held, 3], "EMPTY": [empty]}
    args = {"backend": TorchBackend(model), "tokenizer": sp, "paths": [held], "lanes": 2}
    args |= {k: subst.get(v, v) if isinstance(v, str) else v for k, v in change.items()}
    one_line_error(message, text_perplexity, args["backend"], args["tokenizer"], args["paths"], args["lanes"],
                   progress=False)


@pytest.mark.parametrize("relative", [True, False])
def test_one_text_path_is_one_file(env, tmp_path, monkeypatch, relative):
    """A str or Path, not a sequence of one-character paths ("/" would be the whole file system)."""
    from switchhead.evals.text import text_perplexity
    from switchhead.runtime import TorchBackend

    _, _, model, sp = env
    monkeypatch.chdir(tmp_path)
    (tmp_path / "held.txt").write_text(passage(random.Random(3), 3))
    path = "held.txt" if relative else tmp_path / "held.txt"
    (row,) = text_perplexity(TorchBackend(model), sp, path, 2, progress=False)
    assert row == text_perplexity(TorchBackend(model), sp, [tmp_path / "held.txt"], 2, progress=False)[0] | {
        "file": str(path)}
    (got,) = evaluate(None, texts=path, model=model, tokenizer=sp, batch_size=2, progress=False)["text"]
    assert got["file"] == str(path) and got["tokens"] == row["tokens"]


# --- CLI ----------------------------------------------------------------------------------------------------

def run_cli(*args):
    return CliRunner().invoke(main, ["eval", *args])


def test_cli_runs_and_writes_results(env, tmp_path):
    ckpt, d, _, _ = env
    out = tmp_path / "r.json"
    r = run_cli("--tasks", "lambada", "--ckpt", str(ckpt), "--data-dir", str(d), "--limit", "3",
                "--output", str(out), "--no-progress")
    assert r.exit_code == 0, r.output
    assert "switchhead_lambada" in r.output and "perplexity" in r.output
    saved = json.loads(out.read_text())
    assert saved["results"]["switchhead_lambada"]["sample_len"] == 3
    r = run_cli("--tasks", "lambada", "--ckpt", str(ckpt), "--data-dir", str(d), "--limit", "2",
                "--output", str(out), "--no-progress")
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["results"]["switchhead_lambada"]["sample_len"] == 2, "an earlier run's file"


def test_limit_beyond_sys_maxsize_evaluates_all_the_data(env, tmp_path):
    ckpt, _, _, _ = env
    (tmp_path / "lambada").mkdir()
    (tmp_path / data.LAMBADA_FILE).write_text('{"text": "mary saw the dog"}\n{"text": "tom found the ball"}\n')
    r = run_cli("--tasks", "lambada", "--ckpt", str(ckpt), "--data-dir", str(tmp_path), "--limit", str(10**20),
                "--output", str(tmp_path / "r.json"), "--no-progress")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "r.json").read_text())["results"]["switchhead_lambada"]["sample_len"] == 2


def test_eval_prints_nothing_on_stderr_with_no_progress_outside_a_git_repository(env, tmp_path, monkeypatch, capfd):
    # lm-eval runs `git describe` in the current directory to record a commit (git complains outside a
    # repository) and draws a progress bar per task while building requests: neither may reach the terminal.
    ckpt, d, _, _ = env
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))

    evaluate("lambada,cbt", ckpt=str(ckpt), data_dir=d, limit=2, progress=False, output=tmp_path / "r.json")
    assert capfd.readouterr().err == ""
    assert json.loads((tmp_path / "r.json").read_text())["git_hash"] is None


@pytest.mark.parametrize("args, message", [
    (["--tasks", "lambada,squad"], "unknown task(s) squad"),
    (["--tasks", ""], "no task given"),
    (["--tasks", "blimp", "--data-dir", "NOPE"], "data directory not found"),  # built-in model
    (["--tasks", "blimp", "--ckpt", "CKPT", "--onnx", "x"], "not both"),
    (["--tasks", "blimp", "--ckpt", "CKPT", "--data-dir", "NOPE"], "data directory not found"),
    (["--tasks", "cbt", "--ckpt", "CKPT", "--data-dir", "EMPTY"], "cbtest_CN_test_2500ex.txt"),
    (["--tasks", "lambada", "--ckpt", "MISSING", "--data-dir", "DATA"], "checkpoint directory not found"),
    (["--tasks", "lambada", "--ckpt", "EMPTY", "--data-dir", "DATA"], "config.json is missing"),
    (["--tasks", "lambada", "--onnx", "EMPTY", "--data-dir", "DATA"], "ONNX"),
    (["--tasks", "lambada", "--ckpt", "CKPT", "--data-dir", "DATA", "--limit", "0"], "--limit"),
    (["--tasks", "lambada", "--ckpt", "CKPT", "--data-dir", "DATA", "--batch-size", "-1"], "batch size"),
    (["--tasks", "lambada", "--ckpt", "CKPT", "--data-dir", "DATA", "--device", "bogus"], "unknown device 'bogus'"),
])
def test_cli_errors(env, tmp_path, args, message):
    ckpt, d, _, _ = env
    (tmp_path / "empty").mkdir()
    subst = {"CKPT": str(ckpt), "DATA": str(d), "EMPTY": str(tmp_path / "empty"), "NOPE": str(tmp_path / "nope"),
             "MISSING": str(tmp_path / "missing")}
    r = run_cli(*[subst.get(a, a) for a in args])
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert len(r.output.strip().splitlines()) == 1 and r.output.startswith("Error:"), r.output


def test_cli_offline_without_data_dir_fails_fast(env, monkeypatch):
    import time

    ckpt, _, _, _ = env
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = time.monotonic()
    r = run_cli("--tasks", "blimp", "--ckpt", str(ckpt))
    assert r.exit_code == 2 and "--data-dir" in r.output and "unreachable" in r.output, r.output
    assert time.monotonic() - t < 5


@pytest.mark.parametrize("kwargs,message", [
    ({"tasks": None}, "tasks must be a string such as 'lambada,blimp' or a list of names, got None"),
    ({"tasks": ["lambada", 3]}, "tasks must be a string"),
    ({"tasks": "lambada", "limit": "a"}, "--limit must be a positive number"),
    ({"tasks": "lambada", "limit": True}, "--limit must be a positive number"),
    ({"tasks": None, "texts": ["a.txt", 3]}, "texts[1] must be a str or Path, got int"),
    ({"tasks": None, "texts": 3}, "texts must be a file path (str or Path) or a list of them, got int"),
    ({"tasks": None, "texts": b"a.txt"}, "texts must be a file path (str or Path) or a list of them, got bytes"),
    ({"tasks": None, "texts": ""}, "texts is empty"),
])
def test_evaluate_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(SwitchheadError, match=re.escape(message)):
        evaluate(**kwargs, ckpt=str(tmp_path), data_dir=tmp_path)


@pytest.mark.parametrize("kwargs, message", [
    ({"data_dir": 5}, "data_dir must be a str or Path, got int"),
    ({"ckpt": 123}, "ckpt must be a str or Path, got int"),
    ({"onnx": 1.5}, "onnx must be a str or Path, got float"),
    ({"output": 7}, "output must be a str or Path, got int"),
])
def test_evaluate_paths_of_the_wrong_kind(kwargs, message):
    with pytest.raises(SwitchheadError, match=re.escape(message)):
        evaluate("lambada", **kwargs)


def test_evaluate_refuses_an_empty_data_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where "" would have been looked for
    (tmp_path / "lambada").mkdir()
    (tmp_path / data.LAMBADA_FILE).write_text('{"text": "a b"}\n')
    with pytest.raises(SwitchheadError, match="--data-dir needs a path, got an empty one"):
        evaluate("lambada", ckpt=str(tmp_path), data_dir="")


def test_bad_data_file_is_a_clear_error(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(SwitchheadError, match=r"x.jsonl:2: not valid JSON"):
        data.read_jsonl(path, ("text",))


@pytest.mark.parametrize("line, message", [
    ('{"text": "a b", "n": ' + "1" * 5000 + "}", "Exceeds the limit"),  # json raises a plain ValueError
    ("[" * 100_000 + "]" * 100_000, "maximum recursion depth"),
])
def test_json_line_python_cannot_decode_is_a_clear_error(tmp_path, line, message):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "a b"}\n' + line + "\n")
    with pytest.raises(SwitchheadError, match=rf"x.jsonl:2: not readable as JSON \(.*{message}"):
        data.read_jsonl(path, ("text",))


def test_data_dir_that_is_a_file_is_told_apart_from_a_missing_one(tmp_path):
    (tmp_path / "evals.tgz").write_bytes(b"")
    with pytest.raises(SwitchheadError, match=r"evals.tgz is not a directory; pass --data-dir DIR holding"):
        data.check_data_dir(tmp_path / "evals.tgz", ["lambada"])


@pytest.mark.parametrize("endpoint", ["https://hub.example:99999", "http://hub.example:port", "http://[::1"])
def test_malformed_hf_endpoint_is_a_clear_error(monkeypatch, endpoint):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with pytest.raises(SwitchheadError, match=re.escape(f"HF_ENDPOINT={endpoint!r} is not a valid URL")):
        data.hub_reachable()


def test_output_with_a_trailing_separator_is_refused(tmp_path):
    from switchhead.evals.run import check_output

    with pytest.raises(SwitchheadError, match="ends with a separator"):
        check_output(f"{tmp_path / 'results'}/")
    assert not (tmp_path / "results").exists()


def test_cli_reports_a_broken_data_file_in_one_line(env, tmp_path):
    ckpt, _, _, _ = env
    (tmp_path / "lambada").mkdir()
    (tmp_path / data.LAMBADA_FILE).write_text('{"text": "a b"}\nnot json\n')
    r = run_cli("--tasks", "lambada", "--ckpt", str(ckpt), "--data-dir", str(tmp_path), "--no-progress")
    assert r.exit_code == 2 and "lambada_test.jsonl:2: not valid JSON" in r.output, r.output


def cbt_example(answer: str = "man", candidates: str = "birds|food|maiden|man|middle|place|sight|south|wash|wings",
                question: str = "the young XXXXX sat ."):
    lines = [f"{i} Line {i} ." for i in range(1, 21)]
    return "\n".join(lines + [f"21 {question}\t{answer}\t\t{candidates}"]) + "\n\n"


@pytest.mark.parametrize("text", ["Hello", "", " ", "two words ", " word"])
def test_lambada_passage_needs_a_context_and_a_final_word(tmp_path, text):
    # no space: lm-eval's split crashed; an empty last word was an empty target that always counted as correct
    (tmp_path / "lambada").mkdir()
    (tmp_path / data.LAMBADA_FILE).write_text(json.dumps({"text": "a b c"}) + "\n" + json.dumps({"text": text}))
    with pytest.raises(SwitchheadError, match=r"lambada_test.jsonl:2: a LAMBADA passage needs a context and a "
                                              r"final word"):
        data.load_lambada(data_dir=str(tmp_path))


@pytest.mark.parametrize("good, bad", [("", "tom saw the dog ."), ("tom saw the dog .", " \t")])
def test_blimp_sentences_must_not_be_empty(tmp_path, good, bad):
    (tmp_path / "blimp").mkdir()
    (tmp_path / data.blimp_file("wh_island")).write_text(
        json.dumps({"sentence_good": "a b", "sentence_bad": "b a"}) + "\n"
        + json.dumps({"sentence_good": good, "sentence_bad": bad}) + "\n")
    with pytest.raises(SwitchheadError, match=r"wh_island.jsonl:2: a BLiMP pair needs two non-empty sentences"):
        data.load_blimp("wh_island", data_dir=str(tmp_path))


@pytest.mark.parametrize("answer, candidates", [
    ("man", "birds|food||man|middle|place|sight|south|wash|wings"),
    ("", "birds|food||man|middle|place|sight|south|wash|wings"),
    (" ", "birds|food| |man|middle|place|sight|south|wash|wings"),
])
def test_cbt_answer_and_candidates_must_not_be_empty(tmp_path, answer, candidates):
    path = tmp_path / "cbt.txt"
    path.write_text(cbt_example() + cbt_example(answer, candidates))
    with pytest.raises(SwitchheadError, match=r"cbt.txt:43: empty answer or candidate"):
        data.parse_cbt(path)


@pytest.mark.parametrize("bad, message", [
    ({"candidates": "birds|food|man|man|middle|place|sight|south|wash|wings"}, "candidate 'man' appears twice"),
    ({"candidates": "birds|birds|maiden|man|middle|place|sight|south|wash|wings"}, "candidate 'birds' appears twice"),
    ({"question": "the XXXXX sat by the XXXXX ."}, "the question must hold the blank XXXXX exactly once, it has 2"),
    ({"question": "the young man sat ."}, "the question must hold the blank XXXXX exactly once, it has 0"),
])
def test_cbt_candidates_must_differ_and_the_question_has_one_blank(tmp_path, bad, message):
    # a second blank stayed inside every option's text; CBT's ten candidates are distinct words
    path = tmp_path / "cbt.txt"
    path.write_text(cbt_example() + cbt_example(**bad))
    with pytest.raises(SwitchheadError, match=rf"cbt.txt:43: {re.escape(message)}"):
        data.parse_cbt(path)


@pytest.mark.parametrize("task, good, bad, message", [
    ("lambada", '{"text": "a b"}', r'{"text": "hello \ud800 world"}',
     "field text is not valid UTF-8 (lone surrogate U+D800 at character 6)"),
    ("blimp", '{"sentence_good": "a b", "sentence_bad": "b a"}', r'{"sentence_good": "a b", "sentence_bad": "\udcff"}',
     "field sentence_bad is not valid UTF-8 (byte 0xFF at character 0)"),
])
def test_jsonl_string_that_is_not_utf8_is_a_clear_error(tmp_path, task, good, bad, message):
    # UTF-8 bytes whose JSON escape decodes to a lone surrogate: pyarrow failed on it after the model had loaded
    rel = data.required_files(task)[0]
    (tmp_path / rel).parent.mkdir()
    (tmp_path / rel).write_text(f"{good}\n{bad}\n")
    with pytest.raises(SwitchheadError, match=rf"{rel.split('/')[1]}:2: {re.escape(message)}"):
        data.check_data_files(tmp_path, [task])


@pytest.mark.parametrize("task", ["lambada", "blimp", "cbt"])
def test_data_file_that_is_not_utf8_is_a_clear_error(tmp_path, task):
    good = {"lambada": '{"text": "a b"}\n', "blimp": '{"sentence_good": "a b", "sentence_bad": "b a"}\n',
            "cbt": cbt_example()}[task]
    rel = data.required_files(task)[0]
    (tmp_path / rel).parent.mkdir()
    (tmp_path / rel).write_bytes(good.encode() + b"caf\xe9 \xff\n")
    load = {"lambada": lambda: data.load_lambada(data_dir=str(tmp_path)),
            "blimp": lambda: data.load_blimp(data.BLIMP_PARADIGMS[0], data_dir=str(tmp_path)),
            "cbt": lambda: data.load_cbt(data.CBT_SETS[0], data_dir=str(tmp_path))}[task]
    line = good.count("\n") + 1
    offset = len(good.encode()) + 3  # the \xe9 of "caf\xe9"
    with pytest.raises(SwitchheadError,
                       match=rf"cannot read .*{rel.split('/')[1]}: not valid UTF-8 \(byte 0xe9 at offset {offset}, "
                             rf"line {line}\)"):
        load()


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model (or evaluating) fails the test: the errors below must come before either."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr("switchhead.evals.lm.SwitchheadLM", refuse)


@pytest.mark.parametrize("rel, content, message", [
    (data.LAMBADA_FILE, b'{"text": "a b"}\n{"text": "Hello"}\n', "lambada_test.jsonl:2: a LAMBADA passage needs"),
    (data.blimp_file("wh_island"), b'{"sentence_good": "", "sentence_bad": "x"}\n',
     "wh_island.jsonl:1: a BLiMP pair needs two non-empty sentences"),
    (data.cbt_file("P"), b"1 caf\xe9\n", "cbtest_P_test_2500ex.txt: not valid UTF-8 (byte 0xe9 at offset 5, line 1)"),
    (data.LAMBADA_FILE, b'{"text": "a b"}\n{"text": "hello \\ud800 world"}\n',
     "lambada_test.jsonl:2: field text is not valid UTF-8 (lone surrogate U+D800"),
    (data.cbt_file("NE"), cbt_example(candidates="birds|man|maiden|man|middle|place|sight|south|wash|wings").encode(),
     "cbtest_NE_test_2500ex.txt:21: candidate 'man' appears twice"),
])
def test_cli_reports_bad_data_in_one_line_before_loading_the_model(env, tmp_path, no_model, rel, content, message):
    ckpt, d, _, _ = env
    for task in ("lambada", "blimp", "cbt"):
        for f in data.required_files(task):
            (tmp_path / f).parent.mkdir(exist_ok=True)
            (tmp_path / f).write_bytes((d / f).read_bytes())
    (tmp_path / rel).write_bytes(content)
    r = run_cli("--tasks", "lambada,blimp,cbt", "--ckpt", str(ckpt), "--data-dir", str(tmp_path), "--no-progress")
    assert r.exit_code == 2 and message in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and r.output.startswith("Error:"), r.output


@pytest.mark.parametrize("output", ["afile/r.json", "afile/sub/r.json"])
def test_cli_output_under_a_file_fails_before_evaluating(env, tmp_path, no_model, output):
    ckpt, d, _, _ = env
    (tmp_path / "afile").write_text("")
    r = run_cli("--tasks", "lambada", "--ckpt", str(ckpt), "--data-dir", str(d), "--no-progress",
                "--output", str(tmp_path / output))
    assert r.exit_code == 2 and "afile is not a directory" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and r.output.startswith("Error:"), r.output


@pytest.mark.parametrize("content", ["my notes\n", "", '{"results": {}}', "[1, 2]", '{"results": 1, "configs": {}, '
                                     '"versions": {}, "config": {}}', b"\xff\xfe{"])
def test_cli_output_refuses_to_overwrite_a_file_that_is_no_results_json(env, tmp_path, no_model, content):
    ckpt, d, _, _ = env
    out = tmp_path / "notes.txt"
    if isinstance(content, bytes):
        out.write_bytes(content)
    else:
        out.write_text(content)
    before = out.read_bytes()
    r = run_cli("--tasks", "lambada", "--ckpt", str(ckpt), "--data-dir", str(d), "--no-progress",
                "--output", str(out))
    assert r.exit_code == 2 and "exists and is not an earlier results JSON; not overwriting it" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and r.output.startswith("Error:"), r.output
    assert out.read_bytes() == before


def test_evaluate_refuses_cuda_without_cuda_but_lm_eval_falls_back(env, tmp_path):
    # lm-eval's CLI asks for cuda by default, so SwitchheadLM runs on the CPU without it; a user who asked
    # switchhead for cuda must hear that it is missing, before anything is loaded.
    from switchhead.evals import SwitchheadLM

    ckpt, d, _, _ = env
    lm = SwitchheadLM(ckpt=str(ckpt), device="cuda", progress=False)
    assert lm.backend.model.out.weight.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    out = tmp_path / "r.json"
    if torch.cuda.is_available():
        assert evaluate("lambada", ckpt=str(ckpt), data_dir=d, limit=1, progress=False, device="cuda", output=out)
        assert out.is_file()
    else:
        with pytest.raises(SwitchheadError, match=r"^device 'cuda' requested but CUDA is not available$"):
            evaluate("lambada", ckpt=str(ckpt), data_dir=d, limit=1, progress=False, device="cuda", output=out)
        assert not out.exists()


def test_text_rows_are_told_apart_when_file_names_clash():
    from switchhead.evals.run import format_table

    row = {"tokens": 10, "lanes": 1, "loss": 1.0, "perplexity": math.e, "bits_per_byte": 0.5}
    table = format_table({"text": [{"file": f, **row} for f in ("a/x.txt", "b/x.txt", "c/y.txt")]})
    labels = {line.split()[1] for line in table.splitlines()[1:]}
    assert labels == {"a/x.txt", "b/x.txt", "y.txt"}, table


def test_a_context_starts_a_document_whatever_its_leading_space(sp):
    """With verbatim whitespace, a context's leading space is the dummy prefix at a document start, as for an empty
    context's continuation and a rolling document: splitting a text anywhere keeps the chain rule."""
    from switchhead.evals import SwitchheadLM

    torch.manual_seed(0)
    model = TransformerLM(PRESETS["tiny-switchhead"].replace(vocab_size=sp.get_piece_size())).eval()
    lm = SwitchheadLM(model=model, tokenizer=sp, batch_size=4, progress=False)
    assert len(sp.encode(" the fox")) > len(sp.encode("the fox")), "whitespace is kept verbatim"
    assert lm.encode_pair(" the quick fox", " jumps") == lm.encode_pair("the quick fox", " jumps")
    (head, _), (tail, _), (whole, _) = lm.loglikelihood(
        [Req("", " the quick fox"), Req(" the quick fox", " jumps over"), Req("", " the quick fox jumps over")])
    assert head + tail == pytest.approx(whole, abs=1e-4)
    (rolling,) = lm.loglikelihood_rolling([Req(" the quick fox jumps over")])
    assert rolling == pytest.approx(whole, abs=1e-4)
    spaced, plain = lm.generate_until([Req(" the quick fox", {"until": [], "max_gen_toks": 6}),
                                       Req("the quick fox", {"until": [], "max_gen_toks": 6})])
    assert spaced == plain


def test_a_contexts_trailing_space_moves_to_the_continuation(sp):
    """lm-eval contexts often end in a space ("Answer: "): the space belongs to the continuation's first word, as
    it is tokenised in running text, so the score is that of the plain split (direct_pair, from the forward)."""
    from switchhead.evals import SwitchheadLM

    torch.manual_seed(0)
    model = TransformerLM(PRESETS["tiny-switchhead"].replace(vocab_size=sp.get_piece_size())).eval()
    lm = SwitchheadLM(model=model, tokenizer=sp, batch_size=4, progress=False)
    ctx, cont = lm.encode_pair("the quick fox  ", "jumps over")
    assert (ctx, cont) == ([sp.eos_id()] + sp.encode("the quick fox"), sp.encode("the quick fox  jumps over")[
        len(sp.encode("the quick fox")):])
    (got, greedy), = lm.loglikelihood([Req("the quick fox ", "jumps over")])
    want, want_greedy, n = direct_pair(model, sp, "the quick fox", " jumps over")
    assert got == pytest.approx(want, abs=1e-4) and greedy == want_greedy
    assert lm.continuation_length("the quick fox ", "jumps over") == n
