"""lmms-lab/LLaVA-Video-178K (video instruction data) -> canonical samples.

Annotations come from `load_dataset(source, config, split=...)` (splits caption, open_ended,
multi_choice); when a file's column types disagree (e.g. int and str ids) the `json` builder
fails and the file is read with the `json` module instead. Videos come from the
`<config>/<config>_videos_<k>.tar.gz` parts (indexed in one streaming pass, then read with random
access; `./` prefixes normalised, unsafe names ignored) or, without parts, from an
already-extracted config folder. Every video is probed with PyAV (duration, frames, fps, size,
codec) decoding at most one frame; missing, unreadable and zero-frame videos reject their rows.
The source's `<image>` placeholder means the video: it is written as `<video>`.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

import datasets

from converters.archives import FolderMembers, TarGzMembers
from converters.base import Built, SourceSplit, Unit, UsageError, reject_all
from converters.hub import Source, open_data_file, open_splits, resolve_configs
from converters.media import (
    Limits,
    MediaError,
    fetch_media,
    probe_video,
    video_fixups,
    video_media,
)
from energon_tasks.sample_format import (
    IMAGE_PLACEHOLDER,
    VIDEO_EXTENSIONS,
    VIDEO_PLACEHOLDER,
    CanonicalSample,
    SourceRef,
    Turn,
    sample_key,
)

HUB_ID = "lmms-lab/LLaVA-Video-178K"
DATASET = "llava-video"
_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def _valid_text(text: str) -> bool:
    """False for text holding lone surrogates (JSON `\\ud800` escapes): not writable as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_conversations(messages) -> tuple[list[Turn], list[str]] | str:
    """Turns with `<image>` rewritten as `<video>` and the fixups made, or why it is malformed."""
    if not isinstance(messages, list) or not messages:
        return "conversations is empty or not a list"
    turns = []
    for message in messages:
        role = _ROLES.get(message.get("from")) if isinstance(message, dict) else None
        value = message.get("value") if isinstance(message, dict) else None
        if role is None or not isinstance(value, str):
            return f"bad message {str(message)[:80]!r}"
        turns.append(Turn(role=role, content=value))
    placeholders = sum(t.content.count(IMAGE_PLACEHOLDER) + t.content.count(VIDEO_PLACEHOLDER)
                       for t in turns)
    first_user = next((t for t in turns if t.role == "user"), None)
    if first_user is None or not any(t.role == "assistant" for t in turns):
        return "needs a human and a gpt turn"
    if placeholders > 1:
        return f"{placeholders} media placeholders for one video"
    fixups = []
    if IMAGE_PLACEHOLDER in first_user.content:
        first_user.content = first_user.content.replace(IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)
        fixups.append("image_placeholder_is_video")
    elif VIDEO_PLACEHOLDER not in first_user.content:
        if placeholders:
            return "the media placeholder is not in the first human turn"
        first_user.content = f"{VIDEO_PLACEHOLDER}\n{first_user.content}"
        fixups.append("prepended_video_placeholder")
    return turns, fixups


def _read_json_records(url: str) -> list:
    """The records of one annotation file read with the `json` module.

    Raises:
        UsageError: the file is not UTF-8 JSON holding an array (names the file).
    """
    try:
        with open_data_file(url) as f:
            records = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, OSError) as exc:
        raise UsageError(f"annotation file {url} cannot be parsed: {type(exc).__name__}: "
                         f"{str(exc)[:160]}") from None
    if not isinstance(records, list):
        raise UsageError(f"annotation file {url} holds a {type(records).__name__}, "
                         "not an array of records")
    return records


def _record_problem(record) -> str | None:
    """Why a record is unusable as data (not an object, no id, text that is not Unicode)."""
    if not isinstance(record, dict):
        return f"the record is a {type(record).__name__}, not an object"
    if record.get("id") is None:
        return "the record has no id"
    if not _valid_text(json.dumps(record, ensure_ascii=False, default=str)):
        return "the record holds text that is not valid Unicode (a lone surrogate)"
    return None


