"""Activation recomputation (model config ``recompute``, models/layers/recompute.py) for both
families: the gradients are those of ``none`` and fewer activation bytes are kept for backward."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO
from tests.models.conftest import TINY_CONFIGS, build_tiny


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_recompute_keeps_gradients_and_saves_memory(family):
    from models.hf.verify_inputs import make_inputs
    from models.layers.recompute import backward_footprint

    kept, grads = {}, {}
    for mode in ("none", "selective", "full"):
        cfg, model = build_tiny(family, f"recompute={mode}")  # same initial weights
        kept[mode], _, grads[mode] = backward_footprint(model.train(),
                                                        make_inputs(cfg)["images_interleaved"])
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
