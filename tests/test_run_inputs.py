"""Run inputs that are refused, or read as given, before any model is built (issue 45): the
command line's text for string keys, value ranges, bounded YAML, blend weights, budgets against
the model, the make targets an error names. Each runs in this process (config loading, or
train.py's / eval.py's ``main`` up to its one-line error)."""

from __future__ import annotations

import pytest

from recipes.run_config import ConfigError, load_run_config
from tests.test_train import MANTIS_CFG


# ------------------------------------------------------------------ the command line's text
@pytest.mark.parametrize("typed, kept", [("0010", "0010"), ("no", "no"), ("exp #2", "exp #2"),
                                         ("1e3", "1e3"), ("[a]", "[a]")])
def test_string_keys_keep_the_text_given(typed, kept):
    """``out=0010`` is the folder ``0010`` (not 8), ``out=no`` not ``False``, ``out='exp #2'``
    not ``exp``: every string key keeps the command line's text; other keys read YAML."""
    cfg = load_run_config(MANTIS_CFG, [f"out={typed}", f"data.path={typed}",
                                       f"checkpoint.dir={typed}", f"data.split_part={typed}",
                                       "train.steps=0012", "log.tensorboard=no"])
    assert (cfg.out, cfg.data.path, cfg.checkpoint.dir, cfg.data.split_part) == (kept,) * 4
    assert cfg.train.steps == 12 and cfg.log.tensorboard is False


def test_null_is_none_where_a_string_key_allows_it():
    cfg = load_run_config(MANTIS_CFG, ["checkpoint.dir=null", "task_encoder.tokenizer=~",
                                       "out=null"])
    assert cfg.checkpoint.dir is None and cfg.task_encoder.tokenizer is None
    assert cfg.out == "null"  # out takes no null: the text


def test_a_choice_key_names_its_values():
    """``model.recompute=yes``: the allowed values, not "expected str, got True"; the same
    in a YAML file (where yes is a boolean) says to quote it."""
    with pytest.raises(ConfigError) as typed:
        load_run_config(MANTIS_CFG, ["model.recompute=yes"])
    assert "none" in str(typed.value) and "selective" in str(typed.value), typed.value
    assert "'yes'" in str(typed.value)


def test_quotes_left_by_a_shell_spell_the_string():
    cfg = load_run_config(MANTIS_CFG, ["out='exp #2'", 'data.path="0010"', "data.split_part='a"])
    assert (cfg.out, cfg.data.path, cfg.data.split_part) == ("exp #2", "0010", "'a")


# ------------------------------------------------------------------ value ranges
def test_optimizer_and_loader_values_out_of_range_are_one_line(capsys):
    """A NaN learning rate, beta1 1.5, eps -1, a NaN weight decay, num_workers -1 (errors after
    the model was built before, two of them SIGABRT): every one named, in one line, before
    anything is built."""
    from tests.test_train import main_error

    bad = {"train.lr": "nan", "train.min_lr": "-1", "train.adam_beta1": "1.5",
           "train.adam_beta2": "inf", "train.adam_eps": "-1", "train.weight_decay": "nan",
           "train.clip_grad": "-inf", "train.warmup_steps": "-2", "train.seed": "-5",
           "data.num_workers": "-1", "data.shuffle_buffer_size": "-3",
           "data.max_samples_per_sequence": "0", "data.seed_offset": str(2**40),
           "parallel.ep": "0", "parallel.etp": "0", "checkpoint.interval": "-1",
           "train.lr_vision_model": "1e+39"}  # within float64, not a float32 update
    line = main_error(capsys, str(MANTIS_CFG), *(f"{k}={v}" for k, v in bad.items()))
    for key, value in bad.items():
        assert f"{key} must be" in line and f"got {value}" in line, (key, line)
    assert "train.lr must be a finite number >= 0, got nan" in line
    assert "train.adam_beta1 must be a finite number >= 0 and < 1, got 1.5" in line
    assert "train.lr_vision_model must be <= 1e+30 (a larger rate overflows float32" in line


def test_the_boundaries_of_the_ranges_load():
    cfg = load_run_config(MANTIS_CFG, ["train.lr=0", "train.min_lr=0", "train.adam_beta1=0",
                                       "train.weight_decay=0", "train.clip_grad=0",
                                       "data.num_workers=0", "train.warmup_steps=0"])
    assert cfg.train.lr == 0.0 and cfg.data.num_workers == 0


