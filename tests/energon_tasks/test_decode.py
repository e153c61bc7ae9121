"""Image and video decoding at the planned size: exact and fast image decoding against the
transformers processors, draft, EXIF, modes, caps, bad media, frames."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as hf_image
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from contract.errors import ConfigError
from energon_tasks import task_encoder_for
from energon_tasks.config import TaskEncoderConfig
from energon_tasks.decode import MediaError, decode_image
from energon_tasks.families.nemotron_omni.geometry import NEMOTRON_OMNI
from energon_tasks.families.qwen_vl.geometry import QWEN2_5_VL, QWEN3_VL
from energon_tasks.resize import torch_resized
from energon_tasks.sample_format import Media
from energon_tasks.task_encoder import cook_conversation
from energon_tasks.video_decode import decode_video_frames
from tests.energon_tasks.conftest import (
    conversation,
    crude,
    image_bytes,
)
from tests.energon_tasks.test_geometry import _random_sizes, hf_image_processor
from tests.energon_tasks.test_nemotron_encoder import hf_image_rows, nemotron_resize

BIG = 10**9
FORMATS = ("JPEG", "PNG", "WEBP")


# ---- the processors' pixel values (references) -------------------------------------------------


def qwen_references(data: bytes, geometry, min_pixels: int, max_pixels: int) -> list:
    """``pixel_values`` of transformers' ``Qwen2VLImageProcessorPil`` on the decoded image (its
    ``convert_to_rgb``, ``smart_resize``, PIL bicubic resize), and, when that size is one the
    processor keeps, on the image after qwen-vl-utils' ``fetch_image`` resize step (RGBA pasted on
    white, else ``convert("RGB")``, PIL resize with the default filter; qwen-vl-utils itself does
    not import here: it needs torchvision). The processor's size is not always one it keeps: with
    a side under half the factor its min-pixels step can overshoot max_pixels (200x1 at 3136..9408
    -> 812x28, which it would shrink again)."""
    processor = hf_image_processor(geometry, min_pixels, max_pixels)
    image = Image.open(io.BytesIO(data))
    out = [processor(images=[image], return_tensors="np")["pixel_values"]]
    height, width = hf_image.smart_resize(image.height, image.width, geometry.factor,
                                          min_pixels, max_pixels)
    if hf_image.smart_resize(height, width, geometry.factor, min_pixels, max_pixels) == (
            height, width):
        if image.mode == "RGBA":
            white = Image.new("RGB", image.size, (255, 255, 255))
            white.paste(image, mask=image.split()[3])
            image = white
        fetched = image.convert("RGB").resize((width, height))
        out.append(processor(images=[fetched], return_tensors="np")["pixel_values"])
    return out


def nemotron_reference(data: bytes, height: int, width: int) -> np.ndarray:
    """transformers' ``convert_to_rgb`` (alpha on white), the processor's float32 resize, its
    fused rescale + normalise and ``convert_image_to_patches`` (``hf_image_rows``)."""
    rgb = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    return hf_image_rows(nemotron_resize(rgb, height, width))


def photo_bytes(height: int, width: int, seed: int, fmt: str, alpha: bool = False) -> bytes:
    """A small photo-like image (gradients + noise), encoded as ``fmt`` (q 90 when lossy)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1),
                     (x + y) * 127 // max(height + width, 1)], -1)
    pixels = np.clip(base + rng.integers(-40, 40, (height, width, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    if alpha:
        image.putalpha(Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8)))
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"compress_level": 1} if fmt == "PNG" else {"quality": 90}))
    return buffer.getvalue()


def small_sizes(count: int = 220, area: int = 16_000) -> list[tuple[int, int]]:
    """The geometry tests' sizes (``_random_sizes``: tiny, huge, up to 1:200), scaled down to at
    most ``area`` pixels with their aspect ratio (still <= 200), so that decoding stays cheap."""
    out = []
    for height, width in _random_sizes(seed=28, count=count):
        if height * width > area:
            factor = math.sqrt(area / (height * width))
            short = max(1, round(min(height, width) * factor))
            long = min(round(max(height, width) * factor), 200 * short)
            height, width = (short, long) if height < width else (long, short)
        out.append((height, width))
    return out


