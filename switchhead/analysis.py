"""Attention and expert-selection inspection (the paper's analysis section) as plain data, figures and HTML.

Three layers, usable separately:

- `collect(model, ids)` runs the text chunk by chunk with the XL memory (exactly as training saw it) and keeps,
  per chunk and layer, the attention probabilities [H, T, S] (S = memory columns first, then the chunk) and the
  V/O expert choices as numpy arrays (`ChunkTrace` / `LayerTrace`);
- `render(...)` draws them with matplotlib (Agg canvas, no pyplot state) and writes ``index.html``;
- `to_json(...)` gives the raw numbers for people who plot elsewhere.

Figures are windowed so the token labels stay readable: each covers at most `window` query rows and the
`2 * window` key columns that end at the window's last query (memory columns included when they fall inside);
its title says how much of the rows' attention mass lies on the columns it shows.
"""

from __future__ import annotations

import html
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from switchhead.errors import SwitchheadError, is_int
from switchhead.fileio import as_path, atomic_directory, check_output_dir, read_utf8
from switchhead.model.lm import TransformerLM, check_ids, eval_mode
from switchhead.model.tokenizer import check_tokenizer
from switchhead.runtime.sampling import check_utf8

DEFAULT_WINDOW = 64
JSON_NAME = "attention.json"
INDEX_NAME = "index.html"
_TITLE = "<title>switchhead inspect</title>"  # also how an earlier report is recognised
_CELL_IN = 0.15  # inches per token cell: 6 pt labels fit without overlapping


# ------------------------------------------------------------------------------------------------ data
@dataclass
class LayerTrace:
    """One layer on one chunk. `v`/`o` are (experts, gates), each [tokens, groups, k], or None when that side is
    dense. For SwitchHead groups = heads; for MoA there is one group whose k slots are the attention maps."""

    probs: np.ndarray  # [H, T, S]
    v: tuple[np.ndarray, np.ndarray] | None
    o: tuple[np.ndarray, np.ndarray] | None


@dataclass
class ChunkTrace:
    index: int
    start: int  # text position of the chunk's first token
    memory: int  # memory columns in front of it (previous chunk's tokens)
    layers: dict[int, LayerTrace] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return next(iter(self.layers.values())).probs.shape[1]

    @property
    def key_start(self) -> int:
        """Text position of key column 0."""
        return self.start - self.memory


def n_maps(cfg) -> int:
    """Attention maps per layer: heads (SwitchHead, dense) or selected expert slots (MoA, k == n_heads)."""
    return cfg.n_heads


def head_selection(cfg, trace: LayerTrace, side: str, head: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(experts, gates) [tokens, k'] that fed attention map `head` on `side` ("v" or "o"), or None if dense.

    MoA's map j is produced by the expert in slot j of its single group, so it gets that one column."""
    route = trace.v if side == "v" else trace.o
    if route is None:
        return None
    experts, gates = route
    if cfg.attention == "moa":
        return experts[:, 0, head:head + 1], gates[:, 0, head:head + 1]
    return experts[:, head], gates[:, head]


def selection_scores(experts: np.ndarray, gates: np.ndarray, n_experts: int) -> np.ndarray:
    """[tokens, E]: the gate of each chosen expert, 0 for experts not chosen."""
    out = np.zeros((experts.shape[0], n_experts), dtype=np.float32)
    np.put_along_axis(out, experts.astype(np.int64), gates.astype(np.float32), axis=1)
    return out


def parse_indices(spec: str | None, what: str) -> list[int] | None:
    """"0,2,5" -> [0, 2, 5]; None/empty -> None (all). A list of indices is taken as it is (checked later)."""
    if isinstance(spec, (list, tuple, range)):
        return list(spec)
    if spec is not None and not isinstance(spec, str):
        raise SwitchheadError(f"--{what} must be comma-separated integers such as 0,2, or a list of them; got "
                              f"{spec!r}")
    if spec is None or not spec.strip():
        return None
    try:
        values = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise SwitchheadError(f"--{what} must be comma-separated integers such as 0,2; got {spec!r}") from None
    if not values:
        raise SwitchheadError(f"--{what} is empty: {spec!r}")
    return sorted(set(values))


def _check_range(values: Sequence[int] | None, n: int, what: str) -> list[int]:
    """`values` (None: all n) as sorted distinct indices, each in [0, n)."""
    if values is None:
        return list(range(n))
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, range, set, frozenset)):
        raise SwitchheadError(f"the {what}s must be a list of integers, got {type(values).__name__}")
    if not values:
        raise SwitchheadError(f"no {what} given: name at least one, or none for all {n}")
    if bad := [v for v in values if not is_int(v)]:  # a list: a falsy bad value (False, 0.0, None) still counts
        raise SwitchheadError(f"{what} indices must be integers, got {bad[0]!r}")
    bad = [v for v in values if not 0 <= v < n]
    if bad:
        raise SwitchheadError(f"{what} {bad[0]} out of range: the model has {n} {what}s (0..{n - 1})")
    return sorted(set(values))


