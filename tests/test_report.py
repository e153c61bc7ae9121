"""The demo report's pictures and check lines: one loss panel per dataset and one for the
vision-signal pairs, every check line naming its family (recipes.report, in-process)."""

from __future__ import annotations

import json

import yaml

from recipes.report import main


def _run(root, name: str, family: str, dataset: str, losses: list[float]):
    run = root / name
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(
        {"model": {"family": family}, "data": {"path": f"demo/{dataset}/metadataset.yaml"}}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": i + 1, "loss": loss, "step_time_s": 0.1, "tokens_per_s": 1.0,
         "samples_per_s": 1.0, "visual_tokens_per_s": 1.0}) + "\n"
        for i, loss in enumerate(losses)))
    return run


def test_panels_by_dataset_and_checks_name_their_family(tmp_path, capsys):
    from PIL import Image

    runs = [_run(tmp_path, "a-mantis", "qwen2_5_vl", "mantis", [6.0, 3.0, 2.0, 1.0]),
            _run(tmp_path, "b-mantis", "nemotron_omni", "mantis", [6.0, 4.0, 3.0, 2.0]),
            _run(tmp_path, "a-check", "qwen2_5_vl", "vision-check", [6.0, 1.0, 0.2, 0.2]),
            _run(tmp_path, "a-blank", "qwen2_5_vl", "vision-check", [6.0, 1.0, 0.5, 0.5])]
    out = tmp_path / "report"
    assert main([str(out), *map(str, runs), "--pair", "a-check:a-blank"]) == 0
    text = (out / "report.md").read_text()
    assert "Vision-signal check PASSED (qwen2_5_vl)" in text
    width, height = Image.open(out / "loss_curves.png").size
    assert height > width * 0.5  # two panels stacked: mantis, the vision-signal pair
    checks = json.loads((out / "report.json").read_text())["checks"]
    assert checks[0]["family"] == "qwen2_5_vl" and checks[0]["passed"]
