"""GPU check of the model and training paths (issues 4, 5, 23, 24, 44): one device call on one GPU.

Parts, in the order they run (``PARTS``); every row is printed as one JSON line and
``gpu_check.json`` is rewritten after each row (complete whatever stops the run), with the
environment (device, driver, every package's version, the command):

1. ``kernels``: every implementation of every layer kind (models/kernels: TE attention,
   flash-attn varlen, causal-conv1d, fla-core's conv and chunked delta rule, mamba_ssm's chunked
   scan, TE grouped experts) checked against the torch reference on this GPU, bf16 and fp32
   (``models.kernels.survey``: accepted / rejected with the worst relative difference /
   unavailable with the reason, the check's seconds, compile included); then the chosen Mamba
   and Gated DeltaNet kernels against torch's, forward + backward timed on a 16K-token packed row
   at the published layer shapes (Nemotron-3 Nano's Mamba, Qwen3.5-9B's DeltaNet), with the peak
   memory of each (the torch chunked kernels' memory at training size).
2. ``train``: every family trains at its published per-layer shapes (layers cut to one GPU) on
   real-shaped samples: a Mantis row of 12 photos, a 6000x9000 page, a 64-frame video
   (bench/gpu_train.py): real tokens/s, padded slots/s, TFLOP/s and MFU (``--peak-tflops``, 989:
   H100 / H200 dense bf16), the vision and LM time split, peak memory beside the estimate, the
   losses (finite, falling), the kernel lines.
3. ``verify``: ``python -m models.convert hf-to-mcore`` then ``verify`` for a tiny transformers
   model of each family (``--hf-models DIR/<family>``, or built here with lookalikes/models.py): our
   model on the GPU against transformers' on the CPU, fp32, the largest |logit difference| over
   the generated inputs (the CPU parity tests' bound is 1e-4).
4. ``packed``: packed batches in megatron's THD format (the tiny models of each family, bf16):
   the largest |logit difference| between every packed sample and the same sample alone, next to
   the bf16 noise of the unpacked batch (``max_abs_diff`` must stay of that order; a sample that
   attended across its segment is off by far more).
5. ``moe``: the tiny Qwen3-VL MoE and Qwen3.5 MoE models with TransformerEngine's grouped-GEMM
   experts (TE specs) against the local spec's sequential experts on the same weights (saved
   from the local model, loaded by the dist checkpoint into the TE one), fp32: the largest
   |logit difference| and the relative difference of the gradient norm after one backward. Without
   TE the part is skipped.
6. ``vision``: the real-shaped vision towers (configs/qwen2_5_vl_7b.yaml, qwen3_vl_8b.yaml,
   nemotron_omni_30b_a3b.yaml), bf16, TE layer specs when TE is importable, forward + backward
   over InfoVQA-sized images: patches/s and TFLOP/s (``models.flops.vision_flops`` x 3).

A row that fails records its error's last line (the traceback goes to stderr) and the next row
runs. ``--budget-s``: past it, the remaining families and parts are skipped (recorded), so one
device call ends with a complete JSON.

``--smoke`` runs every part with the tiny configs on CPU in seconds: the test suite runs it so
the script itself is known to work where no GPU is lent (bench/gpu_check.sh is the device entry;
bench/gpu_cards.py turns the JSON into docs/cards/<family>.md).

Run: python bench/gpu_check.py [--out bench_out] [--steps 20] [--smoke] [--part NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu_kernels import kernels_part  # noqa: E402 - after the path

#: part -> (model config of the real run, of the smoke run)
TOWERS = {
    "qwen2.5-vl-7b": ("configs/qwen2_5_vl_7b.yaml", "configs/qwen2_5_vl_tiny.yaml"),
    "qwen3-vl-8b": ("configs/qwen3_vl_8b.yaml", "configs/qwen3_vl_tiny.yaml"),
    "nemotron-omni-30b-a3b": ("configs/nemotron_omni_30b_a3b.yaml",
                              "configs/nemotron_omni_tiny.yaml"),
}
#: the parts in the order they run (the kernels first: the train part depends on them)
PARTS = ("kernels", "train", "verify", "packed", "moe", "vision")
#: images per vision batch as (height, width) in pixels: InfoVQA-like pages at ~1 MP
IMAGES = [(1344, 896), (1024, 1024), (1792, 672), (896, 1344)]
#: the packages whose versions a card lists
PACKAGES = ("torch", "triton", "transformer_engine", "flash_attn", "mamba_ssm", "causal_conv1d",
            "fla", "megatron.core", "megatron.energon", "transformers", "av")


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
        return True
    except ImportError:
        return False


class Report:
    """The JSON report: the environment, then each part's rows; written after every row."""

    def __init__(self, out: Path, budget_s: float):
        self.path = out / "gpu_check.json"
        self.deadline = time.monotonic() + budget_s
        self.data = {"environment": environment(), "parts": {}}
        self.save()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, part: str, row: dict) -> dict:
        self.data["parts"].setdefault(part, []).append({"part": part, **row})
        print(json.dumps(self.data["parts"][part][-1]), flush=True)
        self.save()
        return row

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1))


