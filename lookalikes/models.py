"""Tiny random-weight models of every supported family (Qwen2.5-VL, Qwen3-VL dense and MoE,
Qwen3.5 dense and MoE, Nemotron-Omni) built with transformers (no download): the model folders
the offline journey, the parity tests, the evaluation tests and the HF journey tests start from.

``build_tiny_hf_model`` writes a hub-complete folder (config.json with the published keys,
model.safetensors, the test tokenizer with the family's special tokens and a chat template that
renders list content as the real ones do, generation_config.json, the processor files an
export of that family writes, processor_config.json included), so that ``HF=``, export and the
README's transformers snippet run offline end to end:

    python -m lookalikes.models --family qwen2_5_vl --out tiny_qwen2_5_vl
    make train-qwen-vl-mantis HF=tiny_qwen2_5_vl DATA_ROOT=demo_out

The lower-level builders (``build_tiny_hf``, ``build_tiny_qwen3_5``,
``build_tiny_nemotron_omni``) write the weights and config.json alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import torch

TOKENS = dict(image_token_id=290, video_token_id=291, vision_start_token_id=292,
              vision_end_token_id=293)


def build_tiny_hf(family: str, out: Path, *, vocab: int = 300, tokens: dict | None = None,
                  max_positions: int = 512, vision_depth: int = 3, seed: int = 0,
                  moe: dict | None = None) -> Path:
    """Save a tiny fp32 HF model of ``family`` (weights perturbed well beyond the default init).

    Args:
        family: "qwen2_5_vl", "qwen3_vl" or "qwen3_vl_moe" (``TINY_MOE``'s experts; layer 1
            dense through ``mlp_only_layers``).
        out: folder to save to.
        vocab, tokens, max_positions, vision_depth: shape knobs (defaults: the parity tests').
        seed: weight seed.
        moe: ``TINY_MOE`` keys to change (qwen3_vl_moe).
    """
    import transformers as tf

    tokens = tokens or TOKENS
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if family == "qwen2_5_vl":
        config = tf.Qwen2_5_VLConfig(
            text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             rope_parameters={**rope, "mrope_section": [2, 3, 3]},
                             max_position_embeddings=max_positions, tie_word_embeddings=False),
            vision_config=dict(depth=vision_depth, hidden_size=32, intermediate_size=48,
                               num_heads=2,
                               out_hidden_size=64, patch_size=14, window_size=56,
                               fullatt_block_indexes=[1]),
            **tokens)
        cls = tf.Qwen2_5_VLForConditionalGeneration
    else:
        moe_keys, moe = moe, family == "qwen3_vl_moe"
        config = (tf.Qwen3VLMoeConfig if moe else tf.Qwen3VLConfig)(
            text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, max_position_embeddings=max_positions,
                             rope_parameters={**rope, "mrope_section": [4, 2, 2],
                                              "mrope_interleaved": True},
                             **({**TINY_MOE, **(moe_keys or {})} if moe else {})),
            vision_config=dict(depth=vision_depth, hidden_size=32, intermediate_size=48,
                               num_heads=2,
                               out_hidden_size=64, patch_size=16, num_position_embeddings=16,
                               deepstack_visual_indexes=[0, 1]),
            **tokens)
        cls = (tf.Qwen3VLMoeForConditionalGeneration if moe
               else tf.Qwen3VLForConditionalGeneration)
    return save_perturbed(cls, config, out, seed)


#: the tiny Qwen3-VL MoE LM's experts (also configs/qwen3_vl_moe_tiny.yaml's): 4 experts of
#: width 48, top-2 (H 64, I 48 and 2I 96 all differ, so a transposed expert tensor shows); layer 1
#: is a dense MLP (``mlp_only_layers``)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                mlp_only_layers=[1], decoder_sparse_step=1, router_aux_loss_coef=0.001)


#: the tiny Qwen3.5 LM (also configs/qwen3_5_tiny.yaml's): 4 layers, the published 3:1 pattern
#: (3 Gated DeltaNet, then gated attention); attention heads 4 / KV 2 of 32 (rotary on 8 channels:
#: M-RoPE sections 2, 1, 1); DeltaNet key heads 2 of 16, value heads 4 of 8 (two value heads per
#: key head, K != V); MoE: 4 experts of 48, top-2, a shared expert of 40
TINY_QWEN3_5 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4)
TINY_QWEN3_5_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                        shared_expert_intermediate_size=40, router_aux_loss_coef=0.001)


def build_tiny_qwen3_5(out: Path, *, moe: bool = False, vocab: int = 300,
                       tokens: dict | None = None, max_positions: int = 512, seed: int = 0,
                       text: dict | None = None) -> Path:
    """Save a tiny fp32 Qwen3.5 (``moe``: Qwen3.5 MoE) built with transformers (weights perturbed
    well beyond the default init); ``text``: ``text_config`` keys to change."""
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
            "mrope_interleaved": True, "partial_rotary_factor": 0.25}
    text_config = dict(vocab_size=vocab, max_position_embeddings=max_positions,
                       rope_parameters=rope, **{**TINY_QWEN3_5,
                                                **(TINY_QWEN3_5_MOE if moe else {}),
                                                **(text or {})})
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  patch_size=16, num_position_embeddings=16)
    config = (tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config)(
        text_config=text_config, vision_config=vision, **(tokens or TOKENS))
    cls = tf.Qwen3_5MoeForConditionalGeneration if moe else tf.Qwen3_5ForConditionalGeneration
    return save_perturbed(cls, config, out, seed)


def qwen3_5_mtp_shapes(text: dict, *, packed: bool) -> dict[str, tuple[int, ...]]:
    """The ``mtp.*`` tensors of a published Qwen3.5 / 3.6 / 3.8 checkpoint (one
    multi-token-prediction layer; transformers loads none of them) -> their shapes, for an HF
    ``text_config``: ``fc`` (H, 2H) over [embedding; hidden], three norms, and ``layers.0`` shaped
    like a gated full-attention decoder layer with the model's MLP; MoE experts one by one
    (Qwen3.5) or ``packed`` (Qwen3.6: ``experts.gate_up_proj`` (E, H, 2I) and
    ``experts.down_proj`` (E, I, H), the x@W layout of the published fused tensors)."""
    h, d = text["hidden_size"], text["head_dim"]
    heads, kv = text["num_attention_heads"], text["num_key_value_heads"]
    layer = "mtp.layers.0."
    out = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
           "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,),
           layer + "input_layernorm.weight": (h,), layer + "post_attention_layernorm.weight": (h,),
           layer + "self_attn.q_proj.weight": (2 * heads * d, h),
           layer + "self_attn.k_proj.weight": (kv * d, h),
           layer + "self_attn.v_proj.weight": (kv * d, h),
           layer + "self_attn.o_proj.weight": (h, heads * d),
           layer + "self_attn.q_norm.weight": (d,), layer + "self_attn.k_norm.weight": (d,)}
    mlp = layer + "mlp."
    experts = text.get("num_experts") or 0
    if not experts:
        i = text["intermediate_size"]
        return out | {mlp + "gate_proj.weight": (i, h), mlp + "up_proj.weight": (i, h),
                      mlp + "down_proj.weight": (h, i)}
    i, s = text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
    out |= {mlp + "gate.weight": (experts, h), mlp + "shared_expert_gate.weight": (1, h),
            mlp + "shared_expert.gate_proj.weight": (s, h),
            mlp + "shared_expert.up_proj.weight": (s, h),
            mlp + "shared_expert.down_proj.weight": (h, s)}
    if packed:
        return out | {mlp + "experts.gate_up_proj": (experts, h, 2 * i),
                      mlp + "experts.down_proj": (experts, i, h)}
    for e in range(experts):
        out |= {mlp + f"experts.{e}.gate_proj.weight": (i, h),
                mlp + f"experts.{e}.up_proj.weight": (i, h),
                mlp + f"experts.{e}.down_proj.weight": (h, i)}
    return out


def add_qwen3_5_mtp(folder: Path, *, packed: bool = False, seed: int = 1
                    ) -> dict[str, torch.Tensor]:
    """Add the published ``mtp.*`` tensors (``qwen3_5_mtp_shapes``, random) to a tiny Qwen3.5
    folder's model.safetensors and ``mtp_num_hidden_layers: 1`` to its text_config, as the hub's
    checkpoints have them; returns the added tensors."""
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)
    added = {key: torch.randn(shape, generator=g) * 0.1
             for key, shape in qwen3_5_mtp_shapes(config["text_config"], packed=packed).items()}
    weights = load_file(str(folder / "model.safetensors"))
    save_file(weights | added, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return added


def pack_qwen3_5_experts(folder: Path) -> None:
    """Rewrite a tiny Qwen3.5 MoE folder's per-expert LM weights as the packed tensors of each
    layer in the layout transformers loads for this model type (no transpose on load):
    ``mlp.experts.gate_up_proj`` (E, 2I, H) = [gate; up], ``down_proj`` (E, H, I); the other
    expert layout of the hub's checkpoints (Qwen3.6)."""
    import re

    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    per_expert = re.compile(r"^(model\.language_model\.layers\.\d+\.mlp\.experts\.)(\d+)\."
                            r"(gate|up|down)_proj\.weight$")
    layers: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key in [k for k in weights if per_expert.match(k)]:
        prefix, e, part = per_expert.match(key).groups()
        layers.setdefault(prefix, {}).setdefault(int(e), {})[part] = weights.pop(key)
    for prefix, experts in layers.items():
        order = [experts[e] for e in sorted(experts)]
        weights[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([x["gate"], x["up"]]) for x in order]).contiguous()
        weights[prefix + "down_proj"] = torch.stack([x["down"] for x in order]).contiguous()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def build_tiny_mimo_vl(out: Path, *, vocab: int = 300, seed: int = 0) -> Path:
    """Save a tiny MiMo-VL (XiaomiMiMo/MiMo-VL-7B-*: a ``qwen2_5_vl`` checkpoint) as its hub
    folder has it: config.json in the older flat layout (the LM's keys at the top level next to
    ``vision_config``, ``rope_scaling`` with both ``type`` and ``rope_type``, ``rope_theta``
    640000, ``rms_norm_eps`` 1e-5, 4 query heads per KV head, ``max_window_layers`` /
    ``sliding_window`` / ``use_sliding_window``, the tower's ``in_chans`` and
    ``spatial_patch_size``) and the weights under the older prefixes (``model.layers.*``,
    ``visual.*``), built with transformers' Qwen2.5-VL at tiny sizes."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 640000.0,
                                 "mrope_section": [1, 1, 2]})
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  patch_size=14, window_size=56, fullatt_block_indexes=[1], tokens_per_second=2)
    config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **TOKENS)
    save_perturbed(tf.Qwen2_5_VLForConditionalGeneration, config, out, seed)
    flat = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0,
            "hidden_act": "silu", "initializer_range": 0.02, "max_window_layers": 2,
            "model_type": "qwen2_5_vl", "sliding_window": 512, "torch_dtype": "float32",
            "use_cache": True, "use_sliding_window": False, "vision_token_id": 289,
            **{k: v for k, v in text.items() if k != "rope_parameters"},
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default",
                             "type": "default"},
            "rope_theta": 640000, "vision_config": {
                **vision, "hidden_act": "silu", "in_chans": 3, "spatial_merge_size": 2,
                "spatial_patch_size": 14, "temporal_patch_size": 2}, **TOKENS}
    (out / "config.json").write_text(json.dumps(flat, indent=2))
    weights = load_file(str(out / "model.safetensors"))
    legacy = {"model.language_model.": "model.", "model.visual.": "visual."}
    renamed = {}
    for key, tensor in weights.items():
        new = next((key.replace(a, b, 1) for a, b in legacy.items() if key.startswith(a)), key)
        renamed[new] = tensor
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


COSMOS3_DROPPED = {  # published names of the unified checkpoint's other towers -> shapes (tiny)
    "layers.0.self_attn.add_q_proj.weight": (64, 64), "layers.0.self_attn.to_add_out.weight":
    (64, 64), "layers.0.moe_gen.experts.0.up_proj.weight": (32, 64), "proj_in.weight": (64, 16),
    "proj_out.weight": (16, 64), "time_embedder.linear_1.weight": (64, 16),
    "audio_proj_in.weight": (64, 8), "audio_modality_embed": (64,),
    "action_proj_in.weight": (64, 7), "action_modality_embed": (64,)}


def build_tiny_cosmos3_omni(out: Path, *, vocab: int = 300, seed: int = 0,
                            unified: bool = True, tokens: dict | None = None,
                            max_positions: int = 512) -> Path:
    """Save a tiny Cosmos3-Omni (``cosmos3_omni``: the reasoner is Qwen3-VL) with transformers'
    ``Cosmos3OmniForConditionalGeneration``, whose save writes the published layout (LM under
    ``layers.*`` / ``embed_tokens`` / ``norm``, the ViT under flat ``blocks.*`` / ``merger.*``
    / ``patch_embed`` / ``pos_embed`` / ``deepstack_merger_list.*``, attention as
    ``to_q / to_k / to_v / to_out / norm_q / norm_k``); ``unified``: with the generator, sound
    and action weights of the unified checkpoint added (``COSMOS3_DROPPED``, random), which
    transformers' reasoner ignores."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=max_positions,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [4, 2, 2], "mrope_interleaved": True})
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    config = tf.Cosmos3OmniConfig(text_config=text, vision_config=vision, **(tokens or TOKENS))
    save_perturbed(tf.Cosmos3OmniForConditionalGeneration, config, out, seed)
    if unified:
        g = torch.Generator().manual_seed(seed + 1)
        weights = load_file(str(out / "model.safetensors"))
        weights |= {k: torch.randn(shape, generator=g) for k, shape in COSMOS3_DROPPED.items()}
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


