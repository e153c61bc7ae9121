"""Tiny random-weight Qwen2.5-VL / Qwen3-VL / Nemotron-Omni models built with transformers (no
download)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lookalikes.models import build_tiny_hf, build_tiny_nemotron_omni, build_tiny_qwen3_5
from tests.conftest import REPO

#: family -> (configs/ file, overrides) of the tiny model of each family
TINY_CONFIGS = {
    "qwen2_5_vl": ("qwen2_5_vl_tiny.yaml", ["lm.max_position_embeddings=512"]),
    "qwen3_vl": ("qwen3_vl_tiny.yaml", ["lm.max_position_embeddings=512"]),
    "nemotron_omni": ("nemotron_omni_tiny.yaml", []),
    "qwen3_5": ("qwen3_5_tiny.yaml", []),
    "qwen3_5_moe": ("qwen3_5_moe_tiny.yaml", []),
}


def build_tiny(family: str, *overrides: str, seed: int = 0):
    """(config, model) of the family's tiny config (+ ``overrides``), local spec, seeded init."""
    from models.families import build_model, config_module
    from models.parallel import init_parallel

    config, defaults = TINY_CONFIGS[family]
    cfg = config_module(family).load_yaml(REPO / "configs" / config, [*defaults, *overrides])
    init_parallel()
    torch.manual_seed(seed)
    return cfg, build_model(cfg, use_te=False)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_hf")
    return {f: build_tiny_hf(f, root / f) for f in ("qwen2_5_vl", "qwen3_vl")}


@pytest.fixture(scope="session")
def tiny_nemotron_hf(tmp_path_factory) -> dict[str, Path]:
    """pattern -> saved tiny NemotronH_Omni_Reasoning_V3: "M*M-" (Mamba2, attention, MLP; the
    tiny config's pattern) and "ME*E" (with MoE layers, which run on CPU with megatron's local
    MoE; at PP=2 each stage has MoE)."""
    root = tmp_path_factory.mktemp("tiny_nemotron")
    return {p: build_tiny_nemotron_omni(root / f"p{i}", pattern=p)
            for i, p in enumerate(("M*M-", "ME*E"))}


@pytest.fixture(scope="session")
def super_hf(tmp_path_factory) -> Path:
    """A hub-complete tiny Nemotron 3.5 Super VL folder (``lookalikes.models``: LatentMoE, the
    MTP block's published tensors; test tokenizer, processor files)."""
    from lookalikes.models import build_tiny_hf_model

    return build_tiny_hf_model("nemotron_omni", tmp_path_factory.mktemp("super") / "hf",
                               pixels=(16384, 16384), super_vl=True)


@pytest.fixture(scope="session")
def qwen_imported(tiny_hf, tmp_path_factory) -> dict[str, Path]:
    """family -> the hf-to-mcore import (TP=1, PP=1) of ``tiny_hf``'s model."""
    from models.convert import hf_to_mcore

    root = tmp_path_factory.mktemp("mcore")
    for family, path in tiny_hf.items():
        hf_to_mcore(str(path), root / family, tp=1, pp=1)
    return {f: root / f for f in tiny_hf}


@pytest.fixture(scope="session")
def nemotron_imported(tiny_nemotron_hf, tmp_path_factory) -> dict[str, Path]:
    """pattern -> the hf-to-mcore import (TP=1, PP=1) of ``tiny_nemotron_hf``'s model."""
    from models.convert import hf_to_mcore

    root = tmp_path_factory.mktemp("mcore_nemotron")
    out = {}
    for i, (pattern, path) in enumerate(tiny_nemotron_hf.items()):
        hf_to_mcore(str(path), root / f"p{i}", tp=1, pp=1)
        out[pattern] = root / f"p{i}"
    return out


