"""Runs a conversion: plan shards, build them with N workers, then index the union once.

Planning is deterministic: every source row is in exactly one unit, units are cut into contiguous
partitions (`--num-partitions/--partition-index`, one per machine), and each partition's units are
bucketed per (Energon split, config) into shards of `shard_size` samples. The output bytes do not
depend on the number of workers. When the last partition completes, `finalize` writes the
accounting, the statistics, `.nv-meta/` through `energon prepare`, and the metadataset blend.

Faults: each partition runs under its own lock (`converters.lock`: a second run of the same
partition into the same `--out` is refused, a stale lock of a killed run is taken over); SIGINT /
SIGTERM stop the workers at once and end the run with `Interrupted`; a full disk ends it with
`OutOfSpace`; a worker that dies ends it with `WorkerDied`. Whatever stopped it, a completed shard
is recorded by its sidecar and nothing else counts, so the same command resumes and finishes with
the output of an uninterrupted run. The options that change the output are recorded once the
source is planned; a later run with other options, or of a local source whose annotation files
or archives changed (their fingerprints are among the options), is refused once a shard exists
(before that, an attempt that failed leaves nothing that blocks the corrected command);
`--restart` discards the earlier run and converts from scratch.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from contract.console import DEFAULT_EVERY_S, Progress, phase
from contract.errors import RunFailure, disk_full
from contract.lifetime import die_with_parent
from converters.base import SourceDataset, SourceSplit, Unit, UsageError, config_folder
from converters.lock import RunLock
from converters.writer import ShardSpec, shard_done, write_json_atomic, write_shard

_TARGET_ORDER = ("train", "val", "test")


class Interrupted(BaseException):
    """SIGINT / SIGTERM arrived; `signal` names it. A BaseException, like KeyboardInterrupt, so
    that no `except Exception` on the way (e.g. the writer's per-row guard) can swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class OutOfSpace(RunFailure):
    """A write failed for lack of space (or a file size limit): exit code 1."""


class WorkerDied(RunFailure):
    """A worker process ended without finishing its shard (killed, out of memory): exit 1."""


@dataclass(slots=True, kw_only=True)
class Options:
    out: Path
    workers: int = 1
    num_partitions: int = 1
    partition_index: int = 0
    val_fraction: float = 0.01
    shard_size: int = 1000  #: samples per shard
    #: also store Energon's own media metadata in index.sqlite (K.json always has it); costs
    #: about 2 ms per image in `energon prepare`
    energon_media_metadata: bool = False
    progress_interval: float = DEFAULT_EVERY_S  #: seconds between progress lines (no TTY)
    #: discard what an earlier run left in `out` (shards, accounting, caches) and start over
    restart: bool = False

    def check(self) -> None:
        problems = []
        if self.workers < 1:
            problems.append("--workers must be >= 1")
        if self.num_partitions < 1 or not 0 <= self.partition_index < self.num_partitions:
            problems.append("--partition-index must be in [0, --num-partitions)")
        if not 0.0 <= self.val_fraction < 1.0:
            problems.append("--val-fraction must be in [0, 1)")
        if self.shard_size < 1:
            problems.append("--shard-size must be >= 1")
        if self.restart and self.num_partitions > 1:
            problems.append("--restart converts one partition from scratch and cannot discard "
                            "the shards of the others: with --num-partitions > 1 remove --out "
                            "and rerun every partition")
        if problems:
            raise UsageError("; ".join(problems))


def carve_to_val(key: str, fraction: float) -> bool:
    """Per-sample val assignment by a hash of the key (stable across runs and machines)."""
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) / 2**32 < fraction


def plan_shards(source: SourceDataset, splits: list[SourceSplit], opts: Options) -> list[ShardSpec]:
    """The shards of this partition, each a list of units, in a fixed order."""
    buckets: dict[tuple[str, str], list[tuple[int, Unit]]] = {}
    for index, split in enumerate(splits):
        units = source.units(split) if split.num_rows else []
        covered = sorted(r for u in units for r in u.rows)
        if covered != list(range(split.num_rows)):
            raise RuntimeError(f"converter bug: units of {split.config}/{split.split} do not "
                               f"cover its {split.num_rows} rows exactly once")
        lo = len(units) * opts.partition_index // opts.num_partitions
        hi = len(units) * (opts.partition_index + 1) // opts.num_partitions
        for unit in units[lo:hi]:
            target = split.target
            if target == "carve":
                target = "val" if carve_to_val(unit.key, opts.val_fraction) else "train"
            buckets.setdefault((target, split.config), []).append((index, unit))
    specs = []
    for target, config in sorted(buckets, key=lambda b: (_TARGET_ORDER.index(b[0]), b[1])):
        items = buckets[(target, config)]
        folder = config_folder(config)
        for k in range(0, len(items), opts.shard_size):
            number = k // opts.shard_size
            name = f"shards/{target}/{folder}/p{opts.partition_index:03d}-{number:06d}.tar"
            specs.append(ShardSpec(name=name, items=items[k:k + opts.shard_size]))
    return specs


