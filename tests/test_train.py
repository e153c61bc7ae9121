"""train.py: config loading, schedule, bad input (exit 2), end-to-end runs, exact resume (also
after SIGTERM, with auto_resume), the run-folder and checkpoint refusals, validation loss,
DP=2 / CP=2 / PP=2 equivalence (tiny Qwen-VL and tiny Nemotron-Omni on the lookalike datasets).
The vision-signal check (media vs media blanked, loss and eval accuracy, both families) is
proved by ``make demo``, which fails unless it passes.

Input problems found before any process group is set up run train.py's ``main()`` in this
process; every other run is a process of its own: a fork of tests/runner.py's preloaded server
(no ~5-8 CPU-s of imports per run; torchrun's worker environment for DP / CP / PP / EP runs), or
the real ``python train.py`` (the reference run) / torchrun (tests/test_hf_journey.py's TP=2
run) command."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import signal
import sys
from pathlib import Path

import pytest
import yaml

from recipes.run_config import ConfigError, load_run_config, to_dict
from recipes.schedule import lr_at
from tests import runner

REPO = Path(__file__).resolve().parents[1]
MANTIS_CFG = REPO / "configs" / "train_qwen_vl_mantis.yaml"
NEMOTRON_MANTIS_CFG = REPO / "configs" / "train_nemotron_omni_mantis.yaml"
FAST = ["data.num_workers=0", "log.tensorboard=false", "checkpoint.save_final=false"]


def run_config(path, overrides=()):
    """The run config with the task encoder's config class, as train.py loads it."""
    return load_run_config(path, overrides)


def train(*args: str, nproc: int = 1, env: dict | None = None, timeout: int = 300,
          plain: bool = False):
    """Run train.py in a process of its own, like a user: a fork of tests/runner.py's preloaded
    server (torchrun's worker environment for nproc > 1), or with ``plain`` the real ``python
    train.py`` / ``torchrun --standalone`` command."""
    return runner.run("train.py", *args, nproc=nproc, env=env, timeout=timeout, plain=plain)


def records(out: Path, field: str = "loss") -> list[dict]:
    """The metrics.jsonl records of a run that hold ``field`` (training or val_loss ones)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if field in r]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in records(out)]


def ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def error_line(proc) -> str:
    """The one-line error of a run that must exit 2."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("train.py: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def main_error(capsys, *args: str, env: dict | None = None) -> str:
    """The one-line error (exit code 2, no traceback) of train.py's main() run in this process,
    for input problems found before any process group or model is set up (``env``: e.g. the
    WORLD_SIZE a launcher would set)."""
    sys.path.insert(0, str(REPO))
    import train as script

    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        code = script.main(list(args))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("train.py: error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


# ------------------------------------------------------------------ config
def test_config_loads_with_overrides():
    cfg = run_config(MANTIS_CFG, ["train.steps=7", "train.lr=1e-3", "model.lm.num_layers=1",
                                       "task_encoder.max_pixels=50176", "data.path=/x",
                                       "parallel.cp=2", "out=/tmp/o", "model.recompute=full",
                                       "parallel.ep=1", "train.distributed_optimizer=false"])
    assert (cfg.train.steps, cfg.train.lr, cfg.model.lm.num_layers) == (7, 1e-3, 1)
    assert cfg.model.recompute == "full" and not cfg.train.distributed_optimizer
    assert cfg.task_encoder.max_pixels == 50176 and cfg.data.path == "/x"
    assert cfg.task_encoder.context_parallel_size == 2  # follows parallel.cp
    assert to_dict(cfg)["train"]["steps"] == 7 and cfg.checkpoint_dir == Path("/tmp/o/checkpoints")
    # a value that is no YAML (here an alias-like layer pattern) is taken as text
    assert run_config(NEMOTRON_MANTIS_CFG, ["model.lm.pattern=*E-E"]).model.lm.pattern == "*E-E"


def test_model_base_override_swaps_the_model():
    """``model.base=`` on the command line replaces the file's inline (tiny) model, and the other
    ``model.*`` overrides refine the new base, whatever their order."""
    cfg = run_config(MANTIS_CFG, ["model.lm.num_layers=3", "model.base=configs/qwen2_5_vl_7b.yaml"])
    lm, vision = cfg.model.lm, cfg.model.vision
    assert (lm.hidden_size, lm.vocab_size, lm.num_layers, vision.depth) == (3584, 152064, 3, 32)
    assert run_config(MANTIS_CFG).model.lm.hidden_size == 64  # the file's own model otherwise


def test_config_errors_are_reported_together():
    with pytest.raises(ConfigError) as info:
        run_config(MANTIS_CFG, ["train.stepz=3", "data.num_workers=abc", "bogus=1",
                                     "task_encoder.max_pixelz=4", "model.lm.depth=2"])
    message = str(info.value)
    assert "\n" not in message
    for part in ("train.stepz", "data.num_workers", "bogus", "max_pixelz", "depth"):
        assert part in message, message


def test_config_files_all_load():
    for family in ("qwen_vl", "nemotron_omni"):
        for name in ("mantis", "infovqa", "llava_video"):
            cfg = run_config(REPO / "configs" / f"train_{family}_{name}.yaml")
            assert 10 <= cfg.train.steps <= 50
            assert cfg.model.family.startswith(family.split("_")[0])


def test_lr_warmup_then_cosine():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=2, total_steps=12)
    values = [lr_at(s, **kw) for s in range(12)]
    assert values[:2] == [0.5, 1.0] and values[2] == 1.0
    assert all(a >= b for a, b in zip(values[2:], values[3:]))
    assert math.isclose(lr_at(12, **kw), 0.1)


