"""The Nemotron-Omni geometry against transformers' Nemotron-Omni processors / model (installed
here, nothing downloaded), InternVL's tiling rule, direct formulas, and the worked examples of
docs/nemotron.md.

The image processor module imports torchvision (absent on the CPU torch), so its two pure
functions are read from the installed source with ``ast`` and run as written.
"""

from __future__ import annotations

import ast
import math
import random
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from energon_tasks.families.nemotron_omni.geometry import (
    NEMOTRON_OMNI,
    NEMOTRON_OMNI_TILED,
    NemotronOmniGeometry,
    closest_aspect_ratio,
    pixel_shuffle,
)
from energon_tasks.image_grid import ImageGrid

HF_DIR = Path(transformers.__file__).parent / "models" / "nemotron_h_omni"
G, T = NEMOTRON_OMNI, NEMOTRON_OMNI_TILED


def _hf_functions():
    source = (HF_DIR / "image_processing_nemotron_h_omni.py").read_text()
    wanted = {"get_patch_grid_size", "convert_image_to_patches"}
    module = ast.Module([n for n in ast.parse(source).body
                         if isinstance(n, ast.FunctionDef) and n.name in wanted], [])
    namespace = {"math": math, "torch": torch}
    exec(compile(module, "hf_nemotron_image", "exec"), namespace)  # noqa: S102
    return namespace["get_patch_grid_size"], namespace["convert_image_to_patches"]


HF_GRID, HF_PATCHES = _hf_functions()


def _sizes(n, seed, hi=9000):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        h, w = rng.randint(1, hi), rng.randint(1, hi)
        if max(h, w) / min(h, w) <= 200:
            out.append((h, w))
    return out


