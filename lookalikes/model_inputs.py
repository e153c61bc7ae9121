"""Synthetic model inputs that tests and bench/ share (never the product): several single-row
inputs (``models.hf.verify_inputs.make_inputs``) packed into one batch by the task encoder's own
packer and collator (``energon_tasks.collate``), to compare a packed forward with the same samples
alone.
"""

from __future__ import annotations

import torch

from contract.batch import EncodedSample
from contract.constants import IGNORE_INDEX
from energon_tasks.collate import collate, pack_samples

_MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def _encoded(case: dict, key: str) -> EncodedSample:
    """One single-row input (tensors with a batch dimension of 1) as an encoded sample."""
    n = case["input_ids"].shape[1]
    labels = (case["labels"][0] if "labels" in case
              else torch.full((n,), IGNORE_INDEX, dtype=torch.long))
    media = {name: case[name] if case.get(name) is not None
             else torch.zeros((0, 3) if name.endswith("grid_thw") else (0, 0))
             for name in _MEDIA}
    video = case.get("video_grid_thw") is not None
    items = len(media["video_grid_thw" if video else "image_grid_thw"])
    return EncodedSample(
        __key__=key, __restore_key__=(), input_ids=case["input_ids"][0].long(),
        labels=labels.long(), loss_mask=(labels != IGNORE_INDEX).float(),
        position_ids=case["position_ids"][:, 0].long(), **media,
        visual_kinds=torch.full((items,), int(video), dtype=torch.long),
        seq_lens=torch.tensor([n]))


def pack_inputs(rows: list[list[dict]], tail: int = 0, pad_id: int = 0) -> dict:
    """Single-row inputs (``models.hf.verify_inputs.make_inputs``; ``labels`` too when they have
    them) packed into one batch as the task encoder lays it out (batch contract): the samples of
    a row packed, rows padded to one length (``tail`` pads after the longest), media and
    ``visual_kinds`` in row-major span order, ``cu_seqlens`` over the flattened B*L tokens with
    each row's pad tail as one more segment. Media keys no sample has are left out."""
    packed = [pack_samples([_encoded(case, f"{r}.{i}") for i, case in enumerate(row)])
              for r, row in enumerate(rows)]
    length = max(len(row.input_ids) for row in packed) + tail
    batch = collate(packed, pad_id=pad_id, multiple=1, fixed_length=length, packed=True,
                    budget_counters={})
    labelled = {"labels": batch.labels, "loss_mask": batch.loss_mask}
    return {"input_ids": batch.input_ids, "position_ids": batch.position_ids,
            "visual_kinds": batch.visual_kinds, **(labelled if "labels" in rows[0][0] else {}),
            "cu_seqlens": batch.cu_seqlens, "max_seqlen": batch.max_seqlen,
            **{name: getattr(batch, name) for name in _MEDIA if getattr(batch, name).numel()}}