def environment() -> dict:
    """Device, driver, Python, every package's version and the command of this run."""
    import importlib
    import importlib.metadata

    import torch

    versions = {}
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
            versions[name] = str(getattr(module, "__version__", "") or "installed")
        except Exception as error:  # noqa: BLE001 - absent or broken: say which
            versions[name] = ("not installed" if isinstance(error, ImportError)
                              and "No module named" in str(error) else f"broken: {error}"[:120])
    cuda = torch.cuda.is_available()
    driver = ""
    if cuda:
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                     "--format=csv,noheader"], capture_output=True, text=True,
                                    timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            driver = "unknown"
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "gpu_memory_gb": round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1)
            if cuda else None, "cuda": torch.version.cuda, "driver": driver,
            "python": platform.python_version(), "packages": versions,
            "command": " ".join(["python", *sys.argv]),
            "commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


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


def guarded(report: Report, part: str, label: dict, work) -> None:
    """Add ``work()``'s row, labelled; a failure becomes the row's ``error`` (its last line; the
    traceback on stderr) and the part goes on with its next row."""
    try:
        row = work()
    except Exception as error:  # noqa: BLE001 - a check reports every row it can
        traceback.print_exc()
        row = {"error": last_line(error)}
    report.add(part, {**label, **row})


# ------------------------------------------------------------------ train
def train_part(report: Report, smoke: bool, steps: int, out: Path, peak_tflops: float) -> None:
    """Every family's training row (bench/gpu_train.py); past the budget the rest are skipped."""
    import gc

    import torch

    from bench.gpu_train import FAMILIES, train_family

    for family in FAMILIES:
        if report.left() < 30:
            report.add("train", {"family": family, "skipped": "the run's time budget is spent"})
            continue
        guarded(report, "train", {"family": family},
                partial(train_family, family, smoke, steps, out, peak_tflops))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def vision_part(report: Report, smoke: bool, repeats: int) -> None:
    import torch

    from energon_tasks.config import TaskEncoderConfig
    from models.families import config_module
    from models.flops import vision_flops
    from models.parallel import init_parallel

    init_parallel()
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    use_te = te_available() and not smoke

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
            from models.layers.qwen_vision import QwenVisionEncoder

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
        guarded(report, "vision", {"tower": name}, partial(tower_row, name, real, tiny))


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


def packed_part(report: Report, smoke: bool) -> None:
    """Each family's tiny model: packed samples vs the same samples alone (max |logit diff|)."""
    import torch

    from lookalikes.model_inputs import pack_inputs
    from models.families import build_model, config_module
    from models.hf.verify_inputs import make_inputs
    from models.parallel import init_parallel

    init_parallel()
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    use_te = te_available() and not smoke

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
        guarded(report, "packed", {"family": family}, partial(family_row, family, config))


