"""The Qwen3.5 / Qwen3.5 MoE model: the Qwen ViT (no DeepStack) + a megatron-core GPTModel whose
layers are Gated DeltaNet or gated full attention (``lm.layer_types``).

This module owns the assembled VLM (``Qwen35``) and its language model's layer specs:

- full-attention layers: megatron's ``SelfAttention`` with ``attention_output_gate`` (its
  ``linear_qkv`` gives q, the gate, k and v per KV group; the output is multiplied by
  sigmoid(gate) before ``linear_proj``), per-head q/k RMSNorm, M-RoPE on the first
  ``partial_rotary_factor`` of each head (``rotary_percent``; interleaved t/h/w frequencies as
  megatron's chunked ``mrope_section``, ``models.layers.mrope``);
- linear-attention layers: the same ``TransformerLayer`` with ``models.layers.gated_deltanet``'s
  ``GatedDeltaNet`` as its ``self_attention`` (it ignores rotary);
- every norm zero-centred (``layernorm_zero_centered_gamma``: TE's norms on GPU,
  ``models.layers.norms.ZeroCenteredRMSNorm`` in the local spec), except the DeltaNet's gated norm;
- MLPs: SwiGLU (dense), or megatron ``MoELayer``s (Qwen3.5 MoE: transformers' router as
  Qwen3-VL MoE's, fp32 softmax, top-k, renormalised; plus megatron's shared expert with its
  sigmoid gate, ``moe_shared_expert_gate``); under TP the whole LM runs megatron's sequence
  parallelism, which its MoE layers need there (as Qwen3-VL MoE's).

The vision embeddings are scattered into the ``<|image_pad|>`` / ``<|video_pad|>`` positions in
order (``models.multimodal``); the loss follows the batch contract (labels unshifted). Packed rows
run as THD (``LanguageModelRunner``): attention per sample (TE /
``models.layers.segment_attention``) and the DeltaNet's conv and state restarted per sample.
``encode_visual(pixel_values, grid_thw)`` is the one call into the vision tower (wrapped by the
vision-DP module, models/vision_dp.py).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from models import kernels
from models.families.qwen3_5.config import Qwen35ModelConfig
from models.layers.gated_deltanet import GatedDeltaNet
from models.layers.moe_aux import capacity_kwargs, transformer_config
from models.layers.mrope import megatron_mrope_section
from models.layers.mtp import MTPHead, with_head_logits, with_head_loss
from models.layers.norms import ZeroCenteredRMSNorm
from models.layers.qwen_vision import QwenVisionEncoder
from models.layers.recompute import transformer_config_kwargs
from models.layers.segment_attention import with_packed_attention
from models.multimodal import LanguageModelRunner, resolve_kernels, scatter_visual
from models.parallel import moe_parallel_kwargs
from models.vision_dp import CostModel, VisionDPOverCP

#: the tower's vision-DP cost model: Qwen3-VL's (27 full-attention layers, hidden 1152)
VISION_COST = CostModel(per_patch=1.0, per_patch_sq=1.5e-4)


def moe_aux_loss_weight(lm) -> float:
    """megatron's ``moe_aux_loss_coeff`` giving transformers' aux-loss term (``coef * k / MoE
    layers``: see the Qwen-VL package's derivation; every layer is MoE here)."""
    return lm.router_aux_loss_coef * lm.experts_per_token / max(lm.num_layers, 1)


def lm_transformer_config(cfg: Qwen35ModelConfig, use_te: bool = False) -> TransformerConfig:
    t = cfg.lm
    moe = {}
    if t.num_experts:
        weight = moe_aux_loss_weight(t)
        moe = dict(
            num_moe_experts=t.num_experts, moe_router_topk=t.experts_per_token,
            moe_ffn_hidden_size=t.moe_intermediate_size,
            moe_shared_expert_intermediate_size=t.shared_expert_intermediate_size,
            moe_shared_expert_gate=True, moe_router_score_function="softmax",
            moe_router_pre_softmax=False, moe_router_dtype="fp32",
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="aux_loss" if weight > 0 else "none",
            moe_aux_loss_coeff=weight,
            moe_grouped_gemm=kernels.grouped_gemm(use_te),
            **moe_parallel_kwargs(),
            # megatron's MoE layers need sequence parallelism under TP (the whole LM runs it)
            sequence_parallel=parallel_state.get_tensor_model_parallel_world_size() > 1,
            **capacity_kwargs(cfg.moe_capacity_factor))
    config = transformer_config(
        num_layers=t.num_layers, hidden_size=t.hidden_size,
        ffn_hidden_size=t.intermediate_size or t.moe_intermediate_size,
        num_attention_heads=t.num_heads, num_query_groups=t.num_kv_heads, kv_channels=t.head_dim,
        normalization="RMSNorm", layernorm_epsilon=t.rms_norm_eps,
        layernorm_zero_centered_gamma=True, add_bias_linear=False, add_qkv_bias=False,
        hetereogenous_dist_checkpoint=True,  # layers differ: each stored under its own number
        qk_layernorm=True, attention_output_gate=True, gated_linear_unit=True,
        activation_func=F.silu, bias_activation_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
        linear_conv_kernel_dim=t.linear_conv_kernel, linear_key_head_dim=t.linear_key_head_dim,
        linear_value_head_dim=t.linear_value_head_dim,
        linear_num_key_heads=t.linear_num_key_heads,
        linear_num_value_heads=t.linear_num_value_heads,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32,  # activations sent between PP stages (bf16 set by train.py)
        **transformer_config_kwargs(cfg.recompute, block_recompute=True), **moe)
    config.mrope_section = megatron_mrope_section(t.mrope_section, True)
    return config


def _local_norms(spec) -> None:
    """The local spec's norms as zero-centred RMSNorms (megatron's torch norm has none)."""
    sub = spec.submodules
    sub.input_layernorm = ZeroCenteredRMSNorm
    sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
    attention = sub.self_attention.submodules
    attention.q_layernorm = attention.k_layernorm = ZeroCenteredRMSNorm


def layer_specs(cfg: Qwen35ModelConfig, config: TransformerConfig, use_te: bool):
    """(gated full-attention layer spec, Gated DeltaNet layer spec, norm), each layer with the
    dense / MoE MLP."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = cfg.lm.num_experts or None
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        attention = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=config.moe_grouped_gemm, qk_layernorm=True)
        norm = TENorm
    else:
        attention = with_packed_attention(specs.get_gpt_layer_local_spec(
            num_experts=experts, qk_layernorm=True, normalization="RMSNorm"))
        _local_norms(attention)
        norm = ZeroCenteredRMSNorm
    linear = copy.deepcopy(attention)
    linear.submodules.self_attention = ModuleSpec(module=GatedDeltaNet)
    linear.submodules.input_layernorm = norm  # TE's attention spec fuses it into linear_qkv
    linear.submodules.sharded_state_dict_keys_map = {
        k: v for k, v in linear.submodules.sharded_state_dict_keys_map.items()
        if k != "input_layernorm."}
    return attention, linear, norm


def lm_block_spec(cfg: Qwen35ModelConfig, config: TransformerConfig, use_te: bool):
    """The decoder's block spec: this pipeline stage's layers, each a gated-attention or a Gated
    DeltaNet layer by ``lm.layer_types`` (global layer index)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    attention, linear, norm = layer_specs(cfg, config, use_te)
    offset = get_transformer_layer_offset(config)
    count = get_num_layers_to_build(config)
    kinds = cfg.lm.linear_layers[offset:offset + count]
    return TransformerBlockSubmodules(layer_specs=[linear if k else attention for k in kinds],
                                      layer_norm=norm)


class Qwen35(LanguageModelRunner, MegatronModule):
    """Qwen ViT + hybrid GPTModel (see module docstring)."""

    def __init__(self, cfg: Qwen35ModelConfig, *, use_te: bool | None = None,
                 vision_dp_over_cp: bool | None = None):
        """Args:
            cfg: model shapes.
            use_te: TransformerEngine layer specs (default: where the attention kernel chosen
                is TE, ``models.kernels``).
            vision_dp_over_cp: share the vision encoder's work over the context-parallel ranks
                (models/vision_dp.py); None = on when CP > 1.
        """
        use_te = resolve_kernels(cfg, use_te)
        config = lm_transformer_config(cfg, use_te)
        super().__init__(config=config)
        self._init_stage(cfg)
        self.vision = QwenVisionEncoder(cfg, use_te=use_te) if self.pre_process else None
        self.language_model = GPTModel(
            config=config, transformer_layer_spec=lm_block_spec(cfg, config, use_te),
            vocab_size=cfg.lm.vocab_size, max_sequence_length=cfg.lm.max_position_embeddings,
            pre_process=self.pre_process, post_process=self.post_process,
            share_embeddings_and_output_weights=cfg.lm.tie_embeddings,
            position_embedding_type="mrope", rotary_percent=cfg.lm.partial_rotary_factor,
            rotary_base=cfg.lm.rope_theta,
            # whole sequences out of the embedding (the visual scatter needs them); under
            # sequence parallelism ``run_language_model`` scatters the decoder input
            scatter_embedding_sequence_parallel=False)
        self.mtp = None  # model.train_mtp: the multi-token-prediction head (on the one stage)
        if cfg.train_mtp and self.post_process:
            attention, _linear, norm = layer_specs(cfg, config, use_te)
            self.mtp = MTPHead(config, [attention], norm, cfg.lm.num_layers)
        self._vision_dp = None
        if self.pre_process:
            self._vision_dp = VisionDPOverCP(
                self._encode_flat, hidden_size=cfg.lm.hidden_size,
                merge_size=cfg.vision.spatial_merge_size,
                cp_group=self._context_parallel_group(), enabled=vision_dp_over_cp,
                cost_model=VISION_COST)

    def _encode_flat(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.vision(pixel_values, grid_thw)[0]  # no DeepStack features

    def encode_visual(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The vision tower (through the vision-DP wrapper): -> embeds (sum t*h*w/4, H)."""
        return self._vision_dp(pixel_values, grid_thw)

    def embed(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
              video_grid_thw=None, sample_keys=None, visual_kinds=None):
        """Token embeddings with the visual embeddings scattered in: ((L, B, H), None)."""
        emb = self.language_model.embedding(input_ids=input_ids, position_ids=None)
        emb = emb.transpose(0, 1).clone()  # (B, L, H): row-major order of the pad tokens
        media = (("image", self.cfg.image_token_id, pixel_values, image_grid_thw),
                 ("video", self.cfg.video_token_id, pixel_values_videos, video_grid_thw))
        scatter_visual(emb, input_ids, media, self.encode_visual,
                       self.cfg.vision.spatial_merge_size, sample_keys, visual_kinds)
        return emb.transpose(0, 1).contiguous(), None

    def forward(self, input_ids, position_ids, pixel_values=None, image_grid_thw=None,
                pixel_values_videos=None, video_grid_thw=None, labels=None, loss_mask=None,
                cu_seqlens=None, max_seqlen=None, sample_keys=None, visual_kinds=None,
                **_unused):
        """Batch-contract fields -> logits (B, L, V/TP) or (per-token loss (B, L), loss mask);
        ``position_ids`` (3, B, L) M-RoPE. Under PP a stage before the last returns its output
        hidden states.

        Raises:
            ValueError: a batch row's <|image_pad|>/<|video_pad|> tokens differ from the
                embeddings of its images/videos (the row and both counts named).
        """
        batch, length = input_ids.shape
        decoder_input = None
        if self.pre_process:
            decoder_input, _ = self.embed(input_ids, pixel_values, image_grid_thw,
                                          pixel_values_videos, video_grid_thw, sample_keys,
                                          visual_kinds)
        run = functools.partial(self.run_language_model, decoder_input, position_ids, labels,
                                loss_mask, (batch, length), cu_seqlens, max_seqlen)
        if self.mtp is None or labels is None or not self.training:
            return run()
        return with_head_loss(self.language_model, self.mtp, run, labels, loss_mask, cu_seqlens)

    def mtp_logits(self, input_ids, position_ids, pixel_values=None, image_grid_thw=None,
                   pixel_values_videos=None, video_grid_thw=None, **_unused):
        """(the LM's logits, the MTP head's logits), each (B, L, V): position i of the second
        predicts token i+2 (parity checks; one stage, TP = 1)."""
        decoder_input, _ = self.embed(input_ids, pixel_values, image_grid_thw,
                                      pixel_values_videos, video_grid_thw)
        return with_head_logits(self.language_model, self.mtp, functools.partial(
            self.run_language_model, decoder_input, position_ids, None, None,
            tuple(input_ids.shape)))
