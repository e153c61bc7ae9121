"""A full disk while finalize's `energon prepare` writes the Energon index (its sqlite database):
one line, exit 1, no half-written index left; the rerun with space finalizes."""

from __future__ import annotations

import resource
import shutil
import signal
import subprocess

import pytest

from tests.conftest import summary


def _sqlite_limit() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails (EFBIG), no signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # below index.sqlite (~45 kB)


@pytest.mark.slow
def test_a_full_disk_while_energon_prepare_writes_its_index(mantis_out, tmp_path, monkeypatch,
                                                           capsys):
    """energon prepare runs with a file-size limit (standing in for a full disk: the sqlite
    writes fail as on one; only its process is limited, since the statistics PNG finalize
    writes before it is larger than the index)."""
    import converters.finalize as finalize
    from converters.__main__ import main

    out = tmp_path / "out"
    shutil.copytree(mantis_out, out)
    (out / ".work" / "finalized.json").unlink()  # finalize again, from scratch
    real = subprocess.run
    monkeypatch.setattr(finalize.subprocess, "run",
                        lambda *a, **k: real(*a, preexec_fn=_sqlite_limit, **k))
    assert main(["finalize", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("converters: error: energon prepare could not write the index of "
                              f"{out} ("), err[-3:]
    assert "free space and run `python -m converters finalize" in err[-1]
    assert not any("Traceback" in line for line in err)
    assert not (out / ".nv-meta").exists() and not list(out.rglob("*.tar.idx"))
    assert not (out / ".work" / "finalized.json").exists()
    monkeypatch.undo()
    assert main(["finalize", "--out", str(out)]) == 0
    assert summary(out)["samples_written"] == summary(mantis_out)["samples_written"]
    assert (out / ".nv-meta" / "index.sqlite").is_file()
