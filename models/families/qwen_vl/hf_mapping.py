"""Hugging Face <-> our weight names for Qwen2.5-VL, Qwen3-VL and Qwen3-VL MoE: the literal
mapping tables.

This module owns the tables (HF key template -> our key template, and which part of a fused
tensor it is: the part names of ``models.hf.weights``), the hub's legacy Qwen2.5-VL key prefixes,
and the family's three conversions (``hf_to_ours``, ``hf_to_ours_stage`` for one pipeline stage,
``ours_to_hf``), which run the shared machinery of ``models.hf.weights`` (every key and shape
checked; the first offender named in a one-line ``ValueError``) over these tables. Our keys are
the state-dict keys of ``QwenVL`` (this package's ``model``) built with the local (non-TE) spec at
TP=1; megatron's ``sharded_state_dict`` maps them to the TE names inside distributed checkpoints.

Qwen3-VL MoE layers (``lm.moe_layers``): the router ``mlp.gate.weight`` (E, H) and the experts.
The table names the experts one by one (``mlp.experts.{e}.gate_proj / up_proj / down_proj``, the
per-expert layout, which is also read as is); the fused 3-D tensors of a checkpoint are split into
them first (``split_fused_experts``), in either layout, told apart by shape: the published
checkpoints' x@W layout, gate_up (E, H, 2I) and down (E, I, H), or transformers' ``save_pretrained``
layout (E, 2I, H) / (E, H, I) (gate_up is ambiguous only when H = 2I, down only when H = I; never
both, so one of the two decides). Any other shape is one ``ValueError`` naming the key, its shape
and both layouts. Export writes the published layout (``fuse_experts``), which transformers and
vLLM load.

Cosmos3-Omni (``cosmos3_omni``): the reasoner is Qwen3-VL under its own published names (the LM
without its ``model.`` prefix, ``layers.*`` / ``embed_tokens`` / ``norm``; the ViT flat,
``blocks.*`` / ``merger.*`` / ``patch_embed`` / ``pos_embed`` / ``deepstack_merger_list.*``;
attention as ``to_q / to_k / to_v / to_out / norm_q / norm_k`` in newer checkpoints, the Qwen
names in older ones): both read (``COSMOS3_NAMES``), the newer one written (what transformers'
``save_pretrained`` writes). The unified checkpoint's generator, sound and action weights
(``COSMOS3_UNUSED``) are no part of the reasoner: ``unused_keys`` names them, and the import
refuses them in one line unless asked to drop them (``models.checkpointing.sharding``).
"""

from __future__ import annotations

import functools
import re

import torch

from models.families.qwen_vl.config import QwenVLModelConfig
from models.hf import weights as hf_weights
from models.hf.weights import fuse_experts, split_fused_experts

L, V = "model.language_model.layers.{i}.", "model.visual.blocks.{i}."
OL, OV = "language_model.decoder.layers.{i}.", "vision.layers.{i}."

