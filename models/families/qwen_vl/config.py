"""Model shapes of Qwen2.5-VL, Qwen3-VL (dense) and Qwen3-VL MoE: vision tower, language model
(MoE fields: experts, top-k, expert width, which layers are MoE, the aux loss), special tokens.

This module owns the typed model config (``QwenVLModelConfig`` = ``VisionConfig`` + ``LMConfig``
+ token ids), what differs between the two families (``VARIANTS``: HF defaults and layout, how
the vision tower is built), its construction from a Hugging Face config (``from_hf_config``: a
``config.json`` dict or a transformers config object), from YAML (``load_yaml``,
``configs/qwen*_model*.yaml`` style, unknown keys rejected, dotted ``key=value`` overrides:
``models.model_config``), and back to a Hugging Face ``config.json`` dict (``to_hf_dict``, for
export).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.families import COSMOS3_OMNI, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """What differs between the Qwen-VL families of this package (one row per family): the
    Hugging Face defaults and layout, and how the vision tower is built."""

    architecture: str  #: HF ``architectures[0]``
    mrope_section: tuple[int, int, int]  #: default when the HF config has none
    text_v3: bool  #: Qwen3 text: q/k RMSNorm, interleaved M-RoPE, ``attention_bias`` read
    vision_act: str  #: default ``hidden_act`` of the ViT
    vision_norm: str  #: "RMSNorm" (2.5) or "LayerNorm" (3): blocks and the final merger
    gated_mlp: bool  #: 2.5: gated SiLU MLP; 3: plain MLP
    windowed: bool  #: 2.5: window attention except ``fullatt_block_indexes``; 3: full attention
    learned_positions: bool  #: 3: interpolated position table, patch bias, DeepStack
    moe: bool = False  #: the LM's MLPs are MoE layers (Qwen3-VL MoE), dense where the config says
    #: the ``model_type`` prefix of its ``text_config`` / ``vision_config`` (default: the family's)
    sub_config_type: str = ""

    @property
    def deepstack(self) -> bool:
        """Qwen3-VL's DeepStack mergers (every tower with learned positions here)."""
        return self.learned_positions


VARIANTS = {
    QWEN2_5_VL: Variant(architecture="Qwen2_5_VLForConditionalGeneration",
                        mrope_section=(16, 24, 24), text_v3=False, vision_act="silu",
                        vision_norm="RMSNorm", gated_mlp=True, windowed=True,
                        learned_positions=False),
    QWEN3_VL: Variant(architecture="Qwen3VLForConditionalGeneration",
                      mrope_section=(24, 20, 20), text_v3=True, vision_act="gelu_pytorch_tanh",
                      vision_norm="LayerNorm", gated_mlp=False, windowed=False,
                      learned_positions=True),
    QWEN3_VL_MOE: Variant(architecture="Qwen3VLMoeForConditionalGeneration",
                          mrope_section=(24, 20, 20), text_v3=True,
                          vision_act="gelu_pytorch_tanh", vision_norm="LayerNorm", gated_mlp=False,
                          windowed=False, learned_positions=True, moe=True),
}
#: Cosmos3-Omni's reasoner: Qwen3-VL's model and sub-configs (its own architecture name)
VARIANTS[COSMOS3_OMNI] = dataclasses.replace(
    VARIANTS[QWEN3_VL], architecture="Cosmos3OmniForConditionalGeneration",
    sub_config_type=QWEN3_VL)
FAMILIES = tuple(VARIANTS)


@dataclass(kw_only=True, slots=True)
class LMConfig:
    """Language model shape (Qwen2 / Qwen3 decoder with M-RoPE)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  #: per-head width (hidden_size // num_heads for Qwen2.5)
    mrope_section: list[int]  #: rotary frequencies per (t, h, w); sums to head_dim // 2
    mrope_interleaved: bool = False  #: Qwen3-VL interleaves t/h/w over frequencies
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = True  #: Qwen2.5: q/k/v biases; Qwen3: none
    qk_norm: bool = False  #: Qwen3: RMSNorm on q and k per head
    tie_embeddings: bool = False
    max_position_embeddings: int = 128000
    # MoE (Qwen3-VL MoE; 0 experts: every MLP dense, of intermediate_size)
    num_experts: int = 0  #: routed experts per MoE layer (no shared expert)
    experts_per_token: int = 0  #: top-k (HF num_experts_per_tok)
    moe_intermediate_size: int = 0  #: expert MLP width
    decoder_sparse_step: int = 1  #: layer i is MoE iff (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  #: ... and i is not listed here
    #: load-balancing aux loss weight (HF router_aux_loss_coef; 0 = off)
    router_aux_loss_coef: float = 0.0

    @property
    def moe_layers(self) -> list[bool]:
        """Per layer: MoE (True) or dense MLP, as transformers' Qwen3-VL MoE decides it."""
        return [self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0 for i in range(self.num_layers)]


