"""GPU check of the model and training paths (issues 4, 5, 23, 24): one short run on one GPU.

Four parts, each printing one JSON line (and writing ``OUT/gpu_check.json``):

1. ``vision``: the real-shaped vision towers (configs/qwen2_5_vl_7b.yaml, qwen3_vl_8b.yaml,
   nemotron_omni_30b_a3b.yaml), bf16, TransformerEngine layer specs when TE is importable (the
   local spec otherwise, said in the output), forward + backward over a batch of InfoVQA-sized
   images; reports patches/s and the achieved TFLOP/s (``models.flops.vision_flops`` x 3).
2. ``packed``: packed batches in megatron's THD format through TE's varlen attention (the tiny
   models of each family, bf16): the largest |logit difference| between every packed sample and
   the same sample alone, next to the bf16 noise of the unpacked batch (``max_abs_diff`` must
   stay of that order; a sample that attended across its segment is off by far more);
3. ``train``: ``train.py`` for a few real-shaped steps (Qwen2.5-VL 3B shapes, random init, bf16,
   packing on) on lookalike shards built on the spot (lookalikes.demo); reports the median step's
   tokens/s, TFLOP/s and MFU against the GPU's dense bf16 peak (``--peak-tflops``, 989 for an
   H200).

4. ``moe``: the tiny Qwen3-VL MoE and Qwen3.5 MoE models with TransformerEngine's grouped-GEMM
   experts (``moe_grouped_gemm``, TE specs) against the local spec's sequential experts on the
   same weights (saved from the local model, loaded by the dist checkpoint into the TE one), in
   fp32 on the GPU: the largest |logit difference| and the relative difference of the gradient
   norm after one backward (both must be at float32 noise, ~1e-5). The Qwen3.5 model also needs
   fla-core and causal-conv1d for its DeltaNet layers: without them its row says so.

``--smoke`` runs every part with the tiny configs on CPU in seconds: the test suite runs it so
the script itself is known to work where no GPU is lent (bench/gpu_check.sh is the device entry).

Run: python bench/gpu_check.py [--out bench_out] [--steps 6] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: part -> (model config of the real run, of the smoke run)
TOWERS = {
    "qwen2.5-vl-7b": ("configs/qwen2_5_vl_7b.yaml", "configs/qwen2_5_vl_tiny.yaml"),
    "qwen3-vl-8b": ("configs/qwen3_vl_8b.yaml", "configs/qwen3_vl_tiny.yaml"),
    "nemotron-omni-30b-a3b": ("configs/nemotron_omni_30b_a3b.yaml",
                              "configs/nemotron_omni_tiny.yaml"),
}
#: images per vision batch as (height, width) in pixels: InfoVQA-like pages at ~1 MP
IMAGES = [(1344, 896), (1024, 1024), (1792, 672), (896, 1344)]


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
        return True
    except ImportError:
        return False


def time_step(tower, pixels, grid, repeats: int) -> float:
    """Median seconds of one forward + backward of ``tower`` (after a warm-up step)."""
    import torch

    def step():
        out = tower(pixels, grid)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()

    step()  # warm-up (kernels, allocator)
    times = []
    for _ in range(repeats):
        if pixels.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if pixels.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def vision_part(smoke: bool, repeats: int) -> list[dict]:
    import torch

    from energon_tasks.config import TaskEncoderConfig
    from models.families import config_module
    from models.flops import vision_flops
    from models.parallel import init_parallel

    init_parallel()
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    use_te = te_available() and not smoke
    rows = []
    for name, (real, tiny) in TOWERS.items():
        family = "nemotron_omni" if name.startswith("nemotron") else "qwen2_5_vl"
        cfg = config_module(family).load_yaml(REPO / (tiny if smoke else real))
        geometry = TaskEncoderConfig(model={"qwen2.5-vl-7b": "qwen2.5-vl",
                                            "qwen3-vl-8b": "qwen3-vl"}.get(name, "nemotron-omni"),
                                     max_pixels=None).resolve().geometry
        sizes = [(h // 8, w // 8) for h, w in IMAGES] if smoke else IMAGES
        grids = [list(geometry.image_grid(h, w).grid_thw) for h, w in sizes]
        if family == "nemotron_omni":
            from models.families.nemotron_omni.radio import RadioEncoder

            tower = RadioEncoder(cfg, use_te=use_te)
            width = cfg.vision.in_channels * cfg.vision.patch_size ** 2
        else:
            from models.qwen_vision import QwenVisionEncoder

            tower = QwenVisionEncoder(cfg, use_te=use_te)
            v = cfg.vision
            width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        tower = tower.to(device=device, dtype=dtype)
        patches = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(patches, width, device=device, dtype=dtype)
        grid = torch.tensor(grids, dtype=torch.long)
        seconds = time_step(tower, pixels, grid, repeats)
        flops = 3 * vision_flops(cfg, [grids])
        rows.append({"part": "vision", "tower": name, "te": use_te, "dtype": str(dtype),
                     "images": len(grids), "patches": patches, "step_s": round(seconds, 4),
                     "patches_per_s": round(patches / seconds, 1),
                     "tflops_per_s": round(flops / seconds / 1e12, 2)})
        print(json.dumps(rows[-1]), flush=True)
        del tower, pixels
    return rows


def logits(model, inputs: dict):
    """The model's logits (float32, on the CPU) for batch-contract ``inputs``, moved to the
    model's device and pixel dtype."""
    import torch

    param = next(model.parameters())
    moved = {k: v.to(param.device) if isinstance(v, torch.Tensor) else v
             for k, v in inputs.items()}
    for key in ("pixel_values", "pixel_values_videos"):
        if key in moved:
            moved[key] = moved[key].to(param.dtype)
    with torch.no_grad():
        return model(**moved).float().cpu()


