"""Model shapes of Nemotron-Omni (NemotronH_Omni_Reasoning_V3): RADIO vision tower, projector,
hybrid NemotronH language model (Mamba2 / attention / MLP / MoE layers), special tokens.

This module owns the typed config ``NemotronOmniModelConfig`` (= ``RadioConfig`` + projector
fields + ``NemotronHConfig`` + token ids), its
construction from a Hugging Face ``nemotron_h_omni`` config (``from_hf_config``: a
``config.json`` dict or a transformers config object), from YAML (``from_dict`` / ``load_yaml``,
unknown keys rejected, dotted ``key=value`` overrides), and back to a Hugging Face
``config.json`` dict (``to_hf_dict``, for export).

Field names that the data side sets (``image_token_id``, ``video_token_id``,
``vision_start_token_id``, ``vision_end_token_id``, ``lm.vocab_size``) are spelled as in
the Qwen-VL package's ``QwenVLModelConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from contract.families import HF_MODEL_TYPES, NEMOTRON_OMNI
from models.layers.moe_aux import check_capacity
from models.layers.recompute import check_mode
from models.model_config import build_model_config, check_hf_shapes, load_model_yaml
from models.model_config import hf_value as _get

FAMILY = NEMOTRON_OMNI
HF_MODEL_TYPE = HF_MODEL_TYPES[NEMOTRON_OMNI]
#: HF ``layers_block_type`` names <-> megatron hybrid pattern symbols
LAYER_SYMBOLS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
#: the MTP block's inner layers the head builds (``train_mtp``): no Mamba layer (its state would
#: need the head's own recurrence; no published checkpoint has one)
MTP_SYMBOLS = "*-E"
CLIP_MEAN = list(OPENAI_CLIP_MEAN)
CLIP_STD = list(OPENAI_CLIP_STD)


@dataclass(kw_only=True, slots=True)
class RadioConfig:
    """RADIO ViT shape (HF ``RadioConfig``)."""

    depth: int  #: ViT blocks (HF num_hidden_layers)
    hidden_size: int  #: ViT width (= HF vision_hidden_size of the omni config)
    intermediate_size: int  #: MLP width (HF: hidden_size * mlp_ratio; SwiGLU: 2/3 of it, rounded)
    num_heads: int
    patch_size: int = 16
    in_channels: int = 3
    num_cls_tokens: int = 3  #: learned class tokens prepended to every segment
    num_registers: int = 7  #: learned register tokens prepended after them
    max_img_size: int = 2048  #: position table side = max_img_size // patch_size
    mlp: str = "gelu"  #: "gelu" (fc1-GELU-fc2, biases) or "swiglu" (use_swiglu_ffn)
    layerscale_value: float = 1.0  #: initial LayerScale (HF RadioLayerScale; 1.0 = identity)
    norm_eps: float = 1e-6  #: LayerNorm eps of the blocks
    qkv_bias: bool = True
    video_temporal_patch_size: int = 2  #: frames per tubelet (video projection rows: T*C*P*P)
    #: pixel normalisation. NOT applied by the model: the HF omni model makes RADIO's input
    #: conditioner external (``make_preprocessor_external``), its image/video processors normalise.
    norm_mean: list[float] = field(default_factory=lambda: list(CLIP_MEAN))
    norm_std: list[float] = field(default_factory=lambda: list(CLIP_STD))
    summary_idxs: list[int] = field(default_factory=lambda: [0, 1])  #: HF buffer (export only)

    @property
    def prefix_tokens(self) -> int:
        return self.num_cls_tokens + self.num_registers

    @property
    def position_side(self) -> int:
        return self.max_img_size // self.patch_size


@dataclass(kw_only=True, slots=True)
class NemotronHConfig:
    """Hybrid language model shape (HF ``NemotronHConfig``). One mixer per layer, by ``pattern``:
    ``M`` Mamba2, ``*`` attention (no rotary), ``-`` MLP (squared ReLU, no gate), ``E`` MoE."""

    vocab_size: int
    hidden_size: int
    pattern: str  #: hybrid layer pattern, one symbol per layer (HF hybrid_override_pattern)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  #: '-' layers
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    # Mamba2 ('M')
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    mamba_groups: int = 8  #: HF n_groups
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    # MoE ('E')
    num_experts: int = 8  #: HF n_routed_experts
    experts_per_token: int = 2  #: HF num_experts_per_tok
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    num_nextn_predict_layers: int = 0  #: MTP depths of the checkpoint (built with train_mtp)
    #: the inner layers of an MTP depth, one symbol each (HF ``mtp_layers_block_type``)
    mtp_pattern: str = "*E"

    @property
    def num_layers(self) -> int:
        return len(self.pattern)


@dataclass(kw_only=True, slots=True)
class NemotronOmniModelConfig:
    family: str  #: "nemotron_omni"
    vision: RadioConfig
    lm: NemotronHConfig
    projector_hidden_size: int = 4096
    downsample_ratio: float = 0.5  #: pixel shuffle: 2x2 patches -> one token
    vision_final_norm: bool = False  #: LayerNorm on the tower features (HF: LM has MTP layers)
    #: context tokens; the data side sets them (train.py). HF's processor puts the IMAGE token in
    #: video chunks too (the tokenizer has no video token): equal ids are allowed, then the
    #: batch's ``visual_kinds`` tells image and video runs apart (needed when it holds both).
    image_token_id: int = 18
    video_token_id: int = 18
    vision_start_token_id: int = -1  #: ``<img>`` (not used by the model; kept for the data side)
    vision_end_token_id: int = -1  #: ``</img>``
    #: activation recomputation while training: none | selective | full (models/layers/recompute.py;
    #: the hybrid LM recomputes its core attention for full)
    recompute: str = "none"
    #: MoE expert capacity (models/layers/moe_aux.py: the assignments past it are dropped);
    #: null: none
    moe_capacity_factor: float | None = None
    #: build and train the checkpoint's multi-token-prediction block (``language_model.mtp.*``,
    #: ``models.layers.mtp``); false: its weights are carried unchanged
    train_mtp: bool = False
    #: the MTP loss's weight in the objective (LM loss + weight x MTP loss); 0.1 is megatron's
    #: ``mtp_loss_scaling_factor`` default
    mtp_loss_weight: float = 0.1

    def kernel_kinds(self) -> tuple[str, ...]:
        """The layer kinds whose kernels ``models.kernels`` chooses for this model."""
        pattern = self.layer_kinds
        return ("attention", *(("conv", "mamba") if "M" in pattern else ()),
                *(("experts",) if "E" in pattern else ()))

    def __post_init__(self):
        if self.family != FAMILY:
            raise ValueError(f"family must be {FAMILY!r}, got {self.family!r}")
        check_mode(self.recompute)
        check_capacity(self.moe_capacity_factor,
                       self.lm.num_experts if "E" in self.layer_kinds else 0)
        bad = sorted(set(self.lm.pattern) - set(LAYER_SYMBOLS.values()))
        if bad or not self.lm.pattern:
            raise ValueError(f"lm.pattern {self.lm.pattern!r}: symbols must be M, *, - or E")
        if round(1 / self.downsample_ratio) ** 2 * self.downsample_ratio ** 2 != 1:
            raise ValueError(f"downsample_ratio {self.downsample_ratio} must be 1/integer")
        problems = []
        depths = self.lm.num_nextn_predict_layers
        if self.train_mtp and depths != 1:
            problems.append(f"train_mtp needs the checkpoint's one MTP depth "
                            f"(lm.num_nextn_predict_layers 1), got {depths}")
        if self.train_mtp and (set(self.lm.mtp_pattern) - set(MTP_SYMBOLS)
                               or not self.lm.mtp_pattern):
            problems.append(f"lm.mtp_pattern {self.lm.mtp_pattern!r}: train_mtp builds "
                            f"attention (*), MLP (-) and MoE (E) layers only")
        if not 0.0 <= self.mtp_loss_weight < float("inf"):
            problems.append(f"mtp_loss_weight must be >= 0 and finite, got {self.mtp_loss_weight}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def layer_kinds(self) -> str:
        """The symbols of every layer the model builds: the decoder's, and with ``train_mtp``
        the MTP block's."""
        return self.lm.pattern + (self.lm.mtp_pattern if self.train_mtp else "")

    @property
    def merge_size(self) -> int:
        """Pixel-shuffle side: tokens per item slice = h * w / merge_size**2."""
        return round(1 / self.downsample_ratio)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------ Hugging Face config