# ------------------------------------------------------------------ bounded YAML
BOMB = "\n".join([f"l0: &l0 [{', '.join(['x'] * 10)}]"] + [
    f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)])  # 10^9 values


def test_yaml_anchor_bombs_are_refused_at_once(tmp_path, mantis_out, capsys):
    """An anchor bomb (10^9 values in 9 lines: 7.6 GB and 53 s, then MemoryError before) in a run
    config, a model base YAML, a metadataset or a command-line value: one line naming the file,
    at once; a value a problem shows is cut."""
    import time

    from tests.test_train import main_error

    config = tmp_path / "bomb.yaml"
    config.write_text(MANTIS_CFG.read_text().replace(  # a list value that is used
        "\nmodel:", f"\n{BOMB}\nmodel:\n  peft: lora\n  lora: {{target_modules: *l8}}", 1))
    base = tmp_path / "base.yaml"
    base.write_text(f"{BOMB}\nfamily: qwen2_5_vl\n")
    blend = tmp_path / "metadataset.yaml"
    nested = "".join(f"\n        {line}" for line in BOMB.splitlines())  # in a subflavor
    blend.write_text((mantis_out / "metadataset.yaml").read_text().replace(
        "\n      subflavors:", f"\n      subflavors:{nested}", 1).replace(
        "path: .", f"path: {mantis_out}"))
    data = f"data.path={mantis_out}/metadataset.yaml"
    start = time.monotonic()
    line = main_error(capsys, str(config), data)
    assert f"config {config}: not valid YAML" in line and "100000 values" in line, line
    line = main_error(capsys, str(MANTIS_CFG), data, f"model.base={base}")
    assert f"model.base: {base} is not valid YAML" in line and "aliases" in line, line
    line = main_error(capsys, str(MANTIS_CFG), f"data.path={blend}")
    assert f"data path {blend} is unreadable" in line and "aliases" in line, line
    bomb_value = "[" + ", ".join(["&a [x, x, x, x, x, x, x, x, x, x]"] + ["*a"] * 20000) + "]"
    line = main_error(capsys, str(MANTIS_CFG), data, f"model.lora.target_modules={bomb_value}",
                      "model.peft=lora")
    assert "model.lora.target_modules: expected a list of str, got '[&a" in line, line
    assert len(line) < 1000 and time.monotonic() - start < 60, line


def test_anchors_within_the_bounds_load():
    from contract.bounded_yaml import YAMLTooLarge, safe_load

    assert safe_load("a: &a {x: 1}\nb: {<<: *a, y: 2}\nc: [*a, *a]") == {
        "a": {"x": 1}, "b": {"x": 1, "y": 2}, "c": [{"x": 1}, {"x": 1}]}
    with pytest.raises(YAMLTooLarge):
        safe_load(BOMB)
    with pytest.raises(YAMLTooLarge, match="nested deeper"):
        safe_load("[" * 1000 + "]" * 1000)  # past the composer's recursion too
    with pytest.raises(YAMLTooLarge, match="nested deeper"):
        safe_load("&a [*a]")  # a value that holds itself


def test_a_long_value_in_a_problem_is_cut():
    with pytest.raises(ConfigError) as info:
        load_run_config(MANTIS_CFG, ["train.steps=[" + ",".join(["1"] * 5000) + "]"])
    assert "train.steps: expected int, got '[1,1,1," in str(info.value)
    assert "characters)" in str(info.value) and len(str(info.value)) < 300, str(info.value)


# ------------------------------------------------------------------ blend weights
@pytest.mark.parametrize("weight", ["0", "-1", ".nan", ".inf", "abc", "true", "'3'"])
def test_blend_weights_that_energon_refuses_are_one_line(weight, tmp_path, mantis_out, capsys):
    """A blend weight 0 (what the converter's comment invited), negative, NaN, inf or text
    failed after the model was built with an Energon traceback: refused when the data path is
    checked, naming the file, the member and the fix."""
    from tests.test_train import main_error

    blend = tmp_path / "metadataset.yaml"
    text = (mantis_out / "metadataset.yaml").read_text().replace("path: .", f"path: {mantis_out}")
    first = text.index("weight: ") + len("weight: ")
    blend.write_text(text[:first] + weight + text[text.index("\n", first):])
    line = main_error(capsys, str(MANTIS_CFG), f"data.path={blend}")
    assert f"{blend}: splits.train.blend[0].weight: " in line, line
    assert "is not a positive finite number" in line and "delete its member" in line, line


