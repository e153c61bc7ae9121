"""Nemotron 3.5 Super VL (``nemotron_h_omni`` without audio, LatentMoE, an MTP layer) on
megatron-core without TransformerEngine: a tiny model of that shape built with transformers
(``lookalikes.models.build_tiny_nemotron_super_vl``), imported, its logits against transformers'
(one image, interleaved images, tiles, a video; at TP=1, TP=2, EP=2 and PP=2), the export equal
to the source (the MTP tensors byte for byte), greedy generation against transformers'
``generate``, and train.py from the HF folder (loss falls; export and resume keep the MTP
tensors)."""

from __future__ import annotations

import json

import pytest
import torch

from lookalikes.models import NEMOTRON_MTP_PREFIX
from tests.models.conftest import launch_world2, world2_result
from tests.models.test_nemotron_omni import _hf_greedy, _prompt

TOL = 1e-4


@pytest.fixture(scope="module")
def super_imported(super_hf, tmp_path_factory):
    from models.convert import hf_to_mcore

    out = tmp_path_factory.mktemp("super_mcore") / "mcore"
    hf_to_mcore(str(super_hf), out, tp=1, pp=1)
    return out


def tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and \
        a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))


def test_tiny_has_the_super_vl_shape(super_hf):
    """No audio keys, LatentMoE, 16 experts / 4 active, an MTP block (attention, MoE) whose
    published tensors transformers ignores on load."""
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3,
    )

    config = json.loads((super_hf / "config.json").read_text())
    assert "audio_config" not in config
    text = config["text_config"]
    assert (text["moe_latent_size"], text["n_routed_experts"], text["num_experts_per_tok"],
            text["num_nextn_predict_layers"]) == (24, 16, 4, 1)
    mtp = [k for k in tensors(super_hf) if k.startswith(NEMOTRON_MTP_PREFIX)]
    assert {NEMOTRON_MTP_PREFIX + "0.eh_proj.weight", NEMOTRON_MTP_PREFIX + "1.final_layernorm."
            "weight", NEMOTRON_MTP_PREFIX + "1.mixer.fc1_latent_proj.weight"} <= set(mtp)
    _model, info = NemotronH_Omni_Reasoning_V3.from_pretrained(super_hf, output_loading_info=True)
    assert not any(info.values()), info


def test_published_key_spelling_reads_the_same(super_hf, tmp_path):
    """The Nemotron-3 Super config.json spelling (``hybrid_override_pattern``,
    ``mtp_hybrid_override_pattern``) gives the same model config as transformers' saved one, and
    transformers reads it as the same layers and MTP block."""
    from transformers import AutoConfig

    from models.families import config_from_hf
    from models.families.nemotron_omni.config import LAYER_SYMBOLS

    saved = json.loads((super_hf / "config.json").read_text())
    published = json.loads(json.dumps(saved))
    text = published["text_config"]
    text["hybrid_override_pattern"] = "".join(LAYER_SYMBOLS[t] for t in text["layers_block_type"])
    text["mtp_hybrid_override_pattern"] = "*E"
    del text["layers_block_type"], text["mtp_layers_block_type"]
    assert config_from_hf(published) == config_from_hf(saved)
    (tmp_path / "config.json").write_text(json.dumps(published))
    theirs = AutoConfig.from_pretrained(tmp_path).text_config
    assert theirs.layers_block_type == saved["text_config"]["layers_block_type"]
    assert theirs.mtp_layers_block_type == saved["text_config"]["mtp_layers_block_type"]


def test_builds_without_te_and_logits_match_transformers(super_hf, super_imported):
    """The import builds on megatron's local spec (no TransformerEngine: megatron's own MoE layer
    asserts it for latent projections); logits equal transformers' on every input."""
    from models.checkpointing.checkpoint import load_checkpoint
    from models.convert import verify
    from models.layers.latent_moe import LatentMoELayer, ReplicatedLinear
    from models.parallel import init_parallel

    init_parallel()
    model, cfg = load_checkpoint(super_imported, use_te=False)
    moe = [m for m in model.modules() if isinstance(m, LatentMoELayer)]
    assert len(moe) == cfg.lm.pattern.count("E") == 2
    for layer in moe:
        assert isinstance(layer.fc1_latent_proj, ReplicatedLinear)
        assert layer.fc1_latent_proj.weight.shape == (24, 64)
        assert layer.experts.local_experts[0].linear_fc1.weight.shape == (32, 24)
    report = verify(super_hf, super_imported)
    assert set(report) == {"one_image", "images_interleaved", "tiles", "video"}
    for name, row in report.items():
        assert row["max_abs_logit_diff"] <= TOL, (name, row)


def test_export_equals_the_source(super_hf, super_imported, tmp_path):
    """hf -> mcore -> hf: every tensor equal, the MTP ones byte for byte (carried), the same
    config.json (still without audio keys)."""
    from models.convert import mcore_to_hf

    mcore_to_hf(super_imported, tmp_path / "hf")
    before, after = tensors(super_hf), tensors(tmp_path / "hf")
    assert sorted(before) == sorted(after)
    assert all(same_bytes(before[k], after[k]) for k in before)
    assert (json.loads((tmp_path / "hf" / "config.json").read_text())
            == json.loads((super_hf / "config.json").read_text()))


