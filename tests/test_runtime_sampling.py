"""Each sampling function against a plain-Python reference, plus parameter validation."""

import math
import random

import pytest
import torch

from switchhead.errors import SwitchheadError
from switchhead.runtime.sampling import (
    SamplingParams,
    TokenHistory,
    choose,
    draw,
    min_p_filter,
    presence_frequency_penalty,
    processed_logits,
    repetition_penalty,
    seed_plus,
    top_k_filter,
    top_p_filter,
)

NEG = float("-inf")



def _rows(n=6, v=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 3
    x[0, 3] = x[0, 5]  # a tie
    return x


def _softmax(row):
    m = max(row)
    e = [math.exp(r - m) if r != NEG else 0.0 for r in row]
    s = sum(e)
    return [v / s for v in e]


def _kept(t):
    return [[v != NEG for v in row] for row in t.tolist()]


def test_top_k_reference():
    x = _rows()
    for k in [1, 2, 5, 22]:
        want = []
        for row in x.tolist():
            kth = sorted(row, reverse=True)[k - 1]
            want.append([v >= kth for v in row])
        assert _kept(top_k_filter(x, k)) == want
    assert torch.equal(top_k_filter(x, 0), x) and torch.equal(top_k_filter(x, 23), x)


def test_top_p_reference():
    x = _rows()
    for p in [0.05, 0.3, 0.5, 0.9, 0.999]:
        want = []
        for row in x.tolist():
            probs = _softmax(row)
            order = sorted(range(len(row)), key=lambda i: -probs[i])
            keep, mass = set(), 0.0
            for i in order:
                keep.add(i)
                mass += probs[i]
                if mass >= p:
                    break
            want.append([i in keep for i in range(len(row))])
        assert _kept(top_p_filter(x, p)) == want, p
    assert torch.equal(top_p_filter(x, 1.0), x)
    # Mass that reaches p exactly (1/4 each, exact in binary) ends the set there: the smallest set reaching p.
    flat = torch.zeros(1, 4, dtype=torch.float64)
    for p, n in [(0.25, 1), (0.5, 2), (0.75, 3), (0.7, 3), (0.8, 4)]:
        assert sum(_kept(top_p_filter(flat, p))[0]) == n, p


def test_min_p_reference():
    x = _rows()
    for mp in [0.01, 0.2, 0.7, 1.0]:
        want = []
        for row in x.tolist():
            probs = _softmax(row)
            want.append([q >= mp * max(probs) for q in probs])
        assert _kept(min_p_filter(x, mp)) == want
    assert torch.equal(min_p_filter(x, 0.0), x)


def test_repetition_penalty_reference():
    x = _rows()
    seen = torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) < 0.4
    for pen in [0.5, 1.3, 2.0]:
        got = repetition_penalty(x, seen, pen).tolist()
        for row, srow, grow in zip(x.tolist(), seen.tolist(), got):
            for v, s, g in zip(row, srow, grow):
                want = (v / pen if v > 0 else v * pen) if s else v
                assert g == pytest.approx(want, rel=1e-6)
    assert torch.equal(repetition_penalty(x, seen, 1.0), x)


def test_presence_frequency_penalty_reference():
    x = _rows()
    x[1, 4] = NEG  # a banned token stays banned
    counts = torch.randint(0, 4, x.shape, generator=torch.Generator().manual_seed(2))
    for presence, frequency in [(0.5, 0.0), (0.0, 1.5), (-2.0, 0.7), (1.0, -0.3)]:
        got = presence_frequency_penalty(x.double(), counts, presence, frequency).tolist()
        for row, crow, grow in zip(x.tolist(), counts.tolist(), got):
            for v, c, g in zip(row, crow, grow):
                want = v - frequency * c - (presence if c > 0 else 0.0)
                assert g == want or g == pytest.approx(want, rel=1e-12)
    assert torch.equal(presence_frequency_penalty(x, counts, 0.0, 0.0), x)


