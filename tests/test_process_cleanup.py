"""Every process ends with its run (contract/lifetime.py): a ``kill -9`` of train.py (loader
workers at data.num_workers=2), of torchrun (its ranks and their workers) or of a converter (its
shard workers) leaves no process of its session alive; found by scanning /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_train import MANTIS_CFG

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")


def session_members(sid: int) -> list[int]:
    """The pids of the live (not zombie) processes of session ``sid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def kill_then_survivors(proc: subprocess.Popen, ready, wait_s: float = 20.0) -> list[int]:
    """Wait until ``ready()`` (the run has its children), kill -9 the run's first process, then
    the processes of its session still alive after ``wait_s`` (reaped as they go)."""
    deadline = time.monotonic() + 240
    while not ready(proc):
        assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
        assert time.monotonic() < deadline, "the run never got its children"
        time.sleep(0.2)
    before = session_members(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    end = time.monotonic() + wait_s
    while session_members(proc.pid) and time.monotonic() < end:
        time.sleep(0.5)
    survivors = session_members(proc.pid)
    for pid in survivors:  # leave nothing behind for the next tests
        os.kill(pid, signal.SIGKILL)
    assert len(before) > 2, before  # the kill met the run with its children
    return survivors


def started(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def has_children(n: int):
    return lambda proc: len(session_members(proc.pid)) >= n


def metrics_written(out: Path):
    return lambda proc: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat(
    ).st_size > 0


TRAIN = ["train.steps=100000", "log.tensorboard=false", "checkpoint.save_final=false",
         "data.num_workers=2"]


@pytest.mark.slow
def test_kill_9_of_train_py_leaves_no_loader_worker(mantis_out, tmp_path):
    proc = started("train.py", str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
                   f"out={tmp_path}", *TRAIN)
    assert kill_then_survivors(proc, metrics_written(tmp_path)) == []


@pytest.mark.slow
def test_kill_9_of_torchrun_leaves_no_rank(mantis_out, tmp_path):
    proc = started("-m", "recipes.launch", "--standalone", "--nproc-per-node", "2", "train.py",
                   str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
                   f"out={tmp_path}", *TRAIN)
    assert kill_then_survivors(proc, metrics_written(tmp_path)) == []


@pytest.mark.slow
def test_kill_9_of_a_converter_leaves_no_worker(sources, tmp_path):
    proc = started("-m", "converters", "llava-video", "--source", str(sources["llava-video"]),
                   "--out", str(tmp_path / "out"), "--shard-size", "1", "--workers", "2")
    assert kill_then_survivors(proc, has_children(3)) == []
