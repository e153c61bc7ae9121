"""Image and video decoding at the planned size: draft, EXIF, modes, caps, bad media, frames."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from energon_tasks.decode import MediaError, decode_image, decode_video_frames
from energon_tasks.geometry import QWEN2_5_VL, QWEN3_VL
from tests.energon_tasks.conftest import b_frame_video_bytes, image_bytes, video_bytes
from tests.energon_tasks.test_geometry import hf_image_processor

BIG = 10**9


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


def test_video_decodes_only_the_chosen_frames():
    data = video_bytes(120, fps=30, gop=10)
    picks = [0, 40, 80, 119]
    video = decode_video_frames(data, picks, size=(28, 56), max_source_pixels=BIG)
    assert video.frames.shape == (4, 28, 56, 3)
    red = video.frames[:, 14, 28, 0].astype(int)
    np.testing.assert_allclose(red, [2 * i for i in picks], atol=4)
    assert video.decoded_frames <= 1 + 1 + 1 + 10  # from the keyframe before each pick only
    assert video.seeks >= 2
    dense = decode_video_frames(data, list(range(0, 120, 2)), size=(28, 56),
                                max_source_pixels=BIG)
    assert dense.decoded_frames <= 120
    np.testing.assert_allclose(dense.frames[:, 14, 28, 0].astype(int),
                               list(range(0, 240, 4)), atol=4)


@pytest.fixture(scope="module")
def b_frame_clip():
    """150 frames at 30 fps, keyframe every 30, B-frames; and every frame decoded by PyAV."""
    import av

    data = b_frame_video_bytes(150, gop=30)
    with av.open(io.BytesIO(data)) as container:
        every = [frame.to_image() for frame in container.decode(video=0)]
        packets = container.streams.video[0].frames
    assert len(every) == packets == 150
    return data, every


@pytest.mark.parametrize("picks", [
    [0, 37, 74, 112, 149],  # sparse: one seek per pick
    list(range(1, 150, 3)),  # dense: decode forward once the keyframe spacing is known
    [29, 30, 31, 59, 60, 89, 119, 120],  # around keyframes
    [5, 6, 140],
])
def test_video_frames_identical_to_decoding_every_frame(b_frame_clip, picks):
    data, every = b_frame_clip
    size = (56, 84)
    video = decode_video_frames(data, picks, size=size, max_source_pixels=BIG)
    expected = [np.asarray(every[i].resize(size[::-1], Image.BICUBIC)) for i in picks]
    assert np.array_equal(video.frames, np.stack(expected))
    from_keyframes, position = 0, -1  # frames a decoder restarting at keyframes needs
    for pick in picks:
        key = pick // 30 * 30  # keyframe every 30 frames
        from_keyframes += pick - key + 1 if key > position else pick - position
        position = pick
    assert video.decoded_frames <= from_keyframes
    if len(picks) > 40:
        assert video.seeks <= 3  # forward decoding, not a seek per pick
        assert video.decoded_frames < 150


def test_video_skips_non_reference_frames_before_a_pick(b_frame_clip):
    data, _ = b_frame_clip
    video = decode_video_frames(data, [29, 59, 89], size=(56, 84), max_source_pixels=BIG)
    # each pick is the last frame of its 30-frame GOP: 30 frames from its keyframe without
    # skipping; the B-frames nothing references are not decoded
    assert video.seeks == 3 and video.decoded_frames < 3 * 30 * 0.8
