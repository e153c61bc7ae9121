"""lmms-lab/LLaVA-Video-178K (video instruction data) -> canonical samples.

A config's files are found in the repository's file listing (`find_config_files`), not through the
README's `data_files`, which point the four `*_activitynet` configs at folders that do not exist
(their files live in `*_activitynetqa/`): splits `caption` / `open_ended` / `multi_choice` are the
README's globs `*cap*` / `*oe*` / `*mc*.json` in the config's real folder. Annotations load with
the `json` builder (`load_dataset("json", data_files=...)`); a file whose column types disagree
(int and str ids) is read with the `json` module instead. Videos come from the folder's
`*_videos_<k>.tar.gz` parts (indexed in one streaming pass, then read with random access) or, in
a local mirror without parts, from the extracted folder. A config whose media are not in the
repository (`llava_hound`: frame folders of ShareGPTVideo) is skipped with one line and recorded
in summary.json, or converted from `--frames-root` as frame-sequence videos.

Every video is verified (converters/media.py): frames counted by demuxing, first and last frame
decoded, within the caps. The source's `<image>` placeholder means the video: it is written as
`<video>` where it first appears; repeats in later turns are dropped (a fixup); a record naming
several videos is rejected `several_videos`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import datasets
import yaml

from contract.console import phase
from converters.archives import FolderMembers, FrameFolders, TarGzMembers
from converters.base import (
    MAX_RECORD_DEPTH,
    Built,
    SourceSplit,
    Unit,
    UsageError,
    check_config_folders,
    depth_problem,
    reject_all,
    row_units,
    target_of,
)
from converters.hub import Source, open_data_file, reraise_full_disk, resolve_configs
from converters.media import (
    DEFAULT_LIMITS,
    Limits,
    MediaError,
    fetch_media,
    probe_frames,
    probe_video,
    video_fixups,
    video_media,
)
from energon_tasks.sample_format import (
    FRAMES_FORMAT,
    IMAGE_PLACEHOLDER,
    PLACEHOLDER_RE,
    VIDEO_EXTENSIONS,
    VIDEO_PLACEHOLDER,
    CanonicalSample,
    SourceRef,
    Turn,
)

HUB_ID = "lmms-lab/LLaVA-Video-178K"
DATASET = "llava-video"
_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
_PLACEHOLDER_LINE = re.compile(r"(<image>|<video>)\n?")


def _valid_text(text: str) -> bool:
    """False for text holding lone surrogates (JSON `\\ud800` escapes): not writable as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_conversations(messages) -> tuple[list[Turn], list[str]] | str:
    """Turns with the one video span as `<video>` where a placeholder first appears in a human
    turn, and the fixups made; or why the conversation is malformed.

    The source's `<image>` means the video (fixup `image_placeholder_is_video`); a record whose
    later turns repeat the placeholder for the same video keeps the first and drops the others
    (fixup `repeated_video_placeholder_removed`); a record without one gets it prepended to the
    first human turn (fixup `prepended_video_placeholder`).
    """
    if not isinstance(messages, list) or not messages:
        return "conversations is empty or not a list"
    turns = []
    for message in messages:
        role = _ROLES.get(message.get("from")) if isinstance(message, dict) else None
        value = message.get("value") if isinstance(message, dict) else None
        if role is None or not isinstance(value, str):
            return f"bad message {str(message)[:80]!r}"
        turns.append(Turn(role=role, content=value))
    users = [t for t in turns if t.role == "user"]
    if not users or not any(t.role == "assistant" for t in turns):
        return "needs a human and a gpt turn"
    if any(PLACEHOLDER_RE.search(t.content) for t in turns if t.role != "user"):
        return "a media placeholder outside the human turns"
    found = [m.group(0) for t in users for m in PLACEHOLDER_RE.finditer(t.content)]
    if not found:
        users[0].content = f"{VIDEO_PLACEHOLDER}\n{users[0].content}"
        return turns, ["prepended_video_placeholder"]
    kept = False
    for turn in users:
        def keep_first(match, _turn=turn):
            nonlocal kept
            if kept:
                return ""
            kept = True
            return VIDEO_PLACEHOLDER + (match.group(0)[len(match.group(1)):])

        turn.content = _PLACEHOLDER_LINE.sub(keep_first, turn.content)
    fixups = ["image_placeholder_is_video"] if found[0] == IMAGE_PLACEHOLDER else []
    return turns, fixups + (["repeated_video_placeholder_removed"] if len(found) > 1 else [])


