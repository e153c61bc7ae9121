"""The Qwen-VL task-encoder hooks (Qwen2.5-VL, Qwen3-VL): tokens, spans, pixel rows, positions.

``QwenVLHooks`` is what ``energon_tasks.task_encoder.VLMTaskEncoder`` asks for every step that
depends on the model (``energon_tasks.profiles`` names it for the Qwen profiles); planning,
decoding, labels, packing and batching are the encoder's own.

- special tokens: ChatML ``<|im_start|>`` / ``<|im_end|>``, ``<|vision_start|>`` /
  ``<|vision_end|>``, ``<|image_pad|>`` / ``<|video_pad|>``; pad ``<|endoftext|>`` when the
  tokenizer has none;
- spans: an image ``<|vision_start|><|image_pad|>*n<|vision_end|>``; a video the same with
  ``<|video_pad|>`` (Qwen2.5-VL), or as Qwen3-VL's processor: ``<|vision_start|>`` + per temporal
  patch ``<T.T seconds><|vision_start|><|video_pad|>*n<|vision_end|>`` + ``<|vision_end|>``;
- pixel rows: the HF processors' row layout (``QwenVLGeometry.pixel_rows``), one row width for
  both kinds;
- positions: 3-D M-RoPE (``mrope_position_ids``; Qwen2.5-VL's video time steps from the sampled
  frame rate).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from energon_tasks.families.qwen_vl.geometry import mrope_position_ids
from energon_tasks.sample_format import Media

#: Qwen2.5-VL vision_config.tokens_per_second: M-RoPE time units per second of video.
QWEN2_5_TOKENS_PER_SECOND = 2
#: The special tokens the Qwen-VL ChatML template uses, in the order they are added.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


class QwenVLHooks:
    """The model-dependent steps of the encoder for Qwen2.5-VL / Qwen3-VL.

    Args:
        encoder: the ``VLMTaskEncoder`` these hooks serve (its geometry, token ids, text
            tokenizer and decode settings).
    """

    #: special tokens a tokenizer must have
    REQUIRED_TOKENS = QWEN_SPECIAL_TOKENS
    #: encoder attribute -> special token; each attribute holds the token's id
    SPECIAL_TOKENS = {
        "im_start": "<|im_start|>", "im_end": "<|im_end|>",
        "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>",
        "image_pad": "<|image_pad|>", "video_pad": "<|video_pad|>",
    }
    #: what the chat template writes for an image / a video content item (where transformers'
    #: processor expands the pad token to the visual tokens)
    CHAT_MEDIA = {"image": "<|vision_start|><|image_pad|><|vision_end|>",
                  "video": "<|vision_start|><|video_pad|><|vision_end|>"}

    def __init__(self, encoder) -> None:
        self.encoder, self.geometry = encoder, encoder.geometry

    def default_pad_id(self) -> int:
        """Pad id when the tokenizer has no pad token: ``<|endoftext|>``."""
        return self.encoder.tokenizer.convert_tokens_to_ids("<|endoftext|>")

    # ---- spans --------------------------------------------------------------------------------

    def video_timestamps(self, media: Media, frames: Sequence[int],
                         seconds: Sequence[float] | None = None) -> list[float]:
        """Seconds of each temporal patch (mean of its frames), as Qwen3-VL's processor: each
        frame at index / fps, or at ``seconds`` (the frames' true timestamps: keyframe sampling, a
        variable-rate clip)."""
        step = self.geometry.temporal_patch_size
        stamps = [i / media.fps for i in frames] if seconds is None else list(seconds)
        stamps += [stamps[-1]] * (-len(stamps) % step)
        return [(stamps[i] + stamps[i + step - 1]) / 2 for i in range(0, len(stamps), step)]

    def span(self, media: Media, grid_thw: Sequence[int], frames: Sequence[int] = (),
             seconds: Sequence[float] | None = None) -> list[int]:
        """Token ids of one media span (markers, pads, Qwen3-VL timestamps: ``video_timestamps``
        of ``frames`` / ``seconds``)."""
        te = self.encoder
        t, h, w = grid_thw
        per_patch = h * w // self.geometry.merge_size**2
        if media.kind == "image":
            return [te.vision_start, *[te.image_pad] * (t * per_patch), te.vision_end]
        if self.geometry.frame_sampling != "transformers_qwen3":
            return [te.vision_start, *[te.video_pad] * (t * per_patch), te.vision_end]
        ids = [te.vision_start]
        for second in self.video_timestamps(media, frames, seconds):
            ids += te.encode_text(f"<{second:.1f} seconds>")
            ids += [te.vision_start, *[te.video_pad] * per_patch, te.vision_end]
        return [*ids, te.vision_end]

    # ---- decoded pixels, pixel rows and positions ---------------------------------------------

    def finish_decode(self, plan, sample, media_bytes: dict,
                      pixels: list[np.ndarray]) -> list[np.ndarray]:
        """The decoded items as they are (the planned sizes are the model's input)."""
        return pixels

    def pixel_grid(self, kind: str, frames: np.ndarray) -> tuple[int, int, int]:
        """(t, h, w) patch grid of decoded uint8 frames (T, H, W, C): t = ceil(T / temporal
        patch), an image (T = 1) included; its product is the item's pixel row count."""
        geo = self.geometry
        return (-(-frames.shape[0] // geo.temporal_patch_size), frames.shape[1] // geo.patch_size,
                frames.shape[2] // geo.patch_size)

    def pixel_row_width(self, kind: str) -> int:
        """Floats per pixel row: C * temporal_patch_size * patch_size**2 (both kinds)."""
        geo = self.geometry
        return 3 * geo.temporal_patch_size * geo.patch_size**2

    def write_pixel_rows(self, kind: str, frames: np.ndarray, out: np.ndarray) -> None:
        """Normalised patch rows of one item into ``out`` (``QwenVLGeometry.pixel_rows``)."""
        self.geometry.pixel_rows(frames, out=out)

    def position_ids(
        self, ids: list[int], grids: dict[str, list], videos: list[tuple]
    ) -> np.ndarray:
        """(3, L) M-RoPE positions of one sample (``videos``: each video's media, frames and
        true seconds or None)."""
        qwen3 = self.geometry.frame_sampling == "transformers_qwen3"
        steps = None if qwen3 else [self._time_step(*video) for video in videos]
        return mrope_position_ids(
            ids, image_token_id=self.encoder.image_pad, video_token_id=self.encoder.video_pad,
            image_grid_thw=grids["image"], video_grid_thw=grids["video"],
            spatial_merge_size=self.geometry.merge_size, video_time_steps=steps)

    def _time_step(self, media: Media, frames: Sequence[int],
                   seconds: Sequence[float] | None = None) -> float:
        """Qwen2.5-VL M-RoPE time step of a video: tokens_per_second * seconds per grid_t
        (``second_per_grid_t``): temporal patch / sampled fps, the processor's; with true
        ``seconds`` (keyframe sampling, a variable-rate clip), temporal patch * their mean
        spacing."""
        step = self.geometry.temporal_patch_size
        if seconds is not None and len(seconds) > 1 and seconds[-1] > seconds[0]:
            per_grid = np.float32(step * (seconds[-1] - seconds[0]) / (len(seconds) - 1))
        else:
            per_grid = np.float32(step / (len(frames) / media.frames * media.fps))
        return float(np.float32(QWEN2_5_TOKENS_PER_SECOND) * per_grid)
