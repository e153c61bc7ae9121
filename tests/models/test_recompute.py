"""Activation recomputation (model config ``recompute``, models/recompute.py) for both families:
the gradients are those of ``none`` and fewer activation bytes are kept for backward."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO

MODELS = {
    "qwen2_5_vl": ("qwen2_5_vl_tiny.yaml", ["lm.max_position_embeddings=512"]),
    "qwen3_vl": ("qwen3_vl_tiny.yaml", ["lm.max_position_embeddings=512"]),
    "nemotron_omni": ("nemotron_omni_tiny.yaml", []),
}


def saved_bytes_and_grads(name: str, mode: str) -> tuple[int, dict[str, torch.Tensor]]:
    """One forward + backward of the tiny model (same init for every mode): the bytes of the
    distinct tensors autograd keeps for backward, and every parameter's gradient."""
    from models.checkpoint import build_model, init_parallel
    from models.convert import make_inputs
    from models.families import config_module

    config, overrides = MODELS[name]
    cfg = config_module(name).load_yaml(REPO / "configs" / config,
                                        [*overrides, f"recompute={mode}"])
    init_parallel()
    torch.manual_seed(0)
    model = build_model(cfg, use_te=False).train()
    batch = make_inputs(cfg)["images_interleaved"]
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, mask = model(**batch, labels=batch["input_ids"])
    (loss.sum() / mask.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return sum(kept.values()), grads


@pytest.mark.parametrize("name", list(MODELS))
def test_recompute_keeps_gradients_and_saves_memory(name):
    kept, grads = {}, {}
    for mode in ("none", "selective", "full"):
        kept[mode], grads[mode] = saved_bytes_and_grads(name, mode)
    for mode in ("selective", "full"):
        assert grads[mode].keys() == grads["none"].keys()
        for key, grad in grads["none"].items():
            torch.testing.assert_close(grads[mode][key], grad, rtol=0, atol=1e-6, msg=key)
    assert kept["full"] < kept["selective"] <= kept["none"], kept


def test_unknown_recompute_mode_is_refused():
    from models.families import config_module

    with pytest.raises(ValueError, match="recompute must be one of"):
        config_module("qwen2_5_vl").load_yaml(REPO / "configs" / "qwen2_5_vl_tiny.yaml",
                                              ["recompute=partial"])