def test_greedy_tokens_equal_transformers_generate(super_hf, super_imported):
    """models.generation.generate (KV cache, Mamba states, the LatentMoE decode step) gives
    transformers' ``generate`` tokens on one image, interleaved images, tiles and a video."""
    from models.checkpointing.checkpoint import load_checkpoint
    from models.convert import load_hf_model
    from models.generation.generate import greedy_generate
    from models.hf.verify_inputs import hf_inputs, make_inputs
    from models.parallel import init_parallel

    never = 10 ** 6
    init_parallel()
    model, cfg = load_checkpoint(super_imported, use_te=False)
    hf = load_hf_model(super_hf)
    for name, case in make_inputs(cfg).items():
        ours = greedy_generate(model, [_prompt(case)], eos_id=never, max_new_tokens=5)[0]
        assert ours == _hf_greedy(hf, hf_inputs(cfg, case), 5, never), name


def test_memory_table_counts_the_latent_projections(super_hf):
    """The memory estimate's table (recipes/estimate.py, from the parameters' shapes) holds each
    MoE layer's latent projections as dense, unsharded LM weights (whole on every TP / EP rank)
    and its routed experts at the latent width; the shapes-only build allocates no projection."""
    from models.families import config_from_hf, meta_model
    from models.parallel import init_parallel
    from recipes.estimate import run_table
    from recipes.run_config import load_run_config
    from tests.test_train import NEMOTRON_MANTIS_CFG

    init_parallel()
    model = meta_model(config_from_hf(json.loads((super_hf / "config.json").read_text())))
    assert {p.device.type for n, p in model.named_parameters() if "_latent_proj." in n} \
        == {"meta"}

    table = run_table(load_run_config(NEMOTRON_MANTIS_CFG, [f"model.hf={super_hf}"]))
    latent, hidden, experts, inner = 24, 64, 16, 32
    for layer in (1, 5):  # the E layers of "MEM*ME"
        parts = [p for p in table.parts if p.layer == layer and p.place == "lm"]
        dense = sum(p.numel for p in parts if not p.expert and not p.sharded)
        routed = [p for p in parts if p.expert]
        # the RMSNorm, the router, the two projections (the shared expert: TP-sharded)
        assert dense == hidden + experts * hidden + 2 * latent * hidden
        assert sum(p.numel for p in routed) == experts * 2 * inner * latent
        assert sum(p.width_whole + p.width_split for p in routed) == experts * 2 * (inner + latent)


@pytest.mark.slow
def test_tp2_ep2_and_pp2_match_transformers(super_hf, super_imported, tmp_path):
    """2 gloo ranks: imported at TP=2 (the latent projections whole on both ranks, the experts
    sliced), and the TP=1 import loaded at EP=2 (8 experts per rank): logits, and greedy tokens
    of a batch of two prompts (at EP=2 the lean decode step: each rank's experts, one all-reduce,
    then the latent up-projection); imported at PP=2 ("MEM" / "*ME": a LatentMoE layer on each
    stage): logits, and the PP=1 and PP=2 imports equal (tests/models/pp2_check.py)."""
    from tests.models.pp2_check import check_pp2

    launched = launch_world2({"layouts": ("layouts", [super_hf, super_imported]),
                              "pp2": ("pp2", [super_hf, super_imported])}, tmp_path)
    check_pp2(super_hf, super_imported, world2_result(launched, "pp2"),
              {"one_image", "images_interleaved", "tiles", "video"}, TOL)
    out = world2_result(launched, "layouts")
    report = json.loads((out / "layouts_report.json").read_text())
    assert set(report) == {"tp2", "ep2"}
    for layout, rows in report.items():
        assert set(rows) == {"one_image", "images_interleaved", "tiles", "video"}
        assert max(rows.values()) <= TOL, (layout, rows)
    generated = json.loads((out / "layouts_generate.json").read_text())
    for layout, tokens in generated.items():
        assert "error" not in tokens and tokens["ours"] == tokens["hf"], (layout, tokens)
    assert generated["ep2"]["lean_decode"], generated["ep2"]


def mtp_of(folder) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors(folder).items() if k.startswith(NEMOTRON_MTP_PREFIX)}


@pytest.mark.slow  # two train.py runs and three exports: 18-21 s on 2 shared cores
def test_train_from_hf_resume_and_export(super_hf, tmp_path, mantis_out):
    """train.py from the HF folder (3 steps, step 2 saved): the loss falls; the export loads in
    transformers with our logits; the MTP tensors come back byte for byte from the run and from
    a run resumed at step 2."""
    from tests.test_hf_journey import LOGITS_TOLERANCE, export, logits_diff
    from tests.test_train import FAST, NEMOTRON_MANTIS_CFG, losses, ok, train

    common = [str(NEMOTRON_MANTIS_CFG), f"model.hf={super_hf}",
              f"data.path={mantis_out}/metadataset.yaml", *FAST, "checkpoint.save_final=true",
              f"train.hf_import_cache={tmp_path / 'cache'}", "train.eval_interval=0"]
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    ok(train(*common, "train.steps=3", "checkpoint.interval=2", f"out={run}"))
    assert losses(run)[-1] < losses(run)[0], losses(run)
    source_mtp = mtp_of(super_hf)
    exported = export(run, tmp_path / "export")
    assert max(logits_diff(run, exported).values()) <= LOGITS_TOLERANCE
    ok(train(*common, "train.steps=3", f"out={resumed}", "--resume",
             str(run / "checkpoints" / "step_000002")))
    assert losses(resumed) == losses(run)[2:]
    for folder in (exported, export(resumed, tmp_path / "export_resumed")):
        carried = mtp_of(folder)
        assert carried.keys() == source_mtp.keys()
        assert all(same_bytes(carried[k], source_mtp[k]) for k in source_mtp)
