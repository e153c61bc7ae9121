"""Hostile sources for the converter tests: the hub's layouts, filled with the worst inputs.

Each builder writes a local folder with a dataset's exact schema and layout (README card,
parquet / JSON annotations, zips / tar.gz parts, via lookalikes.files) and returns it
with the reject reason expected for each planted row. Media are built here by hand: images whose
header lies about their size or whose data is damaged, zip members whose CRC does not match,
truncated archives, videos with one frame, a broken moov, or a frame count claimed in the header;
and the containers that put a frame index and a frame's time to the test (``hostile_videos``):
MPEG-TS, MPEG-4 AVIs with B-frames (FFmpeg's, adaptive runs, DivX / Xvid "packed"), variable
frame rate (random steps, and 30 fps dropping to 5 fps), 30 fps timed in milliseconds, an open
GOP with negative DTS, a zero ``mdhd`` timescale, a corrupt middle of ``mdat``, a clip cut at an
open-GOP keyframe, two video streams, a cover picture ahead of the video, AV1 with hidden frames,
HEVC whose packets are flagged no keyframe or all keyframes.
"""

from __future__ import annotations

import io
import json
import struct
import zipfile
import zlib
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from datasets import Features, Image, List, Value
from PIL import Image as PILImage

from lookalikes.files import (
    fresh_dir,
    write_card,
    write_json,
    write_parquet,
    write_tar_gz,
    write_zip,
)
from lookalikes.media import moving_square_clip

_TURN = {"role": Value("string"), "content": Value("string")}
MANTIS_FEATURES = Features({"id": Value("string"), "images": List({"bytes": Value("binary"),
                                                                   "path": Value("string")}),
                            "conversation": List(_TURN), "source": Value("string")})
INFOVQA_FEATURES = Features({"image": Image(), "question": Value("string"),
                             "answer": List(Value("string"))})


# ---- media -------------------------------------------------------------------------------------

