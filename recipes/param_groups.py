"""The optimizer's parameter groups: a learning rate per part of the model, weight decay where it
belongs, LoRA+.

``train.lr`` is the language model's rate; ``train.lr_vision_model`` and
``train.lr_vision_projection`` (None: the LM's) give the vision tower and the projection into
the LM their own (the family's ``parameter_group``: a LoRA adapter is in its base linear's part,
MoE experts in the LM's); each part's minimum keeps the LM's ``min_lr / lr`` ratio and every part
follows the same warm-up and cosine (``recipes.schedule.lr_at``). ``train.lora_plus_ratio``
(LoRA+) multiplies the rate of every adapter's B factor. Weight decay skips biases and
one-dimensional parameters (norms), megatron's own rule, and with
``train.no_decay_embeddings`` the embeddings and output layer too.

``overrides`` is what megatron's ``get_megatron_optimizer`` takes (``config_overrides``); a part
whose rate is the LM's gets no override, so a run whose rates are all equal has exactly the
groups of a single rate. ``GroupRates`` maps each of the optimizer's groups (in its order,
megatron's ChainedOptimizer included) to its peak and minimum rate, read from the config, not
from a checkpoint: a rate changed at resume applies from the resumed step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from recipes.schedule import lr_at

#: run-config key of each part's rate (None: train.lr)
PART_RATES = {"vision_model": "lr_vision_model", "vision_projection": "lr_vision_projection"}


def part_rate(t, part: str) -> float:
    """Peak rate of a parameter group (``models.families.PARAMETER_GROUPS`` name)."""
    rate = getattr(t, PART_RATES[part]) if part in PART_RATES else None
    return t.lr if rate is None else rate


def _strip(name: str) -> str:
    """A parameter's name in our model (DDP / Float16Module wrappers' ``module.`` dropped)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def overrides(cfg) -> dict:
    """megatron ``config_overrides``: weight decay skips (megatron's standard ones, embeddings
    with ``train.no_decay_embeddings``), each part whose rate differs from the LM's, LoRA+'s B
    factors."""
    from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate

    from models.families import family_of

    t = cfg.train
    group = family_of(cfg.model).parameter_group
    found = get_standard_config_overrides(OptimizerConfig(lr=t.lr, min_lr=t.min_lr))
    if t.no_decay_embeddings:
        found[ParamKey(name=("*embedding*", "*output_layer*"))] = {"wd_mult": 0.0}
    ratio = t.min_lr / t.lr if t.lr else 0.0
    for part in PART_RATES:
        rate = part_rate(t, part)
        if rate == t.lr:
            continue
        key = ParamKey(with_name_predicate=ParamWithNamePredicate(
            name=f"part_{part}", fn=lambda _p, name, part=part: group(_strip(name)) == part))
        found[key] = {"max_lr": rate, "min_lr": rate * ratio}
    if t.lora_plus_ratio is not None and t.lora_plus_ratio != 1.0:
        found[ParamKey(name="*lora_b.weight")] = {"lr_mult": t.lora_plus_ratio}
    return found


@dataclass(frozen=True, slots=True)
class GroupRates:
    """Each optimizer group's (peak, minimum) rate and the run's schedule."""

    rates: tuple[tuple[float, float], ...]
    warmup_steps: int
    total_steps: int

    @classmethod
    def of(cls, optimizer, cfg) -> GroupRates:
        """From the groups megatron built: a group with a ``max_lr`` override is that part's,
        its ``lr_mult`` (LoRA+) applied; else the LM's."""
        t = cfg.train
        rates = []
        for group in optimizer.param_groups:
            peak = group.get("max_lr", t.lr) * group.get("lr_mult", 1.0)
            low = group.get("min_lr", t.min_lr) * group.get("lr_mult", 1.0)
            rates.append((peak, low))
        return cls(tuple(rates), t.warmup_steps, t.steps)

    def at(self, step: int) -> list[float]:
        """Every group's rate at optimizer step ``step`` (0-based)."""
        return [lr_at(step, lr=peak, min_lr=low, warmup_steps=self.warmup_steps,
                      total_steps=self.total_steps) for peak, low in self.rates]


def describe(model, cfg) -> str:
    """The start line's groups: each part's trainable parameters (this rank's model) and peak
    rate."""
    from models.families import family_of

    group = family_of(cfg.model).parameter_group
    counts, rates = Counter(), {}
    t = cfg.train
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for name, param in trainable:
        part = group(_strip(name))
        counts[part] += param.numel()
        rate = part_rate(t, part)
        if name.endswith("lora_b.weight") and t.lora_plus_ratio:
            part_b = f"{part} (LoRA B)"
            counts[part] -= param.numel()
            counts[part_b] += param.numel()
            rates[part_b] = rate * t.lora_plus_ratio
        rates[part] = rate
    return "; ".join(f"{part} {counts[part] / 1e6:.2f} M lr {rates[part]:g}"
                     for part in sorted(counts) if counts[part])

