"""Hugging Face <-> our weight names for Nemotron-Omni (``nemotron_h_omni`` checkpoints).

This module owns the literal name table of the published checkpoint layout (the keys on disk,
which transformers renames on load: ``language_model.backbone.*``, ``mlp1.*``,
``vision_model.radio_model.*``) and the family's import/export rules; the checks, the fused
layouts (q/k/v grouping, ViT fused qkv) and safetensors I/O are the shared machinery of
``models.hf.weights``. Our keys are the state-dict keys of ``NemotronOmni`` (this package's
``model``) built with the local (non-TE) spec at TP=1.

LM layers are mapped by the symbol of the layer in ``lm.pattern``: the block's ``norm`` goes to
the norm in front of its one mixer. ``M`` (Mamba2) and ``E`` (MoE) names follow transformers'
modeling code (``NemotronHMamba2Mixer``, ``NemotronHMoE`` with per-expert hub keys) and megatron's
``MambaMixer`` / ``MoELayer`` (parity-tested on CPU, Mamba on models/kernels/mamba.py). Mamba
tensors keep their layout (in_proj z|x|B|C|dt, conv1d x|B|C); their tensor-parallel slices come
from megatron's ``partition_sizes`` (``models.checkpointing.sharding.shard_for_rank``). megatron >=
0.19 names the conv ``mixer.conv1d_weight`` / ``conv1d_bias`` (0.16.1: an ``nn.Conv1d``,
``mixer.conv1d.*``): the table's targets follow the model's keys (``_as_model_names``).

A PEFT folder names transformers' modules, which its checkpoint conversion renames on load
(``language_model.model.*``, ``vision_model.encoder.layer.*`` with RADIO's q/k/v split,
``multi_modal_projector.*``): ``ours_to_hf(hub_layout=False)`` gives those names
(``module_names``).

Import-only rules: RADIO's input conditioner buffers and ``summary_idxs`` and audio
(``sound_*``) weights are not part of our model and are skipped; a checkpoint without LayerScale
vectors gets ``layerscale_value`` (HF does the same). Export writes ``summary_idxs`` from the
config. The multi-token-prediction layers (``language_model.mtp.*``): ``CARRIED_PREFIXES``
names them, and the import records them for the export, which writes them back byte for byte
(the one mechanism of every family: ``models.checkpointing.checkpoint.carried_record``) unless
the model holds them (``model.train_mtp``: ``MTP_FIRST`` / ``MTP_LAST`` and the decoder's layer
rows map them onto ``models.layers.mtp``'s head, exported with the trained values).

LatentMoE (``moe_latent_size``): ``mixer.fc1_latent_proj`` / ``fc2_latent_proj`` map to the MoE
layer's projections of the same names (megatron's; ``models/layers/latent_moe.py`` without TE),
whole on every tensor-parallel rank (megatron's duplicated linears: no TP attribute, so
``models.checkpointing.sharding.shard_for_rank`` never slices them).
"""

from __future__ import annotations

import re

import torch

from models.families.nemotron_omni.config import NemotronOmniModelConfig
from models.hf import weights as hf_weights

LM, OL = "language_model.backbone.layers.{i}.", "language_model.decoder.layers.{i}."
VB, OV = "vision_model.radio_model.model.blocks.{i}.", "vision.layers.{i}."
PG = "vision_model.radio_model.model.patch_generator."

EMBED, LM_HEAD = "language_model.backbone.embeddings.weight", "language_model.lm_head.weight"

#: HF key template -> (our key template, part of a fused tensor or None). {i} layer.
COMMON = {
    EMBED: ("language_model.embedding.word_embeddings.weight", None),
    "language_model.backbone.norm_f.weight": ("language_model.decoder.final_norm.weight", None),
    LM_HEAD: ("language_model.output_layer.weight", None),
    PG + "embedder.weight": ("vision.embeddings.patch_projection.weight", None),
    PG + "video_embedder.weight": ("vision.embeddings.video_patch_projection.weight", None),
    PG + "pos_embed": ("vision.embeddings.position_embedding", None),
    PG + "cls_token.token": ("vision.embeddings.cls_register_token", None),
    "mlp1.0.weight": ("vision.projector.layer_norm.weight", None),
    "mlp1.1.weight": ("vision.projector.linear_1.weight", None),
    "mlp1.3.weight": ("vision.projector.linear_2.weight", None),
}
FINAL_NORM = {f"vision_projector.vision_final_layernorm.{k}": (f"vision.final_norm.{k}", None)
              for k in ("weight", "bias")}
