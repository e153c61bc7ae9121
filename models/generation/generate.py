"""Greedy generation for every family's model: the megatron prefill, then a lean decode step.

``greedy_generate(model, prompts, eos_id=..., max_new_tokens=...)`` left-pads the prompts to the
longest and runs the model's own prefill (``LanguageModelRunner.prefill``: vision encoded once,
DeepStack applied there, the LM over every prompt token with megatron's
``StaticInferenceContext``; causal mask hiding the padding; recurrent layers, which have no
padding mask (Mamba, Gated DeltaNet), keep the pads out of their states through
``decode_step.padded_prefill``) for all rows at once (``_row_groups``: one row at a time only on
megatron >= 0.17 with Mamba layers). Then every row decodes in one batch through
``models.generation.decode_step``: one token per row per step in plain torch over the model's own
weights, keys cached after RoPE (rotated once), Mamba conv / SSM and DeltaNet conv / recurrent
states per row, no megatron per-token machinery. Where that module does not cover the model (it says
which parts it covers; e.g. TP > 1), each group decodes with megatron's own step
(``language_model(...)`` on the context, which re-rotates the cached keys every step). M-RoPE: a
generated token gets the same position on all three axes, ``max(prompt positions) + 1`` for the
first and +1 per step after (what HF's ``rope_deltas`` do). One host sync per step (``tolist``
of the B new tokens) decides which rows stopped; the batch stops when all have. Runs under
``torch.inference_mode``.

Gated DeltaNet layers (``models.layers.gated_deltanet``) keep each row's conv and recurrent state in
the same inference context; their pad hooks (models/generation/decode_deltanet.py: zero conv input,
no state step on pads) make a left-padded batch prefill give each row's states of its prompt alone.

megatron >= 0.17's static-batching Mamba decode step hands the mixer's (1, B, d) projection to
a step that reads it as (B, s, d): right for one row only, so there rows run one at a time
(``_row_groups``; only the fallback decode needs it). Written against megatron-core 0.16.1
(``inference_context=``, ``StaticInferenceContext``) with guards for the older/newer names
(``inference_params=`` / ``InferenceParams``); >= 0.19 reads the process-wide ``InferenceMode``
flag (its Mamba mixer uses the context only when it is set), which is set for the run as
megatron's engines do. Needs a layer spec whose attention takes an explicit mask (the local
spec; ``models.checkpointing.checkpoint.load_checkpoint(..., use_te=False)``). TP > 1: megatron's
decode step (it gathers the vocab-parallel logits, ``runtime_gather_output``); at TP 2 it gives
transformers' tokens for Qwen2.5-VL, Qwen3-VL, Nemotron-Omni (MoE, Mamba) and Qwen3.5 (the Gated
DeltaNet's states split over the TP ranks) (tests/models/test_generate.py, 2 gloo ranks).
"""

from __future__ import annotations

import contextlib
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
    visual_kinds: torch.Tensor | None = None  #: (items,) 0 image / 1 video, in span order


#: a ``Prompt``'s media fields
MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "visual_kinds")


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