# ---- workers and signals ----------------------------------------------------------------------

# The source object is inherited by forked workers instead of being pickled per task.
_WORKER_STATE: dict = {}


def _run_one(spec: ShardSpec) -> dict:
    state = _WORKER_STATE
    return write_shard(state["out"], state["source"], state["splits"], spec)


def _worker_init(parent: int) -> None:
    """Workers leave SIGINT / SIGTERM to the parent (which stops them) and die with it (a kill
    -9 of the converter leaves no orphan that keeps writing: ``contract.lifetime``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(parent)


@contextmanager
def interruptible():
    """SIGINT and SIGTERM raise `Interrupted` in the main thread while the block runs."""
    def stop(signum, _frame):
        raise Interrupted(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _write_all(pending: list[ShardSpec], workers: int, on_done: Callable[[dict], None]) -> None:
    """Write the pending shards, in this process or in `workers` forked processes."""
    if workers == 1 or len(pending) <= 1:
        for spec in pending:
            on_done(_run_one(spec))
        return
    executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                   initializer=_worker_init, initargs=(os.getpid(),))
    try:
        futures = [executor.submit(_run_one, spec) for spec in pending]
        for future in as_completed(futures):
            on_done(future.result())
    except BrokenProcessPool:
        _kill(executor)
        raise WorkerDied("a worker process died (killed, or out of memory)") from None
    except BaseException:
        _kill(executor)
        raise
    executor.shutdown(wait=True)


def _kill(executor: ProcessPoolExecutor) -> None:
    for process in list((executor._processes or {}).values()):  # no public way in Python 3.11
        process.kill()
    executor.shutdown(wait=True, cancel_futures=True)


@contextmanager
def disk_errors():
    """OSErrors that mean a full disk (or a file size limit) become `OutOfSpace`."""
    try:
        yield
    except OSError as exc:
        if disk_full(exc):
            raise OutOfSpace(f"{exc.strerror} ({exc.filename or 'writing the output'})") from None
        raise


# ---- options and the output folder ------------------------------------------------------------

def check_output(out: Path) -> None:
    """The output folder exists (or is created) and is writable, else a UsageError."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--out {out}: not writable ({exc.strerror or exc})") from None


def _option_fingerprint(opts: Options) -> dict:
    return {"val_fraction": opts.val_fraction, "shard_size": opts.shard_size,
            "num_partitions": opts.num_partitions,
            "energon_media_metadata": opts.energon_media_metadata}


