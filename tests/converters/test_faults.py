"""Faults during a conversion, through the CLI: kill -9 during `energon prepare`, SIGINT with two
workers, a second run into an `--out` in use, stale locks, partitions finishing together, a full
disk, a failed first attempt. After each, the same command gives the uninterrupted output."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from converters.lock import LockedError, RunLock
from tests.conftest import REPO, energon, one_error_line, read_samples, shard_bytes, summary

FIXED = ("rows_read", "rows_written", "samples_written", "rejected", "rejected_by_reason",
         "fixups_by_kind", "samples_by_split", "by_config", "shards")
#: files that are byte-identical between runs of the same command (README); index.sqlite and
#: index.uuid are Energon's and differ, summary.json / stats.json hold timings
IDENTICAL = ("rejects.jsonl", "metadataset.yaml", ".nv-meta/dataset.yaml", ".nv-meta/split.yaml",
             ".nv-meta/.info.json")


def _cmd(sources, out, *extra):
    return [sys.executable, "-m", "converters", "mantis", "--source", str(sources["mantis"]),
            "--out", str(out), "--shard-size", "4", "--val-fraction", "0.2",
            "--progress-interval", "0", *extra]


def _start(cmd, **kwargs):
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **kwargs)


def _run(cmd, **kwargs):
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, **kwargs)


def _wait_for(condition, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if condition():
            return True
        time.sleep(0.01)
    return False


def _sidecars(out):
    return len(list((out / ".work" / "shards").rglob("*.json")))


def same_output(a, b):
    assert shard_bytes(a) == shard_bytes(b)
    indexes = sorted((a / "shards").rglob("*.tar.idx"))
    assert indexes and all(p.read_bytes() == (b / p.relative_to(a)).read_bytes() for p in indexes)
    for name in IDENTICAL:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert {k: summary(a)[k] for k in FIXED} == {k: summary(b)[k] for k in FIXED}


@pytest.mark.slow
def test_kill_during_energon_prepare_then_rerun_matches(sources, mantis_out, tmp_path):
    out = tmp_path / "killed"
    proc = _start(_cmd(sources, out))
    caught = _wait_for(lambda: (out / ".nv-meta").is_dir(), proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the converter and its energon prepare child
    proc.wait()
    assert caught and not (out / "summary.json").exists()
    rerun = _run(_cmd(sources, out))
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "taking over the stale lock" in rerun.stderr
    same_output(mantis_out, out)
    assert energon("info", str(out)).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_group_with_two_workers_ends_in_seconds_and_resumes(
        sources, mantis_out, tmp_path, signum):
    out = tmp_path / "interrupted"
    proc = _start(_cmd(sources, out, "--workers", "2"))
    assert _wait_for(lambda: _sidecars(out) >= 2, proc)
    workers = psutil.Process(proc.pid).children(recursive=True)
    start = time.time()
    os.killpg(proc.pid, signum)  # CTRL-C sends SIGINT to the whole foreground group
    _, stderr = proc.communicate(timeout=10)
    assert time.time() - start < 10 and proc.returncode == 128 + signum
    assert "Traceback" not in stderr
    assert [line for line in stderr.splitlines() if "interrupted" in line] == [
        f"converters: error: interrupted ({signal.Signals(signum).name}); run the same command "
        "again to resume"]
    assert workers and not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE
                               for w in workers)
    assert _run(_cmd(sources, out, "--workers", "2")).returncode == 0
    same_output(mantis_out, out)


@pytest.mark.slow
def test_kill_9_of_the_converter_alone_ends_its_workers_and_the_rerun_matches(
        sources, mantis_out, tmp_path):
    """kill -9 of the converter's own process (not its group: nothing else is signalled) while
    two shard workers write: the workers die with it (contract.lifetime), none keeps writing,
    and the same command then resumes to the uninterrupted output."""
    out = tmp_path / "killed-parent"
    proc = _start(_cmd(sources, out, "--workers", "2"))
    assert _wait_for(lambda: _sidecars(out) >= 1
                     and len(psutil.Process(proc.pid).children()) >= 2, proc)
    workers = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=5)
    for worker in alive:  # leave nothing behind for the next tests
        worker.kill()
    assert len(workers) >= 2 and not alive, alive
    written = sorted(p.stat().st_mtime_ns for p in (out / ".work").rglob("*") if p.is_file())
    time.sleep(0.5)
    assert written == sorted(p.stat().st_mtime_ns for p in (out / ".work").rglob("*")
                             if p.is_file())  # no orphan still writing
    rerun = _run(_cmd(sources, out, "--workers", "2"))
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "taking over the stale lock" in rerun.stderr
    same_output(mantis_out, out)


@pytest.mark.slow
def test_a_second_run_into_an_out_in_use_is_refused(sources, mantis_out, tmp_path):
    out = tmp_path / "busy"
    first = _start(_cmd(sources, out))
    assert _wait_for(lambda: _sidecars(out) >= 1, first)
    second = _run(_cmd(sources, out))
    assert "partition 0 of --out" in one_error_line(second, 2)
    assert "in use by pid" in second.stderr
    assert first.wait(timeout=300) == 0, first.stderr.read()[-2000:]
    same_output(mantis_out, out)


def test_stale_locks_are_taken_over_and_live_ones_refuse(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = tmp_path / "p.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                "started": 0.0, "token": "old"}))
    notes = []
    with RunLock(lock, "test", notify=notes.append):
        assert "process" in notes[0] and "is gone" in notes[0]
        with pytest.raises(LockedError, match="in use by pid"):
            RunLock(lock, "test").acquire()
    assert not lock.exists()
    lock.write_text(json.dumps({"host": "other-machine", "pid": 1, "started": 0.0,
                                "token": "remote"}))
    with pytest.raises(LockedError, match="other-machine"):  # fresh heartbeat: live
        RunLock(lock, "test").acquire()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with RunLock(lock, "test", notify=notes.append):
        assert "no heartbeat from other-machine" in notes[-1]


@pytest.mark.slow
def test_partitions_finishing_together_finalize_once(sources, mantis_out, tmp_path):
    out = tmp_path / "parts"
    procs = [_start(_cmd(sources, out, "--num-partitions", "2", "--partition-index", str(i)))
             for i in (0, 1)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    finalizers = [err for _, err in results if "finalizing: accounting" in err]
    assert len(finalizers) == 1
    assert read_samples(out).keys() == read_samples(mantis_out).keys()
    assert {k: summary(out)[k] for k in FIXED if k != "shards"} == \
        {k: summary(mantis_out)[k] for k in FIXED if k != "shards"}


def _file_size_limit(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_full_disk_is_one_line_and_the_rerun_matches(sources, mantis_out, tmp_path):
    out = tmp_path / "full"
    first = _run(_cmd(sources, out, "--workers", "2"), preexec_fn=_file_size_limit(60_000))
    line = one_error_line(first, 1)
    assert "File too large" in line or "No space left" in line
    assert _sidecars(out) and not list(out.rglob("*.partial*"))
    assert _run(_cmd(sources, out, "--workers", "2")).returncode == 0
    same_output(mantis_out, out)


def test_a_full_disk_while_planning_reads_as_such(sources, tmp_path):
    failed = _run(_cmd(sources, tmp_path / "o"), preexec_fn=_file_size_limit(4_000))
    assert "File too large" in one_error_line(failed, 1)


@pytest.mark.slow
def test_an_attempt_that_wrote_no_shard_does_not_block_the_corrected_command(sources, tmp_path):
    out = tmp_path / "retry"
    first = _start(_cmd(sources, out) + ["--shard-size", "50"])
    assert _wait_for(lambda: (out / ".work" / "options.json").is_file(), first)
    os.killpg(first.pid, signal.SIGINT)
    assert first.wait(timeout=10) == 130 and _sidecars(out) == 0
    corrected = _run(_cmd(sources, out) + ["--shard-size", "5"])
    assert corrected.returncode == 0, corrected.stderr[-2000:]
    assert summary(out)["samples_written"] > 0
    changed = _run(_cmd(sources, out) + ["--shard-size", "6"])
    assert "shard_size: 5 -> 6" in one_error_line(changed, 2)


def test_progress_lines_reach_a_log_file(mantis_out, sources, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(mantis_out, out)
    rerun = _run(_cmd(sources, out))  # stderr is a pipe, not a terminal
    assert rerun.returncode == 0
    assert "writing 0 of" in rerun.stderr and "already finalized" in rerun.stderr
