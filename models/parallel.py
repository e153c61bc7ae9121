"""Process setup of every process that runs a model: torch.distributed, megatron's parallel
state and its seeded RNG tracker (train.py through ``recipes.layout``, eval.py,
``models.convert``, tests, bench/).

This module owns ``init_process_group`` (gloo on CPU / nccl on GPU; under plain python a
one-process group; first, without CUDA, the CPU accommodations ``models.cpu.activate``, and on
any device megatron-core 0.16.1's unbound ``te_general_gemm`` without TE),
``seed_model_parallel``, ``init_parallel``, the one call that sets up TP x PP x CP x EP (x
expert-TP): an existing parallel state of the same sizes is kept, one of other sizes is
replaced, and the RNG is seeded every time; ``moe_parallel_kwargs``, the parallel fields of
every family's MoE ``TransformerConfig`` (read from that parallel state); and
``expert_grads_counted_once``, megatron's expert optimizer told the expert-TP group.
"""

from __future__ import annotations

import os

import torch

from models import cpu


def init_process_group() -> None:
    """torch.distributed for this process: from torchrun's environment, or, under plain python,
    a one-process group on an in-memory store (no TCP port to collide with other runs). First,
    on a machine without CUDA, the CPU accommodations (``models.cpu.activate``)."""
    import torch.distributed as dist

    cpu.activate()
    _bind_missing_te_gemm()
    if dist.is_initialized():
        return
    backend = cpu.distributed_backend()
    if "RANK" in os.environ and "MASTER_PORT" in os.environ:  # torchrun / SLURM launchers
        dist.init_process_group(backend)
    else:
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _bind_missing_te_gemm() -> None:
    """megatron-core 0.16.1 without TransformerEngine, on any device: ``moe_utils`` leaves
    ``te_general_gemm`` unbound when its TE import fails, and every MoE router forward then
    stops with a NameError (seen on an H200 without TE). None is megatron's own "no TE" value
    (the router's plain torch GEMM)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def seed_model_parallel(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker (after parallel_state is set up)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_parallel(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, seed: int = 1234,
                  etp: int | None = None) -> None:
    """torch.distributed (``init_process_group``), megatron's parallel state at tensor /
    pipeline / context / expert parallel sizes ``tp`` x ``pp`` x ``cp`` x ``ep`` (data parallel:
    the rest of the world) with the experts' linears over ``etp`` ranks (expert tensor parallel;
    None: ``tp``, megatron's default), then the seeded RNG tracker (``seed_model_parallel``).

    A parallel state already set up at these five sizes is kept (its process groups stay); one
    at other sizes is destroyed and built again. The RNG is seeded on every call.
    """
    init_process_group()
    from megatron.core import parallel_state as ps

    etp = tp if etp is None else etp
    if ps.model_parallel_is_initialized():
        current = (ps.get_tensor_model_parallel_world_size(),
                   ps.get_pipeline_model_parallel_world_size(),
                   ps.get_context_parallel_world_size(),
                   ps.get_expert_model_parallel_world_size(),
                   ps.get_expert_tensor_parallel_world_size())
        if current == (tp, pp, cp, ep, etp):
            seed_model_parallel(seed)
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    seed_model_parallel(seed)


def moe_parallel_kwargs() -> dict:
    """The parallel fields of a MoE ``TransformerConfig``: expert parallel and expert tensor
    parallel sizes of the parallel state (``init_parallel`` first)."""
    from megatron.core import parallel_state as ps

    return dict(expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size())


def expert_grads_counted_once(optimizer) -> None:
    """Let megatron's expert optimizer (in a ``ChainedOptimizer``: the one of the param groups
    ``is_expert_parallel``) tell tensor-parallel duplicates by the expert-TP rank: megatron-core
    0.16.1 gives every optimizer the dense TP group, so under expert-TP other than TP an expert
    parameter it does not mark ``tensor_model_parallel`` (a LoRA adapter's factor replicated over
    expert-TP) would be left out of the gradient norm on the ranks whose dense TP rank is not 0,
    or counted twice."""
    from megatron.core import parallel_state as ps

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if any(group.get("is_expert_parallel") for group in sub.param_groups):
            sub.tp_group = ps.get_expert_tensor_parallel_group()
