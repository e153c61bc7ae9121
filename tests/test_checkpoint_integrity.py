"""Checkpoints you can trust, through train.py: the manifest ``COMPLETE`` (size + sha256 of every
file) checked before anything is read, a truncated ``.distcp`` / a deleted ``common.pt`` / flipped
bytes named in one line, the automatic resume falling back to the previous intact checkpoint
(one line each), the later checkpoints of a resume from an older step set aside as
``.abandoned`` (``latest`` follows), an atomic save (a full disk: one line, the previous
checkpoint stays the newest, no half folder), the run lock (a second train.py into a live
``out`` refused in one line, metrics.jsonl intact)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from models.checkpointing.folders import COMPLETE, checkpoint_files, hash_files, write_manifest
from tests import runner
from tests.test_train import FAST, MANTIS_CFG, REPO, error_line, losses, main_error, ok, train

STEPS = ["train.steps=4", "checkpoint.interval=1", "train.keep_checkpoints=0"]


@pytest.fixture(scope="module")
def four(mantis_out, tmp_path_factory) -> Path:
    """4 steps, a checkpoint after each (all kept)."""
    out = tmp_path_factory.mktemp("four")
    ok(train(str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", f"out={out}", *STEPS,
             *FAST))
    return out


def reseal(step_dir: Path) -> None:
    """Record a step folder's files as they are now, as a hostile author would after planting a
    payload: checksums catch damage, not attacks (those are the restricted unpicklers')."""
    step = json.loads((step_dir / COMPLETE).read_text())["step"]
    write_manifest(step_dir, step, hash_files(step_dir, checkpoint_files(step_dir)))


def args(mantis_out, out) -> list[str]:
    return [str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", f"out={out}", *FAST]


def test_manifest_records_every_file(four):
    ckpts = four / "checkpoints"
    for step in range(1, 5):
        folder = ckpts / f"step_{step:06d}"
        files = json.loads((folder / COMPLETE).read_text())["files"]
        assert sorted(files) == checkpoint_files(folder)
        assert any(name.endswith(".distcp") for name in files) and "model_optim/.metadata" in files
    assert (ckpts / "latest").read_text().strip() == "step_000004"
    assert not list(ckpts.glob("*.partial")) and not (four / "train.lock").exists()


@pytest.mark.slow
def test_damaged_checkpoints_are_named_and_auto_resume_falls_back(four, mantis_out, tmp_path,
                                                                  capsys):
    out = tmp_path / "run"
    shutil.copytree(four, out)
    ckpts = out / "checkpoints"
    step = {n: ckpts / f"step_{n:06d}" for n in range(1, 5)}
    # the last data file (megatron-core 0.16 writes two per rank, 0.19 one)
    truncated = sorted((step[4] / "model_optim").glob("*.distcp"))[-1]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    # megatron-core <= 0.18 writes common.pt; 0.19 keeps that state inside the .distcp files
    deleted = next(name for name in ("common.pt", "metadata.json")
                   if (step[3] / "model_optim" / name).is_file())
    (step[3] / "model_optim" / deleted).unlink()
    flipped = step[2] / "model_optim" / "__0_0.distcp"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit inside a tensor
    flipped.write_bytes(bytes(data))
    base = args(mantis_out, out)
    line = main_error(capsys, *base, "--resume", str(step[4]))  # before any process group
    assert f"{truncated.name}: " in line and "recorded at save (truncated)" in line, line
    line = main_error(capsys, *base, "--resume", str(step[3]))
    assert f"{deleted}: missing" in line, line
    from models.convert import main as convert_main  # the export checks the sizes too

    export = ["mcore-to-hf", "--mcore", str(step[4]), "--out", str(tmp_path / "hf")]
    assert convert_main(export) == 2
    assert f"{truncated.name}: " in capsys.readouterr().err
    line = error_line(train(*base, "--resume", str(step[2])))  # hashed after the process group
    assert "model_optim/__0_0.distcp: sha256 differs" in line, line
    # a leftover of a save killed midway: never resumed from, removed by the next save
    (ckpts / "step_000005.partial" / "model_optim").mkdir(parents=True)
    proc = train(*base, "train.steps=5", "checkpoint.interval=1", "train.keep_checkpoints=0",
                 "train.auto_resume=true")
    ok(proc)
    said = [ln for ln in proc.stdout.splitlines() if "failed its checks" in ln]
    assert len(said) == 3, proc.stdout
    assert "step_000004" in said[0] and "step_000003" in said[1] and "step_000002" in said[2]
    assert f"resuming from the previous intact checkpoint {step[1]}" in said[2]
    assert f"resuming from {step[1]} (step 1" in proc.stdout
    assert losses(out)[1:4] == losses(four)[1:4]  # resumed exactly from step 1
    names = sorted(p.name for p in ckpts.glob("step_*"))
    assert names == ["step_000001", "step_000002", "step_000002.abandoned", "step_000003",
                     "step_000003.abandoned", "step_000004", "step_000004.abandoned",
                     "step_000005"], names
    assert (ckpts / "latest").read_text().strip() == "step_000005"


@pytest.mark.slow
def test_resume_from_an_older_step_abandons_the_later_ones(four, mantis_out, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(four, out)
    ckpts = out / "checkpoints"
    base = args(mantis_out, out)
    proc = train(*base, "train.steps=3", "checkpoint.interval=0", "checkpoint.save_final=false",
                 "--resume", str(ckpts / "step_000002"))
    ok(proc)
    assert "set aside as .abandoned: step_000003.abandoned, step_000004.abandoned" in proc.stdout
    assert (ckpts / "latest").read_text().strip() == "step_000002"  # not the abandoned 4
    proc = train(*base, "train.steps=3", "train.auto_resume=true")
    ok(proc)
    assert f"resuming from {ckpts / 'step_000002'} (step 2" in proc.stdout  # never the abandoned


def _limit_file_size():
    limit = 1 << 20  # below a .distcp of the tiny model (2 MB), above every other file
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails (EFBIG), no signal


@pytest.mark.slow
def test_a_failed_save_is_one_line_and_keeps_the_previous_checkpoint(four, mantis_out, tmp_path):
    """A write that fails (a file-size limit standing in for a full disk) is one line, exit 1;
    the previous checkpoint stays the newest, no half-written folder remains."""
    out = tmp_path / "run"
    shutil.copytree(four, out)
    ckpts = out / "checkpoints"
    for later in ("step_000003", "step_000004"):
        shutil.rmtree(ckpts / later)
    proc = subprocess.run([sys.executable, "train.py", *args(mantis_out, out), "train.steps=3",
                           "checkpoint.interval=1", "--resume"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, preexec_fn=_limit_file_size)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("train.py: error:")]
    assert "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    assert "saving checkpoint step_000003 failed (" in errors[0], errors
    assert f"{ckpts / 'step_000002'} is still the newest" in errors[0], errors
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000001", "step_000002"]


@pytest.mark.slow
def test_a_second_train_into_a_live_out_is_refused(mantis_out, tmp_path):
    out = tmp_path / "run"
    base = args(mantis_out, out)
    first = runner.launch("train.py", *base, "train.steps=200", "checkpoint.interval=0",
                          stdout=runner.PIPE, stderr=runner.DEVNULL)
    try:
        for line in first.stdout:
            if line.startswith("[train] step 1/200"):
                break
        second = train(*base, "--overwrite")
        line = error_line(second)
        assert f"run folder {out} is in use by pid" in line and "train.lock" in line, line
        first.send_signal(signal.SIGTERM)
        first.stdout.read()
        assert first.wait(timeout=300) == 0
    finally:
        if first.poll() is None:
            first.kill()
    text = (out / "metrics.jsonl").read_text()
    assert "\0" not in text and all(json.loads(ln) for ln in text.splitlines())
    assert not (out / "train.lock").exists()
    # a lock left by a killed run is stale: taken over with one line
    (out / "train.lock").write_text(json.dumps({"host": os.uname().nodename, "pid": 1,
                                                "started": 0.0, "token": "x"}))
    proc = train(*base, "train.steps=1", "--overwrite")
    ok(proc)
    assert "taking over the stale lock" in proc.stdout


@pytest.mark.slow
def test_a_kill_mid_save_leaves_the_previous_checkpoint_newest(mantis_out, tmp_path):
    """kill -9 while a step folder is being written (seen as ``step_N.partial``): no ``step_N``
    appears, the automatic resume takes the previous complete checkpoint, the stale lock is
    taken over with one line and the leftover is removed by the next save."""
    import os
    import signal
    import time

    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    base = args(mantis_out, out)
    proc = runner.launch("train.py", *base, "train.steps=400", "checkpoint.interval=1",
                         "train.keep_checkpoints=0", stdout=runner.DEVNULL,
                         stderr=runner.DEVNULL)
    partial, deadline = None, time.monotonic() + 240
    try:
        while partial is None and proc.poll() is None and time.monotonic() < deadline:
            found = [p for p in ckpts.glob("step_*.partial")] if ckpts.is_dir() else []
            if found and any(ckpts.glob("step_0*[0-9]")):  # a save after a complete one
                os.kill(proc.pid, signal.SIGSTOP)  # frozen: the save cannot finish meanwhile
                if found[0].exists():
                    proc.kill()
                    partial = found[0]
                else:  # it finished between the look and the stop: catch the next one
                    os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    assert partial is not None, "no save was caught in progress"
    killed = int(partial.name.split("_")[1].split(".")[0])
    assert not (ckpts / f"step_{killed:06d}").exists() and partial.exists()
    newest = sorted(p.name for p in ckpts.glob("step_*") if p.name[5:].isdigit())[-1]
    assert int(newest[5:]) == killed - 1
    ok(resumed := train(*base, f"train.steps={killed}", "checkpoint.interval=1",
                        "train.auto_resume=true"))
    assert f"resuming from {ckpts / newest} (step {killed - 1}" in resumed.stdout
    assert "taking over the stale lock" in resumed.stdout
    assert (ckpts / f"step_{killed:06d}").is_dir() and not list(ckpts.glob("*.partial"))