def test_token_history_counts_generated_tokens_and_sees_the_prompt():
    p = SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: -1.0, 0: 2})
    h = TokenHistory(p, 6, [[1, 1, 2], []])
    for b, tok in [(0, 4), (0, 4), (1, 1), (0, 2)]:
        h.add(b, tok)
    assert h.seen.tolist() == [[False, True, True, False, True, False], [False, True, False, False, False, False]]
    assert h.counts.tolist() == [[0, 0, 1, 0, 2, 0], [0, 1, 0, 0, 0, 0]]  # the prompt is not counted
    x = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0, NEG], [0.0, -2.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    want = []
    for row, seen, counts in zip(x.tolist(), h.seen.tolist(), h.counts.tolist()):
        out = []
        for tok, (v, sn, c) in enumerate(zip(row, seen, counts)):
            v += {3: -1.0, 0: 2.0}.get(tok, 0.0)
            if sn:
                v = v / 1.5 if v > 0 else v * 1.5
            out.append(v - 0.25 * c - (0.5 if c else 0.0))
        want.append(out)
    assert h.adjust(x).tolist() == want
    assert processed_logits(x, p, h).tolist() == want  # temperature 1, no filters
    assert not TokenHistory(SamplingParams(), 6, [[1]]).active


def test_logit_bias_outside_the_vocabulary_is_a_user_error():
    with pytest.raises(SwitchheadError, match=r"logit-bias names token 6, outside the vocabulary \(ids 0..5\)"):
        TokenHistory(SamplingParams(logit_bias={2: 1.0, 6: 1.0}), 6, [[]])


def test_logit_bias_steers_greedy_choice_but_never_unbans():
    x = torch.tensor([[NEG, 1.0, 2.0, 3.0]])

    def choice(bias):
        p = SamplingParams(temperature=0, logit_bias=bias)
        return choose(x, p, TokenHistory(p, 4, [[]]), None).item()

    assert choice(None) == 3 and choice({1: 2.5}) == 1 and choice({3: -100}) == 2 and choice({0: 100}) == 3


def test_frequency_penalty_changes_greedy_choice_as_tokens_repeat():
    x = torch.tensor([[2.0, 1.0, 0.0]])
    p = SamplingParams(temperature=0, frequency_penalty=0.6)
    h = TokenHistory(p, 3, [[0, 0, 0]])  # the prompt does not count
    picks = []
    for _ in range(4):
        picks.append(choose(x, p, h, None).item())
        h.add(0, picks[-1])
    assert picks == [0, 0, 1, 0]  # 2.0, then 1.4 > 1.0, then 0.8 < 1.0, then 0.8 vs 0.4


def test_draw_reference():
    rng = random.Random(0)
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0]] * 50)
    u = torch.tensor([1.0 - rng.random() for _ in range(50)])
    u[0], u[1] = 1.0, 1e-12
    got = draw(probs, u).tolist()
    for i, ui in enumerate(u.tolist()):
        acc, want = 0.0, None
        for tok, q in enumerate(probs[i].tolist()):
            acc += q
            if q > 0 and acc >= ui * 1.0 - 1e-7:
                want = tok
                break
        assert got[i] == want


