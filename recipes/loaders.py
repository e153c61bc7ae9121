"""train.py's training loaders and their state: the per-rank Energon loaders, or the global data
plan's (``data.global_plan``: every step planned over all DP ranks, energon_tasks/planned_loader).

This module owns ``build_loaders`` (one loader per virtual DP reader of this process), what a
checkpoint stores of them (``loader_states``: the Energon loaders' per-rank states; the plan's one
DP-independent state goes into ``train_state.json`` as ``data_plan``, ``plan_state``), how a
resume restores them (``restore_loaders``: a plan state at any DP size; an Energon state at its
own DP size only), and the plan's per-step record (``PlanLog``: ``dp_tokens_max_over_mean``,
``dp_vision_max_over_mean`` and the blend's token shares for metrics.jsonl, and with
``log.sample_keys`` the keys each DP rank trained at each step, ``<out>/sample_keys.jsonl``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from contract.errors import UsageError
from contract.lifetime import WithParent
from recipes.run_folder import SAMPLE_KEYS


def vision_cost(model_cfg):
    """(image grids, video grids) -> the tower's forward FLOPs (the plan's vision cost)."""
    from models.families import family_of

    family = family_of(model_cfg)
    return lambda images, videos: family.vision_flops(model_cfg, [images, videos])


def build_loaders(cfg, encoder, layout, stop, skip_log: Path) -> list:
    """One train loader per virtual DP reader of this process (``data.virtual_dp``); the keys of
    the samples they skip go to ``skip_log`` (once per DP replica)."""
    from energon_tasks.energon_dataset import SKIP_LOG_ENV

    os.environ[SKIP_LOG_ENV] = str(skip_log) if layout.first_in_replica else ""
    virtual, d = cfg.data.virtual_dp, cfg.data
    ranks = [(layout.dp_rank * virtual + v, layout.dp * virtual) for v in range(virtual)]
    if d.global_plan:
        from energon_tasks.planned_loader import PlannedLoader

        loaders = [PlannedLoader(
            d.path, task_encoder=encoder, vision_cost=vision_cost(cfg.model),
            rows=cfg.train.global_batch_size, micro_batch=cfg.train.micro_batch_size,
            dp_rank=rank, dp_size=size, num_workers=d.num_workers,
            seed=cfg.train.seed + d.seed_offset, split_part=d.split_part,
            by_tokens=d.blend_weights == "tokens") for rank, size in ranks]
    else:
        from energon_tasks.loader import get_train_loader

        loaders = [get_train_loader(
            d.path, task_encoder=encoder, batch_size=cfg.train.micro_batch_size,
            dp_rank=rank, dp_size=size, num_workers=d.num_workers,
            shuffle_buffer_size=d.shuffle_buffer_size,
            max_samples_per_sequence=d.max_samples_per_sequence, seed_offset=d.seed_offset,
            split_part=d.split_part) for rank, size in ranks]
    for loader in loaders:
        stop.protect_workers(loader)
        loader.worker_init_fn = WithParent(loader.worker_init_fn)  # a kill -9 leaves none
    return loaders


def loader_states(cfg, loaders) -> tuple[list, dict]:
    """(this rank's per-rank loader states, what train_state.json adds): the Energon loaders'
    states in their plain form, or the plan's one state (``data_plan``)."""
    if cfg.data.global_plan:
        return [], {"data_plan": loaders[0].save_state()}
    from energon_tasks.loader_state import to_plain

    return [to_plain(loader.save_state_rank()) for loader in loaders], {}


def restore_loaders(cfg, loaders, resume: dict, plain: list, fresh: bool) -> None:
    """The loaders continue where the checkpoint's stopped (``fresh``: another data path, they
    start over).

    Raises:
        UsageError: the checkpoint's data position is of the other kind of loader, or refused.
    """
    if fresh:
        return
    where = resume["dir"]
    saved_plan = resume.get("data_plan")
    if cfg.data.global_plan != (saved_plan is not None):
        saved = "the global data plan" if saved_plan is not None else "per-rank Energon loaders"
        raise UsageError(f"checkpoint {where} was trained with {saved}: resume with "
                         f"data.global_plan={str(saved_plan is not None).lower()}")
    if saved_plan is not None:
        for loader in loaders:
            try:
                loader.restore_state(saved_plan)
            except ValueError as error:
                raise UsageError(f"checkpoint {where}: data plan state refused ({error})"
                                 ) from None
        return
    from energon_tasks.loader_state import LoaderStateError, from_plain

    if len(plain) != len(loaders):
        raise UsageError(f"checkpoint {where} holds {len(plain)} loader states per rank, "
                         f"data.virtual_dp is {len(loaders)}")
    try:
        states = [from_plain(state) for state in plain]
    except LoaderStateError as error:
        raise UsageError(f"checkpoint {where}: loader state refused ({error})") from None
    for loader, state in zip(loaders, states, strict=True):
        loader.restore_state_rank(state)


class PlanLog:
    """The global plan's record of a logging window and, with ``log.sample_keys``, the keys
    each DP rank trained (gathered to global rank 0, which writes ``<out>/sample_keys.jsonl``)."""

    def __init__(self, out: Path, layout, virtual: int, keys: bool) -> None:
        self.path = out / SAMPLE_KEYS if keys else None
        self.layout, self.virtual = layout, virtual
        self.window: list[dict] = []

    def step(self, step: int, batches: list) -> None:
        """The step's batches (``grad_accum`` per virtual reader, in reader order)."""
        plans = [b.plan for b in batches if getattr(b, "plan", None)]
        if not plans:
            return
        self.window.append(plans[0])
        if self.path is None:
            return
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        per_reader = len(batches) // self.virtual
        mine = {self.layout.dp_rank * self.virtual + v: [k for b in batches[v::self.virtual]
                                                         for k in b.plan["keys"]]
                for v in range(self.virtual)} if per_reader else {}
        gathered = [None] * self.layout.dp
        dist.all_gather_object(gathered, mine, group=ps.get_data_parallel_group())
        if self.layout.rank == 0:
            rows = {rank: keys for part in gathered for rank, keys in part.items()}
            with self.path.open("a", encoding="utf-8") as file:
                for rank in sorted(rows):
                    file.write(json.dumps({"step": step, "rank": rank, "keys": rows[rank]})
                               + "\n")

    def summary(self) -> dict:
        """The window's mean balance (and the latest token shares), then a new window."""
        if not self.window:
            return {}
        out = {key: sum(p[key] for p in self.window) / len(self.window)
               for key in ("dp_tokens_max_over_mean", "dp_vision_max_over_mean")}
        out["blend_token_share"] = self.window[-1]["blend_token_share"]
        self.window = []
        return out
