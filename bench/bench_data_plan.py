"""Balance of tokens and vision work over data-parallel ranks: each rank packing its own samples
(the per-rank Energon loaders) vs the global data plan (energon_tasks/global_plan.py), side by
side in one run.

Simulated with bench/bench_vision_balance.py's samplers (Mantis-like photo sets, InfoVQA-like
pages, LLaVA-Video-like clips, and an even mix of the three; Qwen2.5-VL geometry) and the
vision cost of the same cost model (models.vision_dp.CostModel: patches, and the quadratic
term of full attention). ``--rows-per-rank`` (1) packed rows of ``--tokens`` tokens per rank per
step:

- per rank: each rank fills its row from its own stream, first fit in stream order;
- global plan: the step's samples come from one stream until they hold ``POOL`` (1.5) times the
  DP rows' tokens, are packed by ``pack_rows`` (the rest waits for the next step) and assigned by
  ``assign_rows``; the lower bound no split of whole samples can beat is the step's largest
  sample's vision cost over the mean rank's.

Reported per dataset and DP size (2, 8, 32): max / mean over the ranks of the tokens and of the
vision cost, mean and p95 over ``--steps`` steps, and the step time the plan saves by the cost
model: a step lasts as long as its slowest rank; with vision a share ``--vision-share`` of the
mean rank's compute, time ~ max over ranks of (share x vision / mean vision + (1 - share) x
tokens / mean tokens). For the plan also: the rows' mean fill (tokens / capacity), the planning
time per step (``pack_rows`` + ``assign_rows``, one process, mean and p95), and the most steps
any candidate was left out before it was trained (``pack_rows`` bounds it by ``--max-wait``).

    .venv/bin/python bench/bench_data_plan.py --out bench_out/data_plan [--rows-per-rank 4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_vision_balance as samplers  # noqa: E402

from energon_tasks.global_plan import MAX_WAIT, Item, assign_rows, pack_rows  # noqa: E402

DATASETS = ("mantis", "infovqa", "llava-video", "mix")
POOL = 1.5  #: candidates per step, in rows' worth of tokens (energon_tasks.planned_loader.POOL)


def draw(rng: random.Random, name: str, capacity: int) -> Item:
    """One sample (its tokens within one row) of dataset ``name`` (``mix``: any of the three)."""
    while True:
        which = rng.choice(list(samplers.SAMPLERS)) if name == "mix" else name
        grids, text = samplers.SAMPLERS[which](rng)
        tokens = text + sum(t * h * w // 4 for t, h, w in grids)
        if tokens <= capacity:  # the budget would shrink or skip it: drawn again here
            cost = sum(t * samplers.COST.cost(h * w) for t, h, w in grids)
            return Item((which, tokens), tokens, cost)


def per_rank(rngs: list[random.Random], name: str, capacity: int,
             carried: list[list[Item]]) -> list[tuple[int, float]]:
    """Each rank's (tokens, vision) of one row packed from its own stream (first fit)."""
    out = []
    for rank, rng in enumerate(rngs):
        row, tokens, vision = [], 0, 0.0
        while True:
            item = carried[rank].pop() if carried[rank] else draw(rng, name, capacity)
            if tokens + item.tokens > capacity:
                carried[rank].append(item)
                break
            row.append(item)
            tokens, vision = tokens + item.tokens, vision + item.vision
        out.append((tokens, vision))
    return out


def time_ratio(loads: list[tuple[int, float]], share: float) -> float:
    """Slowest rank's modelled time over the mean rank's."""
    tokens = statistics.fmean(t for t, _ in loads) or 1
    vision = statistics.fmean(v for _, v in loads) or 1
    times = [share * v / vision + (1 - share) * t / tokens for t, v in loads]
    return max(times) / statistics.fmean(times)