def _check_model(model) -> None:
    if not isinstance(model, TransformerLM):
        raise SwitchheadError(f"inspect needs a TransformerLM (e.g. from switchhead.load), got {type(model).__name__}")


def collect(model, ids: Sequence[int], layers: Sequence[int] | None = None) -> list[ChunkTrace]:
    """Attention and selections of every chunk of `ids` (one sequence), run with the XL memory.

    The model's own chunked forward keeps only the last chunk in the hook, so the chunks are fed here one at a
    time with the returned memory; the model is put in eval mode (no dropout) and restored afterwards."""
    _check_model(model)
    cfg = model.config
    if hasattr(ids, "tolist") and getattr(ids, "ndim", 1) == 1:  # a tensor or array of one sequence
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise SwitchheadError(f"ids must be one sequence of token ids, got {type(ids).__name__}")
    if len(ids) == 0:
        raise SwitchheadError("nothing to inspect: the text has no tokens")
    check_ids([ids], cfg.vocab_size)  # a float id would be truncated by as_tensor, not refused
    layers = _check_range(layers, cfg.n_layers, "layer")
    device = next(model.parameters()).device
    ids_t = torch.as_tensor(list(ids), dtype=torch.long, device=device)[None]
    model.record_attention(True)
    chunks: list[ChunkTrace] = []
    memory = None
    try:
        with torch.no_grad(), eval_mode(model):
            for c, start in enumerate(range(0, ids_t.shape[1], cfg.chunk_len)):
                _, memory = model(ids_t[:, start:start + cfg.chunk_len], memory)
                chunk = None
                for i in layers:
                    attn = model.blocks[i].attn
                    probs = attn.last_probs[0].float().cpu().numpy()
                    routes = {side: (e[0].cpu().numpy().astype(np.int16), g[0].float().cpu().numpy())
                              for side, (e, g) in attn.last_routes.items()}
                    if chunk is None:
                        chunk = ChunkTrace(c, start, probs.shape[2] - probs.shape[1])
                    chunk.layers[i] = LayerTrace(probs, routes.get("v"), routes.get("o"))
                chunks.append(chunk)
    finally:
        model.record_attention(False)
    return chunks


def expert_usage(cfg, chunks: list[ChunkTrace], layer: int) -> dict[str, np.ndarray]:
    """How often each expert was chosen over the text: {side: counts [groups, E]}.

    V is counted on each chunk's own tokens only: the memory columns are the previous chunk's tokens, whose
    choices were already counted there."""
    usage: dict[str, np.ndarray] = {}
    for side in ("v", "o"):
        total = None
        for chunk in chunks:
            route = getattr(chunk.layers[layer], side)
            if route is None:
                break
            experts = route[0][chunk.memory:] if side == "v" else route[0]
            counts = np.stack([np.bincount(experts[:, g].ravel(), minlength=cfg.n_experts)
                               for g in range(experts.shape[1])])
            total = counts if total is None else total + counts
        if total is not None:
            usage[side] = total
    return usage


def balance(counts: np.ndarray) -> float:
    """Entropy of the usage distribution divided by log(E): 1 = perfectly balanced, 0 = one expert only."""
    p = counts / max(counts.sum(), 1)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum() / math.log(len(counts))) if len(counts) > 1 else 1.0


# ------------------------------------------------------------------------------------------------ JSON
def _digits(a: np.ndarray, significant: int = 7) -> list:
    """`a` as nested lists of floats with `significant` digits: about float32's precision, so nothing below it
    is lost (rounding to decimal places turned small probabilities into 0), written briefly (float32 values
    read as float64 print 17 digits: 0.008652999997138977)."""
    a = np.asarray(a, dtype=np.float64)
    with np.errstate(divide="ignore"):
        magnitude = np.floor(np.log10(np.abs(a), where=a != 0, out=np.zeros_like(a)))
    scale = 10.0 ** (significant - 1 - magnitude)
    return (np.round(a * scale) / scale).tolist()  # an integer over a power of ten: the shortest repr


