"""Where and how ``models.convert mcore-to-hf`` writes (models/hf/export.py): never into the
checkpoint or the base a checkpoint that holds only what trains loads, never over a folder that is
not a previous export, a previous export replaced as a whole only with ``--overwrite`` (no stale
file survives), a full disk one line with nothing half-written left, and the source's
``auto_map`` (remote code the export does not ship) dropped."""

from __future__ import annotations

import json
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lookalikes.models import build_tiny_hf_model
from tests.conftest import REPO


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, Path]:
    """A tiny HF Qwen2.5-VL whose config.json names remote code (``auto_map``), and its
    hf-to-mcore import."""
    from models.convert import hf_to_mcore

    root = tmp_path_factory.mktemp("export")
    hf = build_tiny_hf_model("qwen2_5_vl", root / "hf", pixels=(3136, 6272))
    config = json.loads((hf / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_remote.RemoteModel"}
    (hf / "config.json").write_text(json.dumps(config))
    hf_to_mcore(str(hf), root / "mcore", tp=1, pp=1)
    return {"hf": hf, "mcore": root / "mcore"}


def _export(mcore: Path, out: Path, capsys, *extra: str) -> tuple[int, str]:
    from models.convert import main

    code = main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(out), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def _refused(mcore: Path, out: Path, capsys, *said: str, extra=()) -> None:
    code, line = _export(mcore, out, capsys, *extra)
    assert code == 2 and line.startswith("models.convert: error: "), line
    assert all(part in line for part in said), line


def test_out_is_new_or_a_previous_export_replaced_whole(imported, tmp_path, capsys):
    mcore = imported["mcore"]
    _refused(mcore, mcore, capsys, "outside the checkpoint")
    _refused(mcore, mcore / "hf" / "x", capsys, "outside the checkpoint")
    _refused(mcore, mcore.parent, capsys, "outside the checkpoint")  # it holds the checkpoint
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    _refused(mcore, other, capsys, "not an export of models.convert", extra=("--overwrite",))
    assert (other / "notes.txt").read_text() == "mine"

    out = tmp_path / "export"
    assert _export(mcore, out, capsys)[0] == 0
    config = json.loads((out / "config.json").read_text())
    assert "auto_map" not in config and config["model_type"] == "qwen2_5_vl"
    assert json.loads((out / "export_record.json").read_text())["exported_from"] == str(mcore)
    (out / "adapter_config.json").write_text("{}")  # a stale file of another save
    _refused(mcore, out, capsys, "holds a previous export", "--overwrite")
    assert _export(mcore, out, capsys, "--overwrite")[0] == 0
    assert not (out / "adapter_config.json").exists()  # replaced as a whole
    assert not list(tmp_path.glob("export.*"))  # no partial or replaced folder left
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _export(mcore, empty, capsys)[0] == 0


def test_the_base_of_a_checkpoint_holding_what_trains_is_refused(imported, tmp_path, capsys):
    """A LoRA run's step folder refers to its base (``model.hf``): --out there is refused (its
    weights unchanged), inside it too."""
    from models.hf.source import fingerprint

    hf = tmp_path / "base"
    shutil.copytree(imported["hf"], hf)
    model = json.loads((imported["mcore"] / "model_config.json").read_text())
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    shutil.copytree(imported["mcore"], step / "model_optim")
    (step / "config.yaml").write_text(yaml.safe_dump(
        {"model": {**model, "peft": "lora", "lora": {"rank": 4, "alpha": 8}}}))
    (step / "train_state.json").write_text(json.dumps(
        {"step": 2, "base": {"hf": str(hf), "fingerprint": fingerprint(hf)}}))
    weights = (hf / "model.safetensors").read_bytes()
    for out in (hf, hf / "sub"):
        _refused(step, out, capsys, f"is the base {hf}", "choose another folder",
                 extra=("--overwrite",))
    assert (hf / "model.safetensors").read_bytes() == weights

    from contract.errors import UsageError
    from models.checkpointing.checkpoint import read_checkpoint
    from models.hf.export import check_out

    (step / "COMPLETE").write_text("{}")
    run = read_checkpoint(tmp_path / "run")  # the run folder given: its newest step
    check_out(tmp_path / "run" / "export", run, overwrite=False)  # beside the checkpoints: fine
    for out in (tmp_path / "run", tmp_path / "run" / "checkpoints", step / "model_optim" / "x"):
        with pytest.raises(UsageError, match="choose a folder outside the checkpoint"):
            check_out(out, run, overwrite=False)


def _file_size_limit() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails (EFBIG), no signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # below model.safetensors


def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(imported, tmp_path):
    """A write that fails for lack of space (a file-size limit standing in for a full disk: the
    same OSError through the same writes) is one line, exit 1; --out is as it was (absent here,
    or the previous export), no partial folder left; the rerun with space writes it."""
    out = tmp_path / "export"
    cmd = [sys.executable, "-m", "models.convert", "mcore-to-hf", "--mcore",
           str(imported["mcore"]), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          preexec_fn=_file_size_limit)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("models.convert: error:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and f"writing the export {out} failed (File too large" in errors[0]
    assert not out.exists() and not list(tmp_path.iterdir())
    assert subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=300).returncode == 0
    assert (out / "model.safetensors").is_file()
