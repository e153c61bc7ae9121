"""The one shard writer: builds the units of one shard and writes them as a reproducible tar.

A shard is written to `<name>.partial-<pid>` and renamed when complete; then its accounting
(rows, rejects, fixups, per-sample statistics) is written atomically to a sidecar JSON under
`.work/`. The sidecar is the completion mark: a resumed run skips shards that have one and redoes
the rest, so a run killed at any moment finishes with the same bytes as an uninterrupted one; a
write that fails (a full disk) removes its partial file. The writer records each media member's
SHA-256 in `K.json`. A sample that breaks the format rules (a converter bug) is never written: its
rows are rejected `internal_error` with the rule it broke. Tar members have fixed order, mtime 0,
uid/gid 0 and empty owner names.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from converters.base import Built, Reject, SourceDataset, SourceSplit, Unit
from energon_tasks.sample_format import PLACEHOLDER_RE, FormatError, validate


@dataclass(slots=True, kw_only=True)
class ShardSpec:
    name: str  #: path relative to OUT, e.g. "shards/train/chartqa/p000-000003.tar"
    items: list[tuple[int, Unit]]  #: (index into the source's split list, unit)

    @property
    def sidecar(self) -> str:
        return ".work/" + self.name[: -len(".tar")] + ".json"


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """One member: header, data and padding in three writes (addfile copies in 16 KiB pieces)."""
    info = _tarinfo(name, len(data))
    header = info.tobuf(tar.format, tar.encoding, tar.errors)
    padding = -len(data) % tarfile.BLOCKSIZE
    tar.fileobj.write(header)
    tar.fileobj.write(data)
    if padding:
        tar.fileobj.write(tarfile.NUL * padding)
    tar.offset += len(header) + len(data) + padding
    tar.members.append(info)


def _check_accounting(split: SourceSplit, unit: Unit, built: Built) -> None:
    written = list(built.sample.source.rows) if built.sample else []
    rejected = [r.row for r in built.rejects]
    if sorted(written + rejected) != sorted(unit.rows):
        raise RuntimeError(f"converter bug: unit {unit.key} of {split.config}/{split.split} "
                           f"accounts rows {sorted(written + rejected)} for {sorted(unit.rows)}")


def _internal_error(split: SourceSplit, unit: Unit, exc: Exception) -> Built:
    return Built(rejects=[Reject(id=i, config=split.config, split=split.split, row=r,
                                 reason="internal_error",
                                 detail=f"{type(exc).__name__}: {exc}"[:500])
                          for r, i in zip(unit.rows, unit.ids)])


def _build_safely(source: SourceDataset, split: SourceSplit, unit: Unit) -> Built:
    """Bad data never aborts the run: an unexpected error, or a sample that breaks the format
    rules, rejects the unit with its message (counted and shown by the summary)."""
    try:
        built = source.build(split, unit)
    except Exception as exc:
        return _internal_error(split, unit, exc)
    _check_accounting(split, unit, built)
    if built.sample is not None:
        for media in built.sample.media:
            media.sha256 = hashlib.sha256(built.parts.get(media.part, b"")).hexdigest()
        try:
            validate(unit.key, built.sample, built.parts)
            built.sample_json = built.sample.to_json_bytes()
        except (FormatError, UnicodeEncodeError) as exc:
            return Built(rejects=built.rejects + _internal_error(
                split, Unit(key=unit.key, rows=list(built.sample.source.rows),
                            ids=list(built.sample.source.ids)), exc).rejects)
    return built


def _sample_stats(target: str, config: str, built: Built) -> dict:
    sample = built.sample
    text = "".join(t.content for t in sample.conversation)
    return {
        "split": target,
        "config": config,
        "images": [[m.width, m.height] for m in sample.media if m.kind == "image"],
        "videos": [[m.duration_s, m.frames, m.width, m.height, m.fps]
                   for m in sample.media if m.kind == "video"],
        "text_chars": len(PLACEHOLDER_RE.sub("", text)),
    }


def write_shard(out: Path, source: SourceDataset, splits: list[SourceSplit],
                spec: ShardSpec) -> dict:
    """Build and write one shard, then its sidecar. Returns the sidecar's content."""
    start = time.perf_counter()
    path = out / spec.name
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    target = spec.name.split("/")[1]
    rejects: list[dict] = []
    fixups: Counter = Counter()
    stats: list[dict] = []
    rows_read = rows_written = samples = bytes_out = ids_from_row = 0
    try:
        tar = tarfile.open(partial, "w", format=tarfile.GNU_FORMAT)
    except OSError:
        partial.unlink(missing_ok=True)
        raise
    with _removed_on_error(partial), tar:
        for split_index, unit in spec.items:
            split = splits[split_index]
            built = _build_safely(source, split, unit)
            rows_read += len(unit.rows)
            ids_from_row += unit.ids_from_row
            rejects.extend(r.to_dict() for r in built.rejects)
            if built.sample is None:
                continue
            sample_json = built.sample_json
            _add(tar, f"{unit.key}.json", sample_json)
            for media in built.sample.media:
                _add(tar, f"{unit.key}.{media.part}", built.parts[media.part])
            rows_written += len(built.sample.source.rows)
            samples += 1
            bytes_out += len(sample_json) + sum(len(b) for b in built.parts.values())
            fixups.update(built.sample.fixups)
            stats.append(_sample_stats(target, split.config, built))
    if samples:
        os.replace(partial, path)
    else:
        partial.unlink()
        path.unlink(missing_ok=True)
    record = {
        "shard": spec.name if samples else None,
        "target": target,
        "rows_read": rows_read,
        "rows_written": rows_written,
        "ids_from_row": ids_from_row,
        "samples_written": samples,
        "rejects": rejects,
        "fixups": dict(sorted(fixups.items())),
        "bytes_out": bytes_out,
        "seconds": round(time.perf_counter() - start, 4),
        "stats": stats,
    }
    write_json_atomic(out / spec.sidecar, record)
    return record


@contextmanager
def _removed_on_error(path: Path):
    try:
        yield
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file so that readers (and a rerun after a kill) see it whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, doc: dict) -> None:
    write_atomic(path, json.dumps(doc, sort_keys=True).encode())


def shard_done(out: Path, spec: ShardSpec) -> bool:
    """A shard is complete when its sidecar exists (and its tar, when it holds samples)."""
    sidecar = out / spec.sidecar
    if not sidecar.is_file():
        return False
    record = json.loads(sidecar.read_text())
    return record["shard"] is None or (out / spec.name).is_file()
