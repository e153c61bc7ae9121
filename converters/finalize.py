"""The final step of a conversion: accounting, statistics, Energon index and blend, over all shards.

Reads every shard sidecar under `OUT/.work/`, checks that every source row ended in exactly one
place, writes `summary.json`, `rejects.jsonl`, `stats.json` (+ PNGs), runs `energon prepare`
(CrudeWebdataset, train/val/test split parts plus one split part per source config) and writes
the MetadatasetV2 blend `metadataset.yaml` weighted by sample counts. Idempotent; guarded by a
lock so that concurrent partitions finalize once.
"""

from __future__ import annotations

import fcntl
import json
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import yaml

from converters.base import UsageError, config_folder
from converters.stats import write_stats

SPLITS = ("train", "val", "test")

#: Energon 7.4's `info` and `lint` cannot read a CrudeWebdataset config (info wants a
#: `sample_type`, lint a cooker), so they get this typed view of the same shards.
INSPECT_CONFIG = "inspect.yaml"
_INSPECT_VIEW = {"sample_type": {"__module__": "megatron.energon", "__class__": "TextSample"},
                 "field_map": {"text": "json"}}


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
    runs = [json.loads(line) for line in (out / ".work" / "runs.jsonl").read_text().splitlines()]
    seconds = sum(r["seconds"] for r in runs)
    bytes_out = sum(r["bytes_out"] for r in records)
    return {
        "dataset": options["dataset"],
        "source_rows": source_rows,
        "rows_read": rows_read,
        "rows_written": rows_written,
        "samples_written": sum(r["samples_written"] for r in records),
        "rejected": rejected,
        "rejected_by_reason": dict(sorted(reasons.items())),
        "fixups_by_kind": dict(sorted(fixups.items())),
        "samples_by_split": {s: by_split[s] for s in SPLITS if by_split[s]},
        "by_config": {c: dict(sorted(v.items())) for c, v in sorted(by_config.items())},
        "shards": sum(1 for r in records if r["shard"]),
        "conversion": {
            "seconds": round(seconds, 3),
            "rows_per_s": round(rows_read / seconds, 2) if seconds else None,
            "mb_per_s": round(bytes_out / 1e6 / seconds, 2) if seconds else None,
            "bytes_written": bytes_out,
        },
    }


def _prepare(out: Path, records: list[dict], workers: int, media_metadata: bool) -> list[str]:
    """Run `energon prepare`; returns the Energon split parts that hold samples."""
    shards = [r["shard"] for r in records if r["shard"]]
    parts: dict[str, str] = {}
    for split in SPLITS:
        if any(s.split("/")[1] == split for s in shards):
            parts[split] = f"shards/{split}/.*"
    for shard in shards:
        _, split, folder, _ = shard.split("/")
        parts[f"{split}/{folder}"] = f"shards/{split}/{re.escape(folder)}/.*"
    cmd = _energon() + ["prepare", str(out), "--non-interactive", "--force-overwrite",
                        "--no-progress", "--num-workers", str(max(1, workers)),
                        "--sample-type", "CrudeWebdataset"]
    if media_metadata:
        cmd.append("--media-metadata-by-extension")
    for name, pattern in parts.items():
        cmd += ["--split-parts", f"{name}:{pattern}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"energon prepare failed: {proc.stderr.strip()[-2000:]}")
    header = ("# Typed view for `energon info/lint --dataset-config inspect.yaml` (Energon 7.4's\n"
              "# tools cannot read the CrudeWebdataset dataset.yaml). Train with dataset.yaml.\n")
    (out / ".nv-meta" / INSPECT_CONFIG).write_text(header + yaml.safe_dump(_INSPECT_VIEW))
    return list(parts)


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
    header = ("# Blend of the source configs, weighted by sample count. Edit the weights to\n"
              "# re-weight subsets; train with this file as the data path.\n")
    (out / "metadataset.yaml").write_text(header + yaml.safe_dump(doc, sort_keys=False))


def finalize(out: Path, splits=None, *, workers: int = 1) -> dict | None:
    """Index the union of all partitions' shards. Returns the summary (None if locked)."""
    work = out / ".work"
    options_path = work / "options.json"
    if not options_path.is_file():
        raise UsageError(f"--out {out}: no conversion found to finalize")
    options = json.loads(options_path.read_text())
    done = len(list(work.glob("partition-*.done")))
    if done < options["num_partitions"]:
        raise UsageError(f"--out {out}: only {done} of {options['num_partitions']} "
                         "partitions are done")
    with open(work / "finalize.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        records = _read_sidecars(out)
        summary = _summarize(out, records, options)
        if not (summary["rows_read"] == summary["source_rows"]
                == summary["rows_written"] + summary["rejected"]):
            raise RuntimeError(f"accounting broken: {summary['source_rows']} source rows, "
                               f"{summary['rows_read']} read, {summary['rows_written']} written, "
                               f"{summary['rejected']} rejected")
        rejects = sorted((r for rec in records for r in rec["rejects"]),
                         key=lambda r: (r["config"], r["split"], r["row"]))
        with open(out / "rejects.jsonl", "w") as f:
            for rej in rejects:
                f.write(json.dumps(rej, sort_keys=True) + "\n")
        summary["stats"] = write_stats(out, [s for rec in records for s in rec["stats"]],
                                       summary["conversion"])
        split_parts = (_prepare(out, records, workers, options["energon_media_metadata"])
                       if summary["shards"] else [])
        summary["energon_split_parts"] = split_parts
        if split_parts:
            _write_metadataset(out, records, split_parts)
        (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
        shutil.rmtree(work / "datasets_cache", ignore_errors=True)  # a local source's table copy
        return summary
