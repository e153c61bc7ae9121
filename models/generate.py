"""Greedy generation for the Qwen-VL model with a KV cache (megatron-core static inference context).

``greedy_generate(model, prompts, eos_id=..., max_new_tokens=...)`` runs one batched prefill over
left-padded prompts (vision encoded once, DeepStack applied there), then one single-token forward
per step that reads the keys/values of earlier tokens from megatron's ``StaticInferenceContext``
(no full forward over the sequence per new token). Masks: prefill is causal and hides the left
padding; each decode step attends to every real token so far. M-RoPE: a generated token gets the
same position on all three axes, ``max(prompt positions) + 1`` for the first and +1 per step after
(what HF's ``rope_deltas`` do). megatron keeps cached keys before RoPE and rotates them with the
rotary table of the whole sequence at each step, so the (3, B, L) positions of the whole
sequence so far are passed at every step (the rotary table is cheap; the K/V projections are not
recomputed).

Written against megatron-core 0.16.1 (``inference_context=``, ``StaticInferenceContext``) with
guards for the older/newer names (``inference_params=`` / ``InferenceParams``). Needs a layer spec
whose attention takes an explicit mask (the local spec; ``models.checkpoint.load_checkpoint(...,
use_te=False)``). TP > 1: megatron gathers the vocab-parallel logits (``runtime_gather_output``).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Prompt:
    """One prompt: token ids (L,), M-RoPE positions (3, L) and its media (task-encoder layout)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None


@dataclass(slots=True)
class GenerationStats:
    prompts: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def _make_context(batch: int, max_len: int):
    try:
        from megatron.core.inference.contexts import StaticInferenceContext
        return StaticInferenceContext(batch, max_len)
    except ImportError:  # older megatron-core
        from megatron.core import InferenceParams
        return InferenceParams(batch, max_len)


def _context_kwarg(language_model) -> str:
    params = inspect.signature(language_model.forward).parameters
    return "inference_context" if "inference_context" in params else "inference_params"


def _unwrap(model):
    while not hasattr(model, "embed") and hasattr(model, "module"):
        model = model.module
    return model


def _cat(tensors: list):
    items = [t for t in tensors if t is not None and t.numel() > 0]
    if not items:
        return None
    return torch.cat(items, 0)


@torch.no_grad()
def greedy_generate(model, prompts: list[Prompt], *, eos_id: int | list[int], max_new_tokens: int,
                    pad_id: int = 0, stats: GenerationStats | None = None) -> list[list[int]]:
    """Greedy continuation of each prompt, up to (not including) ``eos_id`` or max_new_tokens.

    Args:
        model: a ``QwenVL`` (or a wrapper with ``.module``), in eval mode.
        prompts: the batch; rows are left-padded to the longest.
        eos_id: token id(s) that end a row (``<|im_end|>``).
        max_new_tokens: bound on generated tokens per row.
        pad_id: id placed in the padding (never attended to).
        stats: filled with token counts and timings when given.

    Returns:
        The generated token ids of each prompt (without the stop token).
    """
    qwen = _unwrap(model)
    lm = qwen.language_model
    device = next(qwen.parameters()).device
    eos = {eos_id} if isinstance(eos_id, int) else set(eos_id)
    start = time.perf_counter()
    batch = len(prompts)
    lengths = [int(p.input_ids.numel()) for p in prompts]
    width = max(lengths)
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    pos = torch.zeros(3, batch, width, dtype=torch.long)
    valid = torch.zeros(batch, width, dtype=torch.bool)
    for row, (p, n) in enumerate(zip(prompts, lengths)):
        ids[row, width - n:] = p.input_ids.long()
        pos[:, row, width - n:] = p.position_ids.reshape(3, -1).long()
        valid[row, width - n:] = True
    next_pos = pos.amax(dim=(0, 2)) + 1  # (B,) first generated position of each row

    def media(name):
        value = _cat([getattr(p, name) for p in prompts])
        return None if value is None else value.to(device)

    ids, pos, valid = ids.to(device), pos.to(device), valid.to(device)
    total = width + max_new_tokens
    context = _make_context(batch, total)
    kwarg = _context_kwarg(lm)

    # ---- prefill: all prompt tokens, vision encoded once
    emb, deepstack = qwen.embed(ids, media("pixel_values"), media("image_grid_thw"),
                                media("pixel_values_videos"), media("video_grid_thw"))
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    mask = ~(causal[None] & valid[:, None, :])[:, None]  # (B, 1, L, L), True = hidden
    qwen._deepstack = deepstack
    try:
        logits = lm(input_ids=None, position_ids=pos, attention_mask=mask, decoder_input=emb,
                    runtime_gather_output=True, **{kwarg: context})
    finally:
        qwen._deepstack = None
    context.sequence_len_offset += width
    forwards = 1
    prefill_seconds = time.perf_counter() - start

    out: list[list[int]] = [[] for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    all_pos, all_valid = pos, valid
    for step in range(max_new_tokens):
        token = logits[:, -1].float().argmax(-1)  # (B,)
        for row in range(batch):
            if not done[row]:
                t = int(token[row])
                if t in eos:
                    done[row] = True
                else:
                    out[row].append(t)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        if hasattr(context, "enable_decode_mode"):
            context.enable_decode_mode()
        step_pos = (next_pos + step)[None, :, None].expand(3, batch, 1)
        all_pos = torch.cat([all_pos, step_pos], dim=2)
        all_valid = torch.cat([all_valid, torch.ones(batch, 1, dtype=torch.bool, device=device)],
                              dim=1)
        # plain token embedding: a generated context-token id must not be read as a visual slot
        emb = lm.embedding(input_ids=token[:, None], position_ids=None)
        mask = ~all_valid[:, None, None, :]  # (B, 1, 1, L so far)
        logits = lm(input_ids=None, position_ids=all_pos, attention_mask=mask,
                    decoder_input=emb, runtime_gather_output=True, **{kwarg: context})
        context.sequence_len_offset += 1
        forwards += 1
    if stats is not None:
        stats.prompts += batch
        stats.prompt_tokens += sum(lengths)
        stats.generated_tokens += sum(len(o) for o in out)
        stats.forwards += forwards
        stats.seconds += time.perf_counter() - start
        stats.prefill_seconds += prefill_seconds
    return out
