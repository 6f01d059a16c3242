"""How well the CPU regime rule (`torch_paths.choose_regime`) picks between dense and grouped, on measured tables.

    python benchmarks/kernels.py --threads 1 --n 16 32 64 128 256 512 1024 2048 --regimes dense grouped > a.md
    python benchmarks/regime_fit.py a.md b.md ...          # each CPU_COSTS kind, per table and over all of them
    python benchmarks/regime_fit.py a.md b.md ... --grid   # and the grid's best constants over all the tables
    python benchmarks/kernels.py --threads 1 --n 1 2 4 8 16 --regimes gather dense grouped > g.md
    python benchmarks/regime_fit.py --bag g.md ...          # the embedding_bag's threshold (bag_max_pairs)
    python benchmarks/kernels.py --threads 1 --n 1 2 3 4 6 8 --regimes gather dense grouped > b.md
    python benchmarks/regime_fit.py --gather-backward b.md ...   # the backward's (gather_backward_max_pairs)

Reads the markdown rows of `--regimes dense grouped` tables (any table with the columns `case`, `N`, `dense fwd`,
`dense bwd`, `grouped fwd`, `grouped bwd` and the cases of `benchmarks/kernels.py`). Each cell is scored by the time
of the regime the rule picks over the better of the two; cells where the rule picks neither (combo, gather) do not
count. Printed: the geometric mean of that ratio and the worst cell, for each pass with its own constants (forward,
backward of input-contracting shapes, backward of input-expanding ones). With --bag, `--regimes gather dense` tables
instead: each forward cell scored with the gather (one embedding_bag) picked up to a number of (token, slot) pairs
and dense above it, for several such numbers; with `--regimes gather dense grouped` tables, above it the regime each
kind's rule picks without the bag (dense or grouped). With --gather-backward, `--regimes gather dense grouped`
tables: each backward cell scored with the gather picked up to one number of pairs for input-expanding shapes (I <= R)
and another for input-contracting ones, for every pair of such numbers; above them the regime each kind's rule picks
without the gather (dense or grouped).
"""

from __future__ import annotations

import argparse
import math
import sys

from kernels import CASES, Case

from switchhead.kernels import torch_paths
from switchhead.kernels.torch_paths import CpuCosts

