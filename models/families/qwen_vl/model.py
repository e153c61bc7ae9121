"""The Qwen2.5-VL / Qwen3-VL model: vision encoder + megatron-core GPTModel with M-RoPE.

This module owns the assembled VLM (``QwenVL``): the language model (``GPTModel`` with
``position_embedding_type='mrope'``; RMSNorm, SwiGLU, GQA; q/k/v biases for Qwen2.5-VL, per-head
q/k RMSNorm for Qwen3-VL; local spec on CPU, TransformerEngine spec on GPU), the scatter of visual
embeddings into the ``<|image_pad|>`` / ``<|video_pad|>`` positions in order, DeepStack (Qwen3-VL:
features added to the outputs of the first LM layers, through forward hooks on those
``TransformerLayer`` modules, because ``GPTModel`` has no per-layer input), and the loss on the
batch contract (docs/internals/batch_contract.md; labels are unshifted, the model shifts).

Qwen3-VL MoE: the same model, its LM MLPs megatron ``MoELayer``s where ``lm.moe_layers`` says
(``moe_layer_freq`` = that list; dense MLPs elsewhere): transformers' router (fp32 softmax over all
experts, top-k, renormalised: megatron's top-k then softmax over the selected logits), no shared
expert, experts as megatron's ``SequentialMLP`` on CPU and grouped GEMM with TransformerEngine.
The load-balancing aux loss is megatron's (attached to the router's output: its gradient joins the
loss's; logged per layer in megatron's tracker, ``models.layers.moe_aux``) with the weight
``moe_aux_loss_weight`` gives it.

Qwen3-VL's interleaved M-RoPE (t/h/w frequencies interleaved, ``mrope_interleaved``) is expressed
with megatron's chunked ``mrope_section``: a section list of 1-wide chunks cycling t, h, w (zero-
width chunks keep the cycle aligned), which megatron's ``MultimodalRotaryEmbedding`` applies as is.

``encode_visual(pixel_values, grid_thw)`` is the one call into the vision tower: the vision
data-parallel module (models/vision_dp.py) wraps or replaces it (``model.encode_visual = ...``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from models import kernels
from models.families.qwen_vl.config import QwenVLModelConfig
from models.layers.moe_aux import capacity_kwargs, transformer_config
from models.layers.mrope import megatron_mrope_section
from models.layers.qwen_vision import QwenVisionEncoder
from models.layers.recompute import transformer_config_kwargs
from models.layers.segment_attention import with_packed_attention
from models.multimodal import LanguageModelRunner, resolve_kernels, scatter_visual
from models.parallel import moe_parallel_kwargs
from models.vision_dp import CostModel, VisionDPOverCP

#: vision-DP cost models of the towers (``models.vision_dp.CostModel``; the model uses the
#: default, Qwen2.5-VL's, for both): Qwen3-VL's 27 full-attention layers, hidden 1152, MLP 4304:
#: 8.2e8 * p + 1.24e5 * p**2 FLOPs
COST_MODELS = {"qwen2_5_vl": CostModel(per_patch=1.0, per_patch_sq=1.6e-5),
               "qwen3_vl": CostModel(per_patch=1.0, per_patch_sq=1.5e-4)}


def lm_transformer_config(cfg: QwenVLModelConfig, use_te: bool = False) -> TransformerConfig:
    t = cfg.lm
    config = transformer_config(
        num_layers=t.num_layers, hidden_size=t.hidden_size, ffn_hidden_size=t.intermediate_size,
        num_attention_heads=t.num_heads, num_query_groups=t.num_kv_heads, kv_channels=t.head_dim,
        normalization="RMSNorm", layernorm_epsilon=t.rms_norm_eps, add_bias_linear=False,
        add_qkv_bias=t.qkv_bias, qk_layernorm=t.qk_norm, gated_linear_unit=True,
        activation_func=F.silu, bias_activation_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32,  # activations sent between PP stages (bf16 set by train.py)
        # DeepStack adds features to its layers' outputs through forward hooks, which a full
        # rerun of those layers in backward would not repeat: Qwen3-VL's LM takes selective
        **transformer_config_kwargs(cfg.recompute,
                                    block_recompute=not cfg.vision.deepstack_visual_indexes),
        **moe_config_kwargs(cfg, use_te),
    )
    config.mrope_section = megatron_mrope_section(t.mrope_section, t.mrope_interleaved)
    return config


def moe_aux_loss_weight(lm) -> float:
    """megatron's ``moe_aux_loss_coeff`` that gives transformers' aux-loss term.

    transformers: ``coef * E * sum_e f_e * P_e`` once, with f_e the top-k picks of expert e per
    token and P_e its mean router probability, both pooled over every MoE layer's tokens.
    megatron: per MoE layer ``coeff * E * sum_e (f_e / k) * P_e``, the layers' terms summed. So
    ``coeff = coef * k / (MoE layers)``: equal to transformers' with one MoE layer, and the mean of
    the per-layer terms (not the pooled product) with several.
    """
    layers = sum(lm.moe_layers)
    return lm.router_aux_loss_coef * lm.experts_per_token / max(layers, 1)


def moe_config_kwargs(cfg: QwenVLModelConfig, use_te: bool) -> dict:
    """TransformerConfig fields of the MoE layers (none for a dense LM)."""
    t = cfg.lm
    if not t.num_experts:
        return {}
    weight = moe_aux_loss_weight(t)
    return dict(
        num_moe_experts=t.num_experts, moe_router_topk=t.experts_per_token,
        moe_ffn_hidden_size=t.moe_intermediate_size,
        moe_layer_freq=[int(m) for m in t.moe_layers],
        moe_router_score_function="softmax", moe_router_pre_softmax=False,
        moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss" if weight > 0 else "none",
        moe_aux_loss_coeff=weight,
        moe_grouped_gemm=kernels.grouped_gemm(use_te),
        **moe_parallel_kwargs(),
        # megatron's MoE layers need sequence parallelism under TP (the whole LM runs it)
        sequence_parallel=parallel_state.get_tensor_model_parallel_world_size() > 1,
        **capacity_kwargs(cfg.moe_capacity_factor))


def lm_layer_spec(cfg: QwenVLModelConfig, use_te: bool, config: TransformerConfig):
    """The LM's layer spec; with MoE layers a block spec (one layer spec per layer of this
    pipeline stage, MoE or dense by ``moe_layer_freq``)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if cfg.lm.num_experts:
        block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                 normalization="RMSNorm")
        if not use_te:
            block.layer_specs = [with_packed_attention(s) for s in block.layer_specs]
        return block
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.lm.qk_norm)
    return with_packed_attention(specs.get_gpt_layer_local_spec(qk_layernorm=cfg.lm.qk_norm,
                                                                normalization="RMSNorm"))


