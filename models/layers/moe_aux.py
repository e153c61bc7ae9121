"""What a training step measures of its MoE routers, and the router settings every MoE family
shares: the load-balancing aux loss (its gradient's scale and its logged value), each MoE layer's
expert load and, with a capacity factor, the tokens dropped.

megatron's MoE router attaches the aux loss to its output (``MoEAuxLossAutoScaler``): its
gradient joins the main loss's in backward, scaled by one number that megatron's pipeline schedule
sets per micro-batch (CP size / micro-batches: DDP averages over DP x CP, each CP rank holds a
share of the tokens). ``set_backward_scale`` sets the same for the loop without pipeline
parallelism. The router also records each layer's aux loss (divided by its weight) in megatron's
layer-wise tracker; ``step_metrics`` reads that once per step: ``moe_aux_loss``, the term the
step's micro-batches added to the loss on average over them and the data-parallel ranks (the
weight of each layer's term is the model's ``moe_aux_loss_coeff``), and clears it.

Router health (``track_router_load`` hooks every router of the model once): each training forward
adds its token-to-expert assignments (after capacity dropping) per expert to its layer's tally,
on the device, with no host sync. ``step_metrics`` sums the tallies over the step's micro-batches,
the pipeline stages' layers and the ranks that hold other tokens (data and context parallel, and
tensor parallel under sequence parallelism), and logs ``moe_load_max_over_mean`` (the most
loaded expert's tokens over the mean per expert, of the worst MoE layer: 1.0 is perfect balance,
E / top-k the worst possible), ``moe_load_per_layer`` (that ratio per MoE layer, by its 0-based
layer index) and, with ``model.moe_capacity_factor`` set, ``moe_tokens_dropped`` (the token-expert
assignments past an expert's capacity, every layer) and ``moe_dropped_fraction`` (of all
assignments). A forward re-run inside backward (activation recomputation) is not counted twice.

``begin_step`` clears both the aux-loss tracker and the tallies before a step's first forward,
so that forwards outside the step (validation, a probe, another model in the same process) never
count in its values. Models without MoE layers log nothing.

``transformer_config`` builds megatron's config with top-1 softmax routing allowed (megatron
refuses it; the Qwen MoE models with ``num_experts_per_tok: 1`` route that way). ``capacity_kwargs``
turns ``model.moe_capacity_factor`` (None: no capacity, nothing is dropped,
as transformers computes the model) into megatron's fields: per expert, the assignments past
``ceil(tokens * top-k / experts * factor)`` with the lowest router probabilities are dropped (the
token keeps its other experts and the residual), in training and evaluation forwards alike.
"""

from __future__ import annotations

import torch

TRACKED = "load_balancing_loss"  #: megatron's tracker name of the Switch aux loss

#: global layer number (1-based) -> [assignments per expert (device tensor), tokens routed]
_TALLY: dict[int, list] = {}


def _config(model):
    from megatron.core.utils import get_model_config

    return get_model_config(model)


def capacity_kwargs(factor: float | None) -> dict:
    """megatron's TransformerConfig fields of a capacity factor (see module docstring)."""
    if factor is None:
        return {}
    return dict(moe_expert_capacity_factor=float(factor), moe_token_drop_policy="probs",
                moe_pad_expert_input_to_capacity=False)


def transformer_config(**fields):
    """megatron's ``TransformerConfig(**fields)``, top-1 softmax routing included.

    The Qwen MoE models route as transformers computes them: softmax over the top-k logits
    (``moe_router_pre_softmax=False``; transformers' softmax over all experts renormalised over
    the top k is the same), so at top-1 the one expert's weight is 1 and the main loss gives the
    router no gradient (it learns from the aux loss, in transformers too). megatron-core's config
    check refuses that combination ("Please use --moe-router-pre-softmax when topk is 1"), whose
    pre-softmax alternative would weight each token's expert by its probability instead, unlike
    the model. The config is therefore checked with pre-softmax on and set back to the model's
    routing after (the router reads the field at each forward)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    top1 = (fields.get("moe_router_topk") == 1 and not fields.get("moe_router_pre_softmax")
            and fields.get("moe_router_score_function", "softmax") == "softmax")
    config = TransformerConfig(**(fields | {"moe_router_pre_softmax": True} if top1 else fields))
    if top1:
        config.moe_router_pre_softmax = False
    return config


def check_capacity(factor: float | None, experts: int) -> None:
    """Raises ValueError: ``model.moe_capacity_factor`` set on a model without experts, or not
    positive."""
    if factor is None:
        return
    if not experts:
        raise ValueError(f"moe_capacity_factor {factor} needs MoE layers (this model has no "
                         "experts)")
    if not factor > 0:
        raise ValueError(f"moe_capacity_factor must be positive (or null: no capacity), got "
                         f"{factor}")


def begin_step() -> None:
    """Empties megatron's aux-loss tracker and the router tallies: what the next
    ``step_metrics`` reads is this step's."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.clear_aux_losses_tracker()
    _TALLY.clear()


