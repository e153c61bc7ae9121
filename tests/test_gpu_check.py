"""bench/gpu_check.py, the GPU check of issues 4, 5, 23, 24 and 44: its CPU smoke mode runs the
same code (the kernel survey and speed rows, every family's training steps on real-shaped samples
through its task encoder, hf-to-mcore + verify, packed rows, the MoE models, the real tower
classes) on the tiny configs, so the script is known to work before a GPU is lent; and
bench/gpu_cards.py writes a card per family from that JSON, saying plainly that no GPU run
exists when the JSON is a CPU one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "gpu_check.json"


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_part(smoke_report):
    report = json.loads(smoke_report.read_text())
    parts = report["parts"]
    assert list(parts) == ["kernels", "train", "verify", "packed", "moe", "vision"]  # in order
    assert not [row for rows in parts.values() for row in rows if "error" in row]
    assert report["environment"]["device"] == "cpu"
    assert report["environment"]["packages"]["megatron.core"] == "0.16.1"
    survey = [row for row in parts["kernels"] if "kind" in row]
    assert {(row["kind"], row["status"]) for row in survey if row["name"] == "torch"} == {
        ("conv", "reference"), ("mamba", "reference"), ("deltanet", "reference")}
    assert all(row["reason"] == "on CPU" for row in survey if row["status"] == "unavailable")
    speed = {row["speed"]: row for row in parts["kernels"] if "speed" in row}
    assert set(speed) == {"mamba", "deltanet"} and all(r["torch_fwd_bwd_s"] > 0
                                                        for r in speed.values())
    train = {row["family"]: row for row in parts["train"]}
    assert set(train) == {"qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",
                          "nemotron_omni", "nemotron_omni_super"}
    assert train["nemotron_omni_super"]["cut"][0] == "model.lm.pattern=M*E"  # LatentMoE in
    for family, row in train.items():
        assert row["loss_finite"] and row["loss_falling"], (family, row["losses"])
        assert row["real_tokens_per_s"] > 0 and row["padded_slots_per_s"] >= row[
            "real_tokens_per_s"]
        assert [r["row"] for r in row["rows"]] == ["page", "photos+video"]
        photos_video = row["rows"][1]
        assert photos_video["images"] == 12 and photos_video["videos"] == 1
        assert 0 < photos_video["vision_s"] and row["estimate_gb"] > 0
        assert any(line.startswith("attention: torch SDPA per segment") for line in
                   row["kernels"])
    assert any(line.startswith("mamba: torch chunked scan") for line in
               train["nemotron_omni"]["kernels"])
    (verify,) = parts["verify"]
    assert verify["family"] == "qwen3_5_moe" and verify["max_abs_logit_diff"] < 1e-4
    towers = {row["tower"] for row in parts["vision"]}
    assert towers == {"qwen2.5-vl-7b", "qwen3-vl-8b", "nemotron-omni-30b-a3b"}
    packed = {row["family"]: row for row in parts["packed"]}
    assert all(row["max_abs_diff"] < 1e-4 for row in packed.values())  # fp32 on CPU
    assert all(row["max_abs_logit_diff"] < 1e-5 for row in parts["moe"])


@pytest.mark.slow
def test_cards_from_a_cpu_run_say_no_gpu_run_exists(smoke_report, tmp_path):
    """A card per family; from a CPU JSON no figure is presented as a GPU one: the card says no
    GPU run exists and what the run must show, next to the published anchors."""
    proc = subprocess.run([sys.executable, "bench/gpu_cards.py", str(smoke_report),
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    cards = sorted(p.name for p in tmp_path.glob("*.md"))
    assert cards == ["nemotron_omni.md", "nemotron_omni_super.md", "qwen2_5_vl.md", "qwen3_5.md",
                     "qwen3_5_moe.md", "qwen3_vl.md", "qwen3_vl_moe.md"]
    text = (tmp_path / "qwen3_5.md").read_text()
    assert "No GPU run exists yet" in text and "2,507" in text and "989" in text
    assert "| real tokens/s |" not in text and "## Figures" not in text


def test_cards_from_a_gpu_run_show_the_figures(tmp_path):
    """The card of a GPU row: command, device, versions, the figures and the anchors."""
    row = {"part": "train", "family": "qwen2_5_vl", "device": "NVIDIA H100 80GB HBM3",
           "model": "configs/qwen2_5_vl_7b.yaml", "cut": ["model.lm.num_layers=4"],
           "recompute": "full", "dtype": "bf16", "params": 1_234_000_000,
           "kernels": ["attention: flash-attn varlen (agrees with torch on cuda bfloat16: worst "
                       "4.1e-03)"], "steps": 20, "timed_steps": 18,
           "rows": [{"row": "page", "tokens": 16400, "slots": 16400, "images": 1, "videos": 0,
                     "patches": 65536, "step_s": 2.0, "vision_s": 1.5, "vision_share": 0.75,
                     "tflop_per_step": 600.0}],
           "real_tokens_per_s": 8000.0, "padded_slots_per_s": 8100.0, "tflops_per_s": 300.0,
           "mfu": 0.3033, "peak_tflops": 989.0, "peak_mem_gb": 61.2, "estimate_gb": 58.0,
           "estimate": "stage 0: ...", "losses": [12.0, 11.0], "loss_finite": True,
           "loss_falling": True, "wall_s": 60.0}
    report = {"environment": {"device": "NVIDIA H100 80GB HBM3", "cuda": "13.0",
                              "driver": "580.159.04", "python": "3.12.3",
                              "packages": {"torch": "2.11.0+cu130", "flash_attn": "2.8.3"},
                              "command": "python bench/gpu_check.py --out /tmp/gc",
                              "commit": "abc1234", "date": "2027-01-01 10:00 UTC"},
              "parts": {"train": [row]}}
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(report))
    proc = subprocess.run([sys.executable, "bench/gpu_cards.py", str(path), "--out",
                           str(tmp_path / "cards")], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "cards" / "qwen2_5_vl.md").read_text()
    for expected in ("python bench/gpu_check.py --out /tmp/gc", "NVIDIA H100 80GB HBM3",
                     "2.11.0+cu130", "flash-attn varlen", "8,000", "8,100", "300.0", "30.3 %",
                     "61.2", "58.0", "75 %", "57.7", "30-40 %"):
        assert expected in text, expected
    assert "No GPU run exists yet" not in text
    others = (tmp_path / "cards" / "nemotron_omni.md").read_text()
    assert "No GPU run exists yet" in others  # no row for that family in this JSON


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_gpu_check_refuses_without_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "no CUDA device" in proc.stderr
