"""Greedy generation for every family's model with a KV cache (megatron-core static inference
context).

``greedy_generate(model, prompts, eos_id=..., max_new_tokens=...)`` runs one batched prefill over
left-padded prompts (vision encoded once, DeepStack applied there), then one single-token forward
per step that reads the keys/values of earlier tokens from megatron's ``StaticInferenceContext``
(no full forward over the sequence per new token). Masks: prefill is causal and hides the left
padding; each decode step attends to every real token so far (a key-padding mask only when the
batch is padded). M-RoPE: a generated token gets the same position on all three axes,
``max(prompt positions) + 1`` for the first and +1 per step after (what HF's ``rope_deltas`` do).

Per-step cost: everything that does not change during the run is built once (the (3, B, L)
positions and the padding mask of prompt + every generated token; steps slice prefixes). megatron
keeps cached keys before RoPE and rotates them with the rotary table of the whole sequence at each
step; for the Qwen-VL GPTModel the table of the whole run is computed once and the decode step
calls the model's own decoder and output layer (``_fast_decoder``: bitwise the logits of
``language_model(...)``, which would recompute the table and copy the logits every step); other
language models (Nemotron's MambaModel) go through ``language_model(...)``.

Recurrent (Mamba, Gated DeltaNet) layers: megatron's mixer (and ``models.gated_deltanet``)
keeps each row's conv and SSM state in the same inference context (filled by the prefill,
updated in place by every decode step). It has no padding mask, so a left pad would enter the
state: with recurrent layers, prompts of unequal
length are generated in groups of equal length (each group one batched run; same tokens as
alone). megatron >= 0.17's static-batching decode step hands the mixer's (1, B, d) projection to
a step that reads it as (B, s, d): right for one row only, so there rows run one at a time
(``_row_groups``). One host sync per step
(``tolist`` of the B new tokens) decides which rows stopped; the batch stops when all have. Runs
under ``torch.inference_mode`` (no autograd bookkeeping).

Written against megatron-core 0.16.1 (``inference_context=``, ``StaticInferenceContext``) with
guards for the older/newer names (``inference_params=`` / ``InferenceParams``); >= 0.19 reads
the process-wide ``InferenceMode`` flag (its Mamba mixer uses the context only when it is set),
which is set for the run as megatron's engines do. Needs a layer spec
whose attention takes an explicit mask (the local spec; ``models.checkpoint.load_checkpoint(...,
use_te=False)``). TP > 1: megatron gathers the vocab-parallel logits (``runtime_gather_output``).
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


def _row_groups(lm, lengths: list[int]) -> list[list[int]]:
    """The prompts (row indices) that run as one batch: all of them, except with recurrent layers
    (megatron's Mamba, ``mamba_state_shapes_per_request``; ``models.gated_deltanet``'s layers,
    ``recurrent_state``): equal lengths together, and with Mamba one row at a time on megatron
    >= 0.17 (module docstring)."""
    from megatron.core import __version__
    from packaging.version import Version

    shapes = getattr(getattr(lm, "decoder", None), "mamba_state_shapes_per_request", None)
    mamba = shapes is not None and shapes() is not None
    recurrent = any(getattr(m, "recurrent_state", False) for m in lm.modules())  # Gated DeltaNet
    if not (mamba or recurrent):
        return [list(range(len(lengths)))]
    if mamba and Version(__version__) >= Version("0.17"):
        return [[row] for row in range(len(lengths))]
    return [[row for row, n in enumerate(lengths) if n == length]
            for length in sorted(set(lengths))]


def _unwrap(model):
    while not hasattr(model, "embed") and hasattr(model, "module"):
        model = model.module
    return model


def _cat(tensors: list):
    items = [t for t in tensors if t is not None and t.numel() > 0]
    if not items:
        return None
    return torch.cat(items, 0)


def _fast_decoder(lm, pos: torch.Tensor, kwarg: dict):
    """A decode step that skips ``GPTModel.forward``'s per-step preprocessing, or None.

    ``GPTModel.forward`` recomputes the M-RoPE table from the (3, B, L) positions at every step
    and makes the [B, 1, V] logits contiguous. Here the table of the whole run (prompt and every
    generated position, known in advance) is computed once; megatron's attention slices it itself
    (queries ``[offset:offset + 1]``, cached keys ``[:offset + 1]``), so the decoder gets the same
    rotary values as through ``GPTModel.forward``. Then the model's own decoder (its layers, final
    norm, DeepStack hooks) and output layer run as ``GPTModel.forward`` runs them. Only for the
    plain layout this was checked for (GPTModel with M-RoPE, no MTP / flash decode / MLA / local
    CUDA graphs, no CP or sequence parallel); anything else (e.g. Nemotron's MambaModel) returns
    None and goes through ``language_model(...)``.
    """
    try:
        from megatron.core.models.gpt import GPTModel
    except ImportError:  # pragma: no cover
        return None
    cfg = getattr(lm, "config", None)
    if not (isinstance(lm, GPTModel) and getattr(lm, "position_embedding_type", None) == "mrope"
            and hasattr(lm, "mrope_section") and hasattr(lm, "rotary_pos_emb")
            and getattr(lm, "pre_process", False) and getattr(lm, "post_process", False)
            and not getattr(lm, "mtp_process", False) and not getattr(cfg, "flash_decode", False)
            and not getattr(cfg, "multi_latent_attention", False)
            and not getattr(cfg, "sequence_parallel", False)
            and getattr(cfg, "context_parallel_size", 1) == 1
            and getattr(cfg, "mtp_num_layers", None) is None
            and getattr(cfg, "cuda_graph_impl", "none") != "local"):
        return None
    rotary = lm.rotary_pos_emb(pos, lm.mrope_section)  # (L_total, B, 1, D)
    weight = (lm.shared_embedding_or_output_weight() if lm.share_embeddings_and_output_weights
              else None)

    def step(emb, mask):
        hidden = lm.decoder(hidden_states=emb, attention_mask=mask, rotary_pos_emb=rotary, **kwarg)
        logits, _ = lm.output_layer(hidden[-1:], weight=weight, runtime_gather_output=True)
        return logits[-1]  # (B, V)

    return step


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
    """
    qwen = _unwrap(model)
    lm = qwen.language_model
    lengths = [int(p.input_ids.numel()) for p in prompts]
    groups = _row_groups(lm, lengths)
    if len(groups) > 1:  # Mamba layers (module docstring)
        out: list[list[int]] = [[] for _ in prompts]
        for rows in groups:
            group = greedy_generate(model, [prompts[row] for row in rows], eos_id=eos_id,
                                    max_new_tokens=max_new_tokens, pad_id=pad_id, stats=stats)
            for row, tokens in zip(rows, group):
                out[row] = tokens
        return out
    with _inference_mode():
        return _generate(qwen, lm, prompts, lengths, eos_id, max_new_tokens, pad_id, stats)


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


def _decode(lm, logits, context, kwarg: dict, pos, hidden, width: int, eos: set[int],
            max_new_tokens: int) -> tuple[list[list[int]], int]:
    """(tokens per row, forwards) of the greedy decode after the prefill's ``logits`` (B, V):
    one token per live row per step. ``hidden``: the key-padding mask (B, 1, 1, W + N), True =
    hidden; None without left padding (every cached token is attended to, no mask is passed)."""
    if hasattr(context, "enable_decode_mode"):
        context.enable_decode_mode()
    fast = _fast_decoder(lm, pos, kwarg)
    out: list[list[int]] = [[] for _ in range(logits.shape[0])]
    live = list(range(logits.shape[0]))  # rows that have not stopped yet
    forwards = 0
    for step in range(max_new_tokens):
        token = logits.argmax(-1)  # (B,)
        values = token.tolist()  # the one host sync per step
        live = [row for row in live if values[row] not in eos]
        for row in live:
            out[row].append(values[row])
        if not live or step == max_new_tokens - 1:
            break
        length = width + step + 1
        # plain token embedding: a generated context-token id must not be read as a visual slot
        emb = lm.embedding(input_ids=token[:, None], position_ids=None)
        mask = None if hidden is None else hidden[..., :length]
        if fast is not None:
            logits = fast(emb, mask)
        else:
            logits = lm(input_ids=None, position_ids=pos[:, :, :length], attention_mask=mask,
                        decoder_input=emb, runtime_gather_output=True, **kwarg)[:, -1]
        context.sequence_len_offset += 1
        forwards += 1
    return out, forwards


def _generate(qwen, lm, prompts: list[Prompt], lengths: list[int], eos_id, max_new_tokens: int,
              pad_id: int, stats: GenerationStats | None) -> list[list[int]]:
    """``greedy_generate`` of one batch (left-padded to the longest prompt): one prefill (all
    prompt tokens, vision encoded once), then the decode."""
    device = next(qwen.parameters()).device
    eos = {eos_id} if isinstance(eos_id, int) else set(eos_id)
    start = time.perf_counter()
    batch, width = len(prompts), max(lengths)
    ids, pos, valid = (t.to(device) for t in _left_padded(prompts, lengths, pad_id,
                                                           max_new_tokens))

    def media(name):
        value = _cat([getattr(p, name) for p in prompts])
        return None if value is None else value.to(device)

    context = _make_context(batch, width + max_new_tokens)
    kwarg = {_context_kwarg(lm): context}
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    mask = ~(causal[None] & valid[:, None, :width])[:, None]  # (B, 1, L, L), True = hidden
    logits = qwen.prefill(ids, pos[:, :, :width], mask, media("pixel_values"),
                          media("image_grid_thw"), media("pixel_values_videos"),
                          media("video_grid_thw"), media("visual_kinds"), **kwarg)
    context.sequence_len_offset += width
    prefill_seconds = time.perf_counter() - start
    hidden = ~valid[:, None, None, :] if width != min(lengths) else None
    out, forwards = _decode(lm, logits[:, -1], context, kwarg, pos, hidden, width, eos,
                            max_new_tokens)
    if stats is not None:
        stats.prompts += batch
        stats.prompt_tokens += sum(lengths)
        stats.generated_tokens += sum(len(o) for o in out)
        stats.forwards += 1 + forwards
        stats.seconds += time.perf_counter() - start
        stats.prefill_seconds += prefill_seconds
    return out
