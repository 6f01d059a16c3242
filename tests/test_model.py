"""The model against naive float64 loops over heads, experts and positions (tests/naive.py)."""

import itertools
import re

import naive
import pytest
import torch

from switchhead import PRESETS, ModelConfig, TransformerLM
from switchhead.errors import SwitchheadError
from switchhead.kernels import expert_projection
from switchhead.model.layers import ATTENTION, Block, SigmaMoE, moe_project, routing_logits, select_topk

TINY = PRESETS["tiny-switchhead"].replace(d_model=24, d_head=8, n_experts=3, k=2, chunk_len=6, n_layers=2,
                                          vocab_size=37)


def _attn(cfg, seed=0):
    torch.manual_seed(seed)
    return ATTENTION[cfg.attention](cfg).double()


def _check_attention(cfg, t=5, m=4, seed=0):
    att = _attn(cfg, seed)
    with torch.no_grad():  # random u/v/scale so the dense baseline's biases are exercised
        for name in ("u", "v"):
            if getattr(att, name, None) is not None and isinstance(getattr(att, name), torch.nn.Parameter):
                getattr(att, name).normal_()
    x = torch.randn(2, t, cfg.d_model, dtype=torch.float64)
    mem = torch.randn(2, m, cfg.d_model, dtype=torch.float64) if m else None
    got = att(x, mem)
    for b in range(2):
        want = naive.ATTENTION[cfg.attention](att, x[b], None if mem is None else mem[b])
        torch.testing.assert_close(got[b], want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("subset", [s for n in range(5) for s in itertools.combinations("vkqo", n)],
                         ids=lambda s: "".join(s) or "none")
def test_switchhead_all_projection_subsets_match_naive(subset):
    _check_attention(TINY.replace(moe_projections=subset), seed=len(subset))


@pytest.mark.parametrize("cfg", [
    TINY,
    TINY.replace(shared_selection=True),
    TINY.replace(shared_selection=True, moe_projections=("v", "k", "q", "o")),
    TINY.replace(n_heads=3, n_experts=5, k=3),
    TINY.replace(k=1, n_experts=1),
    TINY.replace(positional="rope"),
    TINY.replace(positional="rope", mem_chunks=0),
    TINY.replace(attention="dense", n_heads=3),
    TINY.replace(attention="dense", positional="rope"),
    TINY.replace(attention="moa", n_experts=5, n_heads=2, k=2),
    TINY.replace(attention="moa", n_experts=5, n_heads=3, k=3, moa_gate="sigmoid"),
    TINY.replace(attention="moa", n_experts=4, n_heads=2, k=2, positional="rope"),
], ids=lambda c: f"{c.attention}-{c.positional}-H{c.n_heads}E{c.n_experts}k{c.k}-sh{int(c.shared_selection)}")
@pytest.mark.parametrize("t,m", [(1, 0), (5, 0), (3, 6), (6, 6)])
def test_attention_matches_naive(cfg, t, m):
    _check_attention(cfg, t=t, m=m)


def test_sigma_moe_matches_naive():
    cfg = TINY.replace(ff="sigma_moe", ff_n_experts=5, ff_expert_size=7, ff_k=2)
    torch.manual_seed(0)
    ff = SigmaMoE(cfg).double().eval()
    x = torch.randn(3, 4, cfg.d_model, dtype=torch.float64)
    got = ff(x)
    for b in range(3):
        torch.testing.assert_close(got[b], naive.sigma_moe(ff, x[b]), rtol=1e-9, atol=1e-9)


def test_sigma_moe_entropy_regulariser():
    cfg = TINY.replace(ff="sigma_moe", ff_n_experts=4, ff_expert_size=5, ff_k=2, ff_entropy_coef=0.5)
    ff = SigmaMoE(cfg).double()
    x = torch.randn(2, 3, cfg.d_model, dtype=torch.float64)
    ff(x)
    p = torch.softmax(x.reshape(6, -1) @ ff.sel.detach().T, -1).mean(0)
    assert torch.allclose(ff.last_aux, 0.5 * (p * p.log()).sum())
    # Uniform routing is the entropy maximum: the regulariser is then at its minimum, -coef * log(E).
    with torch.no_grad():
        ff.sel.zero_()
    ff(x)
    assert torch.allclose(ff.last_aux, torch.tensor(-0.5 * torch.log(torch.tensor(4.0)).item(), dtype=torch.float64))


def test_lm_aux_loss_reaches_entropy_regulariser():
    model = TransformerLM(PRESETS["tiny-switchall"])
    model(torch.randint(0, 512, (2, 8)))
    aux = model.aux_loss()
    assert aux.requires_grad and aux.item() < 0
    assert TransformerLM(PRESETS["tiny-switchhead"]).aux_loss().item() == 0


def test_aux_loss_of_a_forward_over_several_chunks_is_the_mean_of_its_chunks():
    torch.manual_seed(0)
    model = TransformerLM(PRESETS["tiny-switchall"]).double().eval()
    t = model.config.chunk_len
    ids = torch.randint(0, 512, (2, 3 * t))
    model(ids)
    whole = model.aux_loss()
    per_chunk, memory = [], None
    for i in range(3):
        _, memory = model(ids[:, i * t:(i + 1) * t], memory)
        per_chunk.append(model.aux_loss())
    assert len(set(v.item() for v in per_chunk)) == 3  # the chunks' regularisers differ
    torch.testing.assert_close(whole, torch.stack(per_chunk).mean(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("projections", [("v",), ("k",), ("q",), ("o",), ("v", "o"), ()])
def test_only_sides_with_expert_projections_are_routed(projections):
    cfg = TINY.replace(moe_projections=projections, shared_selection=True)
    att = ATTENTION["switchhead"](cfg).eval()
    att.record = True
    with torch.no_grad():
        att(torch.randn(2, 5, cfg.d_model))
    want = {s for s, ps in (("v", "vk"), ("o", "oq")) if any(p in projections for p in ps)}
    assert set(att.last_routes) == want


def test_eval_mode_restores_every_submodule_s_own_mode():
    from switchhead.model.lm import eval_mode

    model = TransformerLM(PRESETS["tiny-switchhead"]).train()
    model.blocks[0].eval()  # frozen by its trainer: stays in eval mode afterwards
    before = [m.training for m in model.modules()]
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == before and not all(before)


def test_routing_gates_are_sigmoid_values_exactly_k_no_renormalisation():
    torch.manual_seed(1)
    x = torch.randn(10, 24)
    w = torch.randn(3 * 5, 24)
    idx, gate = select_topk(x, w, n_groups=3, k=2)
    assert idx.shape == gate.shape == (10, 6)
    scores = torch.sigmoid(x @ w.T)
    for n in range(10):
        for h in range(3):
            ids = idx[n, h * 2:(h + 1) * 2]
            assert ((ids >= h * 5) & (ids < (h + 1) * 5)).all(), "a head must only use its own experts"
            assert len(set(ids.tolist())) == 2
            torch.testing.assert_close(gate[n, h * 2:(h + 1) * 2], scores[n, ids])
            assert set(ids.tolist()) == set((scores[n, h * 5:(h + 1) * 5].topk(2).indices + h * 5).tolist())
    assert not torch.allclose(gate.view(10, 3, 2).sum(-1), torch.ones(10, 3))


def test_routing_logits_stay_float32_under_autocast():
    """A logit rounded to bf16 (3 significant digits) flips top-k choices: routing computes in float32 inside
    autocast, and the same logits outside it."""
    x, w = torch.randn(6, 24, generator=torch.Generator().manual_seed(0)), torch.randn(8, 24)
    want = x.double() @ w.double().T
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = routing_logits(x, w)
    outside = routing_logits(x, w)
    assert inside.dtype == outside.dtype == torch.float32
    assert torch.equal(inside, outside)
    torch.testing.assert_close(inside.double(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_routing_ranks_logits_where_float32_sigmoids_saturate(order):
    """sigmoid(30) == sigmoid(18) == 1.0 in float32: ranking the sigmoid values chose by expert index among them."""
    logits = torch.tensor([30.0, 18.0, 25.0, 0.0])[list(order)]
    x, w = torch.eye(4)[:1], torch.zeros(4, 4)
    w[:, 0] = logits
    idx, gate = select_topk(x, w, n_groups=1, k=2)
    assert set(idx[0].tolist()) == {order.index(0), order.index(2)}
    torch.testing.assert_close(gate, torch.ones(1, 2))


def test_shared_selection_really_shares():
    att = ATTENTION["switchhead"](TINY.replace(shared_selection=True))
    assert att.sel_o is None and att.sel_v is not None
    x = torch.randn(7, TINY.d_model)
    assert all(torch.equal(a, b) for a, b in zip(att.route(x, "v"), att.route(x, "o")))
    separate = ATTENTION["switchhead"](TINY)
    assert separate.sel_o is not None and separate.sel_o is not separate.sel_v
    n_shared = sum(p.numel() for p in att.parameters())
    assert sum(p.numel() for p in separate.parameters()) - n_shared == TINY.n_heads * TINY.n_experts * TINY.d_model


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("tiny")] + ["odd-width"])
def test_lm_matches_naive_over_chunks_with_memory(name):
    # odd-width: an odd d_model, whose sinusoid has one sine more than cosines
    cfg = PRESETS["tiny-switchhead"].replace(d_model=13) if name == "odd-width" else PRESETS[name]
    cfg = cfg.replace(vocab_size=41, chunk_len=5)
    torch.manual_seed(3)
    model = TransformerLM(cfg).double().eval()
    ids = torch.randint(0, 41, (2, 12))  # 5 + 5 + 2: the last chunk is partial
    got, mem = model(ids)
    for b in range(2):
        torch.testing.assert_close(got[b], naive.lm_forward(model, ids[b]), rtol=1e-8, atol=1e-8)
    # Chunk by chunk with the returned memory is the same computation.
    first, mem1 = model(ids[:, :5])
    second, mem2 = model(ids[:, 5:10], mem1)
    torch.testing.assert_close(torch.cat([first, second], 1), got[:, :10])
    if cfg.mem_chunks:
        assert mem1.shape == (cfg.n_layers, 2, 5, cfg.d_model) and not mem1.requires_grad
    else:
        assert mem1 is None and mem is None


@pytest.mark.parametrize("name", ["tiny-switchhead", "tiny-transformer", "tiny-moa", "tiny-switchhead-rope"])
def test_causality(name):
    cfg = PRESETS[name]
    model = TransformerLM(cfg).double().eval()
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.chunk_len))
    _, mem = model(torch.randint(0, cfg.vocab_size, (1, cfg.chunk_len)))
    for memory in (None, mem):
        base, _ = model(ids, memory)
        changed = ids.clone()
        changed[0, 9:] = (changed[0, 9:] + 1) % cfg.vocab_size
        other, _ = model(changed, memory)
        # Float64 so that only a real leak (not matmul batching order) could exceed the tolerance.
        torch.testing.assert_close(base[:, :9], other[:, :9], rtol=0, atol=1e-12)
        assert not torch.allclose(base[:, 9:], other[:, 9:])


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("tiny")])
def test_every_parameter_gets_a_gradient(name):
    cfg = PRESETS[name]
    model = TransformerLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.chunk_len))
    _, mem = model(ids)
    logits, _ = model(ids, mem)  # with memory, so the positional terms over memory are used too
    (logits.logsumexp(-1).mean() + model.aux_loss()).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


