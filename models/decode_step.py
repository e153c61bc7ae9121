"""The lean greedy decode step: one token per row through a megatron language model's own weights
in plain torch, with its own caches filled from the megatron prefill (models/generate.py).

Why: a megatron decode step (``language_model(...)`` with a ``StaticInferenceContext``) makes
about 1,600 Python calls on a two-layer model (module calls, tensor-parallel region functions,
inference-context bookkeeping), costs the same at batch 4 as at batch 1, and re-rotates the
whole cached key prefix every step (the static context keeps keys before RoPE). Here each layer
is a small closure over the layer's parameters (read once, at build time): a step is about ten
torch calls per layer and no Python work that grows with the prefix.

``build(lm, prefilled)`` -> ``Decoder`` or None. ``Decoder(tokens)`` takes the (B,) tokens just
chosen and returns the next (B, V) logits. None means some part of the model is not one this
module knows (then the generator runs megatron's own decode step): a tensor-parallel split, a
layer kind without a builder, rotary other than M-RoPE / none, interleaved rotary, forward hooks
on a linear or norm it would read (an unmerged LoRA adapter), non-torch norms, grouped-GEMM
experts, latent MoE projections, a gated shared expert.

Layer kinds (``LAYER_DECODERS``, by megatron module class; each builder returns a
``LayerDecoder`` or raises ``Unsupported``):

- ``TransformerLayer`` / ``MLPLayer``: attention (GQA, optional q/k RMSNorm, biases) when its
  ``self_attention`` is not an identity, then a dense MLP or a MoE when its ``mlp`` is not (the
  router's gating and top-k as megatron computes them at inference, in plain torch; the experts
  a step needs run on all rows, weighted by the router's probabilities: zero where a row did not
  pick it; the shared expert). Keys are cached
  after RoPE: the prefill's keys are rotated once, each new key when it is written.
- ``MambaLayer``: megatron's Mamba2 mixer one token at a time (conv window and SSM state per
  row, the mixer's own gated norm), from the states the prefill left.

A recurrent layer with its own cached state (e.g. a Gated DeltaNet) plugs in at two places:
its decode step, with an entry in ``LAYER_DECODERS`` or a ``lean_decoder(prefilled)`` method on
its layer module (asked first), returning a ``LayerDecoder`` built from
``prefilled.row_states(...)``; and, when its prefill has no padding mask, hooks that keep left
padding out of its state (``PREFILL_PAD_HOOKS`` or a ``prefill_pad_hooks(keep)`` method on the
module; ``padded_prefill``), as the Mamba mixer's do. Without them a batch of unequal prompt
lengths would carry the pads into the state (the tests compare each row with transformers).

Geometry (``Prefilled``): B rows left-padded to the longest prompt W; row r's prompt fills
columns [W - n_r, W); generated token s sits in column W + s. The prefill may have run in
groups of rows (each group its own megatron context, left-padded to its own width: Mamba layers
have no padding mask, so they prefill rows of equal length together); the decode runs all rows
as one batch, attention hiding each row's padding.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn


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
    rotary: tuple | None  #: (cos, sin) (total, B, 1, rot_dim) of the run's positions, or None
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


class Unsupported(Exception):
    """A part of the model the lean step does not cover (the generator falls back)."""


def _plain(module: nn.Module) -> nn.Module:
    if module._forward_hooks or module._forward_pre_hooks:
        raise Unsupported(f"forward hooks on {type(module).__name__}")
    return module


def _is_identity(module) -> bool:
    return type(module).__name__ in ("IdentityOp", "IdentityFuncOp", "Identity")


def _norm(module) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> the norm of x over its last dims, from the module's weight (torch norms only)."""
    if module is None or _is_identity(module):
        return lambda x: x
    _plain(module)
    if isinstance(module, nn.RMSNorm):
        shape, weight, eps = module.normalized_shape, module.weight, module.eps
        return lambda x: F.rms_norm(x, shape, weight, eps)
    if isinstance(module, nn.LayerNorm):
        shape, weight, bias, eps = (module.normalized_shape, module.weight, module.bias,
                                    module.eps)
        return lambda x: F.layer_norm(x, shape, weight, bias, eps)
    raise Unsupported(f"norm {type(module).__name__}")