VISION_BLOCK = {
    VB + "norm1.weight": (OV + "input_layernorm.weight", None),
    VB + "norm1.bias": (OV + "input_layernorm.bias", None),
    VB + "attn.qkv.weight": (OV + "self_attention.linear_qkv.weight", "vit_qkv"),
    VB + "attn.qkv.bias": (OV + "self_attention.linear_qkv.bias", "vit_qkv"),
    VB + "attn.proj.weight": (OV + "self_attention.linear_proj.weight", None),
    VB + "attn.proj.bias": (OV + "self_attention.linear_proj.bias", None),
    VB + "layer_scale1.lambda1": (OV + "self_attention.linear_proj.layer_scale", None),
    VB + "norm2.weight": (OV + "pre_mlp_layernorm.weight", None),
    VB + "norm2.bias": (OV + "pre_mlp_layernorm.bias", None),
    VB + "layer_scale2.lambda1": (OV + "mlp.linear_fc2.layer_scale", None),
}
VISION_MLP = {
    "gelu": {VB + f"mlp.fc{n}.{k}": (OV + f"mlp.linear_fc{n}.{k}", None)
             for n in (1, 2) for k in ("weight", "bias")},
    "swiglu": {**{VB + f"mlp.{p}_proj.{k}": (OV + f"mlp.linear_fc1.{k}", p)
                  for p in ("gate", "up") for k in ("weight", "bias")},
               **{VB + f"mlp.down_proj.{k}": (OV + f"mlp.linear_fc2.{k}", None)
                  for k in ("weight", "bias")}},
}
#: per LM layer symbol: the block norm and the mixer ({e}: routed expert)
LM_LAYER = {
    "*": {LM + "norm.weight": (OL + "input_layernorm.weight", None),
          **{LM + f"mixer.{p}_proj.weight": (OL + "self_attention.linear_qkv.weight", p)
             for p in ("q", "k", "v")},
          LM + "mixer.o_proj.weight": (OL + "self_attention.linear_proj.weight", None)},
    "-": {LM + "norm.weight": (OL + "pre_mlp_layernorm.weight", None),
          LM + "mixer.up_proj.weight": (OL + "mlp.linear_fc1.weight", None),
          LM + "mixer.down_proj.weight": (OL + "mlp.linear_fc2.weight", None)},
    "M": {LM + "norm.weight": (OL + "norm.weight", None),
          **{LM + f"mixer.{n}": (OL + f"mixer.{n}", None)
             for n in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                       "norm.weight", "out_proj.weight")}},
    "E": {LM + "norm.weight": (OL + "pre_mlp_layernorm.weight", None),
          LM + "mixer.gate.weight": (OL + "mlp.router.weight", None),
          LM + "mixer.gate.e_score_correction_bias": (OL + "mlp.router.expert_bias", None),
          LM + "mixer.experts.{e}.up_proj.weight":
              (OL + "mlp.experts.local_experts.{e}.linear_fc1.weight", None),
          LM + "mixer.experts.{e}.down_proj.weight":
              (OL + "mlp.experts.local_experts.{e}.linear_fc2.weight", None),
          LM + "mixer.shared_experts.up_proj.weight":
              (OL + "mlp.shared_experts.linear_fc1.weight", None),
          LM + "mixer.shared_experts.down_proj.weight":
              (OL + "mlp.shared_experts.linear_fc2.weight", None)},
}
LATENT = {LM + f"mixer.fc{n}_latent_proj.weight": (OL + f"mlp.fc{n}_latent_proj.weight", None)
          for n in (1, 2)}
#: HF weights our model does not hold, carried from the import into every export unchanged:
#: the multi-token-prediction layers (``language_model.mtp.layers.{i}.*`` in the published
#: ``nemotron_h_omni`` checkpoints; a text checkpoint's top-level ``mtp.*`` too), unless
#: ``model.train_mtp`` builds them (``MTP``)
CARRIED_PREFIXES = ("language_model.mtp.", "mtp.")
#: the MTP block (``model.train_mtp``, one depth): its inner layers ({i}, by ``lm.mtp_pattern``)
#: as the decoder's layers of the same symbol (``LM_LAYER``, ``LATENT``) under ``mtp.layers.{i}.``
#: (``models.layers.mtp.MTPHead``); the first also holds ``enorm`` / ``hnorm`` / ``eh_proj``,
#: the last ``final_layernorm`` (the head's names for them: Qwen's)
ML, OM = "language_model.mtp.layers.{i}.", "mtp.layers.{i}."
MTP_FIRST = {ML + "enorm.weight": ("mtp.pre_fc_norm_embedding.weight", None),
             ML + "hnorm.weight": ("mtp.pre_fc_norm_hidden.weight", None),
             ML + "eh_proj.weight": ("mtp.fc.weight", None)}
