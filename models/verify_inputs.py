"""The generated inputs of ``python -m models.convert verify`` (and of the tests that compare our
models with transformers' through them), in our batch contract, and their translation to the
arguments of transformers' forward of each family.

Qwen-VL (``make_inputs``): one image; 3 images of different sizes interleaved with text; a video;
3-D M-RoPE positions from ``mrope_positions`` (models may not import the data side's
``energon_tasks.families.qwen_vl.mrope``; this one covers the step-1 temporal positions these inputs need).

Nemotron-Omni (``nemotron_inputs``): ours are image patch rows (sum t*h*w, C*P*P) +
``image_grid_thw`` (t = tiles, each its own segment); video tubelet rows (sum pairs*h*w,
T*C*P*P) + ``video_grid_thw``; videos' context tokens ``video_token_id``. HF
(``to_hf_inputs``): the same image rows with one ``image_grid_hw`` row per tile; videos as
(1, pairs, T*C, H, W) pixel tensors; every context token the image token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from models.nemotron_omni_config import NemotronOmniModelConfig


def mrope_positions(input_ids: torch.Tensor, grids: list[torch.Tensor], vision_ids: set[int],
                    merge: int) -> torch.Tensor:
    """(3, 1, L) M-RoPE positions of one row: text advances t/h/w; a visual run takes
    (start + t, start + row, start + col) on the merged grid; text resumes at max + 1."""
    ids, out, pos, k, i = input_ids.tolist(), [], 0, 0, 0
    while i < len(ids):
        if ids[i] in vision_ids:
            t, h, w = (int(x) for x in grids[k])
            h, w = h // merge, w // merge
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                        indexing="ij")
            out.append(torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + pos)
            pos = int(out[-1].max()) + 1
            i, k = i + t * h * w, k + 1
        else:
            out.append(torch.full((3, 1), pos))
            pos, i = pos + 1, i + 1
    return torch.cat(out, dim=1)[:, None, :]


def make_inputs(cfg, seed: int = 0) -> dict[str, dict]:
    """Single-row inputs: one image; 3 images of different sizes with text; a video (and, for
    Nemotron-Omni, one tiled image: 2 tiles). Our batch-contract fields."""
    if cfg.family == "nemotron_omni":
        return nemotron_inputs(cfg, seed)
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


NEMOTRON_CASES = {"one_image": ("image", [[1, 4, 6]]),
                  "images_interleaved": ("image", [[1, 4, 6], [1, 8, 4], [1, 2, 2]]),
                  "tiles": ("image", [[2, 4, 4]]),
                  "video": ("video", [[2, 4, 4]])}


def nemotron_inputs(cfg: NemotronOmniModelConfig, seed: int = 0) -> dict[str, dict]:
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


def to_hf_inputs(cfg: NemotronOmniModelConfig, inputs: dict) -> dict:
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
            raise ValueError("to_hf_inputs: one video per input")
        frames = rows_to_frames(inputs["pixel_values_videos"], grid, cfg.vision.patch_size)
        out["pixel_values_videos"] = frames[None]
        ids[ids == cfg.video_token_id] = cfg.image_token_id
    out["input_ids"] = ids
    return out


def hf_inputs(cfg, inputs: dict) -> dict:
    """Our inputs as transformers' forward of the family takes them."""
    if cfg.family == "nemotron_omni":
        return to_hf_inputs(cfg, inputs)
    return inputs
