"""Hugging Face <-> our weight names for Qwen3.5 and Qwen3.5 MoE: the literal mapping tables.

This module owns the tables (HF key template -> our key template, and the part of a fused tensor:
``models.hf.weights``), the split of the Gated DeltaNet's fused HF tensors into our per-component
ones (``in_proj_qkv`` -> ``in_proj_q / _k / _v``, ``conv1d`` (channels, 1, w) -> ``conv_q / _k /
_v`` (channels, w); ``split_linear_attention`` / ``fuse_linear_attention``; their LoRA
adapters as one PEFT adapter of ``in_proj_qkv``: ``fuse_adapters``), the experts of the
MoE family (published and written one by one, ``mlp.experts.{e}.gate_proj / up_proj /
down_proj``, as transformers' ``save_pretrained`` writes them too; a checkpoint with
transformers' in-memory fused 3-D tensors is read as well: ``models.hf.weights``), and the
family's three conversions. Our keys are those of ``Qwen35`` (this package's ``model``) with the
local spec at TP=1.

Gated attention: HF's ``q_proj`` holds per head [query; gate] (2 x heads x head_dim rows); it
fuses with k / v into megatron's ``linear_qkv`` (part ``qg``). Norm weights are copied as they
are (zero-centred on both sides). The multi-token-prediction weights of the published
checkpoints (``mtp.*``): ``CARRIED_PREFIXES`` names them, and the import records them for the
export (``models.checkpointing.checkpoint.carried_record``), which writes them back unchanged
unless the model holds them (``model.train_mtp``: ``MTP`` maps them onto
``models.layers.mtp``'s head, packed MTP experts split on import and packed again on
export in the source's layout).
"""

from __future__ import annotations

import torch

from models.families.qwen3_5.config import Qwen35ModelConfig
from models.hf import weights as hf_weights

#: HF weights our model does not hold, carried from the import into every export unchanged
CARRIED_PREFIXES = ("mtp.",)
#: the export writes the LM experts one by one (the Qwen3.5 hub layout); a source with packed
#: experts (Qwen3.6) is recorded and exported packed again
#: (``models.checkpointing.checkpoint.carried_record``)
EXPERTS_ONE_BY_ONE = True
L, V = "model.language_model.layers.{i}.", "model.visual.blocks.{i}."
OL, OV = "language_model.decoder.layers.{i}.", "vision.layers.{i}."
A, OA = L + "linear_attn.", OL + "self_attention."

