"""Core attentions confined to the segments of a packed sequence, for megatron's layer specs.

``SegmentAttention`` (non-causal, the vision towers' core attention): Qwen-VL vision towers attend
within each image / each temporal slice of a video (full-attention blocks) or within each window of
one (window blocks, Qwen2.5-VL). Patches of all images of a batch are one packed sequence, so
attention must be block-diagonal over ``cu_seqlens``. megatron-core's local ``DotProductAttention``
rejects packed sequences, and its THD path (TE) re-indexes rotary frequencies per segment from 0,
which breaks the per-patch 2D rotary of the vision tower. This module is therefore the
``core_attention`` of the vision layer spec: it plugs into megatron's ``SelfAttention`` (which still
owns the QKV/projection linears, tensor parallel sharding and rotary), reads the boundaries from
``packed_seq_params.cu_seqlens_q`` (passed with ``qkv_format="sbhd"`` so megatron applies rotary per
token), and runs flash-attention varlen on GPU when installed, otherwise
``scaled_dot_product_attention`` over the segments of each length as one batch
(``equal_length_batched_attention``: one call per segment took minutes per step for the windows
of four 1 MP pages on an H200).

``PackedCausalAttention`` (causal, the language models' core attention in the local,
non-TransformerEngine spec: ``with_packed_attention(spec)``): TE's core attention takes packed
(THD) sequences, megatron's local ``DotProductAttention`` refuses them. With
``packed_seq_params`` (``qkv_format="thd"``, ``cu_seqlens_q``) it runs causal attention within
each packed sample; without, it is megatron's ``DotProductAttention`` unchanged (explicit masks,
generation).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import MegatronModule

try:  # optional GPU fast path
    from flash_attn import flash_attn_varlen_func
except ImportError:  # CPU machines, or GPU images without flash-attn
    flash_attn_varlen_func = None


class SegmentAttention(MegatronModule):
    """Block-diagonal (per-segment) non-causal attention; a megatron ``core_attention`` module."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type=None,
                 attention_dropout=None, softmax_scale=None, **_kwargs):
        super().__init__(config=config)
        pg_collection = _kwargs.get("pg_collection")
        tp = (pg_collection.tp.size() if pg_collection is not None and hasattr(pg_collection, "tp")
              else parallel_state.get_tensor_model_parallel_world_size())
        self.heads = config.num_attention_heads // tp
        self.scale = softmax_scale or config.kv_channels ** -0.5

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """query/key/value: (s, 1, heads, head_dim) -> (s, 1, heads * head_dim)."""
        if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None:
            raise ValueError("SegmentAttention needs packed_seq_params.cu_seqlens_q")
        cu = packed_seq_params.cu_seqlens_q
        seq = query.shape[0]
        q, k, v = (t[:, 0] for t in (query, key, value))  # (s, heads, head_dim)
        if flash_attn_varlen_func is not None and q.is_cuda:
            cu32 = cu.to(device=q.device, dtype=torch.int32)
            longest = int(packed_seq_params.max_seqlen_q or (cu[1:] - cu[:-1]).max())
            out = flash_attn_varlen_func(q, k, v, cu32, cu32, longest, longest,
                                         softmax_scale=self.scale, causal=False)
        else:
            out = equal_length_batched_attention(q, k, v, cu, self.scale)
        return out.reshape(seq, 1, -1)


def equal_length_batched_attention(q, k, v, cu_seqlens, scale: float) -> torch.Tensor:
    """Non-causal attention within each segment of (s, heads, d) ``q`` / ``k`` / ``v``: the
    segments of one length go through ``scaled_dot_product_attention`` as one batch (a vision
    batch has a few distinct lengths: its images, or its windows and their edge remainders), not
    one call per segment (thousands of windows per layer)."""
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    out = q.new_zeros(q.shape)
    for length in lengths.unique().tolist():
        if length == 0:
            continue
        rows = (starts[lengths == length, None]
                + torch.arange(length, device=starts.device)).to(q.device)  # (n, length)
        part = [t[rows].transpose(1, 2) for t in (q, k, v)]  # (n, heads, length, d)
        out[rows] = F.scaled_dot_product_attention(*part, scale=scale).transpose(1, 2)
    return out


class PackedCausalAttention(DotProductAttention):
    """megatron's local core attention, plus packed (THD) sequences: causal within each sample.

    megatron's ``Attention`` hands a THD call (T, heads, d) query and (T, groups, d) key / value
    (the batch dimension squeezed, rotary already applied per token) and reshapes the result.
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, **kwargs)
        if packed_seq_params.qkv_format != "thd" or attention_bias is not None:
            raise ValueError("packed sequences: only qkv_format 'thd' without attention bias")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        heads, groups = query.shape[1], key.shape[1]
        if heads != groups:
            key = key.repeat_interleave(heads // groups, dim=1)
            value = value.repeat_interleave(heads // groups, dim=1)
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # (heads, T, d)
        dropout = self.attention_dropout.p if self.training else 0.0
        out = torch.cat([
            F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True,
                                           dropout_p=dropout, scale=self.softmax_scale)
            for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
        return out.transpose(0, 1).reshape(query.shape[0], -1)  # (T, heads * d)


def with_packed_attention(spec):
    """A copy of a local GPT layer spec whose core attention also takes packed sequences."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = PackedCausalAttention
    return spec
