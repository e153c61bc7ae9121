"""Hostile video containers through the converter and the loader: what conversion keeps is what
the loader reads, and a frame index is the frame a sequential decode of every packet shows.

One conversion of one LLaVA-Video source holding every kind (``hostile.HOSTILE_VIDEOS``): the
clips the loader could not read are rejected with their reason; for each kept clip the recorded
frame count and size are the sequential decode's, and the loader's frames (at both Qwen-VL
models' default budget, and densely) are bit for bit that decode's frames at the same indices,
with their true timestamps; keyframe sampling returns keyframes with theirs. The clips whose
packets cannot locate their frames (``hostile.SEQUENTIAL_READS``: no timestamps, no keyframe
flag, or flags the decoder refutes) and only those are read from the start, in both modes.
Sampled by time (``decode_video_at``, what the loader reads), a variable-rate clip
(``hostile.VARIABLE_RATE``) gives the frames presented nearest each of the uniform target times,
with their true timestamps; a constant-rate clip, timed in milliseconds included, gives exactly
the processors' index picks.
"""

from __future__ import annotations

import io
import json

import av
import numpy as np
import pytest

from energon_tasks.families.nemotron_omni.geometry import NEMOTRON_OMNI
from energon_tasks.families.qwen_vl.geometry import QWEN2_5_VL, QWEN3_VL
from energon_tasks.resize import resize_rgb
from energon_tasks.video_decode import (
    decode_video_at,
    decode_video_frames,
    video_frame_pixels,
    video_stream,
)
from tests.conftest import read_samples, run_cli
from tests.converters import hostile as h

SIZE = (24, 32)  #: (height, width) the frames are compared at (a resize, as the loader's)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile_videos")
    clips = h.HOSTILE_VIDEOS
    files = {f"v/{name}.{ext}": build() for name, (build, ext, _) in clips.items()}
    records = [h.video_record(name, f"v/{name}.{ext}") for name, (_, ext, _) in clips.items()]
    source = h.write_llava_video(root / "LLaVA-Video-178K", {
        "hostile": {"records": records, "extracted": files}})
    out = root / "out"
    run_cli("converters", "llava-video", "--source", str(source), "--out", str(out),
            "--val-fraction", "0", "--shard-size", "4")
    kept = {s["json"]["source"]["ids"][0]: s for s in read_samples(out).values()}
    return clips, out, kept


def sequential(data: bytes) -> tuple[list, list]:
    """Every frame of a sequential decode of the loader's stream: (pixels, (seconds, key));
    seconds from the frames' pts, or frame count / rate where the pts do not rise frame after
    frame (AVI's decode-order stamps: they are no presentation times)."""
    with av.open(io.BytesIO(data)) as container:
        stream = video_stream(container)
        base, rate = float(stream.time_base), float(stream.average_rate or 0)
        frames = [(video_frame_pixels(f, SIZE[::-1]), f.pts, f.key_frame)
                  for f in container.decode(stream)]
    pts = [f[1] for f in frames]
    if None in pts:
        seconds = [None] * len(pts)
    elif all(a < b for a, b in zip(pts, pts[1:])):
        seconds = [(p - pts[0]) * base for p in pts]
    else:
        seconds = [k / rate for k in range(len(pts))]
    return [f[0] for f in frames], [(s, f[2]) for s, f in zip(seconds, frames)]


def kept_video(converted, name: str) -> tuple[dict, bytes, list, list]:
    """(media entry, stored bytes, sequential decode's frames, their (seconds, key)) of a kept
    clip."""
    sample = converted[2][name]
    media = sample["json"]["media"][0]
    data = sample[media["part"]]
    return (media, data, *sequential(data))


def test_the_clips_the_loader_cannot_read_are_rejected(converted):
    clips, out, kept = converted
    reasons = {r["id"]: r["reason"] for r in map(json.loads, (out / "rejects.jsonl").open())}
    assert reasons == {name: why for name, (_, _, why) in clips.items() if why}
    assert set(kept) == {name for name, (_, _, why) in clips.items() if not why}