COMMON = {
    "model.language_model.embed_tokens.weight":
        ("language_model.embedding.word_embeddings.weight", None),
    "model.language_model.norm.weight": ("language_model.decoder.final_layernorm.weight", None),
    "lm_head.weight": ("language_model.output_layer.weight", None),
    L + "input_layernorm.weight": (OL + "input_layernorm.weight", None),
    L + "post_attention_layernorm.weight": (OL + "pre_mlp_layernorm.weight", None),
    "model.visual.patch_embed.proj.weight": ("vision.patch_embed.weight", "patch"),
    "model.visual.patch_embed.proj.bias": ("vision.patch_embed.bias", None),
    "model.visual.pos_embed.weight": ("vision.pos_embed.weight", None),
    V + "attn.qkv.weight": (OV + "self_attention.linear_qkv.weight", "vit_qkv"),
    V + "attn.qkv.bias": (OV + "self_attention.linear_qkv.bias", "vit_qkv"),
    V + "attn.proj.weight": (OV + "self_attention.linear_proj.weight", None),
    V + "attn.proj.bias": (OV + "self_attention.linear_proj.bias", None),
    **{V + f"norm{n}.{p}": (OV + f"{ours}.{p}", None)
       for n, ours in ((1, "input_layernorm"), (2, "pre_mlp_layernorm"))
       for p in ("weight", "bias")},
    **{V + f"mlp.{fc}.{p}": (OV + f"mlp.{fc}.{p}", None)
       for fc in ("linear_fc1", "linear_fc2") for p in ("weight", "bias")},
    **{f"model.visual.merger.{m}.{p}": (f"vision.merger.{m}.{p}", None)
       for m in ("norm", "linear_fc1", "linear_fc2") for p in ("weight", "bias")},
}
#: a gated full-attention layer's mixer
FULL_ATTENTION = {
    L + "self_attn.q_proj.weight": (OL + "self_attention.linear_qkv.weight", "qg"),
    L + "self_attn.k_proj.weight": (OL + "self_attention.linear_qkv.weight", "k"),
    L + "self_attn.v_proj.weight": (OL + "self_attention.linear_qkv.weight", "v"),
    L + "self_attn.o_proj.weight": (OL + "self_attention.linear_proj.weight", None),
    L + "self_attn.q_norm.weight": (OL + "self_attention.q_layernorm.weight", None),
    L + "self_attn.k_norm.weight": (OL + "self_attention.k_layernorm.weight", None),
}
#: a Gated DeltaNet layer's mixer (in_proj_q/k/v and conv_q/k/v: split_linear_attention's keys)
LINEAR_ATTENTION = {
    **{A + f"in_proj_{n}.weight": (OA + f"in_proj_{n}.weight", None) for n in "qkvzba"},
    **{A + f"conv1d_{n}.weight": (OA + f"conv_{n}", None) for n in "qkv"},
    A + "dt_bias": (OA + "dt_bias", None),
    A + "A_log": (OA + "A_log", None),
    A + "norm.weight": (OA + "norm.weight", None),
    A + "out_proj.weight": (OA + "out_proj.weight", None),
}
DENSE_MLP = {
    L + "mlp.gate_proj.weight": (OL + "mlp.linear_fc1.weight", "gate"),
    L + "mlp.up_proj.weight": (OL + "mlp.linear_fc1.weight", "up"),
    L + "mlp.down_proj.weight": (OL + "mlp.linear_fc2.weight", None),
}
#: a Qwen3.5 MoE layer's MLP: router, the experts one by one ({e}), the gated shared expert
MOE_MLP = {
    L + "mlp.gate.weight": (OL + "mlp.router.weight", None),
    L + "mlp.experts.{e}.gate_proj.weight":
        (OL + "mlp.experts.local_experts.{e}.linear_fc1.weight", "gate"),
    L + "mlp.experts.{e}.up_proj.weight":
        (OL + "mlp.experts.local_experts.{e}.linear_fc1.weight", "up"),
    L + "mlp.experts.{e}.down_proj.weight":
        (OL + "mlp.experts.local_experts.{e}.linear_fc2.weight", None),
    L + "mlp.shared_expert.gate_proj.weight": (OL + "mlp.shared_experts.linear_fc1.weight",
                                               "gate"),
    L + "mlp.shared_expert.up_proj.weight": (OL + "mlp.shared_experts.linear_fc1.weight", "up"),
    L + "mlp.shared_expert.down_proj.weight": (OL + "mlp.shared_experts.linear_fc2.weight", None),
    L + "mlp.shared_expert_gate.weight": (OL + "mlp.shared_experts.gate_weight", None),
}


