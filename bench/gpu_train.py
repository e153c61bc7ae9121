"""The ``train`` part of the GPU check (bench/gpu_check.py): every family trains a few steps at its
published per-layer shapes on real-shaped samples, and what a throughput card reports.

Per family (``FAMILIES``; Nemotron-Omni twice: Nano Omni and the Super VL's LatentMoE): the
published model config (hidden size, heads, experts and top-k, the
whole vision tower) with the LM's layer count cut to what one GPU holds (every layer kind kept:
attention, Gated DeltaNet, Mamba, MoE), random init, bf16, the run's kernels
(``recipes.model_setup.select_kernels``: the lines are in the row), activation recomputation
``full`` (a 6000x9000 page is 65K patches through a 32-layer tower), packing on. The samples are
built in memory with real media and go through the family's own task encoder (the run's decode,
resize, tokenizer, packing and collate; the test tokenizer): a Mantis-like row of 12 photos
(640x480), a 6000x9000 text page, and a 64-frame video (640x360, 32 s at 2 fps), at the
processors' default pixel limits; the page is one packed row, the photos and the video another.
The steps alternate between the two rows; each is one ``recipes.forward.optimizer_step`` (the
training step of train.py: forward, backward, megatron's DDP and Adam) on the built model
(``recipes.model_setup.build_model`` + ``wrap_for_training``).

Reported (the first two steps are warm-up, left out of the rates): real tokens/s (non-pad) and
padded slots/s (what Megatron-Bridge's cards count), TFLOP/s and MFU from the project's FLOP
counter (``models.flops.batch_flops``: model FLOPs, recomputation not counted) against the GPU's
dense bf16 peak, the step time of each row and its vision share (the tower + projector forward +
backward timed alone on the row's pixels; the rest is the LM, loss and optimizer), peak memory
beside ``recipes.memory``'s estimate, and the losses (finite, falling: the two rows are seen ten
times each). ``smoke``: the tiny configs on CPU, small media, fp32 (the plumbing only).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: row -> (family, published config, overrides: the LM cut to what one GPU holds, tiny config,
#: its overrides: the smoke run's shape of the same kind)
FAMILIES = {
    "qwen2_5_vl": ("qwen2_5_vl", "qwen2_5_vl_7b", ["model.lm.num_layers=4"], "qwen2_5_vl_tiny",
                   []),
    "qwen3_vl": ("qwen3_vl", "qwen3_vl_8b", ["model.lm.num_layers=4"], "qwen3_vl_tiny", []),
    "qwen3_vl_moe": ("qwen3_vl_moe", "qwen3_vl_30b_a3b", ["model.lm.num_layers=2"],
                     "qwen3_vl_moe_tiny", []),
    "qwen3_5": ("qwen3_5", "qwen3_5_9b", [
        "model.lm.num_layers=4", "model.lm.layer_types=[linear_attention, linear_attention, "
                                 "linear_attention, full_attention]"], "qwen3_5_tiny", []),
    "qwen3_5_moe": ("qwen3_5_moe", "qwen3_5_35b_a3b", [
        "model.lm.num_layers=2", "model.lm.layer_types=[linear_attention, full_attention]"],
        "qwen3_5_moe_tiny", []),
    "nemotron_omni": ("nemotron_omni", "nemotron_omni_30b_a3b", ["model.lm.pattern=M*E"],
                      "nemotron_omni_tiny", []),
    # Nemotron 3.5 Super VL: LatentMoE (megatron's MoE with its latent projections; TE's when it
    # is importable, else models/layers/latent_moe.py), its experts cut to 128 of 512 for one GPU
    "nemotron_omni_super": ("nemotron_omni", "nemotron_omni_super_120b_a12b", [
        "model.lm.pattern=M*E", "model.lm.num_experts=128"], "nemotron_omni_tiny", [
        "model.lm.pattern=M*E", "model.lm.moe_latent_size=32",
        "model.lm.moe_shared_expert_intermediate_size=64"]),
}
#: the real-shaped samples: Mantis row (photos, (h, w)), the page (w, h), the video
PHOTOS, PAGE, VIDEO = (12, (480, 640)), (6000, 9000), ((640, 360), 64, 2)
SMOKE_PHOTOS, SMOKE_PAGE, SMOKE_VIDEO = (12, (48, 64)), (300, 450), ((64, 48), 8, 2)
WARMUP = 2


def real_samples(smoke: bool) -> list[tuple[str, dict]]:
    """(name, crude webdataset dict) of the three samples, media encoded here."""
    import numpy as np

    from energon_tasks.sample_format import CanonicalSample, Media, SourceRef, Turn
    from lookalikes import media

    (count, (h, w)), page, ((vw, vh), frames, fps) = (
        (SMOKE_PHOTOS, SMOKE_PAGE, SMOKE_VIDEO) if smoke else (PHOTOS, PAGE, VIDEO))
    rng = np.random.default_rng(0)
    answer = " ".join(["the answer is on the page"] * 8)

    def sample(name, question, items):
        medias = [Media(part=part, kind=kind, format=fmt, width=size[0], height=size[1],
                        bytes=len(data), **extra)
                  for part, kind, fmt, size, data, extra in items]
        canonical = CanonicalSample(
            dataset="mantis", source=SourceRef(config="gpu_check", split="train", ids=[name],
                                               rows=[0]),
            conversation=[Turn(role="user", content=question),
                          Turn(role="assistant", content=answer)], media=medias)
        return name, {"__key__": name, "__restore_key__": (), "__subflavors__": {},
                      "__sources__": (), "json": canonical.to_json_bytes(),
                      **{item[0]: item[4] for item in items}}

    photos = [(f"img{i}.jpg", "image", "jpeg", (w, h), media.photo_jpeg(rng, w, h), {})
              for i in range(count)]
    lines = [("Annual report", page[0] // 40)] + [
        (f"fact {k}: {k * 37 % 101} units", page[0] // 80) for k in range(40)]
    page_jpeg = media.encode_image(media.text_page(page, lines), "jpeg", quality=85)
    clip = media.moving_square_clip("right", "red", size=(vw, vh), fps=fps,
                                    seconds=frames / fps, gop=fps * 4)
    video = {"frames": frames, "fps": float(fps), "duration_s": frames / fps, "codec": "h264"}
    return [
        sample("photos", "<image>" * count + " Which pictures show the same place?", photos),
        sample("page", "<image> What does the report say about fact 7?",
               [("img0.jpg", "image", "jpeg", page, page_jpeg, {})]),
        sample("video", "<video> Describe what moves in the clip.",
               [("vid0.mp4", "video", "mp4", (vw, vh), clip, video)]),
    ]


def run_config(family: str, smoke: bool, steps: int, out: Path):
    """The run config of the family's check: published shapes cut, bf16, packing, the
    processors' own pixel limits, 12 images and 64 frames per sample."""
    from contract.config import apply_override
    from recipes.compatibility import profile_for
    from recipes.run_config import from_dict

    name, real, cut, tiny, tiny_cut = FAMILIES[family]
    raw = {"out": str(out), "model": {"base": str(REPO / "configs" / f"{tiny if smoke else real}"
                                                                   ".yaml")},
           "task_encoder": {"model": profile_for(name, None), "tokenizer": "test",
                            "packing": True, "max_pixels": None, "max_num_images": 12,
                            "max_num_frames": 64, "max_visual_tokens": 16384,
                            "seq_length": 4096 if smoke else 20480},
           "train": {"steps": steps, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": WARMUP,
                     "precision": "fp32" if smoke else "bf16"}}
    for item in (["model.lm.vocab_size=640", *tiny_cut] if smoke
                 else [*cut, "model.recompute=full"]):
        apply_override(raw, item)  # smoke: the tiny LM takes the test tokenizer's ids
    return from_dict(raw)


