"""Greedy generation with a MoE model's experts over ranks (EP 2): the lean decode step (each
rank's experts, summed by one all-reduce per MoE layer) side by side with megatron's own decode
step (its alltoall / allgather token dispatcher), on the same imported checkpoint and prompts.

For each MoE family's tiny random model (Qwen3-VL-MoE, Qwen3.5-MoE and Nemotron-Omni "M*E-",
built with transformers as bench/bench_generate.py builds them, imported with `models.convert
hf-to-mcore`), 2 gloo ranks (torchrun) at expert parallel 2 answer the same prompts (text + one
image + text, of unequal length) greedily, a fixed number of new tokens, at batch 1 and batch 4:
every rank the same rows, as eval.py's multi-process eval runs them. Time is each rank's CPU
time (`time.process_time`, one intra-op thread), the two decodes alternating in each repeat
after a warm-up, median of `--repeats`; reported from rank 0 with the ratio megatron's / lean
and whether the tokens are equal.

Usage: python bench/bench_generate_ep.py --out bench_out/generate_ep [--repeats 5]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

MOE_MODELS = ("qwen3_vl_moe", "qwen3_5_moe", "nemotron_omni")


def worker(out: Path, names: list[str], new: int, repeats: int) -> None:
    """One of the 2 ranks: both decodes of every model, rank 0 writes ``out/generate_ep.json``."""
    import torch.distributed as dist
    from bench_generate import NEVER, _prompt, make_cases, median_cpu_times

    from models.checkpointing.checkpoint import load_checkpoint
    from models.generation import decode_step
    from models.generation.generate import GenerationStats, greedy_generate
    from models.parallel import init_parallel

    torch.set_num_threads(1)
    init_parallel(ep=2)
    lean_build, results = decode_step.build, {}
    for name in names:
        model, cfg = load_checkpoint(out / name / "mcore", use_te=False)
        prompts = [_prompt(c) for c in make_cases(cfg, 4)]
        result = {}
        for batch in (1, 4):
            rows, tokens, used = prompts[:batch], {}, {}

            def run(kind, model=model, rows=rows, tokens=tokens, used=used):
                decode_step.build = lean_build if kind == "lean" else (lambda *a, **k: None)
                stats = GenerationStats()
                tokens[kind] = greedy_generate(model, rows, eos_id=NEVER, max_new_tokens=new,
                                               stats=stats)
                used[kind] = stats.extra["lean_decode"]

            times = median_cpu_times({k: (lambda k=k: run(k)) for k in ("lean", "megatron")},
                                     repeats)
            decode_step.build = lean_build
            assert used == {"lean": True, "megatron": False}, used
            result[f"batch{batch}"] = {
                "lean_s": round(times["lean"], 4), "megatron_s": round(times["megatron"], 4),
                "speedup": round(times["megatron"] / times["lean"], 2),
                "tokens_equal": tokens["lean"] == tokens["megatron"]}
        results[name] = result
    if dist.get_rank() == 0:
        (out / "generate_ep.json").write_text(json.dumps(
            {"ranks": 2, "expert_parallel": 2, "new_tokens": new,
             "timing": f"CPU time of rank 0, one thread, median of {repeats}, alternating",
             "models": results}, indent=1))


@click.command()
@click.option("--out", default="bench_out/generate_ep", type=click.Path(path_type=Path))
@click.option("--models", "names", default=",".join(MOE_MODELS), show_default=True)
@click.option("--new-tokens", default=32, show_default=True)
@click.option("--repeats", default=5, show_default=True)
@click.option("--worker", "as_worker", is_flag=True, hidden=True)
def main(out: Path, names: str, new_tokens: int, repeats: int, as_worker: bool) -> None:
    out = out.resolve()
    if as_worker:
        worker(out, names.split(","), new_tokens, repeats)
        return
    from bench_generate import import_tiny

    for name in names.split(","):
        import_tiny(name, out)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", __file__, "--worker", "--out", str(out), "--models",
                    names, "--new-tokens", str(new_tokens), "--repeats", str(repeats)],
                   cwd=REPO, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    report = json.loads((out / "generate_ep.json").read_text())
    click.echo("| model | batch | lean CPU s | megatron's step CPU s | megatron's / lean | "
               "tokens equal |\n|---|---|---|---|---|---|")
    for name, result in report["models"].items():
        for batch, r in result.items():
            click.echo(f"| {name} | {batch[5:]} | {r['lean_s']} | {r['megatron_s']} | "
                       f"{r['speedup']}x | {r['tokens_equal']} |")


if __name__ == "__main__":
    main()
