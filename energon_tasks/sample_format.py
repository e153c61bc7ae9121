"""The canonical sample schema (docs/format.md): one conversation with its media, as stored.

This module owns the format: the dataclasses, their JSON form, sample keys, and the rules every
sample obeys. Converters build `CanonicalSample`s and the shard writer calls `validate` on each;
task encoders parse the stored JSON back with `CanonicalSample.from_json`. It imports nothing
heavy, so conversion and training both depend on it without pulling the other side in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import tarfile
from dataclasses import dataclass, field
from typing import Any, Literal

FORMAT_VERSION = 2
#: Versions the loaders read (1: no media checksums; 2: `sha256` on every media entry).
READABLE_VERSIONS = (1, 2)

#: `.nv-meta/dataset.yaml` of every converted dataset (written by converters/finalize.py): the
#: typed dataset of energon_tasks/energon_dataset.py, named here so that writing it costs no import.
DATASET_YAML = {
    "__module__": "energon_tasks.energon_dataset",
    "__class__": "ConversationWebdataset",
    "sample_type": {"__module__": "energon_tasks.energon_dataset",
                    "__class__": "ConversationSample"},
}

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
PLACEHOLDER_RE = re.compile(r"<image>|<video>")
ROLES = ("user", "assistant", "system")

#: Image formats we store (PIL format name -> member extension).
IMAGE_EXTENSIONS = {
    "JPEG": "jpg",
    "PNG": "png",
    "WEBP": "webp",
    "GIF": "gif",
    "BMP": "bmp",
    "TIFF": "tiff",
}
VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "avi", "mov")
#: `Media.format` of a video stored as a sequence of frame images (part `vidN.tar`)
FRAMES_FORMAT = "frames"

_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class FormatError(ValueError):
    """A sample breaks the canonical format (a converter bug, never bad source data)."""


@dataclass(slots=True, kw_only=True)
class Turn:
    role: Literal["user", "assistant", "system"]
    content: str  #: text with <image>/<video> placeholders where the media appear
    answers: list[str] | None = None  #: every accepted reference answer (evaluation), optional


@dataclass(slots=True, kw_only=True)
class Media:
    part: str  #: member name without the key, e.g. "img0.jpg" or "vid0.mp4"
    kind: Literal["image", "video"]
    format: str  #: "jpeg", "png", ..., "mp4"
    width: int  #: stored pixels (before any EXIF orientation)
    height: int
    bytes: int  #: size of the member
    source_name: str | None = None  #: path of the file in the source (zip member, video path)
    reencoded_from: str | None = None  #: original format when re-encoded losslessly to PNG
    duration_s: float | None = None  #: video only
    frames: int | None = None  #: video only
    fps: float | None = None  #: video only
    codec: str | None = None  #: video only
    sha256: str | None = None  #: hex SHA-256 of the member's bytes (format 2; verified at load)


@dataclass(slots=True, kw_only=True)
class SourceRef:
    config: str  #: source config name (exposed as subflavor "config")
    split: str  #: source split name as the hub spells it
    ids: list[str]  #: source ids of every row in this sample
    rows: list[int]  #: row indices in the source split


@dataclass(slots=True, kw_only=True)
class CanonicalSample:
    dataset: str  #: "mantis" | "infovqa" | "llava-video"
    source: SourceRef
    conversation: list[Turn]
    media: list[Media] = field(default_factory=list)
    fixups: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json_bytes(self) -> bytes:
        """Deterministic JSON (sorted keys; None fields of turns and video-only media dropped)."""
        doc = {
            "format_version": self.format_version,
            "dataset": self.dataset,
            "source": {"config": self.source.config, "split": self.source.split,
                       "ids": list(self.source.ids), "rows": list(self.source.rows)},
            "conversation": [_without_none(t, ()) for t in self.conversation],
            "media": [_without_none(m, _ALWAYS) for m in self.media],
            "fixups": list(self.fixups),
            "extra": self.extra,
        }
        return json.dumps(doc, sort_keys=True, ensure_ascii=False).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes | str | dict) -> "CanonicalSample":
        """Parse a stored `K.json` (bytes, text or an already decoded dict)."""
        doc = json.loads(data) if isinstance(data, (bytes, str)) else data
        if not isinstance(doc, dict):
            raise FormatError(f"K.json is a {type(doc).__name__}, not an object")
        version = doc.get("format_version")
        if version not in READABLE_VERSIONS:
            raise FormatError(f"unsupported format_version {version!r} (this version reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))})")
        return cls(
            dataset=doc["dataset"],
            source=SourceRef(**doc["source"]),
            conversation=[Turn(**t) for t in doc["conversation"]],
            media=[Media(**m) for m in doc.get("media", [])],
            fixups=list(doc.get("fixups", [])),
            extra=dict(doc.get("extra", {})),
            format_version=version,
        )

    def placeholders(self) -> list[str]:
        """The placeholders of the whole conversation in reading order ("<image>"/"<video>")."""
        return [m for t in self.conversation for m in PLACEHOLDER_RE.findall(t.content)]


_ALWAYS = ("source_name", "reencoded_from")


def _without_none(obj, keep: tuple[str, ...]) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if getattr(obj, f.name) is not None or f.name in keep}


def pack_frames(frames: list[tuple[str, bytes]]) -> bytes:
    """The member of a frame-sequence video: an uncompressed POSIX tar of the original frame
    files, in frame order (mtime 0, no owners: the same frames give the same bytes)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in frames:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def is_frame_sequence(data: bytes) -> bool:
    """True for a `pack_frames` member (a tar), judged from the bytes."""
    return len(data) >= 512 and data[257:262] == b"ustar"


