"""Packing and collation: the pure tensor operations between the batch contract's types.

This module owns how encoded samples (``contract.batch.EncodedSample``) are packed into one row
(``pack_samples``, positions restarting per sample) and how rows are padded into one batch
(``collate`` -> ``contract.batch.VLMBatch``; ``padded_length``). Used by the task encoder's
packing and batch hooks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contract.batch import EncodedSample, VLMBatch
from contract.constants import IGNORE_INDEX


def _cat(tensors: Sequence[torch.Tensor], empty_shape: tuple[int, ...], dtype) -> torch.Tensor:
    tensors = [t for t in tensors if t.numel()]
    return torch.cat(tensors) if tensors else torch.zeros(empty_shape, dtype=dtype)


def _visual_fields(items: Sequence[EncodedSample]) -> dict[str, torch.Tensor]:
    """The vision inputs of ``items`` concatenated in order (empty tensors of the right width
    when none has any)."""
    width, video_width = items[0].pixel_values.shape[1], items[0].pixel_values_videos.shape[1]
    return {
        "pixel_values": _cat([i.pixel_values for i in items], (0, width), torch.float32),
        "image_grid_thw": _cat([i.image_grid_thw for i in items], (0, 3), torch.int64),
        "pixel_values_videos": _cat([i.pixel_values_videos for i in items], (0, video_width),
                                    torch.float32),
        "video_grid_thw": _cat([i.video_grid_thw for i in items], (0, 3), torch.int64),
        "visual_kinds": _cat([i.visual_kinds for i in items], (0,), torch.int64),
    }


def pack_samples(samples: Sequence[EncodedSample]) -> EncodedSample:
    """Concatenate encoded samples into one row; positions keep restarting per sample.

    Raises:
        ValueError: no samples.
    """
    if not samples:
        raise ValueError("pack_samples needs at least one sample")
    return EncodedSample(
        __key__=",".join(s.__key__ for s in samples),
        __restore_key__=(),  # Energon sets the pack's restore key
        __subflavors__=samples[0].__subflavors__,
        __sources__=tuple(src for s in samples for src in (s.__sources__ or ())),
        input_ids=torch.cat([s.input_ids for s in samples]),
        labels=torch.cat([s.labels for s in samples]),
        loss_mask=torch.cat([s.loss_mask for s in samples]),
        position_ids=torch.cat([s.position_ids for s in samples], dim=1),
        **_visual_fields(samples),
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
) -> VLMBatch:
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
    return VLMBatch(
        __key__=[r.__key__ for r in rows],
        __restore_key__=(),
        __subflavors__=[r.__subflavors__ for r in rows],
        input_ids=input_ids,
        labels=labels,
        loss_mask=loss_mask,
        attention_mask=attention,
        position_ids=positions,
        **_visual_fields(rows),
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        budget_counters=dict(budget_counters),
    )
