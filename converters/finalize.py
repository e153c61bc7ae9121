"""The final step of a conversion: accounting, statistics, Energon index and blend, over all shards.

Reads every shard sidecar under `OUT/.work/`, checks that every source row ended in exactly one
place, writes `rejects.jsonl`, `stats.json` (+ PNG), runs `energon prepare` (train/val/test split
parts plus one per source config) with our typed `dataset.yaml`
(`energon_tasks.sample_format.DATASET_YAML`), writes the MetadatasetV2 blend `metadataset.yaml`
weighted by sample counts (read back as the loader reads it: `energon_tasks.dataset_files`),
then `summary.json`, and last the marker `.work/finalized.json`.

Exactly once and kill-safe: it runs under the `finalize` lock (a partition that finds it held by a
live run leaves the work to that run), skips work a marker says is done for the same shards, writes
each file atomically, and rebuilds `.nv-meta/` and the `.tar.idx` files from scratch, so a kill at
any moment (energon prepare included) is repaired by running the same command again. A conversion
that wrote no sample raises `NoSamples` after writing its accounting (no Energon index is built).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import yaml

from contract.console import phase
from contract.errors import RunFailure
from converters.base import UsageError, config_folder
from converters.lock import LockedError, RunLock
from converters.stats import write_stats
from converters.writer import write_atomic, write_json_atomic
from energon_tasks.dataset_files import check_dataset_files
from energon_tasks.sample_format import DATASET_YAML

SPLITS = ("train", "val", "test")
MARKER = "finalized.json"


class NoSamples(RunFailure):
    """Every row was rejected: nothing to train on (the message gives the reasons); exit 1."""


def _energon() -> list[str]:
    exe = Path(sys.executable).with_name("energon")
    return [str(exe)] if exe.exists() else [shutil.which("energon") or "energon"]


def _read_sidecars(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / ".work" / "shards").rglob("*.json"))]


def _summarize(out: Path, records: list[dict], options: dict) -> dict:
    by_config: dict[str, Counter] = defaultdict(Counter)
    by_split: Counter = Counter()
    reasons: Counter = Counter()
    fixups: Counter = Counter()
    for rec in records:
        for stat in rec["stats"]:
            by_config[stat["config"]]["samples_written"] += 1
        by_split[rec["target"]] += rec["samples_written"]
        for rej in rec["rejects"]:
            reasons[rej["reason"]] += 1
            by_config[rej["config"]]["rejected"] += 1
        fixups.update(rec["fixups"])
    for config, _split, num_rows in options["splits"]:
        by_config[config]["rows_read"] += num_rows
    rows_read = sum(r["rows_read"] for r in records)
    rows_written = sum(r["rows_written"] for r in records)
    rejected = sum(len(r["rejects"]) for r in records)
    source_rows = sum(n for _, _, n in options["splits"])
    for counts in by_config.values():
        counts["rows_written"] = counts["rows_read"] - counts["rejected"]
    runs_file = out / ".work" / "runs.jsonl"
    runs = [json.loads(line) for line in runs_file.read_text().splitlines() if line.strip()] \
        if runs_file.is_file() else []
    seconds = sum(r["seconds"] for r in runs)
    bytes_out = sum(r["bytes_out"] for r in records)
    return {
        "dataset": options["dataset"],
        "source": options["source"].get("location"),
        "revision": options["source"].get("revision"),  #: the hub commit read (None: a folder)
        "source_rows": source_rows,
        "rows_read": rows_read,
        "rows_written": rows_written,
        "samples_written": sum(r["samples_written"] for r in records),
        "rejected": rejected,
        "rejected_by_reason": dict(sorted(reasons.items())),
        #: rows whose null / empty source id was made from the row position (converters.base)
        "ids_from_row": sum(r.get("ids_from_row", 0) for r in records),
        "fixups_by_kind": dict(sorted(fixups.items())),
        "samples_by_split": {s: by_split[s] for s in SPLITS if by_split[s]},
        "by_config": {c: dict(sorted(v.items())) for c, v in sorted(by_config.items())},
        "skipped_configs": options.get("skipped_configs", {}),
        "shards": sum(1 for r in records if r["shard"]),
        "conversion": {
            "seconds": round(seconds, 3),
            "rows_per_s": round(rows_read / seconds, 2) if seconds else None,
            "mb_per_s": round(bytes_out / 1e6 / seconds, 2) if seconds else None,
            "bytes_written": bytes_out,
        },
    }


def _split_parts(records: list[dict]) -> dict[str, str]:
    """Energon split part -> shard regex: every split (empty or not: Energon's lint and preview
    default to train,val,test) and `<split>/<config folder>` for each config with shards."""
    parts = {split: f"shards/{split}/.*" for split in SPLITS}
    for shard in sorted(r["shard"] for r in records if r["shard"]):
        _, split, folder, _ = shard.split("/")
        parts[f"{split}/{folder}"] = f"shards/{split}/{re.escape(folder)}/.*"
    return parts


#: what a failed `energon prepare` says when its writes failed for lack of space (its sqlite
#: index says "database or disk is full" on a full disk, "disk I/O error" at a file-size limit)
_NO_SPACE = ("No space left on device", "Disk quota exceeded", "File too large",
             "database or disk is full", "disk I/O error")


def _clear_index(out: Path) -> None:
    """Remove Energon's index (`.nv-meta/`, the `.tar.idx` files): a killed or failed prepare's
    leftovers."""
    shutil.rmtree(out / ".nv-meta", ignore_errors=True)
    for index in (out / "shards").rglob("*.tar.idx"):
        index.unlink()


def _prepare(out: Path, parts: dict[str, str], workers: int, media_metadata: bool) -> None:
    """`energon prepare` from scratch (an earlier, killed one may have left any state), then our
    dataset.yaml.

    Raises:
        RunFailure: prepare's writes failed for lack of space (its half-written index removed).
    """
    _clear_index(out)
    cmd = _energon() + ["prepare", str(out), "--non-interactive", "--force-overwrite",
                        "--no-progress", "--num-workers", str(max(1, workers)),
                        "--skip-dataset-yaml"]
    if media_metadata:
        cmd.append("--media-metadata-by-extension")
    for name, pattern in parts.items():
        cmd += ["--split-parts", f"{name}:{pattern}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 and any(mark in proc.stderr for mark in _NO_SPACE):
        _clear_index(out)
        last = proc.stderr.strip().splitlines()[-1].strip()
        free = shutil.disk_usage(out).free / 2**30
        raise RunFailure(f"energon prepare could not write the index of {out} ({last[-200:]}; "
                         f"{free:.1f} GiB free there): free space and run `python -m converters "
                         f"finalize --out {out}` again")
    if proc.returncode != 0:
        raise RuntimeError(f"energon prepare failed: {proc.stderr.strip()[-2000:]}")
    header = ("# Conversation samples (docs/format.md), loaded by vlm-sft's installed package:\n"
              "# read by its task encoders and by `energon info / lint / preview` alike.\n")
    write_atomic(out / ".nv-meta" / "dataset.yaml",
                 (header + yaml.safe_dump(DATASET_YAML, sort_keys=False)).encode())


def _write_metadataset(out: Path, records: list[dict], split_parts: list[str]) -> None:
    """A MetadatasetV2 blend of the source configs, weighted by their sample counts."""
    counts: Counter = Counter()
    for rec in records:
        for stat in rec["stats"]:
            counts[(stat["split"], stat["config"])] += 1
    splits = {}
    for split in SPLITS:
        blend = []
        for part in split_parts:
            if not part.startswith(split + "/"):
                continue
            folder = part.split("/", 1)[1]
            config = next(c for (s, c) in counts if s == split and config_folder(c) == folder)
            blend.append({"weight": counts[(split, config)], "path": ".",
                          "split_part": part, "subflavors": {"config": config}})
        if blend:
            splits[split] = {"blend": blend}
    doc = {"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": splits}
    header = ("# Blend of the source configs, weighted by sample count. Edit a weight (a positive\n"
              "# number; 0 is refused) to re-weight its subset, or delete an entry to leave its\n"
              "# subset out; train with this file as the data path.\n")
    write_atomic(out / "metadataset.yaml",
                 (header + yaml.safe_dump(doc, sort_keys=False)).encode())


def _shards_digest(records: list[dict]) -> str:
    """Identifies the set of shard records a finalize covered."""
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()


def _no_samples_message(out: Path, summary: dict) -> str:
    top = ", ".join(f"{k}={v}" for k, v in sorted(summary["rejected_by_reason"].items(),
                                                   key=lambda kv: -kv[1])[:4])
    return (f"no sample written: all {summary['rejected']} rows were rejected ({top or 'none'}); "
            f"see {out}/rejects.jsonl")


def finalize(out: Path, *, workers: int = 1) -> dict | None:
    """Index the union of all partitions' shards, once.

    Returns:
        The summary, or None when another partition holds the finalize lock (it finalizes).

    Raises:
        UsageError: no conversion in `out`, or partitions still missing.
        NoSamples: every row was rejected.
    """
    work = out / ".work"
    options_path = work / "options.json"
    if not options_path.is_file():
        raise UsageError(f"--out {out}: no conversion found to finalize")
    options = json.loads(options_path.read_text())
    done = len(list(work.glob("partition-*.done")))
    if done < options["num_partitions"]:
        raise UsageError(f"--out {out}: only {done} of {options['num_partitions']} "
                         "partitions are done")
    try:
        lock = RunLock(work / "finalize.lock", f"finalizing --out {out}", notify=phase)
        lock.acquire()
    except LockedError:
        phase(f"another run is finalizing the dataset at {out} (it writes summary.json)")
        return None
    try:
        return _finalize_locked(out, options, workers)
    finally:
        lock.release()


def _finalize_locked(out: Path, options: dict, workers: int) -> dict:
    work = out / ".work"
    records = _read_sidecars(out)
    digest = _shards_digest(records)
    marker = work / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("shards") == digest \
            and (out / "summary.json").is_file():
        phase("already finalized")
        return json.loads((out / "summary.json").read_text())
    phase(f"finalizing: accounting of {len(records)} shards")
    summary = _summarize(out, records, options)
    if not (summary["rows_read"] == summary["source_rows"]
            == summary["rows_written"] + summary["rejected"]):
        raise RuntimeError(f"accounting broken: {summary['source_rows']} source rows, "
                           f"{summary['rows_read']} read, {summary['rows_written']} written, "
                           f"{summary['rejected']} rejected")
    rejects = sorted((r for rec in records for r in rec["rejects"]),
                     key=lambda r: (r["config"], r["split"], r["row"]))
    write_atomic(out / "rejects.jsonl",
                 "".join(json.dumps(r, sort_keys=True) + "\n" for r in rejects).encode())
    if not summary["samples_written"]:
        write_json_atomic(out / "summary.json", summary)
        raise NoSamples(_no_samples_message(out, summary))
    phase("finalizing: statistics")
    summary["stats"] = write_stats(out, [s for rec in records for s in rec["stats"]],
                                   summary["conversion"], summary["dataset"])
    parts = _split_parts(records)
    phase(f"finalizing: energon prepare ({summary['shards']} shards)")
    _prepare(out, parts, workers, options["energon_media_metadata"])
    held = {s for r in records if r["shard"] for s in
            (r["shard"].split("/")[1], "/".join(r["shard"].split("/")[1:3]))}
    summary["energon_split_parts"] = [name for name in parts if name in held]
    _write_metadataset(out, records, summary["energon_split_parts"])
    check_dataset_files(out / "metadataset.yaml")  # what the loader accepts: its own output
    write_atomic(out / "summary.json", json.dumps(summary, indent=1, sort_keys=True).encode())
    write_json_atomic(marker, {"shards": digest})
    shutil.rmtree(work / "datasets_cache", ignore_errors=True)  # a local source's table copy
    return summary
