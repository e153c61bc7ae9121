"""Media decoding at the planned size: images through PIL, the chosen video frames through PyAV.

This module owns turning stored media bytes into uint8 RGB pixels of exactly the planned size:

- images: the JPEG DCT is decoded at a reduced scale (``Image.draft``) when the target is at most
  half the source per side; EXIF orientation is applied; CMYK, palette, 1-bit, 16-bit and float
  images are converted to 8-bit RGB; alpha is composited on white; sources above
  ``max_source_pixels`` are refused before decoding (decompression bombs);
- videos: only the chosen frames are decoded: seek to the keyframe before the next needed frame
  when it lies beyond the current position, then decode forward; never the whole clip.

Any failure raises ``MediaError`` with a skip reason (``MEDIA_SKIP_REASONS``), never anything else.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

#: Skip reasons raised by this module.
MEDIA_SKIP_REASONS = (
    "missing_media", "source_too_large", "undecodable_image", "undecodable_video",
)
_ROTATING = (5, 6, 7, 8)  #: EXIF orientations that swap width and height
_EXIF_ORIENTATION = 0x0112


class MediaError(Exception):
    """A media item cannot be used; ``reason`` is the skip counter suffix."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  #: one of MEDIA_SKIP_REASONS
        self.detail = detail


@dataclass(slots=True, kw_only=True)
class DecodedImage:
    """One image at its planned size (after EXIF orientation)."""

    pixels: np.ndarray  #: (H, W, 3) uint8 RGB
    draft_scale: int  #: 1, 2, 4 or 8: the JPEG DCT reduction used (1 = full decode)


@dataclass(slots=True, kw_only=True)
class DecodedVideo:
    """The chosen frames of one video at the planned size."""

    frames: np.ndarray  #: (T, H, W, 3) uint8 RGB, T = number of requested frames
    decoded_frames: int  #: frames the codec produced (the cost; >= T, far below the clip)
    seeks: int  #: container seeks performed


def _to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB with alpha composited on white; 16-bit / float scaled, palette expanded."""
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        array = np.asarray(image).astype(np.float64)
        peak = 255.0 if image.mode == "F" or array.max(initial=0) <= 255 else 65535.0
        array = np.clip(np.round(array * 255.0 / peak), 0, 255).astype(np.uint8)
        image = Image.fromarray(array, "L")
    if image.mode in ("LA", "La", "PA", "RGBa", "RGBA"):
        image = image.convert("RGBA")
        canvas = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(canvas, image).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def decode_image(
    data: bytes, *, size: tuple[int, int], max_source_pixels: int, name: str = "image"
) -> DecodedImage:
    """Decode an image to RGB uint8 of ``size`` (height, width) in the oriented frame.

    When EXIF orientation swaps the sides, the target is swapped too (``smart_resize`` is symmetric,
    so the token count the planner computed from the stored size is unchanged).

    Args:
        data: the stored bytes.
        size: planned (height, width) for the stored (un-rotated) orientation.
        max_source_pixels: refuse sources with more stored pixels than this.
        name: sample key and part, for messages.

    Raises:
        MediaError: ``source_too_large`` or ``undecodable_image``.
    """
    height, width = size
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
        source_w, source_h = image.size
        if source_w * source_h > max_source_pixels:
            raise MediaError("source_too_large", f"{name}: {source_w}x{source_h} pixels "
                             f"> max_source_pixels {max_source_pixels}")
        orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
        scale = 1
        if image.format == "JPEG":
            image.draft(None, (width, height))  # PIL keeps the result >= the requested size
            scale = max(1, source_w // image.size[0])
        image = _to_rgb(ImageOps.exif_transpose(image) if orientation != 1 else image)
        if orientation in _ROTATING:
            height, width = width, height
        if image.size != (width, height):
            image = image.resize((width, height), Image.BICUBIC)
        return DecodedImage(pixels=np.asarray(image, dtype=np.uint8), draft_scale=scale)
    except MediaError:
        raise
    except (Image.DecompressionBombError, OSError, SyntaxError, ValueError, TypeError,
            EOFError, IndexError, KeyError, MemoryError) as error:
        raise MediaError("undecodable_image", f"{name}: {type(error).__name__}: {error}") from None


def decode_video_frames(
    data: bytes,
    frame_indices: Sequence[int],
    *,
    size: tuple[int, int],
    max_source_pixels: int,
    name: str = "video",
) -> DecodedVideo:
    """Decode only the frames ``frame_indices`` (ascending) of a video, resized to ``size``.

    Frame ``i`` is the one shown at ``start + i / fps``. One demux pass (no decoding) lists the
    keyframes; for each needed frame the container seeks to the keyframe before it unless the
    decoder is already at or past that keyframe, then frames are decoded forward until it is
    reached. A clip that ends early repeats its last decoded frame for the missing picks.

    Raises:
        MediaError: ``source_too_large`` or ``undecodable_video``.
    """
    import av

    height, width = size
    picks = sorted(set(int(i) for i in frame_indices))
    if list(frame_indices) != picks or not picks:
        raise MediaError("undecodable_video", f"{name}: frame indices must ascend, got "
                         f"{list(frame_indices)[:8]}")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            if stream.width * stream.height > max_source_pixels:
                raise MediaError("source_too_large", f"{name}: {stream.width}x{stream.height} "
                                 f"pixels > max_source_pixels {max_source_pixels}")
            frames, decoded, seeks = _read_frames(container, stream, picks, (width, height))
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError, IndexError, ZeroDivisionError) as error:
        raise MediaError("undecodable_video", f"{name}: {type(error).__name__}: {error}") from None
    if not frames:
        raise MediaError("undecodable_video", f"{name}: no frame decoded")
    frames += [frames[-1]] * (len(picks) - len(frames))
    return DecodedVideo(frames=np.stack(frames), decoded_frames=decoded, seeks=seeks)


def _keyframes(container, stream, frame_of) -> list[tuple[int, int]]:
    """(frame index, pts) of every keyframe, from one demux pass (packets only, no decoding)."""
    keys = sorted({(frame_of(p.pts), p.pts) for p in container.demux(stream)
                   if p.is_keyframe and p.pts is not None})
    return keys or [(0, stream.start_time or 0)]


def _read_frames(container, stream, picks, size):
    """Decode from the keyframe before each pick unless the decoder is already past it."""
    rate = stream.average_rate or stream.guessed_rate
    if not rate:
        raise ValueError("no frame rate")
    start = stream.start_time or 0
    frame_of = lambda pts: round(float((pts - start) * stream.time_base * rate))  # noqa: E731
    keys = _keyframes(container, stream, frame_of)
    out, decoded, seeks, position, iterator = [], 0, 0, -1, None
    for pick in picks:
        key_index, key_pts = max((k for k in keys if k[0] <= pick), default=keys[0])
        if iterator is None or key_index > position:
            container.seek(key_pts, stream=stream, backward=True, any_frame=False)
            iterator, seeks = container.decode(stream), seeks + 1
        frame = None
        for frame in iterator:
            decoded += 1
            position = frame_of(frame.pts if frame.pts is not None else start)
            if position >= pick:
                break
        else:
            iterator = frame = None
        if frame is None:
            break
        image = frame.to_image()
        if image.size != size:
            image = image.resize(size, Image.BICUBIC)
        out.append(np.asarray(image, dtype=np.uint8))
    return out, decoded, seeks
