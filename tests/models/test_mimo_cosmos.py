"""Checkpoints of the Qwen-VL architectures under other names: MiMo-VL (a ``qwen2_5_vl``
checkpoint whose config.json has the older flat layout and whose weights have the older
prefixes) and Cosmos3-Omni's reasoner (``cosmos3_omni``: Qwen3-VL in its own published layout,
the unified checkpoint's generator / sound / action weights refused in one line, or dropped when
asked). Each: hf-to-mcore, logits against transformers (one image, interleaved images, a video;
<= 1e-4, fp32), and the export byte for byte equal to the source under its own names, loading in
transformers (training: tests/test_hf_journey.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lookalikes.models import COSMOS3_DROPPED, build_tiny_cosmos3_omni, build_tiny_mimo_vl

TOL = 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mimo_cosmos")
    return {"mimo_vl": build_tiny_mimo_vl(root / "mimo_vl"),
            "cosmos3_omni": build_tiny_cosmos3_omni(root / "cosmos3_omni", unified=False),
            "cosmos3_unified": build_tiny_cosmos3_omni(root / "cosmos3_unified")}


@pytest.mark.parametrize("name", ["mimo_vl", "cosmos3_omni"])
def test_import_verify_export(folders, name, tmp_path):
    import transformers

    from models.convert import hf_to_mcore, mcore_to_hf, verify

    source = folders[name]
    hf_to_mcore(str(source), tmp_path / "mcore", tp=1, pp=1)
    report = verify(source, tmp_path / "mcore")
    assert set(report) == {"one_image", "images_interleaved", "video"}
    for case, row in report.items():
        assert row["max_abs_logit_diff"] <= TOL, (name, case, row)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "export")
    before = load_file(str(source / "model.safetensors"))
    after = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert sorted(after) == sorted(before)  # the source's own names (older / published layout)
    for key in before:
        assert after[key].numpy().tobytes() == before[key].numpy().tobytes(), key
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config == json.loads((source / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    ours = cls.from_pretrained(tmp_path / "export").state_dict()
    theirs = cls.from_pretrained(source).state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_cosmos3_unified_checkpoint_is_refused_or_dropped(folders, tmp_path):
    """The generator, sound and action weights: one line naming each part (exit 2), or, with
    --drop-unused, one line saying what was dropped; the reasoner then gives transformers'
    logits (which ignores those weights)."""
    from models.convert import main, verify

    source = folders["cosmos3_unified"]
    assert main(["hf-to-mcore", "--hf", str(source), "--out", str(tmp_path / "no")]) == 2
    assert main(["hf-to-mcore", "--hf", str(source), "--out", str(tmp_path / "mcore"),
                 "--drop-unused"]) == 0
    for case, row in verify(source, tmp_path / "mcore").items():
        assert row["max_abs_logit_diff"] <= TOL, (case, row)
    assert main(["mcore-to-hf", "--mcore", str(tmp_path / "mcore"),
                 "--out", str(tmp_path / "export")]) == 0
    after = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert not set(COSMOS3_DROPPED) & set(after)


def test_cosmos3_refusal_is_one_line(folders, capsys, tmp_path):
    from models.convert import main

    assert main(["hf-to-mcore", "--hf", str(folders["cosmos3_unified"]),
                 "--out", str(tmp_path)]) == 2
    line, = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert "6 of the generator ('layers.0.moe_gen.experts.0.up_proj.weight'...)" in line
    assert "2 of the sound" in line and "nothing was allocated" not in line
    assert "2 of the action" in line and "--drop-unused" in line