NEMOTRON_TOKENS = dict(image_token_id=420, video_token_id=421)


#: the tiny Mamba2 shape (also configs/nemotron_omni_tiny.yaml's): 8 heads of 8 in 2 groups
#: (TP=2 and CP=2 each get whole groups), state 16, chunks of 8 tokens (the test inputs span
#: several chunks)
TINY_MAMBA = dict(mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2,
                  chunk_size=8, conv_kernel=4)


def build_tiny_nemotron_omni(out: Path, *, vocab: int = 640, pattern: str = "M*M-",
                             seed: int = 0, tokens: dict | None = None,
                             text: dict | None = None) -> Path:
    """Save a tiny fp32 NemotronH_Omni_Reasoning_V3 (tiny RADIO, hybrid LM of ``pattern``: M
    Mamba2, * attention, - MLP, E MoE; no audio; one MTP layer declared so that
    ``vision_final_layernorm`` exists), weights perturbed well beyond the default init. Videos
    get their own token id here (HF ignores it). ``text``: text-config keys to change (e.g. the
    MoE widths, which default to transformers' 7688)."""
    from transformers.models.nemotron_h_omni.configuration_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3_Config,
    )
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3,
    )

    names = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
    config = NemotronH_Omni_Reasoning_V3_Config(
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           max_img_size=128, num_cls_tokens=2, num_registers=3,
                           video_temporal_patch_size=2),
        text_config=dict(vocab_size=vocab, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=96,
                         layers_block_type=[names[s] for s in pattern],
                         **{"num_nextn_predict_layers": 1, **TINY_MAMBA, **(text or {})}),
        projector_hidden_size=48, vision_hidden_size=32, **(tokens or NEMOTRON_TOKENS))
    return save_perturbed(NemotronH_Omni_Reasoning_V3, config, out, seed,
                          adjust=dt_above_transformers_floor)


