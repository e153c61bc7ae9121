"""The Energon dataset type of our shards: what `.nv-meta/dataset.yaml` names.

This module owns how Energon (its loaders and its own CLI: `energon info / lint / preview`) reads a
converted dataset:

- `ConversationSample`: the typed sample, the parsed `K.json` (`CanonicalSample`) and the stored
  bytes of every media member, verified against the SHA-256 recorded in `K.json`; nothing is decoded
  here (the task encoders decode each medium once, at its planned size).
- `ConversationWebdataset`: the dataset factory `dataset.yaml` names
  (`energon_tasks.sample_format.DATASET_YAML`). It is a
  `StandardWebdatasetFactory` with our own sample loader: parts stay raw bytes whatever decoder a
  caller passes, a sample whose member is missing or whose bytes do not match their checksum raises
  `DamagedSample`, and a tar member or header that cannot be read becomes a `DamagedSample` of that
  position instead of stopping the loader.
- The skip log: `skip_handler` (the loaders' error handler) records each damaged sample with its
  key and reason and counts it (a failed allocation is no skip: `LoaderOutOfMemory` ends the run
  in one line); `drain_skips()` hands the counts to the task encoder's batch
  counters (`skipped_<reason>`). Under train.py a key is appended once per process (epochs
  repeat samples) to the file `$VLM_SKIP_LOG` names (`<out>/skipped_samples.jsonl`, written by
  the first rank of each DP replica, empty on the others, inherited by loader workers); the
  other tools (inspect, preview, eval) log one line per skip.

Why a factory class rather than CrudeWebdataset + cooker, a `field_map` or a `sample_loader.py`:
`energon info` needs a `sample_type`, `lint` / `preview` need samples without a task encoder, a
`field_map` cannot name a variable number of media members, and a `sample_loader.py` in `.nv-meta`
would execute code shipped with the data. A class imported from this installed package is typed,
carries no code in the dataset folder, and is the same for Energon's tools and our loaders.
"""

# No `from __future__ import annotations`: Energon's config parser reads the factory's
# signature annotations as types (`sample_type` must be a real `type[...]`).
import hashlib
import json
import logging
import os
from collections import Counter
from typing import Any

from megatron.energon import Sample, StandardWebdatasetFactory, edataclass
from megatron.energon.errors import log_exception

from contract.errors import RunFailure, UsageError
from energon_tasks.sample_format import CanonicalSample

log = logging.getLogger("energon_tasks.skips")

class DamagedSample(ValueError):
    """A stored sample cannot be used as written: `reason` is counted, the key logged."""

    def __init__(self, key: str, reason: str, detail: str) -> None:
        super().__init__(f"sample {key}: {reason}: {detail}")
        self.key, self.reason, self.detail = key, reason, detail


class MediaBytes(dict):
    """Part name -> stored bytes; shown by size (`energon preview` prints samples with repr)."""

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k!r}: <{len(v)} bytes>" for k, v in self.items()) + "}"


@edataclass
class ConversationSample(Sample):
    """A loaded sample: the conversation and its media, not decoded yet."""

    conversation: CanonicalSample  #: the parsed K.json (metadata of every media item)
    media_bytes: dict  #: part name (e.g. "img0.jpg") -> stored bytes, checksum verified


def _as_bytes(value: Any) -> bytes | None:
    return bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else None


def conversation_fields(key: str, parts: dict) -> tuple[CanonicalSample, MediaBytes]:
    """The parsed K.json and the verified media bytes of one sample's tar members.

    Raises:
        DamagedSample: no or unreadable K.json (`bad_sample_json`), a listed member missing
            (`missing_member`) or bytes that do not match the recorded SHA-256
            (`checksum_mismatch`).
    """
    data = parts.get("json")
    try:
        parsed = CanonicalSample.from_json(data if isinstance(data, (bytes, str, dict)) else b"")
    except (KeyError, ValueError, TypeError) as error:
        raise DamagedSample(key, "bad_sample_json", str(error)[:200]) from None
    media = MediaBytes()
    for item in parsed.media:
        blob = _as_bytes(parts.get(item.part))
        if blob is None:
            raise DamagedSample(key, "missing_member", item.part)
        if item.sha256 is not None and hashlib.sha256(blob).hexdigest() != item.sha256:
            raise DamagedSample(key, "checksum_mismatch", item.part)
        media[item.part] = blob
    return parsed, media


def _config_subflavor(parsed: CanonicalSample, subflavors: dict | None) -> dict:
    return {"config": parsed.source.config, **(subflavors or {})}


def conversation_sample(raw: dict, subflavors: dict | None = None) -> ConversationSample:
    """`ConversationSample` from a raw webdataset dict (`__key__`, ..., part -> bytes)."""
    key = raw["__key__"]
    parsed, media = conversation_fields(key, raw)
    return ConversationSample(
        __key__=key,
        __restore_key__=raw.get("__restore_key__", ()),
        __subflavors__=_config_subflavor(parsed, subflavors or raw.get("__subflavors__")),
        __sources__=raw.get("__sources__", ()),
        conversation=parsed,
        media_bytes=media,
    )


