"""Full fine-tuning vs frozen vision tower vs LoRA vs DoRA, side by side in one run: median step
time, peak memory and the optimizer-state bytes each mode's checkpoint holds, as ratios to full
fine-tuning, and DoRA's as ratios to LoRA's (same rank, targets and data).

    .venv/bin/python bench/bench_peft.py [--data META.yaml] [--steps 8] [--rounds 2]

Each (shape, mode) is a real train.py run (tiny Qwen2.5-VL, and a mid-size one: LM hidden 1024
x 8 layers, ViT hidden 512 x 8 blocks), rounds interleaved so that machine drift hits every
mode alike; step time is the median of the steps after the second, memory the run's peak
(``peak_mem_gb``: process RSS on CPU, CUDA peak on GPU), optimizer bytes the ``optimizer.*``
tensors of the final checkpoint (read from its metadata). Without ``--data`` the Mantis
lookalike is converted under bench_out/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "train_qwen_vl_mantis.yaml"
SHAPES = {
    "tiny": [],
    "mid": ["model.lm.hidden_size=1024", "model.lm.intermediate_size=2816",
            "model.lm.num_layers=8", "model.lm.num_heads=16", "model.lm.num_kv_heads=4",
            "model.lm.head_dim=64", "model.lm.mrope_section=[8,12,12]",
            "model.vision.hidden_size=512",
            "model.vision.intermediate_size=1376", "model.vision.num_heads=8",
            "model.vision.depth=8", "model.vision.out_hidden_size=1024"],
}
MODES = {
    "full": [],
    "frozen ViT": ["model.freeze_vision_model=true"],
    "LoRA r16 (LM)": ["model.peft=lora"],
    "DoRA r16 (LM)": ["model.peft=dora"],
}
#: (mode, the mode it is compared with) in the second table
PAIRS = (("DoRA r16 (LM)", "LoRA r16 (LM)"),)


def _data(args) -> Path:
    if args.data:
        return Path(args.data)
    out = REPO / "bench_out" / "peft_mantis"
    if not (out / "metadataset.yaml").is_file():
        from lookalikes import build_all

        sources = build_all(REPO / "bench_out" / "peft_sources")
        subprocess.run([sys.executable, "-m", "converters", "mantis", "--source",
                        str(sources["mantis"]), "--out", str(out), "--shard-size", "4"],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return out / "metadataset.yaml"


def _optimizer_bytes(step: Path) -> int:
    from models.checkpointing.dist_load import read_metadata

    meta = read_metadata(step / "model_optim")
    total = 0
    for key, item in meta.state_dict_metadata.items():
        size = getattr(item, "size", None)
        props = getattr(item, "properties", None)
        if key.startswith("optimizer.") and size is not None and props is not None:
            numel = 1
            for dim in size:
                numel *= dim
            total += numel * props.dtype.itemsize
    return total


def run_once(data: Path, shape: list[str], mode: list[str], steps: int, out: Path) -> dict:
    cmd = [sys.executable, "train.py", str(CONFIG), f"data.path={data}", f"out={out}",
           f"train.steps={steps}", "log.interval=1", "data.num_workers=0",
           "log.tensorboard=false", "train.eval_interval=0", "checkpoint.save_final=true",
           "train.precision=fp32", *shape, *mode, "--overwrite"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"train.py failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if '"loss"' in line]
    step_dir = sorted((out / "checkpoints").glob("step_*"))[-1]
    return {"step_s": statistics.median(r["step_time_s"] for r in records[2:]),
            "mem_gb": max(r["peak_mem_gb"] for r in records),
            "optimizer_bytes": _optimizer_bytes(step_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    data = _data(args)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for shape_name, shape in SHAPES.items():
                for mode_name, mode in MODES.items():
                    got = run_once(data, shape, mode, args.steps, Path(tmp) / "run")
                    results.setdefault((shape_name, mode_name), []).append(got)
    print("| shape | mode | step s (median) | vs full | peak mem GB | vs full | "
          "optimizer state MB | vs full |")
    print("|---|---|---|---|---|---|---|---|")
    for shape_name in SHAPES:
        full = _summary(results[(shape_name, "full")])
        for mode_name in MODES:
            got = _summary(results[(shape_name, mode_name)])
            print(f"| {shape_name} | {mode_name} | {got['step_s']:.3f} | "
                  f"{got['step_s'] / full['step_s']:.2f}x | {got['mem_gb']:.2f} | "
                  f"{got['mem_gb'] / full['mem_gb']:.2f}x | "
                  f"{got['optimizer_bytes'] / 1e6:.2f} | "
                  f"{got['optimizer_bytes'] / full['optimizer_bytes']:.3f}x |")
    print("\n| shape | mode | vs | step time | peak mem | optimizer state |")
    print("|---|---|---|---|---|---|")
    for shape_name in SHAPES:
        for mode_name, other in PAIRS:
            got = _summary(results[(shape_name, mode_name)])
            ref = _summary(results[(shape_name, other)])
            print(f"| {shape_name} | {mode_name} | {other} | "
                  + " | ".join(f"{got[k] / ref[k]:.3f}x"
                               for k in ("step_s", "mem_gb", "optimizer_bytes")) + " |")


def _summary(rounds: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


if __name__ == "__main__":
    main()