def test_paper_init_scales():
    cfg = PRESETS["tiny-switchhead"].replace(d_model=256, d_head=64, n_layers=8)
    att = ATTENTION["switchhead"](cfg)
    ws = (2 / 8) ** 0.5
    assert abs(att.w_v.std().item() - ws / 256 ** 0.5) < 0.05 * ws / 256 ** 0.5
    assert abs(att.w_o.std().item() - ws / (2 * 64) ** 0.5) < 0.05 * ws / (2 * 64) ** 0.5
    assert abs(att.pos.weight.std().item() - ws / 256 ** 0.5) < 0.05 * ws / 256 ** 0.5
    ff = SigmaMoE(cfg.replace(ff="sigma_moe", ff_n_experts=8, ff_expert_size=32))
    norms = ff.sel.norm(dim=1)
    torch.testing.assert_close(norms, norms.mean().expand(8))


def test_block_is_pre_ln_with_memory_through_ln1():
    cfg = TINY
    torch.manual_seed(0)
    block = Block(cfg).double().eval()
    x = torch.randn(1, 4, cfg.d_model, dtype=torch.float64)
    mem = torch.randn(1, 6, cfg.d_model, dtype=torch.float64)
    h = block.attn(block.ln1(x), block.ln1(mem)) + x
    torch.testing.assert_close(block(x, mem), h + block.ff(block.ln2(h)))


