"""The lean decode step's layer builders (models/generation/decode_step.py): each turns one megatron
layer into a closure over its parameters (read once) that takes the residual stream of one new token
per row, (B, H), and returns the layer's output, advancing the layer's own cache / state.

- ``transformer_layer``: megatron's ``TransformerLayer`` / the hybrid stack's ``MLPLayer``:
  attention (GQA, q/k norms, biases, the output gate sigmoid(gate) of ``attention_output_gate``;
  rotary on all or the first part of each head; keys cached after RoPE), or a ``self_attention``
  mixer with its own ``lean_decoder(prefilled)`` (the Gated DeltaNet:
  models/generation/decode_deltanet.py); dense MLP, MoE (the router's gating and top-k as megatron
  computes them at inference; the picked experts on all rows, weighted by the router's
  probabilities; the shared expert, with its sigmoid gate where it has one);
- ``mamba_layer``: megatron's ``MambaLayer`` (Mamba2 mixer: conv window, SSM state, gated norm);
  ``mamba_pad_hooks``: the hooks that keep left padding out of its prefill state.

Norms: torch's ``RMSNorm`` / ``LayerNorm`` and the zero-centred
``models.layers.norms.ZeroCenteredRMSNorm`` (weight applied as 1 + w in float32). A builder raises
``Unsupported`` for a part it does not cover (the generator then runs megatron's own decode
step). ``prefilled`` is ``models.generation.decode_step.Prefilled`` (the prefill's caches and the
run's geometry).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.norms import ZeroCenteredRMSNorm


class Unsupported(Exception):
    """A part of the model the lean step does not cover (the generator falls back)."""


def plain(module: nn.Module) -> nn.Module:
    """The module, when no forward hook changes what its weights compute (an unmerged LoRA
    adapter is one)."""
    if module._forward_hooks or module._forward_pre_hooks:
        raise Unsupported(f"forward hooks on {type(module).__name__}")
    return module


def is_identity(module) -> bool:
    """megatron's placeholder for a sub-layer a layer does not have."""
    return type(module).__name__ in ("IdentityOp", "IdentityFuncOp", "Identity")


def norm_of(module) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> the norm of x over its last dims, from the module's weight (torch norms only)."""
    if module is None or is_identity(module):
        return lambda x: x
    plain(module)
    if isinstance(module, nn.RMSNorm):
        shape, weight, eps = module.normalized_shape, module.weight, module.eps
        return lambda x: F.rms_norm(x, shape, weight, eps)
    if isinstance(module, ZeroCenteredRMSNorm):  # its forward: float32, times 1 + w, cast back
        shape, eps = module.weight.shape, module.eps
        scale = 1.0 + module.weight.float()
        return lambda x: (torch.rms_norm(x.float(), shape, None, eps) * scale).type_as(x)
    if isinstance(module, nn.LayerNorm):
        shape, weight, bias, eps = (module.normalized_shape, module.weight, module.bias,
                                    module.eps)
        return lambda x: F.layer_norm(x, shape, weight, bias, eps)
    raise Unsupported(f"norm {type(module).__name__}")


