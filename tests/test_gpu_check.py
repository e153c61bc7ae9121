"""bench/gpu_check.py, the GPU check of issues 4, 5, 23 and 24: its CPU smoke mode runs the same
code (the DeltaNet kernel checks, hf-to-mcore + verify, real tower classes, the MoE models,
train.py) on the tiny configs, so the script is known to work before a GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_part(mantis_out, tmp_path):
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke", "--out", str(tmp_path),
                           "--data", f"{mantis_out}/metadataset.yaml"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = [row for part in report.values() if isinstance(part, list) for row in part]
    assert not [row for row in rows if "error" in row]  # every row ran
    deltanet = {row["check"]: row for row in report["deltanet"]}
    assert set(deltanet) == {"chunk_and_decode", "conv", "speed"}
    assert deltanet["chunk_and_decode"]["grad_beta_rel"] == 0.0  # torch against itself on CPU
    assert deltanet["speed"]["speedup"] > 0
    (verify,) = report["verify"]
    assert verify["family"] == "qwen3_5_moe" and verify["max_abs_logit_diff"] < 1e-4
    towers = {row["tower"] for row in report["vision"]}
    assert towers == {"qwen2.5-vl-7b", "qwen3-vl-8b", "nemotron-omni-30b-a3b"}
    assert all(row["patches_per_s"] > 0 and row["tflops_per_s"] >= 0 for row in report["vision"])
    packed = {row["family"]: row for row in report["packed"]}
    assert set(packed) == {"qwen2_5_vl", "qwen3_vl", "qwen3_5", "nemotron_omni"}
    assert all(row["max_abs_diff"] < 1e-4 for row in packed.values())  # fp32 on CPU
    moe = {row["family"]: row for row in report["moe"]}
    assert set(moe) == {"qwen3_vl_moe", "qwen3_5_moe"}
    assert all(row["max_abs_logit_diff"] < 1e-5 and row["grad_norm_rel_diff"] < 1e-5
               for row in moe.values())  # the same spec on CPU: the plumbing
    train = report["train"]
    assert train["steps"] == 3 and train["tokens_per_s"] > 0 and 0 <= train["mfu"] < 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_gpu_check_refuses_without_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "no CUDA device" in proc.stderr
