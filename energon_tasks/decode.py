"""Image decoding at the planned size through PIL (videos: ``energon_tasks.video_decode``).

This module owns turning stored image bytes into RGB pixels of exactly the planned size:

- images, two ways (``TaskEncoderConfig.image_decode``, docs/benchmarks_task_encoder.md):
  ``exact`` decodes the whole image and resizes it as the model's transformers processor does,
  so the pixel values equal the processor's: PIL's bicubic on uint8 (``resize.resize_rgb``: PIL's
  arithmetic, vectorised; Qwen-VL: qwen-vl-utils' ``fetch_image`` and
  ``Qwen2VLImageProcessorPil``; InternVL's tiling) or torch's antialiased
  bicubic in float32, unclamped (Nemotron-Omni's image processor: torchvision ``resize`` on a
  float32 tensor = ``F.interpolate(..., "bicubic", antialias=True)``); ``fast`` decodes a JPEG at
  a reduced DCT scale (``Image.draft``) when the target is at most half the source per side, then
  PIL bicubic on uint8 (cheaper, not the processor's pixels). Both apply EXIF orientation; convert
  CMYK, palette, 1-bit, 16-bit and float images to 8-bit RGB; composite alpha on white (as
  transformers' ``convert_to_rgb``); refuse sources above ``max_source_pixels`` before decoding
  (decompression bombs).

Any failure raises ``MediaError`` with a skip reason (``MEDIA_SKIP_REASONS``), never anything else.
"""

from __future__ import annotations

import io
import struct
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from contract.errors import MediaError
from energon_tasks.resize import resize_rgb, resize_rgb_float

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
            with pil_in_one_block():
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


#: PIL allocates an image of up to this many bytes in one block while ``decode_image`` runs, so
#: that ``pil_pixels`` can read its rows in place (PIL's default: 16 MiB blocks, rows split over
#: them); larger images are copied
_ONE_BLOCK_BYTES = 1 << 30


@contextmanager
def pil_in_one_block():
    """PIL's allocations in one block each, for the duration: PIL's arena setting is per
    process, and its blocks are not cached by default, so it changes only how images are cut
    into allocations."""
    before = Image.core.get_block_size()
    Image.core.set_block_size(_ONE_BLOCK_BYTES)
    try:
        yield
    finally:
        Image.core.set_block_size(before)


def pil_pixels(image: Image.Image) -> np.ndarray:
    """(H, W, 3) uint8 pixels of an RGB image: a view of PIL's own memory (4 bytes a pixel, read
    through its Arrow export: Pillow >= 11.2, an image in one block) where it can be had, else
    ``np.asarray``'s copy (the RGBX to RGB copy of a 10 MP page costs ~12 ms)."""
    if image.mode == "RGB" and hasattr(image, "__arrow_c_array__"):
        try:
            import pyarrow as pa  # a dependency (datasets needs it too); imported on first use
        except ImportError:
            return np.asarray(image, dtype=np.uint8)
        try:
            values = pa.array(image).values  # fixed_size_list<uint8>[4] per pixel
        except (ValueError, TypeError, AttributeError, pa.ArrowException):
            values = None  # rows not in one block (PIL says so), another layout: the copy below
        if (values is not None and pa.types.is_uint8(values.type)
                and len(values) == 4 * image.width * image.height):
            flat = np.frombuffer(values.buffers()[1], np.uint8, len(values), values.offset)
            return flat.reshape(image.height, image.width, 4)[..., :3]
    return np.asarray(image, dtype=np.uint8)


def _resized(image: Image.Image, width: int, height: int, resize: str) -> np.ndarray:
    """(height, width, 3) pixels of an RGB image: PIL's bicubic (uint8, ``resize.resize_rgb``),
    or torch's antialiased bicubic in float32 (``resize.resize_rgb_float``; the Nemotron-Omni
    processor resizes in float32 to keep the overshoot)."""
    pixels = pil_pixels(image)
    if resize == "torch":
        return resize_rgb_float(pixels, width, height)
    return pixels if image.size == (width, height) else resize_rgb(pixels, width, height)

