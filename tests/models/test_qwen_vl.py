"""Qwen-VL on megatron-core: HF import parity (TP=1, TP=2, PP=2), round trip, TP2->TP1 and
PP1<->PP2 reshard, count-mismatch error, CLI errors, tiny configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.models.conftest import train_steps, world2_result

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
TOL = 1e-4


@pytest.fixture(scope="module")
def imported(qwen_imported) -> dict[str, Path]:
    return {f: qwen_imported[f] for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, tiny_hf, imported):
    from models.convert import verify

    report = verify(tiny_hf[family], imported[family])
    assert set(report) == {"one_image", "images_interleaved", "video"}
    for name, row in report.items():
        assert row["max_abs_logit_diff"] <= TOL, (family, name, row)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_identical(family, tiny_hf, imported, tmp_path):
    from safetensors.torch import load_file

    from models.convert import mcore_to_hf

    mcore_to_hf(imported[family], tmp_path / "hf")
    before = load_file(str(tiny_hf[family] / "model.safetensors"))
    after = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config == json.loads((tiny_hf[family] / "config.json").read_text())


def test_count_mismatch_names_row(imported):
    from models.checkpointing.checkpoint import load_checkpoint
    from models.hf.verify_inputs import make_inputs
    from models.parallel import init_parallel

    init_parallel()
    model, cfg = load_checkpoint(imported["qwen2_5_vl"], use_te=False)
    inputs = make_inputs(cfg)["images_interleaved"]
    ids = inputs["input_ids"].clone()
    ids[0, (ids[0] == cfg.image_token_id).nonzero()[0]] = 5  # drop one <|image_pad|>
    inputs["input_ids"] = ids
    with pytest.raises(ValueError, match=r"batch row 0 \(k0\): .* 14 <\|image_pad\|> tokens "
                                         r"but 15 image embeddings"):
        with torch.no_grad():
            model(**inputs, sample_keys=["k0"])
    two = make_inputs(cfg)  # two rows: the first short of one token, the second complete
    row0, row1 = two["one_image"], two["images_interleaved"]
    ids0 = row0["input_ids"][0].clone()
    ids0[(ids0 == cfg.image_token_id).nonzero()[0]] = 5
    width = max(len(ids0), row1["input_ids"].shape[1])
    ids = torch.full((2, width), 5)
    ids[0, :len(ids0)], ids[1, :row1["input_ids"].shape[1]] = ids0, row1["input_ids"][0]
    pos = torch.zeros(3, 2, width, dtype=torch.long)
    with pytest.raises(ValueError, match=r"batch row 0 \(a\): 5 <\|image_pad\|> tokens but its "
                                         r"images in order give 6 embeddings"):
        with torch.no_grad():
            model(input_ids=ids, position_ids=pos,
                  pixel_values=torch.cat([row0["pixel_values"], row1["pixel_values"]]),
                  image_grid_thw=torch.cat([row0["image_grid_thw"], row1["image_grid_thw"]]),
                  sample_keys=["a", "b"])


def test_interleaved_mrope_section():
    from models.families.qwen_vl.model import megatron_mrope_section

    assert megatron_mrope_section([16, 24, 24], False) == [16, 24, 24]
    chunks = megatron_mrope_section([24, 20, 20], True)
    owner = [j % 3 for j, n in enumerate(chunks) for _ in range(n)]
    assert len(owner) == 64 and len(chunks) % 3 == 0
    assert owner[:6] == [0, 1, 2, 0, 1, 2] and owner[60:] == [0, 0, 0, 0]


def test_cli_errors(tmp_path, tiny_hf, capsys):
    """``python -m models.convert``'s main() in this process (the errors come before any process
    group or model): one line on stderr, exit code 2."""
    from models.convert import main

    def error(*argv: str) -> str:
        capsys.readouterr()
        assert main(list(argv)) == 2
        return capsys.readouterr().err

    err = error("verify", "--hf", str(tmp_path / "nope"), "--mcore", str(tmp_path))
    assert err.count("\n") == 1 and "--hf" in err
    bad = tmp_path / "llama"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (bad / "model.safetensors").write_bytes(b"")
    err = error("hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "o"))
    assert "model_type" in err.splitlines()[-1]


@pytest.mark.slow
def test_tp2_parity_and_reshard_to_tp1(tiny_hf, world2):
    """2 gloo ranks (tests/models/world2_checks.py's launch): import sharded at TP=2 and check
    TP=2 logits; then load those TP=2 checkpoints at TP=1 here and check logits again."""
    from models.convert import verify

    out = world2_result(world2, "tp2_qwen")
    report = json.loads((out / "tp2_report.json").read_text())
    for family in FAMILIES:
        writers = {p.name.split("_")[2] for p in (out / family).glob("__*_*.distcp")}
        assert writers == {"0", "1"}  # both TP ranks wrote shards
        for name, diff in report[family].items():
            assert diff <= TOL, (family, name, diff)
        for name, row in verify(tiny_hf[family], out / family).items():  # TP=1 load
            assert row["max_abs_logit_diff"] <= TOL, (family, name, row)


@pytest.mark.slow
def test_pp2_parity_and_reshard(tiny_hf, imported, world2):
    """2 gloo ranks (tests/models/world2_checks.py's launch): import Qwen2.5-VL at PP=2 (one LM
    layer per stage, each stage writes its own), PP=2 logits vs transformers, the PP=1 import
    loaded at PP=2 equals it; then here at PP=1: the PP=2 import's logits and tensors equal the
    PP=1 import's."""
    from tests.models.pp2_check import check_pp2

    check_pp2(tiny_hf["qwen2_5_vl"], imported["qwen2_5_vl"],
              world2_result(world2, "pp2_qwen2_5_vl"),
              {"one_image", "images_interleaved", "video"}, TOL)


@pytest.mark.parametrize("name", ["qwen2_5_vl_tiny", "qwen3_vl_tiny"])
def test_tiny_config_trains(name):
    """configs/<tiny>.yaml builds a model whose loss falls within a few CPU steps."""
    import glob

    from models.families import build_model
    from models.families.qwen_vl.config import load_yaml
    from models.hf.verify_inputs import make_inputs
    from models.parallel import init_parallel

    for path in glob.glob(str(REPO / "configs" / "qwen*_vl_*.yaml")):
        load_yaml(path)  # every shipped model config parses
    cfg = load_yaml(REPO / "configs" / f"{name}.yaml", ["lm.max_position_embeddings=512"])
    init_parallel()
    model = build_model(cfg, use_te=False).train()
    batch = make_inputs(cfg)["images_interleaved"]
    losses = train_steps(model, batch)
    assert losses[-1] < losses[0]
    assert all(p.grad is not None for p in model.vision.parameters())


def test_visual_kinds_ignored_with_separate_tokens():
    """Qwen's images and videos have their own context tokens: ``visual_kinds`` (the batch's
    image / video order) is not read, so a batch mixing both gives the same logits with it,
    without it, or with a wrong one (Qwen3-VL: DeepStack included)."""
    from models.families import build_model
    from models.families.qwen_vl.config import load_yaml
    from models.hf.verify_inputs import make_inputs
    from models.parallel import init_parallel

    cfg = load_yaml(REPO / "configs" / "qwen3_vl_tiny.yaml", ["lm.max_position_embeddings=512"])
    assert cfg.image_token_id != cfg.video_token_id
    init_parallel()
    torch.manual_seed(0)
    model = build_model(cfg, use_te=False).eval()
    cases = make_inputs(cfg)
    rows = [cases["images_interleaved"], cases["video"]]
    length = max(r["input_ids"].shape[1] for r in rows)
    ids = torch.zeros(2, length, dtype=torch.long)
    pos = torch.zeros(3, 2, length, dtype=torch.long)
    for i, row in enumerate(rows):
        n = row["input_ids"].shape[1]
        ids[i, :n], pos[:, i, :n] = row["input_ids"][0], row["position_ids"][:, 0]
    batch = {"input_ids": ids, "position_ids": pos, **{k: v for r in rows for k, v in r.items()
                                                        if k not in ("input_ids", "position_ids")}}
    with torch.no_grad():
        plain = model(**batch)
        for kinds in (torch.tensor([0, 0, 0, 1]), torch.tensor([1, 1])):
            assert torch.equal(model(**batch, visual_kinds=kinds), plain)
        for i, row in enumerate(rows):  # each row as alone: DeepStack lands on its own tokens
            n = row["input_ids"].shape[1]
            torch.testing.assert_close(plain[i, :n], model(**row)[0], rtol=0, atol=1e-5)
