"""Media decoding at the planned size: images through PIL, the chosen video frames through PyAV.

This module owns turning stored media bytes into RGB pixels of exactly the planned size:

- images, two ways (``TaskEncoderConfig.image_decode``, docs/benchmarks_task_encoder.md):
  ``exact`` decodes the whole image and resizes it as the model's transformers processor does,
  so the pixel values equal the processor's: PIL bicubic on uint8 (Qwen-VL: qwen-vl-utils'
  ``fetch_image`` and ``Qwen2VLImageProcessorPil``; InternVL's tiling) or torch's antialiased
  bicubic in float32, unclamped (Nemotron-Omni's image processor: torchvision ``resize`` on a
  float32 tensor = ``F.interpolate(..., "bicubic", antialias=True)``); ``fast`` decodes a JPEG at
  a reduced DCT scale (``Image.draft``) when the target is at most half the source per side, then
  PIL bicubic on uint8 (cheaper, not the processor's pixels). Both apply EXIF orientation; convert
  CMYK, palette, 1-bit, 16-bit and float images to 8-bit RGB; composite alpha on white (as
  transformers' ``convert_to_rgb``); refuse sources above ``max_source_pixels`` before decoding
  (decompression bombs);
- frame-sequence videos (a tar of frame images, docs/format.md): the chosen frames only, each
  decoded whole and resized as a video frame is;
- videos: only what the chosen frames need is decoded: seek to the keyframe before the next
  needed frame when a keyframe surely lies between it and the current position (spacing learned
  while decoding; no pass over the clip to list keyframes), else decode forward; frames before a
  pick that no other frame references are skipped by the codec; never the whole clip.

Any failure raises ``MediaError`` with a skip reason (``MEDIA_SKIP_REASONS``), never anything else.
"""

from __future__ import annotations

import io
import math
import struct
import tarfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from PIL import Image, ImageOps

from contract.errors import MediaError
from energon_tasks.sample_format import is_frame_sequence, unpack_frames

#: image resize filters: "pil" = PIL bicubic on uint8, "torch" = torch antialiased bicubic in
#: float32 (``decode_image``'s ``resize``)
IMAGE_RESIZES = ("pil", "torch")
#: Skip reasons raised by this module.
MEDIA_SKIP_REASONS = (
    "missing_media", "source_too_large", "undecodable_image", "undecodable_video",
)
_ROTATING = (5, 6, 7, 8)  #: EXIF orientations that swap width and height
_EXIF_ORIENTATION = 0x0112


@dataclass(slots=True, kw_only=True)
class DecodedImage:
    """One image at its planned size (after EXIF orientation)."""

    pixels: np.ndarray  #: (H, W, 3) RGB: uint8 (resize "pil"), float32 0..255 unclamped ("torch")
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


#: What PIL raises for damaged bytes, EXIF included (its EXIF parser and `exif_transpose` raise
#: struct.error, ArithmeticError and RecursionError besides the usual ones): a counted skip.
_IMAGE_ERRORS = (Image.DecompressionBombError, OSError, SyntaxError, ValueError, TypeError,
                 EOFError, IndexError, KeyError, MemoryError, struct.error, ArithmeticError,
                 RecursionError, AttributeError)


