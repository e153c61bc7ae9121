"""Nemotron-Omni model geometry: resize sizes, tile grids, token counts, frame picks, timestamps.

The Nemotron-Omni counterpart of the Qwen-VL package's ``QwenVLGeometry`` (the same
``energon_tasks.families.Geometry`` interface and ``ImageGrid`` results, so the budget planner can
take either). Three input paths:

- ``dynamic`` images (the default): native aspect ratio, patch 16, 2x2 pixel shuffle. The patch
  grid is exactly transformers' ``nemotron_h_omni.image_processing_nemotron_h_omni.
  get_patch_grid_size`` (``NemotronH_Omni_Reasoning_V3ImageProcessor``, transformers 5.x, installed
  here); tokens = grid_h * grid_w / 4.
- ``tiled`` images (older checkpoints): InternVL's ``dynamic_preprocess`` /
  ``find_closest_aspect_ratio`` over 512x512 tiles, plus a thumbnail when the grid has more than one
  tile; 256 tokens per tile. This path is not in transformers; the rule is InternVL's public code
  (re-written here, see docs/nemotron.md).
- video (never dynamic): frames sampled uniformly at ``video_fps``, capped at ``max_num_frames``,
  the count floored to a multiple of 2; every frame is resized to one tile chosen as
  transformers' ``NemotronH_Omni_Reasoning_V3VideoProcessor._compute_target_patches``
  (``video_target_num_patches`` = 1024 patches: 512x512 for a square frame, or always 512x512 with
  ``video_maintain_aspect_ratio=False``); frames go in pairs (tubelets); each pair's span is
  preceded by a text label with its frames' timestamps, formatted as the processor's
  ``replace_video_token``.

Pure Python + numpy. See docs/nemotron.md for the formulas and worked examples.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from contract.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from energon_tasks.image_grid import MAX_ASPECT_RATIO, ImageGrid

try:  # float32 frames' rows in one pass: make install's C extension (energon_tasks/_resample.c)
    from energon_tasks._resample import normalize_rows as _native_normalize_rows
except ImportError:  # not built (no C compiler at install): numpy, the same values
    _native_normalize_rows = None

__all__ = [
    "NEMOTRON_OMNI",
    "NEMOTRON_OMNI_TILED",
    "NemotronOmniGeometry",
    "TiledGrid",
    "closest_aspect_ratio",
    "patch_grid_size",
    "pixel_shuffle",
    "video_target_patches",
]


def patch_grid_size(
    height: int, width: int, *, patch_size: int, merge_size: int, min_num_patches: int,
    max_num_patches: int,
) -> tuple[int, int]:
    """(grid_h, grid_w) in patches of one dynamic-resolution image.

    Same arithmetic as transformers' ``nemotron_h_omni.image_processing_nemotron_h_omni.
    get_patch_grid_size``: start from floor(side / patch) + 1 (side / patch when exact), scale down
    (aspect kept, floor) to at most ``max_num_patches``, scale up (ceil) to at least
    ``min_num_patches`` when max > min, then round each side to a multiple of ``merge_size``: up
    when the area still fits ``max_num_patches``, else down (never below ``merge_size``).
    """
    grid_h = round(height / patch_size + 0.5)
    grid_w = round(width / patch_size + 0.5)
    factor = min(math.sqrt(max_num_patches / (grid_h * grid_w)), 1.0)
    grid_h, grid_w = math.floor(factor * grid_h), math.floor(factor * grid_w)
    if max_num_patches > min_num_patches and grid_h * grid_w < min_num_patches:
        factor = math.sqrt(min_num_patches / (grid_h * grid_w))
        grid_h, grid_w = math.ceil(factor * grid_h), math.ceil(factor * grid_w)
    if remainder := grid_h % merge_size:
        if (grid_h + merge_size - remainder) * grid_w <= max_num_patches:
            grid_h += merge_size - remainder
        else:
            grid_h = max(merge_size, grid_h - remainder)
    if remainder := grid_w % merge_size:
        if grid_h * (grid_w + merge_size - remainder) <= max_num_patches:
            grid_w += merge_size - remainder
        else:
            grid_w = max(merge_size, grid_w - remainder)
    return grid_h, grid_w


def video_target_patches(
    height: int, width: int, *, target: int, divisor: int, maintain_aspect_ratio: bool
) -> tuple[int, int]:
    """(grid_h, grid_w) in patches of every frame of a video.

    Same arithmetic as transformers' ``NemotronH_Omni_Reasoning_V3VideoProcessor.
    _compute_target_patches`` (which returns them as (w, h)).
    """
    if not maintain_aspect_ratio:
        side = max(divisor, (int(math.sqrt(target)) // divisor) * divisor)
        return side, side
    aspect = width / max(height, 1)
    ph = max(round(math.sqrt(target / aspect)), 1)
    pw = max(round(math.sqrt(target * aspect)), 1)
    if divisor > 1:
        rem_h, rem_w = ph % divisor, pw % divisor
        ph_up = ph + (divisor - rem_h if rem_h else 0)
        pw_up = pw + (divisor - rem_w if rem_w else 0)
        if ph_up * pw_up <= target:
            ph, pw = ph_up, pw_up
        else:
            ph, pw = max(divisor, ph - rem_h), max(divisor, pw - rem_w)
    return ph, pw


def closest_aspect_ratio(
    height: int, width: int, *, tile_size: int, min_num_tiles: int, max_num_tiles: int
) -> tuple[int, int]:
    """(columns, rows) of the tile grid: InternVL's ``find_closest_aspect_ratio``.

    Candidates: every (i, j) with min_num_tiles <= i * j <= max_num_tiles (i columns, j rows),
    visited in InternVL's order (its set, sorted by i * j; the set of small-int tuples iterates in
    a fixed order, reproduced by building the same set). The first candidate with the smallest
    |width / height - i / j| wins; a later candidate with an equal difference replaces it when
    width * height > 0.5 * tile_size**2 * i * j (prefer the larger grid for a large image).
    No candidate (min > max) gives (1, 1), as InternVL.
    """
    ratios = {
        (i, j)
        for n in range(min_num_tiles, max_num_tiles + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if min_num_tiles <= i * j <= max_num_tiles
    }
    aspect = width / height
    area = width * height
    best_diff, best = float("inf"), (1, 1)
    for ratio in sorted(ratios, key=lambda r: r[0] * r[1]):
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and area > 0.5 * tile_size * tile_size * ratio[0] * ratio[1]:
            best = ratio
    return best


@dataclass(frozen=True, slots=True)
class TiledGrid:
    """Tiles of one image on the tiled path."""

    columns: int  #: tiles across (the image is resized to columns * tile_size wide)
    rows: int  #: tiles down
    thumbnail: bool  #: a whole-image tile_size x tile_size thumbnail follows the grid tiles
    tile_size: int
    tokens_per_tile: int

    @property
    def tiles(self) -> int:
        """Tiles fed to the encoder: columns * rows (+1 thumbnail); row-major, then the thumb."""
        return self.columns * self.rows + int(self.thumbnail)

    @property
    def visual_tokens(self) -> int:
        return self.tiles * self.tokens_per_tile

    @property
    def resized_height(self) -> int:
        return self.rows * self.tile_size

    @property
    def resized_width(self) -> int:
        return self.columns * self.tile_size

    def as_image_grid(self) -> ImageGrid:
        """The planner's view: grid_thw = (tiles, tile patches, tile patches)."""
        grid = math.isqrt(self.tokens_per_tile * 4)  # patches per tile side (merge 2)
        return ImageGrid(self.resized_height, self.resized_width, (self.tiles, grid, grid),
                         self.visual_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class NemotronOmniGeometry:
    """Everything size-related about the Nemotron-Omni vision path.

    Defaults are the class defaults of transformers' Nemotron-Omni processors (the published
    checkpoint's ``preprocessor_config.json`` may override them; not available offline here):
    patch 16, downsample 0.5 (2x2 pixel shuffle), 1024..13312 patches per image (262144..3407872
    pixels), CLIP mean / std, video target 1024 patches with aspect kept, temporal patch 2.
    The tiled values (512 tiles, 1..12 tiles, thumbnail) are InternVL / Nemotron-VL conventions.
    """

    name: str = "nemotron_omni"
    image_mode: Literal["dynamic", "tiled"] = "dynamic"
    patch_size: int = 16
    merge_size: int = 2  #: 1 / downsample_ratio
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    default_min_pixels: int = 1024 * 16 * 16  #: min_num_patches 1024
    default_max_pixels: int = 13312 * 16 * 16  #: max_num_patches 13312
    tile_size: int = 512
    min_num_tiles: int = 1
    max_num_tiles: int = 12
    use_thumbnail: bool = True
    video_target_num_patches: int = 1024
    video_maintain_aspect_ratio: bool = True
    default_video_fps: float = 2.0
    default_min_num_frames: int = 2
    default_max_num_frames: int = 32

    @property
    def factor(self) -> int:
        """Side multiple of every resized image: patch_size * merge_size (32)."""
        return self.patch_size * self.merge_size

    @property
    def image_resize(self) -> str:
        """The image resize of the processor path (``energon_tasks.decode.decode_image``):
        dynamic images "torch" (``NemotronH_Omni_Reasoning_V3ImageProcessor`` resizes the float32
        tensor with torchvision's antialiased bicubic, unclamped); tiled images "pil" (InternVL's
        ``dynamic_preprocess`` resizes with PIL's bicubic)."""
        return "pil" if self.image_mode == "tiled" else "torch"

    @property
    def pixel_cap_step(self) -> int:
        """Granularity of ``max_pixels`` for the budget planner: caps between two multiples of
        this give the same grids (dynamic: whole patches, patch**2; tiled: whole tiles,
        tile_size**2), so ``energon_tasks.budget._best_cap`` searches on multiples of it."""
        return self.tile_size**2 if self.image_mode == "tiled" else self.patch_size**2

    @property
    def default_video_min_pixels(self) -> int:
        """The frame area of the video target (the planner's interface; video sizes are fixed by
        ``video_target_num_patches``, not by pixel limits)."""
        return self.video_target_num_patches * self.patch_size**2

    @property
    def default_video_max_pixels(self) -> int:
        """Same as ``default_video_min_pixels``."""
        return self.default_video_min_pixels

    @property
    def tokens_per_tile(self) -> int:
        """(tile / patch)**2 / merge**2: 256 for 512 tiles."""
        return (self.tile_size // self.patch_size) ** 2 // self.merge_size**2

    def _check(self, height: int, width: int) -> None:
        if height < 1 or width < 1:
            raise ValueError(f"size {height}x{width} (HxW): sides must be >= 1")
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ValueError(f"size {height}x{width} (HxW) has aspect ratio above "
                             f"{MAX_ASPECT_RATIO}")

    # ----------------------------------------------------------------------------- images
    def dynamic_grid(self, height: int, width: int, *, min_pixels: int | None = None,
                     max_pixels: int | None = None) -> ImageGrid:
        """Dynamic path: ImageGrid(resized_h, resized_w, (1, grid_h, grid_w), grid_h*grid_w/4).

        ``min_pixels`` / ``max_pixels`` are the processor's min / max_num_patches times patch**2
        (floored to whole patches).
        """
        self._check(height, width)
        low = self.default_min_pixels if min_pixels is None else min_pixels
        high = self.default_max_pixels if max_pixels is None else max_pixels
        p2 = self.patch_size**2
        gh, gw = patch_grid_size(height, width, patch_size=self.patch_size,
                                 merge_size=self.merge_size, min_num_patches=low // p2,
                                 max_num_patches=high // p2)
        return ImageGrid(gh * self.patch_size, gw * self.patch_size, (1, gh, gw),
                         gh * gw // self.merge_size**2)

    def tiled_grid(self, height: int, width: int, *, max_num_tiles: int | None = None,
                   min_num_tiles: int | None = None) -> TiledGrid:
        """Tiled path: the closest aspect-ratio grid of tile_size tiles (+ thumbnail)."""
        self._check(height, width)
        hi = self.max_num_tiles if max_num_tiles is None else max_num_tiles
        lo = self.min_num_tiles if min_num_tiles is None else min_num_tiles
        cols, rows = closest_aspect_ratio(height, width, tile_size=self.tile_size,
                                          min_num_tiles=lo, max_num_tiles=hi)
        return TiledGrid(cols, rows, self.use_thumbnail and cols * rows != 1, self.tile_size,
                         self.tokens_per_tile)

    def image_grid(self, height: int, width: int, *, min_pixels: int | None = None,
                   max_pixels: int | None = None) -> ImageGrid:
        """Grid of one image on this geometry's ``image_mode`` (the planner's entry point).

        Tiled mode maps the pixel cap to a tile cap: max_num_tiles' = max(min_num_tiles,
        min(max_num_tiles, max_pixels // tile_size**2)); ``min_pixels`` is ignored. Tokens never
        increase when max_pixels decreases (tests check it on both paths).
        """
        if self.image_mode == "dynamic":
            return self.dynamic_grid(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
        cap = self.max_num_tiles if max_pixels is None else self.tile_cap(max_pixels)
        return self.tiled_grid(height, width, max_num_tiles=cap).as_image_grid()

    def tile_cap(self, max_pixels: int | None) -> int | None:
        """Tiled images: the tile cap ``max_pixels`` leaves, max(min_num_tiles,
        min(max_num_tiles, max_pixels // tile_size**2)); None on dynamic images or without a
        pixel cap."""
        if self.image_mode != "tiled" or max_pixels is None:
            return None
        return max(self.min_num_tiles, min(self.max_num_tiles, max_pixels // self.tile_size**2))

    def image_cap_notice(self, max_pixels: int | None) -> str | None:
        """What a user should be told when ``max_pixels`` caps the tiles below
        ``max_num_tiles`` (None when it does not)."""
        cap = self.tile_cap(max_pixels)
        if cap is None or cap >= self.max_num_tiles:
            return None
        return (f"{self.name} reads max_pixels {max_pixels} as a cap of {cap} tile(s) per image "
                f"(below max_num_tiles {self.max_num_tiles}); set max_pixels: null to use "
                "max_num_tiles")

    # ----------------------------------------------------------------------------- video
    def video_frame_indices(self, total_frames: int, source_fps: float, **limits) -> list[int]:
        """The frame indices: ``video_frame_positions`` rounded half to even (numpy's
        ``round``); ``limits`` as there."""
        return [round(p) for p in self.video_frame_positions(total_frames, source_fps, **limits)]

    def video_frame_positions(self, total_frames: int, source_fps: float, *,
                              video_fps: float | None = None, max_num_frames: int | None = None,
                              min_num_frames: int | None = None) -> list[float]:
        """Fractional frame positions to show: n = floor_2(clamp(int(total / source_fps *
        video_fps), min, max, total)), positions = np.linspace(0, total - 1, n) (uniform over
        the whole clip; the frame indices are them rounded). The loader reads the frame shown
        at each position's time (``video_decode.decode_video_at``: on a constant-rate clip,
        frame ``round(p)``).

        Raises:
            ValueError: non-positive inputs, or fewer than 2 frames in the clip.
        """
        fps = self.default_video_fps if video_fps is None else video_fps
        hi = self.default_max_num_frames if max_num_frames is None else max_num_frames
        lo = self.default_min_num_frames if min_num_frames is None else min_num_frames
        if total_frames < 1 or source_fps <= 0 or fps <= 0 or hi < 1:
            raise ValueError(f"video of {total_frames} frames at {source_fps} fps, sampled at "
                             f"{fps} fps with max {hi} frames: all must be positive")
        step = self.temporal_patch_size
        n = min(max(int(total_frames / source_fps * fps), lo), hi, total_frames)
        n = n // step * step
        if n < step:
            raise ValueError(f"video of {total_frames} frame(s): fewer than {step} to sample")
        return np.linspace(0, total_frames - 1, n).tolist()

    def video_grid(self, num_frames: int, height: int, width: int, *,
                   min_pixels: int | None = None, max_pixels: int | None = None) -> ImageGrid:
        """ImageGrid(frame_h, frame_w, (pairs, grid_h, grid_w), pairs * grid_h * grid_w / 4).

        pairs = ceil(num_frames / 2) (an odd count is padded with its last frame, as the video
        processor). The pixel knobs are accepted for the planner's interface and ignored: video
        never takes the dynamic path.
        """
        del min_pixels, max_pixels
        if num_frames < 1:
            raise ValueError(f"video of {num_frames} frame(s): needs at least 1")
        self._check(height, width)
        gh, gw = video_target_patches(height, width, target=self.video_target_num_patches,
                                      divisor=self.merge_size,
                                      maintain_aspect_ratio=self.video_maintain_aspect_ratio)
        pairs = -(-num_frames // self.temporal_patch_size)
        return ImageGrid(gh * self.patch_size, gw * self.patch_size, (pairs, gh, gw),
                         pairs * gh * gw // self.merge_size**2)

    @staticmethod
    def video_timestamps(frame_indices, source_fps: float) -> list[float]:
        """Seconds of each picked frame: index * int(1000 / fps) / 1000 (the processor's rule,
        which truncates the frame duration to whole ms: 29.97 fps -> 33 ms)."""
        duration_ms = int(1000.0 / source_fps)
        return [int(i) * duration_ms / 1000.0 for i in frame_indices]

    def video_labels(self, frame_indices, source_fps: float, seconds=None) -> list[str]:
        """One text label per frame pair, e.g. ``"Frame 1 sampled at 0.00 seconds and frame 2
        sampled at 0.50 seconds: "`` (numbering from 1 over the picked frames); the seconds are
        ``video_timestamps``' or, given, ``seconds`` (the frames' true timestamps)."""
        stamps = self.video_timestamps(frame_indices, source_fps) if seconds is None else seconds
        labels = []
        for first in range(0, len(stamps), self.temporal_patch_size):
            parts = [f"{'Frame' if k == first else 'frame'} {k + 1} sampled at {stamps[k]:.2f} "
                     "seconds" for k in range(first, min(first + self.temporal_patch_size,
                                                          len(stamps)))]
            labels.append(" and ".join(parts) + ": ")
        return labels

    def video_span_text(self, frame_indices, source_fps: float, grid: ImageGrid, *,
                        image_token: str = "<image>", start: str = "<img>",
                        end: str = "</img>") -> str:
        """The text a ``<video>`` placeholder expands to: per pair, label + start + pads + end,
        pairs joined by a newline (the processor's ``replace_video_token``)."""
        per_pair = grid.visual_tokens // grid.grid_thw[0]
        chunk = start + image_token * per_pair + end
        return "\n".join(label + chunk for label in self.video_labels(frame_indices, source_fps))

    def image_span_text(self, grid: ImageGrid, *, image_token: str = "<image>",
                        start: str = "<img>", end: str = "</img>") -> str:
        """``<img>`` + pads + ``</img>`` (one span per image; a tiled image's tiles share it)."""
        return start + image_token * grid.visual_tokens + end

    # ----------------------------------------------------------------------------- pixels
    def tiles(self, pixels: np.ndarray, thumbnail: np.ndarray | None = None) -> np.ndarray:
        """(rows * tile, cols * tile, C) resized image -> (tiles, tile, tile, C): the grid tiles
        in row-major order (InternVL's crop boxes), then the thumbnail when given."""
        height, width, channels = pixels.shape
        t = self.tile_size
        if height % t or width % t:
            raise ValueError(f"pixels of shape {pixels.shape}: H, W must be multiples of {t}")
        grid = pixels.reshape(height // t, t, width // t, t, channels).swapaxes(1, 2)
        grid = grid.reshape(-1, t, t, channels)
        return grid if thumbnail is None else np.concatenate([grid, thumbnail[None]])

    def pixel_rows(self, frames: np.ndarray, *, kind: str,
                   out: np.ndarray | None = None) -> np.ndarray:
        """Frames (T, H, W, C) -> float32 patch rows as the transformers processors make them,
        normalised as ``normalization_table(kind)``: uint8 frames through the table, float32
        frames (0..255, e.g. resized in float32 as the image processor does) with the same
        float ops.

        - ``kind="image"``: one row per 16x16 patch of each frame (a dynamic image is T = 1, a
          tiled image is T = tiles), frames in order, patches row-major, each row (C, 16, 16):
          ``patchify`` of each frame, i.e. the image processor's ``convert_image_to_patches``
          and what ``RadioModel._forward_packed`` reads back with ``view(-1, C, 16, 16)``.
        - ``kind="video"``: frames go in pairs (tubelets; an odd count is padded with the last
          frame), one row per patch of a pair, each row (2, C, 16, 16) = frame 0 RGB then frame 1
          RGB: RADIO's ``_image_to_patches`` on the video processor's (2C, H, W) tubelet.

        Args:
            frames: (T, H, W, C) uint8 or float32, H and W multiples of ``patch_size``.
            kind: "image" or "video".
            out: optional C-contiguous float32 array of the result's shape to fill.

        Raises:
            ValueError: a bad shape or ``out``.
        """
        frames = np.asarray(frames)
        if frames.dtype != np.float32:
            frames = frames.astype(np.uint8, copy=False)
        p = self.patch_size
        if frames.ndim != 4 or frames.shape[1] % p or frames.shape[2] % p:
            raise ValueError(f"frames of shape {frames.shape}: need (T, H, W, C) with H, W "
                             f"multiples of {p}")
        count, height, width, channels = frames.shape
        step = self.temporal_patch_size if kind == "video" else 1
        slots, gh, gw = -(-count // step), height // p, width // p
        shape = (slots * gh * gw, step * channels * p * p)
        if out is None:
            out = np.empty(shape, dtype=np.float32)
        elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out of shape {out.shape} {out.dtype}: need C-contiguous float32 "
                             f"{shape}")
        planes = frames.transpose(0, 3, 1, 2)  # a resized image: a view of (C, H, W) planes
        if (frames.dtype == np.float32 and _native_normalize_rows is not None
                and planes.flags.c_contiguous):
            _native_normalize_rows(planes, *_float_ops(kind, self.image_mean, self.image_std),
                                   out, p, step)
            return out
        table = self.normalization_table(kind)
        # (T, grid row, grid col, C, patch row, patch col): a view of the frames
        source = frames.reshape(count, gh, p, gw, p, channels).transpose(0, 1, 3, 5, 2, 4)
        target = out.reshape(slots, gh, gw, step, channels, p, p)
        for slot in range(slots * step):
            frame = source[min(slot, count - 1)]  # the last frame also fills the padding
            if frames.dtype == np.float32:  # straight into the output, no temporaries
                _normalize(kind, frame, self.image_mean, self.image_std,
                           out=target[slot // step, :, :, slot % step])
                continue
            for channel in range(channels):
                target[slot // step, :, :, slot % step, channel] = table[channel][
                    frame[:, :, channel]]
        return out

    def normalization_table(self, kind: str) -> np.ndarray:
        """(C, 256) float32: the processor's value of every uint8 level per channel.

        Both processors rescale to [0, 1] AND normalise with ``image_mean`` / ``image_std``
        (the model's RADIO input conditioner is detached: ``make_preprocessor_external``), but
        with different float ops, reproduced here bit for bit:

        - image (``TorchvisionBackend.rescale_and_normalize``, fused):
          ``(x - float32(mean * 255)) / float32(std * 255)``;
        - video (``NemotronH_Omni_Reasoning_V3VideoProcessor._preprocess``):
          ``(x / 255 - mean) / std``; all in float32.
        """
        return _normalization_table(kind, self.image_mean, self.image_std)

    def patchify(self, pixels: np.ndarray) -> np.ndarray:
        """(C, H, W) normalised pixels -> (grid_h * grid_w, C * patch**2), row-major patches, each
        patch channel-major (C, patch_row, patch_col): transformers' ``convert_image_to_patches``.
        """
        channels, height, width = pixels.shape
        p = self.patch_size
        if height % p or width % p:
            raise ValueError(f"pixels of shape {pixels.shape}: H, W must be multiples of {p}")
        rows = pixels.reshape(channels, height // p, p, width // p, p).transpose(1, 3, 0, 2, 4)
        return np.ascontiguousarray(rows).reshape(-1, channels * p * p)


@functools.lru_cache(maxsize=8)
def _normalization_table(kind: str, mean: tuple, std: tuple) -> np.ndarray:
    levels = np.arange(256, dtype=np.float32)[None, :, None]
    table = _normalize(kind, levels, mean, std)[:, :, 0]
    table.setflags(write=False)
    return table


@functools.lru_cache(maxsize=8)
def _float_ops(kind: str, mean: tuple, std: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pre, sub, div), each (C,) float32: the processor's value of x is ((x / pre) - sub) / div,
    each op rounded to float32 (``NemotronOmniGeometry.normalization_table``'s float ops; an
    image's pre is 1: x / 1 is x)."""
    mean32, std32 = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
    if kind == "image":
        scale = np.float32(1.0 / (1.0 / 255))  # transformers: mean * (1.0 / rescale_factor)
        ops = (np.ones_like(mean32), mean32 * scale, std32 * scale)
    elif kind == "video":
        ops = (np.full_like(mean32, 255.0), mean32, std32)
    else:
        raise ValueError(f"kind {kind!r}: need 'image' or 'video'")
    for op in ops:
        op.setflags(write=False)
    return ops


def _normalize(kind: str, values: np.ndarray, mean: tuple, std: tuple,
               out: np.ndarray | None = None) -> np.ndarray:
    """float32 values 0..255, channels on axis -3 -> the processor's normalised values
    (``_float_ops``), written into ``out`` when given."""
    pre, sub, div = (op[:, None, None] for op in _float_ops(kind, mean, std))
    if out is None:
        out = np.empty(np.broadcast_shapes(values.shape, sub.shape), dtype=np.float32)
    np.divide(values, pre, out=out)
    np.subtract(out, sub, out=out)
    return np.divide(out, div, out=out)


def pixel_shuffle(features: np.ndarray, merge_size: int = 2) -> np.ndarray:
    """(..., H, W, C) encoder features -> (..., H/m, W/m, m*m*C), the model's ``pixel_shuffle``.

    out[i, j, (a * m + b) * C + c] = features[m*i + a, m*j + b, c]: each output token is the m x m
    block at (i, j), row offset major, then column offset, then channel; tokens stay row-major.
    """
    *lead, height, width, channels = features.shape
    m = merge_size
    if height % m or width % m:
        raise ValueError(f"features of shape {features.shape}: H, W must be multiples of {m}")
    x = features.reshape(*lead, height // m, m, width // m, m, channels)
    n = len(lead)
    order = [*range(n), n, n + 2, n + 1, n + 3, n + 4]
    return x.transpose(order).reshape(*lead, height // m, width // m, m * m * channels)


NEMOTRON_OMNI = NemotronOmniGeometry()
NEMOTRON_OMNI_TILED = NemotronOmniGeometry(name="nemotron_omni_tiled", image_mode="tiled")