def _flatten(doc, prefix: str = "") -> dict:
    if not isinstance(doc, dict):
        return {prefix: doc}
    out = {}
    for key, value in doc.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def _differences(before: dict, now: dict) -> list[str]:
    a, b = _flatten(before), _flatten(now)
    return [f"{k}: {json.dumps(a.get(k))[:80]} -> {json.dumps(b.get(k))[:80]}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _has_shards(out: Path) -> bool:
    return any((out / ".work" / "shards").rglob("*.json"))


def _check_options(out: Path, fingerprint: dict, *, write: bool) -> None:
    """A run that continues a conversion must use its options (only the keys both know when
    `write` is False, i.e. before the source is planned). Refused only once a shard exists."""
    path = out / ".work" / "options.json"
    previous = json.loads(path.read_text()) if path.is_file() else None
    if previous is not None and _has_shards(out):
        known = previous if write else {k: previous[k] for k in fingerprint if k in previous}
        changed = _differences(known, fingerprint)
        files = [c.split(":", 1)[0][len("source.files."):] for c in changed
                 if c.startswith("source.files.")]
        if files:
            raise UsageError(f"--source {fingerprint['source'].get('location')} changed since "
                             f"the interrupted run into --out {out} ({len(files)} file(s): "
                             f"{', '.join(files[:3])}{', ...' if len(files) > 3 else ''}); "
                             "rerun with --restart to convert it from scratch, or use another "
                             "--out")
        if changed:
            raise UsageError(f"--out {out} holds a conversion made with other options "
                             f"({'; '.join(changed)}); rerun with those, or use another --out")
    if write and previous != fingerprint:
        write_json_atomic(path, fingerprint)


def recorded_source(out: Path) -> tuple[dict | None, bool]:
    """What the conversion in `out` recorded of its source (its `fingerprint()["source"]`, None
    when there is none), and whether that record binds a rerun (a shard exists). Read it under the
    partition's lock, i.e. from `make_source`."""
    path = out / ".work" / "options.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    return previous.get("source"), _has_shards(out)


def precheck(opts: Options) -> None:
    """Argument checks that need no source: run before opening it (which can be slow)."""
    opts.check()
    check_output(opts.out)
    if not opts.restart:
        _check_options(opts.out, _option_fingerprint(opts), write=False)


def discard_earlier_run(out: Path) -> None:
    """`--restart`: remove what an earlier conversion left in `out` (shards, their accounting,
    the recorded options, the finalized outputs, the caches of `.work/`); the lock files stay.
    Held under the (single) partition's lock."""
    import shutil

    for name in ("shards", ".nv-meta"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("summary.json", "rejects.jsonl", "stats.json", "metadataset.yaml"):
        (out / name).unlink(missing_ok=True)
    for path in (out / ".work").iterdir() if (out / ".work").is_dir() else ():
        if path.suffix == ".lock":
            continue
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    phase(f"--restart: discarded the earlier conversion in {out}")


def _remove_partials(out: Path, partition: int) -> None:
    """Half-written shards of an earlier, killed run of this partition (held under its lock)."""
    for path in (out / "shards").rglob(f"p{partition:03d}-*.tar.partial*"):
        path.unlink(missing_ok=True)


# ---- the run ------------------------------------------------------------------------------------

def convert(make_source: Callable[[], SourceDataset], opts: Options) -> dict | None:
    """Convert this partition; finalize when every partition is done.

    Args:
        make_source: opens (plans) the source; called under this partition's lock.
        opts: the run's options.

    Returns:
        The summary when this run finalized the dataset, else None (other partitions pending,
        or another partition finalizes).

    Raises:
        UsageError, LockedError, Interrupted, OutOfSpace, WorkerDied, NoSamples.
    """
    opts.check()
    check_output(opts.out)
    work = opts.out / ".work"
    with interruptible(), disk_errors(), RunLock(
            work / f"partition-{opts.partition_index:03d}.lock",
            f"partition {opts.partition_index} of --out {opts.out}", notify=phase):
        if opts.restart:
            discard_earlier_run(opts.out)
        _remove_partials(opts.out, opts.partition_index)
        phase(f"planning: reading the source (partition {opts.partition_index + 1} of "
              f"{opts.num_partitions})")
        source = make_source()
        splits = source.splits()
        fingerprint = {"dataset": source.name, "source": source.fingerprint(),
                       "splits": [[s.config, s.split, s.num_rows] for s in splits],
                       "skipped_configs": getattr(source, "skipped", dict)(),
                       **_option_fingerprint(opts)}
        _check_options(opts.out, fingerprint, write=True)
        start = time.perf_counter()
        specs = plan_shards(source, splits, opts)
        pending = [s for s in specs if not shard_done(opts.out, s)]
        rows = sum(len(u.rows) for s in pending for _, u in s.items)
        phase(f"writing {len(pending)} of {len(specs)} shards ({rows} rows) with "
              f"{opts.workers} worker(s)")
        _WORKER_STATE.update(out=opts.out, source=source, splits=splits)
        progress = Progress(f"{source.name} p{opts.partition_index}", opts.progress_interval,
                            total=rows, unit="rows", stream=sys.stderr)
        try:
            _write_all(pending, opts.workers, lambda record: progress.advance(record["rows_read"]))
        except BaseException:
            _remove_partials(opts.out, opts.partition_index)  # of the workers stopped mid-shard
            raise
        finally:
            progress.close()
        with open(work / "runs.jsonl", "a") as f:
            f.write(json.dumps({"partition": opts.partition_index, "rows": rows,
                                "seconds": round(time.perf_counter() - start, 3)}) + "\n")
        write_json_atomic(work / f"partition-{opts.partition_index:03d}.done",
                          {"shards": len(specs)})
        if len(list(work.glob("partition-*.done"))) < opts.num_partitions:
            return None
        from converters.finalize import finalize

        return finalize(opts.out, workers=opts.workers)  # still under this partition's lock