@pytest.mark.parametrize("name", [n for n, (_, _, why) in h.HOSTILE_VIDEOS.items() if not why])
def test_loader_frames_are_the_sequential_decode_frames(converted, name):
    media, data, every, stamps = kept_video(converted, name)
    first = stream_size(data)
    assert media["frames"] == len(every) and (media["width"], media["height"]) == first
    picks_sets = [geo.video_frame_indices(media["frames"], media["fps"])
                  for geo in (QWEN2_5_VL, QWEN3_VL)]
    picks_sets += [list(range(1, len(every), 3)), [len(every) - 2, len(every) - 1]]
    for picks in picks_sets:
        video = decode_video_frames(data, picks, size=SIZE, max_source_pixels=10**8,
                                    frames=media["frames"])
        assert video.indices == tuple(picks)
        assert video.sequential == (name in h.SEQUENTIAL_READS), picks
        assert np.array_equal(video.frames, np.stack([every[i] for i in picks])), picks
        if stamps[0][0] is not None:
            np.testing.assert_allclose(video.timestamps, [stamps[i][0] for i in picks],
                                       atol=1e-9)


@pytest.mark.parametrize("name", sorted(h.VARIABLE_RATE))
def test_a_variable_rate_clip_is_sampled_uniformly_in_time(converted, name):
    media, data, every, stamps = kept_video(converted, name)
    seconds = np.array([second for second, _ in stamps])  # each frame's, from its decoded pts
    for geo in (QWEN2_5_VL, QWEN3_VL, NEMOTRON_OMNI):
        positions = geo.video_frame_positions(media["frames"], media["fps"])
        # uniform over the clip: from the first frame's time to the last's, n targets
        targets = np.linspace(seconds[0], seconds[-1], len(positions))
        shown = [int(np.argmin(np.abs(seconds - target))) for target in targets]
        video = decode_video_at(data, positions, size=SIZE, max_source_pixels=10**8,
                                frames=media["frames"])
        assert video.variable_rate and video.indices == tuple(shown), geo.name
        assert np.array_equal(video.frames, np.stack([every[i] for i in shown]))
        np.testing.assert_allclose(video.timestamps, seconds[shown], atol=1e-9)
        if name == "vfr_30_then_5":  # by index, most picks crowd the 30 fps first third
            by_index = geo.video_frame_indices(media["frames"], media["fps"])
            assert sum(i < 60 for i in by_index) > sum(i < 60 for i in shown) + 2, geo.name


@pytest.mark.parametrize("name", [n for n, (_, _, why) in h.HOSTILE_VIDEOS.items()
                                  if not why and n not in h.VARIABLE_RATE])
def test_a_constant_rate_clip_sampled_by_time_gives_the_processors_indices(converted, name):
    media, data, every, _ = kept_video(converted, name)
    count = media["frames"]
    sets = [geo.video_frame_positions(count, media["fps"])
            for geo in (QWEN2_5_VL, QWEN3_VL, NEMOTRON_OMNI)]
    if name == "mkv_30fps_ms":  # steps of 33 and 34 ms: every count, ties (k + 0.5) included
        sets += [np.linspace(0, count - 1, n).tolist() for n in range(2, count + 1)]
    for positions in sets:
        picks = [round(p) for p in positions]
        video = decode_video_at(data, positions, size=SIZE, max_source_pixels=10**8,
                                frames=count)
        assert video.indices == tuple(picks) and not video.variable_rate, len(positions)
        assert np.array_equal(video.frames, np.stack([every[i] for i in picks]))


