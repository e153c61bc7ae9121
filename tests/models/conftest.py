"""Tiny random-weight Qwen2.5-VL / Qwen3-VL / Nemotron-Omni models built with transformers (no
download)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.tiny_hf import build_tiny_hf, build_tiny_nemotron_omni

#: family -> (configs/ file, overrides) of the tiny model of each family
TINY_CONFIGS = {
    "qwen2_5_vl": ("qwen2_5_vl_tiny.yaml", ["lm.max_position_embeddings=512"]),
    "qwen3_vl": ("qwen3_vl_tiny.yaml", ["lm.max_position_embeddings=512"]),
    "nemotron_omni": ("nemotron_omni_tiny.yaml", []),
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