#: the older names of ``layers_block_type`` / ``mtp_layers_block_type`` entries (transformers
#: reads them as the new ones: ``remap_legacy_layer_types``)
LEGACY_LAYER_NAMES = {"mamba": "linear_attention", "attention": "full_attention"}


def _symbols(types) -> str:
    return "".join(LAYER_SYMBOLS[LEGACY_LAYER_NAMES.get(t, t)] for t in types)


def _layer_pattern(text: Any) -> str:
    types = _get(text, "layers_block_type") or _get(text, "layer_types")
    if types:
        return _symbols(types)
    pattern = _get(text, "hybrid_override_pattern")
    if not pattern:
        raise ValueError("text_config has neither layers_block_type nor hybrid_override_pattern")
    return pattern


def _mtp_pattern(text: Any) -> str:
    """The MTP block's inner layers (``mtp_layers_block_type``, or the published Nemotron-3
    spelling ``mtp_hybrid_override_pattern``; transformers' default attention then MoE)."""
    types = _get(text, "mtp_layers_block_type")
    if types:
        return _symbols(types)
    return _get(text, "mtp_hybrid_override_pattern") or "*E"


#: the values the model is built of (``models.model_config.check_hf_shapes``): the LM's (under
#: ``text_config``, or ``llm_config`` in older configs) and the tower's
HF_TEXT_POSITIVE = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "intermediate_size", "mamba_num_heads", "mamba_head_dim",
                    "ssm_state_size", "n_groups", "conv_kernel", "chunk_size", "n_routed_experts",
                    "num_experts_per_tok", "moe_intermediate_size")
