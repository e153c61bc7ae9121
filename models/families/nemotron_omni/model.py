"""Nemotron-Omni (NemotronH_Omni_Reasoning_V3): RADIO vision tower + megatron-core hybrid
``MambaModel`` language model.

This module owns the assembled VLM (``NemotronOmni``, same public interface as the Qwen-VL
package's ``QwenVL``): the hybrid language model and its layer specs, the scatter of visual
embeddings into the context tokens, and the loss on the batch contract (labels unshifted, the
model shifts; packed rows run as megatron's THD format over ``cu_seqlens``).

Language model: megatron ``MambaModel`` with the HF hybrid pattern (one mixer per layer: ``M``
Mamba2, ``*`` attention, ``-`` MLP, ``E`` MoE; RMSNorm pre-norm + residual), no position
embedding (``position_embedding_type='none'``: NemotronH attention has no rotary, so the
(3, B, L) ``position_ids`` of the batch are ignored), squared-ReLU non-gated MLPs, GQA attention
without biases. Specs: on GPU megatron's TransformerEngine hybrid stack spec; on CPU local specs
(megatron's local GPT attention / MLP / MoE modules, megatron's ``MambaMixer`` with megatron
linears and a torch norm; LatentMoE, ``lm.moe_latent_size``: models/layers/latent_moe.py's
``LatentMoELayer``, as megatron's ``MoELayer`` builds its latent projections with TE only).
``M`` runs megatron's ``MambaMixer`` on the kernels ``models.kernels`` chose and bound into it
before the stack is built (mamba_ssm's where they are installed and agree with torch, else the
plain-torch ones of models/kernels/mamba.py: the model builds without mamba_ssm on any device;
so is MambaStack's final ``TENorm`` without TransformerEngine); the mixer gets the config's conv
width, chunk size and dt init range.
Pipeline parallel: MambaStack gives each stage its slice of the pattern (an even split of the
layer count) and numbers the layers globally (dist checkpoints load at any PP); vision +
embedding live on the first stage, the output layer + loss on the last
(``models.multimodal.LanguageModelRunner``, as Qwen-VL).

MTP (``model.train_mtp``): ``mtp_head`` builds the checkpoint's multi-token-prediction block
(``lm.mtp_pattern``, attention then LatentMoE by default) from the same layer specs, as
``models.layers.mtp``'s shared head on the last stage; its loss follows the LM's.

Vision: this package's ``radio.RadioEncoder`` (tower, pixel shuffle, projector) behind the shared
``VisionDPOverCP`` (whole images / tiles / tubelets spread over the context-parallel ranks).
``encode_visual(pixel_values, grid_thw) -> embeds`` is the one call into it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from models import kernels
from models.families.nemotron_omni.config import NemotronOmniModelConfig
from models.families.nemotron_omni.radio import RadioEncoder
from models.layers.moe_aux import capacity_kwargs
from models.layers.mtp import MTPHead, with_head_logits, with_head_loss
from models.layers.recompute import transformer_config_kwargs
from models.layers.segment_attention import with_packed_attention
from models.multimodal import LanguageModelRunner, resolve_kernels, scatter_visual
from models.parallel import moe_parallel_kwargs
from models.vision_dp import CostModel, VisionDPOverCP

#: RADIO's vision-DP cost model: 32 full-attention layers, hidden 1280, MLP 5120:
#: 1.26e9 * p + 1.64e5 * p**2 FLOPs (p includes the 10 class/register tokens), normalised
RADIO_COST = CostModel(per_patch=1.0, per_patch_sq=1.3e-4)

#: the eps of the gated RMSNorm inside megatron's Mamba mixer (fixed in its constructor)
MAMBA_NORM_EPS = 1e-5


def lm_transformer_config(cfg: NemotronOmniModelConfig, use_te: bool = False) -> TransformerConfig:
    """The hybrid LM's TransformerConfig (Mamba / MoE fields only where the pattern uses them;
    fields this megatron-core version lacks are dropped, named in the error if one matters)."""
    from megatron.core.activations import squared_relu

    t = cfg.lm
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if t.num_layers % pp:  # MambaStack splits the pattern evenly (and would drop the remainder)
        raise ValueError(f"lm.pattern {t.pattern!r} has {t.num_layers} layers, not divisible by "
                         f"the {pp} pipeline stages")
    kwargs = dict(
        num_layers=t.num_layers, hidden_size=t.hidden_size, ffn_hidden_size=t.intermediate_size,
        num_attention_heads=t.num_heads, num_query_groups=t.num_kv_heads, kv_channels=t.head_dim,
        normalization="RMSNorm", layernorm_epsilon=t.rms_norm_eps, add_bias_linear=False,
        add_qkv_bias=False, gated_linear_unit=False, activation_func=squared_relu,
        bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,  # activations sent between PP stages (bf16 set by train.py)
        **transformer_config_kwargs(cfg.recompute, block_recompute=False),  # MambaStack: no full
    )
    if "M" in t.pattern:
        check_mamba_shape(t, parallel_state.get_tensor_model_parallel_world_size(),
                          parallel_state.get_context_parallel_world_size())
        kwargs.update(mamba_state_dim=t.ssm_state_size, mamba_head_dim=t.mamba_head_dim,
                      mamba_num_groups=t.mamba_groups, mamba_num_heads=t.mamba_num_heads)
    if "E" in cfg.layer_kinds:
        kwargs.update(
            num_moe_experts=t.num_experts, moe_router_topk=t.experts_per_token,
            moe_ffn_hidden_size=t.moe_intermediate_size,
            moe_shared_expert_intermediate_size=t.moe_shared_expert_intermediate_size,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=t.routed_scaling_factor,
            moe_router_load_balancing_type="none", moe_router_dtype="fp32",
            moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=kernels.grouped_gemm(use_te),
            **moe_parallel_kwargs(), **capacity_kwargs(cfg.moe_capacity_factor))
        if t.n_group > 1:
            kwargs.update(moe_router_num_groups=t.n_group, moe_router_group_topk=t.topk_group)
        if t.moe_latent_size is not None:
            kwargs["moe_latent_size"] = t.moe_latent_size
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    missing = sorted(k for k in kwargs if k not in known)
    if missing:
        raise ValueError(f"this megatron-core's TransformerConfig lacks {missing} "
                         f"(needed by lm.pattern {t.pattern!r})")
    return TransformerConfig(**kwargs)


def check_mamba_shape(t, tp: int, cp: int) -> None:
    """What megatron's Mamba mixer asserts, as one ValueError naming every problem: a conv bias
    and the norm eps it fixes; whole heads per group; whole heads and groups per tensor-parallel
    rank; under context parallel (heads shared over CP ranks) whole heads per rank, and groups
    either split evenly or repeated evenly."""
    problems = []
    if not t.use_conv_bias or t.rms_norm_eps != MAMBA_NORM_EPS:
        problems.append(f"lm.use_conv_bias must be true and lm.rms_norm_eps {MAMBA_NORM_EPS} (the "
                        f"mixer norm's fixed eps), got {t.use_conv_bias} and {t.rms_norm_eps}")
    if t.mamba_num_heads % t.mamba_groups:
        problems.append(f"lm.mamba_num_heads {t.mamba_num_heads} is not a multiple of "
                        f"lm.mamba_groups {t.mamba_groups}")
    if t.mamba_num_heads % (tp * cp) or t.mamba_groups % tp:
        problems.append(f"lm.mamba_num_heads {t.mamba_num_heads} / lm.mamba_groups "
                        f"{t.mamba_groups} do not split over tp {tp} x cp {cp}")
    elif cp > 1 and max(t.mamba_groups // tp, cp) % min(t.mamba_groups // tp, cp):
        problems.append(f"the {t.mamba_groups // tp} Mamba groups per tensor-parallel rank and "
                        f"cp {cp} do not divide one another")
    if problems:
        raise ValueError(f"lm.pattern {t.pattern!r} (Mamba layers): " + "; ".join(problems))


def _mixer_params(cfg: NemotronOmniModelConfig) -> dict:
    """``MambaMixer`` constructor arguments from the config (megatron's defaults otherwise)."""
    t = cfg.lm
    return dict(d_conv=t.conv_kernel, chunk_size=t.chunk_size, dt_min=t.time_step_min,
                dt_max=t.time_step_max, dt_init_floor=t.time_step_floor)


def _mamba_spec(cfg: NemotronOmniModelConfig):
    """The local Mamba layer: torch norm + megatron linears around megatron's ``MambaMixer``.
    Its norm is stored under the TE spec's name (fused into ``mixer.in_proj``), as the local
    attention / MLP layers do, so a checkpoint written on CPU loads with the TE spec."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=WrappedTorchNorm,
        mixer=ModuleSpec(module=MambaMixer, params=_mixer_params(cfg),
                         submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear,
                                                         out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"}))


def lm_stack_spec(cfg: NemotronOmniModelConfig, use_te: bool, grouped_gemm: bool = True):
    """MambaStack spec: megatron's TE hybrid spec (its MoE experts grouped or sequential by
    ``grouped_gemm``), or local attention / MLP / MoE / Mamba layers. The Mamba mixer's kernels
    are bound by ``models.kernels`` (``resolve_kernels``) before the stack is built. Layer
    kinds of the MTP block (``train_mtp``) are in it too (``mtp_head``)."""
    pattern = cfg.layer_kinds
    if use_te:
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

        spec = copy.deepcopy(mamba_stack_spec)
        spec.submodules.mamba_layer.submodules.mixer.params = _mixer_params(cfg)
        if "E" in pattern:
            spec.submodules.moe_layer.submodules.mlp = get_moe_module_spec(
                use_te=True, num_experts=cfg.lm.num_experts, moe_grouped_gemm=grouped_gemm)
        return spec
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    local = specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    attention = with_packed_attention(local)
    attention.submodules.pre_mlp_layernorm = IdentityOp
    attention.submodules.mlp = IdentityOp
    attention.submodules.mlp_bda = IdentityFuncOp
    norm = local.submodules.pre_mlp_layernorm
    to_te = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=norm, mlp=local.submodules.mlp, mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=to_te))
    submodules = dict(attention_layer=attention, mlp_layer=mlp)
    if "E" in pattern:
        moe = specs.get_gpt_layer_local_spec(num_experts=cfg.lm.num_experts,
                                             normalization="RMSNorm").submodules.mlp
        if cfg.lm.moe_latent_size is not None:  # megatron's MoELayer builds them with TE only
            from models.layers.latent_moe import LatentMoELayer

            moe = dataclasses.replace(moe, module=LatentMoELayer)
        submodules["moe_layer"] = ModuleSpec(module=TransformerLayer,
                                             submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=moe, mlp_bda=get_bias_dropout_add))
    if "M" in pattern:
        submodules["mamba_layer"] = _mamba_spec(cfg)
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(**submodules))


def mtp_head(cfg: NemotronOmniModelConfig, config: TransformerConfig, use_te: bool,
             grouped_gemm: bool) -> MTPHead:
    """The MTP block (``model.train_mtp``, ``models.layers.mtp``): its inner layers by
    ``lm.mtp_pattern`` from the decoder's own layer specs (attention, MLP, LatentMoE), its norms
    the stack's final norm's class (RMSNorm)."""
    from megatron.core.ssm import mamba_block

    layers = lm_stack_spec(cfg, use_te, grouped_gemm).submodules
    specs = {"*": layers.attention_layer, "-": layers.mlp_layer, "E": layers.moe_layer}
    return MTPHead(config, [specs[s] for s in cfg.lm.mtp_pattern], mamba_block.TENorm,
                   cfg.lm.num_layers)


def mark_mamba_tp_layout(lm) -> None:
    """Give every Mamba mixer's tensor-parallel parameters megatron's layout attributes where
    this megatron-core lacks them (0.16.1; >= 0.17 sets them itself): ``partition_dim`` 0, and
    ``partition_sizes`` (this rank's rows of each component) on the packed ``in_proj``
    (z | x | B | C | dt) and conv1d (x | B | C). Import slicing reads them
    (``models.checkpointing.sharding.shard_for_rank``)."""
    from megatron.core.ssm.mamba_mixer import MambaMixer

    for mixer in lm.modules():
        if not isinstance(mixer, MambaMixer):
            continue
        groups = mixer.ngroups_local_tp * mixer.d_state
        xbc = [mixer.d_inner_local_tp, groups, groups]
        packed = {"in_proj.weight": [mixer.d_inner_local_tp, *xbc, mixer.nheads_local_tp],
                  "conv1d.weight": xbc, "conv1d.bias": xbc,  # 0.16.1: an nn.Conv1d
                  "conv1d_weight": xbc, "conv1d_bias": xbc}  # >= 0.19: parameters
        for name, p in mixer.named_parameters():
            if getattr(p, "tensor_model_parallel", False) and not hasattr(p, "partition_dim"):
                p.partition_dim = 0
            if name in packed and not hasattr(p, "partition_sizes"):
                p.partition_sizes = packed[name]


def _pattern_kwarg() -> str:
    """MambaModel's name for the layer pattern (``hybrid_override_pattern`` in 0.16; newer
    releases rename it)."""
    from megatron.core.models.mamba import MambaModel

    for cls in MambaModel.__mro__:  # >= 0.19: MambaModel(*args, **kwargs) wraps HybridModel
        params = inspect.signature(cls.__init__).parameters if "__init__" in vars(cls) else {}
        for name in ("hybrid_override_pattern", "hybrid_layer_pattern", "hybrid_pattern"):
            if name in params:
                return name
    raise ValueError("this megatron-core's MambaModel takes no hybrid layer pattern argument")


class NemotronOmni(LanguageModelRunner, MegatronModule):
    """RADIO + projector + hybrid MambaModel (see module docstring)."""

    def __init__(self, cfg: NemotronOmniModelConfig, *, use_te: bool | None = None,
                 vision_dp_over_cp: bool | None = None):
        """Args:
            cfg: model shapes.
            use_te: TransformerEngine layer specs (default: where the attention kernel chosen
                is TE, ``models.kernels``).
            vision_dp_over_cp: share the vision encoder's work over the context-parallel ranks
                (models/vision_dp.py); None = on when CP > 1. Inactive is reported once, loudly.
        """
        from megatron.core.models.mamba import MambaModel

        from models.kernels.megatron_mamba import final_norm_without_te

        use_te = resolve_kernels(cfg, use_te)
        final_norm_without_te()  # a pattern without Mamba layers binds no Mamba kernels
        config = lm_transformer_config(cfg, use_te)
        super().__init__(config=config)
        self._init_stage(cfg)
        self.vision = RadioEncoder(cfg, use_te=use_te) if self.pre_process else None
        self.language_model = MambaModel(
            config=config, mamba_stack_spec=lm_stack_spec(
                cfg, use_te, getattr(config, "moe_grouped_gemm", False)),
            vocab_size=cfg.lm.vocab_size, max_sequence_length=cfg.lm.max_position_embeddings,
            pre_process=self.pre_process, post_process=self.post_process,
            share_embeddings_and_output_weights=cfg.lm.tie_embeddings,
            position_embedding_type="none", **{_pattern_kwarg(): cfg.lm.pattern},
        )
        self.mtp = None  # model.train_mtp: the multi-token-prediction block (on the one stage)
        if cfg.train_mtp and self.post_process:
            self.mtp = mtp_head(cfg, config, use_te, getattr(config, "moe_grouped_gemm", False))
        mark_mamba_tp_layout(self.language_model)
        self._vision_dp = None
        if self.pre_process:
            self._vision_dp = VisionDPOverCP(
                self.vision, hidden_size=cfg.lm.hidden_size, merge_size=cfg.merge_size,
                cp_group=self._context_parallel_group(), enabled=vision_dp_over_cp,
                cost_model=RADIO_COST)

    # ---------------------------------------------------------------- vision
    def encode_visual(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Vision tower + pixel shuffle + projector: -> (sum t*h*w / merge**2, LM hidden).

        Image rows (C*P*P wide) and video tubelet rows (T*C*P*P) go through their own patch
        projection; every temporal slice (tile, tubelet) is its own segment. Runs through the
        vision data-parallel wrapper (whole slices shared over CP ranks when active).
        """
        return self._vision_dp(pixel_values, grid_thw)

    def embed(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
              video_grid_thw=None, sample_keys=None, visual_kinds=None):
        """Token embeddings with the visual embeddings scattered in: ((L, B, H), None).

        When images and videos share the context token (``<image>``, as HF's processor), the
        batch's ``visual_kinds`` (image / video per item, in span order) tells which runs are
        videos; it is needed only when the batch holds both kinds
        (``models.multimodal.context_masks``).

        Raises:
            ValueError: a batch row's context tokens differ from the embeddings of its
                images / videos (row, key and both counts named); both kinds on a shared token
                without ``visual_kinds``.
        """
        emb = self.language_model.embedding(input_ids=input_ids, position_ids=None)
        emb = emb.transpose(0, 1).clone()  # (B, L, H): row-major order of the context tokens
        media = (("image", self.cfg.image_token_id, pixel_values, image_grid_thw),
                 ("video", self.cfg.video_token_id, pixel_values_videos, video_grid_thw))
        scatter_visual(emb, input_ids, media, self.encode_visual, self.cfg.merge_size,
                       sample_keys, visual_kinds)
        return emb.transpose(0, 1).contiguous(), None

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids, position_ids, pixel_values=None, image_grid_thw=None,
                pixel_values_videos=None, video_grid_thw=None, labels=None, loss_mask=None,
                cu_seqlens=None, max_seqlen=None, sample_keys=None, visual_kinds=None,
                **_unused):
        """Batch-contract fields -> logits (B, L, V/TP) or (per-token loss (B, L), loss mask).

        ``position_ids`` (3, B, L) is accepted and ignored (no rotary in NemotronH);
        ``visual_kinds``: see :meth:`embed`. With ``labels`` (unshifted, -100 = no loss) the model
        predicts token t+1 at t and returns the per-token loss and the shifted loss mask. Under
        PP a stage before the last returns its output hidden states (L, B, H).
        """
        del position_ids
        batch, length = input_ids.shape
        decoder_input = None  # later PP stages: megatron's set_input_tensor
        if self.pre_process:
            decoder_input, _ = self.embed(input_ids, pixel_values, image_grid_thw,
                                          pixel_values_videos, video_grid_thw, sample_keys,
                                          visual_kinds)
        run = functools.partial(self.run_language_model, decoder_input, None, labels, loss_mask,
                                (batch, length), cu_seqlens, max_seqlen)
        if self.mtp is None or labels is None or not self.training:
            return run()
        return with_head_loss(self.language_model, self.mtp, run, labels, loss_mask, cu_seqlens)

    def mtp_logits(self, input_ids, position_ids=None, pixel_values=None, image_grid_thw=None,
                   pixel_values_videos=None, video_grid_thw=None, visual_kinds=None, **_unused):
        """(the LM's logits, the MTP block's logits), each (B, L, V): position i of the second
        predicts token i+2 (parity checks; one stage, TP = 1)."""
        del position_ids
        decoder_input, _ = self.embed(input_ids, pixel_values, image_grid_thw,
                                      pixel_values_videos, video_grid_thw,
                                      visual_kinds=visual_kinds)
        return with_head_logits(self.language_model, self.mtp, functools.partial(
            self.run_language_model, decoder_input, None, None, None, tuple(input_ids.shape)))
