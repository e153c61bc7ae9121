"""The batch contract: what one encoded sample and one batch hold
(docs/internals/batch_contract.md).

This module owns the typed outputs of the task encoder, ``EncodedSample`` per sample or packed row
and ``VLMBatch`` per batch, for both families (Qwen-VL, Nemotron-Omni: what differs between them,
row widths, row layout, positions, is in docs/internals/batch_contract.md), and
``VLMBatch.model_inputs``: the fields a model's forward takes. The data side builds them
(``energon_tasks.collate``), the recipes hand them to the models.

Images and videos travel in separate tensors; ``visual_kinds`` records how they interleave in the
token stream (``VISUAL_KINDS`` codes, one per item, in span order), which the model needs when both
kinds share one context token (Nemotron-Omni's ``<image>``).
"""

from __future__ import annotations

import torch
from megatron.energon import Batch, Sample, edataclass

#: the tensors of a batch that a model's forward takes by name (besides cu_seqlens / max_seqlen)
MODEL_INPUTS = ("input_ids", "labels", "loss_mask", "position_ids", "pixel_values",
                "image_grid_thw", "pixel_values_videos", "video_grid_thw", "visual_kinds")


@edataclass
class EncodedSample(Sample):
    """One encoded conversation, or several packed into one row (``seq_lens`` has one per sample).

    ``D`` = 3 * temporal_patch_size * patch_size**2 (1176 for Qwen2.5-VL, 1536 for Qwen3-VL);
    Nemotron-Omni: 768 for ``pixel_values`` (one 16x16 patch), 1536 for ``pixel_values_videos``
    (one patch of a frame pair), and ``position_ids`` rows are identical (plain arange).
    """

    input_ids: torch.Tensor  #: (L,) int64
    labels: torch.Tensor  #: (L,) int64, IGNORE_INDEX outside assistant content (+ its <|im_end|>)
    loss_mask: torch.Tensor  #: (L,) float32, 1.0 where labels are supervised
    position_ids: torch.Tensor  #: (3, L) int64 M-RoPE (t, h, w), restarting at 0 per sample
    pixel_values: torch.Tensor  #: (sum_images t*h*w, D) float32, images in conversation order
    image_grid_thw: torch.Tensor  #: (num_images, 3) int64 patch grid of each image
    pixel_values_videos: torch.Tensor  #: (sum_videos t*h*w, D) float32, videos in order
    video_grid_thw: torch.Tensor  #: (num_videos, 3) int64 patch grid of each video
    #: (num_images + num_videos,) int64 VISUAL_KINDS code of each item, in span order
    visual_kinds: torch.Tensor
    seq_lens: torch.Tensor  #: (S,) int64 length of each packed sample (S = 1 unpacked)


@edataclass
class VLMBatch(Batch):
    """A batch of B rows padded to one length L (see docs/internals/batch_contract.md)."""

    input_ids: torch.Tensor  #: (B, L) int64, pad id after each row's tokens
    labels: torch.Tensor  #: (B, L) int64, IGNORE_INDEX on pads and unsupervised tokens
    loss_mask: torch.Tensor  #: (B, L) float32
    attention_mask: torch.Tensor  #: (B, L) bool, True on real tokens (False on pads)
    position_ids: torch.Tensor  #: (3, B, L) int64 M-RoPE, 0 on pads, restarting per sample
    pixel_values: torch.Tensor  #: (sum t*h*w over the batch's images, D) float32
    image_grid_thw: torch.Tensor  #: (num_images, 3) int64, row-major over rows then samples
    pixel_values_videos: torch.Tensor  #: (sum t*h*w over the batch's videos, D) float32
    video_grid_thw: torch.Tensor  #: (num_videos, 3) int64
    #: (num_images + num_videos,) int64 0 = image / 1 = video per item, in span order (row-major)
    visual_kinds: torch.Tensor
    cu_seqlens: torch.Tensor | None  #: (S+1,) int32 sample bounds in the flattened B*L tokens
    max_seqlen: int | None  #: longest segment of cu_seqlens (packed batches only)
    budget_counters: dict  #: {counter: int} budget actions since the previous batch (one worker)
    #: the global data plan's record of the step (``energon_tasks.planned_loader``; None: the
    #: per-rank Energon loader): step, keys, DP balance, blend shares, the plan state
    plan: dict | None = None

    def model_inputs(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The ``MODEL_INPUTS`` tensors on ``device``, by name."""
        return {name: getattr(self, name).to(device) for name in MODEL_INPUTS}
