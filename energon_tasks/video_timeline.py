"""A clip's timeline from its packets alone: which frame each packet is, and when it is shown.

This module owns what the demuxer's packets (nothing decoded) say about the frames, for the
converter's probe (``converters.media``) and the loader's reader (``energon_tasks.video_decode``)
alike:

- whether the packets' pts are presentation times (``decode_order_stamps``: AVI gives H.264 with
  B-frames its decode positions; ``packed_b_frames``: a DivX / Xvid AVI packet holding two
  frames), and whether, sorted, they are the frames' times (``packets_give_frame_times``) and
  locate the frames (``packets_map_to_frames``);
- whether those times are a constant rate's (``evenly_spaced``), and which frame is shown nearest
  a time on the clip's timeline (``nearest_frames``: video sampled uniformly in time).

Pure Python + numpy.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from fractions import Fraction

import numpy as np


def rising(stamps: list) -> bool:
    """Every stamp is there and each is above the one before."""
    return None not in stamps and all(a < b for a, b in zip(stamps, stamps[1:]))


def decode_order_stamps(stamps: list, reorders: bool) -> bool:
    """True when the packets' timestamps count decode order, not presentation: they rise packet
    after packet although the codec reorders frames (``reorders``: the codec context's
    ``has_b_frames``). AVI stores no presentation times: H.264 with B-frames there gets each
    packet's decode position as its pts, and a frame shown out of decode order carries the
    stamp of another position (a planned read would swap frames 1 and 2)."""
    return bool(reorders) and rising(stamps)


def packed_b_frames(codec: str, packets) -> bool:
    """True when an MPEG-4 part 2 packet of ``packets`` holds two frames: "packed B-frames", as
    DivX 5 and Xvid write AVI (an anchor and the B-frame shown before it in one chunk, a
    not-coded placeholder chunk later; the decoder shows the frames in order). Such a packet's
    pts is no one frame's, and the decoded frames carry other frames' pts."""
    return codec == "mpeg4" and any(bytes(packet).count(_VOP_START) > 1 for packet in packets)


_VOP_START = b"\x00\x00\x01\xb6"  #: an MPEG-4 part 2 frame (video object plane) starts


def packets_give_frame_times(stamps: list, frames: int | None, reorders: bool,
                             packed: bool = False) -> bool:
    """True when the packets' pts, sorted, are the frames' presentation times in frame order:
    every packet has a pts, no two share one, there are as many packets as decoded frames
    (``frames``; None: not known), the pts are presentation times (not
    ``decode_order_stamps``; ``reorders``: the codec's ``has_b_frames``) and no packet holds two
    frames (``packed``: ``packed_b_frames``)."""
    return (bool(stamps) and not packed and None not in stamps
            and len(set(stamps)) == len(stamps) and frames in (None, len(stamps))
            and not decode_order_stamps(stamps, reorders))


def packets_map_to_frames(stamps: list, first_is_key: bool, frames: int | None,
                          reorders: bool, packed: bool = False) -> bool:
    """True when frame k is surely the packet with the k-th smallest pts: the packets give the
    frame times (``packets_give_frame_times``) and the first is a keyframe. Else only a
    sequential decode locates the frames."""
    return first_is_key and packets_give_frame_times(stamps, frames, reorders, packed)


def evenly_spaced(times: Sequence[int]) -> bool:
    """True when the frame times (ascending pts) are those of a constant rate up to the time
    base's rounding: each within one tick of the line through the first and the last (a 30 fps
    clip in milliseconds has steps of 33 and 34)."""
    offsets = np.asarray(times, dtype=np.int64) - times[0]
    steps = len(offsets) - 1
    line = np.arange(len(offsets), dtype=np.int64) * offsets[-1]
    return steps < 1 or bool(np.all(np.abs(offsets * steps - line) <= steps))


def nearest_frames(times: Sequence[int], positions: Sequence[float]) -> list[int]:
    """The frame presented nearest the time of each position (``decode_video_at``): position
    ``p`` is the time ``times[0] + p / (N - 1) * (times[-1] - times[0])``; exact arithmetic, a
    tie to the even position (the processors' rounding: on evenly spaced times, ``round(p)``)."""
    last = len(times) - 1
    if last < 1:
        return [round(p) for p in positions]
    span, picks = Fraction(times[-1] - times[0], last), []
    for position in positions:
        target = times[0] + Fraction(position) * span
        before = min(max(bisect.bisect_right(times, target) - 1, 0), last - 1)
        step = Fraction(target - times[before], times[before + 1] - times[before])
        picks.append(round(before + step))
    return picks
