"""Generation throughput of models/generate.py side by side with transformers' `generate`.

The same tiny random Qwen2.5-VL (built with transformers, imported with `models.convert
hf-to-mcore`) answers the same prompts (text + one image + text), greedy, a fixed number of new
tokens (no early stop), on CPU in one process with one intra-op thread. Time is CPU time of this
process (`time.process_time`: robust to other load on a shared machine); the two generators run
alternately in each repeat (after one warm-up each) and the median of `--repeats` is reported, at
batch 1 and batch 4 (prompts of equal length, so no padding). Reported: samples/s and generated
tokens/s, and transformers' time / ours (>= 1: ours is not slower); the generated tokens are
checked to be identical.

Usage: python bench/bench_generate.py --out bench_out/generate
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NEVER = 151645  # an id outside the tiny vocabulary: generation runs to max_new_tokens


def make_prompts(cfg, n: int, seed: int = 0):
    """n prompts: 6 text tokens, one 8x8-patch image, 5 text tokens."""
    from models.generate import Prompt
    from models.mrope import mrope_positions

    g = torch.Generator().manual_seed(seed)
    v, merge = cfg.vision, cfg.vision.spatial_merge_size
    grid = torch.tensor([[1, 8, 8]])
    prompts = []
    for _ in range(n):
        ids = torch.cat([torch.randint(8, 280, (6,), generator=g),
                         torch.tensor([cfg.vision_start_token_id]),
                         torch.full((int(grid.prod()) // merge**2,), cfg.image_token_id),
                         torch.tensor([cfg.vision_end_token_id]),
                         torch.randint(8, 280, (5,), generator=g)])
        pixels = torch.randn(int(grid.prod()),
                             v.in_channels * v.temporal_patch_size * v.patch_size**2, generator=g)
        positions = mrope_positions(ids, list(grid), {cfg.image_token_id}, merge)[:, 0]
        prompts.append(Prompt(ids, positions, pixels, grid))
    return prompts


def hf_generate(hf, prompts, image_token: int, new: int) -> list[list[int]]:
    """transformers' greedy generate over prompts of equal length (no padding needed)."""
    ids = torch.stack([p.input_ids for p in prompts])
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                      pixel_values=torch.cat([p.pixel_values for p in prompts]),
                      image_grid_thw=torch.cat([p.image_grid_thw for p in prompts]),
                      mm_token_type_ids=(ids == image_token).int(), do_sample=False,
                      max_new_tokens=new, min_new_tokens=new, eos_token_id=NEVER, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


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


@click.command()
@click.option("--out", default="bench_out/generate", type=click.Path(path_type=Path))
@click.option("--prompts", "n_prompts", default=8, show_default=True)
@click.option("--new-tokens", default=32, show_default=True)
@click.option("--repeats", default=7, show_default=True)
def main(out: Path, n_prompts: int, new_tokens: int, repeats: int) -> None:
    from models.checkpoint import load_checkpoint
    from models.convert import load_hf_model
    from models.generate import greedy_generate
    from models.parallel import init_parallel
    from tests.tiny_hf import build_tiny_hf

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    hf_dir = build_tiny_hf("qwen2_5_vl", out / "hf", max_positions=2048, vision_depth=2)
    subprocess.run([sys.executable, "-m", "models.convert", "hf-to-mcore", "--hf", str(hf_dir),
                    "--out", str(out / "mcore")], cwd=REPO, check=True, capture_output=True)
    init_parallel()
    model, cfg = load_checkpoint(out / "mcore", use_te=False)
    hf = load_hf_model(hf_dir)
    prompts = make_prompts(cfg, n_prompts)

    def ours(batch: int):
        for k in range(0, len(prompts), batch):
            greedy_generate(model, prompts[k:k + batch], eos_id=NEVER, max_new_tokens=new_tokens)

    def theirs(batch: int):
        for k in range(0, len(prompts), batch):
            hf_generate(hf, prompts[k:k + batch], cfg.image_token_id, new_tokens)

    same = (greedy_generate(model, prompts[:4], eos_id=NEVER, max_new_tokens=new_tokens)
            == hf_generate(hf, prompts[:4], cfg.image_token_id, new_tokens))
    seconds = {}
    with torch.no_grad():
        for b in (1, 4):
            seconds.update(median_cpu_times({f"ours_batch{b}": lambda b=b: ours(b),
                                             f"transformers_batch{b}": lambda b=b: theirs(b)},
                                            repeats))
    rows = {name: {"cpu_seconds": round(s, 3), "samples_per_s": round(n_prompts / s, 2),
                   "tokens_per_s": round(n_prompts * new_tokens / s, 1)}
            for name, s in seconds.items()}
    result = {"prompts": n_prompts, "new_tokens": new_tokens, "identical_tokens": same,
              "timing": f"CPU time, median of {repeats}, alternating", "runs": rows,
              **{f"speedup_batch{b}": round(seconds[f"transformers_batch{b}"]
                                            / seconds[f"ours_batch{b}"], 2) for b in (1, 4)}}
    (out / "generate.json").write_text(json.dumps(result, indent=1))
    click.echo("| generator | samples/s (CPU time) | generated tokens/s |\n|---|---|---|")
    for name, r in rows.items():
        click.echo(f"| {name} | {r['samples_per_s']} | {r['tokens_per_s']} |")
    click.echo(f"\nours / transformers: {result['speedup_batch1']}x at batch 1, "
               f"{result['speedup_batch4']}x at batch 4; tokens identical (4 prompts): {same}")


if __name__ == "__main__":
    main()
