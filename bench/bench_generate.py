"""Greedy generation of models/generation/generate.py side by side with transformers' `generate`,
and where the time of a decode step goes.

For each family's tiny random model (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE built with transformers;
Nemotron-Omni with the hybrid LM "M*E-": Mamba2, attention, MoE with a shared expert, MLP;
Qwen3.5 and Qwen3.5-MoE: three Gated DeltaNet layers, then gated attention, MoE with a gated
shared expert; imported with `models.convert hf-to-mcore`) the same prompts (text + one image +
text, of unequal length: 1 to 10 extra text tokens) are answered greedily, a fixed number of new
tokens (no early stop), on CPU in one process with one intra-op thread, at batch 1 and batch 4
(both left-padded; transformers with its attention mask, ours with the prefill's mask and the
pads kept out of the Mamba / DeltaNet states, then one batched lean decode). Time is CPU time of
this process (`time.process_time`, robust to other load on a shared machine); the generators
alternate in each repeat (after one warm-up each) and the median of `--repeats` is reported.

Reported per model and batch: transformers' time / ours (the speed-up), our share of prefill;
per decode step (batch 4): CPU ms and Python function calls (cProfile) of our lean step,
megatron's own decode step (`language_model(...)` with its static inference context, what
models/generation/generate.py falls back to) and transformers' step, and the share of megatron's
step spent re-rotating cached keys; per step at batch 1 for ours and megatron's. Tokens: ours at
batch 4 equal transformers' at batch 1, row by row.

Usage: python bench/bench_generate.py --out bench_out/generate
"""

from __future__ import annotations

import cProfile
import inspect
import json
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NEVER = 10 ** 6  # an id outside the tiny vocabularies: generation runs to max_new_tokens
MODELS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "nemotron_omni", "qwen3_5", "qwen3_5_moe")
#: Nemotron's bench LM: every layer kind; MoE widths as small as the rest of the tiny model
NEMOTRON = dict(pattern="M*E-", text=dict(moe_intermediate_size=96,
                                          moe_shared_expert_intermediate_size=96))


def import_tiny(name: str, out: Path) -> tuple[Path, Path]:
    """(HF folder, megatron checkpoint) of one tiny model under ``out / name``: built with
    transformers, imported with ``models.convert hf-to-mcore`` in a subprocess (megatron's
    checkpoint writer keeps a process of its own)."""
    from lookalikes.models import build_tiny_hf, build_tiny_nemotron_omni, build_tiny_qwen3_5

    hf_dir, mcore_dir = out / name / "hf", out / name / "mcore"
    if name == "nemotron_omni":
        build_tiny_nemotron_omni(hf_dir, **NEMOTRON)
    elif name in ("qwen3_5", "qwen3_5_moe"):
        build_tiny_qwen3_5(hf_dir, moe=name == "qwen3_5_moe", max_positions=2048)
    else:
        build_tiny_hf(name, hf_dir, max_positions=2048, vision_depth=2)
    subprocess.run([sys.executable, "-m", "models.convert", "hf-to-mcore", "--hf", str(hf_dir),
                    "--out", str(mcore_dir)], cwd=REPO, check=True, capture_output=True)
    return hf_dir, mcore_dir


def build(name: str, out: Path):
    """(model, cfg, hf) of one tiny model (``import_tiny``)."""
    from models.checkpointing.checkpoint import load_checkpoint
    from models.convert import load_hf_model

    hf_dir, mcore_dir = import_tiny(name, out)
    model, cfg = load_checkpoint(mcore_dir, use_te=False)
    return model, cfg, load_hf_model(hf_dir)


def make_cases(cfg, n: int, seed: int = 0) -> list[dict]:
    """n single-row inputs: the family's one-image verify case + 1, 4, 7 or 10 text tokens."""
    from models.hf.verify_inputs import make_inputs

    g = torch.Generator().manual_seed(seed)
    case = make_inputs(cfg, seed)["one_image"]
    low = min(t for t in (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id,
                          cfg.lm.vocab_size) if t >= 0)
    cases = []
    for i in range(n):
        extra = 1 + 3 * (i % 4)
        ids = torch.cat([case["input_ids"], torch.randint(8, low, (1, extra), generator=g)], 1)
        pos = case["position_ids"]
        more = pos.amax() + 1 + torch.arange(extra)
        cases.append(dict(case, input_ids=ids,
                          position_ids=torch.cat([pos, more.expand(3, 1, -1)], -1)))
    return cases


def _prompt(case: dict):
    from models.generation.generate import Prompt

    return Prompt(case["input_ids"][0], case["position_ids"][:, 0], case["pixel_values"],
                  case["image_grid_thw"])