#: HF key template -> (our key template, part of a fused tensor or None).
#: {i}: layer, {j}: DeepStack merger.
COMMON = {
    "model.language_model.embed_tokens.weight":
        ("language_model.embedding.word_embeddings.weight", None),
    "model.language_model.norm.weight": ("language_model.decoder.final_layernorm.weight", None),
    "lm_head.weight": ("language_model.output_layer.weight", None),
    L + "input_layernorm.weight": (OL + "input_layernorm.weight", None),
    L + "self_attn.q_proj.weight": (OL + "self_attention.linear_qkv.weight", "q"),
    L + "self_attn.k_proj.weight": (OL + "self_attention.linear_qkv.weight", "k"),
    L + "self_attn.v_proj.weight": (OL + "self_attention.linear_qkv.weight", "v"),
    L + "self_attn.o_proj.weight": (OL + "self_attention.linear_proj.weight", None),
    L + "post_attention_layernorm.weight": (OL + "pre_mlp_layernorm.weight", None),
    L + "mlp.gate_proj.weight": (OL + "mlp.linear_fc1.weight", "gate"),
    L + "mlp.up_proj.weight": (OL + "mlp.linear_fc1.weight", "up"),
    L + "mlp.down_proj.weight": (OL + "mlp.linear_fc2.weight", None),
    "model.visual.patch_embed.proj.weight": ("vision.patch_embed.weight", "patch"),
    V + "attn.qkv.weight": (OV + "self_attention.linear_qkv.weight", "vit_qkv"),
    V + "attn.qkv.bias": (OV + "self_attention.linear_qkv.bias", "vit_qkv"),
    V + "attn.proj.weight": (OV + "self_attention.linear_proj.weight", None),
    V + "attn.proj.bias": (OV + "self_attention.linear_proj.bias", None),
    V + "norm1.weight": (OV + "input_layernorm.weight", None),
    V + "norm2.weight": (OV + "pre_mlp_layernorm.weight", None),
}
QWEN2_5_VL = {
    **COMMON,
    L + "self_attn.q_proj.bias": (OL + "self_attention.linear_qkv.bias", "q"),
    L + "self_attn.k_proj.bias": (OL + "self_attention.linear_qkv.bias", "k"),
    L + "self_attn.v_proj.bias": (OL + "self_attention.linear_qkv.bias", "v"),
    V + "mlp.gate_proj.weight": (OV + "mlp.linear_fc1.weight", "gate"),
    V + "mlp.up_proj.weight": (OV + "mlp.linear_fc1.weight", "up"),
    V + "mlp.gate_proj.bias": (OV + "mlp.linear_fc1.bias", "gate"),
    V + "mlp.up_proj.bias": (OV + "mlp.linear_fc1.bias", "up"),
    V + "mlp.down_proj.weight": (OV + "mlp.linear_fc2.weight", None),
    V + "mlp.down_proj.bias": (OV + "mlp.linear_fc2.bias", None),
    "model.visual.merger.ln_q.weight": ("vision.merger.norm.weight", None),
    "model.visual.merger.mlp.0.weight": ("vision.merger.linear_fc1.weight", None),
    "model.visual.merger.mlp.0.bias": ("vision.merger.linear_fc1.bias", None),
    "model.visual.merger.mlp.2.weight": ("vision.merger.linear_fc2.weight", None),
    "model.visual.merger.mlp.2.bias": ("vision.merger.linear_fc2.bias", None),
}
_MERGER3 = [f"{a}.{b}" for a in ("norm", "linear_fc1", "linear_fc2") for b in ("weight", "bias")]
QWEN3_VL = {
    **COMMON,
    L + "self_attn.q_norm.weight": (OL + "self_attention.q_layernorm.weight", None),
    L + "self_attn.k_norm.weight": (OL + "self_attention.k_layernorm.weight", None),
    "model.visual.patch_embed.proj.bias": ("vision.patch_embed.bias", None),
    "model.visual.pos_embed.weight": ("vision.pos_embed.weight", None),
    V + "norm1.bias": (OV + "input_layernorm.bias", None),
    V + "norm2.bias": (OV + "pre_mlp_layernorm.bias", None),
    V + "mlp.linear_fc1.weight": (OV + "mlp.linear_fc1.weight", None),
    V + "mlp.linear_fc1.bias": (OV + "mlp.linear_fc1.bias", None),
    V + "mlp.linear_fc2.weight": (OV + "mlp.linear_fc2.weight", None),
    V + "mlp.linear_fc2.bias": (OV + "mlp.linear_fc2.bias", None),
    **{f"model.visual.merger.{k}": (f"vision.merger.{k}", None) for k in _MERGER3},
    **{f"model.visual.deepstack_merger_list.{{j}}.{k}":
       (f"vision.deepstack_mergers.{{j}}.{k}", None)
       for k in _MERGER3},
}
#: a Qwen3-VL MoE layer's MLP: router + experts one by one ({e}); replaces the dense MLP rows
MOE_LAYER = {
    L + "mlp.gate.weight": (OL + "mlp.router.weight", None),
    L + "mlp.experts.{e}.gate_proj.weight":
        (OL + "mlp.experts.local_experts.{e}.linear_fc1.weight", "gate"),
    L + "mlp.experts.{e}.up_proj.weight":
        (OL + "mlp.experts.local_experts.{e}.linear_fc1.weight", "up"),
    L + "mlp.experts.{e}.down_proj.weight":
        (OL + "mlp.experts.local_experts.{e}.linear_fc2.weight", None),
}
DENSE_MLP = tuple(L + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
TABLES = {"qwen2_5_vl": QWEN2_5_VL, "qwen3_vl": QWEN3_VL, "qwen3_vl_moe": QWEN3_VL,
          "cosmos3_omni": QWEN3_VL}
#: Cosmos3-Omni's published names -> transformers' Qwen3-VL ones (prefix, then attention names;
#: ``to_hub_hf_key`` writes them back)
COSMOS3_PREFIXES = (("model.language_model.", ("layers.", "embed_tokens.", "norm.")),
                    ("model.visual.", ("blocks.", "merger.", "patch_embed.", "pos_embed.",
                                       "deepstack_merger_list.")))
COSMOS3_ATTENTION = {"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "o_proj",
                     "norm_q": "q_norm", "norm_k": "k_norm"}
#: what of the unified Cosmos3 checkpoint the reasoner does not use, per tower (key patterns)
COSMOS3_UNUSED = {
    "generator": re.compile(r"\.(add_[qkv]_proj|to_add_out|norm_added_[qk])\.|moe_gen"
                            r"|^(proj_in|proj_out|time_embedder)\."),
    "sound": re.compile(r"^audio_(proj_in\.|proj_out\.|modality_embed$)"),
    "action": re.compile(r"^action_(proj_in\.|proj_out\.|modality_embed$)"),
}
#: Qwen2.5-VL checkpoints on the hub use the legacy prefixes (transformers < 4.52 layout).
LEGACY_PREFIXES = {
    "qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
}


def expand_table(cfg: QwenVLModelConfig) -> dict[str, tuple[str, str | None]]:
    """The table with {i}/{j} filled in for this model's layer counts (tied lm_head dropped)."""
    out = {}
    moe = cfg.lm.moe_layers
    rows = dict(TABLES[cfg.family])
    if any(moe):
        rows.update(MOE_LAYER)
    for hf, (ours, part) in rows.items():
        if hf == "lm_head.weight" and cfg.lm.tie_embeddings:
            continue
        if "{j}" in hf:
            reps = [{"j": j} for j in range(len(cfg.vision.deepstack_visual_indexes))]
        elif hf in MOE_LAYER:
            reps = [{"i": i, "e": e} for i in range(cfg.lm.num_layers) if moe[i]
                    for e in range(cfg.lm.num_experts)]
        elif hf in DENSE_MLP:
            reps = [{"i": i} for i in range(cfg.lm.num_layers) if not moe[i]]
        elif hf.startswith("model.language_model.layers"):
            reps = [{"i": i} for i in range(cfg.lm.num_layers)]
        elif hf.startswith("model.visual.blocks"):
            reps = [{"i": i} for i in range(cfg.vision.depth)]
        else:
            reps = [{}]
        for r in reps:
            out[hf.format(**r)] = (ours.format(**r), part)
    return out


def to_canonical_hf_key(key: str, family: str) -> str:
    if family == "cosmos3_omni":
        return _cosmos3_canonical(key)
    for new, old in LEGACY_PREFIXES.get(family, ()):
        if key.startswith(old) and not key.startswith(new):
            return new + key[len(old):]
    return key


def to_hub_hf_key(key: str, family: str) -> str:
    if family == "cosmos3_omni":
        return _cosmos3_hub(key)
    for new, old in LEGACY_PREFIXES.get(family, ()):
        if key.startswith(new):
            return old + key[len(new):]
    return key


def _cosmos3_canonical(key: str) -> str:
    for nested, flat in COSMOS3_PREFIXES:
        if key.startswith(flat):
            key = nested + key
            break
    parts = key.split(".")
    if len(parts) > 2 and parts[-3] == "self_attn":
        parts[-2] = COSMOS3_ATTENTION.get(parts[-2], parts[-2])
    return ".".join(parts)


def _cosmos3_hub(key: str) -> str:
    for nested, _flat in COSMOS3_PREFIXES:
        if key.startswith(nested):
            key = key[len(nested):]
            break
    parts = key.split(".")
    if len(parts) > 2 and parts[-3] == "self_attn":
        parts[-2] = {q: c for c, q in COSMOS3_ATTENTION.items()}.get(parts[-2], parts[-2])
    return ".".join(parts)


def unused_keys(keys, cfg: QwenVLModelConfig) -> dict[str, list[str]]:
    """Tower -> the keys of ``keys`` that belong to a part of the checkpoint this family's model
    is not (Cosmos3-Omni's generator, sound and action towers); empty for the other families."""
    if cfg.family != "cosmos3_omni":
        return {}
    found = {tower: sorted(k for k in keys if pattern.search(k))
             for tower, pattern in COSMOS3_UNUSED.items()}
    return {tower: found_keys for tower, found_keys in found.items() if found_keys}


# ------------------------------------------------------------------ conversions
def hf_to_ours(hf_sd: dict[str, torch.Tensor], cfg: QwenVLModelConfig,
               expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Map an HF state dict to our (TP=1) keys; ``expected`` = our key -> shape.

    Raises:
        ValueError: see ``models.hf.weights.hf_to_ours``.
    """
    return hf_weights.hf_to_ours(split_fused_experts(hf_sd, cfg), cfg, expected,
                                 expand_table(cfg), _canonical(cfg))


def hf_to_ours_stage(hf_sd: dict[str, torch.Tensor], cfg: QwenVLModelConfig,
                     expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """``hf_to_ours`` for one pipeline stage (``models.hf.weights.hf_to_ours_stage``)."""
    return hf_weights.hf_to_ours_stage(split_fused_experts(hf_sd, cfg), cfg, expected,
                                       expand_table(cfg), canonical=_canonical(cfg))


def ours_to_hf(sd: dict[str, torch.Tensor], cfg: QwenVLModelConfig,
               hub_layout: bool = True, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Map our (TP=1) state dict to HF keys (the hub's prefixes when ``hub_layout``, else the
    names of transformers' modules); ``only``: just these keys of ours."""
    hub = functools.partial(to_hub_hf_key, family=cfg.family) if hub_layout else None
    out = hf_weights.ours_to_hf(sd, cfg, expand_table(cfg), hub_key=hub, only=only)
    return out if only is not None else fuse_experts(out, cfg)  # some keys: no expert fusing


def _canonical(cfg: QwenVLModelConfig):
    return functools.partial(to_canonical_hf_key, family=cfg.family)