def batches(cfg, out: Path, smoke: bool):
    """The two packed rows (the page; the photos and the video) through the family's task
    encoder, and the model config with the tokenizer's token ids."""
    from energon_tasks import task_encoder_for
    from energon_tasks.task_encoder import cook_conversation
    from recipes.data import load_run_tokenizer

    tokenizer = load_run_tokenizer(cfg.task_encoder, out)
    encoder = task_encoder_for(cfg.task_encoder, tokenizer)
    encoded = {name: encoder.encode_sample(cook_conversation(crude))
               for name, crude in real_samples(smoke)}
    rows = [[encoded["page"]], [encoded["photos"], encoded["video"]]]
    model = dataclasses.replace(cfg.model, image_token_id=encoder.image_pad,
                                video_token_id=encoder.video_pad,
                                vision_start_token_id=encoder.vision_start,
                                vision_end_token_id=encoder.vision_end)
    return ([encoder.batch([encoder.pack_selected_samples(row)]) for row in rows],
            dataclasses.replace(cfg, model=model))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vision_seconds(model, batch, repeats: int = 2) -> float:
    """Median seconds of the tower + projector forward + backward on ``batch``'s pixels."""
    from megatron.core.utils import unwrap_model

    raw = unwrap_model(model)
    param = next(raw.parameters())
    times = []
    for _ in range(repeats):
        _sync(param.device)
        tick = time.perf_counter()
        for pixels, grid in ((batch.pixel_values, batch.image_grid_thw),
                             (batch.pixel_values_videos, batch.video_grid_thw)):
            if len(grid):
                out = raw.encode_visual(pixels.to(param.device, param.dtype), grid)
                embeds, *deepstack = out if isinstance(out, tuple) else (out,)
                features = [embeds, *(deepstack[0] if deepstack else [])]  # Qwen3-VL's
                sum(f.float().square().mean() for f in features).backward()
        _sync(param.device)
        times.append(time.perf_counter() - tick)
    model.zero_grad_buffer()
    return statistics.median(times)