def moe_part(report: Report, smoke: bool, out: Path) -> None:
    """The tiny MoE models: grouped-GEMM experts (TE) vs sequential experts (local), same weights;
    on CPU (``smoke``) both are the local spec (the plumbing only)."""
    import torch

    from models.checkpointing.checkpoint import load_checkpoint, save_checkpoint
    from models.families import build_model, config_module
    from models.hf.verify_inputs import make_inputs
    from models.parallel import init_parallel

    init_parallel()
    device = "cpu" if smoke else "cuda"
    use_te = te_available() and not smoke
    if not smoke and not use_te:
        report.add("moe", {"skipped": "TransformerEngine is not installed: no grouped-GEMM "
                                      "experts to compare with the sequential ones"})
        return

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
        guarded(report, "moe", {"family": family}, partial(family_row, family, config))


#: the families the verify part imports and checks (the smoke run: the first only)
VERIFY_FAMILIES = ("qwen3_5_moe", "qwen3_5", "qwen3_vl_moe", "qwen3_vl", "qwen2_5_vl",
                   "nemotron_omni")


def build_tiny_hf_folder(family: str, folder: Path) -> Path:
    """A tiny transformers model of ``family`` (lookalikes/models.py, the parity tests' shapes)."""
    from lookalikes import models as tiny_hf

    if family in ("qwen3_5", "qwen3_5_moe"):
        return tiny_hf.build_tiny_qwen3_5(folder, moe=family == "qwen3_5_moe")
    if family == "nemotron_omni":
        return tiny_hf.build_tiny_nemotron_omni(folder)
    return tiny_hf.build_tiny_hf(family, folder)


def verify_part(report: Report, smoke: bool, out: Path, hf_models: str | None) -> None:
    """``models.convert hf-to-mcore`` + ``verify`` per family, the families side by side (one
    process pair each); the largest |logit difference| over verify's inputs."""
    families = VERIFY_FAMILIES[:1] if smoke else VERIFY_FAMILIES
    runs = {}
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
        try:
            stdout, stderr = runs[family].communicate(timeout=max(30.0, report.left()))
        except subprocess.TimeoutExpired:
            runs[family].kill()
            raise
        if runs[family].returncode != 0:
            print(stderr[-4000:], file=sys.stderr)
            errors = [line for line in stderr.splitlines() if "Error" in line or "error:" in line]
            raise RuntimeError(errors[-1] if errors else "failed")
        found = json.loads(stdout[stdout.index("{"):])
        return {"device": "cpu" if smoke else "cuda", "dtype": "float32",
                "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in found.values()),
                "inputs": {name: r["max_abs_logit_diff"] for name, r in found.items()}}

    for family in families:
        guarded(report, "verify", {"family": family}, partial(family_row, family))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--steps", type=int, default=20, help="training steps per family")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds after which the remaining families and parts are skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny configs on CPU (tests)")
    ap.add_argument("--part", nargs="+", choices=("all", *PARTS), default=["all"],
                    help="the parts to run, in the order of PARTS")
    ap.add_argument("--hf-models", help="folder of tiny HF models named by family for the verify "
                                        "part (default: built with lookalikes/models.py)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device (use --smoke for the CPU plumbing run)")
    report = Report(out, args.budget_s)
    parts = {
        "kernels": lambda: kernels_part(report, args.smoke, partial(guarded, report)),
        "train": lambda: train_part(report, args.smoke, 4 if args.smoke else args.steps, out,
                                    args.peak_tflops),
        "verify": lambda: verify_part(report, args.smoke, out, args.hf_models),
        "packed": lambda: packed_part(report, args.smoke),
        "moe": lambda: moe_part(report, args.smoke, out),
        "vision": lambda: vision_part(report, args.smoke, 2 if args.smoke else args.repeats),
    }
    for name in [part for part in PARTS if part in args.part or "all" in args.part]:
        if report.left() < 10:
            report.add(name, {"skipped": "the run's time budget is spent"})
            continue
        try:
            parts[name]()
        except Exception as error:  # noqa: BLE001 - the other parts still run
            traceback.print_exc()
            report.add(name, {"error": last_line(error)})


if __name__ == "__main__":
    main()
