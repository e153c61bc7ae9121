"""A training run's folder and checkpoints, besides the weights: safe state files, completion,
retention, the run guard, and stopping at a step boundary.

- Per-rank state of a step folder: the Energon loader state of each DP replica as JSON
  (``loader/dp_NNNNN.json``, plain data from ``energon_tasks.loader_state``) and each rank's RNG
  state as plain tensors (``rng/rank_NNNNN.pt``, read back with ``torch.load(weights_only=True)``).
  ``check_rank_states`` (every file, before any heavy work) and ``read_rank_state`` (this
  rank's) refuse anything else (a pickle where a state file should be, a folder of an older
  format) with one line; ``check_dist_metadata`` reads the one pickle of a megatron
  dist checkpoint (torch DCP's ``.metadata``) with an unpickler that accepts only DCP's metadata
  classes, before megatron unpickles it.
- ``COMPLETE``: written last into a step folder, after every rank's files; ``newest_complete``
  never picks a half-written folder (``resolve_checkpoint``: a run, checkpoints or step folder ->
  the step folder); ``prune`` keeps the newest N complete ones.
- ``plan_start``: an ``out`` that holds a run (metrics or checkpoints) is refused unless the run
  resumes (``--resume``, ``auto_resume``: the newest complete checkpoint) or ``--overwrite``
  clears it; ``prepare_run_folder`` then deletes the earlier run (``clear_run``) or drops the
  metrics records of steps after the one resumed from (``trim_metrics``), so each step is
  logged once.
- ``StopSignal``: SIGINT / SIGTERM ask for a checkpoint and a clean exit at the next step
  boundary; every rank agrees on that boundary (a MAX all-reduce once per step).

Raises ``contract.errors.UsageError`` (one line; train.py exits 2) for every bad input.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from contract.errors import UsageError
from models import cpu

if TYPE_CHECKING:  # an annotation only: recipes.training imports this module
    from recipes.training import Layout

#: Written last into a step folder: the checkpoint is complete.
COMPLETE = "COMPLETE"
STEP_GLOB = "step_*"


def loader_file(step_dir: Path, dp_rank: int) -> Path:
    return step_dir / "loader" / f"dp_{dp_rank:05d}.json"


def rng_file(step_dir: Path, rank: int) -> Path:
    return step_dir / "rng" / f"rank_{rank:05d}.pt"


# ------------------------------------------------------------------ RNG state as plain tensors
def rng_state() -> dict:
    """This process's python / numpy / torch (/ CUDA) / megatron tracker RNG state: dicts of
    tensors, numbers and strings only (loadable with ``weights_only=True``)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": {"version": version, "state": torch.tensor(words, dtype=torch.int64),
                       "gauss": gauss},
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                      "has_gauss": has_gauss, "cached_gaussian": cached},
            "torch": torch.get_rng_state(),
            "cuda": cpu.cuda_rng_state(),
            "tracker": dict(get_cuda_rng_tracker().get_states())}


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cpu.set_cuda_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


# ------------------------------------------------------------------ per-rank files
def write_rank_state(step_dir: Path, layout: Layout, loader_states: list) -> None:
    """This rank's RNG state, and (first rank of a replica) its readers' loader states."""
    if layout.first_in_replica:
        loader_file(step_dir, layout.dp_rank).write_text(json.dumps(loader_states))
    torch.save(rng_state(), rng_file(step_dir, layout.rank))


def _loader_states(path: Path, step_dir: Path) -> list:
    try:
        loader = json.loads(path.read_bytes())
        if not isinstance(loader, list):
            raise ValueError("not a list of loader states")
    except (UnicodeDecodeError, ValueError) as error:
        raise UsageError(f"checkpoint {step_dir}: {path.relative_to(step_dir)} is not a JSON "
                         f"loader state ({type(error).__name__}): refused, nothing in a "
                         "checkpoint is unpickled") from None
    return loader


