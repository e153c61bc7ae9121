"""The global sample stream: one order of a run's training samples, the same on every data-parallel
rank whatever their number, read by random access (metadata alone, or whole samples).

A data path (an Energon dataset folder or a metadataset YAML, checked first by
``dataset_files.check_dataset_files``) is read as its ``members`` for one split part: each
member's samples are the rows of Energon's own index (``.nv-meta/index.sqlite``) whose shards
belong to the split part, in shard order. The stream is a pure function of the members, the seed
and the number of draws:

- draw d picks a member with the probability of its blend weight (a metadataset's ``weight``; a
  nested metadataset's members share their parent's weight as their own weights split it), from
  a generator seeded by (seed, d); with ``by_tokens`` the weights are shares of trained tokens:
  each member's probability is divided by the mean planned tokens of its samples drawn so far;
- a member gives its samples in a seeded permutation per epoch (seed, member, epoch), one after
  the other, the next epoch's permutation when one is used up.

``StreamState`` is all a resume needs (draws made, samples taken of each member, their tokens):
plain JSON, the same on every rank, independent of the DP size, so a run resumes at any DP size
and continues the very sequence (``energon_tasks.planned_loader``). ``Readers`` fetch a sample's
``K.json`` alone (the index's part offsets: one small read, for planning) or the whole sample
(``ConversationSample``, checksums verified, for the rank that trains it).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from contract import bounded_yaml
from contract.errors import UsageError
from energon_tasks.dataset_files import check_dataset_files
from energon_tasks.energon_dataset import ConversationSample, conversation_sample
from energon_tasks.sample_format import CanonicalSample

_MEMBER_SALT, _DRAW_SALT = 104729, 7919  #: keep the member and draw generators apart


@dataclass(frozen=True, slots=True)
class Member:
    """One dataset of the blend: its samples (keys, index order) and its weight."""

    name: str  #: how logs name it (its subflavor ``config``, else its split part)
    folder: Path
    split_part: str
    weight: float
    subflavors: dict
    keys: tuple[str, ...]


@dataclass(slots=True)
class StreamState:
    """Where the stream is: the only data position a checkpoint needs (see the module
    docstring). ``taken[i]``: samples drawn from member i so far (its epoch is
    ``taken // len(keys)``); ``tokens[i]``: their planned tokens (the token-share blend)."""

    draws: int = 0
    taken: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def to_plain(self) -> dict:
        return {"draws": self.draws, "taken": list(self.taken), "tokens": list(self.tokens)}

    @classmethod
    def from_plain(cls, plain: dict, members: int) -> StreamState:
        """Raises ValueError: not a state of a stream of ``members`` members."""
        try:
            state = cls(int(plain["draws"]), [int(v) for v in plain["taken"]],
                        [int(v) for v in plain["tokens"]])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a data stream state ({error})") from None
        if len(state.taken) != members or len(state.tokens) != members or state.draws < 0:
            raise ValueError(f"a data stream state of {len(state.taken)} datasets, this data "
                             f"has {members}")
        return state


#: (member index, sample key)
SampleRef = tuple[int, str]


class Stream:
    """The draws of ``members`` (see the module docstring)."""

    def __init__(self, members: list[Member], seed: int, *, by_tokens: bool = False,
                 state: StreamState | None = None) -> None:
        self.members, self.seed, self.by_tokens = members, seed, by_tokens
        self.state = state or StreamState(0, [0] * len(members), [0] * len(members))
        weights = np.array([m.weight for m in members], dtype=np.float64)
        self._weights = weights / weights.sum()
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def probabilities(self) -> np.ndarray:
        """Each member's chance of the next draw."""
        if not self.by_tokens:
            return self._weights
        taken = np.array(self.state.taken, dtype=np.float64)
        tokens = np.array(self.state.tokens, dtype=np.float64)
        seen = taken > 0
        overall = tokens[seen].sum() / taken[seen].sum() if seen.any() else 1.0
        mean = np.where(seen, tokens / np.maximum(taken, 1), overall)
        share = self._weights / np.maximum(mean, 1.0)
        return share / share.sum()

    def draw(self) -> SampleRef:
        """The next sample (and the state moved past it)."""
        u = np.random.default_rng([self.seed, _DRAW_SALT, self.state.draws]).random()
        member = int(np.searchsorted(np.cumsum(self.probabilities()), u, side="right"))
        member = min(member, len(self.members) - 1)
        keys = self.members[member].keys
        taken = self.state.taken[member]
        order = self._order(member, taken // len(keys))
        self.state.draws += 1
        self.state.taken[member] += 1
        return member, keys[int(order[taken % len(keys)])]

    def observe(self, ref: SampleRef, tokens: int) -> None:
        """The planned tokens of a drawn sample (the token-share blend reads them)."""
        self.state.tokens[ref[0]] += tokens

    def _order(self, member: int, epoch: int) -> np.ndarray:
        if (member, epoch) not in self._orders:
            if len(self._orders) > 64:
                self._orders.clear()
            rng = np.random.default_rng([self.seed, _MEMBER_SALT, member, epoch])
            self._orders[(member, epoch)] = rng.permutation(len(self.members[member].keys))
        return self._orders[(member, epoch)]


# ---- the members of a data path ----------------------------------------------------------------

def members(path: str | Path, split_part: str = "train") -> list[Member]:
    """The datasets of ``path`` for ``split_part`` with their blend weights and samples.

    Raises:
        UsageError: a data path the global plan cannot read (one line: which file, why).
    """
    path = Path(path)
    check_dataset_files(path)
    found = _members(path, split_part, 1.0, {}, depth=0)
    if not found:
        raise UsageError(f"data.path {path}: split part {split_part!r} has no samples")
    return found


def _members(path: Path, split_part: str, weight: float, subflavors: dict,
             depth: int) -> list[Member]:
    if depth > 8:
        raise UsageError(f"{path}: metadatasets nested deeper than 8")
    if path.is_dir():
        keys = _split_keys(path, split_part)
        name = subflavors.get("config") or split_part
        return [Member(str(name), path, split_part, weight, subflavors, keys)] if keys else []
    raw = bounded_yaml.safe_load(path.read_text())  # plain data: check_dataset_files
    split = (raw.get("splits") or {}).get(split_part)
    if not isinstance(split, dict):
        raise UsageError(f"{path}: no split {split_part!r}")
    if "blend_epochized" in split:
        raise UsageError(f"{path}: blend_epochized (repetitions per epoch) is read by the "
                         "per-rank Energon loader only: set data.global_plan=false, or use "
                         "blend with weights")
    entries = split["blend"] if "blend" in split else [split]
    total = sum(float(e.get("weight", 1.0)) for e in entries)
    found = []
    for entry in entries:
        child = (path.parent / str(entry["path"])).resolve()
        share = weight * float(entry.get("weight", 1.0)) / total
        found += _members(child, str(entry.get("split_part", split_part)), share,
                          {**subflavors, **(entry.get("subflavors") or {})}, depth + 1)
    return found


def _split_keys(folder: Path, split_part: str) -> tuple[str, ...]:
    """The sample keys of a split part of a dataset folder, in shard and index order."""
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta

    try:
        meta = WebdatasetMeta.from_config(EPath(folder), split_part=split_part)
    except (AssertionError, FileNotFoundError) as error:
        raise UsageError(f"{folder}: no split part {split_part!r} ({error})") from None
    except Exception as error:  # Energon's own: an empty split part
        if type(error).__name__ == "EmptyDatasetError":
            return ()
        raise
    ids = {name: i for i, name in enumerate(meta.info_shard_files)}
    wanted = [ids[shard.name] for shard in meta.shards if shard.name in ids]
    index = folder / ".nv-meta" / "index.sqlite"
    if not index.is_file():
        raise UsageError(f"{folder}: no .nv-meta/index.sqlite (run `energon prepare`, or "
                         "convert again: the global plan reads samples by Energon's index)")
    with sqlite3.connect(f"file:{index}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT tar_file_id, sample_key FROM samples WHERE tar_file_id IN "
            f"({','.join('?' * len(wanted))}) ORDER BY tar_file_id, sample_index",
            wanted).fetchall()
    excluded = meta.sample_excludes
    return tuple(key for tar, key in rows
                 if f"{meta.info_shard_files[tar]}/{key}" not in excluded)


# ---- reading samples ----------------------------------------------------------------------------

class Readers:
    """Random access into the members' shards (Energon's ``SqliteITarEntryReader``), opened per
    folder on first use (per process: a DataLoader worker opens its own)."""

    def __init__(self, members: list[Member]) -> None:
        import atexit

        self.members = members
        self._parts: dict[Path, object] = {}
        self._samples: dict[Path, object] = {}
        atexit.register(self.close)  # before the interpreter's teardown (Energon's readers log)

    def close(self) -> None:
        for cache in (self._parts, self._samples):
            for reader in cache.values():
                reader.close()
            cache.clear()

    def _reader(self, cache: dict, folder: Path, whole: bool):
        if folder not in cache:
            from megatron.energon.epathlib import EPath
            from megatron.energon.flavors.webdataset.itar_reader import SqliteITarEntryReader

            cache[folder] = SqliteITarEntryReader(EPath(folder), key_is_full_entryname=not whole)
        return cache[folder]

    def conversation(self, ref: SampleRef) -> CanonicalSample:
        """The parsed ``K.json`` of a sample (its media not read).

        Raises:
            DamagedSample: a missing or unreadable ``K.json``.
        """
        from energon_tasks.energon_dataset import DamagedSample

        member = self.members[ref[0]]
        try:
            data, _source = self._reader(self._parts, member.folder, False)[f"{ref[1]}.json"]
            return CanonicalSample.from_json(data)
        except (KeyError, ValueError, TypeError, OSError) as error:
            raise DamagedSample(ref[1], "bad_sample_json", str(error)[:200]) from None

    def sample(self, ref: SampleRef) -> ConversationSample:
        """The whole sample, its media bytes checksum verified.

        Raises:
            DamagedSample: a missing member, a checksum mismatch, an unreadable tar member.
        """
        from energon_tasks.energon_dataset import DamagedSample

        member = self.members[ref[0]]
        try:
            raw = dict(self._reader(self._samples, member.folder, True)[ref[1]])
        except Exception as error:  # tar / index errors come in many types
            raise DamagedSample(ref[1], "unreadable_tar_member", str(error)[:200]) from None
        raw["__key__"] = ref[1]
        return conversation_sample(raw, member.subflavors)