def test_forward_rejects_bad_memory_and_input():
    from switchhead.errors import SwitchheadError

    model = TransformerLM(PRESETS["tiny-switchhead"])
    ids = torch.zeros(2, 3, dtype=torch.long)
    _, memory = model(ids)  # [2 layers, 2, 3, 64]
    cases = [
        ((ids, torch.zeros(2, 3, 4, 64)), "memory has shape (2, 3, 4, 64); expected [2, 2, M, 64]"),
        ((ids, memory[..., :32]), "memory has shape (2, 2, 3, 32)"),
        ((ids, memory[0]), "memory has shape (2, 3, 64)"),
        ((ids, memory.double()), "memory is torch.float64 on cpu; the model is torch.float32 on cpu"),
        ((ids, memory.to("meta")), "memory is torch.float32 on meta"),
        ((torch.zeros(1, 0, dtype=torch.long),), "with batch, tokens >= 1, got (1, 0)"),
        ((torch.zeros(0, 3, dtype=torch.long),), "with batch, tokens >= 1, got (0, 3)"),
        ((torch.zeros(3, dtype=torch.long),), "got (3,)"),
        ((ids.float(),), "token ids must be an integer tensor, got torch.float32"),
        # integer kinds the embedding does not take failed inside it (uint8 ids 256 apart are one id)
        ((ids.to(torch.uint8),), "token ids must be an integer tensor, got torch.uint8 (int64 or int32 are taken)"),
        ((ids.to(torch.int16),), "got torch.int16"),
        ((ids.to(torch.complex64),), "got torch.complex64"),
        ((ids + 512,), "token id 512 is outside the vocabulary [0, 512)"),
        ((ids - 1,), "token id -1 is outside"),
    ]
    for args, message in cases:
        with pytest.raises(SwitchheadError, match=re.escape(message)):
            model(*args)
    model(ids.int(), memory)  # int32 ids and the returned memory are fine