#: the Nemotron 3.5 Super VL shape in small (text_config keys of the published config): LatentMoE
#: (routed experts on a latent width, shared expert on the hidden one), 16 experts of which 4
#: are active, one MTP layer of the default block (attention, then MoE)
TINY_SUPER_VL = dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                     moe_shared_expert_intermediate_size=48, moe_latent_size=24,
                     routed_scaling_factor=2.5, num_nextn_predict_layers=1,
                     mtp_layers_block_type=["attention", "moe"])
#: where the ``nemotron_h_omni`` checkpoints keep the MTP layers: under the LM, next to
#: ``language_model.backbone`` (the key names SGLang's Nemotron-H MTP loader strips)
NEMOTRON_MTP_PREFIX = "language_model.mtp.layers."


def build_tiny_nemotron_super_vl(out: Path, *, vocab: int = 640, pattern: str = "MEM*ME",
                                 seed: int = 0, tokens: dict | None = None) -> Path:
    """A tiny Nemotron 3.5 Super VL (``nemotron_h_omni`` with no audio, LatentMoE and an MTP
    layer): ``build_tiny_nemotron_omni`` with ``TINY_SUPER_VL``, config.json without the audio
    keys (no ``audio_config`` at all, as a checkpoint without a sound encoder), then the MTP
    layer's tensors (``nemotron_mtp_shapes``, random: N(0, 0.1), the norms' 1 + N(0, 0.1)) added
    to model.safetensors under their published names (transformers builds no MTP module and
    ignores them on load)."""
    from safetensors.torch import load_file, save_file

    build_tiny_nemotron_omni(out, vocab=vocab, pattern=pattern, seed=seed, tokens=tokens,
                             text=TINY_SUPER_VL)
    config = json.loads((out / "config.json").read_text())
    for key in ("audio_config", "audio_token_id"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    text = config["text_config"]
    g = torch.Generator().manual_seed(seed + 1)
    added = {key: torch.randn(shape, generator=g) * 0.1 + key.endswith("norm.weight")
             for key, shape in nemotron_mtp_shapes(text).items()}  # norms about 1, as trained
    weights = load_file(str(out / "model.safetensors"))
    save_file(weights | added, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def nemotron_mtp_shapes(text: dict) -> dict[str, tuple[int, ...]]:
    """The ``language_model.mtp.layers.{i}.*`` tensors of a ``nemotron_h_omni`` checkpoint ->
    their shapes, for its HF ``text_config``: the MTP block's inner layers numbered one after
    the other (``num_nextn_predict_layers`` x ``mtp_layers_block_type``), each a ``norm`` and a
    ``mixer``; ``enorm`` / ``hnorm`` / ``eh_proj`` (H x 2H) on the first, ``final_layernorm`` on
    the last of each block."""
    h, heads, kv = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]
    d = text.get("head_dim") or h // heads
    experts, latent = text["n_routed_experts"], text.get("moe_latent_size")
    width = latent or h
    inner, shared = text["moe_intermediate_size"], text["moe_shared_expert_intermediate_size"]
    mixers = {
        "attention": {"q_proj.weight": (heads * d, h), "k_proj.weight": (kv * d, h),
                      "v_proj.weight": (kv * d, h), "o_proj.weight": (h, heads * d)},
        "mlp": {"up_proj.weight": (text["intermediate_size"], h),
                "down_proj.weight": (h, text["intermediate_size"])},
        "moe": {"gate.weight": (experts, h), "gate.e_score_correction_bias": (experts,),
                "shared_experts.up_proj.weight": (shared, h),
                "shared_experts.down_proj.weight": (h, shared),
                **{f"experts.{e}.up_proj.weight": (inner, width) for e in range(experts)},
                **{f"experts.{e}.down_proj.weight": (width, inner) for e in range(experts)},
                **({"fc1_latent_proj.weight": (latent, h), "fc2_latent_proj.weight": (h, latent)}
                   if latent else {})},
    }
    block = [{"full_attention": "attention"}.get(kind, kind)
             for kind in text.get("mtp_layers_block_type") or ["attention", "moe"]]
    out: dict[str, tuple[int, ...]] = {}
    for step in range(text.get("num_nextn_predict_layers") or 0):
        for j, kind in enumerate(block):
            layer = f"{NEMOTRON_MTP_PREFIX}{step * len(block) + j}."
            out[layer + "norm.weight"] = (h,)
            out |= {layer + "mixer." + name: shape for name, shape in mixers[kind].items()}
            if j == 0:
                out |= {layer + "enorm.weight": (h,), layer + "hnorm.weight": (h,),
                        layer + "eh_proj.weight": (h, 2 * h)}
            if j == len(block) - 1:
                out[layer + "final_layernorm.weight"] = (h,)
    return out


def dt_above_transformers_floor(model) -> None:
    """Set every Mamba head's ``dt_bias`` near -1, so that softplus(dt + dt_bias) stays well
    above ``time_step_min`` (0.001) on the test inputs. transformers' NemotronH clamps dt there in
    its full-sequence path (not in its decode step); megatron's mixer, like mamba_ssm's default,
    does not clamp (docs/nemotron.md). HF's init (dt in [0.001, 0.1]) would make the clamp bind
    and the parity tests would measure that difference instead of the mapping."""
    for name, p in model.named_parameters():
        if name.endswith("mixer.dt_bias"):
            p.copy_(torch.randn_like(p) * 0.1 - 1)


def save_perturbed(cls, config, out: Path, seed: int, adjust=None) -> Path:
    """Build ``cls(config)`` with seeded weights perturbed by N(0, 0.1) (well beyond the default
    init, so a wrong mapping shows in the logits), ``adjust(model)`` when given, and save it to
    ``out``."""
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        if adjust is not None:
            adjust(model)
    model.save_pretrained(out)
    return out


#: the test tokenizer's ids of the Qwen vision tokens and of Nemotron-Omni's ``<image>``
TEST_TOKENIZER_QWEN = dict(image_token_id=5, video_token_id=6, vision_start_token_id=3,
                           vision_end_token_id=4)
TEST_TOKENIZER_NEMOTRON = dict(image_token_id=420, video_token_id=420)
#: every family this module builds (contract.families' names)
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "nemotron_omni",
            "cosmos3_omni")
