"""The Qwen-VL geometry (+ mrope, CLI) against the transformers processors and models it mirrors.

Every expected value comes from transformers (installed here, run locally, nothing downloaded) or
from a hand-worked example written out in the test.
"""

from __future__ import annotations

import importlib
import json
import math
import random
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as hf_image
import transformers.models.qwen3_vl.video_processing_qwen3_vl as hf_video3
from PIL import Image
from transformers.video_utils import VideoMetadata

from energon_tasks.families.qwen_vl.geometry import (
    QWEN2_5_VL,
    QWEN3_VL,
    mrope_position_ids,
    smart_resize,
)
from energon_tasks.profiles import get_geometry

MODELS = [QWEN2_5_VL, QWEN3_VL]
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 151655, 151656, 151652, 151653


def hf_image_processor(geometry, min_pixels=None, max_pixels=None):
    """The PIL image processor configured as the model's published preprocessor_config.json."""
    return hf_image.Qwen2VLImageProcessorPil(
        patch_size=geometry.patch_size,
        merge_size=geometry.merge_size,
        temporal_patch_size=geometry.temporal_patch_size,
        image_mean=list(geometry.image_mean),
        image_std=list(geometry.image_std),
        min_pixels=min_pixels or geometry.default_min_pixels,
        max_pixels=max_pixels or geometry.default_max_pixels,
    )


@pytest.fixture(scope="module")
def qwen2_video_processor():
    """transformers' Qwen2VLVideoProcessor (Qwen2.5-VL's), imported with torchvision stubbed.

    Its module imports torchvision at the top but the pure methods used here (resize arithmetic in
    ``get_num_of_video_patches``, ``patchify``) never touch it; the stub is removed right after.
    """
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # evaluated (False) before the stub exists
    names = [
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    ]
    module_name = "transformers.models.qwen2_vl.video_processing_qwen2_vl"
    saved = {name: sys.modules.get(name) for name in [*names, module_name]}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    try:
        module = importlib.import_module(module_name)
    finally:
        for name, value in saved.items():
            if value is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = value
    return module.Qwen2VLVideoProcessor(cap_pixels_per_frame=False)


def _pixel_settings(geometry):
    f2 = geometry.factor**2
    return [
        (geometry.default_min_pixels, geometry.default_max_pixels),
        (3136, 1003520),
        (256 * f2, 1280 * f2),
        (4 * f2, 16384 * f2),
        (1, 4 * f2),
        (64 * f2, 64 * f2),
    ]


def _random_sizes(seed: int, count: int) -> list[tuple[int, int]]:
    """Tiny, huge, extreme-aspect (up to 1:200) and ordinary sizes, plus fixed corner cases."""
    rng = random.Random(seed)
    sizes = [(1, 1), (3, 3), (1, 200), (200, 1), (3, 600), (28, 5600), (45, 9000)]
    sizes += [(9000, 6000), (6000, 9000), (10000, 10000), (27, 29), (13, 2600)]
    while len(sizes) < count:
        pick = rng.random()
        if pick < 0.2:
            h, w = rng.randint(1, 64), rng.randint(1, 64)
        elif pick < 0.4:
            short = rng.randint(1, 60)
            h, w = short, min(10000, short * rng.randint(50, 200))
        elif pick < 0.55:
            h, w = rng.randint(4000, 10000), rng.randint(4000, 10000)
        else:
            h, w = (int(math.exp(rng.uniform(math.log(16), math.log(5000)))) for _ in range(2))
        if max(h, w) / min(h, w) <= 200:
            sizes.append((h, w) if rng.random() < 0.5 else (w, h))
    return sizes