def _linear(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a megatron linear (its bias added whether or not megatron skips it:
    the layer adds it to the same output)."""
    _plain(module)
    if getattr(module, "weight", None) is None:
        raise Unsupported(f"linear {type(module).__name__} without weight")
    return module.weight, getattr(module, "bias", None)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (megatron's non-interleaved ``_apply_rotary_pos_emb_bshd``) on the first
    ``cos.shape[-1]`` channels of t."""
    dim = cos.shape[-1]
    rot, rest = t[..., :dim], t[..., dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot


def _mlp(module) -> Callable:
    """(x (N, H), per-row scale (N,) or None) -> a megatron ``MLP``'s output (N, H)."""
    w1, b1 = _linear(module.linear_fc1)
    w2, b2 = _linear(module.linear_fc2)
    # the activation's own body: megatron's @jit_fuser (torch.compile) wrapper costs more than
    # the op itself on one token per row
    act, gated = inspect.unwrap(module.activation_func), module.config.gated_linear_unit

    def mlp(x, scale=None):
        h = F.linear(x, w1, b1)
        if gated:
            a, b = h.chunk(2, dim=-1)
            h = act(a) * b
        else:
            h = act(h)
        if scale is not None:  # megatron's per_token_scale (the router's probability)
            h = (h * scale[:, None]).to(x.dtype)
        return F.linear(h, w2, b2)

    return mlp


def _router(router) -> Callable:
    """x (B, H) -> (probabilities (B, k), expert indices (B, k)) of a megatron ``TopKRouter``:
    its gating linear in the router dtype, then its top-k routing (softmax before / after the
    top-k, or sigmoid with the expert bias choosing and the renormalised scores weighing; the
    scaling factor), as ``topk_routing_with_score_function`` computes it at inference. Layouts
    this does not cover (sinkhorn, group-limited top-k, capacity, fused or replayed routing)
    call the router module itself (its (B, E) outputs turned into the same pair)."""
    cfg = router.config
    if (getattr(router, "routing_type", None) == "sinkhorn" or cfg.moe_router_group_topk
            or cfg.moe_expert_capacity_factor is not None
            or getattr(cfg, "moe_router_fusion", False)
            or getattr(cfg, "moe_router_force_load_balancing", False)
            or getattr(router, "router_replay", None) is not None
            or router._forward_hooks or router._forward_pre_hooks):
        def via_module(x):
            probs, picked = router(x)
            top = picked.int().topk(router.topk, dim=-1).indices
            return probs.gather(1, top), top
        return via_module
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(cfg.moe_router_dtype)
    weight = router.weight if dtype is None else router.weight.to(dtype)
    bias = router.bias if router.bias is None or dtype is None else router.bias.to(dtype)
    k, score, scale = router.topk, router.score_function, cfg.moe_router_topk_scaling_factor
    pre_softmax, expert_bias = cfg.moe_router_pre_softmax, getattr(router, "expert_bias", None)

    def route(x):
        logits = F.linear(x if dtype is None else x.to(dtype), weight, bias)  # (B, E)
        if score == "softmax":
            if pre_softmax:
                scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
                probs, top = scores.topk(k, dim=1)
            else:
                chosen, top = logits.topk(k, dim=1)
                probs = torch.softmax(chosen, dim=-1, dtype=torch.float32).type_as(logits)
        else:
            scores = torch.sigmoid(logits.float()).type_as(logits)
            if expert_bias is not None:
                top = (scores + expert_bias).topk(k, dim=1).indices
                probs = scores.gather(1, top)
            else:
                probs, top = scores.topk(k, dim=1)
            if k > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        return (probs * scale if scale else probs), top

    return route


def _moe(module) -> Callable:
    """x (B, H) -> a megatron ``MoELayer``'s output: its router's choice, the picked experts
    weighted by their probabilities, the shared expert."""
    experts = getattr(module.experts, "local_experts", None)
    cfg = module.config
    if (experts is None or getattr(cfg, "moe_latent_size", None)
            or getattr(cfg, "moe_shared_expert_gate", False)):
        raise Unsupported("MoE layout (grouped experts, latent projections or a gated shared "
                          "expert)")
    route = _router(module.router)
    mlps = [_mlp(e) for e in experts]
    shared = _mlp(module.shared_experts) if getattr(module, "use_shared_expert", False) else None

    def moe(x):
        probs, top = route(x)  # (B, k) each
        out = shared(x) if shared is not None else torch.zeros_like(x)
        for e in top.unique().tolist():  # the experts this step needs (one host sync)
            weight = (probs * (top == e)).sum(-1)  # (B,): 0 where a row did not pick e
            out = out + mlps[e](x, weight)
        return out

    return moe


def _attention(attn, prefilled: Prefilled) -> Callable:
    """x (B, H) (normed) -> a megatron ``SelfAttention``'s output, over its cache (keys after
    RoPE) of the prefill and the steps so far."""
    cfg = attn.config
    if getattr(cfg, "multi_latent_attention", False) or getattr(cfg, "rotary_interleaved", False):
        raise Unsupported("multi-latent or interleaved-rotary attention")
    core = attn.core_attention
    scale = getattr(core, "softmax_scale", None)
    if scale is None:
        raise Unsupported(f"core attention {type(core).__name__}")
    wqkv, bqkv = _linear(attn.linear_qkv)
    wo, bo = _linear(attn.linear_proj)
    groups = attn.num_query_groups_per_partition
    per_group = attn.num_attention_heads_per_partition // groups
    dim = attn.hidden_size_per_attention_head
    qnorm = _norm(getattr(attn, "q_layernorm", None))
    knorm = _norm(getattr(attn, "k_layernorm", None))
    keys, values = prefilled.cached_sequence(attn.layer_number)  # (B, W, G, D), before RoPE
    if prefilled.rotary is not None:
        cos, sin = (t[:prefilled.width].transpose(0, 1) for t in prefilled.rotary)
        keys = _rotate(keys, cos, sin)  # the one rotation of the prompt's keys
    batch, width = prefilled.batch, prefilled.width
    cache_k = keys.new_zeros(batch, groups, prefilled.total, dim)
    cache_v = values.new_zeros(batch, groups, prefilled.total, dim)
    cache_k[:, :, :width] = keys.transpose(1, 2)
    cache_v[:, :, :width] = values.transpose(1, 2)
    attend = prefilled.attend[:, None, None]  # (B, 1, 1, total)

    def attention(x):
        col = width + prefilled.step
        qkv = F.linear(x, wqkv, bqkv).view(batch, groups, per_group + 2, dim)
        q = qnorm(qkv[:, :, :per_group].reshape(batch, groups * per_group, dim))
        k, v = knorm(qkv[:, :, per_group]), qkv[:, :, per_group + 1]
        if prefilled.rotary is not None:
            cos, sin = prefilled.rotary[0][col], prefilled.rotary[1][col]  # (B, 1, rot_dim)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        cache_k[:, :, col] = k
        cache_v[:, :, col] = v
        out = F.scaled_dot_product_attention(
            q[:, :, None], cache_k[:, :, :col + 1], cache_v[:, :, :col + 1],
            attn_mask=attend[..., :col + 1], scale=scale, enable_gqa=per_group > 1)
        return F.linear(out.reshape(batch, -1), wo, bo)

    return attention


def transformer_layer(layer, prefilled: Prefilled) -> LayerDecoder:
    """megatron's ``TransformerLayer`` (and the hybrid stack's ``MLPLayer``): attention and / or
    MLP / MoE, each with its pre-norm and residual."""
    if not _is_identity(layer.cross_attention):
        raise Unsupported("cross attention")
    parts = []
    if not _is_identity(layer.self_attention):
        parts.append((_norm(layer.input_layernorm),
                      _attention(layer.self_attention, prefilled)))
    if not _is_identity(layer.mlp):
        mlp = layer.mlp
        kind = type(mlp).__name__
        if kind == "MoELayer":
            parts.append((_norm(layer.pre_mlp_layernorm), _moe(mlp)))
        elif kind == "MLP":
            parts.append((_norm(layer.pre_mlp_layernorm), _mlp(mlp)))
        else:
            raise Unsupported(f"MLP {kind}")

    def step(x):
        for norm, part in parts:
            x = x + part(norm(x))
        return x

    return step


def mamba_layer(layer, prefilled: Prefilled) -> LayerDecoder:
    """megatron's ``MambaLayer``: norm, then its Mamba2 mixer one token per row (what the
    mixer's own torch decode step computes: conv window, h = exp(dt A) h + dt B x,
    y = C.h + D x, gated norm), residual."""
    mixer = layer.mixer
    norm = _norm(layer.norm)
    w_in, b_in = _linear(mixer.in_proj)
    w_out, b_out = _linear(mixer.out_proj)
    conv_w = mixer.conv1d.weight.reshape(mixer.conv1d.weight.shape[0], -1)  # (conv dim, width)
    conv_b = mixer.conv1d.bias
    inner, heads, state = mixer.d_inner_local_tp, mixer.nheads_local_tp, mixer.d_state
    groups, head_dim = mixer.ngroups_local_tp, mixer.headdim
    split = [inner, inner + 2 * groups * state, heads]
    gated_norm = _plain(mixer.norm) if mixer.rmsnorm else None
    A = -torch.exp(mixer.A_log.float())
    conv, ssm = prefilled.row_states(mixer.layer_number)  # (B, conv dim, width), (B, h, p, n)
    batch = prefilled.batch
    states = {"conv": conv, "ssm": ssm}

    def per_head(t):  # (B, g*n) -> (B, h, n): each head reads its group's B / C
        t = t.view(batch, groups, 1, state).expand(batch, groups, heads // groups, state)
        return t.reshape(batch, heads, state)

    def mamba(x):
        z, xbc, dt = F.linear(norm(x), w_in, b_in).split(split, dim=-1)
        window = torch.cat((states["conv"][..., 1:], xbc[..., None]), dim=-1)
        states["conv"] = window
        xbc = mixer.act((window * conv_w).sum(-1) + (0 if conv_b is None else conv_b))
        xs, b, c = xbc.split([inner, groups * state, groups * state], dim=-1)
        xs = xs.view(batch, heads, head_dim)
        dt = F.softplus(dt + mixer.dt_bias.to(dt.dtype))  # (B, h)
        ssm = (states["ssm"] * torch.exp(dt * A)[..., None, None]
               + (dt[..., None] * xs)[..., None] * per_head(b)[:, :, None])
        states["ssm"] = ssm
        y = (ssm.to(x.dtype) @ per_head(c)[..., None]).squeeze(-1)
        y = (y + mixer.D.to(x.dtype).reshape(heads, -1) * xs).reshape(batch, inner)
        y = gated_norm(y, z) if gated_norm is not None else y * mixer.act(z)
        return x + F.linear(y, w_out, b_out)

    return mamba


def _layer_decoders() -> dict[type, Callable]:
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return {TransformerLayer: transformer_layer, MambaLayer: mamba_layer}


#: megatron layer class -> builder ``(layer, prefilled) -> LayerDecoder`` (subclasses match)
LAYER_DECODERS: dict[type, Callable] = {}


def _layer_decoder(layer, prefilled: Prefilled) -> LayerDecoder:
    if hasattr(layer, "lean_decoder"):
        return layer.lean_decoder(prefilled)
    if not LAYER_DECODERS:
        LAYER_DECODERS.update(_layer_decoders())
    for cls in type(layer).__mro__:
        if cls in LAYER_DECODERS:
            return LAYER_DECODERS[cls](layer, prefilled)
    raise Unsupported(f"layer {type(layer).__name__}")


def mamba_pad_hooks(mixer, keep: torch.Tensor) -> list:
    """Hooks on a megatron ``MambaMixer`` for a left-padded prefill (what transformers' Mamba2
    does with its attention mask): on pad tokens ``in_proj`` gets a zero input (z, x, B, C are 0:
    the conv window of the first real tokens sees zeros, as from a zero state) and its dt output
    is set to -1e4 (softplus(dt + dt_bias) = 0: the SSM state is neither decayed nor written).
    ``keep`` (b, w): True on real tokens. Returns the hook handles."""
    keep_lb = keep.transpose(0, 1)[..., None]  # (w, b, 1): megatron's sequence-first layout
    heads = mixer.nheads_local_tp  # dt: the last columns of z | x | B | C | dt

    def zero_pads(_module, args):
        return (args[0] * keep_lb.to(args[0].dtype), *args[1:])

    def no_step_on_pads(_module, _args, output):
        out, bias = output
        dt = out[..., -heads:].masked_fill(~keep_lb, -1e4)
        return torch.cat([out[..., :-heads], dt], dim=-1), bias

    return [mixer.in_proj.register_forward_pre_hook(zero_pads),
            mixer.in_proj.register_forward_hook(no_step_on_pads)]


#: module class -> ``(module, keep) -> hook handles`` for a left-padded prefill (subclasses match)
PREFILL_PAD_HOOKS: dict[type, Callable] = {}


@contextlib.contextmanager
def padded_prefill(lm, keep: torch.Tensor):
    """While the prefill of a left-padded batch runs: the pad hooks of every module with a state
    the pads must not reach (``PREFILL_PAD_HOOKS``, or the module's ``prefill_pad_hooks(keep)``).
    ``keep`` (b, w): True on real tokens; nothing to do when there is no padding."""
    if not PREFILL_PAD_HOOKS:
        from megatron.core.ssm.mamba_mixer import MambaMixer

        PREFILL_PAD_HOOKS[MambaMixer] = mamba_pad_hooks
    handles = []
    try:
        if not bool(keep.all()):
            for module in lm.modules():
                if hasattr(module, "prefill_pad_hooks"):
                    handles += module.prefill_pad_hooks(keep)
                    continue
                hooks = next((PREFILL_PAD_HOOKS[c] for c in type(module).__mro__
                              if c in PREFILL_PAD_HOOKS), None)
                if hooks is not None:
                    handles += hooks(module, keep)
        yield
    finally:
        for handle in handles:
            handle.remove()


def rotary_table(lm, positions: torch.Tensor) -> tuple | None:
    """(cos, sin) (L, B, 1, rot_dim) of a language model's rotary at the (3, B, L) positions:
    M-RoPE (megatron's ``MultimodalRotaryEmbedding`` table) or None without position embedding.

    Raises:
        Unsupported: another position embedding.
    """
    kind = getattr(lm, "position_embedding_type", None)
    if kind == "none":
        return None
    if kind != "mrope":
        raise Unsupported(f"position embedding {kind!r}")
    freqs = lm.rotary_pos_emb(positions, lm.mrope_section)  # (L, B, 1, rot_dim)
    return freqs.cos(), freqs.sin()


class Decoder:
    """tokens (B,) -> next logits (B, V) (see module docstring)."""

    def __init__(self, lm, prefilled: Prefilled):
        self.prefilled = prefilled
        self.embedding = _plain(lm.embedding.word_embeddings).weight
        decoder = lm.decoder
        self.layers = [_layer_decoder(layer, prefilled) for layer in decoder.layers]
        final = getattr(decoder, "final_layernorm", None) or getattr(decoder, "final_norm", None)
        self.final_norm = _norm(final)
        self.output = (lm.shared_embedding_or_output_weight()
                       if lm.share_embeddings_and_output_weights
                       else _linear(lm.output_layer)[0])
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
