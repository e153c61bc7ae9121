"""Synthetic media for the lookalikes: images whose content answers the questions, and clips.

Owns rendering (coloured shapes, big words, infographic-like text pages), image encoding in the
formats and modes the converters must survive (JPEG, grayscale JPEG, PNG, palette PNG, RGBA PNG),
and video encoding with PyAV: H.264 (libx264, yuv420p) or MPEG-4 part 2 clips of one shape moving
in one direction, plus an audio-only mp4 (a container without a single video frame). Everything is
deterministic: x264 runs single-threaded with macroblock-tree rate control off (with it on, x264
output varied between runs on flat synthetic frames).
"""

from __future__ import annotations

import io
import random
from functools import lru_cache

import av
import numpy as np
from PIL import Image, ImageDraw, ImageFont

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 20),
    "purple": (140, 50, 170),
    "orange": (250, 140, 20),
}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = ("left", "right", "up", "down")
BACKGROUND = (235, 235, 235)


@lru_cache(maxsize=64)
def font(size: int) -> ImageFont.FreeTypeFont:
    """PIL's built-in font at `size` pixels (needs Pillow with FreeType)."""
    return ImageFont.load_default(size=size)


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], rgb):
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=rgb)
    elif shape == "square":
        draw.rectangle(box, fill=rgb)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=rgb)


