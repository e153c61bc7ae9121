"""Media probing for the converters: format from content, sizes, decodability, video metadata.

Images keep their original bytes. A probe detects the format from the bytes (never from the file
name), reads the stored size and proves the image decodes (JPEG at a reduced DCT scale, which
parses the whole entropy-coded stream at a fraction of the cost). Formats that common loaders do not
decode by extension are re-encoded losslessly to PNG and the original format is recorded.
Videos are probed with PyAV without decoding more than their first frame.
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass

import av
from PIL import Image

from energon_tasks.sample_format import IMAGE_EXTENSIONS, Media

# PIL aliases that are the same bytes as a stored format (MPO is a JPEG with extra frames).
_FORMAT_ALIASES = {"MPO": "JPEG"}


_ADDRESS = re.compile(r" ?<[^<>]* at 0x[0-9a-fA-F]+>")


class MediaError(Exception):
    """A media file cannot be used; `reason` is the reject reason recorded for its row."""

    def __init__(self, reason: str, detail: str):
        detail = _ADDRESS.sub("", detail)  # object addresses would make rejects.jsonl unstable
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(slots=True, frozen=True)
class ProbedImage:
    data: bytes  #: bytes to store (the original unless re-encoded)
    ext: str  #: member extension, e.g. "jpg"
    format: str  #: lower-case format name, e.g. "jpeg"
    width: int
    height: int
    reencoded_from: str | None  #: original format when re-encoded to PNG


@dataclass(slots=True, frozen=True)
class ProbedVideo:
    width: int
    height: int
    duration_s: float
    frames: int
    fps: float
    codec: str


def _looks_complete(fmt: str, data: bytes) -> bool:
    """Cheap integrity check: a JPEG ends with its EOI marker, a PNG with its IEND chunk."""
    tail = data[-64:].rstrip(b"\x00")
    if fmt == "JPEG":
        return tail.endswith(b"\xff\xd9")
    if fmt == "PNG":
        return tail.endswith(b"IEND\xaeB`\x82")
    return False


_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fast_header(data: bytes) -> tuple[str, int, int] | None:
    """(format, width, height) of a JPEG or PNG read straight from its header (~10 us, where
    PIL's parser takes ~250 us); None for anything else or any irregularity (PIL decides)."""
    if data[:8] == _PNG_MAGIC and data[12:16] == b"IHDR":
        return "PNG", int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if data[:2] != b"\xff\xd8":
        return None
    i, end = 2, len(data) - 9
    while i < end:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _JPEG_SOF:
            height = int.from_bytes(data[i + 5:i + 7], "big")
            width = int.from_bytes(data[i + 7:i + 9], "big")
            return ("JPEG", width, height) if width and height else None
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return None


def probe_image(data: bytes, name: str = "") -> ProbedImage:
    """Detect format and size from the bytes and check that they are a whole image.

    JPEG and PNG files whose header parses and whose end marker is present are accepted without
    decoding (decoding is the loader's job, and costs 5-20x the copy). Anything else is decoded
    (a JPEG at 1/8 DCT scale, which still parses the whole entropy-coded stream).

    Raises:
        MediaError: reason "undecodable_image" when PIL cannot open or decode the bytes.
    """
    header = _fast_header(data)
    if header and _looks_complete(header[0], data):
        fmt, width, height = header
        return ProbedImage(data, IMAGE_EXTENSIONS[fmt], fmt.lower(), width, height, None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            fmt = _FORMAT_ALIASES.get(img.format or "", img.format or "")
            width, height = img.size
            if not _looks_complete(fmt, data):
                if fmt == "JPEG":
                    img.draft(img.mode, (max(1, width // 8), max(1, height // 8)))
                img.load()
    except Exception as exc:  # PIL raises many types for corrupt data
        raise MediaError("undecodable_image", f"{name}: {type(exc).__name__}: {exc}") from None
    if fmt in IMAGE_EXTENSIONS:
        return ProbedImage(data, IMAGE_EXTENSIONS[fmt], fmt.lower(), width, height, None)
    # Decodable by PIL, but not a format loaders expect by extension: lossless PNG copy.
    img = Image.open(io.BytesIO(data))
    img.load()
    if img.mode not in ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"):
        img = img.convert("RGBA" if "A" in img.getbands() else "RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return ProbedImage(buf.getvalue(), "png", "png", width, height, fmt.lower() or "unknown")


def probe_video(data: bytes, name: str = "") -> ProbedVideo:
    """Read duration, frame count, fps, size and codec; decode only the first frame.

    The frame count is the container's; when the container does not state it, packets are counted
    by demuxing (no decoding).

    Raises:
        MediaError: "unreadable_video" (cannot open or decode), "zero_frame_video" (no frames).
    """
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("zero_frame_video", f"{name}: no video stream")
            stream = container.streams.video[0]
            frames = int(stream.frames or 0)
            if frames == 0:
                frames = sum(1 for p in container.demux(stream) if p.size)
                container.seek(0)
            if frames == 0:
                raise MediaError("zero_frame_video", f"{name}: the video stream has no frames")
            first = next(container.decode(stream), None)
            if first is None:
                raise MediaError("unreadable_video", f"{name}: no frame decodes")
            fps = float(stream.average_rate or stream.guessed_rate or 0) or None
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                duration = container.duration / 1_000_000
            else:
                duration = frames / fps if fps else 0.0
            fps = fps or (frames / duration if duration else 0.0)
            return ProbedVideo(
                width=int(first.width),
                height=int(first.height),
                duration_s=round(duration, 6),
                frames=frames,
                fps=round(fps, 6),
                codec=stream.codec_context.name,
            )
    except MediaError:
        raise
    except Exception as exc:  # PyAV/FFmpeg errors are many types
        raise MediaError("unreadable_video", f"{name}: {type(exc).__name__}: {exc}") from None


def image_media(index: int, probed: ProbedImage, source_name: str | None) -> tuple[Media, bytes]:
    """The format entry and the bytes of the index-th image of a sample."""
    part = f"img{index}.{probed.ext}"
    media = Media(part=part, kind="image", format=probed.format, width=probed.width,
                  height=probed.height, bytes=len(probed.data), source_name=source_name,
                  reencoded_from=probed.reencoded_from)
    return media, probed.data


def video_media(index: int, data: bytes, ext: str, probed: ProbedVideo,
                source_name: str | None) -> tuple[Media, bytes]:
    """The format entry and the bytes of the index-th video of a sample."""
    media = Media(part=f"vid{index}.{ext}", kind="video", format=ext, width=probed.width,
                  height=probed.height, bytes=len(data), source_name=source_name,
                  duration_s=probed.duration_s, frames=probed.frames, fps=probed.fps,
                  codec=probed.codec)
    return media, data


def fetch_media(members, path, probe, missing_reason: str, where: str):
    """Read one media member by its untrusted source path and probe it.

    Args:
        members: archive or folder access with `read(name) -> bytes | None`.
        path: the source's path of the member.
        probe: `probe_image` or `probe_video`.
        missing_reason: reject reason when the member is absent.
        where: what was searched, for the detail message.

    Returns:
        (normalised name, bytes, probe result).

    Raises:
        MediaError: "unsafe_member_name", `missing_reason`, or the probe's reason.
    """
    from converters.archives import safe_member_name

    name = safe_member_name(path) if isinstance(path, str) else None
    if name is None:
        raise MediaError("unsafe_member_name", repr(path))
    data = members.read(name)
    if data is None:
        raise MediaError(missing_reason, f"{path} not in {where}")
    return name, data, probe(data, path)
