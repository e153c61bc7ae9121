"""The training run's process layout: TP x PP x CP (x EP x expert-TP) x DP over the world.

This module owns ``Layout`` (this rank's place: its DP / CP rank, whether it writes its replica's
loader state), ``check_layout`` (every reason a layout cannot be built, in one ``UsageError``)
and ``init_distributed``: the process setup of ``models.parallel.init_parallel`` (gloo on CPU or
nccl on GPU, megatron's ``parallel_state``, the seeded RNG tracker), then this rank's ``Layout``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from contract.errors import UsageError
from models.parallel import init_parallel


@dataclass(frozen=True, slots=True)
class Layout:
    world: int
    rank: int
    tp: int
    pp: int
    cp: int
    dp: int
    dp_rank: int
    cp_rank: int
    first_in_replica: bool  #: tp, pp, cp rank 0: writes this replica's loader state


def check_layout(world: int, tp: int, pp: int, cp: int, fixed_length: bool, ep: int = 1,
                 etp: int | None = None) -> None:
    """Raises UsageError (every problem) when the layout cannot be built (``etp``: the experts'
    tensor parallel, None: tp). (A sequence length that 2 * CP does not divide is the run
    config's error: ``TaskEncoderConfig.validate``.)"""
    problems = []
    if world % (tp * pp * cp):
        problems.append(f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    expert_tp, label = (tp, "tp") if etp is None else (etp, "etp")
    if ep > 1 and world % (expert_tp * pp * ep):
        problems.append(f"world size {world} is not divisible by {label}*pp*ep = "
                        f"{expert_tp}*{pp}*{ep} (the expert-parallel ranks come from the "
                        "data-parallel ones)")
    if pp > 1 and not fixed_length:
        problems.append("parallel.pp > 1 needs task_encoder.fixed_length=true")
    if pp > 1 and cp > 1:
        problems.append("parallel.pp > 1 with parallel.cp > 1 is not supported yet")
    if problems:
        raise UsageError("impossible parallel layout: " + "; ".join(problems))


def init_distributed(tp: int, pp: int, cp: int, seed: int, ep: int = 1,
                     etp: int | None = None) -> Layout:
    """``init_parallel`` at this layout (plain python = one process; ``etp``: the experts'
    tensor parallel, None: tp), then this rank's place."""
    init_parallel(tp=tp, pp=pp, cp=cp, ep=ep, seed=seed, etp=etp)
    from megatron.core import parallel_state as ps

    return Layout(world=dist.get_world_size(), rank=dist.get_rank(), tp=tp, pp=pp, cp=cp,
                  dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                  cp_rank=ps.get_context_parallel_rank(),
                  first_in_replica=(ps.get_tensor_model_parallel_rank() == 0
                                    and ps.get_pipeline_model_parallel_rank() == 0
                                    and ps.get_context_parallel_rank() == 0))