def decode_image(
    data: bytes, *, size: tuple[int, int], max_source_pixels: int, name: str = "image",
    draft: bool = True, resize: str = "pil",
) -> DecodedImage:
    """Decode an image to RGB of ``size`` (height, width) in the oriented frame.

    When EXIF orientation swaps the sides, the target is swapped too (``smart_resize`` is symmetric,
    so the token count the planner computed from the stored size is unchanged).

    Args:
        data: the stored bytes.
        size: planned (height, width) for the stored (un-rotated) orientation.
        max_source_pixels: refuse sources with more stored pixels than this.
        name: sample key and part, for messages.
        draft: decode a JPEG at a reduced DCT scale when the target allows it (``fast``); False
            decodes every source pixel (``exact``).
        resize: "pil" (bicubic on uint8 -> uint8) or "torch" (antialiased bicubic on float32 ->
            float32, values unclamped, as the Nemotron-Omni image processor).

    Raises:
        MediaError: ``source_too_large`` or ``undecodable_image``.
    """
    if resize not in IMAGE_RESIZES:
        raise ValueError(f"resize {resize!r}: expected one of {IMAGE_RESIZES}")
    height, width = size
    try:
        with warnings.catch_warnings():  # PIL warns per damaged EXIF tag: the skip says it
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            warnings.simplefilter("ignore", UserWarning)
            return _decode_image(data, width, height, max_source_pixels, name, draft, resize)
    except MediaError:
        raise
    except _IMAGE_ERRORS as error:
        raise MediaError("undecodable_image", f"{name}: {type(error).__name__}: {error}") from None


def _decode_image(data: bytes, width: int, height: int, max_source_pixels: int, name: str,
                  draft: bool, resize: str) -> DecodedImage:
    image = Image.open(io.BytesIO(data))
    source_w, source_h = image.size
    if source_w * source_h > max_source_pixels:
        raise MediaError("source_too_large", f"{name}: {source_w}x{source_h} pixels "
                         f"> max_source_pixels {max_source_pixels}")
    orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
    scale = 1
    if draft and image.format == "JPEG":
        image.draft(None, (width, height))  # PIL keeps the result >= the requested size
        scale = max(1, source_w // image.size[0])
    image = _to_rgb(ImageOps.exif_transpose(image) if orientation != 1 else image)
    if orientation in _ROTATING:
        height, width = width, height
    return DecodedImage(pixels=_resized(image, width, height, resize), draft_scale=scale)


def _resized(image: Image.Image, width: int, height: int, resize: str) -> np.ndarray:
    """(height, width, 3) pixels of an RGB image: PIL bicubic (uint8), or torch's antialiased
    bicubic in float32 (``_torch_resized``; the Nemotron-Omni processor resizes in float32 to
    keep the overshoot)."""
    if resize == "pil":
        if image.size != (width, height):
            image = image.resize((width, height), Image.BICUBIC)
        return np.asarray(image, dtype=np.uint8)
    pixels = np.asarray(image, dtype=np.uint8)
    if image.size == (width, height):
        return pixels.astype(np.float32)
    return _torch_resized(pixels, height, width)


#: source rows per band of the horizontal pass (a band's float rows stay in the cache)
_BAND_ROWS = 128
#: sources from this many pixels are resized band by band (below, one call is as cheap)
_BANDED_FROM_PIXELS = 2_000_000


def _torch_resized(pixels: np.ndarray, height: int, width: int,
                   banded: bool | None = None) -> np.ndarray:
    """(height, width, 3) float32 of uint8 (H, W, 3) pixels: bit for bit
    ``F.interpolate(float32 (1, 3, H, W), (height, width), "bicubic", antialias=True)``, what
    torchvision's ``resize`` runs on a float32 tensor.

    Large sources (``banded``; default: from ``_BANDED_FROM_PIXELS``) cost about half as much
    on one core this way: torch's antialiased kernel is separable, the horizontal pass (weights
    from the widths only) then the vertical one (weights from the heights only), each output
    value a sum over one row or one column. So each channel is resized alone, its horizontal
    pass over bands of ``_BAND_ROWS`` source rows (converted to float32 band by band, never the
    whole image) and its vertical pass over the whole plane: the same sums in the same order,
    on data that stays in the cache. The result is then a view of (3, height, width) planes.
    """
    source_h, source_w = pixels.shape[:2]
    interpolate = torch.nn.functional.interpolate
    options = {"mode": "bicubic", "align_corners": False, "antialias": True}
    if not (source_h * source_w >= _BANDED_FROM_PIXELS if banded is None else banded):
        planes = np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)
        tensor = torch.from_numpy(planes)[None]
        return interpolate(tensor, size=(height, width), **options)[0].permute(1, 2, 0).numpy()
    out = np.empty((3, height, width), dtype=np.float32)
    rows = torch.empty((1, 1, source_h, width), dtype=torch.float32)
    for channel in range(3):
        if source_w == width:
            rows[0, 0] = torch.from_numpy(pixels[:, :, channel].astype(np.float32))
        else:
            for first in range(0, source_h, _BAND_ROWS):
                last = min(first + _BAND_ROWS, source_h)
                band = torch.from_numpy(pixels[first:last, :, channel].astype(np.float32))
                rows[:, :, first:last] = interpolate(band[None, None], size=(last - first, width),
                                                     **options)
        plane = torch.from_numpy(out[channel])
        if source_h == height:
            plane.copy_(rows[0, 0])
        else:
            plane.copy_(interpolate(rows, size=(height, width), **options)[0, 0])
    return out.transpose(1, 2, 0)


