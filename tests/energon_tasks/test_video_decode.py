"""Video decoding (energon_tasks.video_decode): the chosen frames are bit for bit those of a
decode of every frame, read with the fewest packets decoded (from the keyframe before each pick,
non-reference frames skipped, one restart per GOP that holds picks); keyframe sampling; the
keyframe mode through the task encoder (timestamps in the Qwen3-VL span, Qwen2.5-VL's time step,
Nemotron-Omni's frame labels); a variable-rate clip through the converter's probe and the task
encoder: the frames shown at uniform times, and their true times in each family's span and
positions."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from contract.errors import ConfigError
from converters.media import probe_video
from converters.media import video_media as probed_media
from energon_tasks import task_encoder_for
from energon_tasks.config import TaskEncoderConfig
from energon_tasks.task_encoder import cook_conversation
from energon_tasks.video_decode import (
    MediaError,
    decode_video_at,
    decode_video_frames,
    video_frame_pixels,
)
from tests.converters.hostile import encoded_clip, rate_change_clip, remux
from tests.energon_tasks.conftest import (
    b_frame_video_bytes,
    conversation,
    crude,
    video_bytes,
    video_media,
)

BIG = 10**9


def test_video_decodes_only_the_chosen_frames():
    data = video_bytes(120, fps=30, gop=10)
    picks = [0, 40, 80, 119]
    video = decode_video_frames(data, picks, size=(28, 56), max_source_pixels=BIG)
    assert video.frames.shape == (4, 28, 56, 3)
    red = video.frames[:, 14, 28, 0].astype(int)
    np.testing.assert_allclose(red, [2 * i for i in picks], atol=4)
    assert video.decoded_frames <= 1 + 1 + 1 + 10  # from the keyframe before each pick only
    assert video.seeks >= 2
    dense = decode_video_frames(data, list(range(0, 120, 2)), size=(28, 56),
                                max_source_pixels=BIG)
    assert dense.decoded_frames <= 120
    np.testing.assert_allclose(dense.frames[:, 14, 28, 0].astype(int),
                               list(range(0, 240, 4)), atol=4)


@pytest.fixture(scope="module")
def b_frame_clip():
    """150 frames at 30 fps, keyframe every 30, B-frames; and every frame decoded by PyAV."""
    import av

    data = b_frame_video_bytes(150, gop=30)
    with av.open(io.BytesIO(data)) as container:
        every = [frame.to_image() for frame in container.decode(video=0)]
        packets = container.streams.video[0].frames
    assert len(every) == packets == 150
    return data, every


@pytest.mark.parametrize("picks", [
    [0, 37, 74, 112, 149],  # sparse: one seek per pick
    list(range(1, 150, 3)),  # dense: decode forward once the keyframe spacing is known
    [29, 30, 31, 59, 60, 89, 119, 120],  # around keyframes
    [5, 6, 140],
])
def test_video_frames_identical_to_decoding_every_frame(b_frame_clip, picks):
    data, every = b_frame_clip
    size = (56, 84)
    video = decode_video_frames(data, picks, size=size, max_source_pixels=BIG)
    expected = [np.asarray(every[i].resize(size[::-1], Image.BICUBIC)) for i in picks]
    assert np.array_equal(video.frames, np.stack(expected))
    from_keyframes, position = 0, -1  # frames a decoder restarting at keyframes needs
    for pick in picks:
        key = pick // 30 * 30  # keyframe every 30 frames
        from_keyframes += pick - key + 1 if key > position else pick - position
        position = pick
    assert video.decoded_frames <= from_keyframes
    if len(picks) > 40:
        assert video.seeks <= 3  # forward decoding, not a seek per pick
        assert video.decoded_frames < 150


def test_video_skips_non_reference_frames_before_a_pick(b_frame_clip):
    data, _ = b_frame_clip
    video = decode_video_frames(data, [29, 59, 89], size=(56, 84), max_source_pixels=BIG)
    # each pick is the last frame of its 30-frame GOP: 30 frames from its keyframe without
    # skipping; the B-frames nothing references are not decoded
    assert video.seeks <= 3 and video.decoded_frames < 3 * 30 * 0.8


def test_a_read_reuses_the_memory_of_released_frames_never_of_kept_ones(b_frame_clip):
    data, every = b_frame_clip
    size = (56, 84)

    def read(picks):
        return decode_video_frames(data, picks, size=size, max_source_pixels=BIG).frames

    def expected(picks):
        return np.stack([np.asarray(every[i].resize(size[::-1], Image.BICUBIC)) for i in picks])

    def address(frames):
        return frames.__array_interface__["data"][0]

    kept = read([0, 75, 149])
    views = [kept[:, ::2], kept[1]]  # a view alone keeps the memory too
    first = address(kept)
    del kept
    other = read([10, 20, 140])
    assert address(other) != first
    assert np.array_equal(views[0], expected([0, 75, 149])[:, ::2])
    assert np.array_equal(views[1], expected([75])[0])
    del views
    reused = read([1, 2])  # smaller than the released buffer: its front
    assert address(reused) == first
    assert np.array_equal(reused, expected([1, 2]))
    assert np.array_equal(other, expected([10, 20, 140]))


def test_a_pick_past_the_stream_and_bad_indices_are_skip_reasons(b_frame_clip):
    data, _ = b_frame_clip
    for picks in ([3, 150], [5, 4], [-1, 2], []):
        with pytest.raises(MediaError) as error:
            decode_video_frames(data, picks, size=(56, 84), max_source_pixels=BIG)
        assert error.value.reason == "undecodable_video"
    # a frame count other than the packets': the sequential read, every frame decoded in order
    video = decode_video_frames(data, [3, 149], size=(56, 84), max_source_pixels=BIG, frames=151)
    assert video.decoded_frames == 150 and video.seeks == 1
    planned = decode_video_frames(data, [3, 149], size=(56, 84), max_source_pixels=BIG)
    assert np.array_equal(video.frames, planned.frames) and planned.decoded_frames < 60
    with pytest.raises(MediaError) as error:
        decode_video_frames(data, [3, 150], size=(56, 84), max_source_pixels=BIG, frames=151)
    assert error.value.reason == "undecodable_video"


def test_keyframe_sampling_decodes_each_nearest_keyframe_alone(b_frame_clip):
    data, every = b_frame_clip
    picks = [0, 17, 33, 50, 66, 83, 99, 116, 132, 149]  # keyframes every 30 frames (1 s)
    video = decode_video_frames(data, picks, size=(64, 96), max_source_pixels=BIG,
                                sampling="keyframe")
    assert video.indices == (0, 30, 30, 60, 60, 90, 90, 120, 120, 120)
    assert video.timestamps == pytest.approx([i / 30 for i in video.indices])
    assert np.array_equal(video.frames, np.stack([np.asarray(every[i]) for i in video.indices]))
    assert video.decoded_frames == 5 and video.seeks == 5
    with pytest.raises(ValueError, match="sampling"):
        decode_video_frames(data, picks, size=(64, 96), max_source_pixels=BIG, sampling="near")


@pytest.fixture(scope="module")
def video_sample(b_frame_clip):
    data, _ = b_frame_clip
    media = video_media(0, 150, 30.0, height=64, width=96, data=data)
    return cook_conversation(crude("k", conversation(
        [("user", "<video> what moves?"), ("assistant", "noise")], [media]), {"vid0.mp4": data}))


@pytest.mark.parametrize("sampling", ["exact", "keyframe"])
def test_qwen3_timestamp_lines_are_the_frames_true_times(tokenizer, video_sample, sampling):
    config = TaskEncoderConfig.from_dict({"model": "qwen3-vl", "video_sampling": sampling})
    encoded = task_encoder_for(config, tokenizer=tokenizer).encode_sample(video_sample)
    text = tokenizer.decode(encoded.input_ids)
    stamps = [float(s) for s in text.split("<")[1:] if "seconds>" in s
              for s in [s.split(" seconds>")[0]]]
    # picks 0 17 33 50 66 83 99 116 132 149 (2 fps over 5 s), keyframe mode: 0 30 30 60 60 90
    # 90 120 120 120; one timestamp per frame pair (the mean of its two)
    expected = {"exact": [0.3, 1.4, 2.5, 3.6, 4.7], "keyframe": [0.5, 1.5, 2.5, 3.5, 4.0]}
    assert stamps == expected[sampling]


def test_qwen2_5_time_step_from_the_keyframes_times(tokenizer, video_sample):
    steps = {}
    for sampling in ("exact", "keyframe"):
        config = TaskEncoderConfig.from_dict({"model": "qwen2.5-vl", "video_sampling": sampling})
        encoder = task_encoder_for(config, tokenizer=tokenizer)
        plan = encoder.plan_sample(video_sample.conversation, "k")
        plan, _ = encoder.decode_sample(plan, video_sample.conversation,
                                        video_sample.media_bytes)
        item = plan.media[0]
        media = video_sample.conversation.media[0]
        steps[sampling] = encoder.hooks._time_step(media, item.frame_indices, item.timestamps)
    # exact: 2 tokens/s * 2 frames / (10 frames over 150 at 30 fps = 2 fps) = 2.0; keyframe:
    # 2 * 2 * (4 s - 0 s) / 9 spacings
    assert steps == {"exact": pytest.approx(2.0), "keyframe": pytest.approx(2 * 2 * 4 / 9)}


def test_nemotron_frame_labels_carry_the_keyframes_times(tokenizer, video_sample):
    config = TaskEncoderConfig.from_dict({"model": "nemotron-omni", "video_sampling": "keyframe"})
    encoded = task_encoder_for(config, tokenizer=tokenizer).encode_sample(video_sample)
    text = tokenizer.decode(encoded.input_ids)
    assert "Frame 1 sampled at 0.00 seconds and frame 2 sampled at 1.00 seconds" in text
    with pytest.raises(ConfigError, match="video_sampling: must be one of exact, keyframe"):
        TaskEncoderConfig.from_dict({"model": "qwen3-vl", "video_sampling": "nearest"})


@pytest.mark.parametrize("container", ["mp4", "matroska_unflagged"])
def test_a_frame_held_long_is_shown_at_every_time_it_covers(container):
    """30 fps, one frame held 3 s, 30 fps again; read by time, planned (mp4) and from the start
    (HEVC in Matroska with no keyframe flag): the held frame fills every target it covers."""
    from fractions import Fraction

    import av

    pts = [*range(30), *range(120, 150)]  # frame 29 at 29/30 s, frame 30 at 4 s
    data = encoded_clip(codec="libx265", pts=pts, time_base=Fraction(1, 30), frames=len(pts))
    if container != "mp4":
        data = remux(data, "matroska", keyframe=lambda packet: False)
    with av.open(io.BytesIO(data)) as decoded:
        stream = decoded.streams.video[0]
        every = [(f.pts * stream.time_base, video_frame_pixels(f, (32, 24)))
                 for f in decoded.decode(stream)]
    seconds = np.array([float(t - every[0][0]) for t, _ in every])
    positions = np.linspace(0, len(every) - 1, 10).tolist()
    shown = [int(np.argmin(np.abs(seconds - t))) for t in np.linspace(0, seconds[-1], 10)]
    assert shown.count(29) >= 3  # the held frame, at several targets
    video = decode_video_at(data, positions, size=(24, 32), max_source_pixels=BIG,
                            frames=len(every))
    assert video.variable_rate and video.sequential == (container != "mp4")
    assert video.indices == tuple(shown)
    assert np.array_equal(video.frames, np.stack([every[i][1] for i in shown]))
    np.testing.assert_allclose(video.timestamps, seconds[shown], atol=1e-9)


@pytest.fixture(scope="module")
def rate_change_sample():
    """A sample holding ``hostile.rate_change_clip`` (30 fps for 2 s, then 5 fps) as the
    converter records it, and each frame's true time (its decoded pts, seconds)."""
    import av

    data = rate_change_clip()
    media, _ = probed_media(0, data, "mp4", probe_video(data, "clip.mp4"), "clip.mp4")
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        pts = [frame.pts * stream.time_base for frame in container.decode(stream)]
    seconds = np.array([float(p - pts[0]) for p in pts])
    sample = cook_conversation(crude("k", conversation(
        [("user", "<video> what moves?"), ("assistant", "noise")], [media]), {media.part: data}))
    return sample, seconds


