"""Qwen-VL model geometry: resize sizes, patch grids, token counts, frame picks, patch layout.

This module owns every number the Qwen2.5-VL and Qwen3-VL vision towers impose on their inputs, and
computes each one exactly as the Hugging Face transformers (5.x) processors and models do:

- image size: ``smart_resize`` = ``transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.
  smart_resize`` (shared by both models' image processor, ``Qwen2VLImageProcessor[Pil]``);
- video size: Qwen3-VL resizes over the clip volume (``qwen3_vl.video_processing_qwen3_vl.
  smart_resize``, here ``smart_resize_clip``); Qwen2.5-VL resizes each frame with the image rule
  (``qwen2_vl.video_processing_qwen2_vl.Qwen2VLVideoProcessor.resize``);
- frame picks (positions uniform in time, and the processors' indices), grids, token counts and
  the ``pixel_values`` row layout (``patchify``);
- 3-D M-RoPE position ids (``mrope_position_ids``, the models' ``get_rope_index``; it lives in
  ``energon_tasks.families.qwen_vl.mrope`` and is re-exported here).

The geometry of a model by name is ``energon_tasks.profiles.get_geometry`` (the profile registry).

Pure Python + numpy (the patch rows in one C pass where make install built
``energon_tasks._resample``); torch is imported lazily only by the Qwen2.5-VL frame sampler, which
must reproduce qwen-vl-utils' float32 ``torch.linspace``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from contract.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from energon_tasks.families.qwen_vl.mrope import mrope_position_ids
from energon_tasks.image_grid import ImageGrid, check_aspect

try:  # pixel_rows in one pass: make install's C extension (energon_tasks/_resample.c)
    from energon_tasks._resample import patch_rows as _native_patch_rows
except ImportError:  # not built (no C compiler at install): numpy, the same values
    _native_patch_rows = None

#: (image_mean, image_std) -> (``QwenVLGeometry.normalization_table``, the (3, C) float32
#: divisor / mean / std by which the C kernel may compute the same values, see ``pixel_rows``)
_TABLES: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

__all__ = [
    "QWEN2_5_VL",
    "QWEN3_VL",
    "QwenVLGeometry",
    "mrope_position_ids",
    "smart_resize",
    "smart_resize_clip",
]

RESCALE_FACTOR = 1 / 255


def _fit(frames, t_bar, height, width, factor, min_pixels, max_pixels) -> tuple[int, int]:
    """The shared rounding of both smart_resize flavours (pixel limits over t_bar * h * w)."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Target (height, width) of an image: multiples of ``factor``, area near [min, max] pixels.

    Same arithmetic as transformers' ``qwen2_vl.image_processing_pil_qwen2_vl.smart_resize``.

    Raises:
        ValueError: a side below 1, ``min_pixels`` below 1, or aspect ratio above 200.
    """
    if height < 1 or width < 1 or min_pixels < 1:
        raise ValueError(f"size {height}x{width} (HxW), min_pixels {min_pixels}: need >= 1")
    check_aspect(height, width)
    return _fit(1, 1, height, width, factor, min_pixels, max_pixels)


def smart_resize_clip(
    num_frames: int,
    height: int,
    width: int,
    *,
    factor: int,
    temporal_factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """Target (height, width) of a clip whose pixel limits apply to frames x height x width.

    Same arithmetic as transformers' ``qwen3_vl.video_processing_qwen3_vl.smart_resize``, including
    its first step that scales a side below ``factor`` up (aspect kept) before the ratio check.

    Raises:
        ValueError: fewer frames than ``temporal_factor`` (as transformers), or a bad size.
    """
    if num_frames < temporal_factor:
        raise ValueError(f"video of {num_frames} frame(s): needs at least {temporal_factor}")
    if height < 1 or width < 1:
        raise ValueError(f"size {height}x{width} (HxW): sides must be >= 1")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    check_aspect(height, width)
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    return _fit(num_frames, t_bar, height, width, factor, min_pixels, max_pixels)


@dataclass(frozen=True, slots=True, kw_only=True)
class QwenVLGeometry:
    """Everything size-related about one Qwen-VL vision tower and its processors.

    Defaults are those a transformers processor loaded from the model's published
    ``preprocessor_config.json`` / ``video_preprocessor_config.json`` uses (the image processor
    class is shared with Qwen2-VL, whose class defaults differ: 3136..1003520 pixels, CLIP mean).
    """

    name: str
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    default_min_pixels: int  #: image area floor
    default_max_pixels: int  #: image area ceiling
    default_video_min_pixels: int  #: per frame (Qwen2.5-VL) or per clip volume (Qwen3-VL)
    default_video_max_pixels: int  #: per frame (Qwen2.5-VL) or per clip volume (Qwen3-VL)
    default_video_fps: float = 2.0
    default_min_num_frames: int = 4
    default_max_num_frames: int = 768
    video_resize: Literal["per_frame", "clip_volume"]
    frame_sampling: Literal["qwen_vl_utils", "transformers_qwen3"]
    #: the image resize of the processor path (``energon_tasks.decode.decode_image``):
    #: qwen-vl-utils' ``fetch_image`` resizes with PIL's bicubic on uint8, then the PIL
    #: processor's own resize is a no-op (same size)
    image_resize: Literal["pil", "torch"] = "pil"

    @property
    def factor(self) -> int:
        """Side multiple of every resized image: patch_size * merge_size."""
        return self.patch_size * self.merge_size

    @property
    def pixel_cap_step(self) -> int:
        """Granularity of ``max_pixels`` for the budget planner: 1 (``smart_resize`` reads any
        area), see ``energon_tasks.budget._best_cap``."""
        return 1

    def image_cap_notice(self, max_pixels: int | None) -> str | None:
        """None: ``max_pixels`` is an area cap, read as written."""
        return None

    def _grid(self, num_frames: int, height: int, width: int) -> ImageGrid:
        grid_t = -(-num_frames // self.temporal_patch_size)  # patchify pads with the last frame
        grid_h, grid_w = height // self.patch_size, width // self.patch_size
        tokens = grid_t * grid_h * grid_w // self.merge_size**2
        return ImageGrid(height, width, (grid_t, grid_h, grid_w), tokens)

    def image_grid(
        self,
        height: int,
        width: int,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> ImageGrid:
        """Grid of one image, as ``image_grid_thw`` of transformers' ``Qwen2VLImageProcessor``.

        Raises:
            ValueError: aspect ratio above 200 or a side below 1 (message names the size).
        """
        size = smart_resize(
            height,
            width,
            factor=self.factor,
            min_pixels=self.default_min_pixels if min_pixels is None else min_pixels,
            max_pixels=self.default_max_pixels if max_pixels is None else max_pixels,
        )
        return self._grid(1, *size)

    def video_grid(
        self,
        num_frames: int,
        height: int,
        width: int,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> ImageGrid:
        """Grid of a clip of ``num_frames`` sampled frames, as the model's video processor.

        Qwen3-VL: ``Qwen3VLVideoProcessor.resize`` (limits over frames x H x W, no per-frame cap,
        the transformers default). Qwen2.5-VL: ``Qwen2VLVideoProcessor.resize`` (limits per frame).
        ``grid_t = ceil(num_frames / temporal_patch_size)``: an odd count is padded with the last
        frame, as both processors' ``patchify`` do (``get_num_of_video_patches``).

        Raises:
            ValueError: a bad size, or (Qwen3-VL, as transformers) fewer than 2 frames.
        """
        lo = self.default_video_min_pixels if min_pixels is None else min_pixels
        hi = self.default_video_max_pixels if max_pixels is None else max_pixels
        if num_frames < 1:
            raise ValueError(f"video of {num_frames} frame(s): needs at least 1")
        if self.video_resize == "clip_volume":
            size = smart_resize_clip(
                num_frames,
                height,
                width,
                factor=self.factor,
                temporal_factor=self.temporal_patch_size,
                min_pixels=lo,
                max_pixels=hi,
            )
        else:
            size = smart_resize(height, width, factor=self.factor, min_pixels=lo, max_pixels=hi)
        return self._grid(num_frames, *size)

    def video_frame_positions(
        self,
        total_frames: int,
        source_fps: float,
        *,
        video_fps: float | None = None,
        max_num_frames: int | None = None,
        min_num_frames: int | None = None,
    ) -> list[float]:
        """Fractional frame positions to show: uniform over the whole clip at ``video_fps``,
        before the processors round them to frame indices (``video_frame_indices``). The loader
        reads the frame shown at each position's time (``video_decode.decode_video_at``: on a
        constant-rate clip, frame ``round(p)``).

        Policy per model (``frame_sampling``):

        - ``transformers_qwen3`` (Qwen3-VL): exactly ``Qwen3VLVideoProcessor.sample_frames`` with
          ``fps``: n = int(total / source_fps * video_fps), clamped to [min, max] frames and the
          clip length, ``np.linspace(0, total - 1, n)`` (rounded: ``.round()``). n is NOT rounded
          to the temporal patch: an odd n is padded with the last frame by ``patchify`` (as
          transformers does), and ``video_grid(n, ...)`` counts ``ceil(n / 2)`` temporal patches.
        - ``qwen_vl_utils`` (Qwen2.5-VL): qwen-vl-utils' ``smart_nframes`` + its readers' float32
          ``torch.linspace(0, total - 1, n)`` (rounded: ``.round()``); n is floored to the
          temporal patch (always even). transformers' ``Qwen2VLVideoProcessor`` samples nothing
          by default (``do_sample_frames=False``) and its opt-in sampler takes
          ``arange(0, total, total / n)`` in float32, which for many (total, n) returns n + 1
          frames, the last one past the clip (42 frames, n = 30 -> 31 picks ending at 42), so it
          is not followed.

        Both processors take ``source_fps`` as the clip's average rate (frames / duration) and
        mean the picks uniform in time: ``fps`` frames per second of the clip.

        Raises:
            ValueError: non-positive inputs, or (qwen_vl_utils) fewer than 2 frames to sample.
        """
        fps = self.default_video_fps if video_fps is None else video_fps
        hi = self.default_max_num_frames if max_num_frames is None else max_num_frames
        lo = self.default_min_num_frames if min_num_frames is None else min_num_frames
        if total_frames < 1 or source_fps <= 0 or fps <= 0 or hi < 1:
            raise ValueError(
                f"video of {total_frames} frames at {source_fps} fps, sampled at {fps} fps with "
                f"max {hi} frames: all must be positive"
            )
        if self.frame_sampling == "transformers_qwen3":
            n = min(max(int(total_frames / source_fps * fps), lo), hi, total_frames)
            return np.linspace(0, total_frames - 1, n).tolist()
        step = self.temporal_patch_size
        n = min(
            max(total_frames / source_fps * fps, math.ceil(lo / step) * step),
            math.floor(hi / step) * step,
            total_frames,
        )
        n = math.floor(n / step) * step
        if n < step:
            raise ValueError(f"video of {total_frames} frame(s): fewer than {step} to sample")
        import torch  # qwen-vl-utils picks with float32 torch.linspace; numpy float64 differs

        return torch.linspace(0, total_frames - 1, n).tolist()

    def video_frame_indices(self, total_frames: int, source_fps: float, **limits) -> list[int]:
        """The processors' frame indices: ``video_frame_positions`` rounded half to even (numpy's
        and torch's ``round``); ``limits`` as there."""
        return [round(p) for p in self.video_frame_positions(total_frames, source_fps, **limits)]

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 pixels (..., C, H, W) -> float32 (x / 255 - mean) / std, as the PIL processor.

        Same float ops as transformers' ``image_transforms.rescale`` + ``normalize``.
        """
        scaled = (np.asarray(pixels).astype(np.float64) * RESCALE_FACTOR).astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
        return (scaled - mean) / std

    def normalization_table(self) -> np.ndarray:
        """(C, 256) float32: ``normalize`` of every uint8 value per channel (same float ops)."""
        values = np.arange(256, dtype=np.uint8)[None, :, None].repeat(len(self.image_mean), 0)
        return self.normalize(values)[:, :, 0]

    def pixel_rows(self, frames: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 frames (T, H, W, C) -> normalised float32 patch rows, equal bit for bit to
        ``patchify(normalize(frames.transpose(0, 3, 1, 2)))`` but several times cheaper.

        With the C extension (``energon_tasks._resample.patch_rows``) one pass writes ``out`` in
        row order, each value looked up in ``normalization_table`` (the same float32 values) and
        each repeated temporal slot a copy; with AVX2 (3 channels, patch <= 16) the values are
        computed 8 at a time as ``(float32(x) / 255 - mean) / std`` instead, once the kernel has
        checked that this gives the table for all 256 values of every channel (else it looks
        them up). Without it, numpy: the uint8 frames are read through a
        strided patch-layout view (no copy); normalising runs in float32 over a cache-sized scratch
        block (about 256 rows) and each block is copied into its temporal slot of ``out`` (an
        image's second slot is the same block again): one pass of writes over the output.
        ``float32(x) / 255`` equals ``normalize``'s ``float32(float64(x) * (1 / 255))`` for every
        uint8 ``x`` (test_geometry checks all 256), and the subtract / divide are the same float32
        ops.

        Args:
            frames: (T, H, W, C) uint8, H and W multiples of ``factor``.
            out: optional C-contiguous float32 (rows, C * temporal * patch**2) array to fill
                (e.g. a slice of one buffer holding every item of a sample); a new one if None.

        Returns:
            ``out`` (or the new array), filled.

        Raises:
            ValueError: not 4-D, H / W not multiples of ``factor``, or a bad ``out``.
        """
        frames = np.asarray(frames, dtype=np.uint8)
        if frames.ndim != 4 or frames.shape[1] % self.factor or frames.shape[2] % self.factor:
            raise ValueError(f"frames of shape {frames.shape}: need (T, H, W, C) with H, W "
                             f"multiples of {self.factor}")
        count, height, width, channels = frames.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_t, block_h, block_w = -(-count // tp), height // (p * m), width // (p * m)
        shape = (grid_t * block_h * block_w * m * m, channels * tp * p * p)
        if out is None:
            out = np.empty(shape, dtype=np.float32)
        elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out of shape {out.shape} {out.dtype}: need C-contiguous float32 "
                             f"{shape}")
        if _native_patch_rows is not None:
            key = (tuple(self.image_mean), tuple(self.image_std))
            if key not in _TABLES:
                divisor = [1 / RESCALE_FACTOR] * len(self.image_mean)
                _TABLES[key] = (np.ascontiguousarray(self.normalization_table()), np.array(
                    [divisor, self.image_mean, self.image_std], dtype=np.float32))
            table, constants = _TABLES[key]
            _native_patch_rows(np.ascontiguousarray(frames), table, out, p, m, tp, constants)
            return out
        # (T, block row, block col, row in block, col in block, C, patch row, patch col): a view
        source = frames.reshape(count, block_h, m, p, block_w, m, p, channels)
        source = source.transpose(0, 1, 4, 2, 5, 7, 3, 6)
        target = out.reshape(grid_t, block_h, block_w, m, m, channels, tp, p, p)
        mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
        step = max(1, 256 // (block_w * m * m))  # block rows per scratch block
        scratch = np.empty((min(step, block_h), block_w, m, m, channels, p, p), dtype=np.float32)
        for frame in range(count):
            # the last frame also fills the temporal padding slots after it
            slots = range(frame, grid_t * tp if frame == count - 1 else frame + 1)
            for first in range(0, block_h, step):
                last = min(first + step, block_h)
                block = scratch[: last - first]
                np.divide(source[frame, first:last], np.float32(255), out=block)
                np.subtract(block, mean, out=block)
                np.divide(block, std, out=block)
                for slot in slots:
                    target[slot // tp, first:last, :, :, :, :, slot % tp] = block
        return out

    def patchify(self, pixels: np.ndarray) -> np.ndarray:
        """(T, C, H, W) normalised pixels -> (grid_t*grid_h*grid_w, C*temporal*patch*patch).

        Rows in the processors' order (time, merge-block row, merge-block column, row in block,
        column in block); each row is (C, temporal, patch_h, patch_w). T is padded to a multiple
        of ``temporal_patch_size`` by repeating the last frame, so an image (T=1) is duplicated,
        as ``Qwen2VLImageProcessorPil.patchify`` and ``Qwen3VLVideoProcessor.patchify`` do.

        Raises:
            ValueError: not 4-D, or H / W not multiples of ``factor``.
        """
        if pixels.ndim != 4 or pixels.shape[-2] % self.factor or pixels.shape[-1] % self.factor:
            raise ValueError(
                f"pixels of shape {pixels.shape}: need (T, C, H, W) with H, W multiples of "
                f"{self.factor}"
            )
        if pad := -pixels.shape[0] % self.temporal_patch_size:
            pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
        frames, channels, height, width = pixels.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_t, grid_h, grid_w = frames // tp, height // p, width // p
        blocks = pixels.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
        blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return np.ascontiguousarray(blocks).reshape(grid_t * grid_h * grid_w, channels * tp * p * p)


QWEN2_5_VL = QwenVLGeometry(
    name="qwen2_5_vl",
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=OPENAI_CLIP_MEAN,
    image_std=OPENAI_CLIP_STD,
    default_min_pixels=4 * 28 * 28,  # 3136, Qwen2.5-VL preprocessor_config.json
    default_max_pixels=16384 * 28 * 28,  # 12845056
    default_video_min_pixels=128 * 28 * 28,  # Qwen2VLVideoProcessor and qwen-vl-utils, per frame
    default_video_max_pixels=768 * 28 * 28,
    video_resize="per_frame",
    frame_sampling="qwen_vl_utils",
)
QWEN3_VL = QwenVLGeometry(
    name="qwen3_vl",
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    default_min_pixels=65536,  # Qwen3-VL preprocessor_config.json size.shortest_edge
    default_max_pixels=16777216,  # size.longest_edge
    default_video_min_pixels=4096,  # video_preprocessor_config.json, over the clip volume
    default_video_max_pixels=25165824,
    video_resize="clip_volume",
    frame_sampling="transformers_qwen3",
)
#: Qwen3-VL MoE reads Qwen3-VL's processor: the same geometry under its own profile name
QWEN3_VL_MOE = dataclasses.replace(QWEN3_VL, name="qwen3_vl_moe")
#: Qwen3.5 (dense and MoE) reads Qwen3-VL's processor (``Qwen3VLProcessor``): the same geometry
QWEN3_5 = dataclasses.replace(QWEN3_VL, name="qwen3_5")
QWEN3_5_MOE = dataclasses.replace(QWEN3_VL, name="qwen3_5_moe")
#: Cosmos3-Omni's reasoner reads Qwen3-VL's processor too
COSMOS3_OMNI = dataclasses.replace(QWEN3_VL, name="cosmos3_omni")
