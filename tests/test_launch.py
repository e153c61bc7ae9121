"""Under torchrun a user error is one line, printed once, and the launcher exits with the
rank's code without a traceback of its own (recipes.launch, contract/cli.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_user_error_under_torchrun_is_one_line_once(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.launch", "--standalone", "--nproc-per-node", "2",
         "train.py", "configs/train_qwen_vl_mantis.yaml", "train.stepz=3", f"out={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["train.py: error: unknown key train.stepz (did you mean train.steps?); "
                     + lines[0].split("; ", 1)[1]], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