def _pixel_limits(geometry, index: int, height: int, width: int) -> tuple[int, int]:
    """Limits that shrink (at least 2x per side for the larger images, where a fast decode would
    use the JPEG draft), keep, or enlarge the small images, by turns. Nemotron-Omni's patch grid
    (as transformers') reaches zero rows when the cap in patches is below the aspect ratio, so its
    tight cap is for images of aspect ratio up to 8."""
    if geometry is NEMOTRON_OMNI:
        unit = geometry.patch_size**2
        shrink = (4 * unit, 12 * unit) if max(height, width) <= 8 * min(height, width) else (
            16 * unit, 256 * unit)
        return [shrink, (16 * unit, 256 * unit), (128 * unit, 256 * unit)][index % 3]
    unit = geometry.factor**2
    return [(4 * unit, 4 * unit), (4 * unit, 24 * unit), (32 * unit, 48 * unit)][index % 3]


@pytest.fixture
def one_torch_thread():
    """Small tensors, one at a time: intra-op threads only contend (4x slower on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_exact_pixel_values_equal_the_processors_on_220_sizes(fmt, one_torch_thread):
    """``image_decode="exact"`` (no draft, the processor's resize) gives the processors'
    ``pixel_values`` bit for bit: Qwen2.5-VL / Qwen3-VL (also after qwen-vl-utils' resize),
    Nemotron-Omni (float32 resize, its own normalisation); every size, every pixel-limit regime,
    some RGBA."""
    drafted = fetched = 0
    for index, (height, width) in enumerate(small_sizes()):
        alpha = fmt != "JPEG" and index % 7 == 0
        data = photo_bytes(height, width, index, fmt, alpha)
        for geometry in (QWEN2_5_VL, QWEN3_VL, NEMOTRON_OMNI):
            low, high = _pixel_limits(geometry, index, height, width)
            grid = geometry.image_grid(height, width, min_pixels=low, max_pixels=high)
            size = (grid.resized_height, grid.resized_width)
            decoded = decode_image(data, size=size, max_source_pixels=BIG, draft=False,
                                   resize=geometry.image_resize)
            case = (fmt, height, width, geometry.name, low, high)
            assert decoded.draft_scale == 1, case
            if geometry is NEMOTRON_OMNI:
                ours = geometry.pixel_rows(decoded.pixels[None], kind="image")
                expected = nemotron_reference(data, *size)
                assert ours.shape == expected.shape and np.array_equal(ours, expected), case
            else:
                ours = geometry.pixel_rows(decoded.pixels[None])
                references = qwen_references(data, geometry, low, high)
                fetched += len(references) - 1
                for expected in references:
                    assert ours.shape == expected.shape and np.array_equal(ours, expected), case
            if fmt == "JPEG":  # the fast decode of the same image takes the draft when it can
                drafted += decode_image(data, size=size, max_source_pixels=BIG).draft_scale > 1
    assert fetched > 200 and (fmt != "JPEG" or drafted > 20)


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def test_jpeg_draft_used_when_target_much_smaller():
    data = image_bytes(1600, 2000, fmt="JPEG")
    small = decode_image(data, size=(196, 224), max_source_pixels=BIG)
    assert small.draft_scale == 8 and small.pixels.shape == (196, 224, 3)
    half = decode_image(data, size=(784, 980), max_source_pixels=BIG)
    assert half.draft_scale == 2
    full = decode_image(data, size=(1596, 1988), max_source_pixels=BIG)
    assert full.draft_scale == 1 and full.pixels.dtype == np.uint8


def test_exif_orientation_applied_and_target_swapped():
    array = np.zeros((60, 100, 3), np.uint8)
    array[:, :50] = (255, 0, 0)  # left half red, right half blue
    array[:, 50:] = (0, 0, 255)
    image = Image.fromarray(array)
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise for display
    data = encode(image, "JPEG", exif=exif, quality=95)
    out = decode_image(data, size=(56, 112), max_source_pixels=BIG).pixels
    assert out.shape == (112, 56, 3)  # (h, w) of the stored frame, swapped by the rotation
    assert out[5, 28, 0] > 200 and out[-5, 28, 2] > 200  # red on top, blue below


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        (Image.new("CMYK", (28, 28), (0, 255, 255, 0)), (255, 0, 0)),
        (Image.new("LA", (28, 28), (0, 0)), (255, 255, 255)),
        (Image.new("RGBA", (28, 28), (0, 0, 255, 0)), (255, 255, 255)),
        (Image.new("RGBA", (28, 28), (0, 0, 255, 255)), (0, 0, 255)),
        (Image.new("1", (28, 28), 1), (255, 255, 255)),
    ],
    ids=["cmyk", "la-transparent", "rgba-transparent", "rgba-opaque", "bilevel"],
)
def test_modes_convert_to_rgb(image, expected):
    fmt = "JPEG" if image.mode == "CMYK" else "PNG"
    pixels = decode_image(encode(image, fmt), size=(28, 28), max_source_pixels=BIG).pixels
    assert pixels.shape == (28, 28, 3)
    np.testing.assert_allclose(pixels[14, 14], expected, atol=3)


def test_palette_transparency_and_16_bit():
    palette = Image.new("P", (28, 28), 1)
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    palette.info["transparency"] = 1
    out = decode_image(encode(palette, "PNG", transparency=1), size=(28, 28),
                       max_source_pixels=BIG).pixels
    assert tuple(out[0, 0]) == (255, 255, 255)  # fully transparent -> white
    deep = Image.fromarray(np.full((28, 28), 32768, np.uint16))
    assert deep.mode.startswith("I;16")
    out = decode_image(encode(deep, "PNG"), size=(28, 28), max_source_pixels=BIG).pixels
    assert tuple(out[3, 3]) == (128, 128, 128)


def test_source_pixel_cap_and_bad_bytes_are_skip_reasons():
    with pytest.raises(MediaError) as error:
        decode_image(image_bytes(200, 300), size=(28, 28), max_source_pixels=50_000,
                     name="k.img0.png")
    assert error.value.reason == "source_too_large" and "k.img0.png" in str(error.value)
    for data in (b"not an image", image_bytes(100, 100, fmt="JPEG")[:300]):
        with pytest.raises(MediaError) as error:
            decode_image(data, size=(28, 28), max_source_pixels=BIG)
        assert error.value.reason == "undecodable_image"
    with pytest.raises(MediaError) as error:
        decode_video_frames(b"\x00" * 100, [0, 1], size=(28, 28), max_source_pixels=BIG)
    assert error.value.reason == "undecodable_video"


@pytest.mark.parametrize("geometry", [QWEN2_5_VL, QWEN3_VL], ids=lambda g: g.name)
def test_pixel_values_match_hf_processor(geometry):
    for height, width in [(37, 91), (480, 640), (300, 45)]:
        data = image_bytes(height, width, seed=height)
        grid = geometry.image_grid(height, width)
        decoded = decode_image(data, size=(grid.resized_height, grid.resized_width),
                               max_source_pixels=BIG)
        ours = geometry.patchify(geometry.normalize(decoded.pixels.transpose(2, 0, 1)[None]))
        image = Image.open(io.BytesIO(data))
        expected = hf_image_processor(geometry)(images=[image], return_tensors="np")
        np.testing.assert_allclose(ours, expected["pixel_values"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("model", ["qwen2.5-vl", "qwen3-vl", "nemotron-omni"])
def test_task_encoder_image_decode_option(tokenizer, model, one_torch_thread):
    """``task_encoder.image_decode`` through the task encoder: ``exact`` (the default) gives the
    processor's pixel values for a page-like JPEG shrunk ~4x per side; ``fast`` differs there
    (JPEG draft); a bad value is a one-line config error."""
    data = photo_bytes(1100, 1500, 3, "JPEG")
    media = Media(part="img0.jpg", kind="image", format="jpeg", width=1500, height=1100,
                  bytes=len(data))
    sample = cook_conversation(crude("k", conversation(
        [("user", "<image> read it"), ("assistant", "ok")], [media]), {"img0.jpg": data}))
    settings = {"model": model, "max_pixels": 100_000, "min_pixels": 50_000}
    rows = {}
    for mode in ("exact", "fast", None):
        fields = dict(settings, **({"image_decode": mode} if mode else {}))
        config = TaskEncoderConfig.from_dict({k: str(v) for k, v in fields.items()})
        encoded = task_encoder_for(config, tokenizer=tokenizer).encode_sample(sample)
        rows[mode] = encoded.pixel_values.numpy()
        grid = encoded.image_grid_thw[0].tolist()
    geometry = TaskEncoderConfig(model=model).resolve().geometry
    if geometry is NEMOTRON_OMNI:
        expected = nemotron_reference(data, grid[1] * 16, grid[2] * 16)
    else:
        expected = qwen_references(data, geometry, 50_000, 100_000)[0]
    assert np.array_equal(rows["exact"], expected) and np.array_equal(rows[None], expected)
    assert not np.array_equal(rows["fast"], expected)
    with pytest.raises(ConfigError, match="image_decode: must be one of exact, fast, got 'draft'"):
        TaskEncoderConfig.from_dict({"model": model, "image_decode": "draft"})


def test_fast_decode_differs_from_exact_only_where_the_draft_applies():
    """A JPEG shrunk 4x per side: the fast decode (draft 4) is close to the exact one but not
    equal; a PNG, or a JPEG shrunk less than 2x, decodes the same both ways."""
    page = photo_bytes(1200, 1600, 0, "JPEG")
    fast = decode_image(page, size=(300, 400), max_source_pixels=BIG)
    exact = decode_image(page, size=(300, 400), max_source_pixels=BIG, draft=False)
    assert fast.draft_scale == 4 and exact.draft_scale == 1
    difference = np.abs(fast.pixels.astype(int) - exact.pixels.astype(int))
    assert 0 < difference.mean() < 8
    for data, size in [(photo_bytes(1200, 1600, 0, "PNG"), (300, 400)), (page, (700, 900))]:
        assert np.array_equal(decode_image(data, size=size, max_source_pixels=BIG).pixels,
                              decode_image(data, size=size, max_source_pixels=BIG,
                                           draft=False).pixels)
    with pytest.raises(ValueError, match="resize"):
        decode_image(page, size=(300, 400), max_source_pixels=BIG, resize="lanczos")


def test_fuzzed_exif_is_a_skip_never_a_traceback():
    """400 JPEGs with damaged EXIF (orientation kept, so exif_transpose runs on the rest): each
    decodes or raises MediaError(undecodable_image); struct.error & co. never escape."""
    import random

    pixels = np.random.default_rng(0).integers(0, 255, (24, 32, 3), np.uint8)
    exif = Image.Exif()
    exif[0x0112], exif[0x010F] = 6, "maker"
    exif[0x8769] = {0x9003: "2020:01:01 00:00:00", 0xA002: 32}
    exif[0x0132], exif[0x011A] = "2020:01:01", (72, 1)
    blob = exif.tobytes()
    rng = random.Random(0)
    outcomes = {"decoded": 0, "undecodable_image": 0}
    for _ in range(400):
        damaged = bytearray(blob)
        for _ in range(rng.randint(1, 12)):
            damaged[rng.randrange(8, len(damaged))] = rng.randrange(256)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", exif=bytes(damaged))
        try:
            decode_image(buf.getvalue(), size=(24, 32), max_source_pixels=BIG, name="k.jpg")
            outcomes["decoded"] += 1
        except MediaError as error:
            assert error.reason == "undecodable_image" and error.detail.startswith("k.jpg: ")
            outcomes["undecodable_image"] += 1
    assert sum(outcomes.values()) == 400 and outcomes["decoded"]


@pytest.mark.parametrize("banded", [False, True])
def test_float32_resize_equals_one_interpolate_call(banded, one_torch_thread):
    """Nemotron-Omni's float32 resize, one call or per channel with the horizontal pass in row
    bands (``resize.torch_resized``), is bit for bit the processor's one ``F.interpolate`` call:
    shrinking, enlarging, one side unchanged, heights below, at and across the band size."""
    rng = np.random.default_rng(5)
    for (height, width), target in [((300, 200), (96, 64)), ((128, 90), (256, 96)),
                                    ((257, 64), (112, 64)), ((40, 330), (40, 160)),
                                    ((513, 77), (1024, 32)), ((1, 9), (16, 16))]:
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        ours = torch_resized(pixels, *target, banded=banded)
        expected = nemotron_resize(pixels, *target)
        assert ours.shape == expected.shape and np.array_equal(ours, expected), (height, width)
