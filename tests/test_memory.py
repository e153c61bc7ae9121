"""recipes/memory.py: the per-GPU memory estimate of a run (``python -m recipes.memory CONFIG
--gpus N``) against the parameters of the model itself: experts shared by EP, frozen groups and
LoRA's frozen base with no gradient or optimizer state, pipeline stages that split the weights;
the published Qwen3-VL-30B-A3B layout from its published parameter total. (train.py prints the
same estimate of its rank 0: equal to this one in tests/models/test_moe_layouts.py's PP = 2 and
EP = 2 runs.)"""

from __future__ import annotations

import json

import pytest
import torch

from recipes.run_config import load_run_config
from tests.conftest import REPO

MOE = REPO / "configs" / "train_qwen3_vl_moe_mantis.yaml"
FP32 = ("train.precision=fp32", "task_encoder.fixed_length=true")


def _estimates(*overrides: str, gpus: int = 1):
    from recipes.estimate import estimate_run

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


def test_published_30b_a3b_layout():
    """Qwen3-VL-30B-A3B at Megatron-Bridge's published layout (TP1 EP8, 8 GPUs, bf16): each GPU
    holds the dense 2,079,724,784 parameters and 1/8 of the 28,991,029,248 expert ones
    (31,070,754,032 published in all); fp32 gradients of both; the dense optimizer state over 8
    DP ranks, the experts' over expert-DP 1; the line says it does not fit 80 GiB."""
    from recipes.estimate import estimate_run, summary

    cfg = load_run_config(REPO / "configs" / "train_qwen3_vl_30b_a3b_mantis.yaml",
                          ["recipe=none", "parallel.ep=8", "train.micro_batch_size=2",
                           "task_encoder.seq_length=4096", "task_encoder.max_visual_tokens=3072",
                           "task_encoder.fixed_length=true"])
    experts = 48 * 128 * 3 * 2048 * 768
    dense = 31_070_754_032 - experts
    one, = estimate_run(cfg, 8)
    assert one.weights == 2 * (dense + experts / 8)
    assert one.grads == 4 * (dense + experts / 8)
    assert one.optimizer == 12 * (dense / 8 + experts / 8)
    assert "(stage 0): does NOT fit a 80 GiB GPU" in summary([one])


def test_meta_model_holds_and_marks_what_an_initialised_one_does():
    """``models.families.meta_model`` (built without initialising a weight) gives the estimate's
    table of a model built with megatron's initialisation, every part of every family: the same
    parameters, cut by TP the same way."""
    from models.families import meta_model, model_class
    from models.parallel import init_parallel
    from recipes.estimate import table_of

    init_parallel()
    for name, config in (("qwen3_vl_moe", MOE), ("qwen3_5_moe", "train_qwen3_5_moe_mantis"),
                         ("nemotron_omni", "train_nemotron_omni_mantis"),
                         ("qwen2_5_vl", "train_qwen_vl_mantis")):
        path = config if isinstance(config, type(MOE)) else REPO / "configs" / f"{config}.yaml"
        cfg = load_run_config(path, [*FP32, "model.lm.num_experts=4"] if "moe" in name else FP32)
        with torch.device("meta"):
            initialised = model_class(cfg.model)(cfg.model, use_te=False)
        assert table_of(meta_model(cfg.model), cfg) == table_of(initialised, cfg), name


def test_suggest_lists_layouts_that_fit_fastest_first_and_reproducible(capsys):
    """``--suggest --json``: every listed layout fits (its largest stage + the reserve within
    the GPU), they come fastest first, and its overrides give ``--json``'s estimate of it."""
    from recipes.memory import RESERVE_GIB, main

    args = [str(MOE), "--gpus", "2", *FP32, "train.micro_batch_size=4"]
    assert main([*args, "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    memory = RESERVE_GIB + own["gib_per_gpu"] * 0.8  # the config's own layout does not fit
    assert main([*args, "--json", "--gpu-memory", str(memory)]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is False
    assert main([*args, "--suggest", "--json", "--gpu-memory", str(memory), "--top", "50"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert len(found) >= 3
    assert [s["step_seconds"] for s in found] == sorted(s["step_seconds"] for s in found)
    for suggestion in found:
        assert suggestion["gib_per_gpu"] + RESERVE_GIB <= memory
        assert main([str(MOE), "--gpus", "2", *FP32, *suggestion["overrides"], "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["gib_per_gpu"] == suggestion["gib_per_gpu"]


def test_train_refuses_a_layout_over_the_gpu_with_the_planners_best(tmp_path, capsys):
    """train.py, before it builds anything: a layout whose estimate does not fit the GPU
    (``train.gpu_memory_gib``) is one line with the planner's best layout; applying that layout
    passes the check; ``train.force_layout=true`` trains the first one anyway (here: up to the
    data check that follows)."""
    import train
    from recipes.estimate import RESERVE_GIB, estimate_run

    args = [str(MOE), *FP32, "train.micro_batch_size=4", f"data.path={tmp_path / 'none'}",
            f"out={tmp_path / 'run'}"]
    own = max(e.total for e in estimate_run(load_run_config(MOE, args[1:]), 1)) / 2 ** 30
    limit = f"train.gpu_memory_gib={RESERVE_GIB + own * 0.8}"
    assert train.main([*args, limit]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "by the memory estimate (recipes/memory.py), over the" in err
    best = err.split("the planner's best of 1 GPUs: ")[1].split(": ", 1)[1].split(" (python")[0]
    assert train.main([*args, limit, *best.split()]) == 2  # now only the data path is missing
    assert "data.path" in capsys.readouterr().err
    assert train.main([*args, limit, "train.force_layout=true"]) == 2
    assert "data.path" in capsys.readouterr().err


def test_gated_deltanet_layers_keep_the_whole_sequence_under_cp_where_they_gather():
    """Qwen3.5 MoE's Gated DeltaNet layers under CP = 2 (models/layers/gated_deltanet.py): with 1
    key head per TP rank they all-gather the CP shares, and their mixers keep the activations of the
    whole sequence (per DeltaNet layer: 4 of them count 4 / 3 of 3), the rest of the LM (norms,
    router, experts, attention, logits) half; with 2 key heads they share the heads over the CP
    ranks and everything halves. The conv counts its input and output channels (not its kernel
    width)."""
    from recipes.estimate import estimate_run

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