@pytest.mark.parametrize("geometry", MODELS, ids=lambda g: g.name)
def test_image_grid_matches_hf_resize_for_random_sizes(geometry):
    sizes = _random_sizes(seed=geometry.patch_size, count=220)
    processor = hf_image_processor(geometry)
    for height, width in sizes:
        for min_pixels, max_pixels in _pixel_settings(geometry):
            grid = geometry.image_grid(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
            expected = hf_image.smart_resize(height, width, geometry.factor, min_pixels, max_pixels)
            patches = processor.get_number_of_image_patches(
                height, width, {"min_pixels": min_pixels, "max_pixels": max_pixels}
            )
            case = (height, width, min_pixels, max_pixels)
            assert (grid.resized_height, grid.resized_width) == expected, case
            assert grid.grid_thw == (
                1,
                expected[0] // geometry.patch_size,
                expected[1] // geometry.patch_size,
            ), case
            assert grid.visual_tokens * geometry.merge_size**2 == patches, case


@pytest.mark.slow
@pytest.mark.parametrize("geometry", MODELS, ids=lambda g: g.name)
def test_image_grid_matches_full_hf_processor(geometry):
    sizes = [(3, 3), (1, 200), (200, 1), (27, 29), (480, 640), (1080, 1920), (45, 9000)]
    sizes += [s for s in _random_sizes(seed=7, count=60) if s[0] * s[1] <= 2_000_000][:20]
    sizes.append((9000, 6000))
    for index, (height, width) in enumerate(sizes):
        min_pixels, max_pixels = _pixel_settings(geometry)[index % 3 + 1]
        processor = hf_image_processor(geometry, min_pixels, max_pixels)
        image = Image.new("RGB", (width, height), (index * 7 % 256, 80, 160))
        out = processor(images=[image], return_tensors="np")
        grid = geometry.image_grid(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
        assert out["image_grid_thw"].tolist() == [list(grid.grid_thw)], (height, width)
        assert out["pixel_values"].shape[0] == math.prod(grid.grid_thw)


@pytest.mark.parametrize("geometry", MODELS, ids=lambda g: g.name)
@pytest.mark.parametrize("size", [(37, 91), (480, 640), (300, 45), (1000, 7), (64, 64)])
def test_pixel_values_match_hf(geometry, size):
    height, width = size
    rng = np.random.default_rng(height * width)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    expected = hf_image_processor(geometry)(images=[image], return_tensors="np")["pixel_values"]
    grid = geometry.image_grid(height, width)
    resized = image.resize((grid.resized_width, grid.resized_height), Image.BICUBIC)
    pixels = geometry.normalize(np.asarray(resized).transpose(2, 0, 1)[None])
    ours = geometry.patchify(pixels)
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("geometry", MODELS, ids=lambda g: g.name)
def test_aspect_ratio_over_200_is_a_one_line_error_like_hf(geometry):
    for height, width in [(1, 201), (201, 1), (3, 601), (50, 10001)]:
        with pytest.raises(ValueError):
            hf_image.smart_resize(height, width, geometry.factor, 3136, 1003520)
        with pytest.raises(ValueError, match=f"{height}x{width}") as error:
            geometry.image_grid(height, width)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="0x5"):
        smart_resize(0, 5, factor=28, min_pixels=1, max_pixels=100)


def test_get_geometry_names():
    assert get_geometry("qwen2.5-vl") is get_geometry("qwen2_5_vl") is QWEN2_5_VL
    assert get_geometry("qwen3-vl") is get_geometry("Qwen3_VL") is QWEN3_VL
    assert QWEN2_5_VL.factor == 28 and QWEN3_VL.factor == 32
    with pytest.raises(ValueError, match="qwen2.5-vl.*qwen3-vl"):
        get_geometry("qwen2-vl")


VIDEO_CASES = [  # (total_frames, source_fps, video_fps, max_frames, min_frames)
    (total, src, fps, cap, low)
    for total in (1, 2, 3, 5, 9, 48, 61, 300, 1001, 18000, 123457)
    for src in (24.0, 29.97, 30.0, 60.0)
    for fps in (0.5, 1.0, 2.0, 4.0)
    for cap, low in ((768, 4), (60, 4), (15, 2), (8, 8))
]


def test_qwen3_frame_indices_match_hf_sample_frames():
    processors = {}
    for total, src, fps, cap, low in VIDEO_CASES:
        key = (cap, low)
        if key not in processors:
            processors[key] = hf_video3.Qwen3VLVideoProcessor(max_frames=cap, min_frames=low)
        metadata = VideoMetadata(total_num_frames=total, fps=src)
        expected = processors[key].sample_frames(metadata, fps=fps).tolist()
        ours = QWEN3_VL.video_frame_indices(
            total, src, video_fps=fps, max_num_frames=cap, min_num_frames=low
        )
        assert ours == expected, (total, src, fps, cap, low)


def test_qwen2_5_frame_indices_follow_qwen_vl_utils():
    # Hand-worked: 10 s at 30 fps, 2 fps -> 20 frames, torch.linspace(0, 299, 20).round():
    # step 299/19 = 15.74 -> 0, 16, 31, 47, 63, ..., 283, 299.
    picks = QWEN2_5_VL.video_frame_indices(300, 30.0, video_fps=2.0)
    assert len(picks) == 20 and picks[:5] == [0, 16, 31, 47, 63] and picks[-2:] == [283, 299]
    # 10 frames at 30 fps: 0.67 frames at 2 fps, raised to min 4 -> linspace(0, 9, 4).
    assert QWEN2_5_VL.video_frame_indices(10, 30.0, video_fps=2.0) == [0, 3, 6, 9]
    # 3 frames: min(4, floor2(3)=2, 3) -> 2 frames; 1 frame cannot fill a temporal patch.
    assert QWEN2_5_VL.video_frame_indices(3, 30.0, video_fps=2.0) == [0, 2]
    with pytest.raises(ValueError, match="1 frame"):
        QWEN2_5_VL.video_frame_indices(1, 30.0, video_fps=2.0)
    # Long clips: qwen-vl-utils' readers pick with float32 torch.linspace, which rounds a few
    # frames differently from float64 (36000 frames, pick 744 of 768: 744 * 35999 / 767 =
    # 34919.4994 exactly, but float32 lands on 34919.5 -> 34920).
    for total in (36000, 86400, 172800):
        picks = QWEN2_5_VL.video_frame_indices(total, 24.0, video_fps=2.0)
        assert picks == torch.linspace(0, total - 1, 768).round().long().tolist()
    assert QWEN2_5_VL.video_frame_indices(36000, 24.0, video_fps=2.0)[744] == 34920
    for total, src, fps, cap, low in VIDEO_CASES:
        if total < 2:
            continue
        picks = QWEN2_5_VL.video_frame_indices(
            total, src, video_fps=fps, max_num_frames=cap, min_num_frames=low
        )
        assert len(picks) % 2 == 0 and 2 <= len(picks) <= min(cap, total)
        assert picks[0] == 0 and picks[-1] == total - 1 and picks == sorted(set(picks))


@pytest.mark.parametrize("frames", [2, 3, 4, 7, 16, 61, 768])
def test_qwen3_video_grid_matches_hf(frames):
    processor = hf_video3.Qwen3VLVideoProcessor()
    settings = [(4096, 25165824), (131072, 786432), (4096, 16384 * frames)]
    for height, width in [(5, 5), (31, 700), (360, 640), (1080, 1920), (2160, 3840), (17, 3000)]:
        for min_pixels, max_pixels in settings:
            grid = QWEN3_VL.video_grid(
                frames, height, width, min_pixels=min_pixels, max_pixels=max_pixels
            )
            expected = hf_video3.smart_resize(
                frames, height, width, 2, 32, min_pixels=min_pixels, max_pixels=max_pixels
            )
            kwargs = {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}
            patches = processor.get_num_of_video_patches(frames, height, width, kwargs)
            assert (grid.resized_height, grid.resized_width) == expected
            assert grid.grid_thw[0] == math.ceil(frames / 2)
            assert grid.visual_tokens * 4 == patches
    with pytest.raises(ValueError, match="1 frame"):
        QWEN3_VL.video_grid(1, 360, 640)


@pytest.mark.parametrize("frames", [1, 2, 5, 16, 768])
def test_qwen2_5_video_grid_matches_hf(qwen2_video_processor, frames):
    for height, width in [(5, 5), (31, 700), (360, 640), (1080, 1920), (2160, 3840)]:
        for min_pixels, max_pixels in [(100352, 602112), (3136, 12845056), (128 * 784, 128 * 784)]:
            grid = QWEN2_5_VL.video_grid(
                frames, height, width, min_pixels=min_pixels, max_pixels=max_pixels
            )
            kwargs = {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}
            patches = qwen2_video_processor.get_num_of_video_patches(frames, height, width, kwargs)
            expected = hf_image.smart_resize(height, width, 28, min_pixels, max_pixels)
            assert (grid.resized_height, grid.resized_width) == expected
            assert grid.visual_tokens * 4 == patches


@pytest.mark.parametrize("frames", [1, 3, 4])
@pytest.mark.parametrize("geometry", MODELS, ids=lambda g: g.name)
def test_video_patchify_matches_hf_layout(geometry, frames, qwen2_video_processor):
    hf = qwen2_video_processor if geometry is QWEN2_5_VL else hf_video3.Qwen3VLVideoProcessor()
    shape = (frames, 3, 2 * geometry.factor, 3 * geometry.factor)
    pixels = np.random.default_rng(frames).standard_normal(shape).astype(np.float32)
    expected, grid_t, grid_h, grid_w = hf.patchify(
        torch.from_numpy(pixels)[None], geometry.patch_size, geometry.merge_size, 2
    )
    ours = geometry.patchify(pixels)
    assert (grid_t, grid_h, grid_w) == (math.ceil(frames / 2), 4, 6)
    np.testing.assert_array_equal(ours, expected[0].numpy())


# ---- M-RoPE -------------------------------------------------------------------------------------

TINY_TEXT = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=200,
)
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16)


