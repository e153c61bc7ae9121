"""Video decoding: exactly the frames asked for, reading no more of the clip than they need.

This module owns what a frame index means and how the chosen frames are read:

- **frame index** ``k`` is the k-th frame of the stream in presentation order, as a sequential
  decode of every packet gives it (docs/format.md): B-frames, negative DTS, open GOPs, variable
  frame rate and timestamps that do not start at 0 change nothing; ``DecodedVideo.timestamps`` are
  the true presentation times of the returned frames (seconds after the first frame);
- **frames chosen by time** (``decode_video_at``, what the loader reads): the frame shown at
  the time of each fractional position (``Geometry.video_frame_positions``), from the packets'
  pts, nothing decoded (``energon_tasks.video_timeline``): on a constant-rate clip frame
  ``round(p)``, the processors' pick; on a variable-rate one the frame presented nearest;
- **the stream** is ``video_stream``'s (the converter's probe and the loader read the same one);
- **planned reads** (``exact``): the packets are demuxed once (no decoding: the container's own
  packet order, keyframe flags and timestamps); each pick needs the packets from the last
  keyframe before it (in decode order, presenting no later than it) up to its own; overlapping
  needs are merged, so the decoder restarts (a flush, no container seek) only where a keyframe
  lies between two picks; packets that are not picks are fed with ``skip_frame = NONREF`` (frames
  no other frame references are not decoded: the kept frames are bit for bit the same); after a
  run's last pick the decoder is drained, never fed the next GOP; one thread (loader workers fill
  the cores); only the picks are converted to RGB, each as it comes out of the decoder, straight
  into its rows of the output (the decoded frame goes back to the decoder's pool; a frame two
  picks share is converted once); the decoder is opened before ``skip_frame`` is first set
  (libdav1d reads it once, when opened: an AV1 decoder opened skipping would never show a
  non-reference pick);
- **the decoder's word over the container's**: a planned run whose first packet does not decode to
  a keyframe or an intra frame (``frame.key_frame``, ``pict_type`` I: flags that call every packet
  a keyframe, e.g. an mp4 without ``stss``), or that leaves a pick undecoded, sends the whole read
  down the sequential path;
- **sequential reads**: a stream whose packets cannot be mapped to frames without decoding (a
  packet without a timestamp, two packets with one, a first packet that is not a keyframe, a
  packet count other than the frames the converter decoded, timestamps that count decode
  order: ``decode_order_stamps``, e.g. H.264 with B-frames in AVI, or a packet holding two
  frames: ``packed_b_frames``, DivX / Xvid AVI) is decoded from its start, and the k-th decoded
  frame is frame k: slower, never wrong (``DecodedVideo.sequential``); its timestamps are the
  frames' presentation timestamps where those rise frame after frame, else (decode-order
  stamps, packed frames) frame count / frame rate (such AVIs have a constant rate);
- ``keyframe`` sampling (``TaskEncoderConfig.video_sampling``): each pick is replaced by the
  keyframe nearest to it in time (the earlier one on a tie), decoded alone; the indices and
  timestamps returned are the keyframes' (two picks may share one). A stream read sequentially
  gives its exact frames instead.

Any failure raises ``MediaError`` with a skip reason, never anything else.
"""

from __future__ import annotations

import bisect
import io
import math
import os
import sys
import tarfile
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from contract.errors import MediaError
from energon_tasks.config import VIDEO_SAMPLINGS
from energon_tasks.decode import _to_rgb
from energon_tasks.resize import resize_rgb
from energon_tasks.sample_format import is_frame_sequence, unpack_frames
from energon_tasks.video_timeline import (
    decode_order_stamps,
    evenly_spaced,
    nearest_frames,
    packed_b_frames,
    packets_give_frame_times,
    rising,
)


@dataclass(slots=True, kw_only=True)
class DecodedVideo:
    """The chosen frames of one video at the planned size."""

    frames: np.ndarray  #: (T, H, W, 3) uint8 RGB, T = number of requested frames
    indices: tuple[int, ...]  #: (T,) frame index of each returned frame (keyframe mode: moved)
    #: (T,) seconds of each returned frame after the first frame; None for a frame sequence (no
    #: container timing: index / ``Media.fps``)
    timestamps: tuple[float, ...] | None
    decoded_frames: int  #: frames the codec decoded (the cost; >= distinct picks)
    seeks: int  #: decoder restarts at a keyframe (the first read included)
    #: the frames came from a decode of the stream from its start (the packets could not locate
    #: them, or a planned run was refuted by the decoder)
    sequential: bool = False
    #: chosen by time (``decode_video_at``) on a clip whose frames are not evenly spaced in time:
    #: ``indices`` are not the positions rounded, and a span must show ``timestamps``, not the
    #: processors' index / fps
    variable_rate: bool = False