def _one_video(value) -> str | None:
    """The record's video path: a string, or a list holding one."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return value if isinstance(value, str) and value else None


@dataclass(slots=True, frozen=True)
class _TooDeep:
    """A record of an annotation file nested beyond `MAX_RECORD_DEPTH`, kept unparsed."""

    digest: str  #: SHA-1 of its text (what its row id is made from)
    problem: str


def _row_content(record):
    return record.digest if isinstance(record, _TooDeep) else record


_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},]')


def _split_top_array(text: str) -> list:
    """The elements of a JSON array, each parsed on its own; one nested beyond the depth cap is
    a `_TooDeep` (so one hostile record is a reject, never a RecursionError of the file)."""
    records, depth, deepest, start = [], 0, 0, None
    for match in _TOKENS.finditer(text):
        token = match.group(0)
        if token in "[{":
            depth += 1
            if depth == 1:
                if token != "[":
                    raise json.JSONDecodeError("expected an array", text, match.start())
                start = match.end()
            deepest = max(deepest, depth)
        elif token in "]}" or (token == "," and depth == 1):
            if depth == 1 and text[start:match.start()].strip():
                chunk = text[start:match.start()]
                if deepest - 1 > MAX_RECORD_DEPTH:
                    digest = hashlib.sha1(chunk.encode("utf-8", "surrogatepass")).hexdigest()
                    records.append(_TooDeep(digest, f"the record is nested deeper than "
                                                    f"{MAX_RECORD_DEPTH} levels"))
                else:
                    records.append(json.loads(chunk))
                start, deepest = match.end(), 1
            if token != ",":
                depth -= 1
    return records


def _read_json_records(url: str) -> list:
    """The records of one annotation file read with the `json` module (a file whose nesting is
    too deep for it is split into its records, each parsed on its own).

    Raises:
        UsageError: the file is not UTF-8 JSON holding an array (names the file).
    """
    try:
        with open_data_file(url) as f:
            text = f.read().decode("utf-8")
        try:
            records = json.loads(text)
        except RecursionError:
            records = _split_top_array(text)
    except (UnicodeDecodeError, json.JSONDecodeError, OSError) as exc:
        raise UsageError(f"annotation file {url} cannot be parsed: {type(exc).__name__}: "
                         f"{str(exc)[:160]}") from None
    if not isinstance(records, list):
        raise UsageError(f"annotation file {url} holds a {type(records).__name__}, "
                         "not an array of records")
    return records


def _record_problem(record) -> str | None:
    """Why a record is unusable as data (not an object, nested beyond `MAX_RECORD_DEPTH`, text
    that is not Unicode). A record without an id is data: it gets one from its row (`row_id`)."""
    if isinstance(record, _TooDeep):
        return record.problem
    if not isinstance(record, dict):
        return f"the record is a {type(record).__name__}, not an object"
    deep = depth_problem(record)
    if deep:
        return deep
    if not _valid_text(json.dumps(record, ensure_ascii=False, default=str)):
        return "the record holds text that is not valid Unicode (a lone surrogate)"
    return None


#: split name -> annotation glob, for a config the README does not describe
SPLIT_GLOBS = {"caption": "*cap*.json", "open_ended": "*oe*.json", "multi_choice": "*mc*.json"}
#: where the media of configs that hold none live (printed when such a config is skipped)
MEDIA_ELSEWHERE = {
    "llava_hound": "frame folders of ShareGPTVideo/train_video_and_instruction (train_300k)",
}


@dataclass(slots=True)
class ConfigFiles:
    """Where a config's files really are, from the repository's listing."""

    folder: str  #: the README's `<config>/`, or the real folder (`<config>qa/` for activitynet)
    annotations: dict[str, list[str]]  #: split -> annotation files
    parts: list[str]  #: `*_videos_<k>.tar.gz` parts, in part order
    has_media: bool  #: parts, or extracted media files, in the folder


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def card_data_files(source: Source) -> dict[str, dict[str, list[str]]]:
    """config -> split -> path globs, as the README's `configs:` front matter writes them."""
    readme = source.file_path("README.md")
    text = readme.read_text(encoding="utf-8", errors="replace") if readme else ""
    parts = text.split("---", 2)
    card = yaml.safe_load(parts[1]) if text.startswith("---") and len(parts) == 3 else None
    configs = {}
    for entry in (card or {}).get("configs") or []:
        files = entry.get("data_files") or []
        splits: dict[str, list[str]] = {}
        for item in files if isinstance(files, list) else []:
            paths = item.get("path")
            splits.setdefault(item.get("split", "train"), []).extend(
                [paths] if isinstance(paths, str) else list(paths or []))
        configs[entry.get("config_name")] = splits
    return configs


def _real_folder(source: Source, folder: str) -> str | None:
    """The one top-level folder named `<folder><letters>` (e.g. `0_30_s_activitynetqa` for the
    README's `0_30_s_activitynet`), or None."""
    found = {n.split("/")[0] for n in source.list_files(f"{folder}*/*")}
    found = sorted(f for f in found if f != folder and f[len(folder):].isalpha())
    return found[0] if len(found) == 1 else None