# ------------------------------------------------------------------ bad input: one line, exit 2
def test_bad_config_key_exits_2(capsys):
    assert "train.stepz" in main_error(capsys, str(MANTIS_CFG), "train.stepz=3")


def test_missing_and_empty_dataset_exit_2(tmp_path, capsys):
    assert "does not exist" in main_error(capsys, str(MANTIS_CFG), f"data.path={tmp_path}/nope")
    assert "is an empty folder" in main_error(capsys, str(MANTIS_CFG), f"data.path={tmp_path}")
    assert "not set" in main_error(capsys, str(MANTIS_CFG), "data.path=")


def test_impossible_layout_exits_2(mantis_out, capsys):
    data = f"data.path={mantis_out}/metadataset.yaml"
    line = main_error(capsys, str(MANTIS_CFG), data, "parallel.tp=2", env={"WORLD_SIZE": "3"})
    assert "not divisible by tp*pp*cp" in line
    line = main_error(capsys, str(MANTIS_CFG), data, "parallel.cp=2",
                      "task_encoder.seq_length=1020")
    assert "seq_length" in line and "multiple" in line


def test_unloadable_tokenizer_exits_2(mantis_out, tmp_path):
    """Found after the process group is set up: a process of its own (tests/runner.py)."""
    line = error_line(train(str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
                            f"out={tmp_path}", f"task_encoder.tokenizer={tmp_path}/no-such-folder"))
    assert "cannot load tokenizer" in line


def test_forced_kernel_that_cannot_run_exits_2(mantis_out, tmp_path):
    """``kernels.<kind>=<implementation>`` that cannot run here (models/kernels): one line, exit
    2, found when the kernels are chosen, before the model is built."""
    line = error_line(train(str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
                            f"out={tmp_path}", *FAST, "kernels.attention=flash_attn"))
    assert line == ("train.py: error: kernels.attention=flash_attn: flash-attn varlen needs a "
                    "CUDA device (this process runs on the CPU)")