@dataclass(kw_only=True, slots=True)
class QwenVLModelConfig:
    family: str  #: "qwen2_5_vl", "qwen3_vl" or "qwen3_vl_moe"
    vision: VisionConfig
    lm: LMConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    #: activation recomputation while training: none | selective | full (models/layers/recompute.py)
    recompute: str = "none"
    #: MoE expert capacity (models/layers/moe_aux.py: the assignments past it are dropped);
    #: null: none
    moe_capacity_factor: float | None = None

    def kernel_kinds(self) -> tuple[str, ...]:
        """The layer kinds whose kernels ``models.kernels`` chooses for this model."""
        return ("attention", "experts") if self.lm.num_experts else ("attention",)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        check_mode(self.recompute)
        check_capacity(self.moe_capacity_factor, self.lm.num_experts)
        if sum(self.lm.mrope_section) * 2 != self.lm.head_dim:
            raise ValueError(f"lm.mrope_section {self.lm.mrope_section} must sum to head_dim/2 = "
                             f"{self.lm.head_dim // 2}")
        moe = self.lm.num_experts > 0
        if moe != self.variant.moe:
            raise ValueError(f"lm.num_experts {self.lm.num_experts}: family {self.family!r} "
                             f"{'needs' if self.variant.moe else 'has no'} experts")
        if moe and not (0 < self.lm.experts_per_token <= self.lm.num_experts
                        and self.lm.moe_intermediate_size > 0 and self.lm.decoder_sparse_step > 0):
            raise ValueError(f"lm.experts_per_token {self.lm.experts_per_token} must be in 1.."
                             f"{self.lm.num_experts}, lm.moe_intermediate_size "
                             f"{self.lm.moe_intermediate_size} and lm.decoder_sparse_step "
                             f"{self.lm.decoder_sparse_step} positive")
        if self.vision.out_hidden_size != self.lm.hidden_size:
            raise ValueError(f"vision.out_hidden_size {self.vision.out_hidden_size} != "
                             f"lm.hidden_size {self.lm.hidden_size}")

    @property
    def merge_size(self) -> int:
        """Spatial merge side: tokens per item slice = h * w / merge_size**2 (every family)."""
        return self.vision.spatial_merge_size

    @property
    def variant(self) -> Variant:
        """What this family's model does differently (``VARIANTS``)."""
        return VARIANTS[self.family]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------ Hugging Face config
#: the ``text_config`` values the LM is built of (``models.model_config.check_hf_shapes``)
HF_POSITIVE = tuple(f"text_config.{key}" for key in (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_experts", "num_local_experts", "num_experts_per_tok",
    "moe_intermediate_size"))
HF_DIVISIBLE = (("text_config.num_attention_heads", "text_config.num_key_value_heads"),)


