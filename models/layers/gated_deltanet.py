"""Gated DeltaNet, the linear-attention mixer of Qwen3.5 / Qwen3-Next, as a megatron-core
``self_attention`` module that takes packed sequences and caches its state for generation.

This module owns the layer (``GatedDeltaNet``) and its local layer spec (``gdn_layer_spec``).
Per token (heads of K / V width; each q/k head serves ``num_value_heads / num_key_heads``
consecutive value heads):

    q, k, v = SiLU(causal depthwise conv(x W_q | x W_k | x W_v))        (kernel w, no bias)
    q, k = L2-normalised;  beta = sigmoid(x W_b);  g = -exp(A_log) * softplus(x W_a + dt_bias)
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,  o_t = S_t^T q_t / sqrt(K)
    out = (RMSNorm(o_t) * w_norm * SiLU(x W_z)) W_out                   (norm per value head)

Layout (tensor parallel): the projections are megatron ``ColumnParallelLinear``s, one per
component (``in_proj_q / _k / _v / _z / _b / _a``: every weight a plain row block per rank, so
dist checkpoints reshard at any TP and the HF import slices by ``partition_dim`` alone), the
depthwise conv weights (``conv_q / _k / _v`` (channels, w)), ``dt_bias`` and ``A_log`` are split
the same way (heads per rank: whole key heads with their value heads), the gated norm's weight
(V) is replicated, ``out_proj`` is a ``RowParallelLinear``. With sequence parallelism the column
projections gather the sequence and ``out_proj`` scatters it again (the mixer itself runs on the
whole sequence of this rank's heads).

Packed sequences (THD, ``packed_seq_params.cu_seqlens_q``): the conv window never reaches into
an earlier sample (``seq_idx``) and the recurrence restarts from a zero state at every boundary
(the kernel's ``cu_seqlens``): a packed sample equals the same sample alone.

Generation (megatron's static ``inference_context``, as its Mamba mixer): the prefill
(``sequence_len_offset == 0``) runs the chunked rule and stores, per layer, the conv state (the
last w - 1 inputs of the conv, (b, channels, w - 1)) and the recurrent state (b, heads, K, V)
float32 in ``key_value_memory_dict[layer_number]``; every decode step (one token) updates both in
place (``causal_conv1d_update``, ``fused_recurrent_gated_delta_rule``): megatron's own decode
step. The layer has no padding mask: a left-padded prefill of prompts of unequal length keeps the
pads out of both states through pad hooks (zero conv input, beta = 0 and decay g = 0 on pads),
and greedy generation's lean decode step runs the layer from those states in plain torch; both
live in models/generation/decode_deltanet.py, registered by models/generation/decode_step.py
(its plug-in points for a recurrent layer).

Kernels: what ``models.kernels`` chose for this process (kinds ``deltanet``: fla-core's
``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` or the torch ones of
models/kernels/gated_delta.py; ``conv``: causal-conv1d, fla-core's Triton conv or torch's), read
when the layer runs, so every device builds and trains the layer (a GPU whose fla-core refuses
its backward runs the torch rule). megatron-core versions: 0.16.1 (installed) ships a
``GatedDeltaNet`` that refuses packed sequences and inference and needs ``fla`` to build; packing
and context parallelism for it ship in 0.18. This layer is used with every version (the model's
spec names it), so results do not depend on the installed megatron-core; the switch to
megatron's own layer, once the project moves to >= 0.18, is a spec change (its checkpoint names
differ: one fused ``in_proj``).

Context parallelism (CP > 1, unpacked rows: each rank holds its zig-zag share of the
sequence, ``zigzag``). Where this rank's key heads split evenly over the CP ranks
(``shares_heads``), the heads are shared, as megatron >= 0.18's layer does: each rank projects
its share of the tokens (all heads), an all-to-all gives every rank the whole sequence (in order)
of 1 / CP of the heads, which runs its conv, recurrence and gated norm (the heads are
independent), and a second all-to-all returns each rank its tokens of every head for
``out_proj``. Every op then works on 1 / CP of the layer (measured: bench/bench_deltanet_cp.py,
docs/models.md). Otherwise (e.g. one key head per TP rank at CP 2) the layer gathers the whole
sequence from the CP ranks, runs on it (every rank the same, all heads) and keeps its own share
of the output; the gather's gradient is summed over the ranks: CP-fold DeltaNet compute. Either
way the recurrence sees the tokens in order, so CP = 2 equals CP = 1 (tested for both paths).
With sequence parallelism too (TP and CP with MoE layers) a rank holds a TP piece of its share:
the heads-shared path is unchanged (its projections gather the pieces), the gather path gathers
the pieces over TP first (``_sequence_over_cp``); TP 2 x CP 2 equals one process on both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from torch import nn

from models import kernels
from models.layers.norms import gated_rms_norm
from models.multimodal import zigzag

PARTS = ("q", "k", "v")


def segment_index(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """(1, length) int32 segment number of every token of a packed row."""
    sizes = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.repeat_interleave(torch.arange(len(sizes), device=cu_seqlens.device), sizes)
    return ids.to(torch.int32)[None, :length]


class _GatherSequence(torch.autograd.Function):
    """The whole sequence (s, b, h) in order from every CP rank's zig-zag share (s / CP, b, h);
    backward: the gradient summed over the ranks, this rank's share of it."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, size: int, rank: int, group):
        ctx.size, ctx.rank, ctx.group = size, rank, group
        shares = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(shares, local.contiguous(), group=group)
        chunks = [None] * (2 * size)
        for r, share in enumerate(shares):  # rank r holds chunks r and 2 * size - 1 - r
            chunks[r], chunks[2 * size - 1 - r] = share.chunk(2, 0)
        return torch.cat(chunks, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return zigzag(grad, 0, ctx.size, ctx.rank), None, None, None


class _AllToAll(torch.autograd.Function):
    """(CP, ...) chunks, chunk r to CP rank r -> (CP, ...) chunks, chunk r from CP rank r (equal
    shapes); backward: the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, chunks: torch.Tensor, group):
        ctx.group = group
        received = [torch.empty_like(chunk) for chunk in chunks]
        dist.all_to_all(received, [chunk.contiguous() for chunk in chunks], group=group)
        return torch.stack(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group), None


def shares_heads(key_heads: int, cp: int) -> bool:
    """Whether a DeltaNet layer with ``key_heads`` key heads on this TP rank shares its heads over
    ``cp`` context-parallel ranks (else it gathers the sequence: module docstring)."""
    return cp > 1 and key_heads % cp == 0


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head times SiLU(z) (transformers' ``Qwen3_5RMSNormGated``: the
    weight applied as is, not zero-centred). The weight is replicated over TP while each rank
    normalises its own heads: its gradient is summed over TP (megatron's copy region)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            weight = tensor_parallel.copy_to_tensor_model_parallel_region(weight)
        return gated_rms_norm(x, z, weight, self.eps)


class GatedDeltaNet(MegatronModule):
    """The Gated DeltaNet mixer (module docstring); megatron's ``self_attention`` interface:
    (s, b, h) -> ((s, b, h), None)."""

    def __init__(self, config, layer_number: int | None = None, **_unused):
        super().__init__(config=config)
        self.layer_number = layer_number
        tp = parallel_state.get_tensor_model_parallel_world_size()
        c = config
        self.key_dim, self.value_dim = c.linear_key_head_dim, c.linear_value_head_dim
        key_heads, value_heads = c.linear_num_key_heads, c.linear_num_value_heads
        if key_heads % tp or value_heads % key_heads:
            raise ValueError(f"Gated DeltaNet: {key_heads} key heads / {value_heads} value heads "
                             f"do not split over tensor parallel {tp}")
        self.key_heads, self.value_heads = key_heads // tp, value_heads // tp
        self.width = c.linear_conv_kernel_dim
        widths = {"q": key_heads * self.key_dim, "k": key_heads * self.key_dim,
                  "v": value_heads * self.value_dim, "z": value_heads * self.value_dim,
                  "b": value_heads, "a": value_heads}

        def column(out: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(c.hidden_size, out, config=c, init_method=c.init_method,
                                        bias=False, gather_output=False, skip_bias_add=True)

        for name, out in widths.items():
            setattr(self, f"in_proj_{name}", column(out))
        for name in PARTS:
            self._sharded(f"conv_{name}", torch.empty(widths[name] // tp, self.width))
            nn.init.uniform_(getattr(self, f"conv_{name}"), -self.width ** -0.5,
                             self.width ** -0.5)
        self._sharded("dt_bias", torch.ones(self.value_heads))
        self._sharded("A_log", torch.empty(self.value_heads).uniform_(1, 16).log())
        self.norm = GatedRMSNorm(self.value_dim, c.layernorm_epsilon)
        self.out_proj = RowParallelLinear(widths["v"], c.hidden_size, config=c,
                                          init_method=c.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=True)

    def _sharded(self, name: str, value: torch.Tensor) -> None:
        param = nn.Parameter(value.to(self.config.params_dtype))
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
        setattr(self, name, param)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The dist-checkpoint dict: the conv kernels, ``dt_bias`` and ``A_log`` split over TP on
        dim 0 (one replica per data-parallel group), the projections' own, the norm replicated."""
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
            sharded_state_dict_default,
        )

        tp = parallel_state.get_tensor_model_parallel_group()
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = {name: p for name, p in self.named_parameters(recurse=False)}
        out = make_sharded_tensors_for_checkpoint(own, prefix, {name: 0 for name in own},
                                                  sharded_offsets, tp_group=tp,
                                                  dp_cp_group=metadata["dp_cp_group"])
        for name, child in self.named_children():
            out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets,
                                                  metadata, tp_group=tp))
        return out

    # ---------------------------------------------------------------- forward
    def forward(self, hidden_states, attention_mask=None, inference_context=None,
                packed_seq_params=None, inference_params=None, **_unused):
        """hidden_states (s, b, h) -> (out (s, b, h), None); ``packed_seq_params``: THD
        segments (b = 1); ``inference_context``: megatron's static context (prefill / decode)."""
        context = inference_context or inference_params
        if context is not None and self.training:
            context = None
        cp_size = parallel_state.get_context_parallel_world_size()
        if cp_size > 1:  # module docstring: heads shared, or the whole sequence gathered
            if packed_seq_params is not None or context is not None:
                raise ValueError("Gated DeltaNet under context parallelism takes unpacked rows "
                                 "and no generation")
            cp_rank = parallel_state.get_context_parallel_rank()
            group = parallel_state.get_context_parallel_group()
            if shares_heads(self.key_heads, cp_size):
                return self._heads_over_cp(hidden_states, cp_size, cp_rank, group)
            return self._sequence_over_cp(hidden_states, cp_size, cp_rank, group)
        return self._mix(hidden_states, context, packed_seq_params)

    def _project(self, hidden_states) -> dict[str, torch.Tensor]:
        """The input projections of (s, b, h): name -> (b, s, width) (this TP rank's heads)."""
        return {name: getattr(self, f"in_proj_{name}")(hidden_states)[0].transpose(0, 1)
                for name in ("q", "k", "v", "z", "b", "a")}

    def _mix(self, hidden_states, context, packed_seq_params):
        """The layer on (s, b, h) (this rank's whole sequence) -> ((s, b, h), None)."""
        out = self._mixer(self._project(hidden_states), context, packed_seq_params)
        return self.out_proj(out.transpose(0, 1).contiguous())[0], None

    def _sequence_over_cp(self, hidden_states, cp: int, rank: int, group):
        """The layer on the whole sequence gathered from the CP ranks (module docstring) ->
        this rank's share of its output. Under sequence parallelism (TP > 1 with MoE layers) the
        input and output are this TP rank's contiguous piece of the share: the pieces are
        gathered over TP before the CP gather, the whole sequence is handed to the projections
        as SP pieces again (they gather it), and the output's pieces are gathered back before
        this rank's share is taken. Every TP rank then holds the same gathered tensors, so each
        gather's gradient is this rank's piece, not a sum (``tensor_parallel_output_grad``)."""
        sp = self.config.sequence_parallel and (
            parallel_state.get_tensor_model_parallel_world_size() > 1)
        if sp:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        whole = _GatherSequence.apply(hidden_states, cp, rank, group)
        if sp:
            whole = tensor_parallel.scatter_to_sequence_parallel_region(whole)
        out, bias = self._mix(whole, None, None)
        if sp:
            out = tensor_parallel.gather_from_sequence_parallel_region(
                out, tensor_parallel_output_grad=False)
        out = zigzag(out, 0, cp, rank)
        if sp:
            out = tensor_parallel.scatter_to_sequence_parallel_region(out)
        return out, bias

    def _heads_over_cp(self, hidden_states, cp: int, rank: int, group):
        """The layer on this rank's zig-zag share (s / cp, b, h), the heads shared over the CP
        ranks (module docstring) -> ((s / cp, b, h), None)."""
        proj = self._project(hidden_states)
        names = list(proj)
        batch, share = proj["q"].shape[:2]
        # (cp, b, s / cp, width / cp): chunk r holds head group r of every projection
        send = torch.cat([proj[n].reshape(batch, share, cp, -1) for n in names], -1)
        got = _AllToAll.apply(send.permute(2, 0, 1, 3), group)  # chunk r: rank r's tokens
        pieces = [None] * (2 * cp)
        for r, tokens in enumerate(got):  # rank r holds chunks r and 2 * cp - 1 - r
            pieces[r], pieces[2 * cp - 1 - r] = tokens.chunk(2, 1)
        whole = torch.cat(pieces, 1)  # (b, s, width / cp), the tokens in order
        widths = [proj[n].shape[-1] // cp for n in names]
        out = self._mixer(dict(zip(names, whole.split(widths, -1))), None, None,
                          heads=(rank, cp))
        back = torch.stack([zigzag(out, 1, cp, r) for r in range(cp)])  # rank r's tokens
        mine = _AllToAll.apply(back, group)  # (cp, b, s / cp, width / cp): head group r
        out = mine.permute(1, 2, 0, 3).reshape(batch, share, -1)
        return self.out_proj(out.transpose(0, 1).contiguous())[0], None

    def _mixer(self, proj: dict, context, packed_seq_params, heads: tuple[int, int] = (0, 1)):
        """Conv, gated delta rule and gated norm of the projections ``proj`` (name -> (b, s,
        width)) of head group ``heads`` = (index, groups) of this TP rank's heads -> (b, s, value
        width of the group)."""
        index, groups = heads
        key_heads, value_heads = self.key_heads // groups, self.value_heads // groups
        widths = {"q": key_heads * self.key_dim, "k": key_heads * self.key_dim,
                  "v": value_heads * self.value_dim}
        batch, length = proj["q"].shape[:2]
        x = torch.cat([proj[name] for name in PARTS], -1)  # the conv's input channels
        weight = torch.cat([getattr(self, f"conv_{name}")[index * widths[name]:
                                                          (index + 1) * widths[name]]
                            for name in PARTS], 0)
        decode = context is not None and context.sequence_len_offset > 0
        conv, rule = kernels.chosen("conv").impl, kernels.chosen("deltanet").impl
        if decode:
            conv_state, state = context.key_value_memory_dict[self.layer_number]
            if length != 1:
                raise ValueError(f"Gated DeltaNet decode steps take one token, got {length}")
            mixed = conv.update(x[:, 0], conv_state, weight, None, "silu")[:, None]
        else:
            seq_idx = cu = None
            if packed_seq_params is not None:
                cu = packed_seq_params.cu_seqlens_q
                seq_idx = segment_index(cu, length)
            mixed = conv.fn(x.transpose(1, 2), weight, None, seq_idx=seq_idx,
                            activation="silu").transpose(1, 2)
        q, k, v = mixed.split([widths[name] for name in PARTS], -1)
        repeat = value_heads // key_heads
        q, k = (t.reshape(batch, length, key_heads, self.key_dim)
                .repeat_interleave(repeat, dim=2) for t in (q, k))
        v = v.reshape(batch, length, value_heads, self.value_dim)
        beta = proj["b"].sigmoid()
        heads_of = slice(index * value_heads, (index + 1) * value_heads)
        g = -self.A_log[heads_of].float().exp() * F.softplus(
            proj["a"].float() + self.dt_bias[heads_of].float())
        if decode:
            out, state = rule.recurrent(
                q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                use_qk_l2norm_in_kernel=True)
            context.key_value_memory_dict[self.layer_number][1].copy_(state)
        else:
            out, state = rule.chunk(
                q, k, v, g=g, beta=beta, output_final_state=context is not None,
                cu_seqlens=None if cu is None else cu.long(), use_qk_l2norm_in_kernel=True)
            if context is not None:  # the prefill: this layer's state for the decode steps
                tail = F.pad(x.transpose(1, 2), (max(self.width - 1 - length, 0), 0))
                context.key_value_memory_dict[self.layer_number] = (
                    tail[..., -(self.width - 1):].contiguous(), state.float())
        z = proj["z"].reshape(batch, length, value_heads, self.value_dim)
        return self.norm(out, z).reshape(batch, length, -1)