@pytest.mark.parametrize("name", h.MPEG4_AVIS)
def test_an_mpeg4_avi_with_b_frames_shows_its_source_frames_in_order(converted, name):
    """Frame k of the sequential decode (which the loader's reads equal, above) is the k-th frame
    the encoder was given, at k / 24 s: each decoded frame is nearest its own source frame."""
    media, _, every, stamps = kept_video(converted, name)
    sources = [resize_rgb(frame, *SIZE[::-1]).astype(np.int16)
               for frame in h.textured_frames(48, 64, 48)]
    nearest = [int(np.argmin([np.abs(frame - source).mean() for source in sources]))
               for frame in every]
    assert media["frames"] == 48 and nearest == list(range(48))
    np.testing.assert_allclose([second for second, _ in stamps], np.arange(48) / 24, atol=1e-9)


def stream_size(data: bytes) -> tuple[int, int]:
    with av.open(io.BytesIO(data)) as container:
        stream = video_stream(container)
        return stream.width, stream.height


@pytest.mark.parametrize("name", ["mp4_bframes", "mpegts", "avi_bframes", "vfr", "open_gop",
                                  "cover_art_first", "av1_hidden_frames"])
def test_keyframe_sampling_gives_the_nearest_keyframes_and_their_times(converted, name):
    media, data, every, stamps = kept_video(converted, name)
    picks = QWEN3_VL.video_frame_indices(media["frames"], media["fps"])
    video = decode_video_frames(data, picks, size=SIZE, max_source_pixels=10**8,
                                frames=media["frames"], sampling="keyframe")
    keys = [i for i, (_, key) in enumerate(stamps) if key]
    for pick, index, second in zip(picks, video.indices, video.timestamps, strict=True):
        assert stamps[index][1], f"frame {index} is not a keyframe"
        nearest = min(abs(stamps[k][0] - stamps[pick][0]) for k in keys)
        assert abs(stamps[index][0] - stamps[pick][0]) == pytest.approx(nearest)
        assert second == pytest.approx(stamps[index][0])
    assert np.array_equal(video.frames, np.stack([every[i] for i in video.indices]))
    assert video.decoded_frames == len(set(video.indices))  # each keyframe decoded alone


@pytest.mark.parametrize("name", sorted(h.SEQUENTIAL_READS))
def test_keyframe_sampling_of_a_sequential_read_gives_the_exact_frames(converted, name):
    media, data, every, _ = kept_video(converted, name)
    with av.open(io.BytesIO(data)) as container:
        flags = {p.is_keyframe for p in container.demux(video_stream(container)) if p.size}
    assert flags == {"hevc_unflagged": {False}, "hevc_no_stss": {True}}.get(name, {False, True})
    picks = QWEN3_VL.video_frame_indices(media["frames"], media["fps"])
    video = decode_video_frames(data, picks, size=SIZE, max_source_pixels=10**8,
                                frames=media["frames"], sampling="keyframe")
    assert video.sequential and video.indices == tuple(picks)
    assert np.array_equal(video.frames, np.stack([every[i] for i in picks]))


@pytest.mark.parametrize(("name", "index", "recorded"), [
    ("two_streams", 0, (64, 48, 36)),  # the first of two videos
    ("cover_art_first", 1, (64, 48, 48)),  # the video, not the cover picture ahead of it
])
def test_the_recorded_stream_is_the_one_read(converted, name, index, recorded):
    media, data, _, _ = kept_video(converted, name)
    assert (media["width"], media["height"], media["frames"]) == recorded
    with av.open(io.BytesIO(data)) as container:
        covers = [(s.index, s.width, s.height) for s in container.streams.video
                  if s.disposition & av.stream.Disposition.attached_pic]
        frames = [video_frame_pixels(f, SIZE[::-1]) for f in container.decode(video=index)]
    assert covers == ([(0, 40, 30)] if name == "cover_art_first" else [])
    picks = [0, 17, recorded[2] - 1]
    video = decode_video_frames(data, picks, size=SIZE, max_source_pixels=10**8,
                                frames=recorded[2])
    assert np.array_equal(video.frames, np.stack([frames[i] for i in picks]))
