"""PIL's bicubic resize of RGB uint8 pixels, bit for bit, in a vectorised kernel.

This module owns the one uint8 resize of the exact paths: images for Qwen-VL and tiled
Nemotron-Omni (``decode.decode_image``), video frames (``video_decode``): ``resize_rgb``.

- **native** (``energon_tasks._resample``, C, built by ``make install``; an AVX2 clone on x86-64):
  Pillow's own arithmetic (the same double-precision weights rounded to 22-bit fixed point, int32
  sums, uint8 between the passes), vectorised over the values that share weights; measured 1.8-3x
  PIL's ``Image.resize`` per core (docs/benchmarks.md, "Exact resize");
- **which pass first** is Pillow's rule, and Pillow 13 changed it (the vertical pass first when
  the height shrinks by more than twice what the width does); the uint8 rounding between passes
  makes the order visible in the pixels;
- **checked before use**: the first call resizes a few images of sizes that cover both orders,
  enlarging, shrinking, single rows and columns and steep ratios, with the kernel under each
  known rule and with the installed Pillow; the kernel is used with the rule whose pixels are all
  Pillow's, and not at all when none is (``kernel()`` says which and why);
- **without the compiled module** (no C compiler at install) PIL resizes: the same pixels.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

try:
    from energon_tasks._resample import bicubic as _bicubic
except ImportError as error:  # built at install; optional (pyproject.toml)
    _bicubic, _MISSING = None, f"not built ({error})"
else:
    _MISSING = ""


def _vertical_first_pillow13(height: int, width: int, new_height: int, new_width: int) -> bool:
    shrink = height - new_height
    return shrink > 0 and shrink > (width - new_width) * 2


def _horizontal_first(height: int, width: int, new_height: int, new_width: int) -> bool:
    return False


#: Pillow's pass-order rules, newest first: (name, vertical pass first?)
_ORDER_RULES = (("pillow>=13", _vertical_first_pillow13), ("pillow<13", _horizontal_first))

#: (source height, width) -> (target height, width) the check resizes: both pass orders
#: (a steep height shrink with the width kept or grown, and the reverse), both enlarged, a slight
#: shrink (video frames), one row / column in and out, a steep ratio, a side kept
_CHECK_SIZES = (((97, 61), (13, 80)), ((60, 90), (20, 89)), ((61, 97), (80, 13)),
                ((23, 31), (70, 57)), ((90, 160), (84, 154)), ((1, 40), (3, 17)), ((40, 1), (9, 1)),
                ((300, 11), (7, 29)), ((50, 50), (50, 33)), ((50, 50), (17, 50)),
                ((64, 48), (64, 48)))

_kernel: tuple | None = None  # (rule or None, what kernel() says)


def _pil(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    return np.asarray(Image.fromarray(pixels).resize((width, height), Image.BICUBIC), np.uint8)


def _native(pixels: np.ndarray, width: int, height: int, rule, out: np.ndarray | None
            ) -> np.ndarray:
    if out is None:
        out = np.empty((height, width, 3), np.uint8)
    _bicubic(pixels, out, rule(*pixels.shape[:2], height, width))
    return out


def _checked_rule() -> tuple:
    """(the order rule whose pixels are the installed Pillow's, or None; what kernel() says)."""
    if _bicubic is None:
        return None, f"PIL (the native kernel is {_MISSING})"
    rng = np.random.default_rng(0)
    cases = []
    for (height, width), (new_height, new_width) in _CHECK_SIZES:
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        pixels[height // 2:] = 255 * (pixels[height // 2:] > 127)  # hard edges: clipped overshoot
        cases.append((pixels, new_width, new_height, _pil(pixels, new_width, new_height)))
    for name, rule in _ORDER_RULES:
        if all(np.array_equal(_native(p, w, h, rule, None), expected)
               for p, w, h, expected in cases):
            return rule, f"native ({name} pass order, checked against Pillow {Image.__version__})"
    return None, (f"PIL (the native kernel's pixels differ from Pillow {Image.__version__}'s "
                  "under every known pass order)")


def kernel() -> str:
    """Which resize ``resize_rgb`` uses here, and why (checked once per process)."""
    global _kernel
    if _kernel is None:
        _kernel = _checked_rule()
    return _kernel[1]


def resize_rgb(pixels: np.ndarray, width: int, height: int, *,
               out: np.ndarray | None = None) -> np.ndarray:
    """(height, width, 3) uint8: ``pixels`` ((H, W, 3) uint8) as
    ``Image.fromarray(pixels).resize((width, height), Image.BICUBIC)`` gives them, written into
    ``out`` ((height, width, 3) uint8, C-contiguous) when given. The kernel reads pixels 3 or 4
    bytes apart (``decode.pil_pixels``' view of PIL's RGBX memory) in rows of any stride."""
    if out is not None and out.shape != (height, width, 3):
        raise ValueError(f"out: shape {out.shape}, expected {(height, width, 3)}")
    kernel()
    rule = _kernel[0]
    row_stride, pixel_stride, value_stride = pixels.strides
    if (rule is not None and pixels.dtype == np.uint8 and value_stride == 1
            and pixel_stride in (3, 4) and row_stride >= pixels.shape[1] * pixel_stride):
        return _native(pixels, width, height, rule, out)
    resized = _pil(np.ascontiguousarray(pixels), width, height)
    if out is None:
        return resized
    out[...] = resized
    return out