def _tracked() -> dict:
    """megatron's aux-loss tracker itself: name -> entry (its per-layer ``values``). megatron-core
    >= 0.18 keeps it in ``moe_logging``'s metrics tracker (``get_moe_layer_wise_logging_tracker``
    then returns a copy); before, that function returns the tracker."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe import moe_utils

        return moe_utils.get_moe_layer_wise_logging_tracker()
    return get_moe_metrics_tracker().metrics


def forget() -> None:
    """Drops megatron's aux-loss tracker entries (sized by the layer count of the model that
    first logged into them: another model of other depth would index past them) and the router
    tallies; called when a model is built (``models.families.build_model``)."""
    _tracked().clear()
    _TALLY.clear()


def _in_backward() -> bool:
    """True inside an autograd backward pass (a recomputed forward)."""
    return torch._C._current_graph_task_id() != -1


def _tally(router, args, output) -> None:
    if not (router.training and torch.is_grad_enabled()) or _in_backward():
        return
    if router.layer_number is None:  # an MTP head's router: not a decoder layer of the table
        return
    routing_map = output[1]  # (tokens, experts) bool: the assignments kept
    counts = routing_map.sum(0, dtype=torch.int64).detach()
    entry = _TALLY.get(router.layer_number)
    if entry is None:
        _TALLY[router.layer_number] = [counts, routing_map.shape[0]]
    else:
        entry[0] += counts
        entry[1] += routing_map.shape[0]


def track_router_load(model) -> int:
    """Hooks every megatron router of ``model`` (once) so that its training forwards are counted
    in ``step_metrics``. Returns how many routers are tracked."""
    from megatron.core.transformer.moe.router import Router

    routers = [m for m in model.modules() if isinstance(m, Router)]
    for router in routers:
        if not getattr(router, "_load_tracked", False):
            router.register_forward_hook(_tally)
            router._load_tracked = True
    return len(routers)


def set_backward_scale(model, micro_batches: int, cp: int) -> None:
    """The aux-loss gradient scale of the next micro-batches' backward (megatron's schedule sets
    it itself under PP)."""
    config = _config(model)
    if getattr(config, "num_moe_experts", None) and config.moe_aux_loss_coeff:
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(cp / micro_batches))


def _sum_over_token_shares(values: torch.Tensor, config, pipeline: bool) -> None:
    """All-reduce (sum, in place) over the ranks that hold other tokens of the step (data and
    context parallel; tensor parallel under sequence parallelism, replicated without it) and,
    with ``pipeline``, the pipeline stages (other layers)."""
    if not torch.distributed.is_initialized():
        return
    from megatron.core import parallel_state as ps

    groups = [ps.get_pipeline_model_parallel_group()] if pipeline else []
    if config.sequence_parallel:
        groups.append(ps.get_tensor_model_parallel_group())
    groups.append(ps.get_data_parallel_group(with_context_parallel=True))
    for group in groups:
        if group.size() > 1:
            torch.distributed.all_reduce(values, group=group)


def step_metrics(model, micro_batches: int) -> dict[str, float]:
    """The step's router metrics (see module docstring): ``moe_aux_loss`` where the aux loss is
    on, the expert load and (with a capacity) the drops where the model has MoE layers; {}
    without. A collective over every rank; the tracker and the tallies are cleared."""
    config = _config(model)
    if not getattr(config, "num_moe_experts", None):
        return {}
    out = {}
    if config.moe_aux_loss_coeff:
        out.update(_aux_loss(config, micro_batches))
    out.update(_load(config))
    return out


def _aux_loss(config, micro_batches: int) -> dict[str, float]:
    """``moe_aux_loss``: the tracker summed over the pipeline stages' layers and the token shares,
    averaged over the data-parallel ranks (gloo has no AVG: megatron's own reduction is not
    used), then cleared."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils

    entry = _tracked().get(TRACKED)
    if entry is None:
        return {}
    values = entry["values"] if isinstance(entry, dict) else entry.values
    total = values.sum().reshape(1).double()
    _sum_over_token_shares(total, config, pipeline=True)
    if torch.distributed.is_initialized():
        total /= ps.get_data_parallel_world_size()
    term = float(total) * config.moe_aux_loss_coeff / max(micro_batches, 1)
    moe_utils.clear_aux_losses_tracker()
    return {"moe_aux_loss": term}


def _load(config) -> dict:
    """The expert load (and drops) of the step's tallies, every layer's on every rank."""
    experts = config.num_moe_experts
    layers = config.num_layers  # the same on every rank (the collective's shape)
    assert all(1 <= number <= layers for number in _TALLY), (sorted(_TALLY), layers)
    table = torch.zeros(layers, experts + 1, dtype=torch.float64)  # assignments..., tokens
    for number, (counts, tokens) in _TALLY.items():
        table[number - 1, :experts] = counts.double().cpu()
        table[number - 1, experts] = tokens
    _TALLY.clear()
    _sum_over_token_shares(table, config, pipeline=True)
    routed = table[:, experts] > 0
    if not routed.any():
        return {}
    counts, tokens = table[routed, :experts], table[routed, experts]
    ratio = counts.max(1).values / (counts.sum(1) / experts).clamp(min=1e-12)
    layer_ids = routed.nonzero().flatten().tolist()
    out = {"moe_load_max_over_mean": float(ratio.max()),
           "moe_load_per_layer": {str(i): round(float(r), 6) for i, r in zip(layer_ids, ratio)}}
    if config.moe_expert_capacity_factor is not None:
        assigned = tokens * config.moe_router_topk
        dropped = float((assigned - counts.sum(1)).sum())
        out.update(moe_tokens_dropped=int(round(dropped)),
                   moe_dropped_fraction=dropped / float(assigned.sum()))
    return out
