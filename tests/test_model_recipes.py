"""configs/recipes/ (recipes/model_recipes.py): a run whose ``model.hf`` has a published shape
gets that model's recipe (values under the command line's, its layout for the run's GPUs, the
global batch kept by grad_accum), a run of a real model with CPU-demo values is warned in one
line, every recipe value names its source, every recipe is the one of its model YAML, and every
layout (and every shipped real-size train config) fits its GPUs by the memory estimate."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from contract.errors import ConfigError
from recipes.run_config import load_run_config
from tests.conftest import REPO

MANTIS = REPO / "configs" / "train_qwen_vl_mantis.yaml"
RECIPES = REPO / "configs" / "recipes"
GPU_GIB = 78.0  #: what torch reports of an 80 GB H100, about (the recipes' layouts fit it)


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory) -> Path:
    """A model folder of Qwen2.5-VL-7B's published shape (config.json as the export writes it
    for configs/qwen2_5_vl_7b.yaml, the test tokenizer's token ids) with the tiny folder's
    tokenizer and processor files: what ``model.hf`` reads before any weight (none is loaded
    here)."""
    from lookalikes.models import TEST_TOKENIZER_QWEN, build_tiny_hf_model
    from models.families.qwen_vl.config import load_yaml, to_hf_dict

    folder = build_tiny_hf_model("qwen2_5_vl", tmp_path_factory.mktemp("qwen7b") / "hf")
    tiny = json.loads((folder / "config.json").read_text())
    config = to_hf_dict(load_yaml(REPO / "configs" / "qwen2_5_vl_7b.yaml"))
    config.update(TEST_TOKENIZER_QWEN)
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        config["text_config"][key] = tiny["text_config"][key]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_published_shape_gets_its_recipe_under_the_command_line(qwen7b):
    cfg = load_run_config(MANTIS, [f"model.hf={qwen7b}"], world=8)
    assert cfg.recipe == "qwen2_5_vl_7b"
    assert (cfg.train.lr, cfg.train.min_lr, cfg.task_encoder.seq_length) == (5e-6, 1e-6, 8192)
    assert (cfg.task_encoder.min_pixels, cfg.task_encoder.max_pixels) == (200704, 1003520)
    assert cfg.checkpoint.interval == 500 and cfg.data.num_workers == 2
    assert cfg.parallel.tp == 4  # the recipe's layout of 8 GPUs
    assert cfg.train.grad_accum == 32 // (1 * 2)  # global batch 32 over DP 2
    assert cfg.notes[0].startswith("recipe qwen2_5_vl_7b (configs/recipes/qwen2_5_vl_7b.yaml; "
                                   "layout of 8 GPU(s))")
    assert not any("warning" in note for note in cfg.notes)
    # the command line wins over the recipe, key by key; the layout follows the GPU count
    mine = load_run_config(MANTIS, [f"model.hf={qwen7b}", "train.lr=1e-5", "parallel.tp=2"],
                           world=16)
    assert (mine.train.lr, mine.parallel.tp, mine.train.min_lr) == (1e-5, 2, 1e-6)
    assert mine.train.grad_accum == 32 // 8
    # the resolved config says which recipe resolved it and is never resolved again
    from recipes.run_config import dump_yaml

    text = dump_yaml(cfg)
    assert text.startswith("# resolved with recipe qwen2_5_vl_7b")
    assert yaml.safe_load(text)["recipe"] == "none"


def test_recipe_refusals_are_one_line(qwen7b):
    with pytest.raises(ConfigError, match=r"recipe qwen2_5_vl_7b has no layout for 2 GPU\(s\): "
                                          r"its smallest fitting one is 4 GPUs") as error:
        load_run_config(MANTIS, [f"model.hf={qwen7b}"], world=2)
    assert "--suggest" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="train.global_batch_size 32 is not a multiple of "
                                          r"train.micro_batch_size x DP = 1 x 3"):
        load_run_config(MANTIS, [f"model.hf={qwen7b}"], world=12)  # layout of 4: DP 3
    with pytest.raises(ConfigError, match="recipe 'qwen9' is not one of configs/recipes/: "
                                          "nemotron_omni_30b_a3b, nemotron_omni_super_120b_a12b, "
                                          "qwen2_5_vl_3b"):
        load_run_config(MANTIS, [f"model.hf={qwen7b}", "recipe=qwen9"])
    with pytest.raises(ConfigError, match=r"train.grad_accum=3 disagrees with "
                                          r"train.global_batch_size 32"):
        load_run_config(MANTIS, [f"model.hf={qwen7b}", "train.grad_accum=3"], world=8)


def test_cpu_demo_values_on_a_real_model_are_one_warning_line(qwen7b, tmp_path):
    from lookalikes.models import build_tiny_hf_model

    cfg = load_run_config(MANTIS, [f"model.hf={qwen7b}", "recipe=none"], world=1)
    assert cfg.recipe is None and cfg.train.lr == 3e-3  # the config file's values kept
    warning, = cfg.notes
    assert warning.startswith("warning: a real model with CPU-demo values: train.lr=0.003 "
                              "(above 0.0001 on a model over 1B parameters")
    assert "checkpoint.interval=0" in warning and "task_encoder.seq_length=1024" in warning
    # a tiny model: no recipe matches; its small lr is no warning, the rest is
    tiny = build_tiny_hf_model("qwen2_5_vl", tmp_path / "tiny")
    cfg = load_run_config(MANTIS, [f"model.hf={tiny}"])
    assert cfg.recipe is None
    warning, = cfg.notes
    assert "train.lr" not in warning and "checkpoint.interval=0" in warning
    # no model.hf: the CPU demo as it is, nothing to say
    assert load_run_config(MANTIS).notes == ()


def _model_yamls() -> dict[str, object]:
    from models.families import config_from_dict

    found = {}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        if isinstance(raw, dict) and "family" in raw and "lm" in raw:
            found[path.stem] = config_from_dict(raw)
    return found


def test_every_recipe_is_its_model_yamls_and_names_a_source_per_value():
    """A recipe matches exactly one model YAML of configs/, the one of its own name; every value
    line of configs/recipes/ carries its source in a comment (on the line or just above)."""
    from recipes.model_recipes import all_recipes

    models = _model_yamls()
    for recipe in all_recipes():
        assert [name for name, cfg in models.items() if recipe.matches(cfg)] == [recipe.name]
    for path in RECIPES.glob("*.yaml"):
        lines = path.read_text().splitlines()
        inside = False
        for i, line in enumerate(lines):
            if re.match(r"^\w", line):
                inside = line.startswith("config:")
                continue
            value = re.match(r"^\s+\w+: [^{#\s]", line)
            if inside and value:
                assert "#" in line or lines[i - 1].strip().startswith("#"), f"{path.name}: {line}"


@pytest.mark.slow
def test_every_recipe_layout_and_real_size_config_fits_its_gpus():
    """Each recipe's layout of each GPU count, with the recipe applied at that count, fits
    ``GPU_GIB`` by the estimate; each shipped train config of a real-size model names its GPU
    count in its first line and fits it."""
    from recipes.estimate import Layout, estimate_layout, fits, run_table, uses_bf16
    from recipes.model_recipes import all_recipes

    def recipe_config(recipe, gpus: int | None):
        return load_run_config(recipe.mantis_config(), [
            f"model.base=configs/{recipe.name}.yaml", f"recipe={recipe.name}"], world=gpus)

    for recipe in all_recipes():
        table = run_table(recipe_config(recipe, None))
        assert recipe.layouts, recipe.name
        for gpus in recipe.layouts:
            cfg = recipe_config(recipe, gpus)
            estimates = estimate_layout(table, cfg, gpus, Layout.of(cfg), uses_bf16(cfg.train, 1))
            assert fits(estimates, GPU_GIB), (recipe.name, gpus, [e.line() for e in estimates])
    for path in sorted((REPO / "configs").glob("train_*.yaml")):
        first = path.read_text().splitlines()[0]
        stated = re.search(r"(\d+) x 80 GB GPUs", first)
        cfg = load_run_config(path, world=int(stated.group(1)) if stated else None)
        if 12 * cfg.model.lm.num_layers * cfg.model.lm.hidden_size ** 2 < 1e9:
            continue  # a tiny CPU config
        assert stated, f"{path.name}: its first line states no GPU count: {first}"
        gpus = int(stated.group(1))
        estimates = estimate_layout(run_table(cfg), cfg, gpus, Layout.of(cfg), True)
        assert fits(estimates, GPU_GIB), (path.name, [e.line() for e in estimates])