#: the MTP head (``model.train_mtp``): its own tensors, then its decoder layer ({i}) as a gated
#: full-attention layer of the model (``MTP_LAYER``: the LM tables under ``mtp.layers.{i}.``)
MTP = {f"mtp.{name}.weight": (f"mtp.{name}.weight", None)
       for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
M = "mtp.layers.{i}."


def mtp_layer_rows(rows: dict) -> dict:
    """LM layer rows (``L`` / ``OL`` keys) as the MTP layer's (``M`` on both sides)."""
    return {hf.replace(L, M): (ours.replace(OL, M), part) for hf, (ours, part) in rows.items()
            if hf.startswith(L)}


def expand_table(cfg: Qwen35ModelConfig) -> dict[str, tuple[str, str | None]]:
    """The table with {i}/{e} filled in for this model's layers (tied lm_head dropped)."""
    t = cfg.lm
    out = {}

    def add(rows: dict, reps) -> None:
        for hf, (ours, part) in rows.items():
            for r in reps:
                out[hf.format(**r)] = (ours.format(**r), part)

    common = {k: v for k, v in COMMON.items()
              if not (k == "lm_head.weight" and t.tie_embeddings)}
    add({k: v for k, v in common.items() if not k.startswith(("model.language_model.layers",
                                                              "model.visual.blocks"))}, [{}])
    add({k: v for k, v in common.items() if k.startswith("model.language_model.layers")},
        [{"i": i} for i in range(t.num_layers)])
    add({k: v for k, v in common.items() if k.startswith("model.visual.blocks")},
        [{"i": i} for i in range(cfg.vision.depth)])
    add(LINEAR_ATTENTION, [{"i": i} for i, linear in enumerate(t.linear_layers) if linear])
    add(FULL_ATTENTION, [{"i": i} for i, linear in enumerate(t.linear_layers) if not linear])
    if t.num_experts:
        add({k: v for k, v in MOE_MLP.items() if "{e}" in k},
            [{"i": i, "e": e} for i in range(t.num_layers) for e in range(t.num_experts)])
        add({k: v for k, v in MOE_MLP.items() if "{e}" not in k},
            [{"i": i} for i in range(t.num_layers)])
    else:
        add(DENSE_MLP, [{"i": i} for i in range(t.num_layers)])
    if cfg.train_mtp:
        layers = [{"i": i} for i in range(t.mtp_num_layers)]
        add(MTP, [{}])
        add(mtp_layer_rows({**COMMON, **FULL_ATTENTION,
                            **({k: v for k, v in MOE_MLP.items() if "{e}" not in k}
                               if t.num_experts else DENSE_MLP)}), layers)
        if t.num_experts:
            add(mtp_layer_rows({k: v for k, v in MOE_MLP.items() if "{e}" in k}),
                [{"i": i, "e": e} for i in range(t.mtp_num_layers)
                 for e in range(t.num_experts)])
    return out


# ------------------------------------------------------------------ the DeltaNet's fused tensors
def _widths(cfg: Qwen35ModelConfig) -> list[int]:
    t = cfg.lm
    keys = t.linear_num_key_heads * t.linear_key_head_dim
    return [keys, keys, t.linear_num_value_heads * t.linear_value_head_dim]


def split_linear_attention(hf_sd: dict[str, torch.Tensor], cfg: Qwen35ModelConfig
                           ) -> dict[str, torch.Tensor]:
    """``in_proj_qkv`` and ``conv1d.weight`` of every DeltaNet layer as the table's per-component
    keys (q | k | v rows; the conv kernel without its middle dim).

    Raises:
        ValueError: a fused tensor whose rows are not q | k | v of the config (key, shapes).
    """
    out = dict(hf_sd)
    for i, linear in enumerate(cfg.lm.linear_layers):
        prefix = A.format(i=i)
        for fused, name in (("in_proj_qkv.weight", "in_proj_{}.weight"),
                            ("conv1d.weight", "conv1d_{}.weight")):
            if prefix + fused not in out or not linear:
                continue
            x = out.pop(prefix + fused)
            if x.shape[0] != sum(_widths(cfg)):
                raise ValueError(f"{prefix + fused!r} has {x.shape[0]} rows, expected q | k | v "
                                 f"= {' + '.join(map(str, _widths(cfg)))}")
            if fused.startswith("conv1d"):
                x = x.reshape(x.shape[0], -1)
            for part, rows in zip("qkv", x.split(_widths(cfg))):
                out[prefix + name.format(part)] = rows
    return out


def fuse_linear_attention(hf_sd: dict[str, torch.Tensor], cfg: Qwen35ModelConfig
                          ) -> dict[str, torch.Tensor]:
    """The inverse of :func:`split_linear_attention` (HF's fused tensors)."""
    out = dict(hf_sd)
    for i, linear in enumerate(cfg.lm.linear_layers):
        prefix = A.format(i=i)
        if not linear or prefix + "in_proj_q.weight" not in out:
            continue
        out[prefix + "in_proj_qkv.weight"] = torch.cat(
            [out.pop(prefix + f"in_proj_{n}.weight") for n in "qkv"])
        out[prefix + "conv1d.weight"] = torch.cat(
            [out.pop(prefix + f"conv1d_{n}.weight") for n in "qkv"])[:, None, :].contiguous()
    return out


def fuse_adapters(modules: dict, cfg: Qwen35ModelConfig, sd: dict[str, torch.Tensor]) -> dict:
    """PEFT adapters (HF module -> ``models.lora.Factors``) of a DeltaNet's ``in_proj_q / _k /
    _v`` as the one adapter of HF's fused ``in_proj_qkv``: A the parts' As stacked (rank: their
    sum), B block diagonal over the q | k | v rows (zero rows for a part without an adapter); the
    same update B A x, exactly. DoRA's magnitude: the parts' joined, a part without an adapter
    given its rows' norms in ``sd`` (our state dict), which keep those rows as they are."""
    from models.lora import Factors

    out = dict(modules)
    for i, linear in enumerate(cfg.lm.linear_layers):
        prefix = A.format(i=i)
        parts = {n: out.pop(prefix + f"in_proj_{n}") for n in "qkv"
                 if linear and prefix + f"in_proj_{n}" in out}
        if not parts:
            continue
        a = torch.cat([part.a for part in parts.values()])
        b = a.new_zeros(sum(_widths(cfg)), a.shape[0])
        dora = any(part.magnitude is not None for part in parts.values())
        magnitudes, row, col = [], 0, 0
        for n, width in zip("qkv", _widths(cfg)):
            if n in parts:
                rank = parts[n].a.shape[0]
                b[row:row + width, col:col + rank] = parts[n].b
                col += rank
                magnitudes.append(parts[n].magnitude)
            elif dora:
                weight = sd[OA.format(i=i) + f"in_proj_{n}.weight"]
                magnitudes.append(weight.float().norm(dim=1).to(a.dtype))
            row += width
        out[prefix + "in_proj_qkv"] = Factors(a, b, torch.cat(magnitudes) if dora else None)
    return out


# ------------------------------------------------------------------ conversions
def _to_table_keys(hf_sd: dict[str, torch.Tensor], cfg: Qwen35ModelConfig):
    sd = {k: v for k, v in hf_sd.items()
          if cfg.train_mtp or not k.startswith(CARRIED_PREFIXES)}
    return split_linear_attention(hf_weights.split_fused_experts(sd, cfg), cfg)


def hf_to_ours(hf_sd: dict[str, torch.Tensor], cfg: Qwen35ModelConfig,
               expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Map an HF state dict to our (TP=1) keys; ``expected`` = our key -> shape.

    Raises:
        ValueError: see ``models.hf.weights.hf_to_ours``.
    """
    return hf_weights.hf_to_ours(_to_table_keys(hf_sd, cfg), cfg, expected, expand_table(cfg))


def hf_to_ours_stage(hf_sd: dict[str, torch.Tensor], cfg: Qwen35ModelConfig,
                     expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """``hf_to_ours`` for one pipeline stage (``models.hf.weights.hf_to_ours_stage``)."""
    return hf_weights.hf_to_ours_stage(_to_table_keys(hf_sd, cfg), cfg, expected,
                                       expand_table(cfg))


def ours_to_hf(sd: dict[str, torch.Tensor], cfg: Qwen35ModelConfig,
               hub_layout: bool = True, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Map our (TP=1) state dict to HF keys (the published layout: experts one by one, fused
    DeltaNet tensors); ``only``: just these keys of ours (per-component names, as in the
    table)."""
    del hub_layout  # one layout: the hub's names are transformers' module names
    out = hf_weights.ours_to_hf(sd, cfg, expand_table(cfg), only=only)
    if only is not None:
        return out
    return fuse_linear_attention(out, cfg)