MTP_LAST = {ML + "final_layernorm.weight": ("mtp.norm.weight", None)}
#: HF keys that are not part of our model and not exported (skipped on import)
IGNORED = re.compile(r"^(sound_encoder\.|sound_projection\.|language_model\.backbone\.mtp"
                     r"|vision_model\.radio_model\.(input_conditioner\.|summary_idxs$))")
SUMMARY_IDXS = "vision_model.radio_model.summary_idxs"
#: the published (on-disk) names -> the names of transformers' modules, as its checkpoint
#: conversion renames them on load (``NemotronH_Omni_Reasoning_V3``, ``nemotron_h``, ``radio``):
#: what a PEFT folder's ``target_modules`` and keys name (``ours_to_hf(hub_layout=False)``)
MODULE_NAMES = (
    (r"^language_model\.backbone\.", "language_model.model."),
    (r"^vision_model\.radio_model\.model\.blocks\.", "vision_model.encoder.layer."),
    (r"\.attn\.proj\.", ".attention.o_proj."),
    (r"^vision_model\.radio_model\.model\.patch_generator\.video_embedder\.",
     "vision_model.embeddings.video_patch_projection."),
    (r"^vision_model\.radio_model\.model\.patch_generator\.embedder\.",
     "vision_model.embeddings.patch_projection."),
    (r"^vision_model\.radio_model\.model\.patch_generator\.pos_embed$",
     "vision_model.embeddings.position_embedding"),
    (r"^vision_model\.radio_model\.model\.patch_generator\.cls_token\.token$",
     "vision_model.embeddings.cls_register_token"),
    (r"^mlp1\.0\.", "multi_modal_projector.layer_norm."),
    (r"^mlp1\.1\.", "multi_modal_projector.linear_1."),
    (r"^mlp1\.3\.", "multi_modal_projector.linear_2."),
    (r"^vision_projector\.vision_final_layernorm\.", "vision_final_layernorm."),
)
#: RADIO's fused q/k/v on disk; transformers' modules are its three thirds (rows q, k, v)
FUSED_QKV = re.compile(r"\.attn\.qkv\.(weight|bias)$")
LAYER_SCALE = re.compile(r"\.layer_scale[12]\.lambda1$")


def expand_table(cfg: NemotronOmniModelConfig) -> dict[str, tuple[str, str | None]]:
    """The table with {i}/{e} filled in for this model (tied lm_head dropped)."""
    out: dict[str, tuple[str, str | None]] = {}

    def add(table: dict, **fill):
        for hf, (ours, part) in table.items():
            out[hf.format(**fill)] = (ours.format(**fill), part)

    add({k: v for k, v in COMMON.items()
         if not (k == LM_HEAD and cfg.lm.tie_embeddings)})
    if cfg.vision_final_norm:
        add(FINAL_NORM)
    for i in range(cfg.vision.depth):
        add({**VISION_BLOCK, **VISION_MLP[cfg.vision.mlp]}, i=i)
    for i, symbol in enumerate(cfg.lm.pattern):
        for e in range(cfg.lm.num_experts) if symbol == "E" else [0]:
            add(_layer_rows(cfg, symbol), i=i, e=e)
    if cfg.train_mtp:
        block = cfg.lm.mtp_pattern
        for j, symbol in enumerate(block):
            rows = {hf.replace(LM, ML): (ours.replace(OL, OM), part)
                    for hf, (ours, part) in _layer_rows(cfg, symbol).items()}
            rows.update({**(MTP_FIRST if j == 0 else {}),
                         **(MTP_LAST if j == len(block) - 1 else {})})
            for e in range(cfg.lm.num_experts) if symbol == "E" else [0]:
                add(rows, i=j, e=e)
    return out


