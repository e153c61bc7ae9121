"""Per-GPU memory of a training run, estimated before a job is queued: weights, gradients,
optimizer state and activations at the run's layout, sequence length and micro-batch.

    python -m recipes.memory CONFIG --gpus N [key=value ...]

builds the run's model on the meta device (no memory, no GPU; at TP = PP = EP = 1, with its LoRA
adapters and frozen groups as train.py sets them), gives each pipeline stage its parameters and
each parameter its share on one GPU (TP-sharded ones and LoRA factors / tp; MoE experts /
(ep x etp), ``parallel.etp``, default tp),
and prints one line per stage and the largest; train.py prints the same estimate of its rank 0
at start, from the parameters that rank really holds. What is counted, in bytes per parameter
on the GPU (megatron's DDP and optimizer as train.py sets them up):

- weights: every parameter, frozen ones too (2 bf16, 4 fp32);
- gradients: trainable parameters only (megatron's fp32 gradient buffer, 4, whole on every rank
  also with the distributed optimizer);
- optimizer state: trainable parameters only, Adam's two moments plus the fp32 master copy under
  bf16 (12 bf16, 8 fp32), divided by the ranks it is sharded over with
  ``train.distributed_optimizer``: DP x CP for dense parameters, expert-DP (world / (pp x ep x
  etp)) for experts. Frozen parameters (``model.freeze_*``, the base under LoRA) cost weights
  only: no gradient, no optimizer state;
- activations of one micro-batch of ``micro_batch_size`` x ``seq_length`` / cp tokens, as kept
  for backward: per token and LM layer, the input and output widths of every linear and the
  width of every norm (attention assumed flash: no score matrix; TP-sharded widths / tp, or
  under megatron's sequence parallelism, forced with MoE layers at TP > 1, every width on a
  1 / tp share of the tokens; an expert's linears once per routed token: top-k of them, the
  active experts, not all; a Gated DeltaNet's conv its input and output, and, where its layer
  all-gathers the CP shares instead of sharing its heads over them, the whole sequence, CP-fold
  (models/gated_deltanet.py)); under
  ``recompute=full`` (where the LM honours it) one hidden vector per layer plus one layer's
  worth; the logits (fp32 for the loss, V / tp wide) on the last stage; the vision tower at
  ``max_visual_tokens`` x merge² patches per row (shared over CP by vision DP), only when the
  tower trains. A pipeline stage s keeps min(pp - s, micro-batches) micro-batches in flight
  (1F1B).

Not counted: the CUDA context, communication buffers, the allocator's slack and transient
workspaces (typically 2-5 GiB together); the line says so. The activation term is a formula,
not measured on a GPU here.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import click

GIB = 2 ** 30
_LAYER = re.compile(r"language_model\.decoder\.layers\.(\d+)\.")
_VISION_LAYER = re.compile(r"vision\.(?:\w+\.)?layers\.(\d+)\.")
#: a Gated DeltaNet's parameters (models/gated_deltanet.py): its projections, conv and gated norm
_DELTANET = re.compile(r"\.self_attention\.(?:in_proj_|out_proj\.|conv_|norm\.weight)")


@dataclass(frozen=True, slots=True)
class Estimate:
    """Bytes on one GPU of one pipeline stage."""

    stage: int
    weights: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    def line(self) -> str:
        parts = " + ".join(f"{name} {_size(getattr(self, name))}" for name in
                           ("weights", "grads", "optimizer", "activations"))
        return f"stage {self.stage}: {parts} = {_size(self.total)}"


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.1f} MiB"


@dataclass(frozen=True, slots=True)
class _Split:
    """How one rank's copy of a full (TP = EP = 1) model is cut: divisors and the stage."""

    tp: int = 1
    etp: int = 1  #: the experts' tensor parallel
    ep: int = 1
    pp: int = 1
    stage: int = 0
    layers: int = 0  #: LM layers of the whole model


def _etp(p) -> int:
    return p.tp if p.etp is None else p.etp


def _divisor(name: str, param, split: _Split, named: dict) -> int:
    expert = ".experts." in name
    if not (getattr(param, "tensor_model_parallel", False) or _sharded_factor(name, named)):
        return split.ep if expert else 1
    return split.etp * split.ep if expert else split.tp


def _sharded_factor(name: str, named: dict) -> bool:
    """A LoRA factor that TP shards (models/lora.py: B of a column-parallel base, A of a row
    one); at TP = 1 megatron marks only the base linear."""
    for factor, dim in (("lora_b", 0), ("lora_a", 1)):
        suffix = f"_lora.{factor}.weight"
        if name.endswith(suffix):
            base = named.get(name[: -len(suffix)] + ".weight")
            return (base is not None and getattr(base, "tensor_model_parallel", False)
                    and getattr(base, "partition_dim", 0) == dim)
    return False