def to_json(cfg, pieces: list[str], ids: Sequence[int], chunks: list[ChunkTrace], heads: list[int]) -> dict:
    """Plain nested lists: per chunk, layer and head the attention matrix [T][S] and the experts and gates each
    token chose ("v": one row per key column, memory first; "o": one row per query)."""
    def side(trace, name, h):
        sel = head_selection(cfg, trace, name, h)
        return None if sel is None else {"experts": sel[0].tolist(), "gates": _digits(sel[1])}

    layers = sorted(chunks[0].layers) if chunks else []
    return {
        "config": cfg.to_dict(),
        "tokens": list(pieces),
        "ids": [int(i) for i in ids],
        "layers": layers,
        "heads": heads,
        "usage": {str(i): {s: c.tolist() for s, c in expert_usage(cfg, chunks, i).items()} for i in layers},
        "chunks": [{
            "index": ch.index,
            "start": ch.start,
            "n_tokens": ch.n_tokens,
            "memory": ch.memory,
            "key_start": ch.key_start,
            "layers": [{
                "layer": i,
                "heads": [{
                    "head": h,
                    "attention": _digits(ch.layers[i].probs[h]),
                    "v": side(ch.layers[i], "v", h),
                    "o": side(ch.layers[i], "o", h),
                } for h in heads],
            } for i in layers],
        } for ch in chunks],
    }


# ------------------------------------------------------------------------------------------------ figures
def piece_label(piece: str) -> str:
    """Axis-label form of a SentencePiece piece: control characters made visible."""
    return piece.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r") or "''"


@dataclass
class Window:
    """Query rows [q0, q1) of a chunk against key columns [k0, k1) of its key window."""

    q0: int
    q1: int
    k0: int
    k1: int


def windows(chunk: ChunkTrace, window: int) -> list[Window]:
    out = []
    for q0 in range(0, chunk.n_tokens, window):
        q1 = min(q0 + window, chunk.n_tokens)
        k1 = chunk.memory + q1  # causal: nothing to the right of the last query is visible
        out.append(Window(q0, q1, max(0, k1 - 2 * window), k1))
    return out


def _new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> None:
    import matplotlib

    # Pieces contain '$', '_' and glyphs the default font lacks; neither should break or spam a figure.
    with matplotlib.rc_context({"text.parse_math": False}), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fig.savefig(path, bbox_inches="tight")


def attention_figure(path: Path, probs: np.ndarray, row_labels: list[str], col_labels: list[str],
                     memory_cols: int, title: str, o_scores: np.ndarray | None = None,
                     v_scores: np.ndarray | None = None) -> None:
    """One attention map [rows, cols] with token labels; optional selection-score strips: O [rows, E] to the
    right of the rows (queries), V [cols, E] under the columns (keys). `memory_cols` leading columns are memory."""
    rows, cols = probs.shape
    e_o = o_scores.shape[1] if o_scores is not None else 0
    e_v = v_scores.shape[1] if v_scores is not None else 0
    widths = [cols] + ([e_o] if e_o else []) + [1]
    heights = [rows] + ([e_v] if e_v else [])
    height = sum(heights) * _CELL_IN + 1.5
    fig = _new_figure((sum(widths) + 1) * _CELL_IN + 1.5, height)
    # Leave a fixed band above the axes so the title never runs into the O strip's labels.
    gs = fig.add_gridspec(len(heights), len(widths), width_ratios=widths, height_ratios=heights,
                          wspace=0.4 / max(sum(widths), 1) * len(widths), hspace=0.4 / max(sum(heights), 1),
                          top=1 - 0.7 / height)
    ax = fig.add_subplot(gs[0, 0])
    im = ax.imshow(probs, aspect="auto", cmap="viridis", vmin=0.0, vmax=max(float(probs.max()), 1e-6),
                   interpolation="nearest")
    font = dict(fontsize=6)
    ax.set_yticks(range(rows), row_labels, **font)
    ax.set_ylabel("query")
    label_ax = ax
    if e_v:
        vax = fig.add_subplot(gs[1, 0], sharex=ax)
        vax.imshow(v_scores.T, aspect="auto", cmap="Reds", vmin=0.0, vmax=1.0, interpolation="nearest")
        vax.set_yticks(range(e_v), [str(e) for e in range(e_v)], **font)
        vax.set_ylabel("V expert", fontsize=7)
        ax.tick_params(labelbottom=False)
        label_ax = vax
    label_ax.set_xticks(range(cols), col_labels, rotation=90, **font)
    label_ax.set_xlabel("key" + (" (grey: memory)" if memory_cols else ""))
    for tick in label_ax.get_xticklabels()[:memory_cols]:
        tick.set_color("grey")
    if 0 < memory_cols < cols:
        ax.axvline(memory_cols - 0.5, color="white", linewidth=0.8, linestyle="--")
    if e_o:
        oax = fig.add_subplot(gs[0, 1], sharey=ax)
        oax.imshow(o_scores, aspect="auto", cmap="Reds", vmin=0.0, vmax=1.0, interpolation="nearest")
        oax.set_xticks(range(e_o), [str(e) for e in range(e_o)], **font)
        oax.xaxis.set_ticks_position("top")
        oax.set_title("O expert", fontsize=7, pad=2)
        oax.tick_params(labelleft=False)
    cax = fig.add_subplot(gs[0, -1])
    fig.colorbar(im, cax=cax).ax.tick_params(labelsize=6)
    fig.suptitle(title, fontsize=8, y=1 - 0.1 / height, va="top")
    _save(fig, path)


