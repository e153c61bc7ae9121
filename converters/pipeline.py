"""Runs a conversion: plan shards, build them with N workers, then index the union once.

Planning is deterministic: every source row is in exactly one unit, units are cut into contiguous
partitions (`--num-partitions/--partition-index`, one per machine), and each partition's units are
bucketed per (Energon split, config) into shards of `shard_size` samples. The output bytes do not
depend on the number of workers. When the last partition completes, `finalize` writes the
accounting, the statistics, `.nv-meta/` through `energon prepare`, and the metadataset blend.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from converters.base import SourceDataset, SourceSplit, Unit, UsageError, config_folder
from converters.writer import ShardSpec, shard_done, write_shard

_TARGET_ORDER = ("train", "val", "test")


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
        if problems:
            raise UsageError("; ".join(problems))


def carve_to_val(key: str, fraction: float) -> bool:
    """Per-sample val assignment by a hash of the key (stable across runs and machines)."""
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) / 2**32 < fraction


def plan_shards(source: SourceDataset, splits: list[SourceSplit], opts: Options) -> list[ShardSpec]:
    """The shards of this partition, each a list of units, in a fixed order."""
    buckets: dict[tuple[str, str], list[tuple[int, Unit]]] = {}
    for index, split in enumerate(splits):
        units = source.units(split)
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


# The source object is inherited by forked workers instead of being pickled per task.
_WORKER_STATE: dict = {}


def _run_one(spec: ShardSpec) -> dict:
    state = _WORKER_STATE
    return write_shard(state["out"], state["source"], state["splits"], spec)


def check_output(out: Path) -> None:
    """The output folder exists (or is created) and is writable, else a UsageError."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--out {out}: not writable ({exc.strerror or exc})") from None


def _option_fingerprint(opts: Options) -> dict:
    return {"val_fraction": opts.val_fraction, "shard_size": opts.shard_size,
            "num_partitions": opts.num_partitions,
            "energon_media_metadata": opts.energon_media_metadata}


def _check_options(out: Path, fingerprint: dict, *, write: bool = True) -> None:
    """A resumed run must use the options of the run it continues (keys present in both)."""
    path = out / ".work" / "options.json"
    if path.is_file():
        previous = json.loads(path.read_text())
        changed = sorted(k for k in set(previous) & set(fingerprint)
                         if previous[k] != fingerprint[k])
        if changed or (write and previous != fingerprint):
            changed = changed or sorted(k for k in set(previous) | set(fingerprint)
                                        if previous.get(k) != fingerprint.get(k))
            raise UsageError(f"--out {out} holds a conversion made with other options "
                             f"({', '.join(changed)}); use another --out or delete it")
    elif write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fingerprint, sort_keys=True, indent=1))


def precheck(opts: Options) -> None:
    """Argument checks that need no source: run before opening it (which can be slow)."""
    opts.check()
    check_output(opts.out)
    _check_options(opts.out, _option_fingerprint(opts), write=False)


def convert(source: SourceDataset, opts: Options) -> dict | None:
    """Convert this partition; finalize when every partition is done.

    Returns:
        The summary when this run finalized the dataset, else None (other partitions pending).
    """
    opts.check()
    check_output(opts.out)
    splits = source.splits()
    fingerprint = {"dataset": source.name, "source": source.fingerprint(),
                   "splits": [[s.config, s.split, s.num_rows] for s in splits],
                   **_option_fingerprint(opts)}
    _check_options(opts.out, fingerprint)
    start = time.perf_counter()
    specs = plan_shards(source, splits, opts)
    pending = [s for s in specs if not shard_done(opts.out, s)]
    rows = sum(len(u.rows) for s in pending for _, u in s.items)
    _WORKER_STATE.update(out=opts.out, source=source, splits=splits)
    bar = tqdm(total=rows, unit="row", desc=f"{source.name} p{opts.partition_index}",
               disable=None)
    if opts.workers == 1 or len(pending) <= 1:
        results = map(_run_one, pending)
        pool = None
    else:
        pool = multiprocessing.get_context("fork").Pool(opts.workers)
        results = pool.imap_unordered(_run_one, pending)
    try:
        for record in results:
            bar.update(record["rows_read"])
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
    work = opts.out / ".work"
    with open(work / "runs.jsonl", "a") as f:
        f.write(json.dumps({"partition": opts.partition_index, "rows": rows,
                            "seconds": round(time.perf_counter() - start, 3)}) + "\n")
    (work / f"partition-{opts.partition_index:03d}.done").write_text(str(len(specs)))
    done = sorted(work.glob("partition-*.done"))
    if len(done) < opts.num_partitions:
        return None
    from converters.finalize import finalize

    return finalize(opts.out, splits, workers=opts.workers)
