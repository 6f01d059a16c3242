"""How well the CPU regime rule (`torch_paths.choose_regime`) picks between dense and grouped, on measured tables.

    python benchmarks/kernels.py --threads 1 --n 16 32 64 128 256 512 1024 2048 --regimes dense grouped > a.md
    python benchmarks/regime_fit.py a.md b.md ...          # each CPU_COSTS kind, per table and over all of them
    python benchmarks/regime_fit.py a.md b.md ... --grid   # and the grid's best constants over all the tables
    python benchmarks/kernels.py --threads 1 --n 1 2 4 8 16 --regimes gather dense > g.md
    python benchmarks/regime_fit.py --bag g.md ...          # the embedding_bag's threshold (bag_max_pairs)
    python benchmarks/kernels.py --threads 1 --n 1 2 3 4 6 8 --regimes gather dense grouped > b.md
    python benchmarks/regime_fit.py --gather-backward b.md ...   # the backward's (GATHER_BACKWARD_MAX_PAIRS)

Reads the markdown rows of `--regimes dense grouped` tables (any table with the columns `case`, `N`, `dense fwd`,
`dense bwd`, `grouped fwd`, `grouped bwd` and the cases of `benchmarks/kernels.py`). Each cell is scored by the time
of the regime the rule picks over the better of the two; cells where the rule picks neither (combo, gather) and the
backward of V-like shapes (always grouped) do not count. Printed: the geometric mean of that ratio and the worst cell,
forward and backward. With --bag, `--regimes gather dense` tables instead: each forward cell scored with the gather
(one embedding_bag) picked up to a number of (token, slot) pairs and dense above it, for several such numbers. With
--gather-backward, `--regimes gather dense grouped` tables: each backward cell scored with the gather picked up to
one number of pairs for input-expanding shapes (I <= R; above it grouped, as the rule has it) and another for
input-contracting ones (above it dense), for every pair of such numbers.
"""

from __future__ import annotations

import argparse
import math
import sys

from kernels import CASES, Case

from switchhead.kernels import torch_paths
from switchhead.kernels.torch_paths import CpuCosts