def _on_stage(name: str, split: _Split) -> bool:
    """The parameter lives on the split's stage (LM layers evenly over the stages; vision and
    embeddings on the first, the final norm and output layer on the last)."""
    if split.pp == 1:
        return True
    layer = _LAYER.search(name)
    if layer:
        return int(layer.group(1)) * split.pp // split.layers == split.stage
    if "language_model.decoder." in name or "language_model.output_layer." in name:
        return split.stage == split.pp - 1
    return split.stage == 0


def _widths(name: str, param, shard: float) -> float:
    """Activation elements per token the parameter's op keeps: a linear's input + output width
    (its TP-sharded one / ``shard``), a norm's width; 0 for anything else (biases, adapters)."""
    if "_lora." in name:
        return 0.0
    sharded = getattr(param, "tensor_model_parallel", False)
    if _DELTANET.search(name) and ".conv_" in name:  # (channels, w): the conv's input and output
        return 2.0 * param.shape[0] / (shard if sharded else 1)
    if param.dim() == 2 and not name.endswith("embeddings.weight"):
        out, inp = param.shape
        if sharded and getattr(param, "partition_dim", 0) == 0:
            out /= shard
        elif sharded:
            inp /= shard
        return float(out + inp)
    if param.dim() == 1 and name.endswith(("norm.weight", "layer_norm_weight")):
        return float(param.numel() / (shard if sharded else 1))
    return 0.0


