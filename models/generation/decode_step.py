"""The lean greedy decode step: one token per row through a megatron language model's own weights
in plain torch, with its own caches filled from the megatron prefill
(models/generation/generate.py).

Why: a megatron decode step (``language_model(...)`` with a ``StaticInferenceContext``) makes
about 1,600 Python calls on a two-layer model (module calls, tensor-parallel region functions,
inference-context bookkeeping), costs the same at batch 4 as at batch 1, and re-rotates the
whole cached key prefix every step (the static context keeps keys before RoPE). Here each layer
is a small closure over the layer's parameters (read once, at build time): a step is about ten
torch calls per layer and no Python work that grows with the prefix.

``build(lm, groups, positions, attend, width)`` -> ``Decoder`` or None. ``Decoder(tokens)``
takes the (B,) tokens just chosen and returns the next (B, V) logits. None means some part of
the model is not one this module knows (then the generator runs megatron's own decode step): a
tensor-parallel split, a layer kind without a builder, rotary other than M-RoPE / none,
interleaved rotary (megatron's ``rotary_interleaved``; the interleaved M-RoPE frequencies of
Qwen3-VL / Qwen3.5 are megatron's chunked ``mrope_section`` and covered), forward hooks on a
linear or norm it would read (an unmerged LoRA adapter), norms other than torch's and the
zero-centred RMSNorm, grouped-GEMM experts, latent MoE projections, experts' linears over ranks
(expert TP).

Layer kinds (``LAYER_DECODERS``, by megatron module class; the builders live in
models/generation/decode_layers.py, each returns a ``LayerDecoder`` or raises ``Unsupported``):
``TransformerLayer`` / ``MLPLayer`` (attention with keys cached after RoPE, rotary on all or
the first ``rotary_percent`` of each head, q/k norms, the output gate; or the layer's
``self_attention`` mixer's own step: the Gated DeltaNet of Qwen3.5,
models/generation/decode_deltanet.py; dense MLP, MoE with a shared expert, gated or not) and
``MambaLayer`` (Mamba2 conv window and SSM state per row). So the lean step covers every family:
Qwen2.5-VL, Qwen3-VL (MoE), Nemotron-Omni, Qwen3.5 (MoE), at TP = 1 with the local layer spec;
experts over ranks (EP > 1, every rank decodes the same rows, which ``models.generation.generate``
checks with ``same_prompts_on_expert_ranks``) as each rank's experts summed by one all-reduce per
MoE layer.

A recurrent layer with its own cached state plugs in at two places, both registered here (the
layer's module knows nothing of generation): its decode step, with an entry in
``LAYER_DECODERS`` (a whole layer) or in ``decode_layers.MIXER_DECODERS`` (a
``TransformerLayer``'s ``self_attention`` mixer alone, the layer adding its pre-norm and
residual, as the Gated DeltaNet's), returning a ``LayerDecoder`` built from
``prefilled.row_states(...)``; and, when its prefill has no padding mask, hooks that keep left
padding out of its state (``PREFILL_PAD_HOOKS``; ``padded_prefill``), as the Mamba mixer's and
the Gated DeltaNet's do. Without them a
batch of unequal prompt lengths would carry the pads into the state (the tests compare each row
with transformers).

Geometry (``Prefilled``): B rows left-padded to the longest prompt W; row r's prompt fills
columns [W - n_r, W); generated token s sits in column W + s. The prefill may have run in
groups of rows (each its own megatron context, left-padded to its own width; one row per group
on megatron >= 0.17 with Mamba layers); the decode runs all rows as one batch, attention hiding
each row's padding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from models.generation import decode_layers as layers
from models.generation.decode_deltanet import deltanet_pad_hooks, deltanet_step
from models.generation.decode_layers import Unsupported, linear_of, norm_of, plain


class LayerDecoder(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on the residual stream x (B, H) of one new token per row -> (B, H);
        advances the layer's own cache / state by that token."""


@dataclass(slots=True)
class Prefilled:
    """What the prefill left, and the geometry of the run."""

    groups: list  #: (megatron inference context, row indices, group width) per prefill group
    width: int  #: W: the longest prompt
    total: int  #: W + max new tokens (cache length)
    attend: torch.Tensor  #: (B, total) bool: True where a row has a real token
    rotary: tuple | None  #: (cos, signed sin) (total, B, 1, rot_dim) (``rotary_table``)
    step: int = 0  #: the column the next token goes to, minus W (advanced by ``Decoder``)

    @property
    def batch(self) -> int:
        return self.attend.shape[0]

    def cached_sequence(self, layer_number: int) -> list[torch.Tensor]:
        """The prefill's per-token cache of a layer (megatron's (max_seq, b, ...) tensors of the
        static context, e.g. keys and values) as (B, W, ...) tensors, left-padded."""
        first = self.groups[0][0].key_value_memory_dict[layer_number]
        out = [t.new_zeros(self.batch, self.width, *t.shape[2:]) for t in first]
        for context, rows, width in self.groups:
            for dst, src in zip(out, context.key_value_memory_dict[layer_number]):
                dst[rows, self.width - width:] = src[:width].transpose(0, 1)
        return out

    def row_states(self, layer_number: int) -> list[torch.Tensor]:
        """The prefill's per-row states of a layer (megatron's (b, ...) tensors, e.g. a Mamba
        mixer's conv and SSM states) as (B, ...) tensors."""
        first = self.groups[0][0].key_value_memory_dict[layer_number]
        out = [t.new_zeros(self.batch, *t.shape[1:]) for t in first]
        for context, rows, _width in self.groups:
            for dst, src in zip(out, context.key_value_memory_dict[layer_number]):
                dst[rows] = src[:len(rows)]
        return out


