"""What both vision towers build on (Qwen-VL's ViT and Nemotron-Omni's RADIO): megatron
``TransformerLayer`` specs with the segment attention core (block-diagonal over each image /
temporal slice / window), the activation functions by HF name, and a tower's dist-checkpoint dict.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType

from models.layers.segment_attention import SegmentAttention

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu,
               "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


def vision_layer_spec(normalization: str, use_te: bool):
    """megatron GPT layer spec (TE on GPU, local on CPU) with the segment attention core."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        spec = copy.deepcopy(specs.get_gpt_layer_with_transformer_engine_spec())
    else:
        spec = copy.deepcopy(specs.get_gpt_layer_local_spec(normalization=normalization))
    attention = spec.submodules.self_attention
    attention.params = {**(attention.params or {}), "attn_mask_type": AttnMaskType.no_mask}
    attention.submodules.core_attention = SegmentAttention
    return spec


def tower_sharded_state_dict(tower: torch.nn.Module, prefix="", sharded_offsets=(),
                             metadata=None) -> dict:
    """A vision tower's dist-checkpoint dict (or any module's whose ``layers`` are megatron
    TransformerLayers: the MTP head, models/layers/mtp.py): its ``layers`` with their TP-sharded
    tensors, every other child replicated."""
    from megatron.core.transformer.utils import sharded_state_dict_default

    out = {}
    for name, child in tower.named_children():
        if name == "layers":
            for i, layer in enumerate(child):
                out.update(layer.sharded_state_dict(prefix=f"{prefix}layers.{i}.",
                                                    sharded_offsets=sharded_offsets,
                                                    metadata=metadata))
        else:
            out.update(sharded_state_dict_default(
                child, f"{prefix}{name}.", sharded_offsets, metadata,
                tp_group=parallel_state.get_tensor_model_parallel_group()))
    return out