def estimate(model, cfg, gpus: int, bf16: bool, split: _Split | None = None) -> Estimate:
    """The estimate of one GPU from ``model``: a full meta-device model cut by ``split``
    (``python -m recipes.memory``), or with ``split=None`` the model train.py built on this
    rank (its parameters are already this rank's shares; its stage is its PP rank)."""
    from megatron.core.utils import get_model_config, unwrap_model

    from models.families import family_of
    from models.gated_deltanet import shares_heads

    p, t, te = cfg.parallel, cfg.train, cfg.task_encoder
    local = split is None
    if local:
        from megatron.core import parallel_state as ps

        split = _Split(pp=p.pp, stage=ps.get_pipeline_model_parallel_rank())
    model = unwrap_model(model)  # train.py's DDP(Float16Module(model)): our names
    config = get_model_config(model)
    dtype = 2 if bf16 else 4
    experts = getattr(config, "num_moe_experts", None) or 0
    # an expert's linears see top-k / (experts present here) of the tokens (balanced routing)
    routed = (config.moe_router_topk / (experts / (p.ep if local else 1))) if experts else 1.0
    group = family_of(cfg.model).parameter_group
    sequence_parallel = bool(experts) and p.tp > 1
    # a Gated DeltaNet under CP shares its heads, or (too few per TP rank) gathers the sequence
    deltanet_gathers = p.cp > 1 and not shares_heads(
        (getattr(config, "linear_num_key_heads", None) or 0) // p.tp, p.cp)
    weights = trainable = trainable_experts = 0.0
    lm_width = vision_width = 0.0
    lm_layers, vision_layers, vision_trains = set(), set(), False
    named = dict(model.named_parameters())
    for name, param in named.items():
        if not (local or _on_stage(name, split)):
            continue
        n = param.numel() / (1 if local else _divisor(name, param, split, named))
        weights += n
        if param.requires_grad:
            trainable_experts += n if ".experts." in name else 0
            trainable += 0 if ".experts." in name else n
            vision_trains |= group(name) == "vision_model"
        expert = ".experts." in name
        layer, vision_layer = _LAYER.search(name), _VISION_LAYER.search(name)
        # under sequence parallelism (megatron's, forced with MoE under TP) an LM layer keeps a
        # sequence share of the tokens at full width; else every token at the TP-sharded widths
        # (``local`` shapes are sharded already)
        if expert or not (layer and sequence_parallel):
            shard = 1 if local else split.etp if expert else split.tp
        else:
            shard = 1 / p.tp if local else 1
        width = _widths(name, param, shard)
        if layer and _DELTANET.search(name) and deltanet_gathers:  # the whole sequence
            width *= p.cp
        if layer:
            lm_layers.add(layer.group(1))
            lm_width += width * (routed if expert else 1.0)
        elif vision_layer:
            vision_layers.add(vision_layer.group(1))
            vision_width += width
    dp_cp = gpus // (p.tp * p.pp)
    expert_dp = gpus // (p.pp * p.ep * _etp(p))
    shard = t.distributed_optimizer
    optimizer = (12 if bf16 else 8) * (trainable / (dp_cp if shard else 1)
                                       + trainable_experts / (expert_dp if shard else 1))
    grads = 4 * (trainable + trainable_experts)
    # activations of one micro-batch on this rank
    tokens = t.micro_batch_size * te.seq_length / p.cp
    if getattr(config, "recompute_granularity", None) == "full" and lm_layers:
        lm_width = config.hidden_size * len(lm_layers) + lm_width / len(lm_layers)
    acts = tokens / (p.tp if sequence_parallel else 1) * lm_width * dtype
    if split.stage == split.pp - 1:  # the logits of every token, V / tp wide, and fp32's
        acts += tokens * cfg.model.lm.vocab_size / p.tp * (dtype + 4)
    if split.stage == 0 and vision_trains:
        merge = family_of(cfg.model).vision_geometry(cfg.model)["merge_size"]
        patches = t.micro_batch_size * te.max_visual_tokens * merge ** 2
        patches /= p.cp if p.vision_dp else 1
        if cfg.model.recompute == "full" and vision_layers:
            vision_width = (vision_width / len(vision_layers)
                            + len(vision_layers) * cfg.model.vision.hidden_size)
        acts += patches * vision_width * dtype
    in_flight = min(split.pp - split.stage, t.grad_accum * cfg.data.virtual_dp)
    return Estimate(stage=split.stage, weights=weights * dtype, grads=grads,
                    optimizer=optimizer, activations=acts * in_flight)


def estimate_run(cfg, gpus: int) -> list[Estimate]:
    """Every pipeline stage's estimate of ``cfg`` on ``gpus`` GPUs (see the module docstring).

    Raises:
        UsageError: a layout that cannot be built on ``gpus`` GPUs, or bad LoRA settings.
    """
    import torch

    from models.families import model_class
    from models.parallel import init_parallel
    from recipes.layout import check_layout
    from recipes.model_setup import freeze

    p = cfg.parallel
    check_layout(gpus, p.tp, p.pp, p.cp, cfg.task_encoder.fixed_length, p.ep, p.etp)
    init_parallel()
    with torch.device("meta"):
        model = model_class(cfg.model)(cfg.model, use_te=False)
        freeze(model, cfg)
    layers = cfg.model.lm.num_layers
    bf16 = cfg.train.precision != "fp32"  # auto: bf16 on the GPUs the estimate is for
    return [estimate(model, cfg, gpus, bf16,
                     _Split(tp=p.tp, etp=_etp(p), ep=p.ep, pp=p.pp, stage=s, layers=layers))
            for s in range(p.pp)]


def summary(estimates: list[Estimate], gpu_gib: float = 80.0) -> str:
    """The largest stage's total and whether it fits a ``gpu_gib`` GiB GPU."""
    worst = max(estimates, key=lambda e: e.total)
    verdict = "fits" if worst.total / GIB <= gpu_gib else "does NOT fit"
    return (f"per GPU at most {_size(worst.total)} (stage {worst.stage}): {verdict} a "
            f"{gpu_gib:g} GiB GPU (CUDA context, communication buffers and allocator slack, "
            "2-5 GiB, not counted)")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config")
@click.argument("overrides", nargs=-1)
@click.option("--gpus", type=int, required=True, help="GPUs of the job (the world size).")
@click.option("--gpu-memory", type=float, default=80.0, show_default=True,
              help="GiB of one GPU, for the verdict.")
def cli(config: str, overrides: tuple[str, ...], gpus: int, gpu_memory: float) -> None:
    """Per-GPU memory estimate of train.py's CONFIG (+ key=value overrides) on --gpus GPUs."""
    from recipes.run_config import load_run_config

    cfg = load_run_config(config, list(overrides))
    estimates = estimate_run(cfg, gpus)
    p = cfg.parallel
    click.echo(f"[memory] {config}: {gpus} GPUs = tp {p.tp} x pp {p.pp} x cp {p.cp} x dp "
               f"{gpus // (p.tp * p.pp * p.cp)} (ep {p.ep}); micro-batch "
               f"{cfg.train.micro_batch_size} x {cfg.task_encoder.seq_length} tokens")
    for one in estimates:
        click.echo(f"[memory] {one.line()}")
    click.echo(f"[memory] {summary(estimates, gpu_memory)}")


def main(argv: list[str] | None = None) -> int:
    from contract.cli import run_click

    return run_click(cli, "recipes.memory", argv)


if __name__ == "__main__":
    sys.exit(main())