COLUMNS = ("dense fwd", "dense bwd", "grouped fwd", "grouped bwd")
BAG_COLUMNS = ("gather fwd", "dense fwd")  # and "grouped fwd" where the table has it
BAG_PAIRS = (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # thresholds --bag scores
GATHER_BACKWARD_COLUMNS = ("gather bwd", "dense bwd", "grouped bwd")
GATHER_BACKWARD_PAIRS = (0, 4, 6, 8, 12, 16, 24, 32)  # thresholds --gather-backward scores, for each kind of shape
PASSES = ("forward", "backward (I > R)", "backward (I <= R)")  # CpuCosts' constants, by `torch_paths.cost_pass`
# case, N, backward, dense ms, grouped ms (--bag: gather ms, dense ms, and grouped ms as a sixth item where the table
# has it; --gather-backward: gather ms, dense ms, and grouped ms as a sixth item)
Cell = tuple[Case, int, bool, float, float] | tuple[Case, int, bool, float, float, float]


def read_cells(text: str, bag: bool = False, gather_backward: bool = False) -> list[Cell]:
    """The cells of every table with the regimes' columns (--bag: the gather's and dense's forward, and grouped's
    where the table has it; --gather-backward: the gather's backward beside dense's and grouped's)."""
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
                cells.append((case, int(row["N"]), True, *(float(row[c]) for c in GATHER_BACKWARD_COLUMNS)))
                continue
            if bag:
                times = (float(row[c]) for c in BAG_COLUMNS + ("grouped fwd",) if c in row)
                cells.append((case, int(row["N"]), False, *times))
                continue
            for backward, (a, b) in [(False, COLUMNS[0::2]), (True, COLUMNS[1::2])]:
                cells.append((case, int(row["N"]), backward, float(row[a]), float(row[b])))
    return cells


def _summary(scored: list[tuple[float, str]]) -> tuple[float, float, str, int]:
    """Geometric mean of the ratios, the worst one, its cell, and how many."""
    worst, where = max(scored, default=(1.0, "-"))
    mean = math.exp(sum(math.log(r) for r, _ in scored) / len(scored)) if scored else 1.0
    return mean, max(worst, 1.0), where if worst > 1.0 else "-", len(scored)


def _pick(case: Case, n: int, backward: bool, costs: CpuCosts, bag: bool = False) -> str:
    shape = (n, case.n_in, case.slots, case.n_out, case.heads * case.experts, case.d_in, case.d_out)
    return torch_paths.choose_regime(*shape, backward, bag=bag, costs=costs)


def _above_gather(case: Case, n: int, backward: bool, costs: CpuCosts, dense: float, grouped: float) -> float:
    """The time of the regime (dense or grouped) that `costs` picks for this cell with the gather ruled out (the
    forward's as one embedding_bag, as --bag scores it)."""
    none = costs._replace(bag_max_pairs=0, gather_backward_max_pairs={"expand": 0, "contract": 0})
    return dense if _pick(case, n, backward, none, bag=not backward) == "dense" else grouped


def score(cells: list[Cell], costs: CpuCosts, pass_: int) -> tuple[float, float, str, int]:
    """Geometric mean of picked / best time over the cells of this pass (`torch_paths.cost_pass`), the worst ratio,
    its cell, and the number of cells scored."""
    scored = []
    for case, n, bwd, dense, grouped in cells:
        if torch_paths.cost_pass(bwd, case.n_in, case.n_out) != pass_:
            continue
        pick = _pick(case, n, bwd, costs)
        if pick in ("dense", "grouped"):
            scored.append(((dense if pick == "dense" else grouped) / min(dense, grouped), f"{case.name} N={n}"))
    return _summary(scored)


def score_bag(cells: list[Cell], max_pairs: int, costs: CpuCosts | None = None) -> tuple[float, float, str, int]:
    """The same for the gather (embedding_bag) forward picked up to `max_pairs` (token, slot) pairs; above it dense,
    or, in cells with grouped's forward, the regime (dense or grouped) that `costs` picks without the bag."""
    scored = []
    for case, n, _, gather, dense, *grouped in cells:
        other = _above_gather(case, n, False, costs, dense, *grouped) if grouped and costs else dense
        pick = gather if n * case.slots <= max_pairs else other
        scored.append((pick / min(gather, other), f"{case.name} N={n}"))
    return _summary(scored)


def score_gather_backward(
    cells: list[Cell], expand_pairs: int, contract_pairs: int, costs: CpuCosts
) -> tuple[float, float, str, int]:
    """The same for the gather backward picked up to `expand_pairs` pairs for input-expanding shapes and up to
    `contract_pairs` for the others, above them the regime (dense or grouped) that `costs` picks without it."""
    scored = []
    for case, n, _, gather, dense, grouped in cells:
        expands = torch_paths.dense_expands_inputs(case.n_in, case.n_out)
        other = _above_gather(case, n, True, costs, dense, grouped)
        pick = gather if n * case.slots <= (expand_pairs if expands else contract_pairs) else other
        scored.append((pick / min(gather, other), f"{case.name} N={n}"))
    return _summary(scored)


def _row(label: str, cells: list[Cell], costs: CpuCosts) -> str:
    scores = (score(cells, costs, pass_) for pass_ in range(len(PASSES)))
    parts = [f"{m:.3f} (worst {w:.2f}, {where}; {k} cells)" for m, w, where, k in scores]
    return f"| {label} | " + " | ".join(parts) + " |"


def grid(cells: list[Cell], pass_: int, top: int) -> list[str]:
    """The constants of the pass that lose least over the cells (ties: every one of them shown up to `top`)."""
    results = []
    for per_element in range(0, 161, 4):
        for step in range(61):  # 5e4 to 4.5e7 multiply-adds
            per_expert = 0.05e6 * 1.12**step
            costs = torch_paths.CPU_COSTS["default"]._replace(
                per_expert=(per_expert,) * 3, per_element=(float(per_element),) * 3
            )
            results.append((round(score(cells, costs, pass_)[0], 4), per_element, per_expert))
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
        for kind, costs in torch_paths.CPU_COSTS.items():
            now = costs.gather_backward_max_pairs
            print(f"\n## {kind} (now {now['expand']}, {now['contract']}): above the gather, its dense or grouped\n")
            print("| expanding | contracting | backward over all tables |\n|---|---|---|")
            for expand in GATHER_BACKWARD_PAIRS:
                for contract in GATHER_BACKWARD_PAIRS:
                    mean, worst, where, count = score_gather_backward(every, expand, contract, costs)
                    print(f"| {expand} | {contract} | {mean:.3f} (worst {worst:.2f}, {where}; {count} cells) |")
        return
    if args.bag:
        # Above the bag: dense, or, where the tables have grouped's forward, each kind's own pick (a table per kind).
        kinds = torch_paths.CPU_COSTS.items() if any(len(cell) > 5 for cell in every) else [(None, None)]
        for kind, costs in kinds:
            every_kind = ", ".join(f"{k} {c.bag_max_pairs}" for k, c in torch_paths.CPU_COSTS.items())
            now = f"{kind} {costs.bag_max_pairs}" if kind else every_kind
            above = f"{kind}'s dense or grouped" if kind else "dense"
            print(f"\n| pairs | forward over all tables, {above} above (now {now}) |\n|---|---|")
            for pairs in BAG_PAIRS:
                mean, worst, where, count = score_bag(every, pairs, costs)
                print(f"| {pairs} | {mean:.3f} (worst {worst:.2f}, {where}; {count} cells) |")
        return
    for kind, costs in torch_paths.CPU_COSTS.items():
        print(f"\n## {kind}: {costs}\n\n| table | " + " | ".join(PASSES) + " |\n|---|---|---|---|")
        for path, cells in tables.items():
            print(_row(path, cells, costs))
        if len(tables) > 1:
            print(_row("all", every, costs))
    if args.grid:
        for pass_, name in enumerate(PASSES):
            print(f"\nbest over all tables, {name}:")
            print("\n".join(grid(every, pass_, args.top)))


if __name__ == "__main__":
    main()