def _shown(seconds: np.ndarray, count: int) -> list[int]:
    """The frames presented nearest ``count`` times uniform from the first frame to the last."""
    return [int(np.argmin(np.abs(seconds - t))) for t in np.linspace(0, seconds[-1], count)]


def _encode(tokenizer, sample, seconds: np.ndarray, model: str):
    """(encoder, encoded sample, the frames shown at uniform times); the video's frames decoded
    are those, with their true times."""
    encoder = task_encoder_for(TaskEncoderConfig.from_dict({"model": model}),
                               tokenizer=tokenizer)
    plan = encoder.plan_sample(sample.conversation, "k")
    shown = _shown(seconds, len(plan.media[0].frame_indices))
    item = encoder.decode_sample(plan, sample.conversation, sample.media_bytes)[0].media[0]
    assert item.frame_indices == tuple(shown)  # before: the index picks, most in the 1st 2 s
    np.testing.assert_allclose(item.timestamps, seconds[shown], atol=1e-9)
    return encoder, encoder.encode_sample(sample), shown


def test_qwen3_shows_a_variable_rate_clip_at_uniform_times_with_their_true_times(
        tokenizer, rate_change_sample):
    sample, seconds = rate_change_sample
    _, encoded, frames = _encode(tokenizer, sample, seconds, "qwen3-vl")
    shown = seconds[frames].tolist()
    shown += shown[-1:] * (len(shown) % 2)
    pairs = [(shown[i] + shown[i + 1]) / 2 for i in range(0, len(shown), 2)]
    text = tokenizer.decode(encoded.input_ids)
    stamps = [s.split(" seconds>")[0] for s in text.split("<")[1:] if " seconds>" in s]
    assert stamps == [f"{t:.1f}" for t in pairs]