def shapes_image(
    rng: random.Random, size: tuple[int, int], shape: str, colour: str, count: int = 1
) -> Image.Image:
    """Draw `count` non-overlapping shapes of one kind and colour on a light background.

    Shapes sit in distinct cells of a grid, so they never overlap and can be counted.
    """
    width, height = size
    image = Image.new("RGB", size, BACKGROUND)
    draw = ImageDraw.Draw(image)
    cols = max(1, int(np.ceil(np.sqrt(count * width / height))))
    rows = int(np.ceil(count / cols))
    cw, ch = width // cols, height // rows
    cells = rng.sample(range(cols * rows), count)
    for cell in cells:
        cx, cy = (cell % cols) * cw, (cell // cols) * ch
        pad = max(2, min(cw, ch) // 6)
        box = (cx + pad, cy + pad, cx + cw - pad, cy + ch - pad)
        _draw_shape(draw, shape, box, COLOURS[colour])
    return image


def word_image(text: str, size: tuple[int, int], colour: str = "blue") -> Image.Image:
    """A single word or number, large and centred."""
    image = Image.new("RGB", size, BACKGROUND)
    draw = ImageDraw.Draw(image)
    f = font(max(8, min(size[1] // 2, 2 * size[0] // max(1, len(text)))))
    draw.text((size[0] // 2, size[1] // 2), text, fill=COLOURS[colour], font=f, anchor="mm")
    return image


def text_page(size: tuple[int, int], lines: list[tuple[str, int]]) -> Image.Image:
    """An infographic-like page: text lines of given pixel sizes spread down the page.

    Args:
        size: (width, height) of the page.
        lines: (text, font size in pixels) from top to bottom; the first is drawn on a band.
    """
    width, height = size
    image = Image.new("RGB", size, (250, 248, 240))
    draw = ImageDraw.Draw(image)
    top = 2 * lines[0][1]
    step = (height - top) / len(lines)
    for k, (text, px) in enumerate(lines):
        y = top if k == 0 else int(top + step * (k + 0.3))
        if k == 0:
            draw.rectangle((0, y - px, width, y + px), fill=(40, 70, 140))
        fill = (255, 255, 255) if k == 0 else (20, 20, 20)
        draw.text((width // 20, y), text, fill=fill, font=font(px), anchor="lm")
        if k > 0:  # a bar under each fact, like a chart
            bar = int(width * (0.2 + 0.6 * ((k * 37) % 10) / 10))
            draw.rectangle((width // 20, y + px, bar, y + px + max(2, px // 3)), fill=(90, 160, 90))
    return image


def encode_image(image: Image.Image, fmt: str, *, quality: int = 80) -> bytes:
    """Encode to `fmt` in {"jpeg", "jpeg-gray", "png", "png-palette", "png-rgba"}."""
    buf = io.BytesIO()
    if fmt == "jpeg":
        image.convert("RGB").save(buf, "JPEG", quality=quality, optimize=True)
    elif fmt == "jpeg-gray":
        image.convert("L").save(buf, "JPEG", quality=quality, optimize=True)
    elif fmt == "png":
        image.convert("RGB").save(buf, "PNG")
    elif fmt == "png-palette":
        image.convert("RGB").quantize(colors=16, dither=Image.Dither.NONE).save(buf, "PNG")
    elif fmt == "png-rgba":
        rgba = image.convert("RGBA")
        rgba.putalpha(Image.new("L", image.size, 200))
        rgba.save(buf, "PNG")
    else:
        raise ValueError(f"encode_image: unknown fmt {fmt!r}")
    return buf.getvalue()


def _to_yuv420(rgb: np.ndarray) -> np.ndarray:
    """BT.601 limited-range RGB -> planar yuv420p array of shape (h*3/2, w)."""
    r, g, b = (rgb[..., i].astype(np.float32) for i in range(3))
    y = 0.257 * r + 0.504 * g + 0.098 * b + 16
    u = -0.148 * r - 0.291 * g + 0.439 * b + 128
    v = 0.439 * r - 0.368 * g - 0.071 * b + 128
    h, w = y.shape
    u = u.reshape(h // 2, 2, w // 2, 2).mean(axis=(1, 3))
    v = v.reshape(h // 2, 2, w // 2, 2).mean(axis=(1, 3))
    planes = np.concatenate([y.ravel(), u.ravel(), v.ravel()])
    return planes.round().clip(0, 255).astype(np.uint8).reshape(h * 3 // 2, w)


def _frames(direction: str, colour: str, size: tuple[int, int], n: int):
    """RGB frames of a square of side ~h/3 crossing the frame in `direction`."""
    w, h = size
    side = max(4, h // 3)
    for i in range(n):
        t = i / max(1, n - 1)
        x, y = (w - side) // 2, (h - side) // 2
        if direction in ("left", "right"):
            x = int((w - side) * (t if direction == "right" else 1 - t))
        else:
            y = int((h - side) * (t if direction == "down" else 1 - t))
        frame = np.empty((h, w, 3), np.uint8)
        frame[:] = (60, 60, 60)
        frame[y : y + side, x : x + side] = COLOURS[colour]
        yield frame


def moving_square_clip(
    direction: str,
    colour: str,
    *,
    size: tuple[int, int] = (96, 64),
    fps: int = 10,
    seconds: float = 2.0,
    codec: str = "h264",
    gop: int = 8,
) -> bytes:
    """Encode an mp4 of a `colour` square moving towards `direction`.

    Args:
        direction: One of `DIRECTIONS`.
        colour: A key of `COLOURS`.
        size: (width, height), both even (yuv420p).
        fps: Frame rate.
        seconds: Duration; the clip has round(fps * seconds) frames.
        codec: "h264" (libx264) or "mpeg4" (MPEG-4 part 2).
        gop: Keyframe interval in frames.

    Returns:
        The mp4 file bytes.
    """
    if size[0] % 2 or size[1] % 2:
        raise ValueError(f"moving_square_clip: size must be even for yuv420p, got {size}")
    options = {}
    if codec == "h264":
        options = {"preset": "veryfast", "threads": "1",
                   "x264-params": f"mbtree=0:keyint={gop}:min-keyint={gop}:scenecut=0"}
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264" if codec == "h264" else codec, rate=fps,
                                      options=options)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.codec_context.gop_size = gop
        for i, rgb in enumerate(_frames(direction, colour, size, round(fps * seconds))):
            frame = av.VideoFrame.from_ndarray(_to_yuv420(rgb), format="yuv420p")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def moving_square_frames(direction: str, colour: str, *, size: tuple[int, int] = (96, 64),
                         n: int = 8, quality: int = 85) -> list[bytes]:
    """The frames of `moving_square_clip` as JPEG files (a frame-folder video)."""
    out = []
    for rgb in _frames(direction, colour, size, n):
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, "JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


def audio_only_mp4(seconds: float = 0.5, rate: int = 16000) -> bytes:
    """A valid mp4 holding one silent AAC track and no video stream (zero video frames)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("aac", rate=rate)
        samples = np.zeros((1, int(rate * seconds)), np.float32)
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate, frame.pts = rate, 0
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def encode_h264(frames, *, width: int, height: int, fps: int, options: dict[str, str]) -> bytes:
    """Encode RGB frames (H, W, 3) uint8 into an H.264 mp4 (libx264, yuv420p) with `options`."""
    from fractions import Fraction

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = dict(options)
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def photo_jpeg(rng: np.random.Generator, width: int, height: int) -> bytes:
    """A photo-like JPEG (smooth colour field + grain, quality 90): realistic size and cost."""
    base = rng.integers(0, 255, (height // 32 + 2, width // 32 + 2, 3), dtype=np.uint8)
    image = Image.fromarray(base).resize((width, height), Image.BICUBIC)
    array = np.asarray(image, dtype=np.int16) + rng.integers(-12, 12, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(array.clip(0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()
