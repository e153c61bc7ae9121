"""Step time of real train.py runs at DP 2 (two gloo CPU ranks) with the global data plan on vs
off, on a blend of the Mantis and LLaVA-Video lookalikes (tests/conftest.py's data, built here).

Each mode is one ``torchrun --standalone --nproc-per-node 2`` run of the tiny Qwen2.5-VL of
configs/train_qwen_vl_llava_video.yaml with packing, ``train.global_batch_size`` rows per step
(the same rows per rank in both modes), the loader in the rank's process (``data.num_workers=0``:
its time, the plan's included, is the step's data wait), no evaluation, no checkpoint; the modes
alternate, ``--repeats`` times (the machine is shared: the repeats show the noise). This
script is also each rank's entry (``--rank-log``): it times, per step and rank, the optimizer step
(``recipes.forward.optimizer_step``: forward, backward, gradient reduction, update) and inside
it the gradient reduction (megatron's ``finalize_model_grads``, a blocking all-reduce: a rank
that finished its backward early waits there for the other), and counts the rank's tokens and
visual tokens; then runs train.py's ``main``.

Reported per mode, over the steps after ``--warmup``: the mean step time (metrics.jsonl's
``step_time_s``, rank 0), the mean over steps of the ranks' compute time difference (step minus
reduction, max - min), the mean reduction time of the rank that waits (the faster one) and of the
other, the ranks' tokens and visual tokens max / mean (counted), and with the plan the logged
``dp_tokens_max_over_mean`` / ``dp_vision_max_over_mean`` means.

    .venv/bin/python bench/bench_data_plan_cpu.py --out bench_out/data_plan_cpu
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "train_qwen_vl_llava_video.yaml"
MODES = {"off": ["data.global_plan=false"], "on": ["data.global_plan=true"]}
#: ``--vision-heavy``: a tower that does most of a step's work (6 layers of 128, 64 visual tokens
#: per image and per frame pair, the LM as tiny as before), where the ranks' vision balance sets
#: the step time
VISION_HEAVY = ["model.vision.depth=6", "model.vision.hidden_size=128",
                "model.vision.intermediate_size=512", "model.vision.num_heads=4",
                "model.vision.fullatt_block_indexes=[2,5]", "task_encoder.max_pixels=50176",
                "task_encoder.video_max_pixels=50176", "task_encoder.max_visual_tokens=1024",
                "task_encoder.seq_length=2048"]


def prepare(root: Path) -> Path:
    """The blend's metadataset (built once under ``root``): the lookalikes of Mantis and
    LLaVA-Video converted as the tests convert them, blended 1 : 1."""
    mix = root / "mix.yaml"
    if mix.is_file():
        return mix
    sys.path.insert(0, str(REPO))
    from lookalikes import build_all

    sources = build_all(root / "sources")
    for name, extra in (("mantis", ["--val-fraction", "0.2"]),
                        ("llava-video", ["--val-fraction", "0.2", "--workers", "2"])):
        subprocess.run([sys.executable, "-m", "converters", name, "--source", str(sources[name]),
                        "--out", str(root / name), "--shard-size", "4", *extra], cwd=REPO,
                       check=True, capture_output=True)
    blend = [{"weight": 1, "path": f"{name}/metadataset.yaml"} for name in ("mantis",
                                                                          "llava-video")]
    head = "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n"
    body = "".join(f"  {split}:\n    blend:\n" + "".join(
        f"      - weight: {e['weight']}\n        path: {e['path']}\n" for e in blend)
        for split in ("train", "val"))
    mix.write_text(head + body)
    return mix


def rank_entry(log_dir: Path, argv: list[str]) -> int:
    """One rank: train.py's main with its optimizer steps and gradient reductions timed."""
    sys.path.insert(0, str(REPO))
    import megatron.core.distributed as mcore_dist

    import recipes.forward as forward

    steps: list[dict] = []
    reduce_seconds = [0.0]
    finalize, step = mcore_dist.finalize_model_grads, forward.optimizer_step

    def timed_finalize(*args, **kwargs):
        tick = time.perf_counter()
        try:
            return finalize(*args, **kwargs)
        finally:
            reduce_seconds[0] += time.perf_counter() - tick

    def timed_step(layout, model, optimizer, batches, *args, **kwargs):
        reduce_seconds[0], tick = 0.0, time.perf_counter()
        out = step(layout, model, optimizer, batches, *args, **kwargs)
        seconds = time.perf_counter() - tick
        merge = 4  # Qwen2.5-VL's 2 x 2 merge: patches -> visual tokens
        visual = sum(int(b.image_grid_thw.prod(-1).sum() + b.video_grid_thw.prod(-1).sum())
                     for b in batches) // merge
        steps.append({"step_s": seconds, "reduce_s": reduce_seconds[0],
                      "tokens": sum(int(b.attention_mask.sum()) for b in batches),
                      "visual_tokens": visual})
        return out

    mcore_dist.finalize_model_grads, forward.optimizer_step = timed_finalize, timed_step
    rank = int(os.environ.get("RANK", "0"))
    atexit.register(lambda: (log_dir / f"rank{rank}.json").write_text(json.dumps(steps)))
    sys.argv = [str(REPO / "train.py"), *argv]
    import train

    return train.main(argv)