COLUMNS = ("dense fwd", "dense bwd", "grouped fwd", "grouped bwd")
BAG_COLUMNS = ("gather fwd", "dense fwd")
BAG_PAIRS = (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # thresholds --bag scores
GATHER_BACKWARD_COLUMNS = ("gather bwd", "dense bwd", "grouped bwd")
GATHER_BACKWARD_PAIRS = (0, 4, 6, 8, 12, 16, 24, 32)  # thresholds --gather-backward scores, for each kind of shape
# case, N, backward, dense ms, grouped ms (--bag: gather ms, dense ms; --gather-backward: gather ms, the other's ms)
Cell = tuple[Case, int, bool, float, float]


def read_cells(text: str, bag: bool = False, gather_backward: bool = False) -> list[Cell]:
    """The cells of every table with the regimes' columns (--bag: the gather's and dense's forward only;
    --gather-backward: the gather's backward beside grouped's for input-expanding shapes, dense's for the others)."""
    columns = BAG_COLUMNS if bag else GATHER_BACKWARD_COLUMNS if gather_backward else COLUMNS
    by_name = {c.name: c for c in CASES}
    cells: list[Cell] = []
    header: list[str] | None = None
    for line in text.splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| case |"):
            header = cols if all(c in cols for c in columns) else None
        elif header and line.startswith("|") and cols[0] in by_name:
            row, case = dict(zip(header, cols)), by_name[cols[0]]
            if gather_backward:
                other = "grouped bwd" if torch_paths.dense_expands_inputs(case.n_in, case.n_out) else "dense bwd"
                pairs = [(True, ("gather bwd", other))]
            else:
                pairs = [(False, columns)] if bag else [(False, COLUMNS[0::2]), (True, COLUMNS[1::2])]
            for backward, (a, b) in pairs:
                cells.append((case, int(row["N"]), backward, float(row[a]), float(row[b])))
    return cells


def _summary(scored: list[tuple[float, str]]) -> tuple[float, float, str, int]:
    """Geometric mean of the ratios, the worst one, its cell, and how many."""
    worst, where = max(scored, default=(1.0, "-"))
    mean = math.exp(sum(math.log(r) for r, _ in scored) / len(scored)) if scored else 1.0
    return mean, max(worst, 1.0), where if worst > 1.0 else "-", len(scored)


def _pick(cell: Cell, costs: CpuCosts) -> str:
    case, n, backward, _, _ = cell
    shape = (n, case.n_in, case.slots, case.n_out, case.heads * case.experts, case.d_in, case.d_out)
    return torch_paths.choose_regime(*shape, backward, costs=costs)


def score(cells: list[Cell], costs: CpuCosts, backward: bool) -> tuple[float, float, str, int]:
    """Geometric mean of picked / best time, the worst ratio, its cell, and the number of cells scored."""
    scored = []
    for cell in cells:
        case, n, bwd, dense, grouped = cell
        if bwd != backward or (bwd and case.n_in <= case.n_out):
            continue
        pick = _pick(cell, costs)
        if pick in ("dense", "grouped"):
            scored.append(((dense if pick == "dense" else grouped) / min(dense, grouped), f"{case.name} N={n}"))
    return _summary(scored)


def score_bag(cells: list[Cell], max_pairs: int) -> tuple[float, float, str, int]:
    """The same for the gather (embedding_bag) forward picked up to `max_pairs` (token, slot) pairs, dense above."""
    scored = []
    for case, n, _, gather, dense in cells:
        pick = gather if n * case.slots <= max_pairs else dense
        scored.append((pick / min(gather, dense), f"{case.name} N={n}"))
    return _summary(scored)


def score_gather_backward(cells: list[Cell], expand_pairs: int, contract_pairs: int) -> tuple[float, float, str, int]:
    """The same for the gather backward picked up to `expand_pairs` pairs for input-expanding shapes and up to
    `contract_pairs` for the others, the cell's other regime above."""
    scored = []
    for case, n, _, gather, other in cells:
        expands = torch_paths.dense_expands_inputs(case.n_in, case.n_out)
        pick = gather if n * case.slots <= (expand_pairs if expands else contract_pairs) else other
        scored.append((pick / min(gather, other), f"{case.name} N={n}"))
    return _summary(scored)


def _row(label: str, cells: list[Cell], costs: CpuCosts) -> str:
    scores = (score(cells, costs, backward) for backward in (False, True))
    parts = [f"{m:.3f} (worst {w:.2f}, {where}; {k} cells)" for m, w, where, k in scores]
    return f"| {label} | {parts[0]} | {parts[1]} |"


def grid(cells: list[Cell], backward: bool, top: int) -> list[str]:
    """The constants of the pass that lose least over the cells (ties: every one of them shown up to `top`)."""
    results = []
    for per_element in range(0, 161, 4):
        for step in range(41):
            per_expert = 0.5e6 * 1.12**step
            costs = CpuCosts(per_expert=(per_expert,) * 2, per_element=(float(per_element),) * 2)
            results.append((round(score(cells, costs, backward)[0], 4), per_element, per_expert))
    results.sort()
    return [f"  {m:.4f}: per_element {c}, per_expert {e:.3g}" for m, c, e in results[:top]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tables", nargs="+", help="files with `benchmarks/kernels.py --regimes dense grouped` output")
    parser.add_argument("--grid", action="store_true", help="also search the constants that fit the tables best")
    parser.add_argument("--top", type=int, default=8, help="with --grid: how many of the best to show")
    parser.add_argument("--bag", action="store_true", help="score the embedding_bag's threshold on gather/dense tables")
    parser.add_argument(
        "--gather-backward", action="store_true", help="score the backward gather's thresholds (gather/dense/grouped)"
    )
    args = parser.parse_args()
    if args.bag and args.gather_backward:
        parser.error("--bag and --gather-backward score different tables: one at a time")
    wanted = "gather/dense" if args.bag else "gather/dense/grouped" if args.gather_backward else "dense/grouped"
    tables = {}
    for path in args.tables:
        with open(path) as f:
            tables[path] = read_cells(f.read(), args.bag, args.gather_backward)
        if not tables[path]:
            sys.exit(f"regime_fit.py: no {wanted} rows in {path}")
    every = [cell for cells in tables.values() for cell in cells]
    if args.gather_backward:
        now = torch_paths.GATHER_BACKWARD_MAX_PAIRS
        print(f"\n| expanding | contracting | backward over all tables (now {now['expand']}, {now['contract']}) |")
        print("|---|---|---|")
        for expand in GATHER_BACKWARD_PAIRS:
            for contract in GATHER_BACKWARD_PAIRS:
                mean, worst, where, count = score_gather_backward(every, expand, contract)
                print(f"| {expand} | {contract} | {mean:.3f} (worst {worst:.2f}, {where}; {count} cells) |")
        return
    if args.bag:
        now = ", ".join(f"{kind} {costs.bag_max_pairs}" for kind, costs in torch_paths.CPU_COSTS.items())
        print(f"\n| pairs | forward over all tables (now {now}) |\n|---|---|")
        for pairs in BAG_PAIRS:
            mean, worst, where, count = score_bag(every, pairs)
            print(f"| {pairs} | {mean:.3f} (worst {worst:.2f}, {where}; {count} cells) |")
        return
    for kind, costs in torch_paths.CPU_COSTS.items():
        print(f"\n## {kind}: {costs}\n\n| table | forward | backward (I > R) |\n|---|---|---|")
        for path, cells in tables.items():
            print(_row(path, cells, costs))
        if len(tables) > 1:
            print(_row("all", every, costs))
    if args.grid:
        for backward in (False, True):
            print(f"\nbest over all tables, {'backward' if backward else 'forward'}:")
            print("\n".join(grid(every, backward, args.top)))


if __name__ == "__main__":
    main()