def unpack_frames(data: bytes) -> list[bytes]:
    """The frame files of a frame-sequence member, in frame order.

    Raises:
        tarfile.TarError: the member is not a readable tar.
    """
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        return [tar.extractfile(m).read() for m in tar if m.isfile()]


def sample_key(dataset: str, config: str, split: str, row: int, source_id: str) -> str:
    """Deterministic, unique, dot-free key: sanitised id + 12 hex digits of a hash of its origin."""
    origin = f"{dataset}/{config}/{split}/{row}/{source_id}"
    digest = hashlib.sha1(origin.encode("utf-8", "surrogatepass")).hexdigest()
    stem = _KEY_UNSAFE.sub("_", str(source_id)).strip("_")[:64] or "row"
    return f"{stem}-{digest[:12]}"


def validate(key: str, sample: CanonicalSample, parts: dict[str, bytes]) -> None:
    """Check one sample against the format rules; raises FormatError naming the key and the rule.

    Args:
        key: the sample key.
        sample: the description stored as `K.json`.
        parts: the media members, part name -> bytes.
    """

    def fail(rule: str) -> None:
        raise FormatError(f"sample {key}: {rule}")

    if not KEY_RE.match(key):
        fail("key must match [A-Za-z0-9_-]+")
    if not sample.conversation:
        fail("empty conversation")
    for turn in sample.conversation:
        if turn.role not in ROLES or not isinstance(turn.content, str):
            fail(f"bad turn {turn!r}")
    if not any(t.role == "assistant" for t in sample.conversation):
        fail("no assistant turn")
    expected = [f"<{m.kind}>" for m in sample.media]
    if sample.placeholders() != expected:
        fail(f"placeholders {sample.placeholders()} do not match media kinds {expected}")
    listed = [m.part for m in sample.media]
    if sorted(listed) != sorted(parts) or len(set(listed)) != len(listed):
        fail(f"media parts {listed} do not match members {sorted(parts)}")
    for m in sample.media:
        if m.bytes != len(parts[m.part]) or m.width <= 0 or m.height <= 0:
            fail(f"media {m.part}: bytes/size metadata wrong")
        if sample.format_version >= 2 and not _SHA256_RE.match(m.sha256 or ""):
            fail(f"media {m.part}: sha256 missing")
        if m.kind == "video" and (m.frames is None or m.duration_s is None or m.fps is None):
            fail(f"media {m.part}: video metadata missing")
