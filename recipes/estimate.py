"""Per-GPU memory of a training run, estimated before a job is queued: weights, gradients,
optimizer state and activations at the run's layout, sequence length and micro-batch (what
``python -m recipes.memory`` prints, the planner ranks and train.py checks: recipes/memory.py).

``run_table`` builds the run's model on the meta device once (``models.families.meta_model``:
no memory, no GPU, no initialisation; at TP = PP = EP = 1, with its LoRA adapters and frozen
groups as train.py sets them) and sums its parameters into a table (``ModelTable``: per LM
layer and part, how a layout cuts each), so that any layout is estimated from that table in
microseconds (``estimate_layout``: what the planner ranks, recipes/planner.py): each pipeline
stage gets its parameters and each parameter its share on one GPU (TP-sharded ones and LoRA
factors / tp; MoE experts / (ep x etp), ``parallel.etp``, default tp). train.py prints the same
estimate of its rank 0 at start, from the parameters that rank really holds (``estimate`` on
its model). What is counted, in bytes per parameter on the GPU (megatron's DDP and optimizer
as train.py sets them up):

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
  (models/layers/gated_deltanet.py)); under
  ``recompute=full`` (where the LM honours it) one hidden vector per layer plus one layer's
  worth; the logits (fp32 for the loss, V / tp wide) on the last stage; the vision tower at
  ``max_visual_tokens`` x merge² patches per row (shared over CP by vision DP), only when the
  tower trains. A pipeline stage s keeps min(pp - s, micro-batches) micro-batches in flight
  (1F1B).

Not counted: the CUDA context, communication buffers, the allocator's slack and transient
workspaces: ``RESERVE_GIB`` (4 GiB) is kept free for them when a layout is judged to fit (the
verdict line and ``--suggest``; train.py's refusal). The activation term is a formula; how it
compares with what autograd keeps is measured by bench/bench_memory.py (docs/training.md,
"Memory estimate").
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace

GIB = 2 ** 30
#: GiB of a GPU left for what the estimate does not count (CUDA context, NCCL buffers, the
#: allocator's slack, transient workspaces: typically 2-5 GiB together)
RESERVE_GIB = 4.0
_LAYER = re.compile(r"language_model\.decoder\.layers\.(\d+)\.")
_VISION_LAYER = re.compile(r"vision\.(?:\w+\.)?layers\.(\d+)\.")
#: a Gated DeltaNet's parameters (models/layers/gated_deltanet.py): its projections, conv and
#: gated norm
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
        parts = " + ".join(f"{name} {size_text(getattr(self, name))}" for name in
                           ("weights", "grads", "optimizer", "activations"))
        return f"stage {self.stage}: {parts} = {size_text(self.total)}"

    def as_dict(self) -> dict:
        return {"stage": self.stage, "gib": round(self.total / GIB, 3),
                **{name: round(getattr(self, name) / GIB, 3)
                   for name in ("weights", "grads", "optimizer", "activations")}}


def size_text(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.1f} MiB"


@dataclass(frozen=True, slots=True)
class Layout:
    """What the estimate varies: the parallel sizes and what a layout search may change."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  #: the experts' tensor parallel (None: tp)
    micro_batch_size: int = 1
    recompute: str = "none"
    distributed_optimizer: bool = True
    grad_accum: int = 1  #: micro-batches per step per DP rank (PP keeps min(pp - s, this))
    vision_dp: bool = True

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @classmethod
    def of(cls, cfg) -> Layout:
        p, t = cfg.parallel, cfg.train
        return cls(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp,
                   micro_batch_size=t.micro_batch_size, recompute=cfg.model.recompute,
                   distributed_optimizer=t.distributed_optimizer,
                   grad_accum=t.grad_accum * cfg.data.virtual_dp, vision_dp=p.vision_dp)


@dataclass(frozen=True, slots=True)
class _Part:
    """Parameters of one table row, summed: where they live and how a layout cuts them."""

    layer: int | None  #: LM layer (None: not in an LM layer)
    place: str  #: "lm" (a layer), "vision" (a tower layer), "first" stage, "last" stage
    expert: bool
    sharded: bool  #: TP-sharded (experts: over expert-TP)
    trainable: bool
    deltanet: bool
    numel: float
    width_whole: float  #: activation widths per token not cut by TP
    width_split: float  #: activation widths per token cut by TP (expert-TP for experts)