def test_qwen2_5_temporal_positions_follow_a_variable_rate_clips_true_times(
        tokenizer, rate_change_sample):
    sample, seconds = rate_change_sample
    encoder, encoded, shown = _encode(tokenizer, sample, seconds, "qwen2.5-vl")
    video = encoded.input_ids == encoder.video_pad
    temporal = np.unique(encoded.position_ids[0][video].numpy())
    first_frames = seconds[shown][::2]  # each temporal patch's first frame
    # tokens_per_second 2: a patch's temporal position is 2 x its time, truncated (< 1) and off
    # by at most twice the half frame (0.1 s at 5 fps) between a target time and its frame
    assert len(temporal) == len(first_frames)
    np.testing.assert_allclose(temporal - temporal[0], 2 * first_frames, atol=1.2)


def test_nemotron_labels_a_variable_rate_clips_frames_with_their_true_times(
        tokenizer, rate_change_sample):
    sample, seconds = rate_change_sample
    _, encoded, shown = _encode(tokenizer, sample, seconds, "nemotron-omni")
    text = tokenizer.decode(encoded.input_ids)
    labels = [s.split(" seconds")[0] for s in text.split("sampled at ")[1:]]
    assert labels == [f"{t:.2f}" for t in seconds[shown]]


def _decoded_frame(rgb: np.ndarray, fmt: str = "yuv420p"):
    """A PyAV frame of pixel format ``fmt`` holding ``rgb`` (H, W, 3), as a decoder gives."""
    import av

    return av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format=fmt)


