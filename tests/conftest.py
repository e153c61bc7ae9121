"""Shared fixtures: lookalike sources (built once per session) and their conversions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `python -m <args>` in the repo like a user would; returns the finished process."""
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def one_error_line(proc: subprocess.CompletedProcess, code: int, prog: str = "converters") -> str:
    """The one `<prog>: error:` line a failed CLI run printed (progress lines aside), checked:
    exit code `code`, no traceback, exactly one error line, and it is the last line."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr[-2000:]
    return errors[0]


def energon(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("energon")
    return subprocess.run([str(exe), *args], capture_output=True, text=True)


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> dict[str, Path]:
    from lookalikes import build_all

    return build_all(tmp_path_factory.mktemp("sources"))


def _convert(tmp_path_factory, sources, command, name, *extra) -> Path:
    out = tmp_path_factory.mktemp(command) / "out"
    run_cli("converters", command, "--source", str(sources[name]), "--out", str(out),
            "--shard-size", "4", *extra)
    return out


@pytest.fixture(scope="session")
def mantis_out(tmp_path_factory, sources) -> Path:
    return _convert(tmp_path_factory, sources, "mantis", "mantis", "--val-fraction", "0.2")


@pytest.fixture(scope="session")
def infovqa_out(tmp_path_factory, sources) -> Path:
    return _convert(tmp_path_factory, sources, "infovqa", "infovqa")


@pytest.fixture(scope="session")
def video_out(tmp_path_factory, sources) -> Path:
    return _convert(tmp_path_factory, sources, "llava-video", "llava-video",
                    "--val-fraction", "0.2", "--workers", "2")


def manifest(root: Path) -> dict:
    return json.loads((root / "lookalike_manifest.json").read_text())


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def read_samples(out: Path) -> dict[str, dict]:
    """Every sample of every shard: key -> {"json": dict, "split": str, parts...: bytes}."""
    import tarfile

    samples: dict[str, dict] = {}
    for tar_path in sorted((out / "shards").rglob("*.tar")):
        split = tar_path.relative_to(out / "shards").parts[0]
        with tarfile.open(tar_path) as tar:
            for member in tar:
                key, part = member.name.split(".", 1)
                data = tar.extractfile(member).read()
                entry = samples.setdefault(key, {"split": split})
                entry[part] = json.loads(data) if part == "json" else data
    return samples


def shard_bytes(out: Path) -> dict[str, bytes]:
    tars = sorted((out / "shards").rglob("*.tar"))
    return {str(p.relative_to(out)): p.read_bytes() for p in tars}
