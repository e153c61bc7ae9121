"""Freezing parameter groups (``model.freeze_vision_model`` / ``freeze_vision_projection`` /
``freeze_language_model``): the switches in the run config, which parameters each family puts in
each group, and a run from a tiny HF model whose frozen tensors come out of training and export
bit-identical while the others train."""

from __future__ import annotations

import pytest
import torch
import yaml

from contract.errors import ConfigError, UsageError
from lookalikes.models import build_tiny_hf_model
from recipes.run_config import dump_yaml, load_run_config
from tests.test_hf_journey import JOURNEYS, export, train_from_hf
from tests.test_train import MANTIS_CFG


def test_switches_default_off_round_trip_and_refuse_freezing_everything():
    cfg = load_run_config(MANTIS_CFG)
    assert cfg.freeze.frozen() == ()  # nothing is frozen by default: full fine-tuning
    cfg = load_run_config(MANTIS_CFG, ["model.freeze_vision_model=true"])
    assert cfg.freeze.frozen() == ("vision_model",)
    saved = yaml.safe_load(dump_yaml(cfg))
    assert saved["model"]["freeze_vision_model"] is True
    again = load_run_config(None, stored=saved)  # what eval.py does with a checkpoint's config
    assert again.freeze.frozen() == ("vision_model",) and again.model == cfg.model
    with pytest.raises(ConfigError, match="nothing would train"):
        load_run_config(MANTIS_CFG, ["model.freeze_vision_model=true",
                                     "model.freeze_vision_projection=true",
                                     "model.freeze_language_model=true"])
    from recipes.run_plan import check_run

    frozen_lm = load_run_config(MANTIS_CFG, ["model.freeze_language_model=true",
                                             "parallel.pp=2", "task_encoder.fixed_length=true"])
    with pytest.raises(UsageError, match="freeze_language_model with parallel.pp > 1"):
        check_run(frozen_lm, world=2)
    with pytest.raises(ConfigError, match="model.freeze_vision_model: expected bool"):
        load_run_config(MANTIS_CFG, ["model.freeze_vision_model=maybe"])
    with pytest.raises(ConfigError, match="did you mean model.freeze_vision_model"):
        load_run_config(MANTIS_CFG, ["model.freeze_vision_modle=true"])


@pytest.mark.parametrize("family", ["qwen3_vl", "nemotron_omni"])
def test_parameter_groups_of_each_family(family):
    """Every parameter is in one group; the projection is the mergers (DeepStack included) or
    the projector; the LM holds the embedding and the output layer."""
    from models.families import PARAMETER_GROUPS, build_model, config_module, get
    from models.parallel import init_parallel
    from tests.conftest import REPO

    init_parallel()
    cfg = config_module(family).load_yaml(REPO / "configs" / f"{family}_tiny.yaml")
    names = [name for name, _ in build_model(cfg, use_te=False).named_parameters()]
    groups = {name: get(family).parameter_group(name) for name in names}
    assert set(groups.values()) == set(PARAMETER_GROUPS)
    projection = [n for n, g in groups.items() if g == "vision_projection"]
    assert projection and all(n.startswith(("vision.merger.", "vision.deepstack_mergers.",
                                            "vision.projector.")) for n in projection)
    if family == "qwen3_vl":
        assert any(n.startswith("vision.deepstack_mergers.") for n in projection)
    lm = [n for n, g in groups.items() if g == "language_model"]
    assert any("embedding" in n for n in lm) and all(not n.startswith("vision.") for n in lm)


#: our parameter names of each group, spelled out here (not asked of the family under test)
PROJECTION = ("vision.merger.", "vision.deepstack_mergers.", "vision.projector.")


def _group(name: str) -> str:
    if name.startswith(PROJECTION):
        return "vision_projection"
    return "vision_model" if name.startswith("vision.") else "language_model"


@pytest.mark.slow
@pytest.mark.parametrize("family,frozen", [("qwen2_5_vl", "freeze_vision_model"),
                                           ("nemotron_omni", "freeze_language_model")])
def test_frozen_tensors_come_out_of_training_and_export_unchanged(family, frozen, tmp_path,
                                                                  mantis_out):
    """From a tiny HF model: a few steps with one group frozen; every frozen tensor of the
    checkpoint and of its export (imported again) equals the HF model's import bit for bit, and
    most others trained; the start line counts the trainable parameters."""
    import json

    from models.convert import import_hf_cached
    from models.families import config_from_hf
    from models.parallel import init_parallel
    from tests.test_hf_journey import state

    hf = build_tiny_hf_model(family, tmp_path / "hf", pixels=JOURNEYS[family][1])
    run, cache = tmp_path / "run", tmp_path / "cache"
    proc = train_from_hf(family, hf, run, cache, mantis_out, "train.steps=3",
                         f"model.{frozen}=true")
    group = frozen.removeprefix("freeze_")
    assert f"M trainable; frozen: {group})" in proc.stdout
    init_parallel()
    cfg = config_from_hf(json.loads((hf / "config.json").read_text()))
    start = state(import_hf_cached(cfg, str(hf), cache)[0])  # the run's own cached import
    trained = state(run)
    exported = export(run, tmp_path / "export")
    init_parallel()
    again = state(import_hf_cached(cfg, str(exported), tmp_path / "cache2")[0])
    frozen_keys = [k for k in start if _group(k) == group]
    others = [k for k in start if _group(k) != group]
    assert frozen_keys and others
    for key in frozen_keys:
        assert torch.equal(trained[key], start[key]), key
        assert torch.equal(again[key], start[key]), key
    changed = sum(not torch.equal(trained[k], start[k]) for k in others)
    assert changed > len(others) // 2, (changed, len(others))