class QwenVL(LanguageModelRunner, MegatronModule):
    """Vision encoder + M-RoPE GPTModel (see module docstring)."""

    def __init__(self, cfg: QwenVLModelConfig, *, use_te: bool | None = None,
                 vision_dp_over_cp: bool | None = None):
        """Args:
            cfg: model shapes.
            use_te: TransformerEngine layer specs (default: where the attention kernel chosen
                is TE, ``models.kernels``).
            vision_dp_over_cp: share the vision encoder's work over the context-parallel ranks
                (models/vision_dp.py); None = on when CP > 1. Inactive is reported once, loudly.
        """
        use_te = resolve_kernels(cfg, use_te)
        config = lm_transformer_config(cfg, use_te)
        super().__init__(config=config)
        self._init_stage(cfg)
        self.vision = QwenVisionEncoder(cfg, use_te=use_te) if self.pre_process else None
        self.language_model = GPTModel(
            config=config, transformer_layer_spec=lm_layer_spec(cfg, use_te, config),
            vocab_size=cfg.lm.vocab_size, max_sequence_length=cfg.lm.max_position_embeddings,
            pre_process=self.pre_process, post_process=self.post_process,
            share_embeddings_and_output_weights=cfg.lm.tie_embeddings,
            position_embedding_type="mrope", rotary_base=cfg.lm.rope_theta,
            # whole sequences out of the embedding (the visual scatter needs them); under
            # sequence parallelism ``run_language_model`` scatters the decoder input
            scatter_embedding_sequence_parallel=False,
        )
        self._vision_dp = None
        if self.pre_process:
            widths = [cfg.lm.hidden_size] * (1 + len(cfg.vision.deepstack_visual_indexes))
            self._vision_dp = VisionDPOverCP(
                self._encode_flat, hidden_size=widths, merge_size=cfg.vision.spatial_merge_size,
                cp_group=self._context_parallel_group(), enabled=vision_dp_over_cp)
        self._deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        if cfg.vision.deepstack_visual_indexes and self.pre_process:
            layers = self.language_model.decoder.layers
            levels = len(cfg.vision.deepstack_visual_indexes)
            if len(layers) < levels:
                raise ValueError(f"DeepStack feeds the first {levels} LM layers, the first "
                                 f"pipeline stage holds {len(layers)}: use fewer PP stages")
            for i in range(min(len(cfg.vision.deepstack_visual_indexes), len(layers))):
                layers[i].register_forward_hook(self._deepstack_hook(i))

    # ---------------------------------------------------------------- vision
    def encode_visual(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """Run the vision tower: -> (embeds (sum t*h*w/4, H), DeepStack list of the same shape).

        Runs through the vision data-parallel wrapper, which shares whole images / temporal
        slices over the CP ranks when active and calls the tower directly otherwise.
        """
        embeds, *deepstack = self._vision_dp(pixel_values, grid_thw)
        return embeds, list(deepstack)

    def _encode_flat(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        embeds, deepstack = self.vision(pixel_values, grid_thw)
        return (embeds, *deepstack)

    def _deepstack_hook(self, index: int):
        def hook(_module, _inputs, output):
            if self._deepstack is None:
                return output
            # mask (b, s) bool; feats: list of (n, H) in the mask's row-major (b, s) order
            mask, feats = self._deepstack
            hidden = output[0] if isinstance(output, tuple) else output
            hidden = hidden.clone()
            rows = hidden.transpose(0, 1)  # (b, s, H) view: index in the features' order
            rows[mask] = rows[mask] + feats[index].to(hidden.dtype)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return hook

    def embed(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
              video_grid_thw=None, sample_keys=None, visual_kinds=None):
        """Token embeddings with visual embeddings scattered in: (L, B, H) + DeepStack state.

        ``visual_kinds`` (the batch's image / video order) is read only if the config gives both
        kinds one context token (``models.multimodal.context_masks``); Qwen's differ.
        """
        emb = self.language_model.embedding(input_ids=input_ids, position_ids=None)
        emb = emb.transpose(0, 1).clone()  # (B, L, H): row-major order of the pad tokens
        media = (("image", self.cfg.image_token_id, pixel_values, image_grid_thw),
                 ("video", self.cfg.video_token_id, pixel_values_videos, video_grid_thw))
        done = scatter_visual(emb, input_ids, media, self.encode_visual,
                              self.cfg.vision.spatial_merge_size, sample_keys, visual_kinds)
        masks = [mask for mask, _ in done]
        stacks = [deepstack for _, deepstack in done]
        visual_mask = torch.zeros_like(input_ids, dtype=torch.bool)
        for mask in masks:
            visual_mask |= mask
        deepstack_state = None
        if stacks and stacks[0]:
            # DeepStack features in the order of the visual tokens (images and videos merged)
            joint = []
            for level in range(len(stacks[0])):
                out = emb.new_zeros(int(visual_mask.sum()), emb.shape[-1])
                for mask, stack in zip(masks, stacks):
                    out[mask[visual_mask]] = stack[level].to(out.dtype)
                joint.append(out)
            deepstack_state = (visual_mask, joint)
        return emb.transpose(0, 1).contiguous(), deepstack_state

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, position_ids, pixel_values=None, image_grid_thw=None,
                pixel_values_videos=None, video_grid_thw=None, labels=None, loss_mask=None,
                cu_seqlens=None, max_seqlen=None, sample_keys=None, visual_kinds=None,
                **_unused):
        """Batch-contract fields -> logits (B, L, V/TP) or (per-token loss (B, L), loss mask).

        ``position_ids`` is (3, B, L) M-RoPE; ``visual_kinds``: see :meth:`embed`. With
        ``labels`` (unshifted, -100 = no loss) the model predicts token t+1 at t and returns the
        per-token loss and the shifted loss mask.

        Raises:
            ValueError: the number of <|image_pad|>/<|video_pad|> tokens of a batch row differs
                from the embeddings of its images/videos (the row and both counts are named).
        """
        batch, length = input_ids.shape
        decoder_input, deepstack = None, None  # later PP stages: megatron's set_input_tensor
        if self.pre_process:
            decoder_input, deepstack = self.embed(input_ids, pixel_values, image_grid_thw,
                                                  pixel_values_videos, video_grid_thw, sample_keys,
                                                  visual_kinds)
        return self.run_language_model(decoder_input, position_ids, labels, loss_mask,
                                       (batch, length), cu_seqlens, max_seqlen, deepstack)
