"""TIGER-Lab/Mantis-Instruct (interleaved multi-image conversations) -> canonical samples.

Rows come from `load_dataset(source, config, split=...)` and hold only image paths; the images
are read member by member from `<config>/<split>_images.zip`, or from the part zips listed in
`<config>/<split>_images_zips.txt`, never extracted; an entry that embeds its bytes (`{bytes,
path}`, as `datasets` stores an Image feature) is read from the row. One row = one sample.

Repairs and rejects, as Mantis's own trainer treats its data:
- fewer `<image>` than images: the missing placeholders are prepended to the first user turn
  (fixup `prepended_image_placeholders`);
- more placeholders than images, `images=None` with placeholders, an image entry that is
  neither `{path: str}` nor `{bytes, path}` with the bytes embedded (`bad_record`), a missing,
  unsafe, oversized or unreadable member, an image that does not decode or is over the pixel
  cap, a malformed conversation: the row is rejected with that reason.
A table without the `id`, `images` and `conversation` columns is a one-line error before any
shard is written. Image formats are detected from the bytes (some `.png` members are JPEG).
"""

from __future__ import annotations

import datasets

from converters.archives import ZipMembers
from converters.base import Built, SourceSplit, Unit, UsageError, reject_all, row_units
from converters.hub import Source, open_splits, resolve_configs
from converters.media import (
    DEFAULT_LIMITS,
    Limits,
    MediaError,
    fetch_media,
    image_media,
    probe_image,
)
from energon_tasks.sample_format import (
    IMAGE_PLACEHOLDER,
    CanonicalSample,
    SourceRef,
    Turn,
)

HUB_ID = "TIGER-Lab/Mantis-Instruct"
DATASET = "mantis"
#: columns every split must have (`conversation` may be spelled `conversations`)
REQUIRED_COLUMNS = ({"id"}, {"images"}, {"conversation", "conversations"})


def parse_conversation(messages) -> list[Turn] | str:
    """Turns from the source's `conversation` list, or the reason it is malformed."""
    if not isinstance(messages, list) or not messages:
        return "conversation is empty or not a list"
    turns = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system") or not isinstance(content, str):
            return f"bad message {str(message)[:80]!r}"
        if "<video>" in content:
            return "a <video> placeholder in an image dataset"
        turns.append(Turn(role=role, content=content))
    if not any(t.role == "assistant" for t in turns):
        return "no assistant turn"
    if not any(t.role == "user" for t in turns):
        return "no user turn"
    return turns


def prepend_missing_placeholders(turns: list[Turn], n_images: int) -> int:
    """Mantis's rule for rows with fewer `<image>` than images; returns how many were added."""
    missing = n_images - sum(t.content.count(IMAGE_PLACEHOLDER) for t in turns)
    if missing > 0:
        first_user = next(t for t in turns if t.role == "user")
        first_user.content = IMAGE_PLACEHOLDER * missing + first_user.content
    return max(0, missing)


def _embedded(image: dict) -> bytes | None:
    """The bytes of an images entry that embeds them (`{bytes, path}`, what `datasets` stores
    for an Image feature), else None."""
    data = image.get("bytes")
    return bytes(data) if isinstance(data, (bytes, bytearray, memoryview)) and data else None


def _undecoded(table):
    """The table with an `images` column of Image features left as `{bytes, path}` (never
    decoded by `datasets`)."""
    feature = getattr(table, "features", {}).get("images")
    inner = getattr(feature, "feature", None)
    if isinstance(inner, datasets.Image) and inner.decode:
        return table.cast_column("images", datasets.List(datasets.Image(decode=False)))
    return table


