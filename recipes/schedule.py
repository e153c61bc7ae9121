"""The optimizer step's schedule and loss normalisation.

This module owns ``lr_at`` (linear warmup, then cosine decay to ``min_lr``; the scheduler's state is
the step), ``loss_tokens`` (the supervised tokens of a batch after the model's shift) and
``step_token_total`` (those of one optimizer step over every DP replica, the loss divisor, so the
loss is per token whatever the micro-batching, DP and CP).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from contract.batch import VLMBatch
from contract.constants import IGNORE_INDEX


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR of optimizer step ``step`` (0-based): linear warmup, then cosine to ``min_lr``."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def loss_tokens(batch: VLMBatch) -> int:
    """Supervised tokens of a batch after the model's shift (what its loss mask counts)."""
    shifted = batch.loss_mask[:, 1:] * (batch.labels[:, 1:] != IGNORE_INDEX)
    return int(shifted.sum())


def mtp_loss_tokens(batch: VLMBatch) -> int:
    """Tokens of a batch the MTP loss counts (``model.train_mtp``): a label two ahead in the
    same packed sample (``models.multimodal.mtp_targets``)."""
    from models.multimodal import mtp_targets

    return int(mtp_targets(batch.labels, batch.loss_mask, batch.cu_seqlens)[1].sum())


def step_token_total(local_tokens: int) -> int:
    """Supervised tokens of one optimizer step over all DP replicas (CP ranks share samples)."""
    from megatron.core import parallel_state as ps

    total = torch.tensor([float(local_tokens)])
    if dist.is_initialized() and ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(total, group=ps.get_data_parallel_group())
    return int(total.item())