def _rng_state(path: Path, step_dir: Path) -> dict:
    try:
        with warnings.catch_warnings():  # torch's note on a foreign pickle protocol: we refuse
            warnings.simplefilter("ignore")
            return torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as error:
        raise UsageError(f"checkpoint {step_dir}: {path.relative_to(step_dir)} is not a plain "
                         f"tensor file ({type(error).__name__}): refused, nothing in a "
                         "checkpoint is unpickled") from None


def check_rank_states(step_dir: Path) -> None:
    """Every loader and RNG state file of a step folder is of the safe formats (read, not used).

    Raises:
        UsageError: a file of another format (e.g. a pickle where a state file should be, or
            the pickled ``.pt`` loader state of an earlier version), in one line.
    """
    for path in sorted((step_dir / "loader").glob("*")):
        if path.suffix != ".json":
            raise UsageError(f"checkpoint {step_dir}: {path.relative_to(step_dir)} is not a "
                             "JSON loader state (a pickle of an earlier version?): refused, "
                             "nothing in a checkpoint is unpickled")
        _loader_states(path, step_dir)
    for path in sorted((step_dir / "rng").glob("*")):
        _rng_state(path, step_dir)


def read_rank_state(step_dir: Path, layout: Layout) -> tuple[list, dict | None]:
    """(loader states in their plain form, RNG state or None) of this rank.

    Raises:
        UsageError: a missing or foreign state file, in one line.
    """
    path = loader_file(step_dir, layout.dp_rank)
    if not path.is_file():
        raise UsageError(f"checkpoint {step_dir} has no {path.relative_to(step_dir)}")
    rng = rng_file(step_dir, layout.rank)
    return _loader_states(path, step_dir), _rng_state(rng, step_dir) if rng.is_file() else None


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


# ------------------------------------------------------------------ completion and retention
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


def prune(ckpt_dir: Path, current: int, keep: int) -> None:
    """Keep the newest ``keep`` complete step folders up to ``current`` (0: all); delete older
    ones, half-written ones, and those after ``current`` (an abandoned continuation)."""
    kept = 0
    for step, path in reversed(step_folders(ckpt_dir)):
        if step <= current and (path / COMPLETE).is_file() and (keep == 0 or kept < keep):
            kept += 1
            continue
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ the run folder
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"


def run_contents(out: Path, ckpt_dir: Path) -> str:
    """What of a run ``out`` already holds ("" when nothing): metrics and checkpoints."""
    parts = []
    if (out / METRICS).is_file() and (out / METRICS).stat().st_size:
        parts.append(METRICS)
    folders = step_folders(ckpt_dir)
    if folders:
        parts.append(f"{len(folders)} checkpoint(s) up to {folders[-1][1].name}")
    return " and ".join(parts)


def plan_start(out: Path, ckpt_dir: Path, resume: str | None, overwrite: bool,
               auto_resume: bool) -> tuple[str | None, str]:
    """Where a run starts: (the checkpoint to resume from, or None; what of an earlier run to
    delete first, "" for nothing). ``resume`` is ``--resume``'s value ("latest" without one).

    Raises:
        UsageError: ``out`` holds a run and neither ``--resume`` nor ``--overwrite`` (nor
            ``auto_resume``) says what to do with it, both are given, or ``--resume`` finds no
            complete checkpoint.
    """
    held = run_contents(out, ckpt_dir)
    if resume and overwrite:
        raise UsageError("--resume and --overwrite exclude each other")
    if resume == "latest" or (resume is None and auto_resume):
        newest = newest_complete(ckpt_dir)
        if newest is None and resume == "latest":
            raise UsageError(f"--resume: no complete checkpoint in {ckpt_dir}")
        resume = str(newest) if newest else None
        overwrite = overwrite or resume is None  # auto_resume: no attempt completed a checkpoint
    if held and resume is None and not overwrite:
        raise UsageError(f"out {out} holds a run ({held}): add --resume to continue it, "
                         "--overwrite to start it again, or choose another out=")
    return resume, held if resume is None and overwrite else ""