def video_stream(container):
    """The stream a clip is read from: its first video stream that is not an attached picture
    (cover art); None when it has none. The converter records this stream's size and frames."""
    import av

    for stream in container.streams.video:
        if not stream.disposition & av.stream.Disposition.attached_pic:
            return stream
    return None


def decode_video_frames(
    data: bytes,
    frame_indices: Sequence[int],
    *,
    size: tuple[int, int],
    max_source_pixels: int,
    name: str = "video",
    frames: int | None = None,
    sampling: str = "exact",
    thread_type: str | None = None,
) -> DecodedVideo:
    """Decode the frames ``frame_indices`` (ascending) of a video, resized to ``size``.

    Args:
        data: the stored bytes (a container, or a frame sequence: ``sample_format.pack_frames``).
        frame_indices: frame indices (presentation order), ascending, no repeats.
        size: planned (height, width).
        max_source_pixels: refuse frames with more pixels than this.
        name: sample key and part, for messages.
        frames: the frame count the converter decoded (``Media.frames``); a packet count that
            differs sends the read down the sequential path. None: trust the packets.
        sampling: "exact" or "keyframe" (``VIDEO_SAMPLINGS``).
        thread_type: PyAV codec threading; None = one thread (planned reads restart the decoder
            often; loader workers already fill the cores).

    Raises:
        MediaError: ``source_too_large`` or ``undecodable_video`` (including a pick past the
            frames the stream holds).
    """
    picks = sorted(set(int(i) for i in frame_indices))
    if list(frame_indices) != picks or not picks or picks[0] < 0:
        raise MediaError("undecodable_video", f"{name}: frame indices must ascend from 0, got "
                         f"{list(frame_indices)[:8]}")
    return _decode(data, picks, None, size, max_source_pixels, name, frames, sampling,
                   thread_type)


def decode_video_at(
    data: bytes,
    positions: Sequence[float],
    *,
    size: tuple[int, int],
    max_source_pixels: int,
    name: str = "video",
    frames: int | None = None,
    sampling: str = "exact",
    thread_type: str | None = None,
) -> DecodedVideo:
    """Decode the frames shown at ``positions`` of a video's timeline (what the loader reads).

    Position ``p`` (``Geometry.video_frame_positions``: 0 is the first frame, ``frames - 1`` the
    last) is the time ``p / (frames - 1)`` of the way from the first frame's presentation to the
    last's, and the frame presented nearest it is read (``video_timeline.nearest_frames``; two
    positions may show the same frame). The frame times are the packets' pts (no decoding).
    On a clip whose times are a constant rate's, or not known from the packets (no timestamps,
    decode-order stamps, a frame sequence), frame ``round(p)`` is read: the processors' picks.
    ``DecodedVideo.variable_rate`` says when the picks came from the times.

    Args:
        positions: non-decreasing fractional frame positions, from 0.
        size, max_source_pixels, name, frames, sampling, thread_type: as ``decode_video_frames``.

    Raises:
        MediaError: ``source_too_large`` or ``undecodable_video``.
    """
    if not positions or any(not 0 <= p < math.inf for p in positions) or \
            any(a > b for a, b in zip(positions, positions[1:])):
        raise MediaError("undecodable_video", f"{name}: frame positions must rise from 0, got "
                         f"{list(positions)[:8]}")
    return _decode(data, None, list(positions), size, max_source_pixels, name, frames,
                   sampling, thread_type)


def _decode(data: bytes, picks: list[int] | None, positions: list[float] | None,
            size: tuple[int, int], max_source_pixels: int, name: str, frames: int | None,
            sampling: str, thread_type: str | None) -> DecodedVideo:
    """The frames ``picks``, or those shown at ``positions`` (the other is None)."""
    import av

    if sampling not in VIDEO_SAMPLINGS:
        raise ValueError(f"sampling {sampling!r}: expected one of {VIDEO_SAMPLINGS}")
    height, width = size
    if is_frame_sequence(data):
        picks = picks or [round(p) for p in positions]
        return _frame_sequence(data, picks, (width, height), max_source_pixels, name)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = video_stream(container)
            if stream is None:
                raise MediaError("undecodable_video", f"{name}: no video stream")
            if stream.width * stream.height > max_source_pixels:
                raise MediaError("source_too_large", f"{name}: {stream.width}x{stream.height} "
                                 f"pixels > max_source_pixels {max_source_pixels}")
            codec = stream.codec_context
            if thread_type is None:
                codec.thread_count = 1
            else:
                codec.thread_type = thread_type
            reader = _Reader(container, stream, frames)
            variable = False
            if picks is None:
                picks, variable = reader.frames_at(positions)
            video = reader.read(picks, (width, height), sampling, name)
            video.variable_rate = variable
            return video
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError, IndexError, ZeroDivisionError) as error:
        raise MediaError("undecodable_video", f"{name}: {type(error).__name__}: {error}") from None