@pytest.fixture(scope="session")
def qwen3_5_hf(tmp_path_factory) -> dict[str, Path]:
    """name -> a tiny HF Qwen3.5 folder (lookalikes.models) with the published ``mtp.*``
    tensors added (``add_qwen3_5_mtp``): ``qwen3_5`` dense, ``qwen3_5_moe`` with the experts one
    by one (Qwen3.5's layout, main layers and MTP layer), ``qwen3_6_moe`` the same model type
    with the experts packed in both (Qwen3.6's MTP layer: ``mtp.layers.0.mlp.experts.gate_up_proj``
    / ``down_proj``)."""
    from lookalikes.models import add_qwen3_5_mtp, pack_qwen3_5_experts

    root = tmp_path_factory.mktemp("qwen3_5")
    dense = build_tiny_qwen3_5(root / "dense")
    add_qwen3_5_mtp(dense)
    moe = build_tiny_qwen3_5(root / "moe", moe=True)
    add_qwen3_5_mtp(moe)
    packed = build_tiny_qwen3_5(root / "moe_packed", moe=True, seed=2)
    pack_qwen3_5_experts(packed)
    add_qwen3_5_mtp(packed, packed=True)
    return {"qwen3_5": dense, "qwen3_5_moe": moe, "qwen3_6_moe": packed}


@pytest.fixture(scope="session")
def qwen3_5_imported(qwen3_5_hf, tmp_path_factory) -> dict[str, Path]:
    """family -> the hf-to-mcore import (TP=1, PP=1) of ``qwen3_5_hf``'s model."""
    from models.convert import hf_to_mcore

    root = tmp_path_factory.mktemp("qwen3_5_mcore")
    for family, folder in qwen3_5_hf.items():
        hf_to_mcore(str(folder), root / family, tp=1, pp=1)
    return {family: root / family for family in qwen3_5_hf}


@pytest.fixture(scope="session")
def world2(tiny_hf, tiny_nemotron_hf, qwen_imported, nemotron_imported, qwen3_5_hf,
           qwen3_5_imported, tmp_path_factory):
    """The one torchrun launch (2 gloo ranks) of every 2-process check of tests/models
    (tests/models/world2_checks.py) -> check name -> its output folder. Each test asserts on its
    check's files (``world2_result``)."""
    root = tmp_path_factory.mktemp("world2")
    checks = {
        "tp2_qwen": ("tp2", [tiny_hf["qwen2_5_vl"], tiny_hf["qwen3_vl"]]),
        "tp2_nemotron_ME*E": ("tp2", [tiny_nemotron_hf["ME*E"]]),
        "pp2_qwen2_5_vl": ("pp2", [tiny_hf["qwen2_5_vl"], qwen_imported["qwen2_5_vl"]]),
        **{f"pp2_nemotron_{p}": ("pp2", [tiny_nemotron_hf[p], nemotron_imported[p]])
           for p in ("M*M-", "ME*E")},
        "tp2_qwen3_5": ("tp2", [qwen3_5_hf["qwen3_5"]]),
        "tp2_moe": ("tp2", [build_tiny_hf("qwen3_vl_moe", root / "qwen3_vl_moe_hf"),
                            qwen3_5_hf["qwen3_5_moe"]]),
        "pp2_qwen3_5": ("pp2", [qwen3_5_hf["qwen3_5"], qwen3_5_imported["qwen3_5"]]),
        "vision_dp_cp2": ("vision_dp", []),
        "nemotron_vision_dp_cp2": ("nemotron_vision_dp", []),
    }
    return launch_world2(checks, root)


def launch_world2(checks: dict[str, tuple[str, list]], root: Path) -> dict:
    """One torchrun launch (2 gloo ranks) of tests/models/world2_checks.py over ``checks`` (name
    -> (check kind, its arguments)) -> name -> (its output folder under ``root``, the process)."""
    import json
    import subprocess
    import sys

    folders = {name: root / f"c{i}" for i, name in enumerate(checks)}
    spec = [{"check": kind, "out": str(folders[name]), "args": [str(a) for a in args]}
            for name, (kind, args) in checks.items()]
    (root / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "tests" / "models" / "world2_checks.py"), str(root / "spec.json")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    return {name: (folder, proc) for name, folder in folders.items()}


def world2_result(world2, name: str) -> Path:
    """The output folder of check ``name`` of the ``world2`` launch, asserting it completed."""
    folder, proc = world2[name]
    failed = sorted(folder.glob("FAILED.rank*"))
    assert not failed, failed[0].read_text()[-3000:]
    assert (folder / "DONE").exists(), (proc.returncode, proc.stderr[-3000:])
    return folder


def train_steps(model, batch: dict, steps: int = 4, lr: float = 1e-2) -> list[float]:
    """AdamW steps on one batch (labels = its input ids): the per-token loss of each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss, mask = model(**batch, labels=batch["input_ids"])
        loss = loss.sum() / mask.sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
