"""The memory command and train.py's memory check, over the estimate of recipes/estimate.py:

    python -m recipes.memory CONFIG --gpus N [--gpu-memory 80] [--json] [key=value ...]
    python -m recipes.memory CONFIG --gpus N --suggest [--json]     # the layouts that fit

prints each pipeline stage's estimate and whether the largest fits the GPU with ``RESERVE_GIB``
kept free (``--json``: ``{"gib_per_gpu": x, "fits": ..., "stages": [...]}``), or, with
``--suggest``, the layouts that fit, fastest first by the planner's step-time model
(recipes/planner.py; ``--json``: a list of ``{"overrides": [...], "gib_per_gpu": x, ...}``).
``check_memory`` is train.py's refusal of a layout that does not fit, before anything is built.
"""

from __future__ import annotations

import json
import sys

import click

from recipes.estimate import (
    GIB,
    RESERVE_GIB,
    Layout,
    estimate_layout,
    estimate_run,
    fits,
    run_table,
    size_text,
    summary,
    uses_bf16,
)


def device_memory_gib() -> float | None:
    """GiB of this process's GPU as torch reports it (an 80 GB H100: about 79); None without
    one."""
    import os

    import torch

    if not torch.cuda.is_available():
        return None
    device = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.cuda.get_device_properties(device).total_memory / GIB


def check_memory(cfg, world: int) -> None:
    """train.py, before anything is built: the run's layout fits its GPUs by the estimate
    (``train.gpu_memory_gib``, else the GPU's own; no GPU and no value: nothing to check), or
    ``train.force_layout`` says to train it anyway.

    Raises:
        UsageError: it does not fit; the line names the planner's best layout.
    """
    from contract.errors import UsageError
    from recipes.planner import suggest_layouts

    limit = cfg.train.gpu_memory_gib or device_memory_gib()
    if limit is None or cfg.train.force_layout:
        return
    table = run_table(cfg)
    estimates = estimate_layout(table, cfg, world, Layout.of(cfg), uses_bf16(cfg.train, True))
    if fits(estimates, limit):
        return
    found = suggest_layouts(cfg, world, limit, table=table)
    best = (f"the planner's best of {world} GPUs: {found[0].line()}" if found else
            f"no layout of {world} GPUs fits: more GPUs, LoRA (model.peft=lora) or a shorter "
            "task_encoder.seq_length")
    worst = max(estimates, key=lambda e: e.total)
    raise UsageError(f"this layout needs {size_text(worst.total)} per GPU (stage {worst.stage}) by "
                     f"the memory estimate (recipes/memory.py), over the {limit:.1f} GiB GPU "
                     f"less {RESERVE_GIB:g} GiB kept free; {best} (python -m recipes.memory "
                     f"CONFIG --gpus {world} --suggest lists more; train.force_layout=true "
                     "trains it anyway)")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config")
@click.argument("overrides", nargs=-1)
@click.option("--gpus", type=click.IntRange(min=1), required=True,
              help="GPUs of the job (the world size).")
@click.option("--gpu-memory", type=click.FloatRange(min=1), default=80.0, show_default=True,
              help="GiB of one GPU, for the verdict.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True,
              help="GPUs of one node (--suggest: where TP, EP and DP cross nodes).")
@click.option("--suggest", is_flag=True,
              help="List the layouts that fit, fastest first (recipes/planner.py).")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="--suggest: how many layouts to list.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of lines.")
def cli(config: str, overrides: tuple[str, ...], gpus: int, gpu_memory: float,
        gpus_per_node: int, suggest: bool, top: int, as_json: bool) -> None:
    """Per-GPU memory estimate of train.py's CONFIG (+ key=value overrides) on --gpus GPUs, or
    (--suggest) the layouts that fit, ranked by estimated step time."""
    from contract.console import KnownWarnings
    from recipes.run_config import load_run_config

    KnownWarnings(enabled=True)  # TE / Apex fallbacks: train.py and eval.py hide them too
    cfg = load_run_config(config, list(overrides), world=gpus)
    if suggest:
        from recipes.planner import suggest_layouts

        found = suggest_layouts(cfg, gpus, gpu_memory, gpus_per_node=gpus_per_node)
        _print_suggestions(config, gpus, gpu_memory, found[:top], len(found), as_json)
        return
    estimates = estimate_run(cfg, gpus)
    p = cfg.parallel
    if as_json:
        worst = max(estimates, key=lambda e: e.total)
        click.echo(json.dumps({"gib_per_gpu": round(worst.total / GIB, 3),
                               "fits": fits(estimates, gpu_memory), "gpu_memory": gpu_memory,
                               "reserve_gib": RESERVE_GIB, "gpus": gpus,
                               "stages": [e.as_dict() for e in estimates]}))
        return
    click.echo(f"[memory] {config}: {gpus} GPUs = tp {p.tp} x pp {p.pp} x cp {p.cp} x dp "
               f"{gpus // (p.tp * p.pp * p.cp)} (ep {p.ep}); micro-batch "
               f"{cfg.train.micro_batch_size} x {cfg.task_encoder.seq_length} tokens")
    for one in estimates:
        click.echo(f"[memory] {one.line()}")
    click.echo(f"[memory] {summary(estimates, gpu_memory)}")


def _print_suggestions(config: str, gpus: int, gpu_memory: float, shown: list,
                       total: int, as_json: bool) -> None:
    from recipes.planner import MARGIN

    if as_json:
        click.echo(json.dumps([s.as_dict() for s in shown]))
        return
    if not shown:
        click.echo(f"[memory] {config}: no layout of {gpus} GPUs fits {gpu_memory:g} GiB by the "
                   f"estimate ({RESERVE_GIB:g} GiB kept free): more GPUs, LoRA "
                   "(model.peft=lora) or a shorter task_encoder.seq_length")
        return
    click.echo(f"[memory] {config}: {total} layouts of {gpus} GPUs fit {gpu_memory:g} GiB "
               f"({RESERVE_GIB:g} GiB kept free); the {len(shown)} fastest by the step-time "
               f"model ({MARGIN}):")
    for rank, s in enumerate(shown, 1):
        click.echo(f"[memory] {rank:2d}. {s.line()}")


def main(argv: list[str] | None = None) -> int:
    from contract.cli import run_click

    return run_click(cli, "recipes.memory", argv)


if __name__ == "__main__":
    sys.exit(main())
