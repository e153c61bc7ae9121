"""The one model / task encoder / tokenizer check of train.py, eval.py and model.hf
(recipes/compatibility.py): what it refuses, in one line, and what it names."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from contract.errors import ConfigError, UsageError
from energon_tasks.config import TaskEncoderConfig
from models.families import config_module
from recipes.compatibility import (
    TOKEN_IDS,
    check_compatible,
    compatibility_problems,
    profile_for,
)
from tests.conftest import REPO


def tiny(family: str, *overrides: str):
    name = {"qwen2_5_vl": "qwen2_5_vl_tiny", "qwen3_vl": "qwen3_vl_tiny",
            "nemotron_omni": "nemotron_omni_tiny"}[family]
    return config_module(family).load_yaml(REPO / "configs" / f"{name}.yaml", list(overrides))


class Tokenizer(list):
    """Only its length is read."""


def encoder_like(model) -> SimpleNamespace:
    """A task encoder whose token ids are the model's."""
    return SimpleNamespace(**{attr: getattr(model, name) for name, attr in TOKEN_IDS.items()})


def test_matching_pairs_pass():
    for family, profiles in (("qwen2_5_vl", ["qwen2_5_vl"]), ("qwen3_vl", ["qwen3_vl"]),
                             ("nemotron_omni", ["nemotron_omni", "nemotron_omni_tiled"])):
        model = tiny(family)
        for profile in profiles:
            te = TaskEncoderConfig(model=profile)
            assert compatibility_problems(model, te) == []
            check_compatible(model, te, weights="checkpoint x",
                             tokenizer=Tokenizer(range(model.lm.vocab_size)),
                             encoder=encoder_like(model), token_ids=tuple(TOKEN_IDS))


def test_task_encoder_of_another_family():
    with pytest.raises(ConfigError) as info:
        check_compatible(tiny("nemotron_omni"), TaskEncoderConfig(model="qwen2.5-vl"))
    assert str(info.value) == ("task_encoder.model 'qwen2_5_vl' does not feed model.family "
                               "'nemotron_omni' (use nemotron_omni or nemotron_omni_tiled)")
    problems = compatibility_problems(tiny("qwen3_vl"), TaskEncoderConfig(model="qwen2_5_vl"),
                                      weights="checkpoint runs/x")
    assert problems == ["checkpoint runs/x: task_encoder.model 'qwen2_5_vl' does not feed "
                        "model.family 'qwen3_vl' (use qwen3_vl)"]


def test_patch_geometry_of_tower_and_processor():
    model = tiny("qwen2_5_vl", "vision.patch_size=16")
    te = TaskEncoderConfig(model="qwen2_5_vl")
    problems = compatibility_problems(model, te, weights="model.hf m",
                                      processor={"patch_size": 14, "merge_size": 4})
    assert problems == [
        "model.hf m: model vision patch_size is 16, task_encoder.model 'qwen2_5_vl' uses 14",
        "model.hf m: its processor's merge_size is 4, task_encoder.model 'qwen2_5_vl' uses 2"]
    with pytest.raises(ConfigError) as info:
        check_compatible(model, te)
    assert info.value.problems == [
        "model vision patch_size is 16, task_encoder.model 'qwen2_5_vl' uses 14"]


def test_token_ids_and_vocabulary():
    model = tiny("qwen2_5_vl")
    te = TaskEncoderConfig(model="qwen2_5_vl")
    encoder = encoder_like(model)
    encoder.image_pad += 1
    tokenizer = Tokenizer(range(model.lm.vocab_size + 1))
    with pytest.raises(UsageError) as info:
        check_compatible(model, te, weights="model.hf m", tokenizer=tokenizer, encoder=encoder,
                         token_ids=("image_token_id",))
    assert str(info.value) == (
        f"model.hf m: its image_token_id is {model.image_token_id}, task_encoder.tokenizer "
        f"gives {encoder.image_pad}: they do not belong together; model.hf m: tokenizer has "
        f"{len(tokenizer)} tokens, model.lm.vocab_size is {model.lm.vocab_size}")
    # a model built from the run config takes the tokenizer's ids: only the vocabulary counts
    with pytest.raises(UsageError, match="^tokenizer has .* model.lm.vocab_size is"):
        check_compatible(model, te, tokenizer=tokenizer, encoder=encoder)
    check_compatible(model, te, tokenizer=Tokenizer(range(3)), encoder=encoder)


def test_profile_for_an_hf_models_family():
    assert profile_for("nemotron_omni", "nemotron-omni-tiled") == "nemotron_omni_tiled"
    assert profile_for("nemotron_omni", "qwen2_5_vl") == "nemotron_omni"
    assert profile_for("qwen3_vl", None) == "qwen3_vl"
    assert profile_for("qwen2_5_vl", "no such") == "qwen2_5_vl"


def test_every_vision_token_id_of_an_hf_config_is_its_tokenizers():
    """model.hf's video / vision-start / vision-end ids were replaced by the tokenizer's without
    a word (only the image id was compared): each is compared, the line names the config.json
    key, its value and the tokenizer's; a key the config lacks is its class's default."""
    from recipes.compatibility import hf_token_problems

    model = tiny("qwen2_5_vl")
    config = {"image_token_id": model.image_token_id, "video_token_id": model.video_token_id,
              "vision_start_token_id": model.vision_start_token_id}
    assert hf_token_problems("m/config.json", config, model, encoder_like(model)) == []
    encoder = encoder_like(model)
    encoder.video_pad, encoder.vision_start, encoder.vision_end = 6, 3, 4
    assert hf_token_problems("m/config.json", config, model, encoder) == [
        f"m/config.json: video_token_id {model.video_token_id}, but its tokenizer's video_pad "
        "token is 6: a tokenizer of another model (give the model's own, or none)",
        f"m/config.json: vision_start_token_id {model.vision_start_token_id}, but its "
        "tokenizer's vision_start token is 3: a tokenizer of another model (give the model's "
        "own, or none)",
        f"m/config.json: vision_end_token_id (not set: the default {model.vision_end_token_id}), "
        "but its tokenizer's vision_end token is 4: a tokenizer of another model (give the "
        "model's own, or none)"]
    nemotron = dataclasses.replace(tiny("nemotron_omni"), vision_start_token_id=-1,
                                   vision_end_token_id=-1)  # as from_hf_config: no model's ids
    encoder = encoder_like(nemotron)
    encoder.vision_start, encoder.vision_end = 7, 8
    assert hf_token_problems("n/config.json", {"img_context_token_id": nemotron.image_token_id},
                             nemotron, encoder) == []
    encoder.image_pad = encoder.video_pad = nemotron.image_token_id + 1
    assert [p.split(",")[0] for p in hf_token_problems(
        "n/config.json", {"img_context_token_id": nemotron.image_token_id}, nemotron,
        encoder)] == [f"n/config.json: img_context_token_id {nemotron.image_token_id}",
                      f"n/config.json: video_token_id (not set: the default "
                      f"{nemotron.video_token_id})"]