def hf_generate(hf, cfg, cases: list[dict], new: int) -> list[list[int]]:
    """transformers' greedy generate over the rows, left-padded (its attention mask hides the
    padding); the token types its M-RoPE reads where its forward takes them."""
    from models.hf.verify_inputs import hf_inputs

    rows = [hf_inputs(cfg, c) for c in cases]
    width = max(r["input_ids"].shape[1] for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        n = r["input_ids"].shape[1]
        ids[i, width - n:], mask[i, width - n:] = r["input_ids"][0], 1
    kwargs = {k: torch.cat([r[k] for r in rows]) for k in rows[0]
              if k not in ("input_ids", "position_ids")}
    if "mm_token_type_ids" in inspect.signature(hf.forward).parameters:
        kwargs["mm_token_type_ids"] = (ids == cfg.image_token_id).int() * mask
    out = hf.generate(input_ids=ids, attention_mask=mask, **kwargs, do_sample=False,
                      max_new_tokens=new, min_new_tokens=new, eos_token_id=NEVER, pad_token_id=0)
    return out[:, width:].tolist()


def median_cpu_times(fns: dict, repeats: int) -> dict:
    """Median CPU seconds of each function; one warm-up each, then the functions alternate."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def per_step(fn, new: int) -> dict:
    """CPU ms and Python calls of one decode step of ``fn(max_new_tokens)``: the difference of a
    run of ``new`` tokens and a run of 1 (prefill only), per step; and the share of the steps'
    time in megatron's rotary function."""
    def profiled(n):
        prof = cProfile.Profile()
        start = time.process_time()
        prof.runcall(fn, n)
        seconds = time.process_time() - start
        stats = pstats.Stats(prof)
        rotary = sum(v[3] for k, v in stats.stats.items()
                     if k[2] == "_apply_rotary_pos_emb_bshd")
        return seconds, stats.total_calls, rotary

    fn(2)  # warm-up
    plain = {}
    for n in (1, new):
        runs = []
        for _ in range(3):
            start = time.process_time()
            fn(n)
            runs.append(time.process_time() - start)
        plain[n] = statistics.median(runs)
    (_, calls1, rot1), (_, calls, rot) = profiled(1), profiled(new)
    step = (plain[new] - plain[1]) / (new - 1)
    return {"ms": round(step * 1e3, 3), "python_calls": round((calls - calls1) / (new - 1)),
            "rotary_share": round((rot - rot1) / (new - 1) / step, 3) if step > 0 else None}


def bench_model(name: str, out: Path, n_prompts: int, new: int, repeats: int) -> dict:
    from models.generation import decode_step
    from models.generation.generate import GenerationStats, greedy_generate

    model, cfg, hf = build(name, out)
    cases = make_cases(cfg, n_prompts)
    prompts = [_prompt(c) for c in cases]

    def ours(batch, n=new, stats=None):
        for k in range(0, len(prompts), batch):
            greedy_generate(model, prompts[k:k + batch], eos_id=NEVER, max_new_tokens=n,
                            stats=stats)

    def theirs(batch, n=new):
        for k in range(0, len(cases), batch):
            hf_generate(hf, cfg, cases[k:k + batch], n)

    alone = [hf_generate(hf, cfg, [c], new)[0] for c in cases[:4]]
    same = greedy_generate(model, prompts[:4], eos_id=NEVER, max_new_tokens=new) == alone
    result = {"identical_tokens": same}
    with torch.no_grad():
        for b in (1, 4):
            s = median_cpu_times({"ours": lambda b=b: ours(b), "hf": lambda b=b: theirs(b)},
                                 repeats)
            stats = GenerationStats()
            ours(b, stats=stats)
            result[f"batch{b}"] = {"ours_s": round(s["ours"], 4), "hf_s": round(s["hf"], 4),
                                   "speedup": round(s["hf"] / s["ours"], 2),
                                   "prefill_share": round(stats.prefill_seconds
                                                          / stats.seconds, 2)}
        steps = {"lean": per_step(lambda n: ours(4, n), new),
                 "hf": per_step(lambda n: theirs(4, n), new),
                 "lean_batch1": per_step(lambda n: ours(1, n), new)}
        build_lean = decode_step.build
        decode_step.build = lambda *a, **k: None  # megatron's own decode step
        try:
            steps["megatron"] = per_step(lambda n: ours(4, n), new)
            steps["megatron_batch1"] = per_step(lambda n: ours(1, n), new)
        finally:
            decode_step.build = build_lean
    batches = len(prompts) // 4
    result["step_batch4"] = {k: {**v, "ms": round(v["ms"] / batches, 3),
                                 "python_calls": v["python_calls"] // batches}
                             for k, v in steps.items() if not k.endswith("batch1")}
    result["step_batch1_ms"] = {k.split("_")[0]: round(steps[k]["ms"] / len(prompts), 3)
                                for k in ("lean_batch1", "megatron_batch1")}
    return result


@click.command()
@click.option("--out", default="bench_out/generate", type=click.Path(path_type=Path))
@click.option("--models", "names", default=",".join(MODELS), show_default=True)
@click.option("--prompts", "n_prompts", default=8, show_default=True)
@click.option("--new-tokens", default=32, show_default=True)
@click.option("--repeats", default=5, show_default=True)
def main(out: Path, names: str, n_prompts: int, new_tokens: int, repeats: int) -> None:
    from models.parallel import init_parallel

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    init_parallel()
    results = {name: bench_model(name, out, n_prompts, new_tokens, repeats)
               for name in names.split(",")}
    (out / "generate.json").write_text(json.dumps(
        {"prompts": n_prompts, "new_tokens": new_tokens,
         "timing": f"CPU time, one thread, median of {repeats}, alternating",
         "models": results}, indent=1))
    click.echo("| model | batch 1: transformers / ours | batch 4: transformers / ours | "
               "our prefill share (b1 / b4) | tokens equal |\n|---|---|---|---|---|")
    for name, r in results.items():
        click.echo(f"| {name} | {r['batch1']['speedup']}x | {r['batch4']['speedup']}x | "
                   f"{r['batch1']['prefill_share']} / {r['batch4']['prefill_share']} | "
                   f"{r['identical_tokens']} |")
    click.echo("\n| model | decode step | CPU ms, batch 4 | CPU ms, batch 1 | Python calls, "
               "batch 4 | rotary share, batch 4 |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        for kind, s in r["step_batch4"].items():
            click.echo(f"| {name} | {kind} | {s['ms']} | {r['step_batch1_ms'].get(kind, '')} | "
                       f"{s['python_calls']} | {s['rotary_share']} |")


if __name__ == "__main__":
    main()