def find_config_files(source: Source, config: str, globs: dict[str, list[str]]) -> ConfigFiles:
    """A config's annotation files and video parts from the repository's file listing: the
    README's globs where they match files, else the same file glob in the real folder (the
    activitynet configs' files live in `*_activitynetqa/`, not where the README points).

    Raises:
        UsageError: a split whose files are found nowhere.
    """
    globs = globs or {split: [f"{config}/{g}"] for split, g in SPLIT_GLOBS.items()}
    annotations: dict[str, list[str]] = {}
    folders = set()
    for split, patterns in globs.items():
        files = []
        for pattern in patterns:
            hits = source.list_files(pattern)
            if not hits and "/" in pattern:
                folder, name = pattern.rsplit("/", 1)
                real = _real_folder(source, folder)
                hits = source.list_files(f"{real}/{name}") if real else []
            files += hits
        if files:
            annotations[split] = sorted(set(files))
            folders |= {f.rsplit("/", 1)[0] for f in files if "/" in f}
    if not annotations:
        raise UsageError(f"--source {source.location}: config {config!r}: no annotation file "
                         f"matches {sorted(p for ps in globs.values() for p in ps)}, not even in "
                         "a folder of a longer name")
    folder = sorted(folders)[0] if folders else config
    parts = sorted(source.list_files(f"{folder}/*_videos_*.tar.gz"), key=_natural)
    if source.local:  # a mirror may hold the videos extracted, in sub-folders
        own = {Path(f).name for fs in annotations.values() for f in fs}
        has_media = bool(parts) or any(p.name not in own
                                       for p in (source.local / folder).iterdir())
    else:
        own = {f for fs in annotations.values() for f in fs}
        has_media = bool(parts) or any(n not in own for n in source.list_files(f"{folder}/*"))
    return ConfigFiles(folder, annotations, parts, has_media)


