"""Hugging Face <-> our weight names and layouts for Qwen2.5-VL and Qwen3-VL.

This module owns the literal mapping table (HF key template -> our key template, and which part
of a fused tensor it is), HF checkpoint reading/writing (safetensors, single or sharded), and the
two conversions of whole state dicts (``hf_to_ours``, ``ours_to_hf``; ``hf_to_ours_stage`` for
one pipeline stage). Every key and shape is
checked; the first offender is named in a one-line ``ValueError``. Our keys are the state-dict
keys of ``models.qwen_vl.QwenVL`` built with the local (non-TE) spec at TP=1; megatron's
``sharded_state_dict`` maps them to the TE names inside distributed checkpoints.

Fused tensors (part column): q/k/v -> ``linear_qkv`` in megatron's grouped layout (per KV group:
its queries, then k, then v); the ViT's fused ``qkv`` (3, heads, d) -> (heads, 3, d); gate/up ->
``linear_fc1`` = [gate; up]; the Conv3d patch kernel (out, C, T, P, P) -> Linear (out, C*T*P*P).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from models.qwen_vl_config import QwenVLModelConfig

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
TABLES = {"qwen2_5_vl": QWEN2_5_VL, "qwen3_vl": QWEN3_VL}
#: Qwen2.5-VL checkpoints on the hub use the legacy prefixes (transformers < 4.52 layout).
LEGACY_PREFIXES = {
    "qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
}


def expand_table(cfg: QwenVLModelConfig) -> dict[str, tuple[str, str | None]]:
    """The table with {i}/{j} filled in for this model's layer counts (tied lm_head dropped)."""
    out = {}
    for hf, (ours, part) in TABLES[cfg.family].items():
        if hf == "lm_head.weight" and cfg.lm.tie_embeddings:
            continue
        if "{j}" in hf:
            reps = [{"j": j} for j in range(len(cfg.vision.deepstack_visual_indexes))]
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
    for new, old in LEGACY_PREFIXES.get(family, ()):
        if key.startswith(old) and not key.startswith(new):
            return new + key[len(old):]
    return key


def to_hub_hf_key(key: str, family: str) -> str:
    for new, old in LEGACY_PREFIXES.get(family, ()):
        if key.startswith(new):
            return old + key[len(new):]
    return key


# ------------------------------------------------------------------ fused layouts
def _fuse(cfg: QwenVLModelConfig, part_kind: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    if part_kind in ("q", "k", "v"):
        t = cfg.lm
        groups, per = t.num_kv_heads, t.num_heads // t.num_kv_heads
        q, k, v = parts["q"], parts["k"], parts["v"]
        tail = q.shape[1:]
        q = q.reshape(groups, per * t.head_dim, *tail)
        k, v = k.reshape(groups, t.head_dim, *tail), v.reshape(groups, t.head_dim, *tail)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tail)
    if part_kind in ("gate", "up"):
        return torch.cat([parts["gate"], parts["up"]], dim=0)
    x = parts[part_kind]
    if part_kind == "vit_qkv":
        heads = cfg.vision.num_heads
        return x.reshape(3, heads, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)
    if part_kind == "patch":
        return x.reshape(x.shape[0], -1)
    return x


def _split(cfg: QwenVLModelConfig, part: str, x: torch.Tensor, hf_shape) -> torch.Tensor:
    if part in ("q", "k", "v"):
        t = cfg.lm
        per = t.num_heads // t.num_kv_heads
        tail = x.shape[1:]
        g = x.reshape(t.num_kv_heads, (per + 2) * t.head_dim, *tail)
        q, k, v = g.split([per * t.head_dim, t.head_dim, t.head_dim], dim=1)
        return {"q": q, "k": k, "v": v}[part].reshape(-1, *tail)
    if part in ("gate", "up"):
        return x.chunk(2, dim=0)[0 if part == "gate" else 1]
    if part == "vit_qkv":
        heads = cfg.vision.num_heads
        return x.reshape(heads, 3, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)
    if part == "patch":
        return x.reshape(hf_shape)
    return x