def packed_part(smoke: bool) -> list[dict]:
    """Each family's tiny model: packed samples vs the same samples alone (max |logit diff|)."""
    import torch

    from lookalikes.model_inputs import pack_inputs
    from models.families import build_model, config_module
    from models.parallel import init_parallel
    from models.verify_inputs import make_inputs

    init_parallel()
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    use_te = te_available() and not smoke
    rows = []
    for family, config in (("qwen2_5_vl", "qwen2_5_vl_tiny"), ("qwen3_vl", "qwen3_vl_tiny"),
                           ("nemotron_omni", "nemotron_omni_tiny")):
        cfg = config_module(family).load_yaml(REPO / "configs" / f"{config}.yaml")
        torch.manual_seed(0)
        model = build_model(cfg, use_te=use_te).to(device=device, dtype=dtype).eval()
        cases = list(make_inputs(cfg).values())
        packed_rows = [cases[:2], cases[2:]]
        packed = logits(model, pack_inputs(packed_rows, tail=5))
        unpacked = logits(model, pack_inputs([[c] for c in cases]) | {"cu_seqlens": None,
                                                                       "max_seqlen": None})
        diff = noise = 0.0
        for r, row in enumerate(packed_rows):
            at = 0
            for case in row:
                n = case["input_ids"].shape[1]
                alone = logits(model, case)[0]
                diff = max(diff, float((packed[r, at:at + n] - alone).abs().max()))
                at += n
        for i, case in enumerate(cases):
            n = case["input_ids"].shape[1]
            noise = max(noise, float((unpacked[i, :n] - logits(model, case)[0]).abs().max()))
        rows.append({"part": "packed", "family": family, "te": use_te, "dtype": str(dtype),
                     "max_abs_diff": diff, "unpacked_batch_noise": noise})
        print(json.dumps(rows[-1]), flush=True)
        del model
    return rows


