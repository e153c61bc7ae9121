"""recipes/param_groups.py: a learning rate per part (vision tower, projection, LM), weight decay
skipped on biases, norms and (option) embeddings, LoRA+'s B factors; a zero rate leaves its
part bit-identical while the rest trains, and equal rates are today's single group bit for bit."""

from __future__ import annotations

import pytest
import torch

from recipes.run_config import load_run_config
from tests.test_train import FAST, MANTIS_CFG, ok, records, train


def _groups(*overrides: str):
    """(optimizer param groups, parameter -> our name) of the tiny Qwen2.5-VL as train.py builds
    them."""
    from models.families import build_model
    from models.parallel import init_parallel
    from recipes.model_setup import freeze, wrap_for_training
    from recipes.param_groups import overrides as group_overrides

    cfg = load_run_config(MANTIS_CFG, ["train.precision=fp32", "train.distributed_optimizer=false",
                                       *overrides])  # groups hold the model's parameters
    init_parallel()
    torch.manual_seed(0)
    model = build_model(cfg.model, use_te=False)
    freeze(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    _wrapped, optimizer = wrap_for_training(model, cfg.train, False, group_overrides(cfg))
    return cfg, optimizer, names


def _where(optimizer, names) -> dict[str, int]:
    """Our parameter name -> the index of its optimizer group."""
    return {names[id(p)]: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]
            if id(p) in names}


def test_each_part_gets_its_rate_and_decay_skips_norms_biases_and_embeddings():
    from recipes.param_groups import GroupRates

    cfg, optimizer, names = _groups("train.lr_vision_model=1e-4", "train.weight_decay=0.1",
                                    "train.no_decay_embeddings=true")
    where = _where(optimizer, names)
    rates = GroupRates.of(optimizer, cfg)
    peak = {name: rates.rates[i][0] for name, i in where.items()}
    low = {name: rates.rates[i][1] for name, i in where.items()}
    tower = [n for n in where if n.startswith("vision.") and not n.startswith("vision.merger.")]
    assert tower and all(peak[n] == 1e-4 and low[n] == pytest.approx(1e-5) for n in tower)
    assert all(peak[n] == cfg.train.lr for n in where if n.startswith("vision.merger."))
    assert all(peak[n] == cfg.train.lr for n in where if n.startswith("language_model."))
    for name, i in where.items():
        skip = name.endswith(".bias") or "norm" in name or "embedding" in name \
            or "output_layer" in name
        assert optimizer.param_groups[i]["wd_mult"] == (0.0 if skip else 1.0), name
    assert rates.at(0)[0] == pytest.approx(rates.rates[0][0] / cfg.train.warmup_steps)
    # equal rates: the very groups of a single rate
    _cfg, single, _ = _groups()
    _cfg, equal, _ = _groups(f"train.lr_vision_model={cfg.train.lr}",
                             f"train.lr_vision_projection={cfg.train.lr}")
    assert len(equal.param_groups) == len(single.param_groups)


@pytest.mark.parametrize("peft", ["lora", "dora"])
def test_lora_plus_multiplies_the_b_factors_rate(peft):
    """An adapter (DoRA's magnitude too) trains at its part's rate; LoRA+ multiplies its B
    factor's only; the magnitude (a vector) gets no weight decay."""
    from recipes.param_groups import GroupRates

    cfg, optimizer, names = _groups(f"model.peft={peft}", "model.lora.rank=4",
                                    "model.lora.parts=[language_model,vision_model]",
                                    "train.lr_vision_model=1e-4", "train.lora_plus_ratio=16")
    rates = GroupRates.of(optimizer, cfg)
    where = _where(optimizer, names)
    for name, i in where.items():
        part = 1e-4 if name.startswith("vision.") else cfg.train.lr
        assert rates.rates[i][0] == part * (16 if name.endswith("lora_b.weight") else 1), name
    magnitudes = [n for n in where if n.endswith("_lora.magnitude")]
    assert bool(magnitudes) == (peft == "dora")
    assert {n.split(".")[0] for n in magnitudes} == ({"vision", "language_model"}
                                                     if magnitudes else set())
    assert all(optimizer.param_groups[where[n]]["wd_mult"] == 0.0 for n in magnitudes)


@pytest.mark.slow
def test_zero_rate_keeps_its_part_and_equal_rates_change_nothing(mantis_out, tmp_path):
    """train.py, 3 steps: with the tower's rate 0 its tensors of step 1 and step 3 are equal bit
    for bit while the LM's moved; with every part's rate set to the LM's the losses and gradient
    norms are today's bit for bit; the start line lists the groups."""
    from tests.test_hf_journey import state

    args = [str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", "train.steps=3",
            "train.eval_interval=0", *FAST, "train.weight_decay=0.1"]
    plain, equal, zero = tmp_path / "plain", tmp_path / "equal", tmp_path / "zero"
    ok(train(*args, f"out={plain}"))
    lr = load_run_config(MANTIS_CFG).train.lr
    ok(train(*args, f"out={equal}", f"train.lr_vision_model={lr}",
             f"train.lr_vision_projection={lr}"))
    assert [(r["loss"], r["grad_norm"]) for r in records(plain)] == \
        [(r["loss"], r["grad_norm"]) for r in records(equal)]
    proc = train(*args, f"out={zero}", "train.lr_vision_model=0", "checkpoint.interval=1",
                 "train.keep_checkpoints=0")
    ok(proc)
    assert "parameter groups (rank 0): language_model" in proc.stdout
    assert "vision_model 0.06 M lr 0" in proc.stdout
    first, last = (state(zero / "checkpoints" / f"step_00000{s}") for s in (1, 3))
    tower = [k for k in first if k.startswith("vision.") and not k.startswith("vision.merger.")]
    assert tower and all(torch.equal(first[k], last[k]) for k in tower)
    lm = [k for k in first if k.startswith("language_model.")]
    assert sum(not torch.equal(first[k], last[k]) for k in lm) > len(lm) // 2