def usage_figure(path: Path, usage: dict[str, np.ndarray], title: str, group_labels: list[str]):
    """Grouped bars: how often each expert was chosen, per head, one panel per side (V, O). Returns the figure."""
    sides = [s for s in ("v", "o") if s in usage]
    fig = _new_figure(4.0 * len(sides) + 1, 3.0)
    for j, side in enumerate(sides):
        ax = fig.add_subplot(1, len(sides), j + 1)
        counts = usage[side]
        n_groups, n_experts = counts.shape
        bar = 0.8 / n_groups
        top = 1.0 / n_experts
        for g in range(n_groups):
            share = counts[g] / max(counts[g].sum(), 1)
            top = max(top, float(share.max()))
            ax.bar(np.arange(n_experts) + (g - (n_groups - 1) / 2) * bar, share, bar,
                   label=f"{group_labels[g]} (balance {balance(counts[g]):.2f})")
        ax.axhline(1.0 / n_experts, color="black", linewidth=0.6, linestyle=":")  # perfect balance
        ax.set_xticks(range(n_experts))
        ax.set_xlabel(f"{side.upper()} expert")
        ax.set_ylabel("share of selections")
        # Room above the tallest bar for the legend, one line per group, so that it covers no bar.
        ax.set_ylim(0, top * (1.15 + 0.12 * n_groups))
        ax.legend(fontsize=6, loc="upper right")
    fig.suptitle(title, fontsize=8)
    _save(fig, path)
    return fig



# ------------------------------------------------------------------------------------------------ report
@dataclass
class InspectResult:
    out: Path
    index: Path
    figures: list[Path]
    json_path: Path | None
    n_tokens: int
    n_chunks: int
    layers: list[int]
    heads: list[int]
    window: int


def _describe(cfg) -> str:
    what = {"switchhead": f"SwitchHead, {cfg.n_heads} heads, E={cfg.n_experts}, k={cfg.k}, MoE "
                          f"{'/'.join(cfg.moe_projections).upper() or 'none'}",
            "dense": f"dense attention, {cfg.n_heads} heads",
            "moa": f"MoA, {cfg.k} of {cfg.n_experts} experts"}[cfg.attention]
    return (f"{cfg.name}: {what}; {cfg.n_layers} layers, {cfg.positional} positions, chunk {cfg.chunk_len}, "
            f"memory chunks {cfg.mem_chunks}")


