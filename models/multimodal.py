"""Batch-contract helpers shared by every VLM family (Qwen-VL, Nemotron-Omni).

This module owns what does not depend on the architecture: the per-row check that the context
tokens of each batch row match the embeddings of the images/videos that start in it
(``check_visual_counts``), which context tokens belong to which kind (``context_masks``; when
images and videos share one context token, as Nemotron-Omni's ``<image>``, the batch's
``visual_kinds`` tells which runs are videos), the scatter of the encoded media into those tokens
(``scatter_visual``), megatron's THD parameters of packed rows (``packed_sequence_params``),
the label shift of the loss (``shift_labels``: labels arrive unshifted, the model predicts t+1 at
t) and of a multi-token-prediction head (``mtp_targets``: t+2 at t, within each packed sample),
and the pipeline-parallel surface of a VLM (``LanguageModelRunner``: stage-aware LM call
(packed batches in megatron's THD format), megatron's ``model_type`` / ``set_input_tensor`` /
tied-embedding accessors).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.packed_seq_params import PackedSeqParams

from contract.constants import IGNORE_INDEX, VISUAL_KINDS  # the batch contract
from models import kernels


def check_visual_counts(token_mask: torch.Tensor, grid_thw: torch.Tensor, merge_size: int,
                        kind: str, sample_keys=None, token_name: str | None = None) -> None:
    """Each row's context tokens must equal the embeddings of the items that start in it.

    Args:
        token_mask: (B, L) bool, the context tokens of ``kind``.
        grid_thw: (n, 3) items in batch order; an item gives t*h*w / merge_size**2 embeddings.
        merge_size: spatial merge (2x2 -> 2).
        kind: "image" or "video" (named in the message).
        sample_keys: per-row sample names (e.g. the batch's ``__key__``) for the message.
        token_name: how the token is named in the message (default ``<|{kind}_pad|>``).

    Raises:
        ValueError: naming the row (and its key), the token count and the embedding count.
    """
    token = token_name or f"<|{kind}_pad|>"
    per_item = (grid_thw.prod(-1) // merge_size ** 2).tolist()
    starts = [sum(per_item[:i]) for i in range(len(per_item))]
    done = 0
    for row, n_tokens in enumerate(token_mask.sum(1).tolist()):
        consumed = sum(n for s, n in zip(starts, per_item) if done <= s < done + n_tokens)
        if consumed != n_tokens:
            name = f" ({sample_keys[row]})" if sample_keys else ""
            raise ValueError(f"batch row {row}{name}: {n_tokens} {token} tokens but "
                             f"its {kind}s in order give {consumed} embeddings")
        done += n_tokens
    if done != sum(per_item):
        row = token_mask.shape[0] - 1
        name = f" ({sample_keys[row]})" if sample_keys else ""
        raise ValueError(f"batch row {row}{name}: {kind}s left without tokens after it: the "
                         f"batch has {done} {token} tokens but {sum(per_item)} {kind} "
                         f"embeddings ({len(per_item)} {kind}s)")


def _grid(grid) -> torch.Tensor:
    """A kind's grid on the CPU, (0, 3) when absent."""
    return grid.cpu() if grid is not None else torch.zeros(0, 3, dtype=torch.long)


def context_masks(input_ids: torch.Tensor, media, merge_size: int, sample_keys=None,
                  visual_kinds: torch.Tensor | None = None) -> list[torch.Tensor]:
    """(B, L) bool mask of the context tokens of each kind of ``media``, in ``media`` order.

    With one context token per kind the mask is simply ``input_ids == token`` (``visual_kinds``
    is not needed and not read). When "image" and "video" share one token, the shared tokens are
    split between them: the items (images and videos interleaved in ``visual_kinds`` order) take
    the shared tokens in row-major order, each item its t*h*w / merge_size**2 tokens. Without
    ``visual_kinds`` that split is only known when the batch holds one kind (it takes every
    shared token).

    Args:
        input_ids: (B, L).
        media: ``(kind, token_id, pixel_values, grid_thw)`` per kind, as :func:`scatter_visual`.
        merge_size, sample_keys: as in :func:`check_visual_counts`.
        visual_kinds: (num_images + num_videos,) int, ``VISUAL_KINDS`` code of each item in the
            order of their spans in the flattened batch (the batch contract's ``visual_kinds``).

    Raises:
        ValueError: shared token with images and videos but no ``visual_kinds``; ``visual_kinds``
            disagreeing with the grids; a row's shared tokens differing from the embeddings of
            the items that start in it (row, key and both counts named).
    """
    tokens = {kind: token for kind, token, _, _ in media}
    if len(set(tokens.values())) == len(tokens):
        return [input_ids == token for _, token, _, _ in media]
    if set(tokens) != set(VISUAL_KINDS):
        raise ValueError(f"only images and videos may share a context token, got {tokens}")
    shared = input_ids == tokens["image"]
    grids = {kind: _grid(grid) for kind, _, _, grid in media}
    present = [kind for kind in VISUAL_KINDS if len(grids[kind])]
    if visual_kinds is None:
        if len(present) == 2:
            raise ValueError(f"images and videos share context token {tokens['image']} and this "
                             "batch holds both: pass the batch's visual_kinds (their order) or "
                             "give videos their own video_token_id")
        owner = present[0] if present else "image"  # no items: the image check names the tokens
        return [shared if kind == owner else torch.zeros_like(shared) for kind, *_ in media]
    codes = visual_kinds.cpu().long().reshape(-1)
    have = {kind: int((codes == code).sum()) for code, kind in enumerate(VISUAL_KINDS)}
    want = {kind: len(grids[kind]) for kind in VISUAL_KINDS}
    if have != want or sum(have.values()) != len(codes):
        raise ValueError(f"visual_kinds ({len(codes)} codes: {have}) does not match the batch's "
                         f"grids ({want})")
    interleaved = torch.zeros(len(codes), 3, dtype=torch.long)
    for code, kind in enumerate(VISUAL_KINDS):
        interleaved[codes == code] = grids[kind]
    check_visual_counts(shared, interleaved, merge_size, "visual item", sample_keys,
                        token_name=f"shared image/video context ({tokens['image']})")
    per_token = codes.repeat_interleave(interleaved.prod(-1) // merge_size ** 2)
    per_token = per_token.to(shared.device)
    masks = []
    for kind, *_ in media:
        mask = torch.zeros_like(shared)
        mask[shared] = per_token == VISUAL_KINDS.index(kind)
        masks.append(mask)
    return masks


def scatter_visual(emb: torch.Tensor, input_ids: torch.Tensor, media, encode, merge_size: int,
                   sample_keys=None, visual_kinds: torch.Tensor | None = None,
                   ) -> list[tuple[torch.Tensor, object]]:
    """Encode each kind of media and write its embeddings into its context tokens, in order.

    Args:
        emb: (B, L, H) token embeddings, written in place (row-major order of the tokens).
        input_ids: (B, L).
        media: ``(kind, token_id, pixel_values, grid_thw)`` per kind ("image", "video"); a kind
            with neither items nor tokens is skipped.
        encode: ``encode(pixel_values, grid_thw)`` -> embeddings (n, H), or (embeddings, extra).
        merge_size, sample_keys: as in :func:`check_visual_counts` (checked before encoding).
        visual_kinds: the batch's item order, read only when images and videos share a context
            token (:func:`context_masks`).

    Returns:
        ``(token mask (B, L), extra or None)`` of every kind that was scattered; the masks of
        different kinds never overlap.
    """
    done = []
    masks = context_masks(input_ids, media, merge_size, sample_keys, visual_kinds)
    for (kind, _token, pixels, grid), mask in zip(media, masks):
        has_grid = grid is not None and grid.numel() > 0
        if not has_grid and not mask.any():
            continue
        grid = grid if has_grid else torch.zeros(0, 3, dtype=torch.long)
        check_visual_counts(mask, grid.cpu(), merge_size, kind, sample_keys)
        out = encode(pixels, grid)
        feats, extra = out if isinstance(out, tuple) else (out, None)
        emb[mask] = feats.to(emb.dtype)
        done.append((mask, extra))
    return done


def shift_labels(labels: torch.Tensor, loss_mask: torch.Tensor | None):
    """Unshifted labels (-100 = no loss) -> (target for position t = label t+1, clamped >= 0;
    float loss mask of the shifted targets, also zero where the shifted label is -100)."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if loss_mask is None:
        mask = (shifted != IGNORE_INDEX).float()
    else:
        mask = torch.zeros_like(loss_mask)
        mask[:, :-1] = loss_mask[:, 1:]
        mask = mask * (shifted != IGNORE_INDEX)
    return shifted.clamp(min=0), mask


def segment_ids(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """The packed segment of each of ``tokens`` flattened positions (``cu_seqlens``)."""
    positions = torch.arange(tokens, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)


def mtp_targets(labels: torch.Tensor, loss_mask: torch.Tensor | None,
                cu_seqlens: torch.Tensor | None = None):
    """Unshifted labels (B, L) (-100 = no loss) -> (target of position i = label i+2, clamped
    >= 0; float mask: the label i+2 exists in the same packed sample (``cu_seqlens`` over the
    flattened B*L tokens), is not -100 and its loss-mask entry is set)."""
    target = torch.full_like(labels, IGNORE_INDEX)
    target[:, :-2] = labels[:, 2:]
    mask = (target != IGNORE_INDEX).float()
    if loss_mask is not None:
        shifted = torch.zeros_like(mask)
        shifted[:, :-2] = loss_mask[:, 2:].float()
        mask = mask * shifted
    if cu_seqlens is not None:
        batch, length = labels.shape
        segment = segment_ids(cu_seqlens.to(labels.device), batch * length)
        same = torch.zeros_like(segment, dtype=torch.bool)
        same[:-2] = segment[:-2] == segment[2:]
        mask = mask * same.view(batch, length)
    return target.clamp(min=0), mask


def packed_sequence_params(cu_seqlens: torch.Tensor, max_seqlen: int | None, device):
    """megatron's THD parameters of a packed batch: every packed sample (and each row's pad tail)
    is one causal segment of the flattened B*L tokens (``cu_seqlens``, batch contract).

    Mamba layers restart their state per segment from a per-token segment index: megatron
    0.16.1's mixer builds it from ``cu_seqlens_q``; >= 0.17 reads ``PackedSeqParams.seq_idx``,
    which it computes only when ``total_tokens`` is given (without it the state would silently
    run across segments), so ``total_tokens`` is set where the field exists.
    """
    bounds = cu_seqlens.to(device=device, dtype=torch.int32)
    longest = int(max_seqlen) if max_seqlen is not None else int((bounds[1:] - bounds[:-1]).max())
    extra = {}
    if "total_tokens" in PackedSeqParams.__dataclass_fields__:
        extra["total_tokens"] = int(bounds[-1])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                           max_seqlen_q=longest, max_seqlen_kv=longest, **extra)


def resolve_kernels(cfg, use_te: bool | None) -> bool:
    """The kernels of the model's layer kinds (``models.kernels.prepare``: what the run chose, or
    chosen now; megatron's Mamba mixer gets its kernels bound) before any layer is built ->
    ``use_te``: the TransformerEngine layer specs where the attention choice is TE (``use_te``
    given: as given)."""
    choices = kernels.prepare(cfg.kernel_kinds())
    return choices["attention"].name == "te" if use_te is None else use_te


class LanguageModelRunner:
    """How every family's VLM runs its language model (``self.language_model``: a megatron
    ``GPTModel`` / ``MambaModel``): the pipeline stages (``pre_process`` / ``post_process`` say
    which ends of the pipeline this stage holds: vision + embedding first, output layer + loss
    last; megatron's schedules read ``model_type`` and call ``set_input_tensor`` with the previous
    stage's hidden states; ``finalize_model_grads`` asks the first / last stage for the tied
    embedding), the THD packing and the context-parallel share, DeepStack features, and
    generation's prefill."""

    model_type = ModelType.encoder_or_decoder  # megatron's pipeline schedules read it

    def _init_stage(self, cfg) -> None:
        """Keep ``cfg``, note which pipeline ends this stage holds."""
        self.cfg = cfg
        self.pre_process = parallel_state.is_pipeline_first_stage()
        self.post_process = parallel_state.is_pipeline_last_stage()

    @staticmethod
    def _context_parallel_group():
        """The CP group the vision DP shares over (None before megatron is initialised)."""
        if not parallel_state.model_parallel_is_initialized():
            return None
        return parallel_state.get_context_parallel_group()

    def set_input_tensor(self, input_tensor):
        self.language_model.set_input_tensor(input_tensor)

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.language_model.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    @contextlib.contextmanager
    def deepstack_features(self, state):
        """While the LM runs: the DeepStack features its first layers add (Qwen3-VL), ``state`` =
        (visual-token mask (B, L), one (n, H) tensor per level in the mask's row-major order),
        or None. Models without DeepStack never read it."""
        self._deepstack = state
        try:
            yield
        finally:
            self._deepstack = None

    def prefill(self, input_ids, position_ids, attention_mask, pixel_values=None,
                image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
                visual_kinds=None, **inference_kwargs):
        """Generation's first forward: the whole prompt embedded (each image / video encoded
        once, DeepStack features added) and run through the LM with megatron's inference
        context (``inference_kwargs``) -> logits (B, L, V) gathered over TP. One pipeline stage,
        no CP (models/generation/generate.py)."""
        emb, deepstack = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                                    video_grid_thw, visual_kinds=visual_kinds)
        with self.deepstack_features(deepstack):
            return self.language_model(input_ids=None, position_ids=position_ids,
                                       attention_mask=attention_mask, decoder_input=emb,
                                       runtime_gather_output=True, **inference_kwargs)

    def run_language_model(self, decoder_input, position_ids, labels, loss_mask, shape,
                           cu_seqlens=None, max_seqlen=None, deepstack=None):
        """The LM of this stage on ``decoder_input`` (L, B, H); None on later stages (megatron's
        ``set_input_tensor`` gave the previous stage's output) -> logits (B, L, V/TP) without
        ``labels``, (per-token loss (B, L) * shifted mask, shifted mask) with them on the last
        stage, this stage's output hidden states on the others. ``deepstack``: see
        :meth:`deepstack_features`.

        ``shape`` is the batch's (B, L). A packed batch (``cu_seqlens``) runs as megatron's THD
        format: the B rows are flattened into one sequence of B*L tokens (hidden states
        (B*L, 1, H), also between pipeline stages) whose segments attend only within themselves
        (TE's varlen attention on GPU, ``models.layers.segment_attention`` in the local spec; Mamba
        layers restart their state per segment); the outputs are returned in (B, L) again.
        Under context parallelism (CP > 1) this rank runs its zig-zag share of the sequence
        (:meth:`run_context_parallel_share`).
        """
        batch, length = shape
        target, params = None, None
        if labels is not None:
            target, loss_mask = shift_labels(labels, loss_mask)  # per row, before any flattening
        cp_size, cp_rank = context_parallel_share()
        if cp_size > 1:
            return self.run_context_parallel_share(decoder_input, position_ids, target, loss_mask,
                                                   deepstack, cp_size, cp_rank)
        if cu_seqlens is not None:
            device = next(self.parameters()).device
            params = packed_sequence_params(cu_seqlens, max_seqlen, device)
            if decoder_input is not None:
                decoder_input = decoder_input.transpose(0, 1).reshape(batch * length, 1, -1)
            if position_ids is not None:
                position_ids = position_ids.reshape(position_ids.shape[0], 1, batch * length)
            if target is not None:
                target = target.reshape(1, batch * length)
            if deepstack is not None:  # its mask follows the tokens into the one THD row
                deepstack = (deepstack[0].reshape(1, -1), deepstack[1])
        decoder_input, deepstack = self._sequence_parallel_share(decoder_input, deepstack)
        with self.deepstack_features(deepstack):
            out = self.language_model(input_ids=None, position_ids=position_ids,
                                      attention_mask=None, decoder_input=decoder_input,
                                      labels=target, packed_seq_params=params)
        if not self.post_process:
            return out
        if params is not None:
            out = out.reshape(batch, length, *out.shape[2:])
        if target is None:
            return out
        return out * loss_mask, loss_mask

    def run_context_parallel_share(self, decoder_input, position_ids, target, loss_mask,
                                   deepstack, cp_size: int, cp_rank: int):
        """CP > 1: the whole sequence was embedded (vision DP over CP inside), this rank runs its
        zig-zag share of the LM (:func:`zigzag`) with its visual tokens' DeepStack rows; M-RoPE
        positions stay whole (megatron slices the rotary table per rank). -> (per-token loss
        (B, L/CP) * shifted mask, shifted mask) of this rank's share with ``target``, logits of
        the share without. Not with packing or PP (train.py refuses both)."""
        def split(t, dim):
            return zigzag(t, dim, cp_size, cp_rank)

        decoder_input, deepstack = self._sequence_parallel_share(
            split(decoder_input, 0), deepstack_share(deepstack, split))
        with self.deepstack_features(deepstack):
            out = self.language_model(input_ids=None, position_ids=position_ids,
                                      attention_mask=None, decoder_input=decoder_input,
                                      labels=None if target is None else split(target, 1))
        if target is None:
            return out
        mask = split(loss_mask, 1)
        return out * mask, mask


    def _sequence_parallel_share(self, decoder_input, deepstack):
        """Under megatron's sequence parallelism (Qwen3-VL MoE at TP > 1): this TP rank's
        contiguous share of the whole-sequence embeddings (megatron's scatter; its backward
        gathers) and its visual tokens' DeepStack rows (their gradient summed over TP, as the
        tower that made them runs whole on every TP rank); unchanged otherwise."""
        if decoder_input is None or not self.language_model.config.sequence_parallel:
            return decoder_input, deepstack
        from megatron.core import tensor_parallel

        tp, rank = (parallel_state.get_tensor_model_parallel_world_size(),
                    parallel_state.get_tensor_model_parallel_rank())
        if deepstack is not None:
            deepstack = (deepstack[0], [tensor_parallel.copy_to_tensor_model_parallel_region(f)
                                        for f in deepstack[1]])
        return (tensor_parallel.scatter_to_sequence_parallel_region(decoder_input),
                deepstack_share(deepstack, lambda t, dim: t.chunk(tp, dim)[rank]))


def deepstack_share(deepstack, take):
    """DeepStack state (visual mask (B, L), features in the mask's row-major order) of the tokens
    ``take(t, 1)`` keeps of a (B, L) tensor: the kept mask and its tokens' feature rows."""
    if deepstack is None:
        return None
    visual, features = deepstack
    ordinal = visual.flatten().cumsum(0).view_as(visual) - 1
    local = take(visual, 1)
    return local, [f[take(ordinal, 1)[local]] for f in features]


def context_parallel_share() -> tuple[int, int]:
    """(CP size, this rank's CP rank); (1, 0) before megatron's parallel state exists."""
    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return (parallel_state.get_context_parallel_world_size(),
            parallel_state.get_context_parallel_rank())


def zigzag(t: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """megatron's CP split: rank r keeps chunks r and 2*cp-1-r of 2*cp along ``dim``."""
    chunks = t.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)
