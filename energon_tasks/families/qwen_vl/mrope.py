"""3-D M-RoPE position ids of Qwen2.5-VL / Qwen3-VL for one sample (text, images, videos).

A direct rewrite of the models' ``get_rope_index`` (transformers ``Qwen2_5_VLModel`` /
``Qwen3VLModel``) over numpy; re-exported by ``energon_tasks.families.qwen_vl.geometry``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def _vision_positions(start: int, grid: Sequence[int], time_step: float) -> np.ndarray:
    """(3, t*h*w) positions of a merged (t, h, w) block in raster order (time, row, column)."""
    t, h, w = grid
    temporal = (np.arange(t, dtype=np.float32) * np.float32(time_step)).astype(np.int64)
    tt, hh, ww = np.meshgrid(temporal, np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_position_ids(
    input_ids: Sequence[int] | np.ndarray,
    *,
    image_token_id: int,
    video_token_id: int,
    image_grid_thw: Sequence[Sequence[int]] = (),
    video_grid_thw: Sequence[Sequence[int]] = (),
    spatial_merge_size: int = 2,
    video_time_steps: Sequence[float] | None = None,
) -> np.ndarray:
    """3-D (t, h, w) M-RoPE position ids of ONE sample (restart at 0 for each packed sample).

    Walks the tokens: a text token takes (p, p, p) and the next position is p + 1. A maximal run
    of image tokens is the next image of ``image_grid_thw``; a run of video tokens is the next
    whole temporal patches of the current video: one run per video (Qwen2.5-VL) or one run per
    temporal patch with timestamp text between them (Qwen3-VL). With (t, h, w) the run's MERGED
    grid (h, w divided by ``spatial_merge_size``), token (i, r, c) takes
    (start + int(i * step), start + r, start + c); the text after resumes at max(all so far) + 1.
    ``step`` is 1 for images and ``video_time_steps[k]`` (Qwen2.5-VL: ``tokens_per_second *
    second_per_grid_t``, in float32 as transformers) for video k; Qwen3-VL runs hold one temporal
    patch each, so steps do not matter there.

    Equal to ``Qwen2_5_VLModel.get_rope_index`` / ``Qwen3VLModel.get_rope_index`` of transformers
    5.x, except that transformers 5.x resumes text after a video at start + max(h, w) even when
    its temporal positions reach further; we keep max + 1, the original Qwen2.5-VL rule.

    Returns:
        int64 array (3, len(input_ids)).

    Raises:
        ValueError: a run whose length does not fit its grid, grids left unused / missing, or
            ``video_time_steps`` not one per video.
    """
    ids = np.asarray(input_ids).reshape(-1)
    kinds = np.where(ids == image_token_id, 1, np.where(ids == video_token_id, 2, 0))
    images = [tuple(int(v) for v in g) for g in image_grid_thw]
    videos = [tuple(int(v) for v in g) for g in video_grid_thw]
    steps = [1.0] * len(videos) if video_time_steps is None else list(video_time_steps)
    if len(steps) != len(videos):
        raise ValueError(f"{len(steps)} video_time_steps for {len(videos)} video grids")
    positions = np.zeros((3, len(ids)), dtype=np.int64)
    cursor, image_idx, video_idx, video_left = 0, 0, 0, 0
    bounds = [int(b) for b in np.flatnonzero(np.diff(kinds)) + 1]
    runs = zip([0, *bounds], [*bounds, len(ids)], strict=True) if len(ids) else []
    for begin, end in runs:
        length, kind = end - begin, kinds[begin]
        if kind == 0:
            positions[:, begin:end] = np.arange(cursor, cursor + length)
            cursor += length
            continue
        if kind == 1:
            if image_idx >= len(images):
                raise ValueError(f"more image spans than the {len(images)} image grids")
            raw = images[image_idx]
            image_idx, step, groups = image_idx + 1, 1.0, raw[0]
        else:
            if video_left == 0:
                if video_idx >= len(videos):
                    raise ValueError(f"more video spans than the {len(videos)} video grids")
                video_left, video_idx = videos[video_idx][0], video_idx + 1
            raw, step = videos[video_idx - 1], steps[video_idx - 1]
            groups = length // max(1, raw[1] * raw[2] // spatial_merge_size**2)
            video_left -= groups
        grid = (groups, raw[1] // spatial_merge_size, raw[2] // spatial_merge_size)
        if length != math.prod(grid) or video_left < 0:
            raise ValueError(f"a span of {length} tokens at {begin} does not fit grid {raw}")
        positions[:, begin:end] = _vision_positions(cursor, grid, step)
        cursor = int(positions[:, begin:end].max()) + 1
    if image_idx != len(images) or video_idx != len(videos) or video_left:
        raise ValueError(
            f"input_ids use {image_idx}/{len(images)} image and {video_idx}/{len(videos)} video "
            "grids (a span was cut or is missing)"
        )
    return positions
