"""The generated inputs of ``verify`` for Qwen-VL: one image; 3 images of different sizes
interleaved with text; a video; 3-D M-RoPE positions (``models.mrope``).
transformers' Qwen-VL forward takes them as they are (``hf_inputs``)."""

from __future__ import annotations

import torch

from models.families.qwen_vl.config import QwenVLModelConfig
from models.mrope import mrope_positions


def verify_inputs(cfg: QwenVLModelConfig, seed: int = 0) -> dict[str, dict]:
    """Single-row inputs: one image; 3 images of different sizes with text; a video. Our
    batch-contract fields, with 3-D M-RoPE positions."""
    g = torch.Generator().manual_seed(seed)
    v, merge = cfg.vision, cfg.vision.spatial_merge_size
    dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    low = min(cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.lm.vocab_size)

    def text(n):
        return torch.randint(0, low, (n,), generator=g)

    def visual(grid, token):
        n = int(torch.tensor(grid).prod()) // merge ** 2
        return torch.cat([torch.tensor([cfg.vision_start_token_id]), torch.full((n,), token),
                          torch.tensor([cfg.vision_end_token_id])])

    cases = {"one_image": [[1, 4, 6]], "images_interleaved": [[1, 4, 6], [1, 8, 4], [1, 2, 2]],
             "video": [[2, 4, 4]]}
    out = {}
    for name, grids in cases.items():
        video = name == "video"
        token = cfg.video_token_id if video else cfg.image_token_id
        parts = [text(5)]
        for grid in grids:
            parts += [visual(grid, token), text(3)]
        ids = torch.cat(parts)
        grid_t = torch.tensor(grids, dtype=torch.long)
        pixels = torch.randn(int(grid_t.prod(-1).sum()), dim, generator=g)
        pos = mrope_positions(ids, list(grid_t), {token}, merge)
        key = "video" if video else "image"
        out[name] = {"input_ids": ids[None], "position_ids": pos,
                     f"pixel_values{'_videos' if video else ''}": pixels,
                     f"{key}_grid_thw": grid_t}
    return out


def hf_inputs(cfg: QwenVLModelConfig, inputs: dict) -> dict:
    """Our inputs as transformers' Qwen-VL forward takes them: unchanged."""
    return inputs
