"""Context-parallel core attention on CPU (part of models/cpu, used through
``models.cpu.use_cp_attention``).

On GPU TransformerEngine's core attention runs context parallelism; megatron's local
``DotProductAttention`` refuses it. ``CPUContextParallelAttention`` all-gathers K and V over
the CP group (``all_gather_into_tensor`` forward, ``reduce_scatter_tensor`` backward: both native
in gloo), undoes megatron's zig-zag layout (rank r holds chunks r and 2*cp-1-r of 2*cp), and
applies the causal mask in global positions. O(S^2) memory: for tests and CPU demos, not for real
runs.
``use_cp_attention(gpt_model)`` swaps it into every layer of a built ``GPTModel`` (the core
attention holds no parameters, so checkpoints are unchanged).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule


class _GatherSeq(torch.autograd.Function):
    """all_gather along dim 0 over ``group``; backward sums every rank's gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // ctx.group.size(), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class CPUContextParallelAttention(MegatronModule):
    """Causal core attention over the whole sequence from zig-zag CP shares (sbhd layout)."""

    def __init__(self, config, heads: int, groups: int, head_dim: int, cp_group):
        super().__init__(config=config)
        self.heads, self.groups, self.head_dim = heads, groups, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.cp_group = cp_group

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **_kwargs):
        """query (sq, b, heads, d), key/value (sq, b, groups, d) -> (sq, b, heads * d)."""
        if packed_seq_params is not None:
            raise ValueError("CPU context-parallel attention does not support packed sequences")
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        sq = query.shape[0]
        chunk = sq // 2
        ks = _GatherSeq.apply(key, self.cp_group).split(sq)
        vs = _GatherSeq.apply(value, self.cp_group).split(sq)
        k_chunks, v_chunks = [None] * (2 * cp), [None] * (2 * cp)
        for j in range(cp):
            k_chunks[j], k_chunks[2 * cp - 1 - j] = ks[j][:chunk], ks[j][chunk:]
            v_chunks[j], v_chunks[2 * cp - 1 - j] = vs[j][:chunk], vs[j][chunk:]
        key, value = torch.cat(k_chunks), torch.cat(v_chunks)
        q_pos = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                           torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])
        if self.heads != self.groups:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        scores = torch.einsum("sbnh,tbnh->bnst", query, key) * self.scale
        k_pos = torch.arange(key.shape[0])
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None].to(k_pos.device),
                                    float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        context = torch.einsum("bnst,tbnh->sbnh", probs, value)
        return context.reshape(sq, context.shape[1], self.heads * self.head_dim)


def use_cp_attention(gpt_model) -> None:
    """Replace the core attention of every attention layer of ``gpt_model`` (a built GPTModel,
    or a hybrid MambaModel, whose MLP / MoE layers have no attention)."""
    config = gpt_model.config
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_context_parallel_group()
    for layer in gpt_model.decoder.layers:
        if not hasattr(getattr(layer, "self_attention", None), "core_attention"):
            continue
        layer.self_attention.core_attention = CPUContextParallelAttention(
            config, config.num_attention_heads // tp, config.num_query_groups // tp,
            config.kv_channels, group)