class MantisSource:
    """Mantis-Instruct opened for conversion (see module docstring)."""

    name = DATASET

    def __init__(self, source: Source, configs: list[str] | None = None,
                 splits: list[str] | None = None, limits: Limits = DEFAULT_LIMITS):
        self.source = source
        self.limits = limits
        self.configs = resolve_configs(source, configs)
        self._splits, self._tables = open_splits(
            source, self.configs, splits, lambda c, s: _undecoded(source.load(c, s)),
            required=REQUIRED_COLUMNS)
        self._members: dict[tuple[str, str], ZipMembers] = {}

    def fingerprint(self) -> dict:
        return {**self.source.fingerprint(), "configs": self.configs,
                "limits": self.limits.fingerprint()}

    def splits(self) -> list[SourceSplit]:
        return self._splits

    def units(self, split: SourceSplit) -> list[Unit]:
        self._open_images(split)  # index the zips before workers fork
        table = self._tables[(split.config, split.split)]
        return row_units(DATASET, split, table.data.column("id").to_pylist(),
                         lambda row: table[row])

    def _open_images(self, split: SourceSplit) -> ZipMembers:
        key = (split.config, split.split)
        if key not in self._members:
            prefix = f"{split.config}/{split.split}_images"
            single = self.source.file_path(f"{prefix}.zip")
            if single is not None:
                zips = [single]
            else:
                listing = self.source.file_path(f"{prefix}_zips.txt")
                if listing is None:
                    raise UsageError(f"--source {self.source.location}: neither {prefix}.zip "
                                     f"nor {prefix}_zips.txt exists")
                names = [n.strip() for n in listing.read_text().splitlines() if n.strip()]
                zips = []
                for name in names:
                    path = self.source.file_path(f"{split.config}/{name}")
                    if path is None:
                        raise UsageError(f"--source {self.source.location}: part zip "
                                         f"{split.config}/{name} listed but missing")
                    zips.append(path)
            self._members[key] = ZipMembers(zips)
        return self._members[key]

    def build(self, split: SourceSplit, unit: Unit) -> Built:
        row = self._tables[(split.config, split.split)][unit.rows[0]]
        turns = parse_conversation(row.get("conversation", row.get("conversations")))
        if isinstance(turns, str):
            return reject_all(split, unit, "bad_conversation", turns)
        images = row.get("images")
        n_placeholders = sum(t.content.count(IMAGE_PLACEHOLDER) for t in turns)
        if images is None and n_placeholders:
            return reject_all(split, unit, "images_none_with_placeholders",
                              f"{n_placeholders} <image> and images=None")
        images = images or []
        if not all(isinstance(i, dict) and (_embedded(i) is not None or (
                isinstance(i.get("path"), str) and i["path"])) for i in images):
            return reject_all(split, unit, "bad_record", "an images entry is neither {path: str} "
                              f"nor {{bytes, path}} with bytes: {str(images)[:120]}")
        if n_placeholders > len(images):
            return reject_all(split, unit, "too_many_placeholders",
                              f"{n_placeholders} <image> for {len(images)} images")
        fixups = ["prepended_image_placeholders"] if prepend_missing_placeholders(
            turns, len(images)) else []
        members = self._open_images(split)
        media, parts = [], {}
        for index, image in enumerate(images):
            path, embedded = image.get("path"), _embedded(image)
            try:
                if embedded is not None:  # `datasets` Image feature: the bytes are in the row
                    path = path or f"embedded image {index}"
                    if len(embedded) > self.limits.max_member_bytes:
                        raise MediaError("member_too_large", f"{path}: {len(embedded)} bytes > "
                                         f"--max-member-bytes {self.limits.max_member_bytes}")
                    probed = probe_image(embedded, path, self.limits)
                else:
                    _, _, probed = fetch_media(members, path, probe_image, "missing_image",
                                               "the image zip", self.limits)
            except MediaError as err:
                return reject_all(split, unit, err.reason, err.detail)
            entry, data = image_media(index, probed, path)
            media.append(entry)
            parts[entry.part] = data
            if probed.reencoded_from:
                fixups.append("reencoded_image")
        sample = CanonicalSample(
            dataset=DATASET,
            source=SourceRef(config=split.config, split=split.split, ids=unit.ids,
                             rows=unit.rows),
            conversation=turns,
            media=media,
            fixups=fixups,
            extra={"source": row.get("source")} if row.get("source") else {},
        )
        return Built(sample=sample, parts=parts)
