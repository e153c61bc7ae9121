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
token), and runs the segment kernel ``models.kernels`` chose (``chosen("attention").segments``:
flash-attn varlen where it passed its start-up check, else torch SDPA over the segments of each
length, models/kernels/attention.py).

``PackedCausalAttention`` (causal, the language models' core attention in the local,
non-TransformerEngine spec: ``with_packed_attention(spec)``): TE's core attention takes packed
(THD) sequences, megatron's local ``DotProductAttention`` refuses them. With
``packed_seq_params`` (``qkv_format="thd"``, ``cu_seqlens_q``) it runs causal attention within
each packed sample (the chosen segment kernel, causal); without, it is megatron's
``DotProductAttention`` unchanged (explicit masks, generation).
"""

from __future__ import annotations

import copy

from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import MegatronModule

from models import kernels


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
        seq = query.shape[0]
        q, k, v = (t[:, 0] for t in (query, key, value))  # (s, heads, head_dim)
        segments = kernels.chosen("attention").segments
        out = segments(q, k, v, packed_seq_params.cu_seqlens_q, self.scale, causal=False,
                       max_seqlen=packed_seq_params.max_seqlen_q)
        return out.reshape(seq, 1, -1)


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
        dropout = self.attention_dropout.p if self.training else 0.0
        segments = kernels.chosen("attention").segments
        out = segments(query, key, value, packed_seq_params.cu_seqlens_q, self.softmax_scale,
                       causal=True, dropout_p=dropout, max_seqlen=packed_seq_params.max_seqlen_q)
        return out.reshape(query.shape[0], -1)  # (T, heads * d)


def with_packed_attention(spec):
    """A copy of a local GPT layer spec whose core attention also takes packed sequences."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = PackedCausalAttention
    return spec