#: buffers that reads write their frames into, reused once no array references them (the most
#: recent ``_POOLED`` of at most ``_POOL_BYTES`` each: one per video of a two-video sample)
_pool: list[bytearray] = []
_pool_lock = threading.Lock()
_POOLED, _POOL_BYTES = 2, 256 << 20


def _new_pool_lock() -> None:
    """A fresh lock in a forked loader worker (a thread of the parent may have held it)."""
    global _pool_lock
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_pool_lock)


def _frames_out(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised uint8 array of ``shape`` for a read's frames: the front of a pooled
    buffer that nothing references but the pool (every array or view of it holds a reference
    to the buffer), else a new buffer, pooled when it is at most ``_POOL_BYTES``."""
    size = math.prod(shape)
    with _pool_lock:
        for buffer in _pool:
            # references: the pool's, this loop's and getrefcount's argument: no array left
            if len(buffer) >= size and sys.getrefcount(buffer) == 3:
                return np.frombuffer(buffer, np.uint8, size).reshape(shape)
        buffer = bytearray(size)
        if size <= _POOL_BYTES:
            _pool.append(buffer)
            del _pool[:-_POOLED]
    return np.frombuffer(buffer, np.uint8, size).reshape(shape)


_INTRA = 1  #: ``av.video.frame.PictureType.I`` (AV_PICTURE_TYPE_I)


class _Unplannable(Exception):
    """The decoder refuted the plan: a run's first packet decoded to no keyframe (nor intra
    frame), or a pick is missing."""


class _Reader:
    """One demuxed stream: its packets in decode order, the keyframes (``keys``) and, when the
    packets' pts are the frames' times, each frame's packet (``order``; ``planned`` when they
    also locate the frames without decoding)."""

    def __init__(self, container, stream, frames: int | None) -> None:
        self.codec = stream.codec_context
        self.base = float(stream.time_base) if stream.time_base else 0.0
        self.rate = float(stream.average_rate or stream.guessed_rate or 0)
        self.packets = [p for p in container.demux(stream) if p.size]
        self.stamps = stamps = [p.pts for p in self.packets]
        reorders = self.codec.has_b_frames
        packed = packed_b_frames(self.codec.name, self.packets)
        self.presentation_stamps = not packed and not decode_order_stamps(stamps, reorders)
        timed = self.base > 0 and packets_give_frame_times(stamps, frames, reorders, packed)
        #: the packets' positions in frame order, when their pts are the frames' times
        self.order = sorted(range(len(stamps)), key=stamps.__getitem__) if timed else []
        self.planned = timed and self.packets[0].is_keyframe  # ``packets_map_to_frames``
        self.keys = [i for i, p in enumerate(self.packets) if p.is_keyframe]
        self.decoded = self.seeks = 0

    def frames_at(self, positions: list[float]) -> tuple[list[int], bool]:
        """(the frames shown at ``positions``, whether the clip's times are not a constant
        rate's): ``video_timeline.nearest_frames`` over the packets' times where those are the
        frames' times and not evenly spaced, else the positions rounded."""
        times = [self.stamps[p] for p in self.order]
        if not times or evenly_spaced(times):
            return [round(p) for p in positions], False
        return nearest_frames(times, positions), True

    def read(self, picks: list[int], size: tuple[int, int], sampling: str,
             name: str) -> DecodedVideo:
        if not self.planned:
            return self._sequential(picks, size, name)
        if picks[-1] >= len(self.order):
            raise MediaError("undecodable_video", f"{name}: frame {picks[-1]} asked, the stream "
                             f"holds {len(self.order)}")
        rank = {packet: k for k, packet in enumerate(self.order)}
        if sampling == "keyframe":
            wanted = [self._nearest_key(self.order[k]) for k in picks]
            runs = [(p, p) for p in sorted(set(wanted))]  # each keyframe decoded alone
        else:
            wanted = [self.order[k] for k in picks]
            runs = self._runs(sorted(set(wanted)))
        rows: dict[int, list[int]] = {}  # packet position -> the output rows showing it
        for row, position in enumerate(wanted):
            rows.setdefault(position, []).append(row)
        out = _frames_out((len(picks), size[1], size[0], 3))
        try:
            self._decode_runs(runs, rows, out, size)
        except _Unplannable:
            return self._sequential(picks, size, name)
        first = self.stamps[self.order[0]]
        return DecodedVideo(
            frames=out, indices=tuple(rank[p] for p in wanted),
            timestamps=tuple((self.stamps[p] - first) * self.base for p in wanted),
            decoded_frames=self.decoded, seeks=self.seeks)

    def _start(self, position: int) -> int:
        """The keyframe a decoder must start from to show the frame of packet ``position``: the
        last one before it in decode order that it does not precede in time (an open GOP's
        leading frames belong to the previous keyframe)."""
        at = bisect.bisect_right(self.keys, position) - 1
        pts = self.packets[position].pts
        while at > 0 and self.packets[self.keys[at]].pts > pts:
            at -= 1
        return self.keys[at]

    def _nearest_key(self, position: int) -> int:
        pts = self.packets[position].pts
        return min(self.keys, key=lambda k: (abs(self.packets[k].pts - pts), k))

    def _runs(self, wanted: list[int]) -> list[tuple[int, int]]:
        """The merged spans [keyframe, last pick] (positions) that decode the packets ``wanted``:
        one decoder run each, restarted by a flush where a keyframe lies between picks."""
        runs: list[tuple[int, int]] = []
        for start, end in sorted((self._start(p), p) for p in wanted):
            if runs and start <= runs[-1][1] + 1:
                runs[-1] = (runs[-1][0], max(runs[-1][1], end))
            else:
                runs.append((start, end))
        return runs

    def _decode_runs(self, runs: list[tuple[int, int]], rows: dict[int, list[int]],
                     out: np.ndarray, size: tuple[int, int]) -> None:
        """Decode ``runs`` and write the frame of each packet in ``rows`` (positions) into its
        rows of ``out`` as it comes out (converted once, however many rows show it); non-picks
        are fed skipping non-reference frames, each run is drained (never fed the next GOP's
        packet).

        Raises:
            _Unplannable: a run's first packet did not decode to a keyframe or intra frame, or a
                pick is missing.
        """
        stamps, packets, decode = self.stamps, self.packets, self.codec.decode
        pts_rows = {stamps[p]: found for p, found in rows.items()}
        shown, skip = set(), None
        if not self.codec.is_open:
            self.codec.open(strict=False)  # with skip_frame DEFAULT (libdav1d reads it here)
        for start, end in runs:
            self._restart()
            key_pts, key = stamps[start], False
            for position in range(start, end + 1):
                if skip != (skip := stamps[position] not in pts_rows):
                    self.codec.skip_frame = "NONREF" if skip else "DEFAULT"
                if frames := decode(packets[position]):
                    key |= self._keep(frames, pts_rows, out, size, shown, key_pts)
            key |= self._keep(decode(None), pts_rows, out, size, shown, key_pts)  # drain
            if not key:
                raise _Unplannable
        if len(shown) != len(pts_rows):
            raise _Unplannable

    def _restart(self) -> None:
        if self.seeks:
            self.codec.flush_buffers()
        self.seeks += 1

    def _keep(self, frames, pts_rows: dict, out: np.ndarray, size: tuple[int, int], shown: set,
              key_pts) -> bool:
        """Write the wanted frames into their rows of ``out``; True when the frame at ``key_pts``
        came out a keyframe or an intra frame (an I-frame flagged a sync sample without a
        recovery point SEI is no H.264 keyframe to FFmpeg)."""
        key = False
        self.decoded += len(frames)
        for frame in frames:
            pts = frame.pts
            if pts == key_pts:
                key = key or bool(frame.key_frame or frame.pict_type == _INTRA)
            found = pts_rows.get(pts)
            if found is not None:
                video_frame_pixels(frame, size, out=out, rows=found)
                shown.add(pts)
        return key

    def _sequential(self, picks: list[int], size: tuple[int, int], name: str) -> DecodedVideo:
        """Every packet decoded in order; the k-th frame out is frame k (``picks`` ascending,
        a repeated pick fills each of its rows)."""
        self._restart()
        self.codec.skip_frame = "DEFAULT"
        out = _frames_out((len(picks), size[1], size[0], 3))
        rows_of: dict[int, list[int]] = {}
        for row, k in enumerate(picks):
            rows_of.setdefault(k, []).append(row)
        shown: list = []  # each decoded frame's pts, in presentation order
        for packet in [*self.packets, None]:
            for frame in self.codec.decode(packet):
                self.decoded += 1
                if len(shown) in rows_of:
                    video_frame_pixels(frame, size, out=out, rows=rows_of[len(shown)])
                shown.append(frame.pts)
            if len(shown) > picks[-1]:
                break
        if len(shown) <= picks[-1]:
            raise MediaError("undecodable_video", f"{name}: frame {picks[-1]} asked, "
                             f"{len(shown)} decode")
        return DecodedVideo(frames=out, indices=tuple(picks),
                            timestamps=self._seconds(shown, picks),
                            decoded_frames=self.decoded, seeks=self.seeks, sequential=True)

    def _seconds(self, shown: list, picks: list[int]) -> tuple[float, ...]:
        """Seconds after frame 0 of the frames ``picks`` of a sequential decode whose frames
        came out with the pts ``shown``: from the pts where they are presentation times (every
        frame has one and they rise), else frame count / frame rate."""
        if self.presentation_stamps and self.base > 0 and rising(shown):
            return tuple((shown[k] - shown[0]) * self.base for k in picks)
        return tuple(k / self.rate if self.rate else 0.0 for k in picks)


def _frame_sequence(data: bytes, picks: list[int], size: tuple[int, int], max_source_pixels: int,
                    name: str) -> DecodedVideo:
    """The chosen frames of a frame-sequence video (a tar of frame images, sample_format): each
    image decoded whole, converted to RGB and resized as a decoded video frame is."""
    try:
        files = unpack_frames(data)
        frames = []
        for pick in (p for p in picks if p < len(files)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(files[pick]))
            if image.width * image.height > max_source_pixels:
                raise MediaError("source_too_large", f"{name}: {image.width}x{image.height} "
                                 f"pixels > max_source_pixels {max_source_pixels}")
            rgb = np.asarray(_to_rgb(image), dtype=np.uint8)
            if (rgb.shape[1], rgb.shape[0]) != size:
                rgb = resize_rgb(rgb, *size)
            frames.append(rgb)
    except MediaError:
        raise
    except (tarfile.TarError, OSError, SyntaxError, ValueError, Image.DecompressionBombError
            ) as error:
        raise MediaError("undecodable_video", f"{name}: {type(error).__name__}: {error}") from None
    if not frames:
        raise MediaError("undecodable_video", f"{name}: no frame in the sequence")
    frames += [frames[-1]] * (len(picks) - len(frames))
    return DecodedVideo(frames=np.stack(frames), indices=tuple(picks),
                        timestamps=None, decoded_frames=len(frames),
                        seeks=0)


_thread = threading.local()


def _reformatter():
    """This thread's PyAV ``VideoReformatter`` (its swscale context is cached across frames of
    the same geometry and format, rebuilt when they change). Used with one scaling thread only:
    a context with slice threads that a forked loader worker inherits hangs the worker when it
    is rebuilt or freed there (its threads were not forked)."""
    if (reformatter := getattr(_thread, "reformatter", None)) is None:
        from av.video.reformatter import VideoReformatter

        reformatter = _thread.reformatter = VideoReformatter()
    return reformatter


def video_frame_pixels(frame, size: tuple[int, int], *, out: np.ndarray | None = None,
                       rows: list[int] | None = None) -> np.ndarray:
    """(H, W, 3) uint8 RGB of a decoded PyAV frame at ``size`` (width, height).

    FFmpeg's rgb24 conversion (the same pixels as ``frame.to_image()``, whose Python row copy
    costs ~10x more), then PIL's bicubic when the size differs (``resize.resize_rgb``), as the
    image path. With ``out`` ((T, H, W, 3)) and ``rows``, the pixels are also written into those
    rows of ``out``.

    The conversion runs through one reformatter per thread (``frame.to_ndarray(format=...)``
    would build a new one, and a new swscale context with its slice threads, for every decoded
    frame: 0.3 ms of a 0.45 ms 360p conversion); the rgb24 array is a view of the converted
    frame's buffer.
    """
    rgb = _reformatter().reformat(frame, format="rgb24", threads=1).to_ndarray()
    width, height = size
    if (rgb.shape[1], rgb.shape[0]) != (width, height):
        if out is None:
            return resize_rgb(rgb, width, height)
        rgb = resize_rgb(rgb, width, height, out=out[rows[0]])  # straight into its first row
        rows = rows[1:]
    if out is not None:
        out[rows] = rgb
    return rgb
