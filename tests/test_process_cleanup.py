"""Every process ends with its run (contract/lifetime.py): a ``kill -9`` of train.py (loader
workers at data.num_workers=2) or of torchrun (its ranks and their workers) leaves no process of
its tree alive 2 s later; found by scanning /proc. (A converter's shard workers call the same
``die_with_parent``: tests/converters/test_faults.py kills a converter mid-conversion.)"""

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


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every live (not zombie) process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # state ppid pgrp session ... starttime (field 22)
            found[int(entry.name)] = (int(fields[1]), fields[19])
    return found


def tree(root: int) -> dict[int, str]:
    """pid -> start time of ``root`` and its live descendants (torchrun starts its ranks in
    sessions of their own: the tree, not the session, is the run)."""
    table, members = processes(), {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            members[pid] = table[pid][1]
            todo += [child for child, (parent, _) in table.items() if parent == pid]
    return members


def alive(members: dict[int, str]) -> list[int]:
    table = processes()
    return [pid for pid, start in members.items() if table.get(pid, (0, None))[1] == start]


def kill_then_survivors(proc: subprocess.Popen, ready, wait_s: float = 2.0) -> list[int]:
    """Wait until ``ready()`` (the run has its children), kill -9 the run's first process, then
    the processes of its tree still alive ``wait_s`` later (torch's loader workers notice a dead
    parent by themselves only every 5 s; a converter's workers once their task is done)."""
    deadline = time.monotonic() + 240
    while not ready(proc):
        assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
        assert time.monotonic() < deadline, "the run never got its children"
        time.sleep(0.2)
    before = tree(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    del before[proc.pid]
    time.sleep(wait_s)
    survivors = alive(before)
    for pid in survivors:  # leave nothing behind for the next tests
        os.kill(pid, signal.SIGKILL)
    assert len(before) >= 2, before  # the kill met the run with its children
    return survivors


def started(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


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
