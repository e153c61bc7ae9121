"""Synthetic model inputs that tests and bench/ share (never the product): several single-row
inputs (``models.verify_inputs.make_inputs``) packed into one batch as the task encoder lays it
out, to compare a packed forward with the same samples alone.
"""

from __future__ import annotations

import torch

from models.multimodal import IGNORE_INDEX


def pack_inputs(rows: list[list[dict]], tail: int = 0, pad_id: int = 0) -> dict:
    """Single-row inputs (``models.verify_inputs.make_inputs``; ``labels`` too when they have
    them) packed into one batch as the task encoder lays it out (batch contract): rows padded to
    one length (``tail`` pads after the longest), media and ``visual_kinds`` in row-major span
    order, ``cu_seqlens`` over the flattened B*L tokens with each row's pad tail as one more
    segment."""
    length = max(sum(c["input_ids"].shape[1] for c in row) for row in rows) + tail
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros(3, len(rows), length, dtype=torch.long)
    bounds, media, kinds = [0], {}, []
    for r, row in enumerate(rows):
        at = 0
        for case in row:
            n = case["input_ids"].shape[1]
            ids[r, at:at + n] = case["input_ids"][0]
            if "labels" in case:
                labels[r, at:at + n] = case["labels"][0]
            positions[:, r, at:at + n] = case["position_ids"][:, 0]
            at += n
            bounds.append(r * length + at)
            for key in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                        "video_grid_thw"):
                if case.get(key) is not None:
                    media.setdefault(key, []).append(case[key])
            video = case.get("video_grid_thw") is not None
            grid = case["video_grid_thw" if video else "image_grid_thw"]
            kinds += [int(video)] * len(grid)
        if at < length:
            bounds.append((r + 1) * length)
    cu = torch.tensor(bounds, dtype=torch.int32)
    labelled = {"labels": labels, "loss_mask": (labels != IGNORE_INDEX).float()}
    return {"input_ids": ids, "position_ids": positions, "visual_kinds": torch.tensor(kinds),
            **(labelled if "labels" in rows[0][0] else {}),
            "cu_seqlens": cu, "max_seqlen": int((cu[1:] - cu[:-1]).max()),
            **{key: torch.cat(parts) for key, parts in media.items()}}