def png(width: int = 48, height: int = 32, mode: str = "RGB", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    if mode == "I;16":
        image = PILImage.fromarray(rng.integers(0, 65535, (height, width), dtype=np.uint16))
    else:
        image = PILImage.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def jpeg(width: int = 64, height: int = 48, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    PILImage.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(
        buf, "JPEG", quality=90)
    return buf.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims `width` x `height` (CRC fixed up) over a tiny real image."""
    data = bytearray(png())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def png_damaged() -> bytes:
    """A PNG with a valid header whose image data is garbage (its zlib stream fails)."""
    data = bytearray(png(64, 64, seed=3))
    start = data.index(b"IDAT") + 4
    data[start + 8:start + 40] = bytes(range(32))
    crc_at = start + struct.unpack(">I", data[start - 8:start - 4])[0]
    data[crc_at:crc_at + 4] = struct.pack(">I", zlib.crc32(bytes(data[start - 4:crc_at])))
    return bytes(data)


def jpeg_damaged() -> bytes:
    """A JPEG with a valid header that ends inside its scan (no EOI): decoding fails."""
    data = jpeg(256, 192, seed=4)
    return data[: data.index(b"\xff\xda") + 40]


def clip(seconds: float = 1.0, fps: int = 8) -> bytes:
    return moving_square_clip("left", "red", size=(32, 24), fps=fps, seconds=seconds)


def one_frame_clip() -> bytes:
    return moving_square_clip("left", "red", size=(32, 24), fps=8, seconds=1 / 8)


def remux(data: bytes, fmt: str, *, select=lambda packets: packets, keyframe=None) -> bytes:
    """The first video stream of `data` copied (no re-encoding) into a container `fmt`: the
    packets `select(packets)` keeps, each flagged a keyframe as `keyframe(packet)` says (None:
    as read)."""
    out = io.BytesIO()
    with av.open(io.BytesIO(data), "r") as src, av.open(out, "w", format=fmt) as dst:
        stream = dst.add_stream_from_template(src.streams.video[0])
        for packet in select([p for p in src.demux(src.streams.video[0]) if p.size]):
            if keyframe is not None:
                packet.is_keyframe = keyframe(packet)
            packet.stream = stream
            dst.mux(packet)
    return out.getvalue()


def cut_clip(drop: int = 1) -> bytes:
    """A clip remuxed without its first `drop` packets: it starts on a frame that references the
    dropped keyframe."""
    return remux(clip(seconds=2.0), "matroska", select=lambda packets: packets[drop:])


def mjpeg_claiming(width: int, height: int) -> bytes:
    """A two-frame 16x16 MJPEG AVI whose frames' JPEG headers (SOF0) and stream say
    `width` x `height` (nothing that large is ever encoded)."""
    out = io.BytesIO()
    with av.open(out, "w", format="avi") as container:
        stream = container.add_stream("mjpeg", rate=2)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuvj420p"
        for value in (90, 160):
            frame = av.VideoFrame.from_ndarray(np.full((16, 16, 3), value, np.uint8), "rgb24")
            for packet in stream.encode(frame.reformat(format="yuvj420p")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    data = bytearray(out.getvalue())
    at = 0
    while (at := data.find(b"\xff\xc0", at + 1)) != -1:  # SOF0: FFC0 len(2) prec(1) H(2) W(2)
        data[at + 5:at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def broken_moov_clip() -> bytes:
    """An mp4 whose moov atom (the index) is overwritten with junk."""
    data = bytearray(clip())
    at = data.index(b"moov")
    data[at + 4:at + 200] = bytes(196)
    return bytes(data)


def avi_claiming_frames(claimed: int = 10**9) -> tuple[bytes, int]:
    """An MPEG-4 AVI whose headers claim `claimed` frames; returns (bytes, real frame count)."""
    buf = io.BytesIO()
    frames = 12
    with av.open(buf, "w", format="avi") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        for i in range(frames):
            image = np.full((24, 32, 3), 20 * i, np.uint8)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    data = bytearray(buf.getvalue())
    avih = data.index(b"avih") + 8
    data[avih + 16:avih + 20] = struct.pack("<I", claimed)  # dwTotalFrames
    strh = data.index(b"strh") + 8
    data[strh + 32:strh + 36] = struct.pack("<I", claimed)  # dwLength of the video stream
    return bytes(data), frames


def textured_frames(count: int, width: int, height: int):
    """Frames of a panning noise texture with the frame number in the corner: every frame
    differs from its neighbours (a frame off by one is seen)."""
    texture = np.random.default_rng(3).integers(0, 256, (height, 4 * width, 3), dtype=np.uint8)
    for i in range(count):
        frame = texture[:, (2 * i) % (3 * width):][:, :width].copy()
        frame[:8, :8] = (9 * i) % 256
        yield frame


def encoded_clip(fmt: str = "mp4", codec: str = "libx264", *, frames: int = 48, fps: int = 24,
                 size: tuple[int, int] = (64, 48), gop: int = 12, open_gop: bool = False,
                 pts: list[int] | None = None, time_base: Fraction | None = None) -> bytes:
    """A clip in container `fmt`: H.264 with 3 B-frames (pyramid; negative DTS in mp4) and a
    keyframe every `gop` frames (`open_gop`: x264's open GOPs), HEVC (libx265) with 3 B-frames,
    AV1 (libsvtav1: hidden frames, shown later by 3-byte packets), or MPEG-4 part 2 with 2
    B-frames; `pts` in `time_base` gives each frame its own time (variable frame rate)."""
    width, height = size
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.options = {"preset": "veryfast", "threads": "1", "x264-params":
                              f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes=3:mbtree=0"
                              + (":open-gop=1" if open_gop else "")}
        elif codec == "libx265":
            stream.options = {"x265-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes=3"
                              ":pools=1:frame-threads=1:log-level=none"}
        elif codec == "libsvtav1":
            stream.options = {"preset": "11", "svtav1-params": f"keyint={gop}:lp=1"}
        else:
            stream.codec_context.max_b_frames, stream.codec_context.gop_size = 2, gop
        if time_base is not None:
            stream.time_base = stream.codec_context.time_base = time_base
        for i, array in enumerate(textured_frames(frames, width, height)):
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[i], time_base
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return out.getvalue()


def _bits(bits: str) -> bytes:
    return bytes(int(bits[at:at + 8], 2) for at in range(0, len(bits), 8))


#: MPEG-4 part 2 start codes: user data, and a VOP (one frame)
_USER_DATA, _VOP = b"\x00\x00\x01\xb2", b"\x00\x00\x01\xb6"
#: a not-coded P-VOP (the placeholder chunk of a packed stream) at 24 fps: coding type 01,
#: modulo time base 0, marker, 5 bits of time increment, marker, vop_coded 0, stuffing
_NOT_CODED_VOP = _VOP + _bits("01" + "0" + "1" + "00000" + "1" + "0" + "01111")


def mpeg4_avi(b_frames: int = 2, *, adaptive: bool = False, packed: bool = False,
              frames: int = 48) -> bytes:
    """MPEG-4 part 2 in AVI (24 fps, 64x48, a keyframe every 12, near-lossless so that each
    decoded frame is recognisably its source frame, ``textured_frames``) with ``b_frames``
    B-frames between anchors (``adaptive``: FFmpeg's ``b_strategy 2`` varies the run), as FFmpeg
    writes it, or ``packed`` as DivX 5 / Xvid write it: each anchor in one chunk with the first
    B-frame shown before it, the other B-frames in chunks of their own, then a not-coded VOP as
    a placeholder, and the user data ``DivX503b1393p`` that tells decoders the stream is packed."""
    codec = av.CodecContext.create("mpeg4", "w")
    codec.width, codec.height, codec.pix_fmt = 64, 48, "yuv420p"
    codec.time_base, codec.framerate = Fraction(1, 24), Fraction(24)
    codec.options = {"bf": str(b_frames), "b_strategy": "2" if adaptive else "0", "g": "12",
                     "sc_threshold": "1000000000", "qmax": "3", "flags": "+bitexact"}
    encoded = []  # (bytes, pts, keyframe) in decode order
    for i, array in enumerate(textured_frames(frames, 64, 48)):
        frame = av.VideoFrame.from_ndarray(array, format="rgb24").reformat(format="yuv420p")
        frame.pts = i
        encoded += [(bytes(p), p.pts, p.is_keyframe) for p in codec.encode(frame)]
    encoded += [(bytes(p), p.pts, p.is_keyframe) for p in codec.encode(None)]
    chunks = [(data, key) for data, _, key in encoded]
    if packed:
        first = encoded[0][0]
        at = first.index(_VOP)
        encoded[0] = (first[:at] + _USER_DATA + b"DivX503b1393p" + first[at:], *encoded[0][1:])
        chunks, at = [], 0
        while at < len(encoded):
            (data, pts, key), shown_before = encoded[at], []
            at += 1
            while at < len(encoded) and encoded[at][1] < pts:
                shown_before.append(encoded[at][0])
                at += 1
            if not shown_before:
                chunks.append((data, key))
                continue
            chunks += [(data + shown_before[0], key), *((b, False) for b in shown_before[1:]),
                       (_NOT_CODED_VOP, False)]
    out = io.BytesIO()
    with av.open(out, "w", format="avi") as container:
        stream = container.add_stream("mpeg4", rate=24)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for number, (data, key) in enumerate(chunks):
            packet = av.Packet(data)
            packet.pts = packet.dts = number
            packet.time_base, packet.stream, packet.is_keyframe = Fraction(1, 24), stream, key
            container.mux(packet)
    return out.getvalue()


def vfr_clip(frames: int = 48) -> bytes:
    """An mp4 whose frames last 20, 33, 50 or 80 ms each (a variable frame rate)."""
    steps = np.random.default_rng(0).choice([20, 33, 50, 80], frames - 1)
    pts = [0, *np.cumsum(steps).tolist()]
    return encoded_clip(pts=pts, time_base=Fraction(1, 1000), frames=frames)


def rate_change_clip() -> bytes:
    """An mp4 at 30 fps for 2 s, then at 5 fps for 4 s (a phone's clip that slows down when
    the scene is still): 80 frames, three quarters of them in the first third of the time."""
    pts = [*range(60), *range(60, 180, 6)]
    return encoded_clip(pts=pts, time_base=Fraction(1, 30), frames=len(pts))


def zero_timescale_clip() -> bytes:
    """An mp4 whose video track's `mdhd` timescale is 0 (its timestamps mean nothing)."""
    data = bytearray(encoded_clip())
    at = data.index(b"mdhd")
    at += 8 + (16 if data[at + 4] == 1 else 8)  # version/flags, then the two dates
    data[at:at + 4] = bytes(4)
    return bytes(data)


def corrupt_mdat_clip() -> bytes:
    """An mp4 with 400 bytes of noise in the middle of its `mdat` (first and last frames intact)."""
    data = bytearray(encoded_clip(frames=72))
    at = data.index(b"mdat")
    middle = at + int.from_bytes(data[at - 4:at], "big") // 2
    data[middle:middle + 400] = np.random.default_rng(1).bytes(400)
    return bytes(data)


def open_gop_cut_clip() -> bytes:
    """An open-GOP clip remuxed from its second keyframe on: the first packet is a keyframe, and
    the B-frames after it that are shown before it reference frames the clip no longer holds."""
    def from_second_key(packets):
        return packets[[i for i, p in enumerate(packets) if p.is_keyframe][1]:]

    return remux(encoded_clip(open_gop=True), "mp4", select=from_second_key)


def two_stream_clip() -> bytes:
    """An mp4 with two video streams: 36 frames of 64x48, then 24 frames of 32x24."""
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        streams = []
        for width, height in ((64, 48), (32, 24)):
            stream = container.add_stream("libx264", rate=24)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"preset": "veryfast", "threads": "1",
                              "x264-params": "keyint=12:min-keyint=12:scenecut=0:bframes=3"}
            streams.append(stream)
        for i, array in enumerate(textured_frames(36, 64, 48)):
            container.mux(streams[0].encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
            if i < 24:
                small = np.ascontiguousarray(array[::2, ::2])
                container.mux(streams[1].encode(av.VideoFrame.from_ndarray(small, "rgb24")))
        for stream in streams:
            container.mux(stream.encode(None))
    return out.getvalue()


def _mp4_boxes(data: bytes, start: int = 0, end: int | None = None):
    """(type, offset, size) of each mp4 box from `start` to `end` (32-bit sizes)."""
    at, end = start, len(data) if end is None else end
    while at < end:
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        yield kind, at, size
        at += size


def cover_art_first_clip() -> bytes:
    """An mp4 whose first video stream is its cover art (a 40x30 JPEG, an attached picture),
    ahead of the video (48 frames of 64x48 H.264): the muxer writes the cover in the `moov`'s
    `udta` after the `trak`; that box is moved first (sizes unchanged, the offsets stay valid)."""
    out = io.BytesIO()
    with av.open(io.BytesIO(encoded_clip()), "r") as src, av.open(out, "w", format="mp4") as dst:
        video = dst.add_stream_from_template(src.streams.video[0])
        cover = dst.add_stream("mjpeg", rate=1)
        cover.width, cover.height, cover.pix_fmt = 40, 30, "yuvj420p"
        cover.disposition = av.stream.Disposition.attached_pic
        picture = av.Packet(jpeg(40, 30, seed=5))
        picture.stream = cover
        dst.mux(picture)
        for packet in src.demux(src.streams.video[0]):
            if packet.size:
                packet.stream = video
                dst.mux(packet)
    data = out.getvalue()
    _, moov, size = next(box for box in _mp4_boxes(data) if box[0] == b"moov")
    children = sorted(_mp4_boxes(data, moov + 8, moov + size), key=lambda box: box[0] != b"udta")
    return data[:moov + 8] + b"".join(data[at:at + n] for _, at, n in children) + \
        data[moov + size:]


def without_stss(data: bytes) -> bytes:
    """An mp4 whose sync-sample box (`stss`) is renamed `free`: every packet reads as a
    keyframe (what a muxer that never writes the box gives)."""
    data = bytearray(data)
    at = data.index(b"stss")
    data[at:at + 4] = b"free"
    return bytes(data)


#: name -> (builder, extension, the reject reason expected, or None: kept and frame-exact)
HOSTILE_VIDEOS = {
    "mp4_bframes": (encoded_clip, "mp4", None),
    "mpegts": (lambda: encoded_clip("mpegts"), "ts", None),
    "avi_bframes": (lambda: encoded_clip("avi", "mpeg4"), "avi", None),
    # MPEG-4 part 2 in AVI, near-lossless (each frame recognisably its source frame): B-frame
    # runs of varying length, and "packed" B-frames (DivX 5 / Xvid) with one and with two
    "avi_mpeg4_adaptive_b": (lambda: mpeg4_avi(3, adaptive=True), "avi", None),
    "avi_mpeg4_packed": (lambda: mpeg4_avi(1, packed=True), "avi", None),
    "avi_mpeg4_packed_2b": (lambda: mpeg4_avi(2, packed=True), "avi", None),
    # H.264 with B-frames in AVI: the packets' pts count decode order (a sequential read)
    "avi_h264_bframes": (lambda: encoded_clip("avi"), "avi", None),
    "vfr": (vfr_clip, "mp4", None),
    "vfr_30_then_5": (rate_change_clip, "mp4", None),
    # a constant 30 fps in milliseconds: steps of 33 and 34 (the time base's rounding)
    "mkv_30fps_ms": (lambda: remux(encoded_clip(fps=30, frames=60), "matroska"), "mkv", None),
    "open_gop": (lambda: encoded_clip(open_gop=True), "mp4", None),
    "open_gop_cut": (open_gop_cut_clip, "mp4", None),
    "two_streams": (two_stream_clip, "mp4", None),
    "raw_h264": (lambda: encoded_clip("h264"), "h264", None),  # no timestamps: a sequential read
    "cover_art_first": (cover_art_first_clip, "mp4", None),
    "av1_hidden_frames": (lambda: encoded_clip(codec="libsvtav1"), "mp4", None),
    # no packet flagged a keyframe (HEVC in Matroska: no parser restores the flags)
    "hevc_unflagged": (lambda: remux(encoded_clip(codec="libx265"), "matroska",
                                     keyframe=lambda packet: False), "mkv", None),
    # every packet flagged a keyframe (the flags lie: planned reads would start on P-frames)
    "hevc_no_stss": (lambda: without_stss(encoded_clip(codec="libx265")), "mp4", None),
    "zero_timescale": (zero_timescale_clip, "mp4", "too_few_frames"),
    "corrupt_mdat": (corrupt_mdat_clip, "mp4", "unreadable_video"),
    "cut": (cut_clip, "mkv", "no_leading_keyframe"),
}
#: the MPEG-4 part 2 AVIs of 48 ``textured_frames``, near-lossless: frame k is source frame k
MPEG4_AVIS = ("avi_mpeg4_adaptive_b", "avi_mpeg4_packed", "avi_mpeg4_packed_2b")
#: the kept clips whose frames are not evenly spaced in time (sampled at their own times)
VARIABLE_RATE = {"vfr", "vfr_30_then_5"}
#: the kept clips whose frames the loader reads by a decode from the start, and why
SEQUENTIAL_READS = {
    "raw_h264": "no packet has a timestamp",
    "avi_h264_bframes": "the packets' timestamps count decode order while the codec reorders",
    "avi_mpeg4_packed": "the packets' timestamps count decode order while the codec reorders",
    "avi_mpeg4_packed_2b": "a packet holds two frames (packed B-frames): its pts is no frame's",
    "hevc_unflagged": "no packet is flagged a keyframe",
    "hevc_no_stss": "every packet is flagged a keyframe: the decoder refutes the planned read",
}


def zip_with_bad_crc(members: list[tuple[str, bytes]], damaged: str) -> bytes:
    """A stored zip whose member `damaged` has one flipped byte (its CRC no longer matches)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members:
            zf.writestr(name, data)
    raw = bytearray(buf.getvalue())
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as zf:
        info = zf.getinfo(damaged)
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    raw[start + 5] ^= 0xFF
    return bytes(raw)


def zip_bomb(path: Path, name: str, size: int) -> None:
    """A deflated zip holding `size` zero bytes as one member (~size / 1000 on disk)."""
    chunk = bytes(1 << 20)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open(name, "w", force_zip64=True) as member:
            for _ in range(size // len(chunk)):
                member.write(chunk)


# ---- sources -------------------------------------------------------------------------------------

def mantis_row(row_id: str, text: str, paths: list | None, answer: str = "ok") -> dict:
    return {"id": row_id, "source": "hostile",
            "images": None if paths is None else [p if not isinstance(p, str) else
                                                  {"bytes": None, "path": p} for p in paths],
            "conversation": [{"role": "user", "content": text},
                             {"role": "assistant", "content": answer}]}


def write_mantis(root: Path, configs: dict[str, dict], *, features: Features = MANTIS_FEATURES
                 ) -> Path:
    """A Mantis-Instruct layout. `configs`: name -> {"folder": str (default: the name),
    "rows": [row dicts], "zip": [(member, bytes)] | bytes (the whole zip file) | None,
    "parts": {part zip name: [(member, bytes)] | bytes}, "zips_txt": str}."""
    out = fresh_dir(root)
    card = {}
    for config, spec in configs.items():
        folder = out / spec.get("folder", config)
        write_parquet(folder / "train-00000-of-00001.parquet", spec["rows"], features,
                      hf_metadata=False)
        card[config] = {"train": f"{spec.get('folder', config)}/train-*"}
        for name, members in {"train_images.zip": spec.get("zip"),
                              **spec.get("parts", {})}.items():
            if isinstance(members, bytes):
                (folder / name).write_bytes(members)
            elif members is not None:
                write_zip(folder / name, members)
        if "zips_txt" in spec:
            (folder / "train_images_zips.txt").write_text(spec["zips_txt"])
    write_card(out, card, "hostile Mantis", "test source")
    return out


def write_infovqa(root: Path, splits: dict[str, list[dict]]) -> Path:
    out = fresh_dir(root)
    for split, rows in splits.items():
        write_parquet(out / "data" / f"{split}-00000-of-00001.parquet", rows, INFOVQA_FEATURES,
                      hf_metadata=True)
    write_card(out, {"default": {s: f"data/{s}-*" for s in splits}}, "hostile InfoVQA", "test")
    return out


def video_record(rid, video, text: str = "<image>\nWhat moves?") -> dict:
    return {"id": rid, "video": video, "data_source": "0_30_s_academic_v0_1",
            "conversations": [{"from": "human", "value": text},
                              {"from": "gpt", "value": "A square."}]}


def write_llava_video(root: Path, configs: dict[str, dict]) -> Path:
    """A LLaVA-Video-178K layout. `configs`: name -> {"records": list | raw JSON bytes,
    "parts": [[(member, bytes)] | bytes (a whole .tar.gz)], "extracted": {path: bytes},
    "links": {path: target}}."""
    out = fresh_dir(root)
    card = {}
    for config, spec in configs.items():
        folder = out / config
        folder.mkdir(parents=True)
        name = folder / f"{config}_oe_qa_processed.json"
        if isinstance(spec["records"], bytes):
            name.write_bytes(spec["records"])
        else:
            write_json(name, spec["records"])
        card[config] = {"open_ended": f"{config}/*oe*.json"}
        for k, members in enumerate(spec.get("parts", []), start=1):
            part = folder / f"{config}_videos_{k}.tar.gz"
            if isinstance(members, bytes):
                part.write_bytes(members)
            else:
                write_tar_gz(part, members)
        for path, data in spec.get("extracted", {}).items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_bytes(data)
        for path, target in spec.get("links", {}).items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).symlink_to(target)
    write_card(out, card, "hostile LLaVA-Video", "test")
    return out


def raw_json(records: list) -> bytes:
    """JSON text of `records` (lone surrogates allowed: they stay `\\ud800` escapes)."""
    return json.dumps(records).encode()