def run_mode(mode: str, name: str, data: Path, out: Path, steps: int, rows: int,
             extra: list[str]) -> None:
    log_dir = out / name
    log_dir.mkdir(parents=True, exist_ok=True)
    args = [str(CONFIG), f"data.path={data}", f"out={log_dir / 'run'}", *MODES[mode],
            "task_encoder.packing=true", f"train.global_batch_size={rows}",
            "train.micro_batch_size=1", f"train.steps={steps}", "train.eval_interval=0",
            "data.num_workers=0", "log.tensorboard=false", "checkpoint.save_final=false",
            "checkpoint.interval=0", "train.keep_checkpoints=0", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", __file__,
                           "--rank-log", str(log_dir), "--", *args], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"bench_data_plan_cpu.py: error: the {mode} run failed:\n{proc.stderr[-3000:]}")


def summarize(mode: str, name: str, out: Path, warmup: int) -> dict:
    ranks = [json.loads((out / name / f"rank{r}.json").read_text())[warmup:] for r in (0, 1)]
    metrics = [json.loads(line) for line in
               (out / name / "run" / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in metrics if "loss" in m][warmup:]
    per_step = list(zip(*ranks))

    def spread(key):
        return statistics.fmean(max(s[key] for s in pair) / statistics.fmean(s[key] for s in pair)
                                for pair in per_step)

    compute = [[s["step_s"] - s["reduce_s"] for s in pair] for pair in per_step]
    reduce = [[s["reduce_s"] for s in pair] for pair in per_step]
    faster = [min(range(2), key=lambda r, c=c: c[r]) for c in compute]
    summary = {
        "mode": name, "steps": len(per_step),
        "step_time_s": statistics.fmean(m["step_time_s"] for m in metrics),
        "optimizer_step_s": statistics.fmean(pair[0]["step_s"] for pair in per_step),
        "compute_gap_s": statistics.fmean(max(c) - min(c) for c in compute),
        # the step's critical path over the ranks' mean work: what balance can save
        "slower_compute_over_mean": statistics.fmean(max(c) / statistics.fmean(c)
                                                     for c in compute),
        "reduce_faster_rank_s": statistics.fmean(r[f] for r, f in zip(reduce, faster)),
        "reduce_slower_rank_s": statistics.fmean(r[1 - f] for r, f in zip(reduce, faster)),
        "tokens_max_over_mean": spread("tokens"),
        "visual_tokens_max_over_mean": spread("visual_tokens"),
    }
    for key in ("dp_tokens_max_over_mean", "dp_vision_max_over_mean"):
        if metrics and key in metrics[0]:
            summary[f"logged_{key}"] = statistics.fmean(m[key] for m in metrics)
    return summary


def table(rows: list[dict]) -> str:
    """The runs' summaries as a markdown table."""
    lines = ["| plan | steps | step time (s) | optimizer step (s) | compute gap of the ranks (s) | "
             "slower rank's compute / mean | reduction: faster rank (s) | reduction: slower rank "
             "(s) | tokens max/mean | visual tokens max/mean | logged dp tokens / vision |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        logged = (f"{r['logged_dp_tokens_max_over_mean']:.3f} / "
                  f"{r['logged_dp_vision_max_over_mean']:.3f}"
                  if "logged_dp_tokens_max_over_mean" in r else "-")
        lines.append(f"| {r['mode']} | {r['steps']} | {r['step_time_s']:.3f} | "
                     f"{r['optimizer_step_s']:.3f} | {r['compute_gap_s']:.3f} | "
                     f"{r['slower_compute_over_mean']:.3f} | {r['reduce_faster_rank_s']:.3f} | "
                     f"{r['reduce_slower_rank_s']:.3f} | {r['tokens_max_over_mean']:.3f} | "
                     f"{r['visual_tokens_max_over_mean']:.3f} | {logged} |")
    return "\n".join(lines)


def main() -> None:
    if "--rank-log" in sys.argv:  # one rank of a run (torchrun's worker)
        at = sys.argv.index("--rank-log")
        sys.exit(rank_entry(Path(sys.argv[at + 1]), sys.argv[at + 3:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out/data_plan_cpu"))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4, help="First steps left out.")
    parser.add_argument("--rows", type=int, default=8, help="train.global_batch_size.")
    parser.add_argument("--repeats", type=int, default=2,
                        help="Runs of each mode, alternated (off, on, off, on ...).")
    parser.add_argument("--vision-heavy", action="store_true",
                        help="A tower that does most of the step's work (VISION_HEAVY).")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    out = args.out.resolve()
    data = prepare(out / "data")
    rows = []
    for repeat in range(args.repeats):
        for mode in MODES:
            name = f"{mode}-{repeat + 1}"
            run_mode(mode, name, data, out, args.steps, args.rows,
                     VISION_HEAVY if args.vision_heavy else [])
            rows.append(summarize(mode, name, out, args.warmup))
    (out / "data_plan_cpu.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