class LlavaVideoSource:
    """LLaVA-Video-178K opened for conversion (see module docstring).

    Args:
        source: the repository (hub id or local mirror).
        work_dir: where the gzip indexes of the video parts are kept.
        configs, splits: what to convert (default: everything).
        limits: the media caps.
        frames_root: a local copy of the frame folders of configs whose media are not in the
            repository (llava_hound); without it such configs are skipped (named, counted).
        frames_fps: the rate those frames were taken at.
    """

    name = DATASET

    def __init__(self, source: Source, work_dir: Path, configs: list[str] | None = None,
                 splits: list[str] | None = None, limits: Limits = DEFAULT_LIMITS,
                 frames_root: Path | None = None, frames_fps: float = 1.0):
        self.source = source
        self.work_dir = work_dir
        self.limits = limits
        self.frames_root = Path(frames_root).resolve() if frames_root else None
        self.frames_fps = frames_fps
        if self.frames_root is not None and not self.frames_root.is_dir():
            raise UsageError(f"--frames-root {frames_root}: no such folder")
        self.configs = resolve_configs(source, configs)
        check_config_folders(self.configs)
        self.json_fallbacks: list[str] = []
        card = card_data_files(source)
        self._files = {c: find_config_files(source, c, card.get(c, {})) for c in self.configs}
        self._splits: list[SourceSplit] = []
        self._tables: dict = {}
        self._skipped: dict[str, dict] = {}
        self._videos: dict[str, TarGzMembers | FolderMembers | FrameFolders] = {}
        seen: set[str] = set()
        for config in self.configs:
            self._open_config(config, splits, seen)
        unknown = sorted(set(splits or ()) - seen)
        if unknown:
            raise UsageError(f"unknown split(s) {', '.join(unknown)}; the source has: "
                             f"{', '.join(sorted(seen))}")

    def _open_config(self, config: str, wanted: list[str] | None, seen: set[str]) -> None:
        files = self._files[config]
        seen.update(files.annotations)
        chosen = {s: f for s, f in files.annotations.items() if wanted is None or s in wanted}
        tables = {split: self._load(config, split, paths) for split, paths in chosen.items()}
        if not files.has_media and self.frames_root is None:
            rows = sum(len(t) for t in tables.values())
            where = MEDIA_ELSEWHERE.get(config, "another repository")
            self._skipped[config] = {"rows": rows, "why": f"its videos are not in the repository "
                                     f"but {where}; pass --frames-root DIR to convert it"}
            phase(f"skipping config {config} ({rows} rows): {self._skipped[config]['why']}")
            return
        has_val = any(target_of(s, True) == "val" for s in chosen)
        for split, table in tables.items():
            self._tables[(config, split)] = table
            self._splits.append(SourceSplit(config=config, split=split,
                                            target=target_of(split, has_val),
                                            num_rows=len(table)))

    def _load(self, config: str, split: str, paths: list[str]):
        """The annotation records of one split; the `json` module reads files whose column
        types disagree (e.g. int and str ids), which the `json` builder cannot."""
        local = [str(self.source.file_path(p)) for p in paths]
        try:
            table = datasets.load_dataset("json", data_files=local, split="train",
                                          cache_dir=str(self.source.cache_dir)
                                          if self.source.cache_dir else None)
            if isinstance(table.features.get("id"), datasets.Value):
                return table
            # mixed-type ids can load as a Json feature with JSON-encoded values: read raw
        except Exception as exc:  # e.g. DatasetGenerationError: column types disagree
            reraise_full_disk(exc)
        records = []
        for path in local:
            records.extend(_read_json_records(path))
        self.json_fallbacks.append(f"{config}/{split}")
        return records

    def fingerprint(self) -> dict:
        return {**self.source.fingerprint(), "configs": self.configs,
                "limits": self.limits.fingerprint(),
                "frames_root": str(self.frames_root) if self.frames_root else None,
                "frames_fps": self.frames_fps if self.frames_root else None}

    def skipped(self) -> dict[str, dict]:
        """Configs not converted: config -> {rows, why}."""
        return dict(self._skipped)

    def splits(self) -> list[SourceSplit]:
        return self._splits

    def units(self, split: SourceSplit) -> list[Unit]:
        self._open_videos(split.config)  # index the archives before workers fork
        table = self._tables[(split.config, split.split)]
        if isinstance(table, list):
            ids = [rec.get("id") if isinstance(rec, dict) else None for rec in table]
        else:
            ids = table["id"] if "id" in table.column_names else [None] * len(table)
        units = row_units(DATASET, split, ids, lambda row: _row_content(table[row]))
        self._check_frames_found(split, table)
        return units

    #: rows looked at to tell a `--frames-root` that matches nothing
    FRAMES_CHECK_ROWS = 200

    def _check_frames_found(self, split: SourceSplit, table) -> None:
        """A `--frames-root` where none of the first rows' frame folders is (e.g. one level too
        high) is a UsageError naming the path tried, not a run of `missing_video` rejects."""
        members = self._videos.get(split.config)
        if not isinstance(members, FrameFolders) or not len(table):
            return
        from converters.archives import safe_member_name

        paths = []
        for row in range(min(len(table), self.FRAMES_CHECK_ROWS)):
            record = table[row]
            path = _one_video(record.get("video")) if isinstance(record, dict) else None
            name = safe_member_name(path) if path else None
            if name:
                paths.append(name)
        if paths and not any(members.has(p) for p in paths):
            raise UsageError(f"--frames-root {self.frames_root}: none of the first {len(paths)} "
                             f"videos of {split.config}/{split.split} is there (tried "
                             f"{self.frames_root / paths[0]}); pass the folder that holds them")

    def _open_videos(self, config: str):
        if config not in self._videos:
            files = self._files[config]
            if files.parts:
                paths = [self.source.file_path(p) for p in files.parts]
                self._videos[config] = TarGzMembers(paths, self.work_dir / "gzindex")
            elif files.has_media and self.source.local:
                self._videos[config] = FolderMembers(self.source.local / files.folder)
            elif self.frames_root is not None:
                self._videos[config] = FrameFolders(self.frames_root)
            else:
                raise UsageError(f"--source {self.source.location}: config {config}'s media "
                                 "are not in the repository")
        return self._videos[config]

    def _probe(self, config: str):
        if isinstance(self._videos.get(config), FrameFolders):
            return lambda data, name, limits: probe_frames(data, name, limits, self.frames_fps)
        return probe_video

    def build(self, split: SourceSplit, unit: Unit) -> Built:
        record = self._tables[(split.config, split.split)][unit.rows[0]]
        problem = _record_problem(record)
        if problem:
            return reject_all(split, unit, "bad_record", problem)
        video = record.get("video")
        if isinstance(video, list) and len(video) > 1:
            return reject_all(split, unit, "several_videos",
                              f"{len(video)} videos in one record; a sample holds one")
        parsed = parse_conversations(record.get("conversations"))
        if isinstance(parsed, str):
            return reject_all(split, unit, "bad_conversation", parsed)
        turns, fixups = parsed
        path = _one_video(video) or video
        members = self._open_videos(split.config)
        try:
            name, data, probed = fetch_media(members, path, self._probe(split.config),
                                             "missing_video", "the video parts", self.limits)
        except MediaError as err:
            return reject_all(split, unit, err.reason, err.detail)
        fixups += video_fixups(probed)
        if isinstance(members, FrameFolders):
            ext = "tar"
        else:
            ext = PurePosixPath(name).suffix.lstrip(".").lower()
            ext = ext if ext in VIDEO_EXTENSIONS else "mp4"
        entry, data = video_media(0, data, ext, probed, path)
        if isinstance(members, FrameFolders):
            entry.format = FRAMES_FORMAT
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