# ------------------------------------------------------------------ errors that say the fix
def test_data_errors_say_how_to_get_a_dataset(tmp_path, sources, capsys):
    """A missing / unset data.path names the make target that converts it and DATA= /
    DATA_ROOT=; a source dataset's folder (a hub download) names the conversion of it."""
    from tests.test_train import main_error

    line = main_error(capsys, str(MANTIS_CFG), f"data.path={tmp_path}/mantis/metadataset.yaml")
    assert f"data.path {tmp_path}/mantis/metadataset.yaml does not exist: convert one with " \
           "make prepare-mantis" in line and "DATA=" in line and "DATA_ROOT=" in line, line
    line = main_error(capsys, str(MANTIS_CFG), "data.path=")
    assert "data.path is not set: convert one with make prepare-<dataset> (mantis, infovqa, " \
           "llava-video)" in line, line
    for dataset, folder in sources.items():
        line = main_error(capsys, str(MANTIS_CFG), f"data.path={folder}")
        assert f"data.path {folder} is not an Energon dataset" in line, line
        assert f"make prepare-{dataset} SOURCE={folder} writes data/<dataset>" in line, line
        assert f"--source {folder} --out data/{dataset}" in make_plan(f"prepare-{dataset}",
                                                                      f"SOURCE={folder}")


# ------------------------------------------------------------------ model.hf's token ids
@pytest.mark.slow
def test_model_hf_vision_token_ids_are_checked_before_the_model(tmp_path, mantis_out, capsys):
    """A model.hf whose config.json names a video id the tokenizer gives another id, and lacks
    its vision-end id (the class default then): one line naming each key, before anything is
    imported or built (they were silently replaced by the tokenizer's before)."""
    import json

    from lookalikes.models import TEST_TOKENIZER_QWEN, build_tiny_hf_model
    from tests.test_train import FAST, main_error

    hf = build_tiny_hf_model("qwen2_5_vl", tmp_path / "hf", pixels=(3136, 6272))
    config = json.loads((hf / "config.json").read_text())
    config["video_token_id"] = 151656
    del config["vision_end_token_id"]
    (hf / "config.json").write_text(json.dumps(config))
    line = main_error(capsys, str(MANTIS_CFG), f"model.hf={hf}", *FAST,
                      f"data.path={mantis_out}/metadataset.yaml", f"out={tmp_path / 'run'}",
                      f"train.hf_import_cache={tmp_path / 'cache'}")
    assert line.startswith(f"train.py: error: model.hf {hf}: {hf / 'config.json'}: "
                           "video_token_id 151656, but its tokenizer's video_pad token is "
                           f"{TEST_TOKENIZER_QWEN['video_token_id']}"), line
    assert "vision_end_token_id (not set: the default 151653), but its tokenizer's vision_end " \
           f"token is {TEST_TOKENIZER_QWEN['vision_end_token_id']}" in line, line
    assert "image_token_id" not in line and not (tmp_path / "cache").exists()


# ------------------------------------------------------------------ sequence length
def test_seq_length_beyond_the_models_positions_is_refused(mantis_out, capsys):
    """task_encoder.seq_length 1e9 ran the loader into 43 allocation failures counted as sample
    skips: now compared with the model's positions before anything is built."""
    from tests.test_train import main_error

    line = main_error(capsys, str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
                      "task_encoder.seq_length=1000000000")
    assert line.endswith("task_encoder.seq_length 1000000000 is more than the model's 4096 "
                         "positions (model.lm.max_position_embeddings): lower it"), line


