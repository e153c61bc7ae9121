"""The layout planner: every layout of a run's model on N GPUs that fits their memory by the
estimate, fastest first by a simple, documented step-time model.

    python -m recipes.memory CONFIG --gpus N --gpu-memory 80 --suggest [--json]

``suggest_layouts`` builds the model's table once (``recipes.memory.run_table``: the meta
model, seconds even at 235B), then walks every buildable layout: TP (within a node), PP (a
divisor of the LM layers), CP, EP (a divisor of the experts) and expert-TP (1 or TP),
micro-batch 1 / 2 / 4, recompute none / full, the distributed optimizer on or off, and, where
megatron-core offers it (TransformerEngine's FusedAdam), Adam's moments in bf16. The global
batch stays the run's (``train.global_batch_size``, else micro-batch x grad_accum x DP of the
config), so every layout trains the same rows per step; a layout it does not divide is
skipped. A layout fits when its largest pipeline stage leaves ``RESERVE_GIB`` free
(recipes/memory.py). train.py refuses a layout that does not fit and names this planner's best.

The step-time model (docs/training.md, "Layout planner"), per step and GPU:

- compute: the step's training FLOPs (``models.flops`` formulas: one sample of
  ``seq_length`` tokens per row, ``max_visual_tokens`` in one square image; a recomputed
  forward adds a third) over the GPUs at ``EFFICIENCY`` of the peak (bf16 dense, H100: 989
  TFLOP/s), and the 1F1B pipeline bubble, (pp - 1) / micro-batches of it;
- communication, bandwidth only and not overlapped (train.py overlaps no gradient reduction):
  TP's four all-reduces per layer per micro-batch (LM and tower), CP's key / value all-gather
  and its gradient, EP's dispatch and combine all-to-all forward and backward, PP's activations
  between stages, and the gradient reduction over DP (reduce-scatter of the fp32 gradients and
  all-gather of the bf16 weights with the distributed optimizer, an all-reduce without), of
  the dense parameters over DP x CP and the experts' over expert-DP; a group within a node at
  ``NVLINK_GBS``, across nodes at ``NETWORK_GBS`` per GPU (megatron's rank order
  tp-cp-ep-dp-pp).

``MARGIN`` says how far to trust it: it ranks layouts; it does not budget time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from recipes.estimate import GIB, Estimate, Layout, ModelTable, estimate_layout, fits, run_table

PEAK_TFLOPS = 989.0  #: H100 SXM dense bf16 (what MFU divides by)
EFFICIENCY = 0.40  #: the share of the peak the model's matmuls reach (LMMs-Engine: 30-40 %)
NVLINK_GBS = 450.0  #: GB/s a GPU sends within a node (H100 NVLink 4: 900 GB/s both ways)
NETWORK_GBS = 50.0  #: GB/s a GPU sends across nodes (one 400 Gb/s NIC per GPU)
MARGIN = ("compute at 40 % of the peak on every layout, communication by bandwidth alone and "
          "not overlapped: compute +-30 %, communication +-2x; it ranks layouts, it does not "
          "budget time")
_TP = (1, 2, 4, 8)
_CP = (1, 2, 4, 8)
_MICRO_BATCH = (1, 2, 4)


@dataclass(frozen=True, slots=True)
class Suggestion:
    """A layout that fits, with its estimate and modelled step time."""

    layout: Layout
    overrides: tuple[str, ...]  #: the run-config ``key=value`` that select it
    estimates: tuple[Estimate, ...]
    seconds: float  #: modelled step time
    compute: float  #: of which compute (bubble included)
    communication: float  #: of which communication
    needs: str = ""  #: what the layout needs beyond the project's install ("" for nothing)

    @property
    def gib(self) -> float:
        return max(e.total for e in self.estimates) / GIB

    def line(self) -> str:
        extra = f"; needs {self.needs}" if self.needs else ""
        return (f"{self.gib:.1f} GiB/GPU, {self.seconds:.2f} s/step (compute {self.compute:.2f}"
                f" + communication {self.communication:.2f}){extra}: "
                f"{' '.join(self.overrides)}")

    def as_dict(self) -> dict:
        return {"overrides": list(self.overrides), "gib_per_gpu": round(self.gib, 3),
                "step_seconds": round(self.seconds, 4), "compute_seconds": round(self.compute, 4),
                "communication_seconds": round(self.communication, 4), "needs": self.needs,
                "stages": [e.as_dict() for e in self.estimates]}


def te_adam_available() -> bool:
    """TransformerEngine's FusedAdam, which megatron-core's bf16 optimizer state needs."""
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
    except ImportError:
        return False
    return True


def suggest_layouts(cfg, gpus: int, gpu_gib: float, *, gpus_per_node: int = 8,
                    table: ModelTable | None = None,
                    bf16_state: bool | None = None) -> list[Suggestion]:
    """Every layout of ``cfg``'s model on ``gpus`` GPUs that fits ``gpu_gib`` GiB, fastest
    first (ties: the smaller one first). ``bf16_state``: also Adam's moments in bf16 (default:
    where TransformerEngine's FusedAdam imports)."""
    from recipes.estimate import uses_bf16

    table = table or run_table(cfg)
    bf16 = uses_bf16(cfg.train, True)
    if bf16_state is None:
        bf16_state = te_adam_available()
    rows = global_rows(cfg, gpus)
    found = []
    for layout in candidates(table, cfg, gpus, rows):
        for state in (("fp32", "bf16") if bf16_state and bf16 and layout.distributed_optimizer
                      else ("fp32",)):
            estimates = estimate_layout(table, cfg, gpus, layout, bf16)
            if state == "bf16":  # Adam's two moments in bf16: 4 of the 12 bytes saved
                estimates = [replace(e, optimizer=e.optimizer * 8 / 12) for e in estimates]
            if not fits(estimates, gpu_gib):
                continue
            compute, communication = step_seconds(table, cfg, gpus, layout, gpus_per_node)
            found.append(Suggestion(
                layout=layout, overrides=overrides_of(layout, cfg, state),
                estimates=tuple(estimates), seconds=compute + communication, compute=compute,
                communication=communication,
                needs="TransformerEngine >= 2.1 (FusedAdam)" if state == "bf16" else ""))
    return sorted(found, key=lambda s: (round(s.seconds, 6), s.gib))