@dataclass(frozen=True, slots=True)
class ModelTable:
    """A model's parameters summed by where they live and how a layout cuts them, plus the model
    facts the estimate needs. ``local``: the table of one rank's model (train.py; its shapes
    are that rank's shares, its layers that rank's stage)."""

    parts: tuple[_Part, ...]
    local: bool
    lm_layers: int  #: of the whole model (local: of this stage)
    hidden_size: int
    vocab_size: int
    topk: int  #: experts each token is routed to
    experts: int  #: experts of an MoE layer (0: none)
    deltanet_key_heads: int  #: Gated DeltaNet key heads (0 without)
    lm_honours_full: bool  #: the LM recomputes whole layers under ``recompute=full``
    vision_trains: bool
    vision_layers: int
    vision_hidden: int
    merge_size: int
    kv_width: int  #: the LM attention's key (= value) width: query groups x head width
    #: what TP must divide (head and group counts of every megatron config in the model, the
    #: partitioned dimension of every TP-sharded dense parameter) and what expert-TP must divide
    tp_divides: frozenset[int] = frozenset()
    etp_divides: frozenset[int] = frozenset()


def table_of(model, cfg, local: bool = False) -> ModelTable:
    """The table of ``model``: the whole model on the meta device (``meta_model``), or with
    ``local`` the model train.py built on this rank."""
    from megatron.core.utils import get_model_config, unwrap_model

    from models.families import family_of

    model = unwrap_model(model)  # train.py's DDP(Float16Module(model)): our names
    config = get_model_config(model)
    group = family_of(cfg.model).parameter_group
    named = dict(model.named_parameters())
    sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    lm_layers, vision_layers, vision_trains = set(), set(), False
    tp_divides, etp_divides = _head_counts(model), set()
    for name, param in named.items():
        layer, vision_layer = _LAYER.search(name), _VISION_LAYER.search(name)
        expert = ".experts." in name
        sharded = bool(getattr(param, "tensor_model_parallel", False)) or _sharded_factor(
            name, named)
        if layer:
            place = "lm"
            lm_layers.add(int(layer.group(1)))
        elif vision_layer:
            place = "vision"
            vision_layers.add(vision_layer.group(1))
        elif "language_model.decoder." in name or "language_model.output_layer." in name:
            place = "last"
        else:
            place = "first"
        if param.requires_grad and group(name) == "vision_model":
            vision_trains = True
        if getattr(param, "tensor_model_parallel", False):
            (etp_divides if expert else tp_divides).add(param.shape[param.partition_dim])
        whole, split = _widths(name, param)
        key = (int(layer.group(1)) if layer else None, place, expert, sharded,
               bool(param.requires_grad), bool(layer and _DELTANET.search(name)))
        row = sums[key]
        row[0] += param.numel()
        row[1] += whole
        row[2] += split
    geometry = family_of(cfg.model).vision_geometry(cfg.model)
    return ModelTable(
        parts=tuple(_Part(*key, numel, whole, split) for key, (numel, whole, split)
                    in sorted(sums.items(), key=lambda kv: str(kv[0]))),
        local=local, lm_layers=len(lm_layers) if local else (cfg.model.lm.num_layers or 1),
        hidden_size=config.hidden_size, vocab_size=cfg.model.lm.vocab_size,
        topk=getattr(config, "moe_router_topk", None) or 0,
        experts=getattr(config, "num_moe_experts", None) or 0,
        deltanet_key_heads=getattr(config, "linear_num_key_heads", None) or 0,
        lm_honours_full=getattr(config, "recompute_granularity", None) == "full",
        vision_trains=vision_trains, vision_layers=len(vision_layers),
        vision_hidden=cfg.model.vision.hidden_size, merge_size=geometry["merge_size"],
        kv_width=(config.num_query_groups or config.num_attention_heads) * config.kv_channels,
        tp_divides=frozenset(tp_divides), etp_divides=frozenset(etp_divides))


def _head_counts(model) -> set[int]:
    """The head and group counts of every megatron config in ``model`` (attention heads and
    query groups of the LM and the tower, Mamba heads and groups, Gated DeltaNet heads): TP
    splits each of them."""
    counts, seen = set(), set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or not hasattr(config, "num_attention_heads"):
            continue
        seen.add(id(config))
        for attr in ("num_attention_heads", "num_query_groups", "mamba_num_heads",
                     "mamba_num_groups", "linear_num_key_heads", "linear_num_value_heads"):
            value = getattr(config, attr, None)
            if isinstance(value, int) and value > 0:
                counts.add(value)
    return counts


