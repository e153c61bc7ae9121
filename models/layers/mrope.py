"""3-D M-RoPE positions of one generated row (the inputs of ``verify``, the tests and bench/):
text advances t/h/w; a visual run takes (start + t, start + row, start + col) on the merged grid.
Models may not import the data side's M-RoPE (``energon_tasks``); this one covers the step-1
temporal positions these inputs need. ``qwen_verify_inputs``: the generated rows of the Qwen
VLMs' ``verify`` (one image; 3 images of different sizes interleaved with text; a video).
``megatron_mrope_section``: HF's M-RoPE frequency layout (interleaved or not) as megatron's
chunked ``mrope_section``."""

from __future__ import annotations

import torch


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


def qwen_verify_inputs(cfg, seed: int = 0) -> dict[str, dict]:
    """The ``verify`` inputs of the Qwen VLMs (Qwen-VL, Qwen3.5), single rows: one image; 3
    images of different sizes with text; a video. Our
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


def megatron_mrope_section(section: list[int], interleaved: bool) -> list[int]:
    """megatron chunk list (chunk j takes axis j % 3) reproducing HF's M-RoPE layout."""
    if not interleaved:
        return list(section)
    half = sum(section)
    owner = [0] * half  # HF Qwen3-VL: h on 1, 4, 7, ... < 3*h; w on 2, 5, 8, ... < 3*w
    for axis, start in ((1, 1), (2, 2)):
        for i in range(start, 3 * section[axis], 3):
            owner[i] = axis
    chunks: list[int] = []
    for axis in owner:
        if chunks and (len(chunks) - 1) % 3 == axis:
            chunks[-1] += 1
            continue
        while len(chunks) % 3 != axis:
            chunks.append(0)
        chunks.append(1)
    while len(chunks) % 3:
        chunks.append(0)
    return chunks