HF_VISION_POSITIVE = tuple(f"vision_config.{key}" for key in (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "patch_size", "num_channels"))


def from_hf_config(hf: Any) -> NemotronOmniModelConfig:
    """Build from a Hugging Face ``nemotron_h_omni`` config (``config.json`` dict or object).

    Raises:
        ValueError: not a ``nemotron_h_omni`` config, or one with parts we do not build
            (audio is ignored: the audio tower is not part of this model).
    """
    if _get(hf, "model_type") != HF_MODEL_TYPE:
        raise ValueError(f"model_type must be {HF_MODEL_TYPE!r}, got {_get(hf, 'model_type')!r}")
    text = _get(hf, "text_config") or _get(hf, "llm_config")
    vis = _get(hf, "vision_config")
    if text is None or vis is None:
        raise ValueError("config has no text_config / vision_config")
    section = "text_config" if _get(hf, "text_config") else "llm_config"
    check_hf_shapes(hf, (*(f"{section}.{key}" for key in HF_TEXT_POSITIVE), *HF_VISION_POSITIVE),
                    ((f"{section}.num_attention_heads", f"{section}.num_key_value_heads"),
                     (f"{section}.mamba_num_heads", f"{section}.n_groups"),
                     ("vision_config.hidden_size", "vision_config.num_attention_heads")))
    width = _get(vis, "hidden_size", 1280)
    mlp_width = int(width * _get(vis, "mlp_ratio", 4.0))
    swiglu = bool(_get(vis, "use_swiglu_ffn", False))
    if swiglu:
        mlp_width = (int(mlp_width * 2 / 3) + 7) // 8 * 8
    if _get(vis, "hidden_act", "gelu") != "gelu" and not swiglu:
        raise ValueError(f"vision hidden_act {_get(vis, 'hidden_act')!r}: only gelu is built")
    if _get(text, "attention_bias", False) or _get(text, "mlp_bias", False):
        raise ValueError("text_config attention_bias / mlp_bias = true is not built")
    vision = RadioConfig(
        depth=_get(vis, "num_hidden_layers", 32), hidden_size=width,
        intermediate_size=mlp_width, num_heads=_get(vis, "num_attention_heads", 16),
        patch_size=_get(vis, "patch_size", 16), in_channels=_get(vis, "num_channels", 3),
        num_cls_tokens=_get(vis, "num_cls_tokens", 3),
        num_registers=_get(vis, "num_registers", 7),
        max_img_size=_get(vis, "max_img_size", 2048), mlp="swiglu" if swiglu else "gelu",
        layerscale_value=float(_get(vis, "layerscale_value", 1.0)),
        norm_eps=float(_get(vis, "layer_norm_eps", 1e-6)),
        qkv_bias=bool(_get(vis, "qkv_bias", True)),
        video_temporal_patch_size=(_get(vis, "video_temporal_patch_size")
                                   or _get(hf, "video_temporal_patch_size", 2)),
        norm_mean=list(_get(vis, "norm_mean", CLIP_MEAN)),
        norm_std=list(_get(vis, "norm_std", CLIP_STD)),
        summary_idxs=list(_get(vis, "summary_idxs", None) or [0, 1]),
    )
    heads = _get(text, "num_attention_heads", 32)
    mtp = _get(text, "num_nextn_predict_layers", 0) or 0
    lm = NemotronHConfig(
        vocab_size=_get(text, "vocab_size"), hidden_size=_get(text, "hidden_size"),
        pattern=_layer_pattern(text), num_heads=heads,
        num_kv_heads=_get(text, "num_key_value_heads") or heads,
        head_dim=_get(text, "head_dim") or _get(text, "hidden_size") // heads,
        intermediate_size=_get(text, "intermediate_size"),
        rms_norm_eps=float(_get(text, "layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", None)
                            or _get(text, "tie_word_embeddings", False)),
        max_position_embeddings=_get(text, "max_position_embeddings", 4096),
        mamba_num_heads=_get(text, "mamba_num_heads", 128),
        mamba_head_dim=_get(text, "mamba_head_dim", 64),
        ssm_state_size=_get(text, "ssm_state_size", 128),
        mamba_groups=_get(text, "n_groups", _get(text, "mamba_n_groups", 8)),
        conv_kernel=_get(text, "conv_kernel", _get(text, "mamba_d_conv", 4)),
        chunk_size=_get(text, "chunk_size", _get(text, "mamba_chunk_size", 128)),
        use_conv_bias=bool(_get(text, "use_conv_bias", True)),
        time_step_min=float(_get(text, "time_step_min", 0.001)),
        time_step_max=float(_get(text, "time_step_max", 0.1)),
        time_step_floor=float(_get(text, "time_step_floor", 1e-4)),
        num_experts=_get(text, "n_routed_experts", 8),
        experts_per_token=_get(text, "num_experts_per_tok", 2),
        moe_intermediate_size=_get(text, "moe_intermediate_size", 7688),
        moe_shared_expert_intermediate_size=_get(text, "moe_shared_expert_intermediate_size",
                                                 7688),
        moe_latent_size=_get(text, "moe_latent_size"),
        routed_scaling_factor=float(_get(text, "routed_scaling_factor", 1.0)),
        n_group=_get(text, "n_group", 1), topk_group=_get(text, "topk_group", 1),
        norm_topk_prob=bool(_get(text, "norm_topk_prob", True)),
        num_nextn_predict_layers=mtp, mtp_pattern=_mtp_pattern(text),
    )
    image_token = _get(hf, "image_token_id", None)
    if image_token is None:
        image_token = _get(hf, "img_context_token_id", 18)
    video_token = _get(hf, "video_token_id", None)
    if video_token is None:
        video_token = image_token  # HF fills video chunks with the image token
    return NemotronOmniModelConfig(
        family=FAMILY, vision=vision, lm=lm,
        projector_hidden_size=_get(hf, "projector_hidden_size", 4096),
        downsample_ratio=float(_get(hf, "downsample_ratio", 0.5)),
        vision_final_norm=mtp > 0, image_token_id=image_token, video_token_id=video_token,
    )