def render(cfg, pieces: list[str], chunks: list[ChunkTrace], heads: list[int], out: Path,
           window: int = DEFAULT_WINDOW, progress: bool = False) -> tuple[Path, list[Path]]:
    """Write every figure and index.html into `out`; returns (index path, figure paths).

    Drawing the figures (hundreds for a long text) takes most of the time, hence the progress bar."""
    esc = html.escape
    labels = [piece_label(p) for p in pieces]
    layers = sorted(chunks[0].layers)
    moa = cfg.attention == "moa"
    head_word = "slot" if moa else "head"
    figures: list[Path] = []
    body: list[str] = []
    total = (len(layers) if cfg.attention != "dense" else 0) + sum(
        len(windows(ch, window)) for ch in chunks) * len(layers) * (1 + len(heads))
    bar = tqdm(total=total, desc="inspect", unit="fig", disable=not progress)

    def img(name: str, alt: str) -> str:
        figures.append(out / name)
        bar.update()
        return f'<a href="{esc(name)}"><img src="{esc(name)}" alt="{esc(alt)}"></a>'

    body.append("<h2>Expert usage over the whole text</h2>")
    if cfg.attention == "dense":
        body.append("<p>Dense attention: no routing.</p>")
    else:
        body.append("<p>Share of selections per expert; balance = entropy / log E (1 = uniform). "
                    "V counts each token once (memory columns are not counted again).</p>")
        group_labels = ["all slots"] if moa else [f"head {h}" for h in range(cfg.n_heads)]
        for i in layers:
            name = f"usage_L{i}.png"
            usage_figure(out / name, expert_usage(cfg, chunks, i), f"layer {i}: expert usage", group_labels)
            body.append(img(name, f"layer {i} expert usage"))

    for ch in chunks:
        body.append(f"<h2>Chunk {ch.index}: tokens {ch.start}&ndash;{ch.start + ch.n_tokens - 1}"
                    f" ({ch.memory} memory columns in front)</h2>")
        text = "".join(f'<span title="{ch.start + j}">{esc(p)}</span>'
                       for j, p in enumerate(pieces[ch.start:ch.start + ch.n_tokens]))
        body.append(f'<pre class="tokens">{text}</pre>')
        for w in windows(ch, window):
            rows = labels[ch.start + w.q0:ch.start + w.q1]
            cols = labels[ch.key_start + w.k0:ch.key_start + w.k1]
            mem_cols = max(0, min(ch.memory, w.k1) - w.k0)
            where = (f"queries {ch.start + w.q0}&ndash;{ch.start + w.q1 - 1}, keys "
                     f"{ch.key_start + w.k0}&ndash;{ch.key_start + w.k1 - 1}")
            body.append(f"<h3>{where}</h3>")
            for i in layers:
                trace = ch.layers[i]
                sub = trace.probs[:, w.q0:w.q1, w.k0:w.k1]
                shown = sub.sum(-1).mean(-1)  # per head: mean attention mass on the shown columns
                tag = f"c{ch.index}_q{w.q0}_L{i}"
                body.append(f"<h4>layer {i}</h4><div class=row>")
                peak = sub.max(0)
                attention_figure(out / f"{tag}_max.png", peak, rows, cols, mem_cols,
                                 f"layer {i}, max over {head_word}s; text positions {ch.start + w.q0}.."
                                 f"{ch.start + w.q1 - 1} x {ch.key_start + w.k0}..{ch.key_start + w.k1 - 1}")
                body.append(img(f"{tag}_max.png", f"layer {i} max over {head_word}s"))
                for h in heads:
                    scores = {}
                    for side, lo, hi in (("o", w.q0, w.q1), ("v", w.k0, w.k1)):
                        sel = head_selection(cfg, trace, side, h)
                        if sel is not None:
                            scores[side] = selection_scores(sel[0][lo:hi], sel[1][lo:hi], cfg.n_experts)
                    name = f"{tag}_h{h}.png"
                    attention_figure(out / name, sub[h], rows, cols, mem_cols,
                                     f"layer {i}, {head_word} {h} ({100 * shown[h]:.0f}% of the rows' attention "
                                     f"mass is on the shown keys)", scores.get("o"), scores.get("v"))
                    body.append(img(name, f"layer {i} {head_word} {h}"))
                body.append("</div>")

    strips = ("Strips: selection score of the chosen experts (their sigmoid gate; 0 = not chosen). "
              "O (destination side) is beside the query rows, V (source side) under the key columns."
              if cfg.attention == "switchhead" else
              "MoA: one attention map per selected-expert slot; the O strip shows that slot's expert and gate."
              if moa else "")
    page = f"""<!doctype html>
<html><head><meta charset="utf-8">{_TITLE}
<style>
body {{ font-family: sans-serif; margin: 1em 2em; }}
img {{ max-width: 100%; border: 1px solid #ddd; margin: 2px; vertical-align: top; }}
.row img {{ max-width: 48%; }}
pre.tokens {{ white-space: pre-wrap; background: #f6f6f6; padding: .5em; }}
pre.tokens span:nth-child(odd) {{ background: #e4ecf7; }}
</style></head><body>
<h1>switchhead inspect</h1>
<p>{esc(_describe(cfg))}. {len(pieces)} tokens in {len(chunks)} chunk(s); layers {esc(str(layers))}, {head_word}s
{esc(str(heads))}.</p>
<p>Each figure shows at most {window} query rows and the {2 * window} key columns ending at its last query
(memory columns, the previous chunk's tokens, in grey left of the dashed line); the title says how much of the
rows' attention mass falls on the columns shown. Rows are queries, columns keys; colour = softmax probability.
{esc(strips)} Token labels are SentencePiece pieces (&#9601; = space).</p>
{chr(10).join(body)}
</body></html>
"""
    bar.close()
    index = out / INDEX_NAME
    index.write_text(page, encoding="utf-8")
    return index, figures