def _layer_rows(cfg: NemotronOmniModelConfig, symbol: str) -> dict:
    """One LM layer's rows (``LM`` / ``OL`` keys) for its symbol (LatentMoE's projections)."""
    if symbol == "E" and cfg.lm.moe_latent_size is not None:
        return {**LM_LAYER[symbol], **LATENT}
    return LM_LAYER[symbol]


def _as_model_names(table: dict[str, tuple[str, str | None]],
                    model_keys) -> dict[str, tuple[str, str | None]]:
    """``table`` with the Mamba conv targets renamed when the model names them as parameters
    (megatron >= 0.19: ``mixer.conv1d_weight`` / ``mixer.conv1d_bias``)."""
    if not any(k.endswith("mixer.conv1d_weight") for k in model_keys):
        return table
    return {hf: (ours.replace(".mixer.conv1d.", ".mixer.conv1d_"), part)
            for hf, (ours, part) in table.items()}


def _import_view(hf_sd: dict[str, torch.Tensor], cfg: NemotronOmniModelConfig,
                 table: dict[str, tuple[str, str | None]]) -> dict[str, torch.Tensor]:
    """The HF weights as the table reads them: ignored keys and a tied lm_head dropped, missing
    LayerScale vectors filled (see module docstring)."""
    built = ML.split("{")[0] if cfg.train_mtp else None  # the MTP block's, when the model has it
    hf_sd = {k: v for k, v in hf_sd.items() if not IGNORED.match(k)
             and (not k.startswith(CARRIED_PREFIXES) or built and k.startswith(built))}
    if cfg.lm.tie_embeddings:
        hf_sd.pop(LM_HEAD, None)
    for key in table:
        if LAYER_SCALE.search(key) and key not in hf_sd:  # C-RADIO checkpoints have none
            hf_sd[key] = torch.full((cfg.vision.hidden_size,), cfg.vision.layerscale_value)
    return hf_sd


def hf_to_ours(hf_sd: dict[str, torch.Tensor], cfg: NemotronOmniModelConfig,
               expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Map an HF ``nemotron_h_omni`` state dict to our (TP=1) keys (see module docstring).

    Raises:
        ValueError: an HF key not in the table, a table key missing, or a shape mismatch
            (the first offender is named).
    """
    table = _as_model_names(expand_table(cfg), expected)
    return hf_weights.hf_to_ours(_import_view(hf_sd, cfg, table), cfg, expected, table)


def hf_to_ours_stage(hf_sd: dict[str, torch.Tensor], cfg: NemotronOmniModelConfig,
                     expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """``hf_to_ours`` for one pipeline stage (``models.hf.weights.hf_to_ours_stage``: this
    stage's parameters under their PP=1 keys; a tied last stage's output from the embedding).

    Raises:
        ValueError: as ``hf_to_ours``.
    """
    table = _as_model_names(expand_table(cfg), expected)
    return hf_weights.hf_to_ours_stage(_import_view(hf_sd, cfg, table), cfg, expected,
                                       table, embed_key=EMBED, lm_head_key=LM_HEAD)


def ours_to_hf(sd: dict[str, torch.Tensor], cfg: NemotronOmniModelConfig,
               hub_layout: bool = True, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Map our (TP=1) state dict to the published HF key layout (+ ``summary_idxs``), or with
    ``hub_layout`` false to the names of transformers' modules (``module_names``: a PEFT
    folder's); ``only``: just these keys of ours (no ``summary_idxs``)."""
    out = hf_weights.ours_to_hf(sd, cfg, _as_model_names(expand_table(cfg), sd), only=only)
    if not hub_layout:
        return module_names(out)
    if only is None:
        out[SUMMARY_IDXS] = torch.tensor(cfg.vision.summary_idxs, dtype=torch.long)
    return out


def module_names(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Published HF keys -> the keys of transformers' modules (``MODULE_NAMES``; RADIO's fused
    ``attn.qkv`` as ``attention.q_proj`` / ``k_proj`` / ``v_proj``, its rows in thirds)."""
    out = {}
    for key, value in hf_sd.items():
        for pattern, name in MODULE_NAMES:
            key = re.sub(pattern, name, key)
        fused = FUSED_QKV.search(key)
        if fused is None:
            out[key] = value
            continue
        for part, third in zip("qkv", value.chunk(3, dim=0), strict=True):
            out[f"{key[:fused.start()]}.attention.{part}_proj.{fused.group(1)}"] = third
    return out
