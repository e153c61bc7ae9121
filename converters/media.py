"""Media verification for the converters: every image and video is proven by decoding, within caps.

Nothing a header claims is trusted:
- an image is opened (format from the bytes, never from the name), its pixel count checked against
  `Limits.max_image_pixels`, then decoded (a JPEG at 1/8 DCT scale, which still runs the whole
  entropy-coded stream; other formats fully). Original bytes are kept; formats that common loaders
  do not decode by extension are re-encoded losslessly to PNG and the original format recorded.
  16-bit, CMYK, palette and other modes are kept as stored (the loader converts them to RGB).
- a video (the stream the loader reads: `energon_tasks.video_decode.video_stream`) is demuxed
  packet by packet (no decoding) to measure its duration from the packets' timestamps, within
  `max_video_frames` / `max_video_seconds`; its frame size must be within `max_video_pixels`
  (stream parameters and, for MJPEG, the first frame's JPEG header, checked before any decode; the
  decoder itself refuses larger frames); the whole stream is decoded in order, as the loader's
  sequential read does: a packet that does not decode rejects the clip, and the frames that come
  out are its frames (what a frame index counts, docs/format.md).
  Where the loader takes the frames' presentation times from the packets
  (`video_timeline.packets_give_frame_times`: to choose the frames shown at the sampled times,
  and to locate them without decoding), the decoded frames' timestamps must be the packets' in
  order, else the clip is rejected; where the packets' timestamps count decode order (H.264
  with B-frames in AVI) or a packet holds two frames (DivX / Xvid "packed B-frames" in AVI),
  the loader reads from the start and the clip is kept. The stored frame count (decoded
  frames), duration and rate are the measured ones; when the container claimed another frame
  count the sample records the fixup `video_frames_measured`. The first
  packet must be a keyframe: flagged one by the container or, where it is not, decoded to one (the
  first frame out is that packet's, and a keyframe).

`MediaError.reason` is the reject reason recorded for the row.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import asdict, dataclass

import av
from PIL import Image

from contract.errors import MediaError
from energon_tasks.sample_format import IMAGE_EXTENSIONS, Media
from energon_tasks.video_decode import video_stream
from energon_tasks.video_timeline import packed_b_frames, packets_give_frame_times

# PIL aliases that are the same bytes as a stored format (MPO is a JPEG with extra frames).
_FORMAT_ALIASES = {"MPO": "JPEG"}
_MB = 1024 * 1024
#: A video must fill one temporal patch (2 frames) of the models: qwen-vl-utils refuses fewer and
#: the loaders' frame sampling needs two. A one-frame "video" is rejected `too_few_frames`.
MIN_VIDEO_FRAMES = 2


@dataclass(slots=True, frozen=True)
class Limits:
    """Caps on what one media item may cost to verify and store (CLI `--max-*` options)."""

    #: pixels of one stored image (100 MP: a 10000x10000 page; InfoVQA's largest are ~55 MP)
    max_image_pixels: int = 100_000_000
    #: bytes of one archive member (or extracted file); larger ones are never read into memory
    max_member_bytes: int = 512 * _MB
    #: frames and seconds of one video (LLaVA-Video-178K's longest clips are 3 minutes)
    max_video_frames: int = 300_000
    max_video_seconds: float = 3 * 3600.0
    #: pixels of one video frame (PIL's decompression-bomb limit for an image, 89,478,485)
    max_video_pixels: int = Image.MAX_IMAGE_PIXELS or 89_478_485

    def fingerprint(self) -> dict:
        return asdict(self)


DEFAULT_LIMITS = Limits()


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
    duration_s: float  #: measured from the packets' timestamps
    frames: int  #: frames a sequential decode of the stream gives
    fps: float
    codec: str
    claimed_frames: int  #: what the container said (0: nothing)


def _decode_error(name: str, exc: BaseException) -> MediaError:
    return MediaError("undecodable_image", f"{name}: {type(exc).__name__}: {exc}")


def probe_image(data: bytes, name: str = "", limits: Limits = DEFAULT_LIMITS) -> ProbedImage:
    """Format and size from the bytes, the pixel cap, then a decode that proves the image whole.

    Raises:
        MediaError: "undecodable_image" (cannot open or decode), "image_too_large" (over
            `limits.max_image_pixels`, decided from the header before decoding).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
        fmt = _FORMAT_ALIASES.get(img.format or "", img.format or "")
        width, height = img.size
    except Image.DecompressionBombError as exc:
        raise MediaError("image_too_large", f"{name}: {exc}") from None
    except Exception as exc:  # PIL raises many types for corrupt data
        raise _decode_error(name, exc) from None
    if width * height > limits.max_image_pixels:
        raise MediaError("image_too_large", f"{name}: {width}x{height} is over "
                         f"--max-image-pixels {limits.max_image_pixels}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            if fmt == "JPEG":
                img.draft(img.mode, (max(1, width // 8), max(1, height // 8)))
            img.load()
    except Exception as exc:
        raise _decode_error(name, exc) from None
    if fmt in IMAGE_EXTENSIONS:
        return ProbedImage(data, IMAGE_EXTENSIONS[fmt], fmt.lower(), width, height, None)
    # Decodable by PIL, but not a format loaders expect by extension: lossless PNG copy.
    if img.mode not in ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"):
        img = img.convert("RGBA" if "A" in img.getbands() else "RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return ProbedImage(buf.getvalue(), "png", "png", width, height, fmt.lower() or "unknown")


def _video_error(reason: str, name: str, exc: BaseException) -> MediaError:
    return MediaError(reason, f"{name}: {type(exc).__name__}: {exc}")


def _check_pixels(name: str, width: int, height: int, limits: Limits, where: str) -> None:
    if width * height > limits.max_video_pixels:
        raise MediaError("video_too_large", f"{name}: {width}x{height} frames ({where}) are over "
                         f"--max-video-pixels {limits.max_video_pixels}")


def _first_packet_checks(packet, codec: str, name: str, limits: Limits) -> None:
    """An MJPEG frame's size is read from its JPEG header (nothing decoded) before any decode."""
    if codec in ("mjpeg", "jpeg2000", "png"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                size = Image.open(io.BytesIO(bytes(packet))).size
        except Image.DecompressionBombError:
            size = (limits.max_video_pixels + 1, 1)
        except Exception:  # noqa: BLE001 - the decode below reports a damaged frame
            return
        _check_pixels(name, *size, limits, "its first frame's header")


def _count_packets(container, stream, name: str,
                   limits: Limits) -> tuple[list, float, bool, bool]:
    """(each video packet's pts, seconds they span, whether the first is flagged a keyframe,
    whether a packet holds two frames: ``packed_b_frames``) by demuxing only; caps checked as it
    goes."""
    count, low, high, stamps, first_key, packed = 0, None, None, [], False, False
    base = float(stream.time_base) if stream.time_base else None
    codec = stream.codec_context.name
    for packet in container.demux(stream):
        if not packet.size:  # the demuxer's flush packet
            continue
        if not count:
            first_key = packet.is_keyframe
            _first_packet_checks(packet, codec, name, limits)
        count += 1
        stamps.append(packet.pts)
        packed = packed or packed_b_frames(codec, (packet,))
        if count > limits.max_video_frames:
            raise MediaError("video_too_long", f"{name}: more than --max-video-frames "
                             f"{limits.max_video_frames} frames")
        stamp = packet.pts if packet.pts is not None else packet.dts
        if stamp is not None and base:
            end = stamp + (packet.duration or 0)
            low = stamp if low is None else min(low, stamp)
            high = end if high is None else max(high, end)
            if (high - low) * base > limits.max_video_seconds:
                raise MediaError("video_too_long", f"{name}: longer than --max-video-seconds "
                                 f"{limits.max_video_seconds:g}")
    seconds = (high - low) * base if low is not None and base else 0.0
    return stamps, seconds, first_key, packed


def _decode_all(data: bytes, name: str, limits: Limits) -> tuple[list, int, int, bool]:
    """(each frame's pts, width, height, whether the first is a keyframe) of a sequential decode
    of the whole stream, as the loader's sequential read decodes it (a fresh demuxer from the
    first byte). The deblocking filter is skipped (~30 % of an H.264 decode): it changes pixels,
    never which frames decode."""
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = video_stream(container)
        stream.codec_context.options = {"max_pixels": str(limits.max_video_pixels),
                                        "skip_loop_filter": "all"}
        stream.thread_type = "AUTO"
        stamps, width, height, key = [], 0, 0, False
        for frame in container.decode(stream):
            if not stamps:
                width, height, key = frame.width, frame.height, frame.key_frame
                _check_pixels(name, width, height, limits, "decoded")
            stamps.append(frame.pts)
    return stamps, width, height, key


def probe_video(data: bytes, name: str = "", limits: Limits = DEFAULT_LIMITS) -> ProbedVideo:
    """Measure the duration by demuxing, then decode the whole stream as the loader would.

    Raises:
        MediaError: "unreadable_video" (cannot open, demux or decode), "zero_frame_video" (no
            video stream or no frame), "too_few_frames" (one frame), "video_too_long" (over the
            frame or duration cap), "video_too_large" (frames over `max_video_pixels`: from the
            stream parameters and, for MJPEG, the first frame's JPEG header, before decoding;
            the decoder is capped too), "no_leading_keyframe" (the first packet is neither
            flagged a keyframe nor decodes to one).
    """
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams:
                raise MediaError("unreadable_video", f"{name}: no stream can be read (a damaged "
                                 "or missing index, e.g. the mp4 moov atom)")
            stream = video_stream(container)
            if stream is None:
                raise MediaError("zero_frame_video", f"{name}: no video stream")
            _check_pixels(name, stream.codec_context.width, stream.codec_context.height,
                          limits, "as the stream parameters say")
            # the decoder refuses frames over the cap before allocating them (a stream whose
            # parameters understate the size)
            stream.codec_context.options = {"max_pixels": str(limits.max_video_pixels)}
            claimed = int(stream.frames or 0)
            packets, seconds, first_key, packed = _count_packets(container, stream, name,
                                                                 limits)
            if not packets and claimed:
                raise MediaError("unreadable_video", f"{name}: the container lists {claimed} "
                                 "frames but none can be read")
            if not packets:
                raise MediaError("zero_frame_video", f"{name}: the video stream has no frames")
            if len(packets) < MIN_VIDEO_FRAMES:
                raise MediaError("too_few_frames", f"{name}: {len(packets)} frame; a video needs "
                                 f"{MIN_VIDEO_FRAMES} (one temporal patch)")
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            codec = stream.codec_context.name
            reorders = stream.codec_context.has_b_frames
        stamps, width, height, decoded_key = _decode_all(data, name, limits)
        frames = len(stamps)
        if frames == 0:
            raise MediaError("unreadable_video", f"{name}: {len(packets)} packets, no frame "
                             "decodes")
        if not first_key and not (decoded_key and stamps[:1] == packets[:1]):
            raise MediaError("no_leading_keyframe", f"{name}: the first packet is not a keyframe, "
                             "nor is the first frame decoded (a cut clip: its first frames "
                             "reference frames it does not hold)")
        if frames < MIN_VIDEO_FRAMES:
            raise MediaError("too_few_frames", f"{name}: {frames} frame decodes of "
                             f"{len(packets)} packets; a video needs {MIN_VIDEO_FRAMES}")
        if packets_give_frame_times(packets, frames, reorders, packed) and \
                sorted(packets) != stamps:
            raise MediaError("unreadable_video", f"{name}: the decoded frames' timestamps are "
                             "not the packets' (frames cannot be located without decoding)")
        fps = frames / seconds if seconds > 0 else rate
        if seconds <= 0:
            seconds = frames / fps if fps else 0.0
        return ProbedVideo(width=int(width), height=int(height), duration_s=round(seconds, 6),
                           frames=frames, fps=round(fps, 6), codec=codec,
                           claimed_frames=claimed)
    except MediaError:
        raise
    except Exception as exc:  # PyAV/FFmpeg errors are many types
        raise _video_error("unreadable_video", name, exc) from None


def probe_frames(data: bytes, name: str = "", limits: Limits = DEFAULT_LIMITS,
                 fps: float = 1.0) -> ProbedVideo:
    """A frame-sequence video (`pack_frames`): every frame's header must give the same size, and
    the first and last frames must decode; `fps` is the rate the frames were taken at.

    Raises:
        MediaError: "zero_frame_video" (no frame), "too_few_frames", "video_too_long",
            "unreadable_video" (a frame that does not open or decode, frames of mixed sizes).
    """
    from energon_tasks.sample_format import unpack_frames

    try:
        frames = unpack_frames(data)
    except Exception as exc:
        raise _video_error("unreadable_video", name, exc) from None
    if not frames:
        raise MediaError("zero_frame_video", f"{name}: the frame folder holds no frame")
    if len(frames) < MIN_VIDEO_FRAMES:
        raise MediaError("too_few_frames", f"{name}: {len(frames)} frame; a video needs "
                         f"{MIN_VIDEO_FRAMES} (one temporal patch)")
    if len(frames) > limits.max_video_frames or len(frames) / fps > limits.max_video_seconds:
        raise MediaError("video_too_long", f"{name}: {len(frames)} frames at {fps:g} fps is "
                         "over --max-video-frames / --max-video-seconds")
    sizes = set()
    for index, frame in enumerate(frames):  # headers of all, a decode of the first and last
        where = f"{name} frame {index}"
        try:
            if index in (0, len(frames) - 1):
                probed = probe_image(frame, where, limits)
                sizes.add((probed.width, probed.height))
            else:
                sizes.add(Image.open(io.BytesIO(frame)).size)
        except MediaError as err:
            raise MediaError("unreadable_video", err.detail) from None
        except Exception as exc:
            raise _video_error("unreadable_video", where, exc) from None
    if len(sizes) != 1:
        raise MediaError("unreadable_video", f"{name}: frames of different sizes {sorted(sizes)}")
    (width, height), = sizes
    return ProbedVideo(width=width, height=height, duration_s=round(len(frames) / fps, 6),
                       frames=len(frames), fps=round(fps, 6), codec="frames",
                       claimed_frames=len(frames))


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


def video_fixups(probed: ProbedVideo) -> list[str]:
    """Fixups of a verified video: its container claimed another frame count."""
    return ["video_frames_measured"] if probed.claimed_frames not in (0, probed.frames) else []


def fetch_media(members, path, probe, missing_reason: str, where: str, limits: Limits):
    """Read one media member by its untrusted source path, within the size cap, and verify it.

    Args:
        members: archive or folder access with `read(name, max_bytes) -> bytes | None`.
        path: the source's path of the member.
        probe: `probe_image` or `probe_video`.
        missing_reason: reject reason when the member is absent.
        where: what was searched, for the detail message.
        limits: the caps.

    Returns:
        (normalised name, bytes, probe result).

    Raises:
        MediaError: "bad_record" (the path is not a string), "unsafe_member_name",
            `missing_reason`, "member_too_large", "unreadable_archive", or the probe's reason.
    """
    from converters.archives import safe_member_name

    if not isinstance(path, str) or not path:
        raise MediaError("bad_record", f"media path {path!r} is not a non-empty string")
    name = safe_member_name(path)
    if name is None:
        raise MediaError("unsafe_member_name", repr(path))
    data = members.read(name, limits.max_member_bytes)
    if data is None:
        raise MediaError(missing_reason, f"{path} not in {where}")
    return name, data, probe(data, path, limits)