def moe_part(smoke: bool, out: Path) -> list[dict]:
    """The tiny MoE models: grouped-GEMM experts (TE) vs sequential experts (local), same weights;
    on CPU (``smoke``) both are the local spec (the plumbing only)."""
    import torch

    from models.checkpoint import load_checkpoint, save_checkpoint
    from models.families import build_model, config_module
    from models.parallel import init_parallel
    from models.verify_inputs import make_inputs

    init_parallel()
    device = "cpu" if smoke else "cuda"
    use_te = te_available() and not smoke
    rows = []
    for family, config in (("qwen3_vl_moe", "qwen3_vl_moe_tiny"),
                           ("qwen3_5_moe", "qwen3_5_moe_tiny")):
        cfg = config_module(family).load_yaml(REPO / "configs" / f"{config}.yaml")
        torch.manual_seed(0)
        try:
            local = build_model(cfg, use_te=False).to(device)
            folder = out / f"gpu_check_moe_{family}"
            save_checkpoint(local, cfg, folder)
            grouped = load_checkpoint(folder, use_te=use_te)[0].to(device)
        except ValueError as error:  # e.g. the DeltaNet kernels are not installed
            rows.append({"part": "moe", "family": family, "skipped": str(error)})
            print(json.dumps(rows[-1]), flush=True)
            continue
        inputs = make_inputs(cfg)["images_interleaved"]
        norms, outs = [], []
        for model in (local, grouped):
            model.train()
            moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                     for k, v in inputs.items()}
            loss, mask = model(**moved, labels=moved["input_ids"])
            (loss.sum() / mask.sum()).backward()
            norms.append(float(torch.norm(torch.stack(
                [p.grad.float().norm() for p in model.parameters() if p.grad is not None]))))
            outs.append(logits(model.eval(), inputs))
        rows.append({"part": "moe", "family": family, "te_grouped_gemm": use_te,
                     "max_abs_logit_diff": float((outs[0] - outs[1]).abs().max()),
                     "grad_norm_rel_diff": abs(norms[0] - norms[1]) / norms[0]})
        print(json.dumps(rows[-1]), flush=True)
        del local, grouped
    return rows


def train_part(smoke: bool, steps: int, out: Path, peak_tflops: float,
               data: str | None = None) -> dict:
    """train.py on Mantis-like shards (``data``, or lookalikes built on the spot); the median
    logged step's throughput."""
    if data is None:
        built = out / "gpu_check_data"
        if not (built / "mantis" / "metadataset.yaml").is_file():
            subprocess.run([sys.executable, "-m", "lookalikes.demo", "--out", str(built)],
                           cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        data = str(built / "mantis" / "metadataset.yaml")
    run = out / "gpu_check_run"
    overrides = [f"data.path={data}", f"out={run}",
                 f"train.steps={steps}", "log.tensorboard=false", "checkpoint.save_final=false",
                 "data.num_workers=2", "task_encoder.packing=true"]
    if not smoke:  # real shapes: Qwen2.5-VL 3B, InfoVQA-class resolution, bf16
        overrides += ["model.base=configs/qwen2_5_vl_3b.yaml", "task_encoder.max_pixels=1003520",
                      "task_encoder.max_visual_tokens=8192", "task_encoder.seq_length=4096",
                      "train.micro_batch_size=2", "train.lr=1e-5", "train.min_lr=1e-6",
                      "train.precision=bf16"]
    proc = subprocess.run([sys.executable, "train.py", "configs/train_qwen_vl_mantis.yaml",
                           *overrides, "--overwrite"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if "loss" in r]  # training steps (not the val_loss records)
    timed = records[1:] or records  # the first step pays compilation / allocator warm-up
    tflops = statistics.median(r["tflops_per_s"] for r in timed)
    result = {"part": "train", "model": "tiny" if smoke else "qwen2.5-vl-3b", "steps": steps,
              "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"],
              "step_time_s": statistics.median(r["step_time_s"] for r in timed),
              "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
              "visual_tokens_per_s": statistics.median(r["visual_tokens_per_s"] for r in timed),
              "tflops_per_s": tflops, "mfu": round(tflops / peak_tflops, 4),
              "peak_mem_gb": max(r["peak_mem_gb"] for r in records)}
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    ap.add_argument("--smoke", action="store_true", help="tiny configs on CPU (tests)")
    ap.add_argument("--part", choices=("all", "vision", "packed", "moe", "train"),
                    default="all")
    ap.add_argument("--data", help="Mantis-like dataset for the train part (default: lookalikes)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device (use --smoke for the CPU plumbing run)")
    report = {"te": te_available()}
    if args.part in ("all", "vision"):
        report["vision"] = vision_part(args.smoke, 2 if args.smoke else args.repeats)
    if args.part in ("all", "packed"):
        report["packed"] = packed_part(args.smoke)
    if args.part in ("all", "moe"):
        report["moe"] = moe_part(args.smoke, out)
    if args.part in ("all", "train"):
        report["train"] = train_part(args.smoke, 3 if args.smoke else args.steps, out,
                                     args.peak_tflops, args.data)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