class _DamageTolerantReader:
    """Wraps Energon's tar reader: a sample that cannot be read from its shard (a corrupt tar
    header, a truncated member) is returned as a marker the sample loader turns into
    `DamagedSample`, so that one bad region of a shard skips one sample, not the run."""

    def __init__(self, reader) -> None:
        self._reader = reader

    def __getitem__(self, index):
        try:
            return self._reader[index]
        except Exception as error:  # tarfile / index errors come in many types
            return {"__key__": self._where(index), "__damaged__": str(error)[:200],
                    "__restore_key__": ("Webdataset", index), "__sources__": ()}

    def _where(self, index) -> str:
        """`<shard>@<byte offset>` of a sample whose key cannot be read."""
        try:
            pointer = self._reader._get_itar_sample_pointer(index)
            return f"{self._reader.tar_filenames[pointer.tar_file_id]}@{pointer.byte_offset}"
        except Exception:  # energon internals differ between versions: the index is enough
            return f"sample #{index}"

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def __len__(self) -> int:
        return len(self._reader)


class ConversationWebdataset(StandardWebdatasetFactory[ConversationSample]):
    """The dataset factory of converted datasets (see the module docstring)."""

    def __init__(self, path, *, sample_type: type[ConversationSample] = ConversationSample,
                 decoder: Any = None, **kwargs):
        if sample_type is not ConversationSample:
            raise ValueError(f"{path}: ConversationWebdataset loads ConversationSample, "
                             f"not {sample_type.__name__}")
        kwargs.pop("field_map", None)
        kwargs.pop("sample_loader", None)
        kwargs.pop("part_filter", None)
        super().__init__(path, sample_type=ConversationSample, decoder=None,
                         sample_loader=_unused_sample_loader, part_filter=_every_part, **kwargs)

    def load_sample(self, sample) -> ConversationSample:
        if "__damaged__" in sample:
            raise DamagedSample(sample["__key__"], "unreadable_tar_member", sample["__damaged__"])
        return conversation_sample(sample, self.subflavors)

    def build(self, worker_rotation_offset: int = 0):
        dataset = super().build(worker_rotation_offset)
        loader = getattr(dataset, "dataset", None)  # MapDataset over the sample loader
        readers = getattr(loader, "join_readers", None)
        if readers is not None:
            loader.join_readers = [_DamageTolerantReader(r) for r in readers]
        return dataset


def _every_part(part: str) -> bool:
    return True


def _unused_sample_loader(sample: dict) -> dict:  # load_sample is overridden
    return sample


# ---- the skip log ----------------------------------------------------------------------------

_SKIPS: Counter = Counter()
_RECORDED: set[str] = set()
#: the file the skipped samples' keys are appended to (unset: logged; empty: not recorded here)
SKIP_LOG_ENV = "VLM_SKIP_LOG"


def record_skip(key: str, reason: str, detail: str = "", *, count: bool = True) -> None:
    """Record one skipped sample (its key and reason: see the module docstring); `count`: also
    count it for the batch counters (the task encoder counts its own budget skips itself)."""
    if count:
        _SKIPS[f"skipped_{reason}"] += 1
    path = os.environ.get(SKIP_LOG_ENV)
    if path is None:
        log.warning("skipped sample %s: %s%s", key, reason, f" ({detail})" if detail else "")
    elif path and key not in _RECORDED:
        _RECORDED.add(key)
        line = json.dumps({"key": key, "reason": reason, "detail": detail}) + "\n"
        with open(path, "a", encoding="utf-8") as file:  # one short line: one append
            file.write(line)


def drain_skips() -> dict[str, int]:
    """Counts recorded in this process since the previous call."""
    counts = dict(_SKIPS)
    _SKIPS.clear()
    return counts


def worker_line(message: str) -> str:
    """The one line of an error raised in a DataLoader worker: torch rebuilds the exception in
    the main process from the worker's traceback text (``"Caught X in DataLoader worker ..."``),
    whose last line is ``X: <the line>``."""
    if message.startswith("Caught "):
        last = message.strip().splitlines()[-1]
        return last.split(": ", 1)[-1]
    return message


class LoaderOutOfMemory(RunFailure):
    """A batch (or a sample) the data loader could not allocate memory for: the run stops in one
    line naming the settings that size it (never a sample skip: the data is not at fault)."""

    def __init__(self, message: str):
        super().__init__(worker_line(message))


def allocation_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed memory allocation (Python's, or torch's CPU / GPU
    allocator's)."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text
                                                or "out of memory" in text)


def skip_handler(error: Exception, sample: Any, sources=None) -> None:
    """Energon error handler of our loaders: damaged samples are one counted line; a failed
    allocation ends the run in one line (``LoaderOutOfMemory``: it is no sample's fault, and
    counting it as a skip would blame the budget); anything else keeps Energon's own report (a
    traceback: it is a bug, not bad data)."""
    if isinstance(error, UsageError):  # e.g. task_encoder.max_skips_in_a_row: the run ends
        raise error
    if allocation_failure(error):
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise LoaderOutOfMemory(f"the data loader could not allocate memory ({first}): lower "
                                "train.micro_batch_size or task_encoder.seq_length (the rows of "
                                "a batch: fixed_length and packing pad every row to "
                                "seq_length)") from None
    if isinstance(error, DamagedSample):
        record_skip(error.key, error.reason, error.detail)
    else:
        log_exception(error, sample, sources)
