"""The exact paths' two resizes, bit for bit, in vectorised kernels.

This module owns how the exact paths resize: ``resize_rgb`` is PIL's bicubic on uint8 (images for
Qwen-VL and tiled Nemotron-Omni, ``decode.decode_image``; video frames, ``video_decode``);
``resize_rgb_float`` is torch's antialiased bicubic in float32 (``F.interpolate`` on a float32
tensor: dynamic Nemotron-Omni images, whose processor resizes so).

- **native** (``energon_tasks._resample``, C, built by ``make install``): Pillow's own
  arithmetic (the same double-precision weights rounded to 22-bit fixed point, int32 sums, uint8
  between the passes), vectorised over the values that share weights; on a CPU with AVX2 (chosen
  by its features at run time, ``kernel()`` names it) each output's sums stay in registers over
  all its taps; the plain code elsewhere (docs/benchmarks_task_encoder.md, "Loader benchmark");
- **which pass first** is Pillow's rule, and Pillow 13 changed it (the vertical pass first when
  the height shrinks by more than twice what the width does); the uint8 rounding between passes
  makes the order visible in the pixels;
- **checked before use**: the first call resizes a few images of sizes that cover both orders,
  enlarging, shrinking, single rows and columns and steep ratios, with the kernel under each
  known rule and with the installed Pillow; the kernel is used with the rule whose pixels are all
  Pillow's, and not at all when none is (``kernel()`` says which and why);
- **without the compiled module** (no C compiler at install) PIL resizes: the same pixels.

``resize_rgb_float``:

- **weights**: torch's own, read off ``F.interpolate``'s impulse responses (a few rows of
  impulses spaced wider than any output's window; cached per size pair), placed in torch's
  windows (its float32 window arithmetic);
- **sums**: torch's, which its build fixes: on x86-64 with FMA each output is the first tap's
  product, then the other taps in order, each ``group`` of 4 as a product and an add and the
  last ``(taps - 1) % 4`` fused; no other order, fusing or partial sums gives torch's values
  (docs/benchmarks_task_encoder.md);
- **checked before use** against ``F.interpolate`` itself on sizes that shrink, enlarge and keep
  a side, under each known summing rule; none matching (another build or CPU): torch resizes,
  band by band (``torch_resized``);
- **compiled twice**: with AVX2 + FMA (8 lanes a vector, each fused step one instruction) and
  plain, chosen by the CPU's features at run time (``float_kernel()`` says which);
  ``bench/bench_resize.py`` measures both against ``F.interpolate`` per core
  (docs/benchmarks_task_encoder.md, "Fifth run").
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from PIL import Image

try:
    from energon_tasks._resample import bicubic as _bicubic
    from energon_tasks._resample import bicubic_float as _bicubic_float
    from energon_tasks._resample import float_isa as _float_isa
    from energon_tasks._resample import uint8_isa as _uint8_isa
except ImportError as error:  # built at install; optional (pyproject.toml)
    _bicubic = _bicubic_float = _float_isa = _uint8_isa = None
    _MISSING = f"not built ({error})"
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

#: each check's result, once per process: "uint8" / "float32" -> (rule or None, what it says)
_checks: dict[str, tuple] = {}


def _checked(name: str, check) -> tuple:
    if name not in _checks:
        _checks[name] = check()
    return _checks[name]


def _kernel_reads(pixels: np.ndarray) -> bool:
    """Whether the kernels read ``pixels``: (H, W, 3) uint8, pixels 3 (packed) or 4 (RGBX) bytes
    apart, rows of ascending addresses."""
    row_stride, pixel_stride, value_stride = pixels.strides
    return (pixels.dtype == np.uint8 and value_stride == 1 and pixel_stride in (3, 4)
            and row_stride >= pixels.shape[1] * pixel_stride)


def _pil(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    return np.asarray(Image.fromarray(pixels).resize((width, height), Image.BICUBIC), np.uint8)


def _native(pixels: np.ndarray, width: int, height: int, rule, out: np.ndarray | None,
            plain: bool = False) -> np.ndarray:
    if out is None:
        out = np.empty((height, width, 3), np.uint8)
    _bicubic(pixels, out, rule(*pixels.shape[:2], height, width), plain)
    return out


def _check_cases(sizes, reference) -> list[tuple]:
    """(pixels, width, height, the reference's result) for each (source, target) of ``sizes``:
    noise in the top half, black and white below (hard edges: overshoot to clip)."""
    rng = np.random.default_rng(0)
    cases = []
    for (height, width), (new_height, new_width) in sizes:
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        pixels[height // 2:] = 255 * (pixels[height // 2:] > 127)
        cases.append((pixels, new_width, new_height, reference(pixels, new_width, new_height)))
    return cases


def _checked_rule() -> tuple:
    """(the order rule whose pixels are the installed Pillow's, or None; what kernel() says)."""
    if _bicubic is None:
        return None, f"PIL (the native kernel is {_MISSING})"
    cases = _check_cases(_CHECK_SIZES, _pil)
    for name, rule in _ORDER_RULES:
        if all(np.array_equal(_native(p, w, h, rule, None), expected)
               for p, w, h, expected in cases):
            return rule, (f"native ({name} pass order, {_uint8_isa()} code, checked against "
                          f"Pillow {Image.__version__})")
    return None, (f"PIL (the native kernel's pixels differ from Pillow {Image.__version__}'s "
                  "under every known pass order)")


def kernel() -> str:
    """Which resize ``resize_rgb`` uses here, and why (checked once per process)."""
    return _checked("uint8", _checked_rule)[1]


def resize_rgb(pixels: np.ndarray, width: int, height: int, *,
               out: np.ndarray | None = None) -> np.ndarray:
    """(height, width, 3) uint8: ``pixels`` ((H, W, 3) uint8) as
    ``Image.fromarray(pixels).resize((width, height), Image.BICUBIC)`` gives them, written into
    ``out`` ((height, width, 3) uint8, C-contiguous) when given. The kernel reads pixels 3 or 4
    bytes apart (``decode.pil_pixels``' view of PIL's RGBX memory) in rows of any stride."""
    if out is not None and out.shape != (height, width, 3):
        raise ValueError(f"out: shape {out.shape}, expected {(height, width, 3)}")
    rule = _checked("uint8", _checked_rule)[0]
    if rule is not None and _kernel_reads(pixels):
        return _native(pixels, width, height, rule, out)
    resized = _pil(np.ascontiguousarray(pixels), width, height)
    if out is None:
        return resized
    out[...] = resized
    return out


#: F.interpolate's options for the processors' float32 resize
_AA = {"mode": "bicubic", "align_corners": False, "antialias": True}

#: source rows per band of the horizontal pass (a band's float rows stay in the cache)
_BAND_ROWS = 128
#: sources from this many pixels are resized band by band (below, one call is as cheap)
_BANDED_FROM_PIXELS = 2_000_000


def torch_resized(pixels: np.ndarray, height: int, width: int,
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
    if not (source_h * source_w >= _BANDED_FROM_PIXELS if banded is None else banded):
        planes = np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)
        tensor = torch.from_numpy(planes)[None]
        return interpolate(tensor, size=(height, width), **_AA)[0].permute(1, 2, 0).numpy()
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
                                                     **_AA)
        plane = torch.from_numpy(out[channel])
        if source_h == height:
            plane.copy_(rows[0, 0])
        else:
            plane.copy_(interpolate(rows, size=(height, width), **_AA)[0, 0])
    return out.transpose(1, 2, 0)


# ---- torch's antialiased bicubic in float32 -----------------------------------------------------

#: torch's summing rules, most likely first: taps after the first summed as a product and an add
#: in groups of this many, the rest fused (1: never fused; 10**9: always fused)
_FLOAT_GROUPS = (4, 1, 8, 16, 10**9)

#: (source height, width) -> (target height, width) the float check resizes
_FLOAT_CHECK_SIZES = (((97, 61), (13, 80)), ((60, 90), (20, 89)), ((23, 31), (70, 57)),
                      ((90, 160), (84, 154)), ((1, 40), (3, 17)), ((300, 11), (7, 29)),
                      ((50, 50), (50, 33)), ((50, 50), (17, 50)), ((64, 48), (64, 48)),
                      ((211, 307), (40, 61)))


def _torch_window(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """torch's window of each output (first input, inputs summed) and the most inputs any
    output sums (ksize), computed as its float32 kernel computes them
    (``_compute_indices_min_size_weights_aa``)."""
    scale = np.float32(np.float32(in_size) / np.float32(out_size))
    support = np.float32(2.0 * float(scale)) if scale >= 1.0 else np.float32(2.0)
    ksize = int(math.ceil(support)) * 2 + 1
    centers = (float(scale) * (np.arange(out_size, dtype=np.float64) + 0.5)).astype(np.float32)
    first = np.maximum(((centers - support).astype(np.float64) + 0.5).astype(np.int64), 0)
    last = np.minimum(((centers + support).astype(np.float64) + 0.5).astype(np.int64), in_size)
    count = np.clip(last - first, 0, ksize)
    return first.astype(np.int32), count.astype(np.int32), ksize


@functools.lru_cache(maxsize=512)
def _torch_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(first, count, weights (out, ksize)) of torch's float32 antialiased bicubic along one
    side, the weights read off ``F.interpolate``: rows of impulses ``period`` apart (wider than
    any window, so each output sees at most one), each output's response the weight of the
    impulse nearest its center. None when a response falls outside torch's window as computed
    here (another torch)."""
    first, count, ksize = _torch_window(in_size, out_size)
    period = ksize + 1
    impulses = torch.zeros(period, 1, 1, in_size)
    for shift in range(period):
        impulses[shift, 0, 0, shift::period] = 1.0
    with torch.no_grad():
        response = torch.nn.functional.interpolate(impulses, size=(1, out_size), **_AA)
    response = response[:, 0, 0, :].numpy()  # (period, out_size)
    centers = (np.arange(out_size) + 0.5) * (in_size / out_size)
    shifts = np.arange(period)[:, None]
    position = shifts + np.round((centers[None, :] - shifts) / period).astype(np.int64) * period
    offset = position - first[None, :].astype(np.int64)
    seen = response != 0
    outside = (offset < 0) | (offset >= count[None, :])
    if (seen & outside).any() or not count.all():
        return None
    weights = np.zeros((out_size, ksize), np.float32)
    rows, outputs = np.nonzero(seen)
    weights[outputs, offset[rows, outputs]] = response[rows, outputs]
    return first, count, weights


def _native_float(pixels: np.ndarray, width: int, height: int, group: int,
                  plain: bool = False) -> np.ndarray | None:
    """The kernel's resize, or None where torch sums otherwise: a target one pixel wide (torch
    then iterates the rows, another loop of its build). ``plain``: the kernel's code without
    AVX2 + FMA even where the CPU has them (what a CPU without them runs)."""
    source_h, source_w = pixels.shape[:2]
    if width == 1:
        return None
    sides = []
    for source, target in ((source_w, width), (source_h, height)):
        taps = None if source == target else _torch_taps(source, target)
        if source != target and taps is None:
            return None
        sides += list(taps) if taps is not None else [None, None, None]
    out = np.empty((3, height, width), np.float32)
    _bicubic_float(pixels, out, *sides, group, plain)
    return out.transpose(1, 2, 0)


def _checked_float_rule() -> tuple:
    if _bicubic_float is None:
        return None, f"torch (the native kernel is {_MISSING})"
    cases = _check_cases(_FLOAT_CHECK_SIZES, lambda pixels, width, height: torch_resized(
        pixels, height, width, banded=False))
    for group in _FLOAT_GROUPS:
        results = [_native_float(p, w, h, group) for p, w, h, _ in cases]
        if all(r is not None and np.array_equal(r, expected)
               for r, (*_, expected) in zip(results, cases, strict=True)):
            return group, (f"native ({_float_isa()}, taps summed in groups of {group}, checked "
                           f"against torch {torch.__version__} on "
                           f"{torch.backends.cpu.get_cpu_capability()})")
    return None, (f"torch (the native kernel's values differ from torch {torch.__version__}'s "
                  "under every known summing rule)")


def float_kernel() -> str:
    """Which float32 resize ``resize_rgb_float`` uses here, and why (checked once per process)."""
    return _checked("float32", _checked_float_rule)[1]


def resize_rgb_float(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    """(height, width, 3) float32 (a view of (3, height, width) planes): ``pixels`` ((H, W, 3)
    uint8, pixels 3 or 4 bytes apart) as ``F.interpolate`` resizes them as a float32
    (1, 3, H, W) tensor, bicubic, antialiased, unclamped."""
    group = _checked("float32", _checked_float_rule)[0]
    if group is not None and _kernel_reads(pixels):
        resized = _native_float(pixels, width, height, group)
        if resized is not None:
            return resized
    if pixels.shape[:2] == (height, width):
        return pixels.astype(np.float32)
    return torch_resized(pixels, height, width)