def _load_model(ckpt: str | Path | None):
    from switchhead.model.checkpoint import load

    return load(ckpt)  # no ckpt: the built-in default model


def read_text(text: str | None, text_file: str | Path | None) -> str:
    if (text is None) == (text_file is None):
        raise SwitchheadError("give exactly one of --text or --text-file")
    if text_file is not None:
        text = read_utf8(as_path(text_file, "--text-file"))
    if not isinstance(text, str):
        raise SwitchheadError(f"the text to inspect must be a string, got {type(text).__name__}")
    if not text.strip():
        raise SwitchheadError("the text to inspect is empty")
    check_utf8(text, "the text to inspect")  # SentencePiece cannot take lone surrogates
    return text


def is_report(path: Path) -> bool:
    """An earlier report of `inspect`: its index.html, figures and JSON, nothing else."""
    return ((path / INDEX_NAME).is_file()
            and all(p.is_file() and (p.suffix == ".png" or p.name in (INDEX_NAME, JSON_NAME)) for p in path.iterdir())
            and _TITLE in (path / INDEX_NAME).read_text(encoding="utf-8", errors="replace"))


def prepare_out(out: str | Path) -> Path:
    """`out` as a Path, if the report may go there: a new or empty directory, or an earlier report (which is
    replaced as a whole, so no figure of it is left behind)."""
    return check_output_dir(as_path(out, "--out"), is_report, "an earlier inspect report")


def inspect_text(model, tokenizer, text: str, out: str | Path, layers: Sequence[int] | None = None,
                 heads: Sequence[int] | None = None, write_json: bool = False,
                 window: int = DEFAULT_WINDOW, progress: bool = False) -> InspectResult:
    """Collect, draw and (optionally) dump the attention of `model` on `text` into directory `out`."""
    _check_model(model)
    cfg = model.config
    if tokenizer is None:
        raise SwitchheadError("the checkpoint has no tokenizer.model; inspect needs it to label the tokens")
    check_tokenizer(tokenizer, cfg.vocab_size)
    if not is_int(window) or window < 1:
        raise SwitchheadError(f"--window must be a positive integer, got {window!r}")
    if not isinstance(text, str):
        raise SwitchheadError(f"the text to inspect must be a string, got {type(text).__name__}")
    if not text.strip():
        raise SwitchheadError("the text to inspect is empty")
    check_utf8(text, "the text to inspect")
    heads = _check_range(heads, n_maps(cfg), "head")
    layers = _check_range(layers, cfg.n_layers, "layer")
    out = prepare_out(out)
    ids = tokenizer.encode(text)
    pieces = [tokenizer.id_to_piece(i) for i in ids]
    chunks = collect(model, ids, layers)
    with atomic_directory(out) as tmp:  # a crash or Ctrl-C mid-way leaves no half-drawn report
        index, figures = render(cfg, pieces, chunks, heads, tmp, window, progress)
        if write_json:
            (tmp / JSON_NAME).write_text(json.dumps(to_json(cfg, pieces, ids, chunks, heads)), encoding="utf-8")
    return InspectResult(out, out / index.name, [out / f.name for f in figures],
                         out / JSON_NAME if write_json else None, len(ids), len(chunks), layers, heads, window)


def run_inspect(ckpt: str | Path | None, text: str | None, text_file: str | Path | None, out: str | Path,
                layers: str | None = None, heads: str | None = None, write_json: bool = False,
                window: int = DEFAULT_WINDOW, progress: bool = False) -> InspectResult:
    """The `switchhead inspect` command: everything but printing (index lists are "0,2" strings)."""
    text = read_text(text, text_file)
    layer_list, head_list = parse_indices(layers, "layers"), parse_indices(heads, "heads")
    prepare_out(out)  # fail before the (slow) model load
    model, tokenizer = _load_model(ckpt)
    return inspect_text(model, tokenizer, text, out, layer_list, head_list, write_json, window, progress)
