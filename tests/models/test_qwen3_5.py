"""Qwen3.5 (``qwen3_5``) and Qwen3.5 MoE (``qwen3_5_moe``) on megatron-core against
transformers' ``Qwen3_5(Moe)ForConditionalGeneration`` on tiny models (lookalikes/models.py: three
Gated DeltaNet layers then gated attention, rotary on a quarter of each head, two value heads per
key head, K != V; MoE: 4 experts + a gated shared expert): the torch kernels against transformers'
torch path (several chunks, packed segments, the decode step), logits with images and a video,
the export in the published layout with the MTP weights carried unchanged (greedy generation:
tests/models/test_generate.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.models.conftest import world2_result

TOL = 1e-4


def test_torch_kernels_equal_transformers_torch_path():
    """The chunked rule over several chunks (GVA heads repeated), the token-by-token decode step
    and the conv equal transformers' torch functions; packed segments equal each alone."""
    import torch.nn.functional as F
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from models.kernels import conv as ours_conv
    from models.kernels import gated_delta as ours

    g = torch.Generator().manual_seed(0)
    b, t, h, k, v = 2, 150, 4, 16, 8
    q, key = torch.randn(b, t, h, k, generator=g), torch.randn(b, t, h, k, generator=g)
    value = torch.randn(b, t, h, v, generator=g)
    decay, beta = -torch.rand(b, t, h, generator=g), torch.rand(b, t, h, generator=g)
    args = dict(g=decay, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want, want_state = hf.torch_chunk_gated_delta_rule(q, key, value, **args)
    for fn in (ours.chunk_gated_delta_rule, ours.fused_recurrent_gated_delta_rule):
        out, state = fn(q, key, value, **args)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(state, want_state, rtol=0, atol=1e-5)
    cut = [70, 80]  # row 0's first 70 tokens and row 1's first 80, packed
    packed = {name: torch.cat([x[0, :cut[0]], x[1, :cut[1]]])[None]
              for name, x in (("q", q), ("k", key), ("v", value), ("g", decay), ("beta", beta))}
    out, states = ours.chunk_gated_delta_rule(**packed, cu_seqlens=torch.tensor([0, 70, 150]),
                                              output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    for n, (start, size) in enumerate(((0, 70), (70, 80))):
        alone, alone_state = hf.torch_chunk_gated_delta_rule(
            q[n:n + 1, :size], key[n:n + 1, :size], value[n:n + 1, :size],
            g=decay[n:n + 1, :size], beta=beta[n:n + 1, :size], output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[:, start:start + size], alone, rtol=0, atol=1e-5)
        torch.testing.assert_close(states[n:n + 1], alone_state, rtol=0, atol=1e-5)
    x, weight = torch.randn(2, 12, 9, generator=g), torch.randn(12, 4, generator=g)
    conv = ours_conv.causal_conv1d_fn(x, weight, activation="silu")
    torch.testing.assert_close(conv, hf.causal_conv1d_fn(x, weight, activation="silu"))
    state = F.pad(x[..., :-1], (3, 0))[..., -3:].clone()  # the inputs before the last token
    step = ours_conv.causal_conv1d_update(x[..., -1], state, weight, activation="silu")
    torch.testing.assert_close(step, conv[..., -1])


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_6_moe"])
def test_logits_match_transformers(qwen3_5_hf, qwen3_5_imported, family):
    """hf-to-mcore then ``verify``: one image, interleaved images, a video, each <= 1e-4."""
    from models.convert import verify

    report = verify(qwen3_5_hf[family], qwen3_5_imported[family])
    assert set(report) == {"one_image", "images_interleaved", "video"}
    for name, row in report.items():
        assert row["max_abs_logit_diff"] <= TOL, (family, name, row)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_6_moe"])
def test_export_round_trip_is_the_published_layout(qwen3_5_hf, qwen3_5_imported, family, tmp_path):
    """mcore-to-hf writes every tensor of the source under its own name, byte for byte (fused
    ``in_proj_qkv`` / ``conv1d``; the LM experts one by one as Qwen3.5 publishes them, or packed
    as the Qwen3.6 source has them; every ``mtp.*`` tensor, experts one by one or packed) and
    transformers loads the export with the source's weights."""
    import transformers

    from models.convert import mcore_to_hf

    mcore_to_hf(qwen3_5_imported[family], tmp_path / "export")
    before = load_file(str(qwen3_5_hf[family] / "model.safetensors"))
    after = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for key in before:
        assert after[key].dtype == before[key].dtype, key
        assert after[key].numpy().tobytes() == before[key].numpy().tobytes(), key
    mtp = {k for k in after if k.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= mtp
    if family == "qwen3_5_moe":  # Qwen3.5's layout: experts one by one
        assert "model.language_model.layers.0.mlp.experts.3.down_proj.weight" in after
        assert "mtp.layers.0.mlp.experts.3.down_proj.weight" in mtp
    if family == "qwen3_6_moe":  # Qwen3.6's: packed, in the main layers and the MTP layer
        assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in after
        assert {"mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"} \
            <= mtp
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["model_type"] == family.replace("qwen3_6", "qwen3_5")
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    cls = getattr(transformers, config["architectures"][0])
    ours = cls.from_pretrained(tmp_path / "export").state_dict()
    theirs = cls.from_pretrained(qwen3_5_hf[family]).state_dict()
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.slow
def test_tp2_parity_and_reshard_to_tp1(qwen3_5_hf, world2):
    """2 gloo ranks (tests/models/world2_checks.py's launch): the dense model imported sharded at
    TP=2 (DeltaNet heads, conv and gate split over the ranks) gives transformers' logits; that
    TP=2 checkpoint loaded at TP=1 here gives them too, and the gated norms' weight gradients
    (summed over TP) of TP=1."""
    from models.convert import verify

    out = world2_result(world2, "tp2_qwen3_5")
    report = json.loads((out / "tp2_report.json").read_text())
    assert {p.name.split("_")[2] for p in (out / "qwen3_5").glob("__*_*.distcp")} == {"0", "1"}
    for name, diff in report["qwen3_5"].items():
        assert diff <= TOL, (name, diff)
    for name, row in verify(qwen3_5_hf["qwen3_5"], out / "qwen3_5").items():
        assert row["max_abs_logit_diff"] <= TOL, (name, row)
    # the DeltaNet's gated norm: its weight replicated, each rank its own heads; the gradient
    # summed over TP on both ranks equals TP = 1's
    from models.checkpointing.checkpoint import load_checkpoint
    from models.parallel import init_parallel
    from tests.models.tp2_check import deltanet_norm_grads

    init_parallel()
    model, cfg = load_checkpoint(out / "qwen3_5", use_te=False)
    want = deltanet_norm_grads(model, cfg)
    assert len(want) == 3
    for rank in (0, 1):
        got = torch.load(out / f"norm_grads{rank}.pt")
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_pp2_parity_and_reshard(qwen3_5_hf, qwen3_5_imported, world2):
    """2 gloo ranks: the dense model at PP=2 (layers 0-1 DeltaNet | 2 DeltaNet, 3 attention)
    gives transformers' logits; PP=1 and PP=2 imports hold the same tensors at either layout."""
    from tests.models.pp2_check import check_pp2

    check_pp2(qwen3_5_hf["qwen3_5"], qwen3_5_imported["qwen3_5"],
              world2_result(world2, "pp2_qwen3_5"),
              {"one_image", "images_interleaved", "video"}, TOL)


def test_refusals_are_one_line(qwen3_5_hf):
    """What the model does not build, and a DeltaNet tensor of the wrong shape, are one-line
    errors naming the key / field."""
    from models.families.qwen3_5 import config, hf_mapping

    raw = json.loads((qwen3_5_hf["qwen3_5"] / "config.json").read_text())
    cfg = config.from_hf_config(raw)
    assert cfg.lm.layer_types[3] == "full_attention" and cfg.lm.linear_layers[:3] == [True] * 3
    biased = dict(raw, text_config=dict(raw["text_config"], attention_bias=True))
    with pytest.raises(ValueError, match="attention_bias true"):
        config.from_hf_config(biased)
    key = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
    with pytest.raises(ValueError, match=r"in_proj_qkv\.weight' has 70 rows, expected q \| k \| v "
                                         r"= 32 \+ 32 \+ 32"):
        hf_mapping.split_linear_attention({key: torch.zeros(70, 64)}, cfg)


@pytest.mark.parametrize("name,billions", [("qwen3_5_9b", 9.41), ("qwen3_5_27b", 27.36),
                                           ("qwen3_5_35b_a3b", 35.11)])
def test_real_shape_configs(name, billions):
    """configs/<name>.yaml as transformers builds it (``to_hf_dict``, on the meta device): the
    parameter count of the published model (its name's billions, with the ViT), and the HF config
    back to ours unchanged."""
    import transformers

    from models.families.qwen3_5 import config
    from tests.conftest import REPO

    ours = config.load_yaml(REPO / "configs" / f"{name}.yaml")
    hf = config.to_hf_dict(ours)
    assert config.from_hf_config(hf).lm == ours.lm
    assert config.to_hf_dict(config.from_hf_config(hf)) == hf
    cls = getattr(transformers, hf["architectures"][0])
    hf_config = getattr(transformers, cls.__name__.replace("ForConditionalGeneration", "Config"))(
        **{k: v for k, v in hf.items() if k not in ("architectures", "model_type", "dtype")})
    with torch.device("meta"):
        count = sum(p.numel() for p in cls(hf_config).parameters())
    assert round(count / 1e7) == round(billions * 100), count
