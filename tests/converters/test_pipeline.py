"""The shared pipeline through the CLI: determinism, resume after a kill, partitions, errors."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import (
    REPO,
    energon,
    one_error_line,
    read_samples,
    run_cli,
    shard_bytes,
    summary,
)

FIXED = ("rows_read", "rows_written", "samples_written", "rejected", "rejected_by_reason",
         "fixups_by_kind", "samples_by_split", "by_config", "shards")


def _mantis(sources, out, *extra, check=True):
    return run_cli("converters", "mantis", "--source", str(sources["mantis"]), "--out", str(out),
                   "--shard-size", "4", "--val-fraction", "0.2", *extra, check=check)


def _same_output(a, b):
    assert shard_bytes(a) == shard_bytes(b)
    assert (a / "rejects.jsonl").read_bytes() == (b / "rejects.jsonl").read_bytes()
    assert {k: summary(a)[k] for k in FIXED} == {k: summary(b)[k] for k in FIXED}


@pytest.mark.slow
def test_byte_identical_rerun_with_other_worker_count(sources, mantis_out, tmp_path):
    _mantis(sources, tmp_path / "again", "--workers", "2", "--energon-media-metadata")
    _same_output(mantis_out, tmp_path / "again")


@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted(sources, mantis_out, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "converters", "mantis", "--source", str(sources["mantis"]),
           "--out", str(out), "--shard-size", "4", "--val-fraction", "0.2"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if len(list((out / ".work" / "shards").rglob("*.json"))) >= 2:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # whatever the moment of the kill, a half-written shard may remain: make sure one does
    partial = next((out / "shards").rglob("*.tar"), None)
    if partial is not None:
        sidecar = out / ".work" / str(partial.relative_to(out)).replace(".tar", ".json")
        sidecar.unlink(missing_ok=True)
        partial.write_bytes(partial.read_bytes()[:700])
    _mantis(sources, out)
    _same_output(mantis_out, out)
    assert not list(out.rglob("*.partial"))


@pytest.mark.slow
def test_partitions_cover_the_same_samples(sources, mantis_out, tmp_path):
    out = tmp_path / "parts"
    first = _mantis(sources, out, "--num-partitions", "2", "--partition-index", "1")
    assert "partition done" in first.stdout and not (out / "summary.json").exists()
    _mantis(sources, out, "--num-partitions", "2", "--partition-index", "0")
    whole, parts = read_samples(mantis_out), read_samples(out)
    assert whole.keys() == parts.keys()
    assert all(whole[k] == parts[k] for k in whole)
    assert {k: summary(out)[k] for k in FIXED if k != "shards"} == \
        {k: summary(mantis_out)[k] for k in FIXED if k != "shards"}


def test_resume_with_other_options_is_refused(sources, mantis_out, tmp_path):
    out = tmp_path / "opts"
    shutil.copytree(mantis_out, out)
    proc = _mantis(sources, out, "--shard-size", "3", check=False)
    assert "shard_size: 4 -> 3" in one_error_line(proc, 2)


@pytest.mark.parametrize("args, words", [
    (["mantis", "--source", "/no/such/folder"], "no such folder"),
    (["mantis", "--configs", "nope"], "unknown config"),
    (["mantis", "--splits", "nope"], "unknown split"),
    (["mantis", "--out", "/proc/forbidden/out"], "not writable"),
    (["infovqa", "--workers", "0"], "--workers"),
])
def test_bad_arguments_are_one_line_exit_2(sources, tmp_path, args, words):
    argv = list(args)
    if "--source" not in argv:
        argv += ["--source", str(sources[argv[0]])]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "o")]
    proc = run_cli("converters", *argv, check=False)
    assert words in one_error_line(proc, 2)


def test_shards_are_plain_tars_without_pickle(mantis_out):
    tars = list((mantis_out / "shards").rglob("*.tar"))
    for tar in tars:
        listing = subprocess.run(["tar", "tf", str(tar)], capture_output=True, text=True,
                                 check=True).stdout.split()
        assert listing and not any(n.endswith((".pkl", ".pickle", ".pyd", ".pth")) for n in listing)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mantis_out", "infovqa_out", "video_out"])
def test_plain_energon_info_lint_and_preview_read_every_output(name, request):
    out = request.getfixturevalue(name)
    counts = summary(out)["samples_by_split"]
    info = energon("info", str(out))
    assert info.returncode == 0, info.stderr
    assert "energon_tasks.energon_dataset.ConversationSample" in info.stdout
    assert f"({summary(out)['samples_written']:,} samples" in info.stdout
    for split, count in counts.items():
        assert f"`{split}`" in info.stdout and f"{count:,} samples" in info.stdout
    lint = energon("lint", str(out))
    assert lint.returncode == 0 and "Except sample" not in lint.stdout, lint.stdout[-2000:]
    exe = Path(sys.executable).with_name("energon")
    preview = subprocess.run([str(exe), "preview", str(out)], input="n\n" * 3, text=True,
                             capture_output=True)
    assert preview.returncode == 0, preview.stderr[-2000:]
    assert "conversation (" in preview.stdout and "CanonicalSample(" in preview.stdout
    meta = json.loads((out / ".nv-meta" / ".info.json").read_text())
    assert sum(meta["shard_counts"].values()) == summary(out)["samples_written"]
    assert (out / "metadataset.yaml").is_file() and (out / "stats_histograms.png").is_file()