def _layer_decoders() -> dict[type, Callable]:
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from models.layers.gated_deltanet import GatedDeltaNet

    layers.MIXER_DECODERS.setdefault(GatedDeltaNet, deltanet_step)
    return {TransformerLayer: layers.transformer_layer, MambaLayer: layers.mamba_layer}


#: megatron layer class -> builder ``(layer, prefilled) -> LayerDecoder`` (subclasses match)
LAYER_DECODERS: dict[type, Callable] = {}


def _layer_decoder(layer, prefilled: Prefilled) -> LayerDecoder:
    if not LAYER_DECODERS:
        LAYER_DECODERS.update(_layer_decoders())
    for cls in type(layer).__mro__:
        if cls in LAYER_DECODERS:
            return LAYER_DECODERS[cls](layer, prefilled)
    raise Unsupported(f"layer {type(layer).__name__}")


#: module class -> ``(module, keep) -> hook handles`` for a left-padded prefill (subclasses match)
PREFILL_PAD_HOOKS: dict[type, Callable] = {}


@contextlib.contextmanager
def padded_prefill(lm, keep: torch.Tensor):
    """While the prefill of a left-padded batch runs: the pad hooks of every module with a state
    the pads must not reach (``PREFILL_PAD_HOOKS``, or the module's ``prefill_pad_hooks(keep)``).
    ``keep`` (b, w): True on real tokens; nothing to do when there is no padding."""
    if not PREFILL_PAD_HOOKS:
        from megatron.core.ssm.mamba_mixer import MambaMixer

        from models.layers.gated_deltanet import GatedDeltaNet

        PREFILL_PAD_HOOKS[MambaMixer] = layers.mamba_pad_hooks
        PREFILL_PAD_HOOKS[GatedDeltaNet] = deltanet_pad_hooks
    handles = []
    try:
        if not bool(keep.all()):
            for module in lm.modules():
                hooks = next((PREFILL_PAD_HOOKS[c] for c in type(module).__mro__
                              if c in PREFILL_PAD_HOOKS), None)
                if hooks is not None:
                    handles += hooks(module, keep)
        yield
    finally:
        for handle in handles:
            handle.remove()


def rotary_table(lm, positions: torch.Tensor) -> tuple | None:
    """(cos, signed sin) (L, B, 1, rot_dim) of a language model's rotary at the (3, B, L)
    positions: M-RoPE (megatron's ``MultimodalRotaryEmbedding`` table; the sin negated on the
    first half, the sign ``decode_layers.rotate`` needs) or None without position embedding.

    Raises:
        Unsupported: another position embedding.
    """
    kind = getattr(lm, "position_embedding_type", None)
    if kind == "none":
        return None
    if kind != "mrope":
        raise Unsupported(f"position embedding {kind!r}")
    freqs = lm.rotary_pos_emb(positions, lm.mrope_section)  # (L, B, 1, rot_dim)
    half = freqs.shape[-1] // 2
    sign = torch.cat([-freqs.new_ones(half), freqs.new_ones(freqs.shape[-1] - half)])
    return freqs.cos(), freqs.sin() * sign


class Decoder:
    """tokens (B,) -> next logits (B, V) (see module docstring)."""

    def __init__(self, lm, prefilled: Prefilled):
        self.prefilled = prefilled
        self.embedding = plain(lm.embedding.word_embeddings).weight
        decoder = lm.decoder
        self.layers = [_layer_decoder(layer, prefilled) for layer in decoder.layers]
        if getattr(lm.config, "fp32_residual_connection", False):
            raise Unsupported("fp32 residual connection")
        final = getattr(decoder, "final_layernorm", None)
        self.final_norm = norm_of(final if final is not None
                                else getattr(decoder, "final_norm", None))
        self.output = (lm.shared_embedding_or_output_weight()
                       if lm.share_embeddings_and_output_weights
                       else linear_of(lm.output_layer)[0])
        self.output_bias = getattr(lm.output_layer, "bias", None)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embedding)
        for layer in self.layers:
            x = layer(x)
        self.prefilled.step += 1
        return F.linear(self.final_norm(x), self.output, self.output_bias)


def build(lm, groups: list, positions: torch.Tensor, attend: torch.Tensor,
          width: int) -> Decoder | None:
    """The lean decoder of ``lm`` over the prefill's caches, or None where a part of the model is
    not covered (module docstring).

    Args:
        lm: the megatron language model (one pipeline stage: embedding and output layer).
        groups: ``Prefilled.groups``: (megatron context, row indices, width) per prefill run.
        positions: (3, B, total) position ids of the whole run (prompts left-padded to
            ``width``, then the generated tokens).
        attend: (B, total) True where a row has a real token.
        width: W, the longest prompt.
    """
    from megatron.core import parallel_state

    if (parallel_state.get_tensor_model_parallel_world_size() > 1
            or not (getattr(lm, "pre_process", True) and getattr(lm, "post_process", True))
            or getattr(lm, "mtp_process", False)):
        return None
    try:
        rotary = rotary_table(lm, positions)
        prefilled = Prefilled(groups, width, attend.shape[1], attend, rotary)
        return Decoder(lm, prefilled)
    except Unsupported:
        return None