def linear_of(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a megatron linear (its bias added whether or not megatron skips it:
    the layer adds it to the same output)."""
    plain(module)
    if getattr(module, "weight", None) is None:
        raise Unsupported(f"linear {type(module).__name__} without weight")
    return module.weight, getattr(module, "bias", None)


def rotate(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE (megatron's non-interleaved ``_apply_rotary_pos_emb_bshd``) on the first
    ``cos.shape[-1]`` channels of t: t cos + (-t2, t1) sin, with the sign of the rotated half
    folded into ``signed_sin`` (``models.generation.decode_step.rotary_table``)."""
    dim = cos.shape[-1]
    rot, rest = t[..., :dim], t[..., dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat((x2, x1), dim=-1) * signed_sin
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot


def mlp_step(module) -> Callable:
    """(x (N, H), per-row scale (N,) or None) -> a megatron ``MLP``'s output (N, H)."""
    w1, b1 = linear_of(module.linear_fc1)
    w2, b2 = linear_of(module.linear_fc2)
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


def router_step(router) -> Callable:
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


def shared_expert_step(module) -> Callable:
    """x (B, H) -> a megatron ``SharedExpertMLP``'s output: its MLP, times sigmoid(x gate) where
    it has a gate (``moe_shared_expert_gate``: one (1, H) weight)."""
    mlp = mlp_step(module)
    gate = module.gate_weight if getattr(module, "use_shared_expert_gate", False) else None
    if gate is None:
        return mlp
    return lambda x: mlp(x) * torch.sigmoid(F.linear(x, gate))


def moe_step(module) -> Callable:
    """x (B, H) -> a megatron ``MoELayer``'s output: its router's choice, the picked experts
    weighted by their probabilities, the shared expert. LatentMoE (``moe_latent_size``): the
    experts run on ``fc1_latent_proj(x)`` and their weighted sum goes through
    ``fc2_latent_proj`` (the router and the shared expert read x). Experts over ranks (EP > 1,
    each expert whole: expert-TP 1): each rank adds its own experts' share and one all-reduce
    over the expert-parallel group sums them; that needs the same rows on every EP rank
    (``models.generation.generate.same_prompts_on_expert_ranks`` checks it)."""
    experts = getattr(module.experts, "local_experts", None)
    cfg = module.config
    if experts is None:
        raise Unsupported("MoE layout (grouped experts)")
    down, up = ((linear_of(module.fc1_latent_proj), linear_of(module.fc2_latent_proj))
                if getattr(cfg, "moe_latent_size", None) else (None, None))
    if getattr(cfg, "moe_shared_expert_overlap", False):
        raise Unsupported("MoE shared expert overlapped with the dispatcher")
    group = None
    if len(experts) != cfg.num_moe_experts:
        from megatron.core import parallel_state

        if parallel_state.get_expert_tensor_parallel_world_size() > 1:
            raise Unsupported("experts' linears over ranks (expert tensor parallel)")
        group = parallel_state.get_expert_model_parallel_group()
    route = router_step(module.router)
    mlps = dict(zip(getattr(module, "local_expert_indices", range(len(experts))),
                    (mlp_step(e) for e in experts)))  # global expert index -> its MLP
    shared = (shared_expert_step(module.shared_experts)
              if getattr(module, "use_shared_expert", False) else None)

    def moe(x):
        probs, top = route(x)  # (B, k) each
        inner = x if down is None else F.linear(x, *down)  # the experts' input (latent width)
        out = torch.zeros_like(inner)
        for e in top.unique().tolist():  # the experts this step needs (one host sync)
            if e in mlps:
                weight = (probs * (top == e)).sum(-1)  # (B,): 0 where a row did not pick e
                out = out + mlps[e](inner, weight)
        if group is not None:  # the other ranks' experts
            torch.distributed.all_reduce(out, group=group)
        if up is not None:
            out = F.linear(out, *up)
        return out + shared(x) if shared is not None else out

    return moe


def attention_step(attn, prefilled) -> Callable:
    """x (B, H) (normed) -> a megatron ``SelfAttention``'s output, over its cache (keys after
    RoPE) of the prefill and the steps so far. ``linear_qkv`` gives per KV group its query heads,
    with ``attention_output_gate`` as many gate heads, a key and a value; the gate multiplies the
    attention's output by sigmoid(gate) in float32 before ``linear_proj`` (megatron's
    ``_apply_output_gate``)."""
    cfg = attn.config
    if (getattr(cfg, "multi_latent_attention", False) or getattr(cfg, "rotary_interleaved", False)
            or getattr(cfg, "apply_query_key_layer_scaling", False)):
        raise Unsupported("multi-latent, interleaved-rotary or layer-scaled attention")
    core = attn.core_attention
    scale = getattr(core, "softmax_scale", None)
    if scale is None:
        raise Unsupported(f"core attention {type(core).__name__}")
    wqkv, bqkv = linear_of(attn.linear_qkv)
    wo, bo = linear_of(attn.linear_proj)
    groups = attn.num_query_groups_per_partition
    per_group = attn.num_attention_heads_per_partition // groups
    gated = getattr(cfg, "attention_output_gate", False)
    parts = (2 if gated else 1) * per_group + 2  # per KV group: queries | gates | key | value
    dim = attn.hidden_size_per_attention_head
    qnorm = norm_of(getattr(attn, "q_layernorm", None))
    knorm = norm_of(getattr(attn, "k_layernorm", None))
    keys, values = prefilled.cached_sequence(attn.layer_number)  # (B, W, G, D), before RoPE
    if prefilled.rotary is not None:
        cos, sin = (t[:prefilled.width].transpose(0, 1) for t in prefilled.rotary)
        keys = rotate(keys, cos, sin)  # the one rotation of the prompt's keys
    batch, width = prefilled.batch, prefilled.width
    cache_k = keys.new_zeros(batch, groups, prefilled.total, dim)
    cache_v = values.new_zeros(batch, groups, prefilled.total, dim)
    cache_k[:, :, :width] = keys.transpose(1, 2)
    cache_v[:, :, :width] = values.transpose(1, 2)
    # (B, 1, 1, total); no mask at all when no row is padded
    attend = None if bool(prefilled.attend.all()) else prefilled.attend[:, None, None]
    heads = groups * per_group

    def attention(x):
        col = width + prefilled.step
        qkv = F.linear(x, wqkv, bqkv).view(batch, groups, parts, dim)
        q = qnorm(qkv[:, :, :per_group].reshape(batch, heads, dim))
        k, v = knorm(qkv[:, :, -2]), qkv[:, :, -1]
        if prefilled.rotary is not None:  # q and k in one rotation
            cos, sin = prefilled.rotary[0][col], prefilled.rotary[1][col]  # (B, 1, rot_dim)
            qk = rotate(torch.cat((q, k), dim=1), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        cache_k[:, :, col] = k
        cache_v[:, :, col] = v
        out = F.scaled_dot_product_attention(
            q[:, :, None], cache_k[:, :, :col + 1], cache_v[:, :, :col + 1],
            attn_mask=None if attend is None else attend[..., :col + 1], scale=scale,
            enable_gqa=per_group > 1).reshape(batch, -1)
        if gated:  # the gate heads in the order of the query heads
            gate = qkv[:, :, per_group:2 * per_group].reshape(batch, -1)
            out = (out * torch.sigmoid(gate.float())).to(out.dtype)
        return F.linear(out, wo, bo)

    return attention


#: ``self_attention`` mixer class -> builder ``(mixer, prefilled) -> step`` of a mixer with a
#: decode step of its own (a recurrent one; registered by models/generation/decode_step.py;
#: subclasses match); any other mixer is attention
MIXER_DECODERS: dict[type, Callable] = {}


def transformer_layer(layer, prefilled) -> Callable:
    """megatron's ``TransformerLayer`` (and the hybrid stack's ``MLPLayer``): attention and / or
    MLP / MoE, each with its pre-norm and residual."""
    if not is_identity(layer.cross_attention):
        raise Unsupported("cross attention")
    parts = []
    mixer = layer.self_attention
    if not is_identity(mixer):  # a mixer with its own step (a recurrent one), else attention
        builder = next((MIXER_DECODERS[c] for c in type(mixer).__mro__ if c in MIXER_DECODERS),
                       attention_step)
        parts.append((norm_of(layer.input_layernorm), builder(mixer, prefilled)))
    if not is_identity(layer.mlp):
        mlp = layer.mlp
        kind = type(mlp).__name__
        if kind in ("MoELayer", "LatentMoELayer"):
            parts.append((norm_of(layer.pre_mlp_layernorm), moe_step(mlp)))
        elif kind == "MLP":
            parts.append((norm_of(layer.pre_mlp_layernorm), mlp_step(mlp)))
        else:
            raise Unsupported(f"MLP {kind}")

    def step(x):
        for pre, part in parts:
            x = x + part(pre(x))
        return x

    return step


def mamba_layer(layer, prefilled) -> Callable:
    """megatron's ``MambaLayer``: norm, then its Mamba2 mixer one token per row (what the
    mixer's own torch decode step computes: conv window, h = exp(dt A) h + dt B x,
    y = C.h + D x, gated norm), residual."""
    mixer = layer.mixer
    if getattr(layer, "residual_in_fp32", False):
        raise Unsupported("Mamba residual in fp32")
    pre_norm = norm_of(layer.norm)
    w_in, b_in = linear_of(mixer.in_proj)
    w_out, b_out = linear_of(mixer.out_proj)
    conv1d = getattr(mixer, "conv1d", None)  # megatron-core <= 0.18 an nn.Conv1d; 0.19 params
    conv_w = mixer.conv1d_weight if conv1d is None else conv1d.weight
    conv_b = mixer.conv1d_bias if conv1d is None else conv1d.bias
    conv_w = conv_w.reshape(conv_w.shape[0], -1)  # (conv dim, width)
    inner, heads, state = mixer.d_inner_local_tp, mixer.nheads_local_tp, mixer.d_state
    groups, head_dim = mixer.ngroups_local_tp, mixer.headdim
    split = [inner, inner + 2 * groups * state, heads]
    gated_norm = plain(mixer.norm) if mixer.rmsnorm else None
    A = -torch.exp(mixer.A_log.float())
    conv, ssm = prefilled.row_states(mixer.layer_number)  # (B, conv dim, width), (B, h, p, n)
    batch = prefilled.batch
    states = {"conv": conv, "ssm": ssm}

    def per_head(t):  # (B, g*n) -> (B, h, n): each head reads its group's B / C
        t = t.view(batch, groups, 1, state).expand(batch, groups, heads // groups, state)
        return t.reshape(batch, heads, state)

    def mamba(x):
        z, xbc, dt = F.linear(pre_norm(x), w_in, b_in).split(split, dim=-1)
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
