"""A train.py checkpoint folder as every reader sees it (train.py, eval.py, ``models.convert``).

This module owns the layout of the checkpoints folder: ``step_N`` folders, ``COMPLETE`` written
last into a step folder after every rank's files (``newest_complete`` never picks a half-written
one; ``resolve_checkpoint``: a run, checkpoints or step folder -> the step folder), and
``check_dist_metadata``, which reads the one pickle of a megatron dist checkpoint (torch DCP's
``.metadata``) with an unpickler that accepts only DCP's metadata classes, before megatron
unpickles it.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import torch

from contract.errors import UsageError

#: Written last into a step folder: the checkpoint is complete.
COMPLETE = "COMPLETE"
STEP_GLOB = "step_*"


def mark_complete(step_dir: Path, step: int) -> None:
    (step_dir / COMPLETE).write_text(json.dumps({"step": step, "time": time.time()}) + "\n")


def step_of(path: Path) -> int | None:
    number = path.name.removeprefix("step_")
    return int(number) if path.is_dir() and number.isdigit() else None


def step_folders(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step folder, oldest first, complete or not."""
    found = [(step_of(p), p) for p in Path(ckpt_dir).glob(STEP_GLOB)]
    return sorted((s, p) for s, p in found if s is not None)


def newest_complete(ckpt_dir: Path) -> Path | None:
    complete = [p for _, p in step_folders(ckpt_dir) if (p / COMPLETE).is_file()]
    return complete[-1] if complete else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A step folder, a checkpoint dir, or a run folder (its ``checkpoints/``) -> the step
    folder: the newest complete one of a checkpoint dir (``COMPLETE``)."""
    path = Path(path)
    if (path / "checkpoints").is_dir() and not step_folders(path):
        path = path / "checkpoints"
    if step_folders(path):
        return newest_complete(path) or path
    return path


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch DCP's checkpoint metadata and nothing else: the dataclasses and enums
    its metadata modules define, ``torch.Size``, dtypes and tensor layouts."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
               "torch.distributed.checkpoint.filesystem")

    def find_class(self, module, name):
        import dataclasses
        import enum
        import importlib

        if module in self.MODULES:
            found = getattr(importlib.import_module(module), name, None)
            if (isinstance(found, type) and found.__module__ == module
                    and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))):
                return found
        elif (module, name) in (("torch", "Size"), ("torch.serialization", "_get_layout"),
                                ("collections", "OrderedDict")):
            return getattr(importlib.import_module(module), name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def check_dist_metadata(folder: str | Path) -> None:
    """Read a megatron dist checkpoint's ``.metadata`` (torch DCP's pickle) with the restricted
    unpickler first: a planted pickle is refused before megatron would unpickle it.

    Raises:
        UsageError: the metadata holds anything else, or cannot be read (one line).
    """
    path = Path(folder) / ".metadata"
    if not path.is_file():
        return  # another backend, or not a checkpoint: the loader says so
    try:
        with open(path, "rb") as file:
            _MetadataUnpickler(file).load()
    except Exception as error:  # noqa: BLE001 - any failure: the file is not DCP metadata
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UsageError(f"checkpoint {folder}: .metadata is not dist-checkpoint metadata "
                         f"({first[:120]}): refused") from None
