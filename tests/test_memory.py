"""recipes/memory.py: the per-GPU memory estimate of a run (``python -m recipes.memory CONFIG
--gpus N``) against the parameters of the model itself: experts shared by EP, frozen groups and
LoRA's frozen base with no gradient or optimizer state, pipeline stages that split the weights;
the published Qwen3-VL-30B-A3B layout from its published parameter total. (train.py prints the
same estimate of its rank 0: equal to this one in tests/models/test_moe_layouts.py's PP = 2 and
EP = 2 runs.)"""

from __future__ import annotations

import pytest
import torch

from recipes.run_config import load_run_config
from tests.conftest import REPO

MOE = REPO / "configs" / "train_qwen3_vl_moe_mantis.yaml"
FP32 = ("train.precision=fp32", "task_encoder.fixed_length=true")


def _estimates(*overrides: str, gpus: int = 1):
    from recipes.memory import estimate_run

    return estimate_run(load_run_config(MOE, [*FP32, *overrides]), gpus)


def _numels(*overrides: str) -> dict[str, int]:
    """Parameter counts of the meta-device model: all, experts, vision tower."""
    from models.families import model_class
    from models.parallel import init_parallel

    cfg = load_run_config(MOE, [*FP32, *overrides]).model
    init_parallel()
    with torch.device("meta"):
        model = model_class(cfg)(cfg, use_te=False)
    named = dict(model.named_parameters())
    return {"all": sum(p.numel() for p in named.values()),
            "experts": sum(p.numel() for n, p in named.items() if ".experts." in n),
            "tower": sum(p.numel() for n, p in named.items() if n.startswith("vision.")
                         and not n.startswith(("vision.merger.", "vision.deepstack_mergers.")))}


def test_estimate_knows_experts_frozen_groups_lora_and_stages():
    n = _numels()
    full, = _estimates()
    assert full.weights == full.grads == 4 * n["all"]  # fp32 weights, fp32 gradient buffer
    assert full.optimizer == 8 * n["all"]  # Adam's two fp32 moments, nothing sharded at DP 1
    # EP = 2 on 2 GPUs: half the experts per GPU; their optimizer state over expert-DP 1, the
    # dense state over DP 2
    ep2, = _estimates("parallel.ep=2", gpus=2)
    assert ep2.weights == 4 * (n["all"] - n["experts"] / 2)
    assert ep2.optimizer == 8 * ((n["all"] - n["experts"]) / 2 + n["experts"] / 2)
    # a frozen tower: weights only (no gradient, no optimizer state, no activations kept)
    frozen, = _estimates("model.freeze_vision_model=true")
    assert frozen.weights == full.weights
    assert frozen.grads == 4 * (n["all"] - n["tower"])
    assert frozen.optimizer == 8 * (n["all"] - n["tower"])
    assert frozen.activations < full.activations
    # LoRA: the base is held and frozen, only the adapters (the experts' excluded) train
    lora, = _estimates("model.peft=lora", "model.lora.rank=4")
    adapters = lora.weights / 4 - n["all"]
    assert 0 < adapters < n["all"] / 10
    assert lora.grads == 4 * adapters and lora.optimizer == 8 * adapters
    experts, = _estimates("model.peft=lora", "model.lora.rank=4", "model.lora.experts=true")
    assert experts.grads > lora.grads
    # PP = 2: the stages hold the weights between them, the last the logits' activations
    stages = _estimates("model.lm.num_layers=4", "parallel.pp=2", gpus=2)
    assert sum(s.weights for s in stages) == 4 * _numels("model.lm.num_layers=4")["all"]


def test_refusals_are_one_line(capsys):
    from recipes.memory import main

    assert main([str(MOE), "--gpus", "3", "parallel.ep=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not divisible by tp*pp*ep" in err, err
    assert main([str(MOE), "--gpus", "1", "model.lora.rank=4"]) == 2
    assert "add model.peft=lora" in capsys.readouterr().err


@pytest.mark.slow
def test_published_30b_a3b_layout():
    """configs/train_qwen3_vl_30b_a3b_mantis.yaml (TP1 EP8, 8 GPUs, bf16): each GPU holds the
    dense 2,079,724,784 parameters and 1/8 of the 28,991,029,248 expert ones (31,070,754,032
    published in all); fp32 gradients of both; the dense optimizer state over 8 DP ranks, the
    experts' over expert-DP 1; the line says whether it fits."""
    from recipes.memory import estimate_run, summary

    cfg = load_run_config(REPO / "configs" / "train_qwen3_vl_30b_a3b_mantis.yaml")
    experts = 48 * 128 * 3 * 2048 * 768
    dense = 31_070_754_032 - experts
    one, = estimate_run(cfg, 8)
    assert one.weights == 2 * (dense + experts / 8)
    assert one.grads == 4 * (dense + experts / 8)
    assert one.optimizer == 12 * (dense / 8 + experts / 8)
    assert "GiB GPU" in summary([one])


def test_gated_deltanet_layers_keep_the_whole_sequence_under_cp_where_they_gather():
    """Qwen3.5 MoE's Gated DeltaNet layers under CP = 2 (models/gated_deltanet.py): with 1 key
    head per TP rank they all-gather the CP shares, and their mixers keep the activations of the
    whole sequence (per DeltaNet layer: 4 of them count 4 / 3 of 3), the rest of the LM (norms,
    router, experts, attention, logits) half; with 2 key heads they share the heads over the CP
    ranks and everything halves. The conv counts its input and output channels (not its kernel
    width)."""
    from recipes.memory import estimate_run

    config = REPO / "configs" / "train_qwen3_5_moe_mantis.yaml"
    shared = [*FP32, "model.freeze_vision_model=true", "train.micro_batch_size=1",
              "model.lm.linear_num_key_heads=1"]

    def layer_acts(layers: str, cp: int) -> float:
        cfg = load_run_config(config, [*shared, f"model.lm.layer_types={layers}",
                                       f"parallel.cp={cp}"])
        one, = estimate_run(cfg, cp)
        logits = cfg.task_encoder.seq_length / cp * cfg.model.lm.vocab_size * (4 + 4)
        return one.activations - logits

    def deltanet(layers: str) -> float:  # what CP = 2 does not halve: acts = rest / cp + this
        return 2 * layer_acts(layers, 2) - layer_acts(layers, 1)

    linear = "[linear_attention,linear_attention,linear_attention,linear_attention]"
    mixed = "[linear_attention,linear_attention,linear_attention,full_attention]"
    assert 0 < deltanet(linear) < layer_acts(linear, 1)  # norms, router, experts: halved
    assert deltanet(linear) == pytest.approx(4 / 3 * deltanet(mixed))  # 4 DeltaNet layers : 3
    shared[-1] = "model.lm.linear_num_key_heads=2"  # heads shared over CP: all of it halves
    assert deltanet(linear) == pytest.approx(0, abs=1e-6 * layer_acts(linear, 1))
    shared[-1] = "model.lm.linear_num_key_heads=1"
    # the conv keeps its input and output channels, whatever its kernel width
    wide = load_run_config(config, [*shared, f"model.lm.layer_types={linear}",
                                    "model.lm.linear_conv_kernel=8"])
    assert estimate_run(wide, 1)[0].activations - layer_acts(linear, 1) == \
        wide.task_encoder.seq_length * wide.model.lm.vocab_size * 8
