"""Train / val loaders over an Energon dataset folder or a metadataset YAML.

This module owns every Energon dataset the project builds: the training loader, the val loader
and the one-pass reader (eval.py's reader, train.py's first-batch probe), i.e. the wiring of
``get_train_dataset`` / ``get_val_dataset`` and ``get_savable_loader`` / ``get_loader`` with a
``WorkerConfig`` whose rank is the data-parallel rank (every context / tensor / pipeline-parallel
rank of one replica must read the same samples), and the packing buffer taken from the task
encoder's config. Samples the dataset cannot load (damaged members, checksum mismatches) are
skipped with one logged line each and counted (``energon_tasks.energon_dataset.skip_handler``).
Before Energon reads a dataset, every YAML / JSON file it would read is checked to be data that
names no code (``energon_tasks.dataset_files.check_dataset_files``: one ``UsageError`` line).
"""

from __future__ import annotations

from pathlib import Path

from megatron.energon import (
    WorkerConfig,
    get_loader,
    get_savable_loader,
    get_train_dataset,
    get_val_dataset,
)

from energon_tasks.dataset_files import check_dataset_files
from energon_tasks.energon_dataset import skip_handler
from energon_tasks.task_encoder import VLMTaskEncoder


def worker_config(dp_rank: int = 0, dp_size: int = 1, num_workers: int = 0,
                  seed_offset: int = 0) -> WorkerConfig:
    """The WorkerConfig of every loader of the project: damaged samples are skipped with one
    counted, keyed line (skip_handler), never trained on and never a stop."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} is not in [0, {dp_size})")
    return WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=num_workers,
                        seed_offset=seed_offset, global_error_handler=skip_handler)


def _packing(task_encoder: VLMTaskEncoder) -> int | None:
    budget = task_encoder.budget
    return budget.packing_buffer_size if budget.packing else None


def get_train_loader(
    path: str | Path,
    *,
    task_encoder: VLMTaskEncoder,
    batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    num_workers: int = 2,
    shuffle_buffer_size: int = 100,
    max_samples_per_sequence: int = 100,
    seed_offset: int = 0,
    split_part: str = "train",
):
    """The infinite, savable training loader (``save_state_rank`` / ``restore_state_rank``).

    Args:
        path: dataset folder (``.nv-meta/dataset.yaml``) or a metadataset YAML.
        task_encoder: the task encoder (its config decides packing).
        batch_size: rows per batch (packed rows when packing).
        dp_rank: data-parallel rank (Energon rank); dp_size: data-parallel world size.
        num_workers: loader worker processes per rank (0 = in the main process).
        shuffle_buffer_size: samples in the shuffle buffer.
        max_samples_per_sequence: samples read in a row from one shard before switching.
        seed_offset: changes the shuffle order.
        split_part: Energon split part ("train", or "train/<config>").

    Raises:
        ValueError: a rank outside [0, dp_size).
        UsageError: a dataset file names code or holds what the project's datasets do not.
    """
    check_dataset_files(path)
    dataset = get_train_dataset(
        str(path),
        split_part=split_part,
        worker_config=worker_config(dp_rank, dp_size, num_workers, seed_offset),
        batch_size=batch_size,
        packing_buffer_size=_packing(task_encoder),
        shuffle_buffer_size=shuffle_buffer_size,
        max_samples_per_sequence=max_samples_per_sequence,
        task_encoder=task_encoder,
    )
    return get_savable_loader(dataset)


def get_val_loader(
    path: str | Path,
    *,
    task_encoder: VLMTaskEncoder,
    batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    num_workers: int = 2,
    split_part: str = "val",
    limit: int | None = None,
):
    """One epoch of validation batches, in a fixed order (savable as well).

    Raises:
        ValueError: a rank outside [0, dp_size).
        UsageError: a dataset file names code or holds what the project's datasets do not.
    """
    check_dataset_files(path)
    dataset = get_val_dataset(
        str(path),
        split_part=split_part,
        worker_config=worker_config(dp_rank, dp_size, num_workers, 0),
        batch_size=batch_size,
        packing_buffer_size=_packing(task_encoder),
        limit=limit,
        task_encoder=task_encoder,
    )
    return get_savable_loader(dataset)


def get_pass_loader(path: str | Path, *, task_encoder: VLMTaskEncoder, split_part: str,
                    batch_size: int = 1):
    """One pass over a split in this process, in the val loader's fixed order: no shuffle, no
    repeat, no packing, not savable (eval.py's reader, train.py's first-batch probe).

    Raises:
        UsageError: a dataset file names code or holds what the project's datasets do not.
    """
    check_dataset_files(path)
    dataset = get_val_dataset(str(path), split_part=split_part, worker_config=worker_config(),
                              batch_size=batch_size, task_encoder=task_encoder)
    return get_loader(dataset)
