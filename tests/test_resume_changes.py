"""``--resume`` with changes (recipes/resume.py): the checkpoint's model is the one resumed, a
conflicting ``model.*`` value, another layout or another loader shape is one line (exit 2)
before any process group; another data path resumes with a fresh loader and says so; and
``train.init_checkpoint`` takes the step folder a run printed (= its ``model_optim``)."""

from __future__ import annotations

import shutil

import pytest
import yaml

from tests.test_train import (  # noqa: F401 - the session's reference run is a fixture
    FAST,
    MANTIS_CFG,
    losses,
    main_error,
    mantis_reference,
    ok,
    train,
)


@pytest.fixture
def step(mantis_reference, tmp_path):  # noqa: F811 - the fixture above
    """A copy of the reference run's step-2 checkpoint (saved at num_workers 0, tp 1)."""
    step = tmp_path / "ckpt" / "step_000002"
    shutil.copytree(mantis_reference / "checkpoints" / "step_000002", step)
    return step


def resume_error(capsys, mantis_out, tmp_path, step, *args, env=None) -> str:
    return main_error(capsys, str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
                      f"out={tmp_path / 'out'}", *FAST, *args, "--resume", str(step), env=env)


@pytest.mark.slow
def test_conflicting_model_layout_and_loader_are_one_line(capsys, mantis_out, tmp_path, step):
    line = resume_error(capsys, mantis_out, tmp_path, step, "model.lm.num_layers=3")
    assert "model.lm.num_layers=2" in line and "model.lm.num_layers=3" in line, line
    line = resume_error(capsys, mantis_out, tmp_path, step, "parallel.tp=2",
                        env={"WORLD_SIZE": "2"})
    assert "parallel.tp=1" in line and "parallel.tp=2" in line, line
    assert f"train.init_checkpoint={step}" in line, line
    line = resume_error(capsys, mantis_out, tmp_path, step, "data.num_workers=2")
    assert "data.num_workers=0" in line and "data.num_workers=2" in line, line
    assert not (tmp_path / "out" / "config.yaml").exists()  # nothing written before the refusal


@pytest.mark.slow
def test_model_comes_from_the_checkpoint_and_a_new_data_path_starts_fresh(mantis_out, tmp_path,
                                                                          step):
    """The file's model differs (model.lm.num_layers refined in a copy of the config): the
    checkpoint's model is resumed and written to config.yaml; another data path (a copy of the
    dataset) restarts the loader and says so; a longer train.steps is honoured."""
    config = yaml.safe_load(MANTIS_CFG.read_text())
    config["model"]["lm"]["num_layers"] = 3
    other_cfg = tmp_path / "other.yaml"
    other_cfg.write_text(yaml.safe_dump(config))
    data = tmp_path / "data"
    shutil.copytree(mantis_out, data)
    out = tmp_path / "out"
    proc = train(str(other_cfg), f"data.path={data}/metadataset.yaml", f"out={out}",
                 "train.steps=3", *FAST, "--resume", str(step))
    ok(proc)
    assert "the loader starts fresh on the new data" in proc.stdout
    assert "train.steps changed (4 -> 3)" in proc.stdout
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["lm"]["num_layers"] == 2
    assert len(losses(out)) == 1


@pytest.mark.slow
def test_init_checkpoint_takes_the_step_folder(mantis_out, tmp_path, step):
    """``train.init_checkpoint=<step folder>`` starts from the same weights as
    ``<step folder>/model_optim``: equal first losses."""
    runs = {}
    for name, init in (("step", step), ("model_optim", step / "model_optim")):
        out = tmp_path / name
        ok(train(str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", f"out={out}",
                 "train.steps=1", f"train.init_checkpoint={init}", *FAST))
        runs[name] = losses(out)
    assert runs["step"] == runs["model_optim"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_reader_that_skips_everything_ends_in_one_line(mantis_out, tmp_path, nproc):
    """2 of the 38 mantis lookalike samples fit in 32 tokens: the probe finds one, then a loader
    worker (data.num_workers=1) meets max_skips_in_a_row skips in a row: one line, exit 2,
    never a reader that spins while the other ranks wait (DP=2: the rank whose reader gives up
    ends the run, the peer waiting in a collective is stopped; a hang would time out)."""
    from tests.test_train import error_line

    line = error_line(train(str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
                            f"out={tmp_path}", "train.steps=200", "log.tensorboard=false",
                            "data.num_workers=1", "task_encoder.seq_length=32",
                            "task_encoder.max_skips_in_a_row=20", nproc=nproc, timeout=180))
    assert "20 samples in a row skipped by one data reader" in line, line
    assert "skipped_too_long=" in line and "max_skips_in_a_row" in line, line
