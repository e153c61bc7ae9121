"""Balance of vision data-parallel over CP: cost-balanced plan vs split by image count.

Simulated: batches drawn from size distributions shaped like the three datasets (see
docs/internals/vision_dp.md), grids of the chosen family (``--family``): Qwen2.5-VL (images resized
to 200704..1003520 pixels, videos per frame) or Nemotron-Omni (dynamic images, 1024..13312
patches; videos as frame pairs of the non-dynamic path, each pair one unit), cost from
models.vision_dp.CostModel (``qwen2_5_vl`` or ``radio``).
Reports mean and p95 over batches of max/mean encoder cost per CP rank for CP = 2, 4, 8, and
the lower bound max(1, largest unit * CP / total) that no split of whole units can beat.

Measured (--measure): one torchrun launch of 2 processes (CP=2, gloo, 1 thread each) encoding
down-scaled batches with a small CPU encoder; wall time of the local encoder forward+backward
per rank, cost plan vs count plan.

Run: python bench/bench_vision_balance.py [--measure] [--out bench_out]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from energon_tasks.families.nemotron_omni.geometry import NEMOTRON_OMNI  # noqa: E402
from energon_tasks.profiles import get_geometry  # noqa: E402
from models.families.nemotron_omni.model import RADIO_COST  # noqa: E402
from models.families.qwen_vl.model import COST_MODELS  # noqa: E402
from models.vision_dp import CostModel, count_split, plan_shares  # noqa: E402

#: family -> (geometry, image (min, max) pixels, cost model)
FAMILIES = {
    "qwen2.5-vl": (get_geometry("qwen2.5-vl"), (200704, 1003520), COST_MODELS["qwen2_5_vl"]),
    "nemotron-omni": (NEMOTRON_OMNI, (None, None), RADIO_COST),
}
GEO, (MIN_PX, MAX_PX), COST = FAMILIES["qwen2.5-vl"]


def use_family(name: str) -> None:
    """Switch the samplers and cost model to another model family."""
    global GEO, MIN_PX, MAX_PX, COST
    GEO, (MIN_PX, MAX_PX), COST = FAMILIES[name]
CPS = (2, 4, 8)
FEW = {"mantis": 4, "infovqa": 4, "llava-video": 2}  # samples per batch, "few" regime
TOKENS_PER_RANK = 8192  # "packed" regime: one packed sequence of 8192 * CP tokens


def _image(rng, h, w):
    return GEO.image_grid(h, w, min_pixels=MIN_PX, max_pixels=MAX_PX).grid_thw


def mantis_sample(rng):
    """1-5 small images (Mantis subsets), 5 % visual_story_telling-like with 5-50 images."""
    if rng.random() < 0.05:
        n = rng.randint(5, 50)
    else:
        n = rng.choices([1, 2, 3, 4, 5], weights=[30, 35, 15, 12, 8])[0]
    grids = []
    for _ in range(n):
        short, aspect = rng.uniform(224, 900), math.exp(rng.uniform(-0.7, 0.7))
        grids.append(_image(rng, int(short * max(aspect, 1)), int(short * max(1 / aspect, 1))))
    return grids, 250


def infovqa_sample(rng):
    """One infographic: 0.2-58.6 MP, median ~2 MP (log-normal), tall aspect ratios common."""
    mp = min(max(math.exp(rng.gauss(math.log(2.0), 0.9)), 0.2), 58.6)
    aspect = math.exp(rng.uniform(math.log(0.6), math.log(4.0)))  # h / w
    w = int(math.sqrt(mp * 1e6 / aspect))
    return [_image(rng, int(w * aspect), w)], 60


def video_sample(rng):
    """LLaVA-Video-like clip: 16-64 frames (even), 360p/480p/720p, per-frame pixel limits."""
    frames = 2 * rng.randint(8, 32)
    h, w = rng.choice([(360, 640), (480, 854), (720, 1280)])
    return [GEO.video_grid(frames, h, w).grid_thw], 150


SAMPLERS = {"mantis": mantis_sample, "infovqa": infovqa_sample, "llava-video": video_sample}


def batch(rng, name, cp, regime):
    """Grids of one micro-batch: FEW[name] samples, or samples packed up to 8192 * CP tokens."""
    grids, used = [], 0
    for k in range(10_000):
        g, text = SAMPLERS[name](rng)
        n = text + sum(t * h * w // 4 for t, h, w in g)
        if regime == "few" and k == FEW[name]:
            break
        if regime == "packed" and used + n > TOKENS_PER_RANK * cp:
            if grids:
                break
            continue  # a single sample over the budget: skipped, as the packer would
        grids += g
        used += n
    return grids


def simulate(n_batches: int, cost_model: CostModel) -> list[dict]:
    rows = []
    for regime in ("few", "packed"):
        for name in SAMPLERS:
            for cp in CPS:
                rng = random.Random(f"{name}-{cp}-{regime}")
                cost, count, bound = [], [], []
                for _ in range(n_batches):
                    g = batch(rng, name, cp, regime)
                    units = [cost_model.cost(h * w) for t, h, w in g for _ in range(t)]
                    bound.append(max(1.0, max(units, default=0) * cp / max(sum(units), 1e-9)))
                    cost.append(plan_shares(g, 2, cp, cost_model).imbalance())
                    count.append(count_split(g, 2, cp, cost_model).imbalance())
                q = lambda v: sorted(v)[int(0.95 * (len(v) - 1))]  # noqa: E731
                rows.append({"regime": regime, "dataset": name, "cp": cp,
                             "count_mean": statistics.fmean(count), "count_p95": q(count),
                             "cost_mean": statistics.fmean(cost), "cost_p95": q(cost),
                             "bound_mean": statistics.fmean(bound)})
    return rows


def table(rows) -> str:
    out = ["| batch | dataset | CP | count split max/mean (mean, p95) | cost split max/mean "
           "(mean, p95) | lower bound (mean) |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['regime']} | {r['dataset']} | {r['cp']} | {r['count_mean']:.3f}, "
                   f"{r['count_p95']:.3f} | {r['cost_mean']:.3f}, {r['cost_p95']:.3f} | "
                   f"{r['bound_mean']:.3f} |")
    return "\n".join(out)


# ---- measured: torchrun worker ---------------------------------------------------------------
def _worker(n_batches: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    dim, hid = 48, 64

    class Enc(torch.nn.Module):  # patch embed, 2 x (attention within each unit + MLP), merge
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(dim, hid)
            self.qkv = torch.nn.ModuleList(torch.nn.Linear(hid, 3 * hid) for _ in range(2))
            self.mlp = torch.nn.ModuleList(torch.nn.Sequential(
                torch.nn.Linear(hid, 4 * hid), torch.nn.GELU(), torch.nn.Linear(4 * hid, hid))
                for _ in range(2))
            self.merge = torch.nn.Linear(4 * hid, hid)

        def forward(self, px, grid):
            x = self.embed(px)
            lens = [h * w for t, h, w in grid.tolist() for _ in range(t)]
            for qkv, mlp in zip(self.qkv, self.mlp, strict=True):
                parts = []
                for s in torch.split(x, lens):
                    q, k, v = qkv(s).view(1, -1, 3, 4, hid // 4).unbind(2)
                    a = torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
                    parts.append(s + a.transpose(1, 2).reshape(-1, hid))
                x = torch.cat(parts)
                x = x + mlp(x)
            return self.merge(x.reshape(-1, 4 * hid))

    enc = Enc()

    def timed(px, grid):
        t0 = time.perf_counter()
        enc(px, grid).sum().backward()
        return time.perf_counter() - t0

    # calibrate the CPU encoder's CostModel on single images (rank 0), share it
    sizes = [(1, 8, 8), (1, 16, 16), (1, 24, 24), (1, 32, 32), (1, 40, 40)]
    if rank == 0:
        p = [h * w for _, h, w in sizes]
        secs = [min(timed(torch.randn(n, dim), torch.tensor([s])) for _ in range(3))
                for s, n in zip(sizes, p, strict=True)]
        obj = [CostModel.fit(p, secs)]
    else:
        obj = [None]
    dist.broadcast_object_list(obj, src=0)
    cm = obj[0]

    def shrink(grids):  # CPU-sized: halve each side (keep multiples of the 2x2 merge)
        return [(t, max(2, h // 4 * 2), max(2, w // 4 * 2)) for t, h, w in grids]

    results = {"cost_model": {"per_patch": cm.per_patch, "per_patch_sq": cm.per_patch_sq}}
    for name in ("mantis", "infovqa"):
        rng = random.Random(f"measure-{name}")
        batches = [shrink(batch(rng, name, 2, "packed")) for _ in range(n_batches)]
        for split, fn in (("count", count_split), ("cost", plan_shares)):
            mine, pred = [], []
            for g in batches:
                plan = fn(g, 2, 2, cm)
                grid = plan.local_grid(rank)
                rows = sum(t * h * w for t, h, w in grid)
                dist.barrier()
                mine.append(timed(torch.randn(rows, dim), torch.tensor(grid).reshape(-1, 3)))
                pred.append(plan.imbalance())
            per_rank = [None, None]
            dist.all_gather_object(per_rank, mine)  # [rank][batch] seconds
            per_batch = list(zip(*per_rank, strict=True))
            # a step waits for the slowest rank: sum over batches of max vs of mean
            results[f"{name}/{split}"] = {
                "rank_seconds": [round(sum(v), 3) for v in per_rank],
                "step_seconds_sum_of_max": round(sum(max(b) for b in per_batch), 3),
                "measured_max_over_mean": sum(max(b) for b in per_batch)
                / sum(statistics.fmean(b) for b in per_batch),
                "predicted_max_over_mean": statistics.fmean(pred)}
    if rank == 0:
        print("MEASURED " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def measure(n_batches: int, family: str) -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node=2", __file__,
                           "--worker", "--batches", str(n_batches), "--family", family],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("MEASURED "):
            return json.loads(line[len("MEASURED "):])
    raise RuntimeError(f"measure run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--measure", action="store_true", help="also run the CP=2 CPU timing")
    ap.add_argument("--measure-batches", type=int, default=6)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="qwen2.5-vl")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    use_family(args.family)
    if args.worker:
        _worker(args.batches)
        return
    t0 = time.perf_counter()
    rows = simulate(args.batches, COST)
    print(table(rows))
    print(f"(simulation: {args.batches} batches per row, {time.perf_counter() - t0:.1f} s)")
    report = {"family": args.family, "simulated": rows, "batches": args.batches}
    if args.measure:
        report["measured_cp2_cpu"] = measured = measure(args.measure_batches, args.family)
        print(json.dumps(measured, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.family == "qwen2.5-vl" else f"_{args.family}"
    (out / f"vision_balance{suffix}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