def simulate(name: str, dp: int, steps: int, capacity: int, share: float,
             per_rank_rows: int = 1, pool: float = POOL, max_wait: int = MAX_WAIT) -> dict:
    rngs = [random.Random(f"{name}-{dp}-{r}") for r in range(dp)]
    carried_ranks: list[list[Item]] = [[] for _ in range(dp)]
    stream, carried = random.Random(f"{name}-{dp}-global"), []
    result = {k: [] for k in ("base_tokens", "base_vision", "base_time", "plan_tokens",
                              "plan_vision", "plan_time", "bound_vision", "plan_fill",
                              "plan_ms", "waited")}
    for _ in range(steps):
        base = [tuple(map(sum, zip(*loads))) for loads in zip(*[
            per_rank(rngs, name, capacity, carried_ranks) for _ in range(per_rank_rows)])]
        fresh, have = [], sum(i.tokens for i in carried)
        while have < pool * dp * per_rank_rows * capacity:
            fresh.append(draw(stream, name, capacity))
            have += fresh[-1].tokens
        start = time.perf_counter()
        rows, carried = pack_rows(carried, fresh, dp * per_rank_rows, capacity, packing=True,
                                  max_wait=max_wait)
        ranks = assign_rows(rows, dp)
        result["plan_ms"].append(1000 * (time.perf_counter() - start))
        result["plan_fill"].append(sum(r.tokens for r in rows) / (len(rows) * capacity))
        placed = [item for row in rows for item in row.items]
        result["waited"].append(max(i.waited for i in placed + carried))
        mean_vision = sum(i.vision for i in placed) / dp  # no split of whole samples beats it
        result["bound_vision"].append(max(1.0, max(i.vision for i in placed) / mean_vision))
        plan = [(sum(rows[i].tokens for i in r), sum(rows[i].vision for i in r)) for r in ranks]
        for prefix, loads in (("base", base), ("plan", plan)):
            result[f"{prefix}_tokens"].append(_ratio([t for t, _ in loads]))
            result[f"{prefix}_vision"].append(_ratio([v for _, v in loads]))
            result[f"{prefix}_time"].append(time_ratio(loads, share))
    summary = {"dataset": name, "dp": dp}
    for key, values in result.items():
        summary[key] = statistics.fmean(values)
        summary[f"{key}_p95"] = sorted(values)[int(0.95 * (len(values) - 1))]
    summary["time_saved"] = 1 - summary["plan_time"] / summary["base_time"]
    summary["waited"] = max(result["waited"])  # steps a candidate was left out, at most
    return summary


def _ratio(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return max(values) / mean if mean else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out/data_plan"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vision-share", type=float, default=0.3)
    parser.add_argument("--rows-per-rank", type=int, default=1,
                        help="Rows (micro-batches) each rank trains per step.")
    parser.add_argument("--pool", type=float, default=POOL,
                        help="Candidates per step, in rows' worth of tokens.")
    parser.add_argument("--max-wait", type=int, default=MAX_WAIT,
                        help="Steps a candidate may be left out before it must be trained.")
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--dp", default="2,8,32", help="Comma-separated DP sizes.")
    args = parser.parse_args()
    names = args.datasets.split(",")
    if not set(names) <= set(DATASETS):
        parser.error(f"--datasets: one of {', '.join(DATASETS)} expected, got {args.datasets}")
    rows = [simulate(name, int(dp), args.steps, args.tokens, args.vision_share,
                     args.rows_per_rank, args.pool, args.max_wait)
            for name in names for dp in args.dp.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"data_plan_rows{args.rows_per_rank}.json").write_text(json.dumps(rows, indent=1))
    share = f"{args.vision_share:g}"
    print(f"rows per rank: {args.rows_per_rank}, pool: {args.pool:g}, max wait: {args.max_wait}")
    print(f"| data | DP | per rank: tokens max/mean (p95) | per rank: vision (p95) | global plan: "
          f"tokens (p95) | global plan: vision (p95) | step time saved (vision {share} of "
          "compute) | bound: vision | plan: row fill | plan: ms / step (p95) | most steps a "
          "candidate waited |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dataset']} | {r['dp']} | {r['base_tokens']:.3f} ({r['base_tokens_p95']:.3f})"
              f" | {r['base_vision']:.3f} ({r['base_vision_p95']:.3f}) | {r['plan_tokens']:.3f} "
              f"({r['plan_tokens_p95']:.3f}) | {r['plan_vision']:.3f} ({r['plan_vision_p95']:.3f})"
              f" | {100 * r['time_saved']:.1f} % | {r['bound_vision']:.3f} | "
              f"{r['plan_fill']:.3f} | {r['plan_ms']:.0f} ({r['plan_ms_p95']:.0f}) | "
              f"{r['waited']} |")


if __name__ == "__main__":
    main()
