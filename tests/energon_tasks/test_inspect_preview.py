"""`inspect` predicts what the loader does; `preview` renders one sample as HTML; both take the
test tokenizer, a run config's settings, and fail fast offline."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter

import pytest

from energon_tasks.__main__ import main
from energon_tasks.loader import get_val_loader
from tests.conftest import REPO

KNOBS = {"min_pixels": 784, "max_num_images": 2, "max_visual_tokens": 20,
         "seq_length": 128}


def cli_knobs(knobs: dict) -> list[str]:
    return [arg for name, value in knobs.items()
            for arg in (f"--{name.replace('_', '-')}", str(value))]


@pytest.mark.parametrize(("fixture", "model"), [("mantis_out", "qwen2.5-vl"),
                                                ("video_out", "qwen3-vl"),
                                                ("mantis_out", "qwen3.5")])
def test_inspect_agrees_with_the_loader(request, make_encoder, tokenizer_dir, capsys, tmp_path,
                                        fixture, model):
    dataset = request.getfixturevalue(fixture)
    knobs = dict(KNOBS, max_num_frames=6) if fixture == "video_out" else KNOBS
    plots = tmp_path / "hist.png"
    code = main(["inspect", str(dataset), "--model", model, "--tokenizer", str(tokenizer_dir),
                 "--json", "--plots", str(plots), *cli_knobs(knobs)])
    assert code == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert plots.stat().st_size > 1000
    assert captured.err.strip().splitlines()[-1] == \
        f"[inspect] wrote the token histograms to {plots}"  # the last line says where
    predicted = report["counters"]
    if fixture == "mantis_out":  # the knobs exercise the policy on this data
        assert predicted.get("resized") and predicted.get("turns_cut")
        assert any(name.startswith("skipped_") for name in predicted)
    encoder = make_encoder(model=model, **knobs)
    seen, real = Counter(), 0
    for batch in get_val_loader(dataset, task_encoder=encoder, batch_size=4, num_workers=0,
                                split_part="train"):
        seen.update(batch.budget_counters)
        real += int(batch.attention_mask.sum())
    seen.update(encoder._pending)  # skips after the last batch
    got = {k: v for k, v in seen.items() if not k.startswith("tokens_")}
    assert got == predicted
    assert real == report["tokens"]["total"]["sum"]


@pytest.mark.parametrize("model", ["qwen2.5-vl", "nemotron-omni", "qwen3.5"])  # uint8 / float32
def test_preview_writes_html_with_resized_media(tokenizer_dir, mantis_out, tmp_path, capsys,
                                                model):
    out = tmp_path / "p.html"
    code = main(["preview", str(mantis_out), "--index", "1", "--tokenizer", str(tokenizer_dir),
                 "--max-pixels", "50000", "--model", model, "--out", str(out)])
    assert code == 0 and capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    assert page.count("data:image/png;base64,") >= 1
    assert "grid_thw" in page and "visual tokens" in page and "tokens]" in page
    assert main(["preview", str(mantis_out), "--index", "100000", "--tokenizer",
                 str(tokenizer_dir)]) == 2
    # preview prints sizes as grid takes them, HxW (grid took HxW while preview printed WxH)
    stored, resized = re.search(r"stored (\d+x\d+) \(HxW\) -&gt; (\d+x\d+),", page).groups()
    capsys.readouterr()
    assert main(["grid", "--model", model, "--image", stored, "--max-pixels", "50000"]) == 0
    entry = json.loads(capsys.readouterr().out)[0]
    assert f"{entry['resized_height']}x{entry['resized_width']}" == resized


def test_inspect_takes_the_test_tokenizer_and_a_run_config(mantis_out, capsys):
    """``--tokenizer test`` (what the train configs use) and ``--config RUN_CONFIG`` (its
    task_encoder section: model, tokenizer, budget knobs; options still override)."""
    assert main(["inspect", str(mantis_out), "--tokenizer", "test", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["tokenizer"] == "test"
    config = REPO / "configs" / "train_nemotron_omni_mantis.yaml"
    assert main(["inspect", str(mantis_out), "--config", str(config), "--seq-length", "512",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["config"]
    assert (report["model"], report["tokenizer"], report["seq_length"]) == (
        "nemotron_omni", "test", 512)


@pytest.mark.slow
def test_unreachable_hub_fails_fast_with_one_line(mantis_out, tmp_path):
    """The default tokenizer is a hub id: offline (nothing cached, the hub refuses connections)
    the command fails within seconds with one line saying what to pass."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "energon_tasks", "inspect", str(mantis_out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "unreachable" in proc.stderr and "--tokenizer test" in proc.stderr
    assert elapsed < 30  # was ~57 s of retries; the hub check itself takes < 1 s here
