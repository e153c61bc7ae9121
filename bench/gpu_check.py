"""GPU check of the model and training paths (issues 4, 5, 23, 24): one short run on one GPU.

Six parts (run in the order of ``PARTS``: deltanet, verify, packed, moe, vision, train), each
row printed as one JSON line:

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
   fla-core for its DeltaNet layers (its row says so otherwise). Without TE the part is skipped.

5. ``deltanet``: the Gated DeltaNet kernels the Qwen3.5 layers run on GPU (fla-core's
   ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``, and the conv:
   causal-conv1d, or fla-core's Triton conv where it is not installed) against the torch versions
   of models/cpu/gated_delta.py on the same GPU tensors, fp32: a packed row of three samples
   (outputs, final states, every input's gradient), one decode step from those states, the conv
   over the packed row and its decode update; then both chunked rules timed forward + backward at
   Qwen3.5-9B's DeltaNet shape (16 key / 32 value heads of 128) over 8192 packed tokens, bf16.
6. ``verify``: ``python -m models.convert hf-to-mcore`` then ``verify`` for a tiny transformers
   model of each family (``--hf-models DIR/<family>``, or built here with tests/tiny_hf.py): our
   model on the GPU against transformers' on the CPU, fp32, the largest |logit difference| over
   the generated inputs (the CPU parity tests' bound is 1e-4).

Each part's rows are written to ``gpu_check.json`` as soon as the part ends; a row that fails
records its error's last line (the traceback goes to stderr) and the next row runs.

``--smoke`` runs every part with the tiny configs on CPU in seconds: the test suite runs it so
the script itself is known to work where no GPU is lent (bench/gpu_check.sh is the device entry).

Run: python bench/gpu_check.py [--out bench_out] [--steps 6] [--smoke] [--part NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from functools import partial
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
#: the parts in the order they run (the issues' open checks first, the longest last)
PARTS = ("deltanet", "verify", "packed", "moe", "vision", "train")
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


def last_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:500]


def guarded(rows: list, part: str, label: dict, work) -> None:
    """Append (and print) ``work()``'s row, labelled; a failure becomes the row's ``error`` (its
    last line; the traceback on stderr) and the part goes on with its next row."""
    try:
        row = work()
    except Exception as error:  # noqa: BLE001 - a check reports every row it can
        traceback.print_exc()
        row = {"error": last_line(error)}
    rows.append({"part": part, **label, **row})
    print(json.dumps(rows[-1]), flush=True)


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

    def tower_row(name: str, real: str, tiny: str) -> dict:
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
        return {"te": use_te, "dtype": str(dtype), "images": len(grids), "patches": patches,
                "step_s": round(seconds, 4), "patches_per_s": round(patches / seconds, 1),
                "tflops_per_s": round(flops / seconds / 1e12, 2)}

    for name, (real, tiny) in TOWERS.items():
        guarded(rows, "vision", {"tower": name}, partial(tower_row, name, real, tiny))
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

    def family_row(family: str, config: str) -> dict:
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
        return {"te": use_te, "dtype": str(dtype), "max_abs_diff": diff,
                "unpacked_batch_noise": noise}

    for family, config in (("qwen2_5_vl", "qwen2_5_vl_tiny"), ("qwen3_vl", "qwen3_vl_tiny"),
                           ("qwen3_5", "qwen3_5_tiny"), ("nemotron_omni", "nemotron_omni_tiny")):
        guarded(rows, "packed", {"family": family}, partial(family_row, family, config))
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
    if not smoke and not use_te:
        return [{"part": "moe", "skipped": "TransformerEngine is not installed: no grouped-GEMM "
                                           "experts to compare with the sequential ones"}]

    def family_row(family: str, config: str) -> dict:
        cfg = config_module(family).load_yaml(REPO / "configs" / f"{config}.yaml")
        torch.manual_seed(0)
        local = build_model(cfg, use_te=False).to(device)
        folder = out / f"gpu_check_moe_{family}"
        save_checkpoint(local, cfg, folder)
        grouped = load_checkpoint(folder, use_te=use_te)[0].to(device)
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
        return {"te_grouped_gemm": use_te,
                "max_abs_logit_diff": float((outs[0] - outs[1]).abs().max()),
                "grad_norm_rel_diff": abs(norms[0] - norms[1]) / norms[0]}

    for family, config in (("qwen3_vl_moe", "qwen3_vl_moe_tiny"),
                           ("qwen3_5_moe", "qwen3_5_moe_tiny")):
        guarded(rows, "moe", {"family": family}, partial(family_row, family, config))
    return rows


def deltanet_part(smoke: bool) -> list[dict]:
    """The Gated DeltaNet kernels models/gated_deltanet.py runs (fla-core / causal-conv1d on GPU)
    against the torch versions of models/cpu/gated_delta.py on the same tensors (module
    docstring, part 5); on CPU (``smoke``) both are the torch ones (the plumbing only)."""
    import torch
    import torch.nn.functional as F

    from models import gated_deltanet as kernels
    from models.cpu import gated_delta as reference
    from models.parallel import init_parallel

    init_parallel()  # on CPU: binds the torch kernels into models.gated_deltanet
    device = "cpu" if smoke else "cuda"
    if kernels.chunk_gated_delta_rule is None or kernels.causal_conv1d_fn is None:
        return [{"part": "deltanet", "skipped": "fla-core is not installed"}]
    conv_kind = ("fla-core triton" if kernels.causal_conv1d_fn is kernels.fla_causal_conv1d_fn
                 else getattr(kernels.causal_conv1d_fn, "__module__", "?"))
    rows = []

    def rel(a, b) -> float:
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))

    def inputs(length: int, heads: int, dim: int, dtype, seed: int):
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        q, k, v = (randn(1, length, heads, dim) for _ in range(3))
        g = F.logsigmoid(randn(1, length, heads).float() + 3).to(dtype)  # decays near 1
        beta = torch.sigmoid(randn(1, length, heads).float()).to(dtype)
        return [t.requires_grad_() for t in (q, k, v, g, beta)]

    def chunk_row() -> dict:
        cu = torch.tensor([0, 37, 100, 229], device=device)  # odd lengths, across chunks of 64
        names = ("q", "k", "v", "g", "beta")
        result = {}
        grads = {}
        for label, module in (("kernel", kernels), ("torch", reference)):
            xs = inputs(229, 4, 128, torch.float32, seed=1)
            out, state = module.chunk_gated_delta_rule(*xs, output_final_state=True,
                                                       cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
            result[label] = (out.detach(), state.detach())
            # one decode step per sample from its final state
            step = [t.detach()[:, :3].transpose(0, 1).contiguous() for t in xs]  # (3, 1, ...)
            result[label + "_decode"] = module.fused_recurrent_gated_delta_rule(
                *step, initial_state=state.detach().clone(), output_final_state=True,
                use_qk_l2norm_in_kernel=True)
            weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(device)
            try:  # fla-core refuses its backward on Hopper with Triton 3.4 - 3.7.0
                (out * weight).sum().backward()
                grads[label] = {n: x.grad for n, x in zip(names, xs)}
            except RuntimeError as error:
                grads["error"] = last_line(error)
        row = {"dtype": "float32", "tokens": 229, "samples": 3,
               "out_rel": rel(result["kernel"][0], result["torch"][0]),
               "final_state_rel": rel(result["kernel"][1], result["torch"][1])}
        if "error" in grads:
            row["backward_error"] = grads["error"]
        else:
            row.update({f"grad_{n}_rel": rel(grads["kernel"][n], grads["torch"][n])
                        for n in names})
        row["decode_out_rel"] = rel(result["kernel_decode"][0], result["torch_decode"][0])
        row["decode_state_rel"] = rel(result["kernel_decode"][1], result["torch_decode"][1])
        return row

    def conv_row() -> dict:
        gen = torch.Generator().manual_seed(3)
        channels, length, width = 96, 229, 4
        seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor([37, 63, 129]))[None]
        seq_idx = seq_idx.to(device=device, dtype=torch.int32)
        outs, grads = {}, {}
        for label, fn in (("kernel", kernels.causal_conv1d_fn),
                          ("torch", reference.causal_conv1d_fn)):
            x = torch.randn(1, length, channels, generator=gen.manual_seed(4)).to(device)
            x = x.transpose(1, 2).requires_grad_()  # (b, d, l), the layer's strides
            w = torch.randn(channels, width, generator=gen.manual_seed(5)).to(device)
            w.requires_grad_()
            out = fn(x, w, None, seq_idx=seq_idx, activation="silu")
            (out * out.detach().sin()).sum().backward()
            outs[label], grads[label] = out.detach(), (x.grad, w.grad)
        states, steps = {}, {}
        for label, fn in (("kernel", kernels.causal_conv1d_update),
                          ("torch", reference.causal_conv1d_update)):
            state = torch.randn(3, channels, width - 1, generator=gen.manual_seed(6)).to(device)
            token = torch.randn(3, channels, generator=gen.manual_seed(7)).to(device)
            w = torch.randn(channels, width, generator=gen.manual_seed(5)).to(device)
            steps[label] = fn(token, state, w, None, "silu")
            states[label] = state
        return {"conv": conv_kind, "out_rel": rel(outs["kernel"], outs["torch"]),
                "grad_x_rel": rel(grads["kernel"][0], grads["torch"][0]),
                "grad_w_rel": rel(grads["kernel"][1], grads["torch"][1]),
                "update_out_rel": rel(steps["kernel"], steps["torch"]),
                "update_state_rel": rel(states["kernel"], states["torch"])}

    def speed_row() -> dict:
        length, heads, dim = (512, 4, 32) if smoke else (8192, 32, 128)  # Qwen3.5-9B: 32 x 128
        cu = torch.arange(0, length + 1, length // 4, device=device)
        dtype = torch.float32 if smoke else torch.bfloat16
        timed = {}
        for label, rule in (("kernel", kernels.chunk_gated_delta_rule),
                            ("torch", reference.chunk_gated_delta_rule)):
            xs = inputs(length, heads, dim, dtype, seed=8)

            def step(rule=rule, xs=xs):
                out, _ = rule(*xs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
                out.float().square().mean().backward()

            step()
            times = []
            for _ in range(3):
                if not smoke:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                step()
                if not smoke:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            timed[label] = statistics.median(times)
        return {"dtype": str(dtype), "tokens": length, "value_heads": heads, "head_dim": dim,
                "kernel_fwd_bwd_s": round(timed["kernel"], 5),
                "torch_fwd_bwd_s": round(timed["torch"], 5),
                "speedup": round(timed["torch"] / timed["kernel"], 2)}

    guarded(rows, "deltanet", {"check": "chunk_and_decode"}, chunk_row)
    guarded(rows, "deltanet", {"check": "conv"}, conv_row)
    guarded(rows, "deltanet", {"check": "speed"}, speed_row)
    return rows


#: the families the verify part imports and checks (the smoke run: the first only)
VERIFY_FAMILIES = ("qwen3_5_moe", "qwen3_5", "qwen3_vl_moe", "qwen3_vl", "qwen2_5_vl",
                   "nemotron_omni")


def build_tiny_hf_folder(family: str, folder: Path) -> Path:
    """A tiny transformers model of ``family`` (tests/tiny_hf.py, the parity tests' shapes)."""
    from tests import tiny_hf

    if family in ("qwen3_5", "qwen3_5_moe"):
        return tiny_hf.build_tiny_qwen3_5(folder, moe=family == "qwen3_5_moe")
    if family == "nemotron_omni":
        return tiny_hf.build_tiny_nemotron_omni(folder)
    return tiny_hf.build_tiny_hf(family, folder)


def verify_part(smoke: bool, out: Path, hf_models: str | None) -> list[dict]:
    """``models.convert hf-to-mcore`` + ``verify`` per family, the families side by side (one
    process pair each); the largest |logit difference| over verify's inputs."""
    families = VERIFY_FAMILIES[:1] if smoke else VERIFY_FAMILIES
    rows, runs = [], {}
    for family in families:
        hf = Path(hf_models) / family if hf_models else out / "gpu_check_hf" / family
        if not (hf / "config.json").is_file():
            build_tiny_hf_folder(family, hf)
        mcore = out / "gpu_check_mcore" / family
        script = (f"{sys.executable} -m models.convert hf-to-mcore --hf {hf} --out {mcore} && "
                  f"{sys.executable} -m models.convert verify --hf {hf} --mcore {mcore}")
        runs[family] = subprocess.Popen(["bash", "-c", script], cwd=REPO, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def family_row(family: str) -> dict:
        stdout, stderr = runs[family].communicate(timeout=400)
        if runs[family].returncode != 0:
            print(stderr[-4000:], file=sys.stderr)
            errors = [line for line in stderr.splitlines() if "Error" in line or "error:" in line]
            raise RuntimeError(errors[-1] if errors else "failed")
        report = json.loads(stdout[stdout.index("{"):])
        return {"device": "cpu" if smoke else "cuda", "dtype": "float32",
                "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in report.values()),
                "inputs": {name: r["max_abs_logit_diff"] for name, r in report.items()}}

    for family in families:
        guarded(rows, "verify", {"family": family}, partial(family_row, family))
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
        print(proc.stderr[-6000:], file=sys.stderr)
        raise RuntimeError(f"train.py failed ({proc.returncode}): "
                           f"{proc.stderr.strip().splitlines()[-1:]}")
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
    ap.add_argument("--part", nargs="+", choices=("all", *PARTS), default=["all"],
                    help="the parts to run, in the order of PARTS")
    ap.add_argument("--data", help="Mantis-like dataset for the train part (default: lookalikes)")
    ap.add_argument("--hf-models", help="folder of tiny HF models named by family for the verify "
                                        "part (default: built with tests/tiny_hf.py)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device (use --smoke for the CPU plumbing run)")
    parts = {
        "deltanet": lambda: deltanet_part(args.smoke),
        "verify": lambda: verify_part(args.smoke, out, args.hf_models),
        "packed": lambda: packed_part(args.smoke),
        "moe": lambda: moe_part(args.smoke, out),
        "vision": lambda: vision_part(args.smoke, 2 if args.smoke else args.repeats),
        "train": lambda: train_part(args.smoke, 3 if args.smoke else args.steps, out,
                                    args.peak_tflops, args.data),
    }
    report = {"te": te_available()}
    for name in [part for part in PARTS if part in args.part or "all" in args.part]:
        try:
            report[name] = parts[name]()
        except Exception as error:  # noqa: BLE001 - the other parts still run
            traceback.print_exc()
            report[name] = {"part": name, "error": last_line(error)}
            print(json.dumps(report[name]), flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