def test_draw_frequencies_follow_probabilities():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    u = 1.0 - torch.rand(20000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    toks = draw(probs.expand(20000, -1), u)
    freq = torch.bincount(toks, minlength=4).double() / 20000
    assert freq[1] == 0
    assert torch.allclose(freq, probs.double(), atol=0.015)


def test_processed_logits_composes_in_order():
    x = _rows()
    p = SamplingParams(temperature=0.7, top_k=8, top_p=0.8, min_p=0.05, repetition_penalty=1.2,
                       presence_penalty=0.4, frequency_penalty=0.3, logit_bias={5: 1.5, 9: -2})
    history = TokenHistory(p, x.shape[1], [[0, 1, 2, 3]] * x.shape[0])
    for tok in (7, 7, 8):
        history.add(2, tok)
    bias = torch.zeros(x.shape[1], dtype=torch.float64)
    bias[5], bias[9] = 1.5, -2.0
    seen = history.seen
    counts = torch.zeros(x.shape, dtype=torch.int64)
    counts[2, 7], counts[2, 8] = 2, 1
    x64 = presence_frequency_penalty(repetition_penalty(x.double() + bias, seen, 1.2), counts, 0.4, 0.3)
    want = min_p_filter(top_p_filter(top_k_filter(x64 / 0.7, 8), 0.8), 0.05)
    assert torch.equal(processed_logits(x, p, history), want)


@pytest.mark.parametrize("params,allowed", [
    (SamplingParams(repetition_penalty=1e-300), {2}),  # the seen positive logit / 1e-300: beyond float32
    (SamplingParams(repetition_penalty=5e-324), {2}),  # beyond float64 too: clamped, still the one winner
    (SamplingParams(temperature=1e39), {1, 2, 3}),  # inf in float32, and the banned -inf / inf was NaN
    (SamplingParams(temperature=1e308, repetition_penalty=1e-300), {1, 2, 3}),
    (SamplingParams(temperature=0, repetition_penalty=1e-300), {2}),
])
def test_extreme_accepted_values_never_sample_a_banned_token(params, allowed):
    # Token 0 is banned (-inf, as the engine masks UNK); a NaN row used to make the draw fall through to it.
    logits = torch.tensor([[float("-inf"), 1.0, 2.0, 3.0]]).expand(64, -1)
    history = TokenHistory(params, 4, [[2]] * 64)
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    got = set(choose(logits, params, history, gens).tolist())
    assert got <= allowed and (len(got) > 1 or got == allowed)


def test_greedy_and_seeded_choice():
    x = _rows()
    assert torch.equal(choose(x, SamplingParams(temperature=0), None, None), x.argmax(-1))
    p = SamplingParams(temperature=1.5, top_k=10)

    def run(seed):
        gens = [torch.Generator().manual_seed(seed) for _ in range(x.shape[0])]
        return [choose(x, p, None, gens).tolist() for _ in range(20)]

    assert run(3) == run(3)
    assert run(3) != run(4)
    for row in run(5):  # top-k=10 never yields a token outside the top 10
        for b, tok in enumerate(row):
            assert x[b, tok] >= x[b].topk(10).values[-1]


def test_repetition_penalty_changes_greedy_choice():
    x = torch.tensor([[2.0, 1.9, -1.0]])
    p = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert choose(x, p, TokenHistory(p, 3, [[0]]), None).item() == 1


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.01), ("top_k", -1), ("min_p", -0.1), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("max_new_tokens", 0), ("temperature", float("nan")),
    ("presence_penalty", 2.5), ("presence_penalty", float("inf")), ("frequency_penalty", -2.01),
    ("frequency_penalty", "1"), ("logit_bias", {1: 101}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}),
    ("logit_bias", {True: 1.0}), ("logit_bias", {1: float("nan")}), ("logit_bias", [1, 2]),
    ("logit_bias", ((5, 100.0), (5, -100.0))),  # pairs naming one id twice: the sort picked the bias
])
def test_bad_parameters_are_user_errors(field, value):
    with pytest.raises(SwitchheadError, match=field.replace("_", "-")):
        SamplingParams(**{field: value})


def test_numpy_scalars_are_numbers_and_stop_at_eos_a_bool():
    import numpy as np

    p = SamplingParams(max_new_tokens=np.int64(5), temperature=np.float32(0.5), top_k=np.int32(3),
                       top_p=np.float64(0.9), presence_penalty=np.float16(0.5), seed=np.uint64(2**64 - 1))
    assert p == SamplingParams(max_new_tokens=5, temperature=0.5, top_k=3, top_p=0.9, presence_penalty=0.5,
                               seed=2**64 - 1)
    assert type(p.max_new_tokens) is int and type(p.temperature) is float and type(p.seed) is int
    with pytest.raises(SwitchheadError, match="temperature must be >= 0"):
        SamplingParams(temperature=np.float32(-1))
    with pytest.raises(SwitchheadError, match="stop_at_eos must be True or False, got 'no'"):
        SamplingParams(stop_at_eos="no")


