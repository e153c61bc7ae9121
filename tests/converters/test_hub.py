"""The converters' hub path, through the CLI, against a local fake of the Hugging Face Hub
(tests/fake_hub.py) serving the lookalikes under their real hub ids: a hub id converts to the same
output as the same files in a local folder, `--revision` is resolved once and every read names
that commit, a resumed run stays at the commit it recorded while `main` moves, and a hub that is
unreachable, or lacks the dataset or the revision, is one line."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, one_error_line, summary
from tests.converters.test_faults import same_output
from tests.fake_hub import FakeHub

#: command -> (hub id, the local conversion fixture, the options it was made with)
CASES = {
    "mantis": ("TIGER-Lab/Mantis-Instruct", "mantis_out", ["--val-fraction", "0.2"]),
    "infovqa": ("Ahren09/InfoVQA", "infovqa_out", []),
    "llava-video": ("lmms-lab/LLaVA-Video-178K", "video_out",
                    ["--val-fraction", "0.2", "--workers", "2"]),
}
MOVING = "TIGER-Lab/Mantis-Instruct-moving"  #: a repository whose main moves during a run


@pytest.fixture(scope="module")
def hub(sources):
    """The fake hub serving each lookalike at one commit; a few entries per listing page, so that
    the clients follow pages as they do on large repositories."""
    with FakeHub(page_size=4) as hub:
        for command, (repo, _, _) in CASES.items():
            hub.commit(repo, sources[command])
        yield hub


@pytest.fixture
def env(hub, tmp_path):
    """A CLI process's environment: the fake hub, an empty HF_HOME of its own."""
    return hub.environ(tmp_path / "hf_home")


def _cmd(command, source, out, *extra):
    return [sys.executable, "-m", "converters", command, "--source", source, "--out", str(out),
            "--shard-size", "4", "--progress-interval", "0", *extra]


def _run(cmd, env):
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)


def _reads_since(hub, mark):
    """The requests after `mark` that read the repository (all but revision resolutions)."""
    return [r for r in hub.requests[mark:] if "/revision/" not in r and " cdn:" not in r]


@pytest.mark.slow
@pytest.mark.parametrize("command", CASES)
def test_a_hub_id_converts_like_the_local_folder_at_one_commit(command, hub, env, tmp_path,
                                                              request):
    repo, local_fixture, extra = CASES[command]
    local_out, sha, out = request.getfixturevalue(local_fixture), hub.head(repo), tmp_path / "o"
    mark = len(hub.requests)
    proc = _run(_cmd(command, repo, out, *extra), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"source {repo} at main = {sha}" in proc.stderr
    same_output(local_out, out)
    assert (summary(out)["source"], summary(out)["revision"]) == (repo, sha)
    assert summary(local_out)["revision"] is None
    reads = _reads_since(hub, mark)
    assert any("/resolve/" in r for r in reads) and any("/tree/" in r for r in reads)
    assert all(sha in r for r in reads), [r for r in reads if sha not in r]
    assert hub.requests[mark:].count(f"GET /api/datasets/{repo}/revision/main") == 1
    assert not hub.unhandled


def _halve_a_parquet(folder, into):
    """A copy of the Mantis lookalike whose first train parquet lost half its rows (as when the
    real parquets were re-uploaded without new zips)."""
    shutil.copytree(folder, into)
    path = sorted(into.glob("*/train-*.parquet"))[0]
    table = pq.read_table(path)
    pq.write_table(table.slice(0, table.num_rows // 2), path)
    return into


@pytest.mark.slow
def test_a_resume_reads_the_recorded_commit_after_main_moved(hub, env, sources, mantis_out,
                                                             tmp_path):
    first = hub.commit(MOVING, sources["mantis"])
    for attempt in range(5):  # on a loaded machine the run may finish before the kill lands
        out = tmp_path / f"o{attempt}"
        cmd = _cmd("mantis", MOVING, out, "--val-fraction", "0.2")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None \
                and not any((out / ".work" / "shards").rglob("*.json")):
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert any((out / ".work" / "shards").rglob("*.json")), "the first run wrote no shard"
        if not (out / ".work" / "partition-000.done").exists():
            break
    else:
        pytest.fail("the first run was never cut short in 5 attempts")

    moved = hub.commit(MOVING, _halve_a_parquet(sources["mantis"], tmp_path / "moved"))
    mark = len(hub.requests)
    resumed = _run(cmd, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"source {MOVING} at {first}" in resumed.stderr
    reads = _reads_since(hub, mark)
    assert reads and all(first in r for r in reads), [r for r in reads if first not in r]
    assert not any("/main" in r or moved in r for r in hub.requests[mark:])
    same_output(mantis_out, out)  # = an uninterrupted run at the first commit
    assert summary(out)["revision"] == first
    assert not hub.unhandled

    refused = _run(cmd + ["--revision", "main"], env)
    line = one_error_line(refused, 2)
    assert first in line and moved in line and "--revision main" in line


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case, words", [
    ("unreachable", "cannot reach http://127.0.0.1:"),
    ("no such dataset", "no such dataset on http://127.0.0.1:"),
    ("no such revision", "--revision v9: no such branch, tag or commit"),
    ("a local folder", "is a local folder"),
])
def test_hub_failures_are_one_line_in_seconds(case, words, hub, env, sources, tmp_path):
    source, extra = "TIGER-Lab/Mantis-Instruct", []
    if case == "unreachable":
        env = {**env, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    elif case == "no such dataset":
        source = "TIGER-Lab/No-Such-Dataset"
    elif case == "no such revision":
        extra = ["--revision", "v9"]
    else:
        source, extra = str(sources["mantis"]), ["--revision", "main"]
    start = time.time()
    proc = _run(_cmd("mantis", source, tmp_path / "o", *extra), env)
    assert words in one_error_line(proc, 2)
    assert time.time() - start < 60  # python's start-up included; the hub is asked once