def test_a_failed_allocation_in_the_loader_is_no_sample_skip(mantis_out, tmp_path, capsys):
    """A batch the loader cannot allocate (here 2^50 tokens a row: the allocator refuses at
    once) ends the run in one line naming what sizes it (exit 1), never counted as skips that
    blame the budget."""
    import sys

    from tests.test_train import REPO

    sys.path.insert(0, str(REPO))
    import train as script

    capsys.readouterr()
    code = script.main([str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
                        f"out={tmp_path}", "data.num_workers=0", "task_encoder.fixed_length=true",
                        f"task_encoder.seq_length={2**50}",
                        f"model.lm.max_position_embeddings={2**51}"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code == 1 and last.startswith("train.py: error: the data loader could not allocate "
                                         "memory ("), err[-3000:]
    assert "lower train.micro_batch_size or task_encoder.seq_length" in last
    assert "skipped" not in last and err.count("Traceback") == 0, err[-3000:]


# ------------------------------------------------------------------ sizes bounded by the model
def test_lora_rank_and_alpha_are_bounded_by_the_model():
    """A LoRA rank of 10^8 allocated 25.6 GB before failing, and alpha 0 trained nothing
    without a word: the rank is at most the narrowest adapted part's width (the tiny model's
    LM: 64, its tower: 32), alpha is no 0, in the config's one line."""
    lora = ["model.peft=lora"]
    assert load_run_config(MANTIS_CFG, [*lora, "model.lora.rank=64"]).lora.rank == 64
    with pytest.raises(ConfigError) as info:
        load_run_config(MANTIS_CFG, [*lora, "model.lora.rank=100000000", "model.lora.alpha=0"])
    assert info.value.problems == [
        "model.lora.rank 100000000 is more than the 64 features of the narrowest adapted part "
        "(language_model): at most 64",
        "model.lora.alpha must be a finite number other than 0, got 0.0 (the update is scaled "
        "by alpha / rank: 0 trains nothing; default 32)"]
    with pytest.raises(ConfigError, match=r"rank 33 is more than the 32 features of the "
                                          r"narrowest adapted part \(vision_model\)"):
        load_run_config(MANTIS_CFG, [*lora, "model.lora.rank=33",
                                     "model.lora.parts=[language_model,vision_model]",
                                     "model.freeze_vision_model=true"])


def test_a_micro_batch_beyond_the_split_is_refused(mantis_out, capsys):
    """train.micro_batch_size 10^9 buffered 6.7 GB of samples before failing: a micro-batch of
    more samples than the split holds is one line before anything is built."""
    from recipes.data import split_samples
    from tests.test_train import main_error

    data = f"{mantis_out}/metadataset.yaml"
    samples = split_samples(data, "train")
    assert samples == split_samples(str(mantis_out), "train") > 8
    line = main_error(capsys, str(MANTIS_CFG), f"data.path={data}",
                      "train.micro_batch_size=1000000000")
    assert line.endswith(f"train.micro_batch_size 1000000000 is more than the {samples} "
                         f"samples of split 'train' of data.path {data}: a micro-batch would "
                         "repeat them; lower it"), line


# ------------------------------------------------------------------ a budget without images
@pytest.mark.slow
def test_a_budget_that_drops_every_image_is_said(mantis_out, tmp_path):
    """max_visual_tokens 1 skips every sample with an image: the run trains the VLM on text
    only, which only per-step skip counters showed. The first-batch probe says it in one line,
    the step lines say "text only", metrics.jsonl has text_only 1."""
    from tests.test_train import FAST, ok, records, train

    proc = train(str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", f"out={tmp_path}",
                 *FAST, "train.steps=2", "train.eval_interval=0", "train.micro_batch_size=1",
                 "task_encoder.max_visual_tokens=1")
    ok(proc)
    warned = [line for line in proc.stdout.splitlines() if "dropped every image" in line]
    assert warned[0].startswith("[train] warning: the budget dropped every image and video of "
                                "the first ") and "skipped_too_many_visual_tokens" in warned[0]
    assert all("text only (the budget dropped every image: " in line for line in warned[1:])
    assert len(warned) == 3 and [r["text_only"] for r in records(tmp_path)] == [1, 1]
    assert "vision_dp_over_cp" not in proc.stdout + proc.stderr  # no stray line at CP = 1


# ------------------------------------------------------------------ families and make targets
NEMOTRON_CFG = MANTIS_CFG.parent / "train_nemotron_omni_mantis.yaml"


def make_plan(*args: str) -> str:
    """``make -n <args>``: the commands a make target would run (it must exist)."""
    import subprocess

    from tests.test_train import REPO

    proc = subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_train_config_keeps_its_family_unless_told(tmp_path):
    """``make train-nemotron-omni-mantis HF=<a Qwen model>`` trained Qwen into
    runs/nemotron_omni_mantis without a word: one line naming both families, the make target
    that fits (it exists) and the word that keeps it (model.family=)."""
    from lookalikes.models import build_tiny_hf_model

    hf = build_tiny_hf_model("qwen2_5_vl", tmp_path / "hf", pixels=(3136, 6272))
    with pytest.raises(ConfigError) as info:
        load_run_config(NEMOTRON_CFG, [f"model.hf={hf}"])
    config = NEMOTRON_CFG
    assert str(info.value) == (
        f"model.hf {hf} is a qwen2_5_vl model, but {config} trains nemotron_omni: use make "
        f"train-qwen-vl-mantis HF={hf}, or add model.family=qwen2_5_vl to train it with this "
        "config")
    assert f"train.py configs/train_qwen_vl_mantis.yaml data.path=data/mantis/metadataset.yaml " \
           f"model.hf={hf}" in make_plan("train-qwen-vl-mantis", f"HF={hf}")
    told = load_run_config(NEMOTRON_CFG, [f"model.hf={hf}", "model.family=qwen2_5_vl"])
    assert (told.model.family, told.task_encoder.model) == ("qwen2_5_vl", "qwen2_5_vl")
    qwen = load_run_config(MANTIS_CFG.parent / "train_qwen3_5_moe_mantis.yaml", [f"model.hf={hf}"])
    assert qwen.model.family == "qwen2_5_vl"  # within the qwen-vl make family: as before


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                                    "qwen3_5_moe", "nemotron_omni"])
def test_make_eval_takes_every_family_its_train_target_trains(family, tmp_path, capsys):
    """``make eval-qwen-vl-*`` refused a Qwen3.5 run of ``make train-qwen-vl-* HF=<Qwen3.5>``,
    naming a make target that does not exist: each family is taken by the eval target of its
    make family; a refusal names a target that exists."""
    from types import SimpleNamespace

    import eval as eval_script
    from contract.errors import UsageError
    from contract.families import MAKE_FAMILIES

    (tmp_path / "summary.json").write_text('{"dataset": "mantis"}')
    found = SimpleNamespace(model_config=SimpleNamespace(family=family), path=tmp_path / "run",
                            run_config={"data": {"path": str(tmp_path / "metadataset.yaml")}})
    ours = MAKE_FAMILIES[family]
    eval_script.check_expected(found, f"configs/train_{ours.replace('-', '_')}_mantis.yaml")
    other = "nemotron_omni" if ours == "qwen-vl" else "qwen_vl"
    with pytest.raises(UsageError) as info:
        eval_script.check_expected(found, f"configs/train_{other}_infovqa.yaml")
    assert f"use make eval-{ours}-mantis CKPT={found.path} " in str(info.value), info.value
    assert f"--ckpt {found.path} --expect configs/train_{ours.replace('-', '_')}_mantis" \
        in make_plan(f"eval-{ours}-mantis", f"CKPT={found.path}")


def test_the_make_families_are_the_makefiles():
    """The make families an error names (``contract.families.MAKE_FAMILIES``) are the Makefile's
    ``FAMILIES``, and its ``DATASETS`` the converters' datasets (``make prepare-<dataset>``)."""
    from contract.families import FAMILIES, MAKE_FAMILIES
    from recipes.data import _datasets
    from recipes.make_targets import _make_lists

    lists = _make_lists()
    assert set(MAKE_FAMILIES) == set(FAMILIES)
    assert sorted(set(MAKE_FAMILIES.values())) == sorted(lists["FAMILIES"])
    assert list(_datasets()) == list(lists["DATASETS"])


# ------------------------------------------------------------------ the command line's order
def test_resume_before_the_overrides_says_to_put_it_last(mantis_out, capsys):
    """``train.py CONFIG --resume train.steps=40``: click reads train.steps=40 as --resume's
    checkpoint; one line says so and to put --resume last."""
    from tests.test_train import main_error

    line = main_error(capsys, str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
                      "--resume", "train.steps=40")
    assert line == ("train.py: error: --resume train.steps=40: that is a key=value override, "
                    "read as --resume's checkpoint because it follows --resume: put --resume "
                    "last (or write --resume=CKPT)")