def decode_video_frames(
    data: bytes,
    frame_indices: Sequence[int],
    *,
    size: tuple[int, int],
    max_source_pixels: int,
    name: str = "video",
    thread_type: str | None = None,
) -> DecodedVideo:
    """Decode only the frames ``frame_indices`` (ascending) of a video, resized to ``size``.

    Frame ``i`` is the one shown at ``start + i / fps``. For each needed frame the reader either
    decodes forward or, when a keyframe surely lies between (see ``_read_frames``), seeks to the
    keyframe before it; non-reference frames before a pick are skipped by the codec (the kept
    frames are bit-identical to decoding every frame). A clip that ends early repeats its last
    decoded frame for the missing picks.

    Args:
        thread_type: PyAV codec threading ("SLICE", "FRAME", "AUTO"); None keeps PyAV's default
            (slice threads). Loader workers already fill the cores, so the default stays.

    Raises:
        MediaError: ``source_too_large`` or ``undecodable_video``.
    """
    import av

    height, width = size
    picks = sorted(set(int(i) for i in frame_indices))
    if list(frame_indices) != picks or not picks:
        raise MediaError("undecodable_video", f"{name}: frame indices must ascend, got "
                         f"{list(frame_indices)[:8]}")
    if is_frame_sequence(data):
        return _frame_sequence(data, picks, (width, height), max_source_pixels, name)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            if thread_type is not None:
                stream.thread_type = thread_type
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


def _frame_sequence(data: bytes, picks: list[int], size: tuple[int, int], max_source_pixels: int,
                    name: str) -> DecodedVideo:
    """The chosen frames of a frame-sequence video (a tar of frame images, sample_format): each
    image decoded whole, converted to RGB and resized as a decoded video frame is."""
    try:
        files = unpack_frames(data)
        frames = []
        for pick in (p for p in picks if p < len(files)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(files[pick]))
            if image.width * image.height > max_source_pixels:
                raise MediaError("source_too_large", f"{name}: {image.width}x{image.height} "
                                 f"pixels > max_source_pixels {max_source_pixels}")
            rgb = np.asarray(_to_rgb(image), dtype=np.uint8)
            if (rgb.shape[1], rgb.shape[0]) != size:
                rgb = np.asarray(Image.fromarray(rgb).resize(size, Image.BICUBIC), np.uint8)
            frames.append(rgb)
    except MediaError:
        raise
    except (tarfile.TarError, OSError, SyntaxError, ValueError, Image.DecompressionBombError
            ) as error:
        raise MediaError("undecodable_video", f"{name}: {type(error).__name__}: {error}") from None
    if not frames:
        raise MediaError("undecodable_video", f"{name}: no frame in the sequence")
    frames += [frames[-1]] * (len(picks) - len(frames))
    return DecodedVideo(frames=np.stack(frames), decoded_frames=len(frames), seeks=0)


