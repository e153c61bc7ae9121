"""The generated inputs of ``verify`` for Nemotron-Omni, and their translation to transformers'.

Ours (``verify_inputs``): image patch rows (sum t*h*w, C*P*P) + ``image_grid_thw`` (t = tiles,
each its own segment); video tubelet rows (sum pairs*h*w, T*C*P*P) + ``video_grid_thw``; videos'
context tokens ``video_token_id``. HF (``hf_inputs``): the same image rows with one
``image_grid_hw`` row per tile; videos as (1, pairs, T*C, H, W) pixel tensors; every context token
the image token.
"""

from __future__ import annotations

import torch

from models.families.nemotron_omni.config import NemotronOmniModelConfig

NEMOTRON_CASES = {"one_image": ("image", [[1, 4, 6]]),
                  "images_interleaved": ("image", [[1, 4, 6], [1, 8, 4], [1, 2, 2]]),
                  "tiles": ("image", [[2, 4, 4]]),
                  "video": ("video", [[2, 4, 4]])}


def verify_inputs(cfg: NemotronOmniModelConfig, seed: int = 0) -> dict[str, dict]:
    """Single-row inputs: one image; 3 images of different sizes with text; one image of 2
    tiles; a video of 2 tubelets. Each visual item is wrapped in the start/end tokens."""
    g = torch.Generator().manual_seed(seed)
    v, merge = cfg.vision, cfg.merge_size
    specials = [t for t in (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id,
                            cfg.vision_end_token_id) if t >= 0]
    low = min(specials + [cfg.lm.vocab_size])

    def text(n):
        return torch.randint(0, low, (n,), generator=g)

    def wrap(core):
        start = [cfg.vision_start_token_id] if cfg.vision_start_token_id >= 0 else []
        end = [cfg.vision_end_token_id] if cfg.vision_end_token_id >= 0 else []
        return torch.cat([torch.tensor(start, dtype=torch.long), core,
                          torch.tensor(end, dtype=torch.long)])

    out = {}
    for name, (kind, grids) in NEMOTRON_CASES.items():
        token = cfg.video_token_id if kind == "video" else cfg.image_token_id
        parts = [text(5)]
        for t, h, w in grids:
            parts += [wrap(torch.full((t * h * w // merge ** 2,), token)), text(3)]
        ids = torch.cat(parts)
        grid = torch.tensor(grids, dtype=torch.long)
        width = v.in_channels * v.patch_size ** 2
        if kind == "video":
            width *= v.video_temporal_patch_size
        pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=g)
        suffix = "_videos" if kind == "video" else ""
        out[name] = {"input_ids": ids[None],
                     "position_ids": torch.arange(len(ids)).expand(3, 1, -1).clone(),
                     f"pixel_values{suffix}": pixels, f"{kind}_grid_thw": grid}
    return out


def rows_to_frames(rows: torch.Tensor, grid_thw: torch.Tensor, patch: int) -> torch.Tensor:
    """Tubelet rows of ONE video -> (pairs, T*C, H, W) (inverse of HF ``_image_to_patches``)."""
    (pairs, h, w), = grid_thw.tolist()
    x = rows.view(pairs, h, w, -1, patch, patch)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(pairs, -1, h * patch, w * patch)


def hf_inputs(cfg: NemotronOmniModelConfig, inputs: dict) -> dict:
    """Our single-video or image inputs -> transformers' forward kwargs (see module docstring)."""
    ids = inputs["input_ids"].clone()
    out = {}
    if inputs.get("image_grid_thw") is not None:
        grid = inputs["image_grid_thw"]
        out["pixel_values"] = inputs["pixel_values"]
        out["image_grid_hw"] = grid[:, 1:].repeat_interleave(grid[:, 0], dim=0)
    if inputs.get("video_grid_thw") is not None:
        grid = inputs["video_grid_thw"]
        if grid.shape[0] != 1:
            raise ValueError("hf_inputs: one video per input")
        frames = rows_to_frames(inputs["pixel_values_videos"], grid, cfg.vision.patch_size)
        out["pixel_values_videos"] = frames[None]
        ids[ids == cfg.video_token_id] = cfg.image_token_id
    out["input_ids"] = ids
    return out