def from_hf_config(hf: Any) -> QwenVLModelConfig:
    """Build from a Hugging Face Qwen2.5-VL / Qwen3-VL config (``config.json`` dict or object).

    Raises:
        ValueError: the config is not a Qwen2.5-VL, Qwen3-VL or Qwen3-VL MoE config.
    """
    model_type = _get(hf, "model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type must be one of {FAMILIES}, got {model_type!r}")
    hf = with_text_config(hf)
    text, vis = _get(hf, "text_config"), _get(hf, "vision_config")
    if text is None or vis is None:
        raise ValueError("config has no text_config / vision_config")
    check_hf_shapes(hf, (*HF_POSITIVE, *VISION_POSITIVE), (*HF_DIVISIBLE, *VISION_DIVISIBLE))
    rope = _get(text, "rope_parameters") or _get(text, "rope_scaling") or {}
    hidden, heads = _get(text, "hidden_size"), _get(text, "num_attention_heads")
    variant = VARIANTS[model_type]
    qwen3 = variant.text_v3
    tie = _get(hf, "tie_word_embeddings")
    if tie is None:
        tie = _get(text, "tie_word_embeddings", False)
    lm = LMConfig(
        vocab_size=_get(text, "vocab_size"), hidden_size=hidden,
        intermediate_size=_get(text, "intermediate_size"),
        num_layers=_get(text, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=_get(text, "num_key_value_heads") or heads,
        head_dim=_get(text, "head_dim") or hidden // heads,
        mrope_section=list(rope.get("mrope_section") or variant.mrope_section),
        mrope_interleaved=bool(rope.get("mrope_interleaved", qwen3)),
        rope_theta=float(rope.get("rope_theta", _get(text, "rope_theta", 1000000.0))),
        rms_norm_eps=float(_get(text, "rms_norm_eps", 1e-6)),
        qkv_bias=bool(_get(text, "attention_bias", False)) if qwen3 else True,
        qk_norm=qwen3, tie_embeddings=bool(tie),
        max_position_embeddings=_get(text, "max_position_embeddings", 128000),
        **(_moe_fields(text) if variant.moe else {}),
    )
    vision = vision_from_hf(vis, variant)
    return QwenVLModelConfig(
        family=model_type, vision=vision, lm=lm,
        image_token_id=_get(hf, "image_token_id", 151655),
        video_token_id=_get(hf, "video_token_id", 151656),
        vision_start_token_id=_get(hf, "vision_start_token_id", 151652),
        vision_end_token_id=_get(hf, "vision_end_token_id", 151653),
    )


def with_text_config(hf: Any) -> Any:
    """``hf`` with its LM keys under ``text_config``: a config.json of the older flat layout
    (transformers < 4.52 wrote Qwen2.5-VL's LM keys at the top level, next to ``vision_config``,
    as the hub's Qwen2.5-VL and MiMo-VL checkpoints still have them) gets a ``text_config`` of
    its top-level keys, as transformers reads it; a nested one is returned as it is."""
    if not isinstance(hf, dict) or hf.get("text_config") is not None or "hidden_size" not in hf:
        return hf
    return {**hf, "text_config": {k: v for k, v in hf.items() if k != "vision_config"}}


def _moe_fields(text: Any) -> dict:
    """The MoE fields of our ``LMConfig`` from a Qwen3-VL MoE ``text_config`` (transformers'
    defaults where a key is absent; transformers 5.x writes ``num_experts`` as
    ``num_local_experts``; ``norm_topk_prob``, which hub configs still carry, is always
    true in transformers' model and is not read)."""
    experts = _get(text, "num_experts") or _get(text, "num_local_experts")  # 5.x saves the latter
    return dict(num_experts=experts or 60,
                experts_per_token=_get(text, "num_experts_per_tok", 4),
                moe_intermediate_size=_get(text, "moe_intermediate_size", 1408),
                decoder_sparse_step=_get(text, "decoder_sparse_step", 1) or 1,
                mlp_only_layers=list(_get(text, "mlp_only_layers", None) or []),
                router_aux_loss_coef=float(_get(text, "router_aux_loss_coef", 0.001)))


def to_hf_dict(cfg: QwenVLModelConfig) -> dict:
    """A Hugging Face ``config.json`` dict for ``cfg`` (used by export when none was stored)."""
    v, t, variant = cfg.vision, cfg.lm, cfg.variant
    qwen3 = variant.text_v3
    rope = {"rope_type": "default", "rope_theta": t.rope_theta, "mrope_section": t.mrope_section}
    if qwen3:
        rope["mrope_interleaved"] = t.mrope_interleaved
    text = {"model_type": f"{variant.sub_config_type or cfg.family}_text",
            "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_layers, "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
            "rms_norm_eps": t.rms_norm_eps, "rope_parameters": rope, "hidden_act": "silu",
            "max_position_embeddings": t.max_position_embeddings,
            "tie_word_embeddings": t.tie_embeddings}
    if qwen3:
        text["attention_bias"] = t.qkv_bias
    if variant.moe:
        text.update(num_experts=t.num_experts, num_experts_per_tok=t.experts_per_token,
                    moe_intermediate_size=t.moe_intermediate_size,
                    decoder_sparse_step=t.decoder_sparse_step, mlp_only_layers=t.mlp_only_layers,
                    router_aux_loss_coef=t.router_aux_loss_coef, norm_topk_prob=True)
    vision = vision_to_hf(v, variant.sub_config_type or cfg.family, variant)
    return {"architectures": [variant.architecture], "model_type": cfg.family, "text_config": text,
            "vision_config": vision, "tie_word_embeddings": t.tie_embeddings,
            "image_token_id": cfg.image_token_id, "video_token_id": cfg.video_token_id,
            "vision_start_token_id": cfg.vision_start_token_id,
            "vision_end_token_id": cfg.vision_end_token_id, "dtype": "float32"}


# ------------------------------------------------------------------ YAML


def from_dict(raw: dict) -> QwenVLModelConfig:
    """Build from a plain dict (the YAML layout; ``models.model_config.build_model_config``).

    Raises:
        ConfigError: unknown or missing keys and wrong types (all listed), or inconsistent
            shapes.
    """
    return build_model_config(QwenVLModelConfig, raw)


def load_yaml(path: str | Path,
              overrides: list[str] | tuple[str, ...] = ()) -> QwenVLModelConfig:
    """Load ``configs/qwen*.yaml`` (with dotted ``key=value`` overrides)."""
    return load_model_yaml(path, overrides, from_dict)