def prepare_run_folder(out: Path, ckpt_dir: Path, clear: str, resume: dict | None) -> None:
    """Rank 0, before anything is written: delete an earlier run (``clear``: what it holds) or
    drop the metrics records after the step resumed from; say which."""
    if clear:
        clear_run(out, ckpt_dir)
        print(f"[train] starting again in {out} (deleted {clear})", flush=True)
    if resume:
        dropped = trim_metrics(out, resume["step"])
        print(f"[train] resuming from {resume['dir']} (step {resume['step']}"
              f"{f'; {dropped} later metrics records dropped' if dropped else ''})", flush=True)
    out.mkdir(parents=True, exist_ok=True)


def clear_run(out: Path, ckpt_dir: Path) -> None:
    """Delete what an earlier run wrote (metrics, TensorBoard events, checkpoints)."""
    (out / METRICS).unlink(missing_ok=True)
    shutil.rmtree(out / TENSORBOARD, ignore_errors=True)
    for _, path in step_folders(ckpt_dir):
        shutil.rmtree(path, ignore_errors=True)
    (Path(ckpt_dir) / "latest").unlink(missing_ok=True)


def trim_metrics(out: Path, step: int) -> int:
    """Drop the records of steps after ``step`` from metrics.jsonl (a resume replays them);
    returns how many were dropped."""
    path = out / METRICS
    if not path.is_file():
        return 0
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
    path.write_text("".join(ln + "\n" for ln in kept))
    return len(lines) - len(kept)


# ------------------------------------------------------------------ stopping at a step boundary
class StopSignal:
    """SIGINT / SIGTERM -> stop after the current step (with a checkpoint).

    The handler only records the signal. A second SIGINT more than 3 s after the first aborts at
    once (launchers such as torchrun forward the first one again right away). Loader workers
    (``protect_workers``) ignore both until this process exits: a batch scheduler signals every
    process of a job, and the workers' state is saved at the step boundary.
    """

    def __init__(self):
        import atexit
        import multiprocessing

        self.received = 0
        self._at = 0.0
        self._pid = os.getpid()
        self._exiting = multiprocessing.get_context("fork").Event()
        atexit.register(self._exiting.set)  # before multiprocessing terminates the workers
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        if os.getpid() != self._pid:
            return
        if self.received and signum == signal.SIGINT and time.monotonic() - self._at > 3:
            raise KeyboardInterrupt
        if not self.received:
            self.received, self._at = signum, time.monotonic()

    def agreed(self) -> int:
        """The signal any rank received (0: none); a collective, once per step on every rank."""
        flag = torch.tensor([self.received], dtype=torch.int64, device=cpu.compute_device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def protect_workers(self, loader) -> None:
        """Let a torch DataLoader's worker processes ignore SIGINT, and SIGTERM until this
        process exits (when multiprocessing terminates them)."""
        loader.worker_init_fn = _WorkerInit(loader.worker_init_fn, self._exiting)


class _WorkerInit:
    def __init__(self, inner, exiting):
        self.inner, self.exiting = inner, exiting

    def __call__(self, worker_id: int) -> None:
        exiting = self.exiting

        def on_sigterm(signum, _frame):
            if exiting.is_set():  # the main process is shutting its workers down
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, on_sigterm)
        if self.inner is not None:
            self.inner(worker_id)


def resolve_checkpoint(path: str | Path) -> Path:
    """A step folder, a checkpoint dir, or a run folder (its ``checkpoints/``) -> the step
    folder: the newest complete one of a checkpoint dir (``COMPLETE``)."""
    path = Path(path)
    if (path / "checkpoints").is_dir() and not step_folders(path):
        path = path / "checkpoints"
    if step_folders(path):
        return newest_complete(path) or path
    return path