def _inference_mode():
    """megatron >= 0.19's ``InferenceMode.active()`` (what its inference engines set); a no-op
    context on versions without it."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return contextlib.nullcontext()
    return InferenceMode.active() if hasattr(InferenceMode, "active") else \
        contextlib.nullcontext()


def _mamba_mixers(lm) -> list:
    try:
        from megatron.core.ssm.mamba_mixer import MambaMixer
    except ImportError:  # pragma: no cover
        return []
    return [m for m in lm.modules() if isinstance(m, MambaMixer)]


def _row_groups(lm, lengths: list[int]) -> list[list[int]]:
    """The prompts (row indices) that prefill as one batch: all of them, except with Mamba
    layers on megatron >= 0.17 (one row at a time; module docstring)."""
    from megatron.core import __version__
    from packaging.version import Version

    if _mamba_mixers(lm) and Version(__version__) >= Version("0.17"):
        return [[row] for row in range(len(lengths))]
    return [list(range(len(lengths)))]


def _unwrap(model):
    while not hasattr(model, "embed") and hasattr(model, "module"):
        model = model.module
    return model


def _cat(tensors: list):
    items = [t for t in tensors if t is not None and t.numel() > 0]
    if not items:
        return None
    return torch.cat(items, 0)


@torch.inference_mode()
def greedy_generate(model, prompts: list[Prompt], *, eos_id: int | list[int], max_new_tokens: int,
                    pad_id: int = 0, stats: GenerationStats | None = None) -> list[list[int]]:
    """Greedy continuation of each prompt, up to (not including) ``eos_id`` or max_new_tokens.

    Args:
        model: a ``QwenVL`` / ``NemotronOmni`` (or a wrapper with ``.module``), in eval mode.
        prompts: the batch; rows are left-padded to the longest (with Mamba layers: see
            ``_row_groups``).
        eos_id: token id(s) that end a row (``<|im_end|>``).
        max_new_tokens: bound on generated tokens per row.
        pad_id: id placed in the padding (never attended to).
        stats: filled with token counts and timings when given.

    Returns:
        The generated token ids of each prompt (without the stop token).

    Raises:
        ValueError: a model under sequence parallelism (megatron's MoE layers at TP > 1), which
            splits the sequence over the TP ranks: a one-token decode step cannot be split; or
            experts over ranks (EP > 1) with other prompts on another EP rank (each rank would
            stop after its own rows, and the experts' collectives need every rank each step).
    """
    qwen = _unwrap(model)
    if qwen.language_model.config.sequence_parallel:
        raise ValueError("greedy_generate: a model under sequence parallelism (MoE layers at "
                         "TP > 1) cannot split a one-token decode step over the TP ranks: load "
                         "it at TP 1, its experts over ranks if it needs them (EP)")
    with _inference_mode():
        return _generate(qwen, qwen.language_model, prompts, eos_id, max_new_tokens, pad_id,
                         stats)


def _left_padded(prompts: list[Prompt], lengths: list[int], pad_id: int, max_new_tokens: int):
    """(ids (B, W), positions (3, B, W + N), key-padding mask (B, W + N)) of a batch left-padded
    to its longest prompt W, built once for the whole run: a generated token sits at
    max(prompt positions) + 1 + step on all three M-RoPE axes; each step slices a prefix (views)."""
    batch, width = len(prompts), max(lengths)
    total = width + max_new_tokens
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    pos = torch.zeros(3, batch, total, dtype=torch.long)
    valid = torch.ones(batch, total, dtype=torch.bool)
    for row, (p, n) in enumerate(zip(prompts, lengths)):
        ids[row, width - n:] = p.input_ids.long()
        pos[:, row, width - n:width] = p.position_ids.reshape(3, -1).long()
        valid[row, :width - n] = False
    next_pos = pos[:, :, :width].amax(dim=(0, 2)) + 1  # (B,) first generated position of each row
    pos[:, :, width:] = (next_pos[:, None] + torch.arange(max_new_tokens))[None]
    return ids, pos, valid


def _decode(first, step, eos: set[int], max_new_tokens: int) -> tuple[list[list[int]], int]:
    """(tokens per row, forwards) of the greedy decode after the prefill's ``first`` logits
    (B, V): ``step(tokens (B,)) -> logits (B, V)`` feeds one token per row (rows that stopped
    too: the batch keeps its shape)."""
    logits = first
    out: list[list[int]] = [[] for _ in range(logits.shape[0])]
    live = list(range(logits.shape[0]))  # rows that have not stopped yet
    forwards = 0
    for index in range(max_new_tokens):
        token = logits.argmax(-1)  # (B,)
        values = token.tolist()  # the one host sync per step
        live = [row for row in live if values[row] not in eos]
        for row in live:
            out[row].append(values[row])
        if not live or index == max_new_tokens - 1:
            break
        logits = step(token)
        forwards += 1
    return out, forwards


def _megatron_step(lm, context, kwarg: dict, pos, valid, width: int):
    """megatron's own decode step over one prefill group (``language_model(...)`` on the new
    token's embedding; the context holds keys before RoPE and the Mamba states). ``pos`` /
    ``valid``: the group's (3, b, W + N) positions and (b, W + N) real-token mask."""
    if hasattr(context, "enable_decode_mode"):
        context.enable_decode_mode()
    hidden = None if bool(valid[:, :width].all()) else ~valid[:, None, None, :]

    def step(token):
        length = context.sequence_len_offset + 1
        # plain token embedding: a generated context-token id must not be read as a visual slot
        emb = lm.embedding(input_ids=token[:, None], position_ids=None)
        mask = None if hidden is None else hidden[..., :length]
        logits = lm(input_ids=None, position_ids=pos[:, :, :length], attention_mask=mask,
                    decoder_input=emb, runtime_gather_output=True, **kwarg)[:, -1]
        context.sequence_len_offset += 1
        return logits

    return step


def same_prompts_on_expert_ranks(ids: torch.Tensor, prompts: list[Prompt]) -> bool:
    """Whether every expert-parallel rank generates for the same prompts: the fingerprints (first
    dimension, size and two weighted sums) of their (B, W) left-padded token ids and of each of
    their media fields (``MEDIA``, concatenated over the prompts) are equal (one all-gather;
    True at EP 1, without one). Generation needs it: the experts' collectives need every EP rank
    in each step, so all must stop together, and the lean MoE step sums each rank's experts
    over the same rows with one all-reduce (``decode_layers.moe_step``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_world_size() == 1:
        return True
    parts = []
    for tensor in (ids, *(_cat([getattr(p, name) for p in prompts]) for name in MEDIA)):
        if tensor is None:
            parts.append(torch.full((4,), -1.0, dtype=torch.float64))
            continue
        flat = tensor.reshape(-1).to(device="cpu", dtype=torch.float64)
        at = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
        parts.append(torch.stack([torch.tensor(float(tensor.shape[0])),
                                  torch.tensor(float(flat.numel())),
                                  (flat * at).sum(), (flat * torch.sin(at)).sum()]))
    mine = torch.cat(parts).to(ids.device)
    group = parallel_state.get_expert_model_parallel_group()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return all(torch.equal(other, mine) for other in every)


def _generate(qwen, lm, prompts: list[Prompt], eos_id, max_new_tokens: int, pad_id: int,
              stats: GenerationStats | None) -> list[list[int]]:
    """``greedy_generate``: the prefill of each row group (``_row_groups``; all prompt tokens,
    vision encoded once), then the lean decode of all rows (``models.generation.decode_step``) or,
    where it does not cover the model, megatron's decode step per group."""
    from models.generation import decode_step

    device = next(qwen.parameters()).device
    eos = {eos_id} if isinstance(eos_id, int) else set(eos_id)
    start = time.perf_counter()
    lengths = [int(p.input_ids.numel()) for p in prompts]
    width = max(lengths)
    ids, pos, valid = (t.to(device) for t in _left_padded(prompts, lengths, pad_id,
                                                           max_new_tokens))
    if not same_prompts_on_expert_ranks(ids, prompts):
        raise ValueError("greedy_generate with experts over ranks (EP > 1) needs the same prompts "
                         "on every expert-parallel rank (their steps must run together)")
    kwarg_name = _context_kwarg(lm)
    groups, firsts = [], []
    for rows in _row_groups(lm, lengths):
        span = max(lengths[row] for row in rows)  # the group's own left-padded width
        cols = slice(width - span, None)
        groups.append((_prefill(qwen, [prompts[row] for row in rows], ids[rows, width - span:],
                                pos[:, rows, cols], valid[rows, cols], span, max_new_tokens,
                                kwarg_name, device), rows, span))
        firsts.append(groups[-1][0][1])
    prefill_seconds = time.perf_counter() - start
    contexts = [(context, rows, span) for (context, _), rows, span in groups]
    first = torch.empty(len(prompts), firsts[0].shape[-1], dtype=firsts[0].dtype, device=device)
    for (_, rows, _), logits in zip(groups, firsts):
        first[rows] = logits
    decoder = decode_step.build(lm, contexts, pos, valid, width)
    if decoder is not None:
        out, forwards = _decode(first, decoder, eos, max_new_tokens)
    else:  # megatron's own decode step, group by group
        out, forwards = [[] for _ in prompts], 0
        for context, rows, span in contexts:
            cols = slice(width - span, None)
            step = _megatron_step(lm, context, {kwarg_name: context}, pos[:, rows, cols],
                                  valid[rows, cols], span)
            tokens, n = _decode(first[rows], step, eos, max_new_tokens)
            for row, t in zip(rows, tokens):
                out[row] = t
            forwards += n
    if stats is not None:
        stats.prompts += len(prompts)
        stats.prompt_tokens += sum(lengths)
        stats.generated_tokens += sum(len(o) for o in out)
        stats.forwards += len(groups) + forwards
        stats.seconds += time.perf_counter() - start
        stats.prefill_seconds += prefill_seconds
        stats.extra["lean_decode"] = decoder is not None
    return out


def _prefill(qwen, prompts: list[Prompt], ids, pos, valid, width: int, max_new_tokens: int,
             kwarg_name: str, device):
    """(megatron context, last-position logits (b, V)) of one group's prefill: ``ids`` (b, w)
    left-padded, ``pos`` / ``valid`` the group's (3, b, w + N) positions and (b, w + N) mask;
    recurrent layers keep the pads out of their states (``decode_step.padded_prefill``)."""
    from models.generation import decode_step

    def media(name):
        value = _cat([getattr(p, name) for p in prompts])
        return None if value is None else value.to(device)

    context = _make_context(len(prompts), width + max_new_tokens)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    mask = ~(causal[None] & valid[:, None, :width])[:, None]  # (b, 1, w, w), True = hidden
    with decode_step.padded_prefill(qwen.language_model, valid[:, :width]):
        logits = qwen.prefill(ids, pos[:, :, :width], mask, media("pixel_values"),
                              media("image_grid_thw"), media("pixel_values_videos"),
                              media("video_grid_thw"), media("visual_kinds"),
                              **{kwarg_name: context})
    context.sequence_len_offset += width
    return context, logits[:, -1]
