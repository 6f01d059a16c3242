"""The KV cache's defining property: cached logits equal the chunked `TransformerLM.forward` over the same tokens,
for every architecture, prompt length, step pattern and batch composition."""

import random

import pytest
import torch
from tiny import batch_past_available_memory, needs_meminfo

from switchhead import PRESETS, TransformerLM
from switchhead.errors import SwitchheadError
from switchhead.model.accounting import kv_cache_bytes_per_token
from switchhead.runtime import Backend, TorchBackend, XLCache, feed

ARCHS = ["tiny-switchhead", "tiny-transformer", "tiny-moa", "tiny-switchall", "tiny-switchhead-rope",
         "tiny-switchhead-rope-nomem"]
T = 16
ATOL = 1e-5



def _model(name, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = PRESETS[name]
    assert cfg.chunk_len == T
    m = TransformerLM(cfg).eval().to(dtype)
    # Random init leaves the output biases at their defaults; scale the logits up so that small errors in
    # attention (a wrong position, a stale key) are not hidden by near-uniform outputs.
    with torch.no_grad():
        m.out.weight.mul_(4.0)
    return m


def _reference(model, ids):
    with torch.no_grad():
        return model(ids)[0]


def _max_err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch", ARCHS)
def test_token_by_token_matches_forward(arch):
    m = _model(arch)
    ids = torch.randint(0, m.config.vocab_size, (1, 4 * T + 3), generator=torch.Generator().manual_seed(1))
    ref = _reference(m, ids)[0]
    be = TorchBackend(m)
    got = feed(be, be.new_cache(1), [ids[0].tolist()], step=1, keep="all")[0]
    assert got.shape == ref.shape
    assert _max_err(got, ref) <= ATOL


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prompt_len", [5, T - 3, T, 4 * T + 3])
def test_prefill_then_decode_matches_forward(arch, prompt_len):
    m = _model(arch)
    n_new = 6  # enough to cross a chunk boundary from T - 3 and to roll over right after a full chunk
    ids = torch.randint(0, m.config.vocab_size, (1, prompt_len + n_new), generator=torch.Generator().manual_seed(2))
    ref = _reference(m, ids)[0]
    be = TorchBackend(m)
    cache = be.new_cache(1)
    pre = feed(be, cache, [ids[0, :prompt_len].tolist()], keep="all")[0]
    outs = [pre] + [feed(be, cache, [[tok]], keep="all")[0] for tok in ids[0, prompt_len:].tolist()]
    assert _max_err(torch.cat(outs), ref) <= ATOL


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_step_sizes_match_forward(arch):
    m = _model(arch)
    rng = random.Random(arch)
    ids = torch.randint(0, m.config.vocab_size, (1, 5 * T), generator=torch.Generator().manual_seed(3))
    ref = _reference(m, ids)[0]
    be = TorchBackend(m)
    cache = be.new_cache(1)
    toks, outs, i = ids[0].tolist(), [], 0
    while i < len(toks):
        n = rng.choice([1, 2, 3, 7, T - 1, T, T + 5, 2 * T + 1])
        outs.append(feed(be, cache, [toks[i:i + n]], step=rng.choice([None, 5]), keep="all")[0])
        i += n
    assert _max_err(torch.cat(outs), ref) <= ATOL


@pytest.mark.parametrize("arch", ["tiny-switchhead", "tiny-moa", "tiny-switchhead-rope"])
def test_float64_matches_tightly(arch):
    m = _model(arch, dtype=torch.float64)
    ids = torch.randint(0, m.config.vocab_size, (1, 3 * T + 1), generator=torch.Generator().manual_seed(4))
    ref = _reference(m, ids)[0]
    be = TorchBackend(m)
    assert be.dtype == torch.float64
    cache = be.new_cache(1)
    got = torch.cat([feed(be, cache, [ids[0, :T + 3].tolist()], keep="all")[0]]
                    + [feed(be, cache, [[t]], keep="all")[0] for t in ids[0, T + 3:].tolist()])
    assert _max_err(got, ref) <= 1e-10


@pytest.mark.parametrize("arch", ["tiny-switchhead", "tiny-transformer", "tiny-switchhead-rope-nomem"])
def test_batched_rows_equal_each_row_alone(arch):
    """Rows of different lengths and at different chunk phases share steps; padding changes nothing."""
    m = _model(arch)
    g = torch.Generator().manual_seed(5)
    lengths = [3, T + 4, 3 * T - 2]
    rows = [torch.randint(0, m.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    extra = [torch.randint(0, m.config.vocab_size, (9,), generator=g).tolist() for _ in rows]
    be = TorchBackend(m)
    cache = be.new_cache(len(rows))
    got = [[o] for o in feed(be, cache, rows, keep="all")]
    for step in range(9):
        # Rows drop in and out of steps (as finished rows do during generation).
        batch = [[e[step]] if (step + b) % 3 else [] for b, e in enumerate(extra)]
        for b, o in enumerate(feed(be, cache, batch, keep="all")):
            if o is not None:
                got[b].append(o)
    for b, row in enumerate(rows):
        fed = row + [e for s, e in enumerate(extra[b]) if (s + b) % 3]
        ref = _reference(m, torch.tensor([fed]))[0]
        assert _max_err(torch.cat(got[b]), ref) <= ATOL, f"row {b}"


def test_buffers_are_preallocated_and_never_move():
    m = _model("tiny-switchhead")
    be = TorchBackend(m)
    cache = be.new_cache(2)
    cfg = m.config
    ptrs = [t.data_ptr() for t in cache.keys + cache.values]
    assert cache.keys[0].shape == (2, cfg.n_heads, 2 * T, cfg.d_head)
    assert cache.nbytes == 2 * 2 * T * kv_cache_bytes_per_token(cfg)
    feed(be, cache, [list(range(3 * T + 2)), list(range(T))])
    for _ in range(T + 3):
        feed(be, cache, [[7], [8]])
    assert [t.data_ptr() for t in cache.keys + cache.values] == ptrs
    assert cache.seen.tolist() == [4 * T + 5, 2 * T + 3]


@needs_meminfo
@pytest.mark.parametrize("name", ["tiny-switchhead", "tiny-moa"])
def test_cache_larger_than_available_memory_is_refused_before_allocating(name):
    """Allocated layer by layer, such a cache would be granted and then die zeroing its pages (OOM killer)."""
    cfg = PRESETS[name]
    row = XLCache(cfg, 1).nbytes
    batch = batch_past_available_memory(row)
    with pytest.raises(SwitchheadError, match=rf"^the KV cache for {batch} sequences needs {batch * row} bytes "
                                              r"\([0-9.,]+ GiB\); this machine has [0-9.,]+ GiB available$"):
        XLCache(cfg, batch)
    with pytest.raises(SwitchheadError, match=r"^the KV cache for 10+ sequences would need more than 2\*\*63 bytes$"):
        XLCache(cfg, 10**30)


def test_moa_caches_one_shared_head():
    cfg = PRESETS["tiny-moa"]
    assert XLCache(cfg, 1).keys[0].shape == (1, 1, 2 * T, cfg.d_head)


def test_no_memory_model_restarts_context():
    """mem_chunks=0: after a chunk the context restarts, so the tokens before it do not matter."""
    m = _model("tiny-switchhead-rope-nomem")
    be = TorchBackend(m)
    a, b = be.new_cache(1), be.new_cache(1)
    tail = list(range(10, 15))
    la = feed(be, a, [list(range(T)) + tail])[0]
    lb = feed(be, b, [list(range(100, 100 + T)) + tail])[0]
    assert _max_err(la, lb) <= ATOL
    assert not bool(a.has_mem.any())


def test_step_may_not_cross_a_chunk_boundary():
    cache = XLCache(PRESETS["tiny-switchhead"], 1)
    cache.begin([T - 2])
    cache.commit()
    with pytest.raises(SwitchheadError, match="chunk boundary"):
        cache.begin([3])


@pytest.mark.parametrize("arch", ARCHS)
def test_scoring_logits_default_and_override_equal_the_forward(arch):
    """`Backend.logits` (rows through the cache) and TorchBackend's chunked-forward override agree, and the
    state each returns continues the rows, wherever the calls split them (at chunk boundaries, as scoring does,
    or inside chunks)."""
    m = _model(arch)
    ids = torch.randint(0, m.config.vocab_size, (3, 3 * T + 5), generator=torch.Generator().manual_seed(8))
    ref = _reference(m, ids)
    be = TorchBackend(m)
    for logits in (be.logits, lambda x, s=None: Backend.logits(be, x, s)):
        for cuts in ([2 * T], [5], [T + 3, T + 4, 2 * T + 1], [1, 2, T - 1]):
            state, out = None, []
            for a, b in zip([0, *cuts], [*cuts, ids.shape[1]]):
                part, state = logits(ids[:, a:b], state)
                out.append(part)
            assert _max_err(torch.cat(out, 1), ref) <= ATOL, cuts
    _, state = be.logits(ids[:, :5])
    with pytest.raises(SwitchheadError, match="the state continues 3 rows, got ids for 2"):
        be.logits(ids[:2, 5:9], state)


def test_a_backend_runs_a_training_model_in_eval_mode_and_leaves_it_training():
    torch.manual_seed(0)
    m = TransformerLM(PRESETS["tiny-switchhead"].replace(dropout=0.5)).eval()
    ids = torch.randint(0, m.config.vocab_size, (2, T + 3), generator=torch.Generator().manual_seed(3))
    ref = _reference(m, ids)
    m.train()
    be = TorchBackend(m)
    assert m.training
    for logits in (be.logits, lambda x: Backend.logits(be, x)):
        assert _max_err(logits(ids)[0], ref) <= ATOL  # no dropout: the same as in eval mode
        assert m.training


@pytest.mark.parametrize("arch", ["tiny-switchhead", "tiny-transformer"])
def test_torch_backend_follows_a_model_moved_after_it_was_made(arch):
    # The backend took the model's dtype once: caches of a model later moved to another dtype kept the old one
    # and decoding failed deep in a matmul. A cache made before the move is refused with a clear error.
    m = _model(arch)
    be = TorchBackend(m)
    rows = [[1, 2, 3, 4, 5], [6, 7]]
    old = be.new_cache(2)
    for dtype in (torch.float64, torch.bfloat16, torch.float32):
        m.to(dtype)
        fresh = TransformerLM(m.config).to(dtype)
        fresh.load_state_dict(m.state_dict())
        want = feed(TorchBackend(fresh), TorchBackend(fresh).new_cache(2), rows, keep="all")
        cache = be.new_cache(2)
        assert be.dtype == cache.keys[0].dtype == dtype
        for got, ref in zip(feed(be, cache, rows, keep="all"), want):
            assert torch.equal(got, ref)
    m.double()
    with pytest.raises(SwitchheadError, match="start a new cache"):
        feed(be, old, rows)


def test_decode_rejects_bad_ids_and_a_cache_outside_a_step():
    m = _model("tiny-switchhead")
    V = m.config.vocab_size
    cache = XLCache(m.config, 2)
    with torch.no_grad():
        with pytest.raises(SwitchheadError, match=r"XLCache.update outside a step: call cache.begin"):
            m.decode(torch.tensor([[1], [2]]), cache)
        cache.begin([1, 1])
        for ids, message in [(torch.tensor([[1], [V]]), f"token id {V} is outside the vocabulary"),
                             (torch.tensor([[1], [-3]]), "token id -3 is outside"),
                             (torch.tensor([[1.0], [2.0]]), "token ids must be an integer tensor"),
                             (torch.tensor([1, 2]), r"input_ids must be \[batch, tokens\]"),
                             ([[1], [2]], "input_ids must be a tensor"),
                             (torch.tensor([[1]]), "planned for 2 rows of 1 tokens; got 1 rows of 1"),
                             (torch.tensor([[1, 2], [3, 4]]), "planned for 2 rows of 1 tokens; got 2 rows of 2")]:
            with pytest.raises(SwitchheadError, match=message):
                m.decode(ids, cache)
        # The refused calls left the step usable: it still gives the chunked forward's logits.
        got = m.decode(torch.tensor([[5], [7]]), cache)
        cache.commit()
    torch.testing.assert_close(got, _reference(m, torch.tensor([[5], [7]])), atol=ATOL, rtol=0)
    with pytest.raises(SwitchheadError, match="XLCache.commit outside a step"):
        cache.commit()


@pytest.mark.parametrize("change", [dict(chunk_len=8), dict(mem_chunks=0), dict(n_layers=1), dict(n_heads=1),
                                    dict(d_head=8)])
def test_decode_refuses_a_cache_made_for_another_layout(change):
    """A cache of another chunk length or memory setting fitted the buffers and gave wrong logits silently; one of
    other layers or heads failed inside attention."""
    m = _model("tiny-switchhead")
    other = XLCache(m.config.replace(**change), 1)
    other.begin([1])
    with torch.no_grad(), pytest.raises(SwitchheadError, match="the cache was made for another model"):
        m.decode(torch.tensor([[3]]), other)
    # a config that differs elsewhere (here the vocabulary) lays out the same cache, which then serves
    same = XLCache(m.config.replace(vocab_size=m.config.vocab_size + 1), 1)
    same.begin([1])
    with torch.no_grad():
        torch.testing.assert_close(m.decode(torch.tensor([[3]]), same), _reference(m, torch.tensor([[3]])),
                                   atol=ATOL, rtol=0)


def test_decode_refuses_what_is_not_a_cache_or_holds_another_dtype():
    m = _model("tiny-switchhead")
    with torch.no_grad():
        for cache in (None, "cache", m.config):
            with pytest.raises(SwitchheadError, match="decode needs a KV cache"):
                m.decode(torch.tensor([[3]]), cache)
        wide = XLCache(m.config, 1, dtype=torch.float64)
        wide.begin([1])
        with pytest.raises(SwitchheadError, match="the cache holds torch.float64 on cpu; the model computes "
                                                  "torch.float32"):
            m.decode(torch.tensor([[3]]), wide)


def test_cache_refuses_bad_rows_layers_counts_and_devices():
    cfg = PRESETS["tiny-switchhead"]
    cache = XLCache(cfg, 2)
    for row in (-1, 2, True, None, 1.0):  # -1 reset the last row, True and None every row
        with pytest.raises(SwitchheadError, match=r"row must be an integer in \[0, 2\)"):
            cache.reset_row(row)
    for counts in ([1.5, 1], [True, 1], [1], [1, 1, 1], [], torch.tensor([1.0, 1.0]), torch.tensor([[1, 1]]),
                   "11", [float("nan"), 1]):
        with pytest.raises(SwitchheadError, match="bad step: counts must be 2 integers"):
            cache.begin(counts)
    for t in (2.5, True, 0, "2"):  # 2.5 was a width of 3
        with pytest.raises(SwitchheadError, match="bad step: counts"):
            cache.begin([1, 1], t)
    assert cache.plan is None and cache.fill.tolist() == [0, 0]  # nothing refused changed the cache
    cache.begin(torch.tensor([2, 1], dtype=torch.int32), 2)
    with pytest.raises(SwitchheadError, match="begin called twice without commit"):
        cache.begin([1, 1])
    with pytest.raises(SwitchheadError, match="reset_row inside a step"):
        cache.reset_row(0)
    k = torch.zeros(2, cfg.n_heads, 2, cfg.d_head)
    for layer in (-1, cfg.n_layers, True, "0"):  # -1 was the last layer
        with pytest.raises(SwitchheadError, match=rf"layer must be an integer in \[0, {cfg.n_layers}\)"):
            cache.write(layer, k, k)
        with pytest.raises(SwitchheadError, match="layer must be an integer"):
            cache.window(layer)
    cache.commit()
    assert cache.fill.tolist() == [2, 1]
    cache.reset_row(1)
    assert cache.fill.tolist() == [2, 0] and cache.seen.tolist() == [2, 0]
    for device in ("meta", "gpu", ""):
        with pytest.raises(SwitchheadError, match="device"):
            XLCache(cfg, 1, device=device)
