"""A train.py checkpoint folder as every reader sees it (train.py, eval.py, ``models.convert``).

This module owns the layout of the checkpoints folder: ``step_N`` folders, ``COMPLETE`` written
last into a step folder after every rank's files (``newest_complete`` never picks a half-written
one; ``resolve_checkpoint``: a run, checkpoints or step folder -> the step folder). What is
unpickled of the dist checkpoint inside (``model_optim/``, an import folder) is
``models.dist_load``'s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

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


def weights_folder(path: str | Path) -> Path:
    """The dist checkpoint of weights at ``path``: a train.py run, checkpoints or step folder
    (the step its run printed) -> its ``model_optim``; anything else (an import folder,
    ``<step>/model_optim`` itself) as given."""
    step = resolve_checkpoint(path)
    return step / "model_optim" if (step / "model_optim").is_dir() else Path(path)