@pytest.fixture(scope="module")
def hf_models():
    """Tiny Qwen2.5-VL / Qwen3-VL models built from local configs (only get_rope_index is used)."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    mrope = dict(mrope_section=[2, 1, 1])
    qwen2_5 = Qwen2_5_VLConfig(
        text_config=dict(TINY_TEXT, rope_scaling=dict(type="mrope", **mrope)),
        vision_config=dict(TINY_VISION, fullatt_block_indexes=[0], tokens_per_second=2),
    )
    qwen3 = Qwen3VLConfig(
        text_config=dict(TINY_TEXT, rope_scaling=dict(rope_type="default", **mrope)),
        vision_config=dict(TINY_VISION, deepstack_visual_indexes=[0], num_position_embeddings=16),
    )
    return {"qwen2.5-vl": Qwen2_5_VLModel(qwen2_5), "qwen3-vl": Qwen3VLModel(qwen3)}


def _random_sample(rng: random.Random, qwen3: bool):
    """Token ids with images and videos laid out as each model's processor does, and the grids."""
    ids, images, videos, seconds = [], [], [], []

    def text(n):
        return [rng.randint(0, 150000) for _ in range(n)]

    for _ in range(rng.randint(1, 5)):
        ids += text(rng.randint(0, 6))
        h, w = 2 * rng.randint(1, 8), 2 * rng.randint(1, 8)
        if rng.random() < 0.6:
            images.append((1, h, w))
            ids += [VISION_START] + [IMAGE_TOKEN] * (h * w // 4) + [VISION_END]
            continue
        span = max(h, w) // 2  # keep Qwen2.5-VL's temporal reach within the spatial one (see below)
        second = rng.choice([0.25, 0.5, 1 / 3, 2 / 3, 1.0, 1.5])
        t = rng.randint(1, max(1, min(6, int((span - 1) / (2 * second)) + 1)))
        videos.append((t, h, w))
        seconds.append(second)
        if qwen3:  # one vision span per temporal patch, a timestamp text before each
            for _ in range(t):
                ids += text(4) + [VISION_START] + [VIDEO_TOKEN] * (h * w // 4) + [VISION_END]
        else:
            ids += [VISION_START] + [VIDEO_TOKEN] * (t * h * w // 4) + [VISION_END]
    return ids + text(rng.randint(0, 6)), images, videos, seconds


@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3-vl"])
def test_mrope_matches_hf_get_rope_index(hf_models, name):
    """Random samples; Qwen2.5-VL videos keep int((t-1)*step) < max(h, w)/2, where transformers
    5.x and the original max+1 rule agree (test_mrope_text_after_long_video covers the rest)."""
    rng = random.Random(name)
    for _ in range(60):
        ids, images, videos, seconds = _random_sample(rng, qwen3=name == "qwen3-vl")
        input_ids = torch.tensor([ids])
        types_ = (input_ids == IMAGE_TOKEN).int() + 2 * (input_ids == VIDEO_TOKEN).int()
        kwargs = dict(
            image_grid_thw=torch.tensor(images) if images else None,
            video_grid_thw=torch.tensor(videos) if videos else None,
        )
        steps = None
        if name == "qwen2.5-vl" and videos:
            kwargs["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
            steps = [float(np.float32(2) * np.float32(s)) for s in seconds]  # tokens_per_second=2
        expected, _ = hf_models[name].get_rope_index(input_ids, types_, **kwargs)
        ours = mrope_position_ids(
            ids,
            image_token_id=IMAGE_TOKEN,
            video_token_id=VIDEO_TOKEN,
            image_grid_thw=images,
            video_grid_thw=videos,
            video_time_steps=steps,
        )
        np.testing.assert_array_equal(ours, expected[:, 0].numpy())


def test_mrope_text_after_long_video():
    """Hand-worked, from the original Qwen2.5-VL get_rope_index docstring: merged grid 3x2x2,
    interval 50 (tokens_per_second 25, 2 frames per patch, 1 fps): vision t 0/50/100, text 101..."""
    ids = [VIDEO_TOKEN] * 12 + [1, 2, 3, 4, 5]
    ours = mrope_position_ids(
        ids,
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        video_grid_thw=[(3, 4, 4)],
        video_time_steps=[50.0],
    )
    assert ours[0, :12].tolist() == [0] * 4 + [50] * 4 + [100] * 4
    assert ours[1, :12].tolist() == [0, 0, 1, 1] * 3
    assert ours[2, :12].tolist() == [0, 1, 0, 1] * 3
    assert (ours[:, 12:] == np.arange(101, 106)).all()


def test_mrope_rejects_cut_spans():
    common = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN)
    with pytest.raises(ValueError, match="does not fit"):
        mrope_position_ids([1] + [IMAGE_TOKEN] * 3, image_grid_thw=[(1, 4, 4)], **common)
    with pytest.raises(ValueError, match="1/2 image"):
        mrope_position_ids([1] + [IMAGE_TOKEN] * 4, image_grid_thw=[(1, 4, 4)] * 2, **common)
    with pytest.raises(ValueError, match="0/1 video"):
        mrope_position_ids([1, 2], video_grid_thw=[(2, 4, 4)], **common)
    assert mrope_position_ids([], **common).shape == (3, 0)


# ---- CLI ----------------------------------------------------------------------------------------


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "energon_tasks", "grid", *args]
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=root)


def _main_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m energon_tasks grid``'s main() in this process (for its errors, found before
    any work): the same result as ``_run_cli``."""
    import contextlib
    import io

    from energon_tasks.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["grid", *args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_cli_grid_prints_inputs_in_command_line_order():
    args = "--model qwen3-vl --image 480x640 --video 300x360x640 --source-fps 30 --image 3x3"
    result = _run_cli(*args.split(), "--max-pixels", "1003520")
    assert result.returncode == 0, result.stderr
    entries = json.loads(result.stdout)
    assert [e["kind"] for e in entries] == ["image", "video", "image"]
    for entry, size in zip(entries[::2], [(480, 640), (3, 3)], strict=True):
        expected = hf_image.smart_resize(*size, 32, QWEN3_VL.default_min_pixels, 1003520)
        assert entry["input"] == list(size)
        assert [entry["resized_height"], entry["resized_width"]] == list(expected)
        assert entry["grid_thw"] == [1, expected[0] // 16, expected[1] // 16]
        assert entry["visual_tokens"] == expected[0] * expected[1] // 32**2
    video = entries[1]
    frames = len(
        hf_video3.Qwen3VLVideoProcessor().sample_frames(
            VideoMetadata(total_num_frames=300, fps=30.0), fps=2
        )
    )
    assert video["input"] == [300, 360, 640] and video["frames_sampled"] == frames == 20
    grid = QWEN3_VL.video_grid(frames, 360, 640)
    assert video["grid_thw"] == list(grid.grid_thw) and video["visual_tokens"] == grid.visual_tokens


@pytest.mark.parametrize(
    "args",
    [["--model", "qwen2.5-vl", "--image", "12"], ["--model", "qwen3-vl", "--image", "1x300"]],
)
def test_cli_bad_input_is_one_line_exit_2(args):
    result = _main_cli(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert args[-1] in result.stderr


@pytest.fixture(params=["native", "numpy"])
def rows_path(request, monkeypatch):
    """pixel_rows through the C kernel (make install builds it; required here) or numpy."""
    from energon_tasks.families.qwen_vl import geometry

    if request.param == "numpy":
        monkeypatch.setattr(geometry, "_native_patch_rows", None)
    else:
        assert geometry._native_patch_rows is not None, "energon_tasks._resample not built"
    return request.param


@pytest.mark.parametrize("frames", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3-vl"])
def test_pixel_rows_equal_normalize_then_patchify(name, frames, rows_path):
    geo = get_geometry(name)
    pixels = np.random.default_rng(frames).integers(
        0, 256, (frames, geo.factor * 3, geo.factor * 5, 3), dtype=np.uint8)
    expected = geo.patchify(geo.normalize(pixels.transpose(0, 3, 1, 2)))
    assert np.array_equal(geo.pixel_rows(pixels), expected)
    strided = np.zeros((frames, geo.factor * 3, geo.factor * 5 + 7, 3), np.uint8)
    strided[:, :, :geo.factor * 5] = pixels  # a view whose rows are not contiguous
    assert np.array_equal(geo.pixel_rows(strided[:, :, :geo.factor * 5]), expected)


def test_pixel_rows_fill_a_slice_of_one_buffer(rows_path):
    geo = get_geometry("qwen2.5-vl")
    rng = np.random.default_rng(5)
    items = [rng.integers(0, 256, (t, geo.factor * h, geo.factor * w, 3), dtype=np.uint8)
             for t, h, w in [(1, 2, 3), (3, 1, 1), (1, 4, 2)]]
    expected = [geo.patchify(geo.normalize(x.transpose(0, 3, 1, 2))) for x in items]
    buffer = np.full((sum(len(e) for e in expected), expected[0].shape[1]), np.nan, np.float32)
    start = 0
    for pixels, rows in zip(items, expected):
        filled = geo.pixel_rows(pixels, out=buffer[start:start + len(rows)])
        assert np.shares_memory(filled, buffer)  # written in place, no copy
        start += len(rows)
    assert np.array_equal(buffer, np.concatenate(expected))
    with pytest.raises(ValueError, match="out of shape"):
        geo.pixel_rows(items[0], out=buffer[:1])
    with pytest.raises(ValueError, match="multiples"):
        geo.pixel_rows(items[0][:, :-1])


@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3-vl"])
def test_patch_rows_values_are_the_tables_whatever_the_constants(name):
    """The C kernel computes values from its constants only where they give its table for all
    256 values bit for bit: a table they do not give is looked up, constants or not."""
    from energon_tasks import _resample

    geo = get_geometry(name)
    rng = np.random.default_rng(11)
    pixels = rng.integers(0, 256, (3, geo.factor * 2, geo.factor * 3, 3), dtype=np.uint8)
    constants = np.array([[255.0] * 3, geo.image_mean, geo.image_std], np.float32)
    p, m, tp = geo.patch_size, geo.merge_size, geo.temporal_patch_size
    rows = 2 * (geo.factor * 2 // p) * (geo.factor * 3 // p)
    for table in (geo.normalization_table(), rng.standard_normal((3, 256)).astype(np.float32)):
        table = np.ascontiguousarray(table)
        looked_up = table[np.arange(3)[None, :, None, None], pixels.transpose(0, 3, 1, 2)]
        for given in (constants, None):
            out = np.full((rows, 3 * tp * p * p), np.nan, np.float32)
            _resample.patch_rows(pixels, table, out, p, m, tp, given)
            assert np.array_equal(out, geo.patchify(looked_up))
    with pytest.raises(ValueError, match="constants"):
        _resample.patch_rows(pixels, table, out, p, m, tp, constants[:2])


def test_float32_rescale_equals_the_processor_rescale_for_every_uint8(rows_path):
    """pixel_rows rescales in float32 (x / 255); the processors go through float64 (x * 1/255)."""
    values = np.arange(256, dtype=np.uint8)
    processor = (values.astype(np.float64) * (1 / 255)).astype(np.float32)
    assert np.array_equal(values.astype(np.float32) / np.float32(255), processor)
    for name in ("qwen2.5-vl", "qwen3-vl"):
        geo = get_geometry(name)
        pixels = np.broadcast_to(values.reshape(1, 16, 16, 1), (1, 16, 16, 3))
        pixels = np.tile(pixels, (1, geo.factor, geo.factor, 1))  # every value, every channel
        expected = geo.patchify(geo.normalize(pixels.transpose(0, 3, 1, 2)))
        assert np.array_equal(geo.pixel_rows(pixels), expected)


# ---- constants from transformers ----------------------------------------------------------------

#: The published checkpoints' processor files, where they set what transformers' processor classes
#: do not (the Qwen image processor class is Qwen2-VL's; Qwen3-VL's files override its sizes):
#: - Qwen/Qwen2.5-VL-7B-Instruct preprocessor_config.json: "min_pixels": 3136,
#:   "max_pixels": 12845056 (the class default max is Qwen2-VL's 1003520);
#: - Qwen/Qwen3-VL-8B-Instruct preprocessor_config.json: "size": {"shortest_edge": 65536,
#:   "longest_edge": 16777216}, "image_mean" / "image_std": [0.5, 0.5, 0.5];
#:   video_preprocessor_config.json: "size": {"shortest_edge": 4096, "longest_edge": 25165824}
#:   (the Qwen3VLVideoProcessor class default is 131072..786432).
#: (huggingface.co/<repo>/blob/main/<file>, as published; the hub is not reachable here, and the
#: files of the other sizes in configs/ were not re-read: the geometry applies one set per family.)
HUB_PROCESSOR_FILES = {
    "qwen2_5_vl": {"max_pixels": 12845056},
    "qwen3_vl": {"min_pixels": 65536, "max_pixels": 16777216, "video_min_pixels": 4096,
                 "video_max_pixels": 25165824},
}
#: qwen-vl-utils' FPS (vision_process.py), the Qwen2.5-VL frame rate (its video class has none)
QWEN_VL_UTILS_FPS = 2.0


def _model_configs() -> dict[str, object]:
    """configs/<model>.yaml (every model config we ship) -> the transformers config it exports to
    (``to_hf_dict`` read back by ``AutoConfig``)."""
    import yaml
    from transformers import AutoConfig

    from models.families import config_module

    out = {}
    for path in sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")):
        family = yaml.safe_load(path.read_text()).get("family")
        if family:
            module = config_module(family)
            out[path.stem] = AutoConfig.for_model(**module.to_hf_dict(module.load_yaml(path)))
    return out


def _class_attributes(path: Path, name: str) -> dict:
    """Literal class attributes of ``name`` in a transformers module that cannot be imported here
    (it needs torchvision); names such as ``OPENAI_CLIP_MEAN`` resolved from image_utils."""
    import ast

    import transformers.image_utils as image_utils

    tree = ast.parse(path.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name).body
    out = {}
    for node in body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Name):
                out[node.targets[0].id] = getattr(image_utils, value.id, None)
            elif isinstance(value, ast.Constant):
                out[node.targets[0].id] = value.value
    return out


def test_model_configs_carry_the_geometry_patch_merge_and_temporal_sizes():
    """Each model config in configs/, as transformers reads its export, has the patch, merge and
    temporal sizes (and, Nemotron-Omni, the normalisation) of its family's geometry."""
    from energon_tasks.families.nemotron_omni.geometry import NEMOTRON_OMNI, NEMOTRON_OMNI_TILED

    configs = _model_configs()
    assert {"qwen2_5_vl_3b", "qwen2_5_vl_7b", "qwen3_vl_2b", "qwen3_vl_4b", "qwen3_vl_8b",
            "nemotron_omni_30b_a3b"} <= set(configs)
    for name, hf in configs.items():
        v = hf.vision_config
        if hf.model_type == "nemotron_h_omni":
            for geometry in (NEMOTRON_OMNI, NEMOTRON_OMNI_TILED):
                assert geometry.patch_size == v.patch_size, name
                assert geometry.merge_size == round(1 / hf.downsample_ratio), name
                assert geometry.temporal_patch_size == hf.video_temporal_patch_size, name
                assert geometry.temporal_patch_size == v.video_temporal_patch_size, name
                assert list(geometry.image_mean) == v.norm_mean, name
                assert list(geometry.image_std) == v.norm_std, name
            continue
        geometry = get_geometry(hf.model_type)
        assert (geometry.patch_size, geometry.merge_size, geometry.temporal_patch_size) == (
            v.patch_size, v.spatial_merge_size, v.temporal_patch_size), name