def _sharded_factor(name: str, named: dict) -> bool:
    """A LoRA factor that TP shards (models/lora.py: B and DoRA's magnitude of a column-parallel
    base, A of a row one); at TP = 1 megatron marks only the base linear."""
    for suffix, dim in (("_lora.lora_b.weight", 0), ("_lora.magnitude", 0),
                        ("_lora.lora_a.weight", 1)):
        if name.endswith(suffix):
            base = named.get(name[: -len(suffix)] + ".weight")
            return (base is not None and getattr(base, "tensor_model_parallel", False)
                    and getattr(base, "partition_dim", 0) == dim)
    return False


def _widths(name: str, param) -> tuple[float, float]:
    """Activation elements per token the parameter's op keeps, as (not cut by TP, cut by TP):
    a linear's input + output width, a norm's width; 0 for anything else (biases, adapters)."""
    if "_lora." in name:
        return 0.0, 0.0
    sharded = getattr(param, "tensor_model_parallel", False)
    if _DELTANET.search(name) and ".conv_" in name:  # (channels, w): the conv's input and output
        width = 2.0 * param.shape[0]
        return (0.0, width) if sharded else (width, 0.0)
    if param.dim() == 2 and not name.endswith("embeddings.weight"):
        out, inp = param.shape
        if sharded and getattr(param, "partition_dim", 0) == 0:
            return float(inp), float(out)
        if sharded:
            return float(out), float(inp)
        return float(out + inp), 0.0
    if param.dim() == 1 and name.endswith(("norm.weight", "layer_norm_weight")):
        return (0.0, float(param.numel())) if sharded else (float(param.numel()), 0.0)
    return 0.0, 0.0


def estimate_layout(table: ModelTable, cfg, gpus: int, layout: Layout, bf16: bool,
                    stage: int | None = None) -> list[Estimate]:
    """Every pipeline stage's estimate (``stage``: only that one) of the model of ``table`` at
    ``layout`` on ``gpus`` GPUs; a ``local`` table gives its own stage (``stage``)."""
    from models.layers.gated_deltanet import shares_heads

    lay, te = layout, cfg.task_encoder
    dtype = 2 if bf16 else 4
    sequence_parallel = bool(table.experts) and lay.tp > 1
    # a Gated DeltaNet under CP shares its heads, or (too few per TP rank) gathers the sequence;
    # the config's count is the whole model's in a local table too
    heads = table.deltanet_key_heads // lay.tp
    deltanet_gathers = lay.cp > 1 and not shares_heads(heads, lay.cp)
    stages = [stage] if stage is not None or table.local else range(lay.pp)
    return [_stage(table, te, gpus, lay, bf16, dtype, sequence_parallel, deltanet_gathers,
                   s or 0) for s in stages]


def _stage(table: ModelTable, te, gpus: int, lay: Layout, bf16: bool, dtype: int,
           sequence_parallel: bool, deltanet_gathers: bool, s: int) -> Estimate:
    local = table.local
    # an expert's linears see top-k / (experts present here) of the tokens (balanced routing)
    routed = table.topk / (table.experts / (lay.ep if local else 1)) if table.experts else 1.0
    weights = trainable = trainable_experts = lm_width = vision_width = 0.0
    layers_here: set[int] = set()
    for part in table.parts:
        if not (local or _on_stage(part, s, lay.pp, table.lm_layers)):
            continue
        if local:
            divisor = 1
        elif part.expert:
            divisor = lay.ep * (lay.expert_tp if part.sharded else 1)
        else:
            divisor = lay.tp if part.sharded else 1
        n = part.numel / divisor
        weights += n
        if part.trainable:
            if part.expert:
                trainable_experts += n
            else:
                trainable += n
        # under sequence parallelism (megatron's, forced with MoE under TP) an LM layer keeps a
        # sequence share of the tokens at full width; else every token at the TP-sharded widths
        # (``local`` shapes are sharded already)
        if part.expert or not (part.place == "lm" and sequence_parallel):
            shard = 1 if local else lay.expert_tp if part.expert else lay.tp
        else:
            shard = 1 / lay.tp if local else 1
        width = part.width_whole + part.width_split / shard
        if part.deltanet and deltanet_gathers:  # the whole sequence
            width *= lay.cp
        if part.place == "lm":
            layers_here.add(part.layer)
            lm_width += width * (routed if part.expert else 1.0)
        elif part.place == "vision":
            vision_width += width
    dp_cp = gpus // (lay.tp * lay.pp)
    expert_dp = gpus // (lay.pp * lay.ep * lay.expert_tp)
    shard_state = lay.distributed_optimizer
    optimizer = (12 if bf16 else 8) * (trainable / (dp_cp if shard_state else 1)
                                       + trainable_experts / (expert_dp if shard_state else 1))
    grads = 4 * (trainable + trainable_experts)
    # activations of one micro-batch on this rank
    tokens = lay.micro_batch_size * te.seq_length / lay.cp
    if lay.recompute == "full" and table.lm_honours_full and layers_here:
        lm_width = table.hidden_size * len(layers_here) + lm_width / len(layers_here)
    acts = tokens / (lay.tp if sequence_parallel else 1) * lm_width * dtype
    if s == lay.pp - 1:  # the logits of every token, V / tp wide, and fp32's
        acts += tokens * table.vocab_size / lay.tp * (dtype + 4)
    if s == 0 and table.vision_trains:
        patches = lay.micro_batch_size * te.max_visual_tokens * table.merge_size ** 2
        patches /= lay.cp if lay.vision_dp else 1
        if lay.recompute == "full" and table.vision_layers:
            vision_width = (vision_width / table.vision_layers
                            + table.vision_layers * table.vision_hidden)
        acts += patches * vision_width * dtype
    in_flight = min(lay.pp - s, lay.grad_accum)
    return Estimate(stage=s, weights=weights * dtype, grads=grads, optimizer=optimizer,
                    activations=acts * in_flight)