def test_config_is_a_model_config():
    assert isinstance(TINY, ModelConfig)


def test_relative_position_table_memo_is_never_stale():
    att = ATTENTION["switchhead"](TINY)
    with torch.no_grad():
        first = att.rel_pos(6)
        assert att.rel_pos(6) is first  # memoised in inference
        att.pos.weight.mul_(2)
        torch.testing.assert_close(att.rel_pos(6), 2 * first)
    assert att.rel_pos(6).requires_grad  # training: always recomputed, differentiable


def test_frozen_position_weight_trains_after_inference_mode():
    # A frozen positional projection is memoised with grad enabled as well; a table made under inference mode
    # (as generation runs) must not reach a training forward, where autograd refuses to save it.
    model = TransformerLM(TINY)
    for block in model.blocks:
        block.attn.pos.weight.requires_grad_(False)
    ids = torch.randint(0, TINY.vocab_size, (1, 5))
    with torch.inference_mode():
        model(ids)
    logits, _ = model(ids)
    logits.float().mean().backward()
    assert model.blocks[0].attn.pos.weight.grad is None and model.embed.weight.grad is not None


@pytest.mark.parametrize("name", ["tiny-switchhead", "tiny-switchall", "tiny-moa"])
def test_bfloat16_autocast_trains_and_stays_close_to_float32(name):
    cfg = PRESETS[name]
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.chunk_len))
    want, _ = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = model(ids)
    assert got.dtype == torch.bfloat16
    # Mean, not max: bf16 rounding upstream can legitimately flip a near-tie expert choice for a token.
    assert (got.float() - want).abs().mean() < 0.02 * want.abs().mean()
    got.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


# SwitchHead V (2 heads, k = 2) and O, sigma-MoE up and down (k = 2); N = 2 takes the gather regime, N = 64 the
# dense one.
@pytest.mark.parametrize("n", [2, 64])
@pytest.mark.parametrize("n_in, slots, n_out, gated", [(1, 4, 2, True), (2, 4, 1, True), (1, 2, 2, False),
                                                       (2, 2, 1, True)], ids=["v", "o", "ff-up", "ff-down"])
def test_expert_projection_under_autocast_rounds_only_its_inputs_and_output(n, n_in, slots, n_out, gated):
    # Like F.linear under autocast: the inputs are cast to bf16, then the op computes as it does on bf16 tensors
    # (products accumulated in float32) and only its result is rounded. Autocast must not reach the PyTorch
    # paths' own matmuls and round per-slot products or gated inputs to bf16 on the way.
    torch.manual_seed(n + slots)
    x, w = torch.randn(n, n_in, 16), torch.randn(6, 16, 24)
    index = torch.rand(n, 6).argsort(-1)[:, :slots]  # distinct experts per token, as top-k gives
    gate = torch.rand(n, slots) if gated else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = moe_project(x, w, index, gate, n_out)
    bf = torch.bfloat16
    want = expert_projection(x.to(bf), w.to(bf), index, None if gate is None else gate.to(bf), n_out)
    assert got.dtype == bf
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["tiny-switchhead", "tiny-switchall", "tiny-moa", "tiny-switchhead-rope-nomem"])
def test_model_compiles_without_graph_breaks_and_matches(name):
    # fullgraph=True raises at the first graph break; aot_eager traces forward and backward like inductor does,
    # without needing a C++ compiler. Training mode, so the CPU id check runs in the eager model.
    torch.compiler.reset()  # each test's model is new to dynamo: without this the cases share its recompile limit
    cfg = PRESETS[name].replace(vocab_size=41, chunk_len=5, dropout=0.0)
    torch.manual_seed(4)
    model = TransformerLM(cfg).double()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = lambda logits: logits.logsumexp(-1).mean() + model.aux_loss()  # noqa: E731
    for t in (12, 3):  # several chunks with a partial last one, then a new length (a second graph)
        ids = torch.randint(0, 41, (2, t))
        got, mem = compiled(ids)
        more, _ = compiled(ids, mem)
        for b in range(2):
            torch.testing.assert_close(got[b], naive.lm_forward(model, ids[b]), rtol=1e-8, atol=1e-8)
        _, want_mem = model(ids)
        torch.testing.assert_close(more, model(ids, want_mem)[0], rtol=1e-10, atol=1e-10)
        loss(compiled(ids, mem)[0]).backward()
        got_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        loss(model(ids, want_mem)[0]).backward()
        for (n, p), g in zip(model.named_parameters(), got_grads):
            torch.testing.assert_close(g, p.grad, rtol=1e-9, atol=1e-12, msg=n)
        model.zero_grad()