def test_qwen_geometry_constants_are_the_processors(qwen2_video_processor):
    """Qwen2.5-VL: ``Qwen2VLImageProcessorPil`` / ``Qwen2VLVideoProcessor`` class defaults (+ the
    published max_pixels); Qwen3-VL: ``Qwen3VLVideoProcessor`` class defaults (+ the published
    image and video sizes). Also the transformers vision configs' defaults."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    image = hf_image.Qwen2VLImageProcessorPil()
    video3 = hf_video3.Qwen3VLVideoProcessor()
    for geometry, processor, video, vision in [
        (QWEN2_5_VL, image, qwen2_video_processor, Qwen2_5_VLConfig().vision_config),
        (QWEN3_VL, video3, video3, Qwen3VLConfig().vision_config),
    ]:
        hub = HUB_PROCESSOR_FILES[geometry.name]
        sizes = (geometry.patch_size, geometry.merge_size, geometry.temporal_patch_size)
        assert sizes == (processor.patch_size, processor.merge_size,
                         processor.temporal_patch_size)
        assert sizes == (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
        assert sizes == (video.patch_size, video.merge_size, video.temporal_patch_size)
        assert geometry.image_mean == tuple(processor.image_mean), geometry.name
        assert geometry.image_std == tuple(processor.image_std), geometry.name
        assert geometry.default_min_pixels == hub.get("min_pixels", processor.size.shortest_edge)
        assert geometry.default_max_pixels == hub.get("max_pixels", processor.size.longest_edge)
        assert geometry.default_video_min_pixels == hub.get("video_min_pixels",
                                                            video.size.shortest_edge)
        assert geometry.default_video_max_pixels == hub.get("video_max_pixels",
                                                            video.size.longest_edge)
        assert (geometry.default_min_num_frames, geometry.default_max_num_frames) == (
            video.min_frames, video.max_frames)
        assert geometry.default_video_fps == (video.fps or QWEN_VL_UTILS_FPS)
    assert QWEN2_5_VL.factor == 28 and QWEN3_VL.factor == 32  # vlm-facts: 14 x 2, 16 x 2


def test_nemotron_geometry_constants_are_the_processors():
    """``NemotronH_Omni_Reasoning_V3ImageProcessor`` class attributes (read from its source: the
    module needs torchvision) and ``NemotronH_Omni_Reasoning_V3VideoProcessor`` class defaults."""
    import transformers
    from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3VideoProcessor as VideoProcessor,
    )

    from energon_tasks.families.nemotron_omni.geometry import NEMOTRON_OMNI, NEMOTRON_OMNI_TILED

    source = (Path(transformers.__file__).parent / "models" / "nemotron_h_omni"
              / "image_processing_nemotron_h_omni.py")
    image = _class_attributes(source, "NemotronH_Omni_Reasoning_V3ImageProcessor")
    video = VideoProcessor()
    for geometry in (NEMOTRON_OMNI, NEMOTRON_OMNI_TILED):
        assert geometry.patch_size == image["patch_size"] == video.patch_size
        assert geometry.merge_size == round(1 / image["downsample_ratio"]) == round(
            1 / video.downsample_ratio)
        assert geometry.image_mean == tuple(image["image_mean"])
        assert geometry.image_std == tuple(image["image_std"])
        assert geometry.default_min_pixels == image["min_num_patches"] * geometry.patch_size**2
        assert geometry.default_max_pixels == image["max_num_patches"] * geometry.patch_size**2
        assert geometry.temporal_patch_size == video.temporal_patch_size
        assert geometry.video_target_num_patches == video.video_target_num_patches
        assert geometry.video_maintain_aspect_ratio == video.video_maintain_aspect_ratio


@pytest.mark.parametrize("kind, frames", [("image", 1), ("video", 2), ("video", 3)])
def test_nemotron_float_rows_native_equal_numpy(kind, frames, monkeypatch):
    """Float32 frames (a float32 resize's (C, H, W) planes, or frames laid out (H, W, C)) give
    the same rows bit for bit through the C kernel and through numpy."""
    from energon_tasks.families.nemotron_omni import geometry

    assert geometry._native_normalize_rows is not None, "energon_tasks._resample not built"
    geo = get_geometry("nemotron-omni")
    planes = np.random.default_rng(frames).uniform(
        -20, 275, (frames, 3, geo.patch_size * 3, geo.patch_size * 5)).astype(np.float32)
    planes[0, 0, 0, :4] = [0.0, 255.0, -0.0, 1e-39]  # the ends, a signed zero, a subnormal
    as_views, as_copies = planes.transpose(0, 2, 3, 1), np.ascontiguousarray(
        planes.transpose(0, 2, 3, 1))
    native = geo.pixel_rows(as_views, kind=kind)
    monkeypatch.setattr(geometry, "_native_normalize_rows", None)
    expected = geo.pixel_rows(as_views, kind=kind)
    assert native.tobytes() == expected.tobytes()
    assert geo.pixel_rows(as_copies, kind=kind).tobytes() == expected.tobytes()
