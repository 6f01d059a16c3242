"""Naive float64 implementations of the paper's formulas (explicit loops over heads, experts, positions),
written independently of switchhead.model.layers to check it. Inputs are one sequence: x [T, d], mem [M, d]."""

from __future__ import annotations

import math

import torch


def sinusoid(dist: int, d: int) -> torch.Tensor:
    """[sin(dist * f_i) for i < ceil(d/2)] + [cos(dist * f_i) for i < floor(d/2)], f_i = 10000^(-2i/d)."""
    n_sin = (d + 1) // 2
    out = torch.zeros(d, dtype=torch.float64)
    for i in range(n_sin):
        out[i] = math.sin(dist * 10000 ** (-2 * i / d))
    for i in range(d // 2):
        out[n_sin + i] = math.cos(dist * 10000 ** (-2 * i / d))
    return out


def rope(vec: torch.Tensor, pos: int) -> torch.Tensor:
    """Rotate-half rotary embedding on the first half of the channels."""
    rot = vec.shape[0] // 2
    half = rot // 2
    out = vec.clone()
    for i in range(half):
        angle = pos / 10000 ** (2 * i / rot)
        a, b = vec[i], vec[i + half]
        out[i] = a * math.cos(angle) - b * math.sin(angle)
        out[i + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


def topk_sigmoid(w_sel: torch.Tensor, row: torch.Tensor, head: int, n_experts: int, k: int):
    """[(expert, gate)] for one head: the k largest sigmoid scores, gate = the score itself."""
    scores = [(1 / (1 + math.exp(-float(w_sel[head * n_experts + e] @ row))), e) for e in range(n_experts)]
    return [(e, s) for s, e in sorted(scores, reverse=True)[:k]]


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    ex = [math.exp(v - m) for v in xs]
    return [v / sum(ex) for v in ex]


def switchhead_attention(att, x: torch.Tensor, mem: torch.Tensor | None) -> torch.Tensor:
    cfg = att.cfg
    h_n, e_n, k, dh = cfg.n_heads, cfg.n_experts, cfg.k, cfg.d_head
    p = {n: t.detach().double() for n, t in att.named_parameters()}
    sel_v = p.get("sel_v")
    sel_o = p.get("sel_o", sel_v)
    src = x if mem is None else torch.cat([mem, x])
    m = src.shape[0] - x.shape[0]
    scale = dh ** -0.25

    def proj(name, row, head, sel):
        w = p[f"w_{name}"]
        if cfg.is_moe(name):
            return sum(g * (row @ w[head * e_n + e]) for e, g in topk_sigmoid(sel, row, head, e_n, k))
        return w[head * dh:(head + 1) * dh] @ row

    keys = [[proj("k", src[s], h, sel_v) * scale for h in range(h_n)] for s in range(src.shape[0])]
    vals = [[proj("v", src[s], h, sel_v) for h in range(h_n)] for s in range(src.shape[0])]
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for h in range(h_n):
            q = proj("q", x[t], h, sel_o) * scale
            qpos = m + t
            if cfg.positional == "rope":
                q = rope(q, qpos)
            logits = []
            for s in range(qpos + 1):
                key = rope(keys[s][h], s) if cfg.positional == "rope" else keys[s][h]
                score = float(q @ key)
                if cfg.positional == "xl":
                    r = (p["pos.weight"][h * dh:(h + 1) * dh] @ sinusoid(qpos - s, cfg.d_model)) * scale
                    score += float(q @ r)
                logits.append(score)
            a = sum(pr * vals[s][h] for s, pr in enumerate(softmax(logits)))
            if cfg.is_moe("o"):
                for e, g in topk_sigmoid(sel_o, x[t], h, e_n, k):
                    out[t] += g * (a @ p["w_o"][h * e_n + e])
            else:
                out[t] += p["w_o"][:, h * dh:(h + 1) * dh] @ a
    return out


def dense_attention(att, x: torch.Tensor, mem: torch.Tensor | None) -> torch.Tensor:
    cfg = att.cfg
    h_n, dh = cfg.n_heads, cfg.d_head
    p = {n: t.detach().double() for n, t in att.named_parameters()}
    src = x if mem is None else torch.cat([mem, x])
    m = src.shape[0] - x.shape[0]
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        qpos = m + t
        heads = []
        for h in range(h_n):
            rows = slice(h * dh, (h + 1) * dh)
            q = p["w_q"][rows] @ x[t]
            logits, vs = [], []
            for s in range(qpos + 1):
                key = p["w_k"][rows] @ src[s]
                vs.append(p["w_v"][rows] @ src[s])
                if cfg.positional == "xl":
                    r = p["pos.weight"][rows] @ sinusoid(qpos - s, cfg.d_model)
                    score = float((q + p["u"][h]) @ key + (q + p["v"][h]) @ r)
                else:
                    score = float(rope(q, qpos) @ rope(key, s))
                logits.append(float(p["scale"]) * score)
            heads.append(sum(pr * v for pr, v in zip(softmax(logits), vs)))
        out[t] = p["w_o"] @ torch.cat(heads)
    return out


def moa_attention(att, x: torch.Tensor, mem: torch.Tensor | None) -> torch.Tensor:
    cfg = att.cfg
    p = {n: t.detach().double() for n, t in att.named_parameters()}
    src = x if mem is None else torch.cat([mem, x])
    m = src.shape[0] - x.shape[0]
    scale = cfg.d_head ** -0.25
    keys = [p["w_k"] @ src[s] * scale for s in range(src.shape[0])]
    vals = [p["w_v"] @ src[s] for s in range(src.shape[0])]
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        qpos = m + t
        sel_logits = sorted(((float(p["sel"][e] @ x[t]), e) for e in range(cfg.n_experts)), reverse=True)[:cfg.k]
        gates = (softmax([lg for lg, _ in sel_logits]) if cfg.moa_gate == "softmax"
                 else [1 / (1 + math.exp(-lg)) for lg, _ in sel_logits])
        for (_, e), g in zip(sel_logits, gates):
            q = (x[t] @ p["w_q"][e]) * scale
            logits = []
            for s in range(qpos + 1):
                if cfg.positional == "xl":
                    r = p["pos.weight"] @ sinusoid(qpos - s, cfg.d_model) * scale
                    logits.append(float(q @ keys[s] + q @ r))
                else:
                    logits.append(float(rope(q, qpos) @ rope(keys[s], s)))
            a = sum(pr * vals[s] for s, pr in enumerate(softmax(logits)))
            out[t] += g * (a @ p["w_o"][e])
    return out


def sigma_moe(ff, x: torch.Tensor) -> torch.Tensor:
    cfg = ff.cfg
    p = {n: t.detach().double() for n, t in ff.named_parameters()}
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        logits = sorted(((float(p["sel"][e] @ x[t]), e) for e in range(cfg.ff_n_experts)), reverse=True)
        for lg, e in logits[:cfg.ff_k]:
            hidden = torch.relu(x[t] @ p["w1"][e])
            out[t] += (1 / (1 + math.exp(-lg))) * (hidden @ p["w2"][e])
    return out


ATTENTION = {"switchhead": switchhead_attention, "dense": dense_attention, "moa": moa_attention}


@torch.no_grad()
def lm_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, vocab] of one sequence, processed in chunks of T with the previous chunk's layer inputs as
    memory (eval mode: no dropout)."""
    cfg = model.config
    attn = ATTENTION[cfg.attention]
    prev: list[torch.Tensor] | None = None
    outs = []
    for start in range(0, ids.shape[0], cfg.chunk_len):
        x = model.embed.weight.detach().double()[ids[start:start + cfg.chunk_len]]
        inputs = []
        for i, block in enumerate(model.blocks):
            inputs.append(x)
            h = block.ln1(x)
            mem = block.ln1(prev[i]) if prev is not None and cfg.mem_chunks else None
            x = x + attn(block.attn, h, mem)
            f = block.ln2(x)
            x = x + (sigma_moe(block.ff, f) if cfg.ff == "sigma_moe" else block.ff(f))
        prev = inputs
        outs.append(model.out(model.ln_f(x)))
    return torch.cat(outs).detach()
