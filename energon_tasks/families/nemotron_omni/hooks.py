"""The Nemotron-Omni task-encoder hooks: tokens, spans, tiles, pixel rows and positions.

``NemotronOmniHooks`` is what ``energon_tasks.task_encoder.VLMTaskEncoder`` asks for every step
that depends on the model (``energon_tasks.profiles`` names it for ``nemotron_omni`` and
``nemotron_omni_tiled``); cooking, the budget plan (``energon_tasks.budget``, driven by this
package's ``geometry``), decoding, labels, packing and batching are the encoder's own.
What differs from Qwen-VL, each checked against transformers' ``nemotron_h_omni`` processors /
model:

- tokens: ChatML (``<|im_start|>role\\n ... <|im_end|>\\n``) as Qwen; an image span is ``<img>`` +
  ``<image>`` x tokens + ``</img>`` (tokens = gh*gw/4 dynamic, 256 per tile tiled); a video span is
  the processor's ``replace_video_token`` text: per frame pair ``"Frame k sampled at ... seconds
  and frame k+1 sampled at ... seconds: "`` + ``<img>`` + ``<image>`` x (h*w/4) + ``</img>``, pairs
  joined by ``"\\n"``. The tokenizer has no video context token, so ``video_pad == image_pad``
  (``<image>``), as in transformers; the batch's ``visual_kinds`` (image / video per item, in span
  order) tells the model which runs are videos (docs/internals/batch_contract.md);
- tiled images are decoded at the grid size, cut into 512x512 tiles (row-major) and followed by a
  512x512 thumbnail decoded from the source (InternVL's ``dynamic_preprocess``);
- pixel rows (``NemotronOmniGeometry.pixel_rows``): images one 16x16 patch per row (768 floats),
  videos one patch of a frame pair per row (1536 floats), normalised exactly as the processors;
- ``position_ids``: three identical rows of ``arange`` (the language model has no rotary).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from energon_tasks.decode import decode_image
from energon_tasks.sample_format import CanonicalSample, Media

if TYPE_CHECKING:  # annotations only: the planner imports the config, which imports the profiles
    from energon_tasks import budget

#: The special tokens the Nemotron-Omni encoder needs: the ChatML markers and the image span
#: markers / context token of transformers' ``NemotronH_Omni_Reasoning_V3Processor`` (videos use
#: ``<image>`` too: the tokenizer has no video context token).
NEMOTRON_OMNI_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<img>", "</img>", "<image>")


class NemotronOmniHooks:
    """The model-dependent steps of the encoder for Nemotron-Omni (dynamic and tiled images).

    The encoder's token attributes keep their names: ``image_pad`` (``<image>``), ``video_pad``
    (also ``<image>``), ``vision_start`` (``<img>``), ``vision_end`` (``</img>``), ``im_start``,
    ``im_end``, ``pad_id``.

    Args:
        encoder: the ``VLMTaskEncoder`` these hooks serve.
    """

    #: special tokens a tokenizer must have
    REQUIRED_TOKENS = NEMOTRON_OMNI_SPECIAL_TOKENS
    #: encoder attribute -> special token; each attribute holds the token's id
    SPECIAL_TOKENS = {
        "im_start": "<|im_start|>", "im_end": "<|im_end|>",
        "vision_start": "<img>", "vision_end": "</img>",
        "image_pad": "<image>", "video_pad": "<image>",
    }
    #: what the chat template writes for an image / a video content item (transformers'
    #: processor expands it to ``<img>`` + visual tokens + ``</img>`` groups)
    CHAT_MEDIA = {"image": "<image>", "video": "<video>"}

    def __init__(self, encoder) -> None:
        self.encoder, self.geometry = encoder, encoder.geometry

    def default_pad_id(self) -> int:
        """Pad id when the tokenizer has no pad token: its eos, else ``<|im_end|>``."""
        eos = self.encoder.tokenizer.eos_token_id
        return self.encoder.im_end if eos is None else eos

    # ---- spans --------------------------------------------------------------------------------

    def span(self, media: Media, grid_thw: Sequence[int], frames: Sequence[int] = (),
             seconds: Sequence[float] | None = None) -> list[int]:
        """Token ids of one media span: an image ``<img>`` + ``<image>`` x tokens + ``</img>``; a
        video ``video_span_text`` tokenized (labels at ``seconds`` when given: the frames' true
        timestamps, keyframe sampling or a variable-rate clip).

        Each frame-pair label is tokenized with the newline before it ("\\n" + label), as the
        processor's text splits at the special tokens.
        """
        te, geo = self.encoder, self.geometry
        if media.kind == "image":
            t, h, w = grid_thw
            return [te.vision_start, *[te.image_pad] * (t * (h * w // geo.merge_size**2)),
                    te.vision_end]
        pairs, h, w = grid_thw
        labels = geo.video_labels(frames, media.fps, seconds)
        if len(labels) != pairs:
            raise ValueError(f"{media.part}: {len(labels)} frame-pair labels for {pairs} pairs")
        chunk = [te.vision_start, *[te.video_pad] * (h * w // geo.merge_size**2), te.vision_end]
        ids: list[int] = []
        for number, label in enumerate(labels):
            ids += te.encode_text(("\n" if number else "") + label) + chunk
        return ids

    # ---- decoded pixels -------------------------------------------------------------------------

    def finish_decode(self, plan: budget.Plan, sample: CanonicalSample, media_bytes: dict,
                      pixels: list[np.ndarray]) -> list[np.ndarray]:
        """A tiled image becomes (tiles, 512, 512, 3): its grid tiles in row-major order, then
        the thumbnail (the source decoded at 512x512 again, as InternVL resizes the original
        image for it). Dynamic images and videos stay as decoded."""
        geo = self.geometry
        if geo.image_mode != "tiled":
            return pixels
        out = list(pixels)
        for number, item in enumerate(plan.media):
            if item.kind != "image":
                continue
            media, image = sample.media[item.index], out[number][0]
            grid_tiles = (image.shape[0] // geo.tile_size) * (image.shape[1] // geo.tile_size)
            thumbnail = None
            if item.grid.grid_thw[0] > grid_tiles:
                thumbnail = decode_image(
                    media_bytes[media.part], size=(geo.tile_size, geo.tile_size),
                    max_source_pixels=self.encoder.budget.max_source_pixels,
                    name=f"{plan.key}.{media.part}",
                    **self.encoder.image_decode_options()).pixels
            out[number] = geo.tiles(image, thumbnail)
        return out

    # ---- pixel rows and positions ---------------------------------------------------------------

    def pixel_grid(self, kind: str, frames: np.ndarray) -> tuple[int, int, int]:
        """Images: (frames, h, w), i.e. (1, gh, gw) dynamic, (tiles, 32, 32) tiled; videos:
        (pairs, gh, gw)."""
        geo = self.geometry
        step = geo.temporal_patch_size if kind == "video" else 1
        return (-(-frames.shape[0] // step), frames.shape[1] // geo.patch_size,
                frames.shape[2] // geo.patch_size)

    def pixel_row_width(self, kind: str) -> int:
        """768 floats per image row (3x16x16), 1536 per video row (2x3x16x16)."""
        geo = self.geometry
        return (geo.temporal_patch_size if kind == "video" else 1) * 3 * geo.patch_size**2

    def write_pixel_rows(self, kind: str, frames: np.ndarray, out: np.ndarray) -> None:
        """``NemotronOmniGeometry.pixel_rows`` of one item into ``out``."""
        self.geometry.pixel_rows(frames, kind=kind, out=out)

    def position_ids(
        self, ids: list[int], grids: dict[str, list], videos: list[tuple]
    ) -> np.ndarray:
        """(3, L): three identical rows 0..L-1 (no rotary; the shape keeps collate unchanged)."""
        return np.tile(np.arange(len(ids), dtype=np.int64), (3, 1))