def test_empty_stop_string_rejected():
    with pytest.raises(SwitchheadError, match="stop"):
        SamplingParams(stop=("",))


@pytest.mark.parametrize("seed", [-1, 2**64, 2**70, 1.5])
def test_seed_out_of_range_is_a_user_error(seed):
    with pytest.raises(SwitchheadError, match="seed"):
        SamplingParams(seed=seed)


def test_every_valid_seed_seeds_a_generator():
    for seed in [0, 2**63, 2**64 - 1]:
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)
    assert seed_plus(2**64 - 1, 1) == 0 and seed_plus(2**64 - 2, 1) == 2**64 - 1 and seed_plus(5, 3) == 8


def test_stop_string_that_is_not_utf8_is_a_user_error():
    # Lone surrogates: what undecodable command-line bytes (surrogateescape) or a JSON "\ud800" become.
    for stop, what in [("ok\udcff", "byte 0xFF at character 2"), ("\ud800", "lone surrogate U+D800 at character 0")]:
        with pytest.raises(SwitchheadError, match="stop string 1 is not valid UTF-8") as e:
            SamplingParams(stop=("fine", stop))
        assert f"({what})" in str(e.value)


def test_choose_and_history_refuse_what_would_give_the_wrong_number_of_tokens():
    p, x = SamplingParams(temperature=1.0, repetition_penalty=1.2), _rows(3, 7)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert choose(x, p, TokenHistory(p, 7, [[1]] * 3), gens).shape == (3,)
    cases = [
        # one draw per generator: two generators gave two tokens for three rows
        (lambda: choose(x, p, None, gens[:2]), r"one torch.Generator per row \(3\), got 2"),
        (lambda: choose(x, p, None, None), r"one torch.Generator per row \(3\), got NoneType"),
        (lambda: choose(x, p, None, [1, 2, 3]), "one torch.Generator per row"),
        (lambda: choose(x, p, TokenHistory(p, 7, [[1]] * 2), gens), "the history holds 2 rows; the logits have 3"),
        (lambda: choose(x[0], p, None, gens[:1]), r"logits \[B, V\] with B, V >= 1, got \(7,\)"),
        (lambda: choose(x[:, :0], p, None, gens), r"got \(3, 0\)"),
        (lambda: choose(x.tolist(), p, None, gens), "got list"),
        # -1 marked the last token as seen, 1.7 token 1
        (lambda: TokenHistory(p, 7, [[1, -1]]), r"token id -1 is outside the vocabulary \[0, 7\)"),
        (lambda: TokenHistory(p, 7, [[1.7]]), "token id 1.7 is outside"),
        (lambda: TokenHistory(p, 7, "abc"), "prompts must be a list of token-id lists, got str"),
        (lambda: TokenHistory(p, 7, [5]), "each prompt must be a list of token ids, got int"),
        (lambda: TokenHistory(p, 0, [[]]), "vocab_size must be an integer >= 1, got 0"),
        (lambda: TokenHistory({"temperature": 1}, 7, [[]]), "params must be SamplingParams, got dict"),
        (lambda: TokenHistory(p, 7, [[1]]).add(0, -1), r"a token id in \[0, 7\), got row 0, token -1"),
        (lambda: TokenHistory(p, 7, [[1]]).add(1, 2), r"a row in \[0, 1\)"),
        (lambda: TokenHistory(p, 7, [[1]]).add(0, 2.0), "token 2.0"),
    ]
    for call, message in cases:
        with pytest.raises(SwitchheadError, match=message):
            call()
    # greedy choice draws nothing, so it needs no generators
    greedy = SamplingParams(temperature=0)
    assert choose(x, greedy, None, None).tolist() == x.argmax(-1).tolist()
    # a tuple of ids (or a tensor row) is a prompt as a list is
    h = TokenHistory(p, 7, [(1, 2), torch.tensor([3])])
    assert h.seen.nonzero().tolist() == [[0, 1], [0, 2], [1, 3]]