class _FrameReader:
    """Decoded frames of one video stream in display order, with seeking and frame skipping.

    Frames are fed packet by packet: while the packet's timestamp lies before ``skip_before`` the
    codec skips non-reference frames (``skip_frame = NONREF``: frames no other frame is predicted
    from, so the frames kept decode bit for bit as without skipping and are never wanted).
    """

    def __init__(self, container, stream) -> None:
        self.container, self.stream, self.codec = container, stream, stream.codec_context
        self.skip_before: int | None = None  #: pts under which non-reference frames are skipped
        self.frames = self._frames()

    def _frames(self):
        for packet in self.container.demux(self.stream):
            skip = (self.skip_before is not None and packet.pts is not None
                    and packet.pts < self.skip_before)
            self.codec.skip_frame = "NONREF" if skip else "DEFAULT"
            yield from self.codec.decode(packet)

    def seek(self, pts: int) -> None:
        """Restart at the keyframe at or before ``pts`` (the codec is flushed by PyAV)."""
        self.container.seek(pts, stream=self.stream, backward=True, any_frame=False)
        self.frames = self._frames()


def _read_frames(container, stream, picks, size):
    """Decode forward to each pick; seek instead when a keyframe surely lies in between.

    No keyframe list is built (that would cost a demux pass over the whole clip): the decoder
    learns the keyframe spacing from the frames it produces (``spacing``: the longest run of
    frames seen after a keyframe). A pick more than ``spacing`` frames ahead has a keyframe
    before it that is after the current position, so seeking there decodes less than going on;
    a nearer pick is reached by decoding forward. Before the spacing is known the reader seeks
    (at worst it lands on the keyframe it already started from, and learns from it).
    """
    rate = stream.average_rate or stream.guessed_rate
    if not rate:
        raise ValueError("no frame rate")
    start = stream.start_time or 0
    per_frame = 1 / (rate * stream.time_base)  # pts units per frame (a Fraction)
    frame_of = lambda pts: round(float((pts - start) / per_frame))  # noqa: E731
    reader = _FrameReader(container, stream)
    out, decoded, seeks = [], 0, 0
    position, last_key, spacing = -1, None, 0
    for pick in picks:
        # frames mapping to `pick` have pts in [pick - 1/2, pick + 1/2) frames
        first_pts = start + math.ceil((pick - Fraction(1, 2)) * per_frame)
        reader.skip_before = first_pts
        if position < 0 or pick - position > spacing:
            target = start + math.ceil((pick + Fraction(1, 2)) * per_frame) - 1
            for _ in range(8):  # a container whose seek lands after the pick: step back
                reader.seek(target)
                seeks += 1
                frame = next(reader.frames, None)
                if frame is None:
                    break
                decoded += 1
                position = frame_of(frame.pts if frame.pts is not None else start)
                last_key = position if frame.key_frame else None
                if position <= pick or target <= start:
                    break
                target = max(start, min(target, frame.pts) - 1)
            if frame is None:
                break
        else:
            frame = None
        if frame is None or position < pick:
            for frame in reader.frames:
                decoded += 1
                position = frame_of(frame.pts if frame.pts is not None else start)
                if frame.key_frame:
                    last_key = position
                elif last_key is not None:
                    spacing = max(spacing, position - last_key)
                if position >= pick:
                    break
            else:
                frame = None
        if frame is None:
            break
        out.append(video_frame_pixels(frame, size))
    return out, decoded, seeks


def video_frame_pixels(frame, size: tuple[int, int]) -> np.ndarray:
    """(H, W, 3) uint8 RGB of a decoded PyAV frame at ``size`` (width, height).

    FFmpeg's rgb24 conversion (the same pixels as ``frame.to_image()``, whose Python row copy
    costs ~10x more), then PIL bicubic when the size differs, as the image path.
    """
    rgb = frame.to_ndarray(format="rgb24")
    if (rgb.shape[1], rgb.shape[0]) == tuple(size):
        return rgb
    return np.asarray(Image.fromarray(rgb).resize(size, Image.BICUBIC), dtype=np.uint8)
