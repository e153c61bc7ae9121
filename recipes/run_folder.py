"""A training run's folder: what an earlier run left there, and stopping at a step boundary.

This module owns the run guard (``plan_start``: an ``out`` that holds a run (metrics or checkpoints)
is refused unless the run resumes (``--resume``, ``auto_resume``: the newest complete checkpoint)
or ``--overwrite`` clears it; ``prepare_run_folder`` then deletes the earlier run (``clear_run``)
or drops the metrics records of steps after the one resumed from (``trim_metrics``), so each step
is logged once, and renames the later step folders ``.abandoned``), the run lock (``lock_run``:
``<out>/train.lock``, the converters' ``RunLock``: a second train.py into a live ``out`` is refused
in one line), the automatic resume's choice (``plan_start``: the newest complete checkpoint whose
files are all there at their recorded sizes; each one passed over is one line) and
``StopSignal`` (SIGINT / SIGTERM ask for a checkpoint and a clean exit at the next step
boundary; every rank agrees on that boundary with a MAX all-reduce once per step).

Raises ``contract.errors.UsageError`` (one line; train.py exits 2) for every bad start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from contract.errors import UsageError
from models import cpu
from models.checkpointing.folders import (
    ABANDONED,
    check_sizes,
    complete_folders,
    point_latest,
    step_folders,
    step_of,
)

METRICS = "metrics.jsonl"
SAMPLE_KEYS = "sample_keys.jsonl"  #: log.sample_keys: the keys each DP rank trained per step
TENSORBOARD = "tensorboard"
SKIP_LOG = "skipped_samples.jsonl"  #: key, reason, detail of each sample the loaders skipped
LOCK = "train.lock"


def lock_run(out: Path):
    """Rank 0 (``RANK`` 0 or unset): take ``<out>/train.lock`` for this process's lifetime
    (released at exit; after a kill -9 it is stale and taken over). Returns the lock, or None
    on the other ranks.

    Raises:
        UsageError: a live train.py holds it (one line naming its pid and host).
    """
    import atexit

    from converters.lock import LockedError, RunLock

    if os.environ.get("RANK", "0") != "0":
        return None
    lock = RunLock(Path(out) / LOCK, what=f"run folder {out}",
                   notify=lambda line: print(f"[train] {line}", flush=True))
    try:
        lock.acquire()
    except LockedError as error:
        raise UsageError(str(error)) from None
    atexit.register(lock.release)
    return lock


def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[train] {line}", flush=True)


def newest_intact(ckpt_dir: Path, say: bool = True) -> Path | None:
    """The newest complete step folder whose recorded files are all there at their sizes;
    each newer one passed over is one line (``say``)."""
    for path in reversed(complete_folders(ckpt_dir)):
        problem = check_sizes(path)
        if problem is None:
            return path
        if say:
            _say(f"checkpoint {path} failed its checks ({problem}): passed over, trying the "
                 "previous one")
    return None


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
               auto_resume: bool, say: bool = True) -> tuple[str | None, str]:
    """Where a run starts: (the checkpoint to resume from, or None; what of an earlier run to
    delete first, "" for nothing). ``resume`` is ``--resume``'s value ("latest" without one);
    ``say``: name each checkpoint passed over (``newest_intact``).

    Raises:
        UsageError: ``out`` holds a run and neither ``--resume`` nor ``--overwrite`` (nor
            ``auto_resume``) says what to do with it, both are given, or ``--resume`` finds no
            complete checkpoint.
    """
    held = run_contents(out, ckpt_dir)
    if resume and overwrite:
        raise UsageError("--resume and --overwrite exclude each other")
    if resume == "latest" or (resume is None and auto_resume):
        newest = newest_intact(ckpt_dir, say)
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
        abandoned = abandon_after(Path(resume["dir"]), ckpt_dir)
        aside = f"; later checkpoints set aside as {ABANDONED}: {abandoned}" if abandoned else ""
        print(f"[train] resuming from {resume['dir']} (step {resume['step']}"
              f"{f'; {dropped} later metrics records dropped' if dropped else ''}{aside})",
              flush=True)
    out.mkdir(parents=True, exist_ok=True)


def abandon_after(step_dir: Path, ckpt_dir: Path) -> str:
    """Resuming from ``step_dir`` (of this run or another): this run's later step folders (in
    ``ckpt_dir``) are renamed ``step_N.abandoned`` (complete ones; nothing resumes from them) or
    deleted (incomplete ones), and ``latest`` names ``step_dir`` when it is one of this run's.
    Returns the renamed names, comma-separated."""
    resumed = step_of(step_dir)
    if resumed is None:
        return ""
    renamed = []
    for step, path in step_folders(ckpt_dir):
        if step <= resumed:
            continue
        if (path / "COMPLETE").is_file():
            target = path.with_name(path.name + ABANDONED)
            shutil.rmtree(target, ignore_errors=True)
            path.rename(target)
            renamed.append(target.name)
        else:
            shutil.rmtree(path, ignore_errors=True)
    if step_dir.parent.resolve() == Path(ckpt_dir).resolve():
        point_latest(ckpt_dir, step_dir)
    return ", ".join(renamed)


def clear_run(out: Path, ckpt_dir: Path) -> None:
    """Delete what an earlier run wrote (metrics, skip log, sample keys, TensorBoard events,
    checkpoints)."""
    for name in (METRICS, SKIP_LOG, SAMPLE_KEYS):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / TENSORBOARD, ignore_errors=True)
    for path in Path(ckpt_dir).glob("step_*"):  # step, .partial and .abandoned folders
        shutil.rmtree(path, ignore_errors=True)
    point_latest(ckpt_dir, None)


def trim_metrics(out: Path, step: int) -> int:
    """Drop the records of steps after ``step`` from metrics.jsonl and sample_keys.jsonl (a
    resume replays them); returns how many metrics records were dropped."""
    dropped = 0
    for name in (METRICS, SAMPLE_KEYS):
        path = out / name
        if not path.is_file():
            continue
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
        path.write_text("".join(ln + "\n" for ln in kept))
        dropped += (len(lines) - len(kept)) if name == METRICS else 0
    return dropped


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
