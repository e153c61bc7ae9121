"""The contract between a dataset converter and the shared pipeline.

A converter module (mantis.py, infovqa.py, llava_video.py) implements `SourceDataset`: it lists
the source splits, groups their rows into units (one unit = one output sample), and builds each
unit into a canonical sample or rejects its rows with reasons. Everything else (partitions,
workers, shards, resume, accounting, energon prepare) is the pipeline's job.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Literal, Protocol

from contract.errors import UsageError
from energon_tasks.sample_format import CanonicalSample, sample_key

Target = Literal["train", "val", "test", "carve"]

#: How source split names map to Energon splits ("carve": train, with val carved out per sample).
_VAL_NAMES = {"val", "validation", "valid", "dev"}


def target_of(split: str, config_has_val: bool) -> Target:
    """The Energon split a source split feeds."""
    if split in _VAL_NAMES:
        return "val"
    if split == "test":
        return "test"
    return "train" if config_has_val else "carve"


def config_folder(config: str) -> str:
    """The shard folder (and Energon split-part suffix) of a source config: the name itself when
    it is a plain folder name, else its sanitised form plus 8 hex digits of its SHA-1, so that
    names like `.`, `..`, `a b` and `a_b` never escape the split folder or share one."""
    plain = "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "_" for c in config)
    if plain == config and plain:
        return plain
    digest = hashlib.sha1(config.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{plain[:64]}-{digest}"


def check_config_folders(configs: list[str]) -> None:
    """Raises UsageError when two configs would share a shard folder."""
    seen: dict[str, str] = {}
    for config in configs:
        folder = config_folder(config)
        if seen.setdefault(folder, config) != config:
            raise UsageError(f"configs {seen[folder]!r} and {config!r} map to one shard folder "
                             f"{folder!r}; convert them in separate runs (--configs)")


@dataclass(slots=True, kw_only=True, frozen=True)
class SourceSplit:
    config: str
    split: str  #: as the source names it
    target: Target
    num_rows: int


@dataclass(slots=True, kw_only=True)
class Unit:
    key: str  #: the output sample key
    rows: list[int]  #: source row indices (InfoVQA groups several questions of one image)
    ids: list[str]  #: source ids of those rows
    ids_from_row: int = 0  #: how many of `ids` were made from the row position (`row_id`)


#: Nesting (objects and arrays) a source record may have; deeper records are `bad_record`
#: rejects (Python's JSON and repr recurse, so a deeper one would be a RecursionError).
MAX_RECORD_DEPTH = 64


def nesting_depth(value, cap: int = MAX_RECORD_DEPTH) -> int:
    """Depth of nested dicts / lists / tuples (a scalar is 0), counted without recursion and
    stopping once it exceeds `cap` (then `cap + 1`)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, (list, tuple)):
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > cap:
            return deepest
        stack.extend((child, depth) for child in item)
    return deepest


def depth_problem(record) -> str | None:
    """Why a record is too deeply nested to be data, or None."""
    if nesting_depth(record) > MAX_RECORD_DEPTH:
        return f"the record is nested deeper than {MAX_RECORD_DEPTH} levels"
    return None


def row_id(value, row: int, content) -> tuple[str, bool]:
    """The source id of a row as text, and whether it was made from the row position.

    A null or empty id becomes `row<N>-<8 hex digits of the SHA-1 of the row's content>`: stable
    across runs, distinct per row, never `None` (`content` is the row, or anything that stands
    for it; it is serialised as JSON, non-JSON values by their repr)."""
    text = "" if value is None else str(value)
    if text.strip():
        return text, False
    try:
        blob = json.dumps(content, sort_keys=True, default=repr).encode("utf-8", "surrogatepass")
    except (RecursionError, ValueError, TypeError):
        blob = repr(type(content)).encode()
    return f"row{row}-{hashlib.sha1(blob).hexdigest()[:8]}", True


def row_units(dataset: str, split: SourceSplit, ids: list, content_of) -> list[Unit]:
    """One unit per row, keyed by its source id (`row_id` for null / empty ones; `content_of(row)`
    gives what stands for the row, read only for those)."""
    units = []
    for row, value in enumerate(ids):
        text, made = row_id(value, row, content_of(row) if value in (None, "") or not str(
            value).strip() else None)
        units.append(Unit(key=sample_key(dataset, split.config, split.split, row, text),
                          rows=[row], ids=[text], ids_from_row=int(made)))
    return units


@dataclass(slots=True, kw_only=True)
class Reject:
    id: str
    config: str
    split: str
    row: int
    reason: str
    detail: str

    def to_dict(self) -> dict:
        return {"id": self.id, "config": self.config, "split": self.split, "row": self.row,
                "reason": self.reason, "detail": self.detail}


@dataclass(slots=True, kw_only=True)
class Built:
    """What building one unit gave: a sample (possibly of a subset of its rows) and rejects."""

    sample: CanonicalSample | None = None
    parts: dict[str, bytes] = field(default_factory=dict)  #: media part name -> bytes
    rejects: list[Reject] = field(default_factory=list)
    sample_json: bytes = b""  #: K.json as written (set by the writer once the sample is valid)


class SourceDataset(Protocol):
    """One source dataset, opened with its options. Must survive `fork` into worker processes."""

    name: str  #: "mantis" | "infovqa" | "llava-video"

    def splits(self) -> list[SourceSplit]:
        """The (config, split) pairs to convert, in a fixed order."""

    def units(self, split: SourceSplit) -> list[Unit]:
        """Every row of the split in exactly one unit, in a deterministic order."""

    def build(self, split: SourceSplit, unit: Unit) -> Built:
        """Turn one unit into a sample; bad rows become rejects (never raise for bad data)."""

    def fingerprint(self) -> dict:
        """Options that change the output (a resumed run must use the same)."""

    # optional: `skipped() -> {config: {"rows": int, "why": str}}`, configs left out on purpose


def reject_all(split: SourceSplit, unit: Unit, reason: str, detail: str) -> Built:
    """Every row of the unit rejected for the same reason."""
    return Built(rejects=[Reject(id=i, config=split.config, split=split.split, row=r,
                                 reason=reason, detail=detail)
                          for r, i in zip(unit.rows, unit.ids)])