def test_unreadable_checkpoint_and_all_skipped_exit_2(mantis_out, tmp_path, capsys):
    data = f"data.path={mantis_out}/metadataset.yaml"
    bad = tmp_path / "ckpt"
    bad.mkdir()
    (bad / "train_state.json").write_text("{not json")
    line = main_error(capsys, str(MANTIS_CFG), data, f"out={tmp_path}", "--resume", str(bad))
    assert "unreadable" in line
    # the first-batch probe runs after the process group is set up: a process of its own
    line = error_line(train(str(MANTIS_CFG), data, f"out={tmp_path}", *FAST,
                            "task_encoder.seq_length=16"))
    assert "skipped by the budget" in line and "skipped_too_long" in line


# ------------------------------------------------------------------ end to end
#: the reference run: 4 steps, checkpoints at 2 and 4, val_loss (2 val batches) at 2 and 4
REFERENCE = ["train.steps=4", "checkpoint.interval=2", "train.eval_interval=2",
             "train.eval_batches=2", *FAST]


@pytest.fixture(scope="session")
def mantis_reference(mantis_out, tmp_path_factory):
    """4 steps on mantis, checkpoint at step 2: the reference of resume and CP=2."""
    out = tmp_path_factory.mktemp("ref")
    proc = train(str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", f"out={out}",
                 *REFERENCE, plain=True)  # the real `python train.py` command, as a user runs it
    ok(proc)
    (out / "stdout.txt").write_text(proc.stdout)
    return out


@pytest.mark.slow
def test_mantis_run_logs_metrics_and_checkpoints(mantis_reference):
    logged = records(mantis_reference)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "step_time_s", "data_wait_s", "samples_per_s",
                "tokens_per_s", "visual_tokens_per_s", "images_per_s", "tflops_per_s",
                "peak_mem_gb", "budget"):
        assert key in logged[0], key
    assert logged[-1]["loss"] < logged[0]["loss"]
    assert logged[0]["visual_tokens_per_s"] > 0 and logged[0]["budget"]["samples"] > 0
    assert all(r["text_only"] == 0 for r in logged)  # images trained (tests/test_run_inputs.py)
    validation = records(mantis_reference, "val_loss")
    assert [r["step"] for r in validation] == [2, 4]
    assert validation[1]["val_loss"] < validation[0]["val_loss"]
    assert all(r["val_batches"] == 2 and r["val_loss_tokens"] > 0 for r in validation)
    step = mantis_reference / "checkpoints" / "step_000002"
    assert (mantis_reference / "checkpoints" / "latest").read_text().strip() == "step_000004"
    for part in ("model_optim/metadata.json", "loader/dp_00000.json", "rng/rank_00000.pt",
                 "train_state.json", "config.yaml", "COMPLETE"):
        assert (step / part).exists(), part
    stdout = (mantis_reference / "stdout.txt").read_text()
    assert "step 3/4" in stdout and "ETA" in stdout and "elapsed" in stdout
    assert "model:" not in stdout and (mantis_reference / "config.yaml").is_file()  # not dumped
    # the run folder's config is the fully resolved one (token ids from the tokenizer included):
    # the same text every checkpoint stores
    resolved = (mantis_reference / "config.yaml").read_text()
    assert resolved == (step / "config.yaml").read_text()
    assert "image_token_id: 5" in resolved  # the test tokenizer's <|image_pad|>, not the default
    assert "known third-party warning(s) hidden" in stdout
    assert ("[train] kernel attention: torch SDPA per segment (on CPU: the fast kernels need "
            "CUDA)") in stdout


