"""The batch contract: what one encoded sample and one batch hold, and how they are built.

This module owns the typed outputs of the task encoder (``EncodedSample`` per sample or packed
row, ``QwenVLBatch`` per batch: the contract ``models/`` consumes, documented field by field in
docs/batch_contract.md) and the pure tensor operations between them: packing samples into one row
(``pack_samples``) and padding rows into a batch (``collate``). Both task encoders (Qwen-VL,
Nemotron-Omni) produce these same fields; what differs (row widths, row layout, positions) is in
docs/batch_contract.md.

Images and videos travel in separate tensors; ``visual_kinds`` records how they interleave in the
token stream (``VISUAL_KINDS`` codes, one per item, in span order), which the model needs when both
kinds share one context token (Nemotron-Omni's ``<image>``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.energon import Batch, Sample, edataclass

from contract.constants import IGNORE_INDEX


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
class QwenVLBatch(Batch):
    """A batch of B rows padded to one length L (see docs/batch_contract.md)."""

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


def _cat(tensors: Sequence[torch.Tensor], empty_shape: tuple[int, ...], dtype) -> torch.Tensor:
    tensors = [t for t in tensors if t.numel()]
    return torch.cat(tensors) if tensors else torch.zeros(empty_shape, dtype=dtype)


def pack_samples(samples: Sequence[EncodedSample]) -> EncodedSample:
    """Concatenate encoded samples into one row; positions keep restarting per sample.

    Raises:
        ValueError: no samples.
    """
    if not samples:
        raise ValueError("pack_samples needs at least one sample")
    width, video_width = samples[0].pixel_values.shape[1], samples[0].pixel_values_videos.shape[1]
    return EncodedSample(
        __key__=",".join(s.__key__ for s in samples),
        __restore_key__=(),  # Energon sets the pack's restore key
        __subflavors__=samples[0].__subflavors__,
        __sources__=tuple(src for s in samples for src in (s.__sources__ or ())),
        input_ids=torch.cat([s.input_ids for s in samples]),
        labels=torch.cat([s.labels for s in samples]),
        loss_mask=torch.cat([s.loss_mask for s in samples]),
        position_ids=torch.cat([s.position_ids for s in samples], dim=1),
        pixel_values=_cat([s.pixel_values for s in samples], (0, width), torch.float32),
        image_grid_thw=_cat([s.image_grid_thw for s in samples], (0, 3), torch.int64),
        pixel_values_videos=_cat([s.pixel_values_videos for s in samples], (0, video_width),
                                 torch.float32),
        video_grid_thw=_cat([s.video_grid_thw for s in samples], (0, 3), torch.int64),
        visual_kinds=_cat([s.visual_kinds for s in samples], (0,), torch.int64),
        seq_lens=torch.cat([s.seq_lens for s in samples]),
    )


def padded_length(longest: int, *, multiple: int, fixed_length: int | None) -> int:
    """Row length of a batch: ``fixed_length`` if set, else ``longest`` rounded up to ``multiple``.

    Raises:
        ValueError: a row is longer than ``fixed_length``.
    """
    if fixed_length is not None:
        if longest > fixed_length:
            raise ValueError(f"a row of {longest} tokens exceeds fixed length {fixed_length}")
        return fixed_length
    return -(-longest // multiple) * multiple


def collate(
    rows: Sequence[EncodedSample],
    *,
    pad_id: int,
    multiple: int,
    fixed_length: int | None,
    packed: bool,
    budget_counters: dict[str, int],
) -> QwenVLBatch:
    """Pad rows to one length and concatenate their vision inputs (order kept).

    Args:
        rows: encoded samples or packed rows.
        pad_id: token id written on pads.
        multiple: the length is rounded up to a multiple of this.
        fixed_length: pad every batch to exactly this length (pipeline parallel) when set.
        packed: build ``cu_seqlens`` over the flattened rows (each row's pad tail is a segment).
        budget_counters: counters carried to the training loop with this batch.

    Raises:
        ValueError: a row longer than ``fixed_length``.
    """
    length = padded_length(max(len(r.input_ids) for r in rows), multiple=multiple,
                           fixed_length=fixed_length)
    batch_size = len(rows)
    input_ids = torch.full((batch_size, length), pad_id, dtype=torch.int64)
    labels = torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.int64)
    loss_mask = torch.zeros((batch_size, length), dtype=torch.float32)
    attention = torch.zeros((batch_size, length), dtype=torch.bool)
    positions = torch.zeros((3, batch_size, length), dtype=torch.int64)
    bounds = [0]
    for i, row in enumerate(rows):
        n = len(row.input_ids)
        input_ids[i, :n], labels[i, :n], loss_mask[i, :n] = row.input_ids, row.labels, row.loss_mask
        attention[i, :n] = True
        positions[:, i, :n] = row.position_ids
        starts = i * length + torch.cumsum(row.seq_lens, 0)
        bounds += starts.tolist() + ([(i + 1) * length] if n < length else [])
    cu_seqlens = max_seqlen = None
    if packed:
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    width, video_width = rows[0].pixel_values.shape[1], rows[0].pixel_values_videos.shape[1]
    return QwenVLBatch(
        __key__=[r.__key__ for r in rows],
        __restore_key__=(),
        __subflavors__=[r.__subflavors__ for r in rows],
        input_ids=input_ids,
        labels=labels,
        loss_mask=loss_mask,
        attention_mask=attention,
        position_ids=positions,
        pixel_values=_cat([r.pixel_values for r in rows], (0, width), torch.float32),
        image_grid_thw=_cat([r.image_grid_thw for r in rows], (0, 3), torch.int64),
        pixel_values_videos=_cat([r.pixel_values_videos for r in rows], (0, video_width),
                                 torch.float32),
        video_grid_thw=_cat([r.video_grid_thw for r in rows], (0, 3), torch.int64),
        visual_kinds=_cat([r.visual_kinds for r in rows], (0,), torch.int64),
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        budget_counters=dict(budget_counters),
    )