#: (min, max) image pixels a folder's processor files carry by default
DEFAULT_PIXELS = {"nemotron_omni": (8192, 16384)}


def build_tiny_hf_model(family: str, out: Path, *, pixels: tuple[int, int] | None = None,
                        pattern: str = "M*M-", seed: int = 0, super_vl: bool = False) -> Path:
    """A complete tiny HF model folder as the hub has them: weights + config.json (token ids of
    the test tokenizer), the test tokenizer with the family's chat template
    (``energon_tasks.tokenizer.chat_template``: ChatML, list contents with the media tokens
    where transformers' processor expands them), generation_config.json and the processor files
    an export of the family writes (``processor_files``: image, video and processor configs,
    with ``pixels`` = (min, max) image pixels). ``pattern``: Nemotron-Omni's LM layers;
    ``super_vl``: Nemotron-Omni in the Nemotron 3.5 Super VL shape
    (``build_tiny_nemotron_super_vl``: LatentMoE, MTP weights; its default pattern)."""
    from transformers import AutoTokenizer

    from energon_tasks.tokenizer import build_test_tokenizer, chat_template
    from models.families import config_from_hf, family_of

    pixels = pixels or DEFAULT_PIXELS.get(family, (3136, 6272))
    out = Path(out)
    video = {}
    if family == "nemotron_omni" and super_vl:
        build_tiny_nemotron_super_vl(out, seed=seed, tokens=TEST_TOKENIZER_NEMOTRON)
        video = {"video_target_num_patches": 64, "video_maintain_aspect_ratio": True}
    elif family == "nemotron_omni":
        build_tiny_nemotron_omni(out, pattern=pattern, seed=seed, tokens=TEST_TOKENIZER_NEMOTRON)
        video = {"video_target_num_patches": 64, "video_maintain_aspect_ratio": True}
    elif family in ("qwen3_5", "qwen3_5_moe"):
        build_tiny_qwen3_5(out, moe=family == "qwen3_5_moe", vocab=448,
                           tokens=TEST_TOKENIZER_QWEN, max_positions=2048, seed=seed)
    elif family == "cosmos3_omni":  # the reasoner alone (no generator / sound / action weights)
        build_tiny_cosmos3_omni(out, vocab=448, seed=seed, unified=False,
                                tokens=TEST_TOKENIZER_QWEN, max_positions=2048)
    else:
        build_tiny_hf(family, out, vocab=448, tokens=TEST_TOKENIZER_QWEN, max_positions=2048,
                      seed=seed)
    build_test_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = chat_template(family)  # each family is a profile of its own
    tokenizer.save_pretrained(out)
    ids = {"bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}  # the test tokenizer's, as a hub model's
    config = json.loads((out / "config.json").read_text())
    config["text_config"].update(ids)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2))
    model_cfg = config_from_hf(config)
    encoder = {"min_pixels": pixels[0], "max_pixels": pixels[1], **video}
    for name, content in family_of(model_cfg).processor_files(model_cfg, encoder).items():
        (out / name).write_text(json.dumps(content, indent=2))
    return out


@click.command()
@click.option("--family", type=click.Choice(FAMILIES), required=True,
              help="The model family (its transformers class and checkpoint layout).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The model folder to write (files in it are replaced).")
@click.option("--seed", default=0, show_default=True, type=int, help="Weight seed.")
@click.option("--super-vl", is_flag=True,
              help="nemotron_omni only: the Nemotron 3.5 Super VL shape (LatentMoE, MTP layer).")
def cli(family: str, out: Path, seed: int, super_vl: bool) -> None:
    """Write a hub-complete tiny model folder of FAMILY: what HF= / model.hf, export and the
    README's transformers snippet take offline."""
    if super_vl and family != "nemotron_omni":
        raise click.UsageError(f"--super-vl is a nemotron_omni shape, not {family}'s")
    folder = build_tiny_hf_model(family, out, seed=seed, super_vl=super_vl)
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    click.echo(f"lookalikes.models: wrote a tiny {family} model folder {folder} "
               f"({size / 1e6:.1f} MB): HF={folder}")


def main(argv: list[str] | None = None) -> int:
    from contract.cli import run_click

    return run_click(cli, "lookalikes.models", argv)


if __name__ == "__main__":
    sys.exit(main())