# ------------------------------------------------------------------------------------- dynamic
def test_dynamic_matches_transformers_and_formula():
    rng = random.Random(0)
    for h, w in _sizes(3000, 1):
        low = rng.choice([256, 1024, 4096])
        high = rng.choice([None, low * 256 + 256 * rng.randint(0, 20000)])
        grid = G.dynamic_grid(h, w, min_pixels=low * 256,
                              max_pixels=None if high is None else high)
        high_patches = 13312 if high is None else high // 256
        gh, gw = HF_GRID(h, w, 16, 2, low, high_patches)
        assert grid.grid_thw == (1, gh, gw)
        assert (grid.resized_height, grid.resized_width) == (16 * gh, 16 * gw)
        assert grid.resized_height % 32 == 0 and grid.resized_width % 32 == 0
        assert grid.visual_tokens == (grid.resized_height // 16) * (grid.resized_width // 16) // 4
        assert G.image_grid(h, w, min_pixels=low * 256, max_pixels=high) == grid


def test_dynamic_worked_examples():
    # docs/nemotron.md, example 1 and 2 (height, width)
    assert G.dynamic_grid(768, 1024) == ImageGrid(768, 1024, (1, 48, 64), 768)
    assert G.dynamic_grid(9375, 6250) == ImageGrid(2240, 1504, (1, 140, 94), 3290)
    assert G.dynamic_grid(6250, 9375) == ImageGrid(1504, 2240, (1, 94, 140), 3290)
    # Python's round(x + 0.5) on an odd integer x rounds to even: 784 = 49 patches -> 50
    assert G.dynamic_grid(784, 784).grid_thw == (1, 50, 50)
    # min_num_patches lifts a small image: 100x100 -> 7x7 patches -> x sqrt(1024/49) -> 32x32
    assert G.dynamic_grid(100, 100) == ImageGrid(512, 512, (1, 32, 32), 256)


def test_dynamic_budget_is_not_monotone_but_planner_safe():
    # the reference rule is NOT monotone in max_num_patches (docs/nemotron.md, "Monotonicity")
    assert G.dynamic_grid(4204, 3996, max_pixels=5632 * 256).grid_thw == (1, 76, 74)  # 1406 tok
    assert G.dynamic_grid(4204, 3996, max_pixels=5760 * 256).grid_thw == (1, 78, 72)  # 1404 tok
    # ... but a cap at least 2 x min_pixels is never exceeded, and the min cap is always valid
    rng = random.Random(2)
    for h, w in _sizes(2000, 3):
        cap = rng.randint(2048, 13312)
        grid = G.dynamic_grid(h, w, max_pixels=cap * 256)
        assert grid.grid_thw[1] * grid.grid_thw[2] <= cap
        low = G.dynamic_grid(h, w, max_pixels=G.default_min_pixels)
        assert low.grid_thw[1] * low.grid_thw[2] <= 1024


# ------------------------------------------------------------------------------------- tiled
def _internvl_reference(width, height, min_num, max_num, image_size):
    """InternVL's dynamic_preprocess target-ratio choice, as published (written out)."""
    target_ratios = sorted({(i, j) for n in range(min_num, max_num + 1)
                            for i in range(1, n + 1) for j in range(1, n + 1)
                            if min_num <= i * j <= max_num}, key=lambda x: x[0] * x[1])
    aspect_ratio = width / height
    best_ratio_diff, best_ratio = float("inf"), (1, 1)
    area = width * height
    for ratio in target_ratios:
        ratio_diff = abs(aspect_ratio - ratio[0] / ratio[1])
        if ratio_diff < best_ratio_diff:
            best_ratio_diff, best_ratio = ratio_diff, ratio
        elif (ratio_diff == best_ratio_diff
              and area > 0.5 * image_size * image_size * ratio[0] * ratio[1]):
            best_ratio = ratio
    return best_ratio


@pytest.mark.parametrize(
    ("height", "width", "grid", "tiles"),
    [
        (768, 1024, (4, 3), 13),  # aspect 4/3 exactly: 4 x 3 + thumbnail
        (9375, 6250, (2, 3), 7),  # aspect 2/3: 2 x 3 + thumbnail
        (1000, 1000, (2, 2), 5),  # tie (1,1)/(2,2)/(3,3): 1e6 > 0.5*512^2*4, not > *9
        (500, 500, (1, 1), 1),  # tie, small image keeps 1 tile, no thumbnail
        (500, 4000, (8, 1), 9),  # aspect 8
        (1000, 2200, (4, 2), 9),  # 2.2: (2,1) and (4,2) tie at 0.2, area 2.2e6 > 1048576
        (1000, 1100, (2, 2), 5),  # 1.1: (1,1) and (2,2) tie at 0.1, 1.1e6 > 524288
        (1000, 1200, (4, 3), 13),  # 1.2: (4,3) diff 0.133 beats (1,1) 0.2; (5,4), (6,5) > 12
    ],
)
def test_tiled_hand_checked(height, width, grid, tiles):
    tg = G.tiled_grid(height, width)
    assert (tg.columns, tg.rows) == grid
    assert tg.tiles == tiles and tg.visual_tokens == 256 * tiles
    assert (tg.resized_height, tg.resized_width) == (512 * grid[1], 512 * grid[0])


def test_tiled_matches_internvl_and_formula():
    rng = random.Random(4)
    for h, w in _sizes(1500, 5, hi=6000):
        lo, hi = rng.choice([(1, 12), (1, 6), (2, 12), (1, 40), (4, 4)])
        cols, rows = closest_aspect_ratio(h, w, tile_size=512, min_num_tiles=lo,
                                          max_num_tiles=hi)
        assert (cols, rows) == _internvl_reference(w, h, lo, hi, 512)
        assert lo <= cols * rows <= hi
        tg = G.tiled_grid(h, w, min_num_tiles=lo, max_num_tiles=hi)
        assert tg.visual_tokens == (cols * rows + (cols * rows > 1)) * (512 // 16) ** 2 // 4
    no_thumb = NemotronOmniGeometry(image_mode="tiled", use_thumbnail=False)
    assert no_thumb.tiled_grid(768, 1024).tiles == 12


def test_tiled_budget_monotone_and_planner_view():
    for h, w in _sizes(400, 6, hi=6000):
        previous = None
        for cap in range(1, 13):
            grid = T.image_grid(h, w, max_pixels=cap * 512 * 512)
            assert grid.grid_thw[0] - (grid.grid_thw[0] > 1) <= cap  # grid tiles, thumb aside
            assert grid.visual_tokens == grid.grid_thw[0] * grid.grid_thw[1] * grid.grid_thw[2] // 4
            if previous is not None:
                assert grid.visual_tokens >= previous  # lower max_pixels never adds tokens
            previous = grid.visual_tokens
        assert T.image_grid(h, w) == T.image_grid(h, w, max_pixels=12 * 512 * 512)
    assert T.image_grid(768, 1024) == ImageGrid(1536, 2048, (13, 32, 32), 3328)


# ------------------------------------------------------------------------------------- video
def _hf_video_patches(geometry, h, w):
    from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3VideoProcessor as VP,
    )

    fake = types.SimpleNamespace(video_target_num_patches=geometry.video_target_num_patches,
                                 video_maintain_aspect_ratio=geometry.video_maintain_aspect_ratio,
                                 _downsample_factor=2)
    pw, ph = VP._compute_target_patches(fake, h, w)
    return ph, pw


@pytest.mark.parametrize("keep_aspect", [True, False])
def test_video_frame_size_matches_transformers(keep_aspect):
    geometry = NemotronOmniGeometry(video_maintain_aspect_ratio=keep_aspect)
    for h, w in _sizes(1500, 7, hi=4000):
        grid = geometry.video_grid(6, h, w)
        ph, pw = _hf_video_patches(geometry, h, w)
        assert grid.grid_thw == (3, ph, pw)
        assert grid.visual_tokens == 3 * ph * pw // 4
        assert ph % 2 == 0 and pw % 2 == 0
    assert geometry.video_grid(5, 360, 640).grid_thw[0] == 3  # odd count: last frame padded
    if not keep_aspect:
        assert geometry.video_grid(2, 720, 1280) == ImageGrid(512, 512, (1, 32, 32), 256)


def test_video_frame_indices_formula():
    rng = random.Random(8)
    for _ in range(500):
        total, fps = rng.randint(2, 20000), rng.choice([23.976, 24.0, 25.0, 29.97, 30.0, 60.0])
        video_fps, cap = rng.choice([0.5, 1.0, 2.0]), rng.choice([8, 32, 60, 61])
        picks = G.video_frame_indices(total, fps, video_fps=video_fps, max_num_frames=cap)
        n = min(max(int(total / fps * video_fps), 2), cap, total) // 2 * 2
        assert len(picks) == n and n % 2 == 0
        assert picks == np.linspace(0, total - 1, n).round().astype(int).tolist()
        assert picks[0] == 0 and picks[-1] == total - 1 and picks == sorted(picks)
    with pytest.raises(ValueError):
        G.video_frame_indices(1, 30.0)


def test_video_worked_example_60s():
    # docs/nemotron.md example 3: 60 s, 30 fps (1800 frames), 1280x720, 2 fps, max 32 frames
    picks = G.video_frame_indices(1800, 30.0, video_fps=2.0, max_num_frames=32)
    assert len(picks) == 32 and picks[:4] == [0, 58, 116, 174] and picks[-1] == 1799
    grid = G.video_grid(len(picks), 720, 1280)
    assert grid == ImageGrid(384, 672, (16, 24, 42), 4032)  # 16 pairs x 252
    square = NemotronOmniGeometry(video_maintain_aspect_ratio=False)
    assert square.video_grid(32, 720, 1280) == ImageGrid(512, 512, (16, 32, 32), 4096)
    stamps = G.video_timestamps(picks, 30.0)
    assert stamps[:2] == [0.0, 1.914] and stamps[-1] == 59.367  # 33 ms per frame (truncated)
    labels = G.video_labels(picks, 30.0)
    assert len(labels) == 16
    assert labels[0] == "Frame 1 sampled at 0.00 seconds and frame 2 sampled at 1.91 seconds: "
    assert labels[-1] == ("Frame 31 sampled at 57.45 seconds and frame 32 sampled at 59.37 "
                          "seconds: ")


@pytest.mark.parametrize(("frames", "fps"), [(32, 30.0), (7, 29.97), (2, 25.0)])
def test_video_span_text_matches_transformers(frames, fps):
    from transformers.models.nemotron_h_omni.processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3Processor as P,
    )

    total = 1800
    picks = list(np.linspace(0, total - 1, frames).round().astype(int))
    grid = G.video_grid(frames, 720, 1280)
    fake = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(patch_size=16, downsample_ratio=0.5),
        image_start_token="<img>", image_token="<image>", image_end_token="</img>",
        video_temporal_patch_dim=2)
    inputs = {
        "num_frames": [frames],
        "video_metadata": [types.SimpleNamespace(fps=fps, frames_indices=picks)],
        "pixel_values_videos": types.SimpleNamespace(
            shape=(1, grid.grid_thw[0], 6, grid.resized_height, grid.resized_width)),
    }
    assert G.video_span_text(picks, fps, grid) == P.replace_video_token(fake, inputs, 0)


# ------------------------------------------------------------------------------------- pixels
def test_patchify_matches_transformers():
    pixels = np.random.default_rng(0).standard_normal((3, 64, 96)).astype(np.float32)
    ours = G.patchify(pixels)
    theirs = HF_PATCHES(torch.from_numpy(pixels)[None], 16)[0].numpy()
    assert ours.shape == (24, 768) and np.array_equal(ours, theirs)


def test_pixel_shuffle_matches_model():
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3 as M,
    )

    features = np.random.default_rng(1).standard_normal((2, 6, 10, 5)).astype(np.float32)
    theirs = M.pixel_shuffle(None, torch.from_numpy(features), 0.5).numpy()
    ours = pixel_shuffle(features)
    assert ours.shape == (2, 3, 5, 20) and np.array_equal(ours, theirs)
    assert np.array_equal(ours[0, 1, 2, 5 * 3:5 * 4], features[0, 3, 5])  # (a, b) = (1, 1)
