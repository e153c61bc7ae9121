"""Throughput cards from a GPU check: docs/cards/<family>.md, one per family, from gpu_check.json.

A card holds the exact command, the device, every package's version, the kernels that ran, the
``train`` part's figures of the family (real tokens/s, padded slots/s, TFLOP/s, MFU, step time
and its vision share per row, peak memory beside the estimate, the losses) and, beside them, the
published anchors (Megatron-Bridge's verification cards, LMMs-Engine's MFU, the dense bf16 peak).
A family without a GPU row (no GPU run yet, a CPU smoke JSON, or a row that failed) gets a card
that says so plainly and lists what the GPU run must show: CPU numbers are never presented as
GPU figures.

Run: python bench/gpu_cards.py bench_out/gpu_check.json [--out docs/cards]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu_train import FAMILIES  # noqa: E402 - after the path

#: the published figures a card stands beside (the peers' published cards and papers)
ANCHORS = [
    ("Megatron-Bridge card: Qwen3.6-35B-A3B SFT, 16 x H100, MedPix (448x448 images), seq 4096, "
     "TP1 PP2 EP8", "2,507 padded slots/s/GPU", "57.7 TFLOP/s/GPU (about 6 % MFU)"),
    ("Megatron-Bridge card: Nemotron-3 Nano Omni SFT, 16 x H100, CORD-v2, seq 4096, TP2 PP2 EP4",
     "670 padded slots/s/GPU", "60.7 TFLOP/s/GPU"),
    ("LMMs-Engine: image SFT, 32 x A800, FSDP2, packing", "", "30-40 % MFU"),
    ("LMMs-Engine: video SFT, 32 x A800, FSDP2, packing", "", "25-35 % MFU"),
    ("H100 / H200 dense bf16 peak (what MFU divides by)", "", "989 TFLOP/s"),
]
#: which anchor a family compares with most closely
CLOSEST = {"qwen3_5_moe": 0, "qwen3_vl_moe": 0, "nemotron_omni": 1}
GOAL = ("MFU at least 40 % on image SFT and 30 % on video for the dense families (Qwen2.5-VL, "
        "Qwen3-VL, Qwen3.5) at real per-layer shapes on one H100 / H200, and every family "
        "training.")
MUST_SHOW = [
    "`bash bench/gpu_check.sh` (one device call, about 8 minutes with the installs) on one H100 "
    "or H200: its `kernels` part lists every kernel's check (accepted, rejected with the worst "
    "difference, or why it did not run) in bf16 and fp32;",
    "this family's `train` row: 20 steps at the published per-layer shapes (layers cut to one "
    "GPU, the whole vision tower), bf16, packing on, over a 6000x9000 page and a row of 12 "
    "photos + a 64-frame video, with the kernel lines it ran on;",
    "real tokens/s and padded slots/s, TFLOP/s and MFU from models/flops.py (against 989 TFLOP/s),"
    " the step time of each row and its vision share, peak memory beside recipes/memory.py's "
    "estimate;",
    "the losses finite and falling;",
    "then: `python bench/gpu_cards.py <out>/gpu_check.json` writes this card with the figures.",
]


def _gpu_row(report: dict, family: str) -> tuple[dict | None, str]:
    """The family's train row of a GPU run, or None and why there is none."""
    rows = [r for r in report.get("parts", {}).get("train", []) if r.get("family") == family]
    if report.get("environment", {}).get("device", "cpu") == "cpu":
        return None, ("the only run of the check is a CPU smoke run (tiny models, the plumbing "
                      "only)" if rows else "no run of the check has been recorded")
    if not rows:
        return None, "the GPU run has no train row of this family"
    row = rows[-1]
    if "error" in row or "skipped" in row:
        return None, f"its train row did not complete: {row.get('error') or row.get('skipped')}"
    return row, ""