class LlavaVideoSource:
    """LLaVA-Video-178K opened for conversion (see module docstring)."""

    name = DATASET

    def __init__(self, source: Source, work_dir: Path, configs: list[str] | None = None,
                 splits: list[str] | None = None, limits: Limits = Limits()):
        self.source = source
        self.work_dir = work_dir
        self.limits = limits
        self.configs = resolve_configs(source, configs)
        self.json_fallbacks: list[str] = []
        self._splits, self._tables = open_splits(source, self.configs, splits, self._load)
        self._videos: dict[str, TarGzMembers | FolderMembers] = {}

    def _load(self, config: str, split: str):
        """The annotation records; the `json` module reads files whose column types disagree."""
        try:
            table = self.source.load(config, split)
            if isinstance(table.features.get("id"), datasets.Value):
                return table
            # mixed-type ids can load as a Json feature with JSON-encoded values: read raw
        except Exception:  # e.g. DatasetGenerationError: column types disagree across files
            pass
        records = []
        for url in self.source.data_files(config, split):
            records.extend(_read_json_records(url))
        self.json_fallbacks.append(f"{config}/{split}")
        return records

    def fingerprint(self) -> dict:
        return {**self.source.fingerprint(), "configs": self.configs,
                "limits": self.limits.fingerprint()}

    def splits(self) -> list[SourceSplit]:
        return self._splits

    def units(self, split: SourceSplit) -> list[Unit]:
        self._open_videos(split.config)  # index the archives before workers fork
        table = self._tables[(split.config, split.split)]
        if isinstance(table, list):
            ids = [rec.get("id") if isinstance(rec, dict) else None for rec in table]
        else:
            ids = table["id"] if "id" in table.column_names else [None] * len(table)
        ids = ["" if i is None else str(i) for i in ids]
        return [Unit(key=sample_key(DATASET, split.config, split.split, row, i),
                     rows=[row], ids=[i]) for row, i in enumerate(ids)]

    def _open_videos(self, config: str):
        if config not in self._videos:
            parts = self.source.list_files(f"{config}/{config}_videos_*.tar.gz")
            if parts:
                paths = [self.source.file_path(p) for p in parts]
                self._videos[config] = TarGzMembers(paths, self.work_dir / "gzindex")
            elif self.source.local and (self.source.local / config).is_dir():
                self._videos[config] = FolderMembers(self.source.local / config)
            else:
                raise UsageError(f"--source {self.source.location}: config {config} has no "
                                 f"{config}_videos_*.tar.gz parts and no extracted folder")
        return self._videos[config]

    def build(self, split: SourceSplit, unit: Unit) -> Built:
        record = self._tables[(split.config, split.split)][unit.rows[0]]
        problem = _record_problem(record)
        if problem:
            return reject_all(split, unit, "bad_record", problem)
        parsed = parse_conversations(record.get("conversations"))
        if isinstance(parsed, str):
            return reject_all(split, unit, "bad_conversation", parsed)
        turns, fixups = parsed
        try:
            name, data, probed = fetch_media(self._open_videos(split.config),
                                             record.get("video"), probe_video, "missing_video",
                                             "the video parts", self.limits)
        except MediaError as err:
            return reject_all(split, unit, err.reason, err.detail)
        fixups += video_fixups(probed)
        ext = PurePosixPath(name).suffix.lstrip(".").lower()
        entry, data = video_media(0, data, ext if ext in VIDEO_EXTENSIONS else "mp4", probed,
                                  record["video"])
        sample = CanonicalSample(
            dataset=DATASET,
            source=SourceRef(config=split.config, split=split.split, ids=unit.ids,
                             rows=unit.rows),
            conversation=turns,
            media=[entry],
            fixups=fixups,
            extra={"data_source": record.get("data_source")} if record.get("data_source")
            else {},
        )
        return Built(sample=sample, parts={entry.part: data})