def test_frame_pixels_follow_each_frames_geometry_and_format():
    """The per-thread converter is rebuilt when a frame's size or pixel format changes: every
    frame's pixels equal PyAV's own rgb24 conversion of that frame."""
    rng = np.random.default_rng(0)
    frames = [_decoded_frame(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), fmt)
              for width, height, fmt in [(64, 48, "yuv420p"), (32, 80, "yuv420p"),
                                         (64, 48, "yuv444p"), (64, 48, "gray"),
                                         (64, 48, "yuv420p")]]
    for frame in frames:
        expected = frame.to_ndarray(format="rgb24")
        same_size = video_frame_pixels(frame, (frame.width, frame.height))
        assert np.array_equal(same_size, expected)
        out = np.zeros((2, 24, 40, 3), np.uint8)
        video_frame_pixels(frame, (40, 24), out=out, rows=[0, 1])
        resized = Image.fromarray(expected).resize((40, 24), Image.BICUBIC)
        assert np.array_equal(out, np.stack([np.asarray(resized)] * 2))


def _convert_in_forked_child(queue) -> None:
    frame = _decoded_frame(np.zeros((100, 60, 3), np.uint8))
    queue.put(video_frame_pixels(frame, (60, 100)).shape)


def test_a_forked_loader_worker_converts_frames_after_the_parent_did():
    """A loader worker forked after the parent converted a frame inherits this thread's
    converter; converting a frame of another size there (the converter is rebuilt) must not
    wait on scaling threads that the fork did not copy."""
    import multiprocessing

    video_frame_pixels(_decoded_frame(np.zeros((360, 640, 3), np.uint8)), (640, 360))
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_convert_in_forked_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked worker hung converting a frame")
    assert child.exitcode == 0 and queue.get(timeout=5) == (100, 60, 3)