def test_sigma_moe_does_not_recompile_for_every_token_count():
    """With dynamic shapes, a new token count reuses the compiled graph: the entropy regulariser took log N of a
    size, which pinned N, so a compiled sigma-MoE model recompiled for every length (and failed under fullgraph
    once past the recompile limit)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.compiler.reset()
    counter = CompileCounterWithBackend("aot_eager")  # N is pinned where AOT autograd traces the graph
    torch.manual_seed(5)
    ff = SigmaMoE(PRESETS["tiny-switchall"])
    compiled = torch.compile(ff, backend=counter, dynamic=True)
    graphs = []
    for t in (7, 8, 9, 10):
        x = torch.randn(2, t, ff.cfg.d_model)
        torch.testing.assert_close(compiled(x), ff(x))
        graphs.append(counter.frame_count)
    assert graphs[1:] == [graphs[1]] * 3, graphs  # a second graph after the first call, none per length after it


def test_relative_position_table_memo_never_serves_an_autocast_table_to_full_precision():
    att = ATTENTION["switchhead"](TINY).eval()
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert att.rel_pos(6).dtype == torch.bfloat16
        assert att.rel_pos(6).dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert att.rel_pos(6).dtype == torch.bfloat16


def test_relative_position_table_memo_is_not_fooled_by_a_reused_address():
    # .to(bf16) and back frees the float32 weight, and its successor (same dtype, same version counter) is often
    # allocated at the freed address: the memo then served the table of the weight before rounding.
    from switchhead.model.layers import sinusoids

    for seed in range(5):
        att = _attn(TINY, seed).float().eval()
        with torch.no_grad():
            att.rel_pos(6)
            att.to(torch.bfloat16).float()
            want = att.pos(sinusoids(6, TINY.d_model)).view(6, -1, TINY.d_head) * att.pos_scale
            assert torch.equal(att.rel_pos(6), want)


def test_memory_returned_under_inference_mode_continues_a_training_forward():
    # Generation runs under inference mode; its memory is an inference tensor, which autograd refused to save.
    torch.manual_seed(0)
    model = TransformerLM(TINY)
    ids = torch.randint(0, TINY.vocab_size, (2, 5))
    with torch.inference_mode():
        _, memory = model(ids)
    logits, _ = model(ids, memory)
    logits.mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    torch.testing.assert_close(logits, model(ids, model(ids)[1])[0], rtol=0, atol=0)


def test_deepcopy_after_a_training_forward():
    # The sigma-MoE regulariser of the last forward holds its autograd graph, which copy.deepcopy refuses; an EMA
    # or best-model snapshot taken between steps must still work and keep the regulariser's value.
    import copy

    model = TransformerLM(PRESETS["tiny-switchall"])
    model(torch.zeros(1, 3, dtype=torch.long))
    copied = copy.deepcopy(model)
    assert torch.equal(copied.aux_loss(), model.aux_loss().detach())
    assert copied._sigma_moe[0] is copied.blocks[0].ff
    model.aux_loss().backward()  # the original's graph is untouched


def test_record_attention_takes_a_bool():
    model = TransformerLM(PRESETS["tiny-switchhead"])
    with pytest.raises(SwitchheadError, match="record_attention takes True or False, got 'no'"):
        model.record_attention("no")  # was truthy: recording switched on
    assert not any(block.attn.record for block in model.blocks)