def _on_stage(part: _Part, stage: int, pp: int, layers: int) -> bool:
    """The part lives on ``stage`` (LM layers evenly over the stages; vision and embeddings on
    the first, the final norm and output layer on the last)."""
    if pp == 1:
        return True
    if part.place == "lm":
        return part.layer * pp // layers == stage
    return stage == (pp - 1 if part.place == "last" else 0)


def estimate(model, cfg, gpus: int, bf16: bool) -> Estimate:
    """The estimate of this rank (train.py): from the model it built, whose parameters are
    already this rank's shares, on its pipeline stage."""
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank()
    return estimate_layout(table_of(model, cfg, local=True), cfg, gpus, Layout.of(cfg), bf16,
                           stage=stage)[0]


def run_table(cfg) -> ModelTable:
    """The table of ``cfg``'s whole model (built once on the meta device, at TP = PP = EP = 1,
    with ``recompute=full`` to learn whether its LM honours it; LoRA and freezing as train.py
    sets them).

    Raises:
        UsageError: bad LoRA settings.
    """
    from models.families import meta_model
    from models.parallel import init_parallel
    from recipes.model_setup import freeze

    init_parallel()
    model = meta_model(replace(cfg.model, recompute="full"))
    freeze(model, cfg)
    return table_of(model, cfg)


def estimate_run(cfg, gpus: int) -> list[Estimate]:
    """Every pipeline stage's estimate of ``cfg`` on ``gpus`` GPUs (see the module docstring).

    Raises:
        UsageError: a layout that cannot be built on ``gpus`` GPUs, or bad LoRA settings.
    """
    from recipes.layout import check_layout

    p = cfg.parallel
    check_layout(gpus, p.tp, p.pp, p.cp, cfg.task_encoder.fixed_length, p.ep, p.etp)
    return estimate_layout(run_table(cfg), cfg, gpus, Layout.of(cfg), uses_bf16(cfg.train, True))


def uses_bf16(t, gpu: bool) -> bool:
    """``train.precision``: bf16, or auto on a GPU (``gpu``: the estimate is for one)."""
    return t.precision == "bf16" or (t.precision == "auto" and gpu)


def fits(estimates: list[Estimate], gpu_gib: float) -> bool:
    """The largest stage leaves ``RESERVE_GIB`` of a ``gpu_gib`` GiB GPU free."""
    return max(e.total for e in estimates) / GIB + RESERVE_GIB <= gpu_gib


def summary(estimates: list[Estimate], gpu_gib: float = 80.0) -> str:
    """The largest stage's total and whether it fits a ``gpu_gib`` GiB GPU."""
    worst = max(estimates, key=lambda e: e.total)
    verdict = "fits" if fits(estimates, gpu_gib) else "does NOT fit"
    return (f"per GPU at most {size_text(worst.total)} (stage {worst.stage}): {verdict} a "
            f"{gpu_gib:g} GiB GPU with {RESERVE_GIB:g} GiB kept for the CUDA context, "
            "communication buffers and allocator slack (not counted)")
