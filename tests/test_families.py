"""Family names and the defaults that depend on them: one spelling in, aliases only at the input,
one source of each default (contract.families, energon_tasks.profiles, models.families)."""

from __future__ import annotations

import logging

import pytest
import yaml

from contract import families as F
from contract.errors import ConfigError
from converters.stats import default_budget
from energon_tasks.config import TaskEncoderConfig
from energon_tasks.profiles import PROFILES
from models import families as M
from models.families.qwen_vl.config import load_yaml
from tests.conftest import REPO


def test_one_spelling_per_family_and_aliases_at_the_input():
    assert set(PROFILES) == set(F.PROFILES)  # the data side's registry covers every profile
    assert set(M.FAMILIES) == set(F.FAMILIES)  # and the model side's every family
    for name, profile in PROFILES.items():
        assert profile.family == F.PROFILES[name] and profile.geometry.name == name
    for alias, name in F.ALIASES.items():
        assert TaskEncoderConfig(model=alias.upper()).model == name  # stored canonical
    assert F.TASK_ENCODER_MODELS[F.NEMOTRON_OMNI] == (F.NEMOTRON_OMNI, F.NEMOTRON_OMNI_TILED)
    assert F.family_of_hf_model_type("nemotron_h_omni") == F.NEMOTRON_OMNI
    with pytest.raises(ConfigError, match="unknown model 'qwen2-vl'.*also spelled qwen2.5-vl"):
        TaskEncoderConfig(model="qwen2-vl")


def test_tile_cap_from_max_pixels_is_explicit(caplog):
    """nemotron_omni_tiled reads max_pixels as a tile cap (behaviour kept) and says so once."""
    with caplog.at_level(logging.WARNING, logger="energon_tasks.config"):
        config = TaskEncoderConfig(model="nemotron-omni-tiled", max_pixels=3 * 512**2 + 5)
        TaskEncoderConfig(model="nemotron_omni_tiled", max_pixels=3 * 512**2 + 5)
    geometry = config.resolve().geometry
    assert geometry.tile_cap(config.max_pixels) == 3
    # a 1:4 image: 3 tiles + thumbnail under the cap, 4 + 1 without
    assert geometry.image_grid(512, 2048, max_pixels=config.max_pixels).grid_thw[0] == 4
    assert geometry.image_grid(512, 2048).grid_thw[0] == 5
    notices = [r.getMessage() for r in caplog.records if "tile" in r.getMessage()]
    assert notices == ["task_encoder: nemotron_omni_tiled reads max_pixels 786437 as a cap of 3 "
                       "tile(s) per image (below max_num_tiles 12); set max_pixels: null to use "
                       "max_num_tiles"]
    assert geometry.tile_cap(None) is None
    assert TaskEncoderConfig(model="nemotron_omni").resolve().geometry.tile_cap(3 * 512**2) is None


def test_stats_estimates_use_the_loaders_defaults():
    for model in ("qwen2_5_vl", "qwen3_vl"):
        config = TaskEncoderConfig(model=model).resolve()
        budget = default_budget(model)
        assert (budget["min_pixels"], budget["max_pixels"]) == (config.min_pixels,
                                                                config.max_pixels)
        assert (budget["video_min_pixels"], budget["video_max_pixels"]) == (
            config.video_min_pixels, config.video_max_pixels)
        assert (budget["video_fps"], budget["max_num_frames"]) == (config.video_fps,
                                                                    config.max_num_frames)


def test_model_yamls_hold_no_parallel_section_and_a_legacy_one_is_dropped(tmp_path, caplog):
    for path in sorted((REPO / "configs").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        model = raw.get("model", raw)
        assert "parallel" not in model, path.name
    legacy = tmp_path / "legacy.yaml"
    raw = yaml.safe_load((REPO / "configs" / "qwen2_5_vl_tiny.yaml").read_text())
    legacy.write_text(yaml.safe_dump({**raw, "parallel": {"tp": 2, "pp": 1, "cp": 1}}))
    with caplog.at_level(logging.WARNING, logger="models.config"):
        cfg = load_yaml(legacy)
    assert "parallel" not in cfg.to_dict()
    assert [r.getMessage() for r in caplog.records] == [
        "model.parallel {'cp': 1, 'pp': 1, 'tp': 2} is not read (the run's layout is the run "
        "config's parallel section); ignored"]
