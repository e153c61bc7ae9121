"""Model shapes of Qwen3.5 (dense, ``qwen3_5``) and Qwen3.5 MoE (``qwen3_5_moe``): the Qwen ViT
without DeepStack, the hybrid language model (Gated DeltaNet and gated full-attention layers by
``layer_types``; dense MLPs, or MoE layers with a sigmoid-gated shared expert), special tokens.

This module owns the typed model config (``Qwen35ModelConfig`` = ``VisionConfig`` +
``LMConfig`` + token ids), what differs between the two families (``VARIANTS``), its
construction from a Hugging Face config (``from_hf_config``: a ``config.json`` dict or a
transformers config object), from YAML (``load_yaml``, unknown keys rejected, dotted
``key=value`` overrides) and back to a Hugging Face ``config.json`` dict (``to_hf_dict``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.families import QWEN3_5, QWEN3_5_MOE
from models.layers.moe_aux import check_capacity
from models.layers.qwen_vision_config import (
    VISION_DIVISIBLE,
    VISION_POSITIVE,
    VisionConfig,
    vision_from_hf,
    vision_to_hf,
)
from models.layers.recompute import check_mode
from models.model_config import build_model_config, check_hf_shapes, load_model_yaml
from models.model_config import hf_value as _get

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """What differs between the two families (one row each), and the tower they share: Qwen3-VL's
    ViT (LayerNorm, GELU MLP, learned positions) without DeepStack."""

    architecture: str  #: HF ``architectures[0]``
    moe: bool  #: MoE layers with a shared expert in every layer
    vision_act: str = "gelu_pytorch_tanh"
    vision_norm: str = "LayerNorm"
    gated_mlp: bool = False
    windowed: bool = False
    learned_positions: bool = True
    deepstack: bool = False


VARIANTS = {QWEN3_5: Variant(architecture="Qwen3_5ForConditionalGeneration", moe=False),
            QWEN3_5_MOE: Variant(architecture="Qwen3_5MoeForConditionalGeneration", moe=True)}
FAMILIES = tuple(VARIANTS)


@dataclass(kw_only=True, slots=True)
class LMConfig:
    """Language model shape: the hybrid Qwen3.5 decoder with M-RoPE on part of each head."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  #: dense MLP width (dense family)
    num_layers: int
    layer_types: list[str]  #: per layer "linear_attention" (Gated DeltaNet) / "full_attention"
    num_heads: int  #: gated attention: query heads
    num_kv_heads: int
    head_dim: int
    mrope_section: list[int]  #: interleaved t/h/w frequencies; sums to rotary_dim / 2
    partial_rotary_factor: float = 0.25  #: rotary on this share of each head's channels
    rope_theta: float = 10000000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_position_embeddings: int = 262144
    # Gated DeltaNet (models.layers.gated_deltanet)
    linear_conv_kernel: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # MoE (qwen3_5_moe; every layer)
    num_experts: int = 0  #: routed experts per layer
    experts_per_token: int = 0  #: top-k
    moe_intermediate_size: int = 0  #: routed expert MLP width
    shared_expert_intermediate_size: int = 0  #: the shared expert's width (sigmoid-gated)
    router_aux_loss_coef: float = 0.0
    #: multi-token-prediction layers the HF checkpoints carry (``mtp.*``): not built, their
    #: weights carried through import and export unchanged (docs/models.md, "Qwen3.5")
    mtp_num_layers: int = 0

    @property
    def moe_layers(self) -> list[bool]:
        """Per layer: MoE (every layer of the MoE family) or dense MLP."""
        return [self.num_experts > 0] * self.num_layers

    @property
    def linear_layers(self) -> list[bool]:
        """Per layer: Gated DeltaNet (True) or gated full attention."""
        return [kind == LINEAR for kind in self.layer_types]

    @property
    def attention_output_gate(self) -> bool:
        """Full attention is gated (``q_proj`` gives query and gate: ``models.hf.weights``)."""
        return True

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass(kw_only=True, slots=True)
class Qwen35ModelConfig:
    family: str  #: "qwen3_5" or "qwen3_5_moe"
    vision: VisionConfig
    lm: LMConfig
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    #: activation recomputation while training: none | selective | full (models/layers/recompute.py)
    recompute: str = "none"
    #: MoE expert capacity (models/layers/moe_aux.py: the assignments past it are dropped);
    #: null: none
    moe_capacity_factor: float | None = None
    #: build and train the checkpoint's multi-token-prediction layer (``mtp.*``,
    #: ``models.layers.mtp``); false: its weights are carried unchanged
    train_mtp: bool = False
    #: the MTP loss's weight in the objective (LM loss + weight x MTP loss); 0.1 is megatron's
    #: ``mtp_loss_scaling_factor`` default
    mtp_loss_weight: float = 0.1

    def kernel_kinds(self) -> tuple[str, ...]:
        """The layer kinds whose kernels ``models.kernels`` chooses for this model."""
        kinds = ("attention", "conv", "deltanet") if any(self.lm.linear_layers) else ("attention",)
        return (*kinds, "experts") if self.lm.num_experts else kinds

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        check_mode(self.recompute)
        check_capacity(self.moe_capacity_factor, self.lm.num_experts)
        t = self.lm
        problems = []
        if sum(t.mrope_section) * 2 != t.rotary_dim:
            problems.append(f"lm.mrope_section {t.mrope_section} must sum to rotary_dim/2 = "
                            f"{t.rotary_dim // 2} (head_dim {t.head_dim} x "
                            f"partial_rotary_factor {t.partial_rotary_factor} / 2)")
        if len(t.layer_types) != t.num_layers or set(t.layer_types) - {LINEAR, FULL}:
            problems.append(f"lm.layer_types must list {t.num_layers} of {LINEAR!r} / {FULL!r}, "
                            f"got {t.layer_types}")
        if t.linear_num_value_heads % t.linear_num_key_heads:
            problems.append(f"lm.linear_num_value_heads {t.linear_num_value_heads} is not a "
                            f"multiple of lm.linear_num_key_heads {t.linear_num_key_heads}")
        moe = t.num_experts > 0
        if moe != self.variant.moe:
            problems.append(f"lm.num_experts {t.num_experts}: family {self.family!r} "
                            f"{'needs' if self.variant.moe else 'has no'} experts")
        if moe and not (0 < t.experts_per_token <= t.num_experts and t.moe_intermediate_size > 0
                        and t.shared_expert_intermediate_size > 0):
            problems.append(f"lm.experts_per_token {t.experts_per_token} must be in 1.."
                            f"{t.num_experts}, lm.moe_intermediate_size and "
                            "lm.shared_expert_intermediate_size positive")
        if self.train_mtp and t.mtp_num_layers != 1:
            problems.append(f"train_mtp needs the checkpoint's one MTP layer "
                            f"(lm.mtp_num_layers 1), got {t.mtp_num_layers}")
        if not 0.0 <= self.mtp_loss_weight < float("inf"):
            problems.append(f"mtp_loss_weight must be >= 0 and finite, got {self.mtp_loss_weight}")
        if self.vision.out_hidden_size != t.hidden_size:
            problems.append(f"vision.out_hidden_size {self.vision.out_hidden_size} != "
                            f"lm.hidden_size {t.hidden_size}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def merge_size(self) -> int:
        return self.vision.spatial_merge_size

    @property
    def variant(self) -> Variant:
        return VARIANTS[self.family]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------ Hugging Face config
#: the ``text_config`` values the LM is built of (``models.model_config.check_hf_shapes``)
HF_POSITIVE = tuple(f"text_config.{key}" for key in (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size"))
HF_DIVISIBLE = (("text_config.num_attention_heads", "text_config.num_key_value_heads"),
                ("text_config.linear_num_value_heads", "text_config.linear_num_key_heads"))


def from_hf_config(hf: Any) -> Qwen35ModelConfig:
    """Build from a Hugging Face Qwen3.5 / Qwen3.5 MoE config (``config.json`` dict or object).

    Raises:
        ValueError: not a Qwen3.5 config, or one this model does not build (attention biases).
    """
    model_type = _get(hf, "model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type must be one of {FAMILIES}, got {model_type!r}")
    text, vis = _get(hf, "text_config"), _get(hf, "vision_config")
    if text is None or vis is None:
        raise ValueError("config has no text_config / vision_config")
    if _get(text, "attention_bias", False):
        raise ValueError("text_config.attention_bias true: Qwen3.5 attention here has no biases")
    check_hf_shapes(hf, (*HF_POSITIVE, *VISION_POSITIVE), (*HF_DIVISIBLE, *VISION_DIVISIBLE))
    rope = _get(text, "rope_parameters") or _get(text, "rope_scaling") or {}
    layers = _get(text, "num_hidden_layers")
    interval = _get(text, "full_attention_interval", 4) or 4
    kinds = _get(text, "layer_types") or [FULL if (i + 1) % interval == 0 else LINEAR
                                          for i in range(layers)]
    variant = VARIANTS[model_type]
    tie = _get(hf, "tie_word_embeddings")
    tie = _get(text, "tie_word_embeddings", False) if tie is None else tie
    moe = dict(num_experts=_get(text, "num_experts"),
               experts_per_token=_get(text, "num_experts_per_tok"),
               moe_intermediate_size=_get(text, "moe_intermediate_size"),
               shared_expert_intermediate_size=_get(text, "shared_expert_intermediate_size"),
               router_aux_loss_coef=float(_get(text, "router_aux_loss_coef", 0.001)))
    lm = LMConfig(
        vocab_size=_get(text, "vocab_size"), hidden_size=_get(text, "hidden_size"),
        intermediate_size=_get(text, "intermediate_size", 0) or 0, num_layers=layers,
        layer_types=list(kinds), num_heads=_get(text, "num_attention_heads"),
        num_kv_heads=_get(text, "num_key_value_heads"), head_dim=_get(text, "head_dim", 256),
        mrope_section=list(rope.get("mrope_section") or [11, 11, 10]),
        partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                             _get(text, "partial_rotary_factor", 0.25))),
        rope_theta=float(rope.get("rope_theta", _get(text, "rope_theta", 10000000.0))),
        rms_norm_eps=float(_get(text, "rms_norm_eps", 1e-6)), tie_embeddings=bool(tie),
        max_position_embeddings=_get(text, "max_position_embeddings", 262144),
        linear_conv_kernel=_get(text, "linear_conv_kernel_dim", 4),
        linear_key_head_dim=_get(text, "linear_key_head_dim", 128),
        linear_value_head_dim=_get(text, "linear_value_head_dim", 128),
        linear_num_key_heads=_get(text, "linear_num_key_heads", 16),
        linear_num_value_heads=_get(text, "linear_num_value_heads", 32),
        mtp_num_layers=_get(text, "mtp_num_hidden_layers", 0) or 0,
        **(moe if variant.moe else {}))
    return Qwen35ModelConfig(
        family=model_type, vision=vision_from_hf(vis, variant), lm=lm,
        image_token_id=_get(hf, "image_token_id", 248056),
        video_token_id=_get(hf, "video_token_id", 248057),
        vision_start_token_id=_get(hf, "vision_start_token_id", 248053),
        vision_end_token_id=_get(hf, "vision_end_token_id", 248054))


def to_hf_dict(cfg: Qwen35ModelConfig) -> dict:
    """A Hugging Face ``config.json`` dict for ``cfg`` (used by export when none was stored)."""
    t, variant = cfg.lm, cfg.variant
    rope = {"rope_type": "default", "rope_theta": t.rope_theta, "mrope_section": t.mrope_section,
            "mrope_interleaved": True, "partial_rotary_factor": t.partial_rotary_factor}
    text = {"model_type": f"{cfg.family}_text", "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size, "num_hidden_layers": t.num_layers,
            "layer_types": t.layer_types, "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
            "rms_norm_eps": t.rms_norm_eps, "rope_parameters": rope, "hidden_act": "silu",
            "attention_bias": False, "max_position_embeddings": t.max_position_embeddings,
            "tie_word_embeddings": t.tie_embeddings,
            "linear_conv_kernel_dim": t.linear_conv_kernel,
            "linear_key_head_dim": t.linear_key_head_dim,
            "linear_value_head_dim": t.linear_value_head_dim,
            "linear_num_key_heads": t.linear_num_key_heads,
            "linear_num_value_heads": t.linear_num_value_heads,
            "mtp_num_hidden_layers": t.mtp_num_layers}
    if variant.moe:
        text.update(num_experts=t.num_experts, num_experts_per_tok=t.experts_per_token,
                    moe_intermediate_size=t.moe_intermediate_size,
                    shared_expert_intermediate_size=t.shared_expert_intermediate_size,
                    router_aux_loss_coef=t.router_aux_loss_coef)
    else:
        text["intermediate_size"] = t.intermediate_size
    return {"architectures": [variant.architecture], "model_type": cfg.family, "text_config": text,
            "vision_config": vision_to_hf(cfg.vision, cfg.family, variant),
            "tie_word_embeddings": t.tie_embeddings, "image_token_id": cfg.image_token_id,
            "video_token_id": cfg.video_token_id,
            "vision_start_token_id": cfg.vision_start_token_id,
            "vision_end_token_id": cfg.vision_end_token_id, "dtype": "float32"}


# ------------------------------------------------------------------ YAML
def from_dict(raw: dict) -> Qwen35ModelConfig:
    """Build from a plain dict (the YAML layout; ``models.model_config.build_model_config``).

    Raises:
        ConfigError: unknown or missing keys and wrong types (all listed), or inconsistent
            shapes.
    """
    return build_model_config(Qwen35ModelConfig, raw)


def load_yaml(path: str | Path,
              overrides: list[str] | tuple[str, ...] = ()) -> Qwen35ModelConfig:
    """Load ``configs/qwen3_5*.yaml`` (with dotted ``key=value`` overrides)."""
    return load_model_yaml(path, overrides, from_dict)


__all__ = ["FAMILIES", "LMConfig", "Qwen35ModelConfig", "VARIANTS", "Variant", "VisionConfig",
           "from_dict", "from_hf_config", "load_yaml", "to_hf_dict"]