def _anchors(family: str) -> list[str]:
    lines = ["## Published anchors", "", "| source | slots/s/GPU | TFLOP/s, MFU |", "|---|---|---|"]
    for i, (source, slots, tflops) in enumerate(ANCHORS):
        mark = " **(closest)**" if CLOSEST.get(family) == i else ""
        lines.append(f"| {source}{mark} | {slots or '-'} | {tflops} |")
    lines += ["", "Megatron-Bridge counts padded slots (GBS x seq_length / step time / GPUs), "
              "multi-GPU with expert parallelism; this card is one GPU with the LM cut, so the "
              "comparable figures are TFLOP/s and MFU per GPU.", "", f"Goal (issue 44): {GOAL}"]
    return lines


def _environment(env: dict) -> list[str]:
    packages = ", ".join(f"{name} {version}" for name, version in env.get("packages", {}).items())
    return ["## Run", "",
            f"- command: `{env.get('command', '?')}` (commit {env.get('commit', '?')}, "
            f"{env.get('date', '?')})",
            f"- device: {env.get('device', '?')} ({env.get('gpu_memory_gb', '?')} GiB), CUDA "
            f"{env.get('cuda', '?')}, driver {env.get('driver', '?')}, Python "
            f"{env.get('python', '?')}",
            f"- packages: {packages}"]


def _figures(row: dict) -> list[str]:
    losses = row.get("losses", [])
    lines = [
        "## Model and kernels", "",
        f"- {row['model']} with {', '.join(row.get('cut') or ['nothing cut'])}; "
        f"{row['params'] / 1e9:.2f} B parameters; {row['dtype']}; recompute {row['recompute']}; "
        f"{row['steps']} steps ({row['timed_steps']} timed)",
        *[f"- kernel {line}" for line in row.get("kernels", [])], "",
        "## Figures (one GPU)", "", "| figure | value |", "|---|---|",
        f"| real tokens/s | {row['real_tokens_per_s']:,.0f} |",
        f"| padded slots/s | {row['padded_slots_per_s']:,.0f} |",
        f"| TFLOP/s (models/flops.py, recompute not counted) | {row['tflops_per_s']:.1f} |",
        f"| MFU (of {row['peak_tflops']:g} TFLOP/s) | {100 * row['mfu']:.1f} % |",
        f"| peak memory / estimate (recipes/memory.py) | {row['peak_mem_gb']:.1f} GiB / "
        f"{row['estimate_gb']:.1f} GiB |",
        f"| loss first -> last | {losses[0]:.3f} -> {losses[-1]:.3f} "
        f"({'finite' if row['loss_finite'] else 'NOT finite'}, "
        f"{'falling' if row['loss_falling'] else 'NOT falling'}) |" if losses else "| loss | - |",
        "", "## Where the time goes", "",
        "| row | tokens | images | videos | patches | step s | vision s | vision share | "
        "TFLOP/step |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['row']} | {r['tokens']:,} | {r['images']} | {r['videos']} | "
              f"{r['patches']:,} | {r['step_s']:.3f} | {r['vision_s']:.3f} | "
              f"{100 * r['vision_share']:.0f} % | {r['tflop_per_step']:.1f} |"
              for r in row.get("rows", [])]
    return lines


def card(report: dict, family: str) -> str:
    """The markdown card of ``family`` from a gpu_check.json ``report``."""
    row, missing = _gpu_row(report, family)
    head = [f"# {family}: training throughput on one GPU", "",
            "Written by `python bench/gpu_cards.py` from `bench/gpu_check.sh`'s JSON "
            "(docs/benchmarks.md, \"GPU check\").", ""]
    if row is None:
        body = [f"**No GPU run exists yet** for this family: {missing}. No figure below is a "
                "GPU figure.", "", "What the GPU run must show:", "",
                *[f"{i}. {item}" for i, item in enumerate(MUST_SHOW, 1)], ""]
    else:
        body = [*_environment(report["environment"]), "", *_figures(row), ""]
    return "\n".join([*head, *body, *_anchors(family)]) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path, help="gpu_check.json of bench/gpu_check.py")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "cards")
    args = ap.parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
    except (OSError, ValueError) as error:
        ap.error(f"{args.report}: {error}")
    args.out.mkdir(parents=True, exist_ok=True)
    for family in FAMILIES:
        (args.out / f"{family}.md").write_text(card(report, family))
    print(f"cards: {', '.join(str(args.out / f'{f}.md') for f in FAMILIES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