def global_rows(cfg, gpus: int) -> int:
    """Rows (packed or not) per optimizer step over all DP ranks: ``train.global_batch_size``,
    else the config's micro-batch x grad_accum x DP on ``gpus`` GPUs."""
    t, p = cfg.train, cfg.parallel
    if t.global_batch_size:
        return t.global_batch_size
    return t.micro_batch_size * t.grad_accum * max(1, gpus // (p.tp * p.pp * p.cp))


def candidates(table: ModelTable, cfg, gpus: int, rows: int):
    """Every layout the model can be built at on ``gpus`` GPUs with ``rows`` rows per step."""
    from recipes.run_config import ParallelConfig

    te = cfg.task_encoder
    family = _family(cfg)
    moe = table.experts > 0
    for tp in _TP:
        if gpus % tp or any(n % tp for n in table.tp_divides):
            continue
        for pp in _divisors(table.lm_layers, gpus // tp):
            for cp in _CP:
                if gpus % (tp * pp * cp) or (cp > 1 and (pp > 1 or te.packing)):
                    continue
                sequence_parallel = moe and tp > 1
                if te.seq_length % (2 * cp * (tp if sequence_parallel else 1)):
                    continue
                dp = gpus // (tp * pp * cp)
                for ep, etp in _expert_splits(table, gpus, tp, pp):
                    parallel = ParallelConfig(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp,
                                              vision_dp=cfg.parallel.vision_dp)
                    if family.layout_problems(cfg.model, parallel):
                        continue
                    for micro in _MICRO_BATCH:
                        if rows % (micro * dp):
                            continue
                        for recompute in ("none", "full"):
                            for sharded in (True, False):
                                yield Layout(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp,
                                             micro_batch_size=micro, recompute=recompute,
                                             distributed_optimizer=sharded,
                                             grad_accum=rows // (micro * dp),
                                             vision_dp=cfg.parallel.vision_dp)


def _family(cfg):
    from models.families import family_of

    return family_of(cfg.model)


def _divisors(n: int, at_most: int) -> list[int]:
    return [d for d in range(1, min(n, at_most) + 1) if n % d == 0 and d <= 16]


def _expert_splits(table: ModelTable, gpus: int, tp: int, pp: int):
    """(ep, etp) pairs: ep 1 (etp = tp, megatron's default) and every ep dividing the experts,
    with etp 1 or tp (other than tp needs ep > 1)."""
    yield 1, None
    if not table.experts:
        return
    for ep in range(2, table.experts + 1):
        if table.experts % ep:
            continue
        for etp in sorted({1, tp}):
            if gpus % (etp * pp * ep) or any(n % etp for n in table.etp_divides):
                continue
            yield ep, (None if etp == tp else etp)


def overrides_of(layout: Layout, cfg, state: str = "fp32") -> tuple[str, ...]:
    """The run-config ``key=value`` list that selects ``layout`` (and the optimizer state)."""
    items = [f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}", f"parallel.cp={layout.cp}",
             f"parallel.ep={layout.ep}"]
    if layout.etp is not None:
        items.append(f"parallel.etp={layout.etp}")
    items.append(f"train.micro_batch_size={layout.micro_batch_size}")
    if not cfg.train.global_batch_size:
        items.append(f"train.grad_accum={layout.grad_accum}")
    items += [f"model.recompute={layout.recompute}",
              f"train.distributed_optimizer={str(layout.distributed_optimizer).lower()}"]
    if state != "fp32":
        items.append(f"train.optimizer_state={state}")
    if layout.pp > 1 and not cfg.task_encoder.fixed_length:
        items.append("task_encoder.fixed_length=true")
    return tuple(items)


def step_seconds(table: ModelTable, cfg, gpus: int, layout: Layout,
                 gpus_per_node: int) -> tuple[float, float]:
    """(compute, communication) seconds of one step per GPU (the module docstring's model)."""
    lay, te = layout, cfg.task_encoder
    family = _family(cfg)
    dp = gpus // (lay.tp * lay.pp * lay.cp)
    micro = lay.grad_accum  # micro-batches per step on every DP rank
    rows = lay.micro_batch_size * micro * dp
    lm = (family.lm_flops(cfg.model.lm, float(te.seq_length), [te.seq_length])
          + family.head_flops(cfg.model, float(te.seq_length), [te.seq_length]))
    side = max(1, round(math.sqrt(te.max_visual_tokens))) * table.merge_size
    vision = family.vision_flops(cfg.model, [[[1, side, side]], []]) if table.vision_trains else 0
    recomputed = 4 / 3 if lay.recompute == "full" else 1.0
    forward = lm * (recomputed if table.lm_honours_full else 1.0) + vision * recomputed
    flops = 3.0 * forward * rows
    compute = flops / gpus / (PEAK_TFLOPS * 1e12 * EFFICIENCY)
    compute *= 1 + (lay.pp - 1) / micro  # the 1F1B bubble
    tokens = lay.micro_batch_size * te.seq_length / lay.cp  # of one micro-batch on one GPU
    layers = table.lm_layers / lay.pp
    hidden = table.hidden_size
    seconds = 0.0
    if lay.tp > 1:
        bw = _bandwidth(1, lay.tp, gpus_per_node)
        ring = 2 * (lay.tp - 1) / lay.tp
        lm_bytes = 4 * layers * tokens * hidden * 2
        patches = lay.micro_batch_size * te.max_visual_tokens * table.merge_size ** 2
        vision_bytes = 4 * table.vision_layers * patches * table.vision_hidden * 2
        seconds += micro * ring * (lm_bytes + vision_bytes) / bw
    if lay.cp > 1:
        bw = _bandwidth(lay.tp, lay.cp, gpus_per_node)
        gathered = (lay.cp - 1) / lay.cp * te.seq_length * lay.micro_batch_size
        seconds += micro * 3 * layers * gathered * 2 * table.kv_width * 2 / bw
    if lay.ep > 1:
        bw = _bandwidth(lay.expert_tp, lay.ep, gpus_per_node)
        a2a = (lay.ep - 1) / lay.ep * tokens * table.topk * hidden * 2
        seconds += micro * 4 * layers * a2a / bw
    if lay.pp > 1:
        bw = _bandwidth(lay.tp * lay.cp * dp, lay.pp, gpus_per_node)
        seconds += micro * 2 * tokens * hidden * 2 / bw
    dense, experts = _trainable_here(table, lay)
    per_param = (4 + 2) if lay.distributed_optimizer else 2 * 4  # RS fp32 + AG bf16 / all-reduce
    if dp * lay.cp > 1:
        group = dp * lay.cp
        seconds += (group - 1) / group * per_param * dense / _bandwidth(lay.tp, group,
                                                                       gpus_per_node)
    expert_dp = gpus // (lay.pp * lay.ep * lay.expert_tp)
    if experts and expert_dp > 1:
        seconds += ((expert_dp - 1) / expert_dp * per_param * experts
                    / _bandwidth(lay.expert_tp * lay.ep, expert_dp, gpus_per_node))
    return compute, seconds


def _bandwidth(stride: int, size: int, gpus_per_node: int) -> float:
    """Bytes/s a GPU sends in a group of ``size`` ranks ``stride`` apart: NVLink when the group
    stays within a node, else the network."""
    return (NVLINK_GBS if stride * size <= gpus_per_node else NETWORK_GBS) * 1e9


def _trainable_here(table: ModelTable, lay: Layout) -> tuple[float, float]:
    """Trainable dense and expert parameters of one GPU of the first (largest) stage."""
    dense = experts = 0.0
    for part in table.parts:
        if not part.trainable:
            continue
        if part.place == "lm" and part.layer * lay.pp // table.lm_layers != 0:
            continue
        if part.place == "last" and lay.pp > 1:
            continue
        if part.expert:
            experts += part.numel / (lay.ep * (lay.expert_tp if part.sharded else 1))
        else:
            dense += part.numel / (lay.tp if part.sharded else 1)
    return dense, experts