def refusal(capsys, *args: str) -> str:
    """train.py's main() in this process, for refusals made before any setup: the one line."""
    sys.path.insert(0, str(REPO))
    import train as script

    assert script.main([str(MANTIS_CFG), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error:"), lines
    return lines[0]


@pytest.mark.slow
def test_refusals_of_run_folders_and_checkpoints(mantis_reference, mantis_out, tmp_path, capsys):
    """One line, exit 2, before the model is built: an out that holds a run (without --resume /
    --overwrite), a pickle planted where a state file should be (never unpickled), a checkpoint
    whose save did not complete."""
    from tests.test_checkpoint_integrity import reseal

    data = f"data.path={mantis_out}/metadataset.yaml"
    line = refusal(capsys, data, f"out={mantis_reference}", *FAST)
    assert "holds a run" in line and "--resume" in line and "--overwrite" in line
    assert "exclude" in refusal(capsys, data, f"out={tmp_path}", "--overwrite", "--resume")
    marker = tmp_path / "unpickled"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for state_file in ("loader/dp_00000.json", "rng/rank_00000.pt", "model_optim/.metadata"):
        step = tmp_path / state_file.split("/")[0] / "step_000002"
        shutil.copytree(mantis_reference / "checkpoints" / "step_000002", step)
        (step / state_file).write_bytes(pickle.dumps(Planted()))
        reseal(step)  # the checksums match: the restricted reader refuses it
        line = refusal(capsys, data, f"out={tmp_path / 'out'}", "--resume", str(step))
        assert "refused" in line and state_file.split("/")[-1] in line, line
    from models.convert import main as convert_main

    assert convert_main(["mcore-to-hf", "--mcore", str(step),  # it reads the same checkpoint
                         "--out", str(tmp_path / "export")]) == 2
    assert "refused" in capsys.readouterr().err
    assert not marker.exists()
    (step / "COMPLETE").unlink()
    line = refusal(capsys, data, f"out={tmp_path / 'out'}", "--resume", str(step))
    assert "incomplete" in line


@pytest.mark.slow
def test_sigterm_then_auto_resume_equals_uninterrupted(mantis_reference, mantis_out, tmp_path):
    """SIGTERM mid-run: a checkpoint at the next step boundary, one line, exit 0. Then
    ``train.auto_resume=true`` picks the newest COMPLETE checkpoint (not a half-written later
    one), metrics.jsonl holds each step once (a record the interrupted run wrote after its last
    checkpoint is replaced) and the losses equal the uninterrupted run's, bit for bit."""
    args = [str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", f"out={tmp_path}",
            *REFERENCE]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = runner.launch("train.py", *args, stdout=runner.PIPE, stderr=stderr)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[train] step 1/4 loss"):
                proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    stopped = [ln for ln in lines if "stopped by SIGTERM" in ln]
    assert len(stopped) == 1, "".join(lines)
    saved = int(stopped[0].split("after step ")[1].split("/")[0])
    assert saved < 4 and losses(tmp_path) == losses(mantis_reference)[:saved]
    ckpts = tmp_path / "checkpoints"
    half = ckpts / f"step_{saved + 1:06d}"  # a later save that did not complete
    shutil.copytree(ckpts / f"step_{saved:06d}", half)
    (half / "COMPLETE").unlink()
    with open(tmp_path / "metrics.jsonl", "a") as metrics:
        metrics.write(json.dumps({"step": saved + 1, "loss": 0.0}) + "\n")
    proc = train(*args, "train.auto_resume=true", "train.keep_checkpoints=1")
    ok(proc)
    assert f"resuming from {ckpts / f'step_{saved:06d}'}" in proc.stdout
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4]
    assert losses(tmp_path) == losses(mantis_reference)
    assert records(tmp_path, "val_loss") == records(mantis_reference, "val_loss")
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000004"]  # keep_checkpoints=1


@pytest.mark.slow
def test_resume_continues_exactly(mantis_reference, mantis_out, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(mantis_reference / "checkpoints" / "step_000002", out / "ckpt" / "step_000002")
    ok(train(str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", f"out={out}",
             "train.steps=4", *FAST, "--resume", str(out / "ckpt" / "step_000002")))
    assert losses(out) == losses(mantis_reference)[2:]  # bit-exact on CPU


@pytest.mark.slow
def test_resuming_a_finished_run_says_so_before_building(mantis_reference, mantis_out, capsys):
    """--resume of a run at its train.steps built everything and printed only ``done``: one line
    says it is finished and how to train more, nothing is built or written (exit 0)."""
    sys.path.insert(0, str(REPO))
    import train as script

    before = sorted(str(p.relative_to(mantis_reference)) for p in mantis_reference.rglob("*"))
    capsys.readouterr()
    assert script.main([str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
                        f"out={mantis_reference}", *REFERENCE, "--resume"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"[train] run {mantis_reference} is finished: {mantis_reference}/checkpoints/"
                   "step_000004 is step 4, train.steps is 4; to train more steps resume with a "
                   "larger train.steps=<N> (the LR schedule is laid over the new steps), or start "
                   "again with --overwrite"], out
    assert sorted(str(p.relative_to(mantis_reference))
                  for p in mantis_reference.rglob("*")) == before


def test_task_encoder_of_another_family_exits_2(mantis_out, tmp_path, capsys):
    line = main_error(capsys, str(NEMOTRON_MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
                      f"out={tmp_path}", "task_encoder.model=qwen2.5-vl",
                      "task_encoder.min_pixels=3136")
    assert "does not feed model.family 'nemotron_omni'" in line


@pytest.mark.slow
def test_resume_refuses_other_dp_size(mantis_reference, mantis_out, tmp_path, capsys):
    step = tmp_path / "step_000002"
    shutil.copytree(mantis_reference / "checkpoints" / "step_000002", step)
    state = json.loads((step / "train_state.json").read_text())
    state["layout"]["dp"] = 2
    (step / "train_state.json").write_text(json.dumps(state))
    from tests.test_checkpoint_integrity import reseal

    reseal(step)  # an edit its checksums record: the DP check is what refuses it
    line = main_error(capsys, str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
                      f"out={tmp_path}", "--resume", str(step))
    assert "data-parallel size 2" in line


@pytest.mark.slow
@pytest.mark.parametrize("family,fixture", [
    ("qwen_vl", "infovqa_out"), ("qwen_vl", "video_out"), ("nemotron_omni", "mantis_out"),
    ("nemotron_omni", "infovqa_out"), ("nemotron_omni", "video_out")])
def test_other_datasets_run(family, fixture, request, tmp_path):
    name = {"mantis_out": "mantis", "infovqa_out": "infovqa", "video_out": "llava_video"}[fixture]
    data = request.getfixturevalue(fixture)
    ok(train(str(REPO / "configs" / f"train_{family}_{name}.yaml"),
             f"data.path={data}/metadataset.yaml", f"out={tmp_path}", "train.steps=4", *FAST))
    logged = records(tmp_path)
    assert logged[-1]["loss"] < logged[0]["loss"]
    assert sum(r["visual_tokens_per_s"] for r in logged) > 0


@pytest.mark.slow
def test_cp2_equals_single_process(mantis_reference, mantis_out, tmp_path):
    ok(train(str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", f"out={tmp_path}",
             "train.steps=4", "checkpoint.interval=2", *FAST, "parallel.cp=2", nproc=2))
    for a, b in zip(losses(tmp_path), losses(mantis_reference), strict=True):
        assert abs(a - b) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_vl", "nemotron_omni", "qwen3_5", "qwen3_5_gathered"])
def test_cp2_equals_single_process_other_families(family, mantis_out, tmp_path):
    """Qwen3-VL under CP: each rank adds the DeepStack rows of its own zig-zag share.
    Nemotron-Omni ("M*M-"): the hybrid LM's attention layers under CP, its MLP layers per token,
    its Mamba layers by megatron's CP (all-to-all: the whole sequence, half the heads per rank).
    Qwen3.5: its Gated DeltaNet layers share their 2 key heads over the CP ranks (all-to-all:
    the whole sequence, one head group per rank); with 1 key head they gather the whole sequence
    (models.layers.gated_deltanet): both give one process's losses and gradient norms."""
    args = [f"data.path={mantis_out}/metadataset.yaml", "train.steps=3", *FAST]
    if family.startswith(("qwen3_vl", "qwen3_5")):
        base = family.removesuffix("_gathered")
        args = [str(MANTIS_CFG), *args, f"model.base=configs/{base}_tiny.yaml",
                "model.lm.vocab_size=640", f"task_encoder.model={base}"]
        if family.endswith("_gathered"):
            args.append("model.lm.linear_num_key_heads=1")
    else:
        args = [str(NEMOTRON_MANTIS_CFG), *args]
    ok(train(*args, f"out={tmp_path / 'one'}"))
    ok(train(*args, f"out={tmp_path / 'cp2'}", "parallel.cp=2", nproc=2))
    for a, b in zip(losses(tmp_path / "cp2"), losses(tmp_path / "one"), strict=True):
        assert abs(a - b) < 1e-4
    if family.startswith("qwen3_5"):  # the heads' parameter gradients, summed over CP
        norms = [[r["grad_norm"] for r in records(tmp_path / run, "grad_norm")]
                 for run in ("cp2", "one")]
        assert all(abs(a - b) < 1e-4 * b for a, b in zip(*norms, strict=True)), norms


@pytest.mark.slow
def test_dp2_equals_single_process(mantis_out, tmp_path):
    """DP=2 (distributed optimizer: state sharded over the 2 ranks) reproduces one process reading
    as 2 DP ranks, equals DP=2 with the plain optimizer, and resumes exactly."""
    args = [str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", "train.steps=3",
            "train.micro_batch_size=2", *FAST]
    ok(train(*args, f"out={tmp_path / 'one'}", "data.virtual_dp=2"))  # reads as 2 DP ranks
    ok(train(*args, f"out={tmp_path / 'two'}", "checkpoint.interval=2", nproc=2))
    ok(train(*args, f"out={tmp_path / 'plain'}", "train.distributed_optimizer=false", nproc=2))
    for a, b in zip(losses(tmp_path / "two"), losses(tmp_path / "one"), strict=True):
        assert abs(a - b) < 1e-4
    for a, b in zip(losses(tmp_path / "plain"), losses(tmp_path / "two"), strict=True):
        assert abs(a - b) < 1e-6
    step = tmp_path / "two" / "checkpoints" / "step_000002"
    ok(train(*args, f"out={tmp_path / 'resumed'}", "--resume", str(step), nproc=2))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "two")[2:]  # bit-exact on CPU


# ------------------------------------------------------------------ pipeline parallel
def test_unsupported_layouts_refused_exit_2(mantis_out, tmp_path, capsys):
    data, fixed = f"data.path={mantis_out}/metadataset.yaml", "task_encoder.fixed_length=true"
    line = main_error(capsys, str(MANTIS_CFG), data, "parallel.pp=2", env={"WORLD_SIZE": "2"})
    assert "parallel.pp > 1 needs task_encoder.fixed_length=true" in line
    line = main_error(capsys, str(MANTIS_CFG), data, fixed, "parallel.pp=2", "parallel.cp=2",
                      env={"WORLD_SIZE": "4"})
    assert "parallel.pp > 1 with parallel.cp > 1 is not supported" in line
    line = main_error(capsys, str(NEMOTRON_MANTIS_CFG), data, fixed, "parallel.pp=3",
                      env={"WORLD_SIZE": "3"})
    assert "parallel.pp 3 does not divide the 4 layers of model.lm.pattern" in line
    line = main_error(capsys, str(MANTIS_CFG), data, "task_encoder.packing=true", "parallel.cp=2",
                      env={"WORLD_SIZE": "2"})
    assert "parallel.cp > 1 with task_encoder.packing is not supported" in line
    line = main_error(capsys, str(MANTIS_CFG), data, "parallel.ep=2", env={"WORLD_SIZE": "2"})
    assert "parallel.ep 2 needs MoE layers" in line and "no experts" in line
    moe = "model.lm.pattern='*E-E'"
    line = main_error(capsys, str(NEMOTRON_MANTIS_CFG), data, moe, "parallel.ep=3",
                      env={"WORLD_SIZE": "3"})
    assert "expert count it divides (model.family 'nemotron_omni' has 8 experts)" in line
    line = main_error(capsys, str(NEMOTRON_MANTIS_CFG), data, moe, "parallel.ep=2",
                      env={"WORLD_SIZE": "2"})
    assert "parallel.ep > 1 on CPU needs task_encoder.fixed_length=true" in line
    line = main_error(capsys, str(NEMOTRON_MANTIS_CFG), data, moe, "parallel.ep=4", fixed,
                      env={"WORLD_SIZE": "2"})
    assert "not divisible by tp*pp*ep = 1*1*4" in line


def pp2_and_pp1_losses(config: Path, mantis_out: Path, tmp_path: Path, *pp2_extra: str,
                       shared: tuple[str, ...] = ()):
    """3 steps (mbs 2 x grad_accum 2, fixed_length, + ``shared``) of ``config`` at PP=1 (python)
    and PP=2 (torchrun, 2 gloo ranks) side by side from one PP=1 random init (megatron's random
    init depends on the layout) -> (the shared train args, PP=2 losses, PP=1 losses)."""
    init = tmp_path / "init"
    ok(runner.run("tests/init_checkpoint.py", str(config), str(init), timeout=300))
    args = [str(config), f"data.path={mantis_out}/metadataset.yaml", "train.steps=3",
            "train.micro_batch_size=2", "train.grad_accum=2", "task_encoder.fixed_length=true",
            f"train.init_checkpoint={init}", *FAST, *shared]
    runs = {"pp1": (1, []), "pp2": (2, ["parallel.pp=2", *pp2_extra])}
    procs = {name: runner.launch("train.py", *args, *extra, f"out={tmp_path / name}",
                                 nproc=nproc, stdout=runner.DEVNULL)
             for name, (nproc, extra) in runs.items()}  # side by side
    for proc in procs.values():
        proc.wait(timeout=600)
        assert proc.returncode == 0, proc.output()[1][-3000:]
    pp1, pp2 = losses(tmp_path / "pp1"), losses(tmp_path / "pp2")
    assert len(pp2) == 3 and pp2[-1] < pp2[0]
    for a, b in zip(pp2, pp1, strict=True):
        assert abs(a - b) < 1e-4
    return args, pp2, pp1


@pytest.mark.slow
def test_pp2_equals_pp1_and_resumes_exactly(mantis_out, tmp_path):
    """PP=2 (megatron's 1F1B schedule, 2 gloo ranks, one LM layer per stage) gives the PP=1
    losses from the same initial weights, and a PP=2 checkpoint resumes exactly."""
    args, pp2, _ = pp2_and_pp1_losses(MANTIS_CFG, mantis_out, tmp_path, "checkpoint.interval=2")
    step = tmp_path / "pp2" / "checkpoints" / "step_000002"
    assert {p.name for p in (step / "rng").iterdir()} == {"rank_00000.pt", "rank_00001.pt"}
    ok(train(*args, "parallel.pp=2", f"out={tmp_path / 'resumed'}", "--resume", str(step),
             nproc=2))
    assert losses(tmp_path / "resumed") == pp2[2:]  # bit-exact on CPU


@pytest.mark.slow
def test_nemotron_ep2_equals_dp2_and_resumes_exactly(mantis_out, tmp_path):
    """Nemotron-Omni with MoE layers ("*E-E", 8 experts): expert parallel EP=2 (4 experts per
    rank) over the 2 DP ranks gives the EP=1 losses from the same initial weights (a checkpoint
    written at EP=1, resharded on load), and an EP=2 checkpoint resumes exactly (also the
    Nemotron-Omni family's resume test: RADIO tower + MambaModel LM)."""
    moe = "model.lm.pattern='*E-E'"
    init = tmp_path / "init"
    ok(runner.run("tests/init_checkpoint.py", str(NEMOTRON_MANTIS_CFG), str(init), moe,
                  timeout=300))
    args = [str(NEMOTRON_MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", moe,
            "train.steps=3", "train.micro_batch_size=1", "task_encoder.fixed_length=true",
            "task_encoder.seq_length=768", f"train.init_checkpoint={init}", *FAST]
    ok(train(*args, f"out={tmp_path / 'dp2'}", nproc=2))
    ok(train(*args, "parallel.ep=2", "checkpoint.interval=2", f"out={tmp_path / 'ep2'}", nproc=2))
    ep2 = losses(tmp_path / "ep2")
    assert ep2[-1] < ep2[0]
    for a, b in zip(ep2, losses(tmp_path / "dp2"), strict=True):
        assert abs(a - b) < 1e-4
    step = tmp_path / "ep2" / "checkpoints" / "step_000002"
    ok(train(*args, "parallel.ep=2", f"out={tmp_path / 'resumed'}", "--resume", str(step),
             nproc=2))
    assert losses(tmp_path / "resumed") == ep2[2:]  # bit-exact on CPU


@pytest.mark.slow
def test_nemotron_packed_pp2_equals_pp1(mantis_out, tmp_path):
    """Nemotron-Omni (MambaModel LM, pattern "M*M-": a Mamba layer on each stage) with packing at
    PP=2 gives the PP=1 losses from the same initial weights: packed batches run as one THD row of
    B*L tokens (Mamba states restart per segment), which is also what the stages exchange."""
    pp2_and_pp1_losses(NEMOTRON_MANTIS_CFG, mantis_out, tmp_path,
                       shared=("task_encoder.packing=true",))


@pytest.mark.slow
def test_eval_reads_the_run_config_from_the_checkpoint(mantis_reference, tmp_path):
    """eval.py --ckpt alone: the data, task encoder and tokenizer of the run come from the config
    stored with the checkpoint; the output goes beside the checkpoint; progress lines when
    stdout is not a terminal."""
    step = tmp_path / "step_000004"
    shutil.copytree(mantis_reference / "checkpoints" / "step_000004", step)
    proc = runner.run("eval.py", "--ckpt", str(step), "--limit", "2", "--max-new-tokens", "2",
                      "--progress-every", "0", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = json.loads((tmp_path / "eval_step_000004" / "scores.json").read_text())
    assert scores["checkpoint_kind"] == "train.py step_000004" and scores["conversations"] == 2
    stored = yaml.safe_load((step / "config.yaml").read_text())
    assert scores["data"] == stored["data"]["path"]
    assert scores["task_encoder"]["tokenizer"] == "test"
    assert "[eval] 2/2 conversations" in proc.stdout


@pytest.mark.slow
def test_skipped_samples_are_summarised_per_reason_and_keyed_once(mantis_out, tmp_path):
    """Over several epochs the step line counts each interval's skips per reason, and the skipped
    samples' keys are written once to <out>/skipped_samples.jsonl (no line per skip)."""
    import re

    proc = train(str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", f"out={tmp_path}",
                 "train.steps=60", "log.interval=20", *FAST)
    ok(proc)
    skips = [json.loads(line) for line in
             (tmp_path / "skipped_samples.jsonl").read_text().splitlines()]
    keys = [skip["key"] for skip in skips]
    assert keys and len(keys) == len(set(keys)), keys  # once per run, not per epoch
    assert {skip["reason"] for skip in skips} == {"too_many_images"}
    assert "skipped sample" not in proc.stderr
    counted = [int(n) for n in re.findall(r"skipped \d+ \(too_many_images (\d+)\)", proc.stdout)]
    assert len(counted) >= 2 and sum(counted) > len(keys)  # later epochs skip them again
