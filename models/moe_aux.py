"""The MoE load-balancing aux loss of a training step: its gradient's scale and its logged value.

megatron's MoE router attaches the aux loss to its output (``MoEAuxLossAutoScaler``): its
gradient joins the main loss's in backward, scaled by one number that megatron's pipeline schedule
sets per micro-batch (CP size / micro-batches: DDP averages over DP x CP, each CP rank holds a
share of the tokens). ``set_backward_scale`` sets the same for the loop without pipeline
parallelism. The router also records each layer's aux loss (divided by its weight) in megatron's
layer-wise tracker; ``step_metrics`` reads that once per step: ``moe_aux_loss``, the term the
step's micro-batches added to the loss on average over them and the data-parallel ranks (the
weight of each layer's term is the model's ``moe_aux_loss_coeff``), and clears it; ``begin_step``
clears it before a step's first forward too, so that forwards outside the step (validation, a
probe, another model in the same process) never count in its value. Models without
MoE layers (or with the aux loss off) log nothing.
"""

from __future__ import annotations

import torch

TRACKED = "load_balancing_loss"  #: megatron's tracker name of the Switch aux loss


def _config(model):
    from megatron.core.utils import get_model_config

    return get_model_config(model)


def begin_step() -> None:
    """Empties megatron's aux-loss tracker: what the next ``step_metrics`` reads is this step's."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.clear_aux_losses_tracker()


def set_backward_scale(model, micro_batches: int, cp: int) -> None:
    """The aux-loss gradient scale of the next micro-batches' backward (megatron's schedule sets
    it itself under PP)."""
    config = _config(model)
    if getattr(config, "num_moe_experts", None) and config.moe_aux_loss_coeff:
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(cp / micro_batches))


def step_metrics(model, micro_batches: int) -> dict[str, float]:
    """``{"moe_aux_loss": ...}`` of the step just run (see module docstring); {} without MoE
    aux loss. The tracker is summed over the pipeline stages' layers and the context-parallel
    (and, under sequence parallelism, tensor-parallel) shares and averaged over the data-parallel
    ranks (gloo has no AVG: megatron's own reduction
    is not used), then cleared."""
    config = _config(model)
    if not (getattr(config, "num_moe_experts", None) and config.moe_aux_loss_coeff):
        return {}
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if TRACKED not in tracker:
        return {}
    total = tracker[TRACKED]["values"].sum().reshape(1).double()
    if torch.distributed.is_initialized():
        # each CP rank's term covers its share of the tokens, as each TP rank's does under
        # sequence parallelism (replicated over TP without it)
        shares = [ps.get_tensor_model_parallel_group()] if config.sequence_parallel else []
        for group in (ps.get_pipeline_model_parallel_group(), *shares,
                      ps.get_data_parallel_group(with_context_parallel=True)):
            if group.size() > 1:
                torch.distributed.all_reduce(total, group=group)
        total /= ps.get_data_parallel_world_size()
    term = float(total) * config.moe_aux_loss_coeff / max(micro_batches, 1)
    moe_utils.clear_aux_losses_tracker()
    return {"moe_aux_loss": term}