def train_family(family: str, smoke: bool, steps: int, out: Path, peak_tflops: float) -> dict:
    """One family's row (module docstring)."""
    import torch

    from models import cpu
    from models.flops import batch_flops
    from recipes.estimate import GIB, estimate
    from recipes.forward import optimizer_step
    from recipes.layout import init_distributed
    from recipes.model_setup import build_model, select_kernels, wrap_for_training
    from recipes.schedule import loss_tokens, lr_at

    if steps < WARMUP + 2:
        raise ValueError(f"--steps {steps}: at least {WARMUP + 2} (warm-up + one step per row)")
    started = time.perf_counter()
    folder = out / f"gpu_check_train_{family}"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = run_config(family, smoke, steps, folder)
    rows, cfg = batches(cfg, folder, smoke)
    layout = init_distributed(1, 1, 1, cfg.train.seed)
    bf16 = cfg.train.precision == "bf16"
    choices = select_kernels(cfg.kernels, cfg.model, torch.bfloat16 if bf16 else torch.float32,
                             log=False)
    model = build_model(cfg)  # on this process's device
    model, optimizer = wrap_for_training(model, cfg.train, bf16)
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, timed = [], []
    for step in range(steps):
        batch = rows[step % len(rows)]
        tokens = loss_tokens(batch)
        lr = lr_at(step, lr=cfg.train.lr, min_lr=cfg.train.min_lr,
                   warmup_steps=cfg.train.warmup_steps, total_steps=steps)
        _sync(device)
        tick = time.perf_counter()
        loss_sum, _norm, _stepped = optimizer_step(layout, model, optimizer, [batch], lr, tokens)
        _sync(device)
        seconds = time.perf_counter() - tick
        losses.append(float(loss_sum) / max(tokens, 1))
        if step >= WARMUP:
            timed.append((step % len(rows), seconds))
    peak = cpu.peak_memory_gb()
    estimated = estimate(model, cfg, 1, bf16)
    total_s = sum(s for _, s in timed)
    flops = sum(batch_flops(rows[r], cfg.model) for r, _ in timed)
    real = sum(int(rows[r].attention_mask.sum()) for r, _ in timed)
    slots = sum(rows[r].input_ids.numel() for r, _ in timed)
    per_row = []
    for r, batch in enumerate(rows):
        step_s = statistics.median([s for i, s in timed if i == r])
        vision_s = vision_seconds(model, batch)
        per_row.append({
            "row": ["page", "photos+video"][r], "tokens": int(batch.attention_mask.sum()),
            "slots": batch.input_ids.numel(), "images": int(batch.image_grid_thw.shape[0]),
            "videos": int(batch.video_grid_thw.shape[0]),
            "patches": int(batch.image_grid_thw.prod(-1).sum()
                           + batch.video_grid_thw.prod(-1).sum()),
            "step_s": round(step_s, 4), "vision_s": round(vision_s, 4),
            "vision_share": round(vision_s / step_s, 3),
            "tflop_per_step": round(batch_flops(batch, cfg.model) / 1e12, 2)})
    tflops = flops / total_s / 1e12
    last = {step % len(rows): loss for step, loss in enumerate(losses)}  # each row's last loss
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": f"configs/{FAMILIES[family][3 if smoke else 1]}.yaml",
        "cut": FAMILIES[family][4 if smoke else 2], "recompute": cfg.model.recompute,
        "dtype": cfg.train.precision, "params": sum(p.numel() for p in model.parameters()),
        "kernels": [choice.line() for choice in choices.values()],
        "steps": steps, "timed_steps": len(timed), "rows": per_row,
        "real_tokens_per_s": round(real / total_s, 1), "padded_slots_per_s": round(
            slots / total_s, 1), "tflops_per_s": round(tflops, 2),
        "mfu": round(tflops / peak_tflops, 4), "peak_tflops": peak_tflops,
        "peak_mem_gb": round(peak, 2), "estimate_gb": round(estimated.total / GIB, 2),
        "estimate": estimated.line(), "losses": [round(x, 4) for x in losses],
        "loss_finite": all(x == x and abs(x) != float("inf") for x in losses),
        "loss_falling": all(last[r] < losses[r] for r in range(len(rows))),
        "wall_s": round(time.perf_counter() - started, 1)}