def to_hf_dict(cfg: NemotronOmniModelConfig) -> dict:
    """A Hugging Face ``config.json`` dict for ``cfg`` (used by export when none was stored)."""
    v, t = cfg.vision, cfg.lm
    names = {s: n for n, s in LAYER_SYMBOLS.items()}
    text = {"model_type": "nemotron_h", "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
            "layers_block_type": [names[s] for s in t.pattern],
            "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
            "head_dim": t.head_dim, "intermediate_size": t.intermediate_size,
            "mlp_hidden_act": "relu2", "layer_norm_epsilon": t.rms_norm_eps,
            "tie_word_embeddings": t.tie_embeddings,
            "max_position_embeddings": t.max_position_embeddings,
            "mamba_num_heads": t.mamba_num_heads, "mamba_head_dim": t.mamba_head_dim,
            "ssm_state_size": t.ssm_state_size, "n_groups": t.mamba_groups,
            "conv_kernel": t.conv_kernel, "chunk_size": t.chunk_size,
            "use_conv_bias": t.use_conv_bias, "time_step_min": t.time_step_min,
            "time_step_max": t.time_step_max, "time_step_floor": t.time_step_floor,
            "n_routed_experts": t.num_experts, "num_experts_per_tok": t.experts_per_token,
            "moe_intermediate_size": t.moe_intermediate_size,
            "moe_shared_expert_intermediate_size": t.moe_shared_expert_intermediate_size,
            "moe_latent_size": t.moe_latent_size, "routed_scaling_factor": t.routed_scaling_factor,
            "n_group": t.n_group, "topk_group": t.topk_group, "norm_topk_prob": t.norm_topk_prob,
            "num_nextn_predict_layers": t.num_nextn_predict_layers,
            "mtp_layers_block_type": [names[s] for s in t.mtp_pattern]}
    ratio = v.intermediate_size / v.hidden_size
    vision = {"model_type": "radio", "hidden_size": v.hidden_size, "num_hidden_layers": v.depth,
              "num_attention_heads": v.num_heads,
              "mlp_ratio": 4.0 if v.mlp == "swiglu" else ratio, "hidden_act": "gelu",
              "use_swiglu_ffn": v.mlp == "swiglu", "layer_norm_eps": v.norm_eps,
              "qkv_bias": v.qkv_bias, "layerscale_value": v.layerscale_value,
              "num_channels": v.in_channels, "patch_size": v.patch_size,
              "max_img_size": v.max_img_size, "num_cls_tokens": v.num_cls_tokens,
              "num_registers": v.num_registers,
              "video_temporal_patch_size": v.video_temporal_patch_size,
              "summary_idxs": v.summary_idxs, "norm_mean": v.norm_mean, "norm_std": v.norm_std}
    return {"architectures": ["NemotronH_Omni_Reasoning_V3"], "model_type": HF_MODEL_TYPE,
            "text_config": text, "vision_config": vision, "audio_config": None,
            "downsample_ratio": cfg.downsample_ratio,
            "projector_hidden_size": cfg.projector_hidden_size,
            "vision_hidden_size": v.hidden_size,
            "video_temporal_patch_size": v.video_temporal_patch_size,
            "image_token_id": cfg.image_token_id, "video_token_id": cfg.video_token_id,
            "tie_word_embeddings": t.tie_embeddings, "dtype": "float32"}


# ------------------------------------------------------------------ YAML


def from_dict(raw: dict) -> NemotronOmniModelConfig:
    """Build from a plain dict (the YAML layout; ``models.model_config.build_model_config``).

    Raises:
        ConfigError: unknown or missing keys and wrong types (all listed), or inconsistent
            shapes.
    """
    return build_model_config(NemotronOmniModelConfig, raw)


def load_yaml(path: str | Path,
              overrides: list[str] | tuple[str, ...] = ()) -> NemotronOmniModelConfig:
    """Load ``configs/nemotron_omni*.yaml`` (with dotted ``key=value`` overrides)."""
    return load_model_yaml(path, overrides, from_dict)