def hf_to_ours(hf_sd: dict[str, torch.Tensor], cfg: QwenVLModelConfig,
               expected: dict[str, torch.Size],
               table: dict[str, tuple[str, str | None]] | None = None) -> dict[str, torch.Tensor]:
    """Map an HF state dict to our (TP=1) keys; ``expected`` = our key -> shape.

    ``table`` (default: this family's ``expand_table(cfg)``) lets other families
    (models/nemotron_hf_mapping.py) reuse the checks and the fused layouts.

    Raises:
        ValueError: an HF key not in the table, a table key missing, or a shape mismatch
            (the first offender is named).
    """
    table = expand_table(cfg) if table is None else table
    hf_sd = {to_canonical_hf_key(k, cfg.family): v for k, v in hf_sd.items()}
    if cfg.lm.tie_embeddings:
        hf_sd.pop("lm_head.weight", None)
    for key in hf_sd:
        if key not in table:
            raise ValueError(f"HF key {key!r} has no entry in the {cfg.family} mapping table")
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    kinds: dict[str, str | None] = {}
    for hf_key, (ours, part) in table.items():
        if hf_key not in hf_sd:
            raise ValueError(f"HF checkpoint lacks {hf_key!r} (needed for {ours!r})")
        grouped.setdefault(ours, {})[part or "x"] = hf_sd[hf_key]
        kinds[ours] = part or "x"
    out = {}
    for ours, parts in grouped.items():
        if ours not in expected:
            raise ValueError(f"our model has no parameter {ours!r}")
        tensor = _fuse(cfg, kinds[ours], parts)
        if tuple(tensor.shape) != tuple(expected[ours]):
            raise ValueError(f"{ours!r}: HF weights give shape {tuple(tensor.shape)}, model "
                             f"expects {tuple(expected[ours])}")
        out[ours] = tensor.contiguous()
    missing = [k for k in expected if k not in out]
    if missing:
        raise ValueError(f"no HF weight maps to our parameter {missing[0]!r}")
    return out


def hf_to_ours_stage(hf_sd: dict[str, torch.Tensor], cfg: QwenVLModelConfig,
                     expected: dict[str, torch.Size],
                     table: dict[str, tuple[str, str | None]] | None = None,
                     embed_key: str = "model.language_model.embed_tokens.weight",
                     lm_head_key: str = "lm_head.weight") -> dict[str, torch.Tensor]:
    """``hf_to_ours`` for one pipeline stage: ``expected`` = this stage's parameters under their
    PP=1 keys (``models.checkpoint.global_layer_keys``) -> shape; HF weights of other stages are
    skipped (each is still checked against the full table).

    With tied embeddings a last stage without the embedding holds its own copy of the output
    weight (megatron keeps it equal to the first stage's): it is filled from ``embed_key``.
    ``table`` / ``embed_key`` / ``lm_head_key``: another family's full table and HF names of the
    token embedding and the output layer (default: this module's Qwen-VL ones).

    Raises:
        ValueError: as ``hf_to_ours``.
    """
    full = expand_table(cfg) if table is None else table
    for key in hf_sd:
        canonical = to_canonical_hf_key(key, cfg.family)
        if canonical not in full and not (canonical == lm_head_key and cfg.lm.tie_embeddings):
            raise ValueError(f"HF key {key!r} has no entry in the {cfg.family} mapping table")
    table = dict(full)
    output, embedding = "language_model.output_layer.weight", \
        "language_model.embedding.word_embeddings.weight"
    if cfg.lm.tie_embeddings and output in expected and embedding not in expected:
        table[embed_key] = (output, None)
    table = {hf: row for hf, row in table.items() if row[0] in expected}
    stage_sd = {k: v for k, v in hf_sd.items() if to_canonical_hf_key(k, cfg.family) in table}
    return hf_to_ours(stage_sd, cfg, expected, table=table)


def ours_to_hf(sd: dict[str, torch.Tensor], cfg: QwenVLModelConfig, hub_layout: bool = True,
               hf_shapes: dict[str, tuple] | None = None,
               table: dict[str, tuple[str, str | None]] | None = None) -> dict[str, torch.Tensor]:
    """Map our (TP=1) state dict to HF keys (hub prefixes when ``hub_layout``)."""
    v = cfg.vision
    patch_shape = (v.hidden_size, v.in_channels, getattr(v, "temporal_patch_size", 1),
                   v.patch_size, v.patch_size)
    out = {}
    for hf_key, (ours, part) in (expand_table(cfg) if table is None else table).items():
        if ours not in sd:
            raise ValueError(f"checkpoint lacks {ours!r} (needed for {hf_key!r})")
        shape = (hf_shapes or {}).get(hf_key, patch_shape)
        tensor = _split(cfg, part, sd[ours], shape) if part else sd[ours]
        out[to_hub_hf_key(hf_key, cfg.family) if hub_layout else hf_key] = tensor.contiguous()
    return out


# ------------------------------------------------------------------ HF folders
def read_hf_folder(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, state dict) of a local HF model folder (safetensors)."""
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type
            raise ValueError(f"{f}: unreadable safetensors file ({exc})") from None
    return config, sd


def write_hf_folder(path: Path, config: dict, sd: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def is_our_key(key: str) -> bool:
    """Parameters of our state dict that carry weights (not TE/megatron extra state)."""
    return not key.endswith("_extra_state") and not re.search(r"\.inv_freq$", key)
