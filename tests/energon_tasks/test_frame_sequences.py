"""Frame-sequence videos (a folder of frame images stored as one tar member, e.g. llava_hound's
ShareGPTVideo frames) are sampled and budgeted exactly like an MP4 of the same frames, and their
pixels are the chosen frames resized, normalised and patchified as the HF video processors do."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from energon_tasks.config import TaskEncoderConfig
from energon_tasks.sample_format import FRAMES_FORMAT, Media, pack_frames
from energon_tasks.task_encoder import cook_conversation, task_encoder_for
from tests.energon_tasks.conftest import conversation, crude, video_media
from tests.energon_tasks.test_geometry import qwen2_video_processor  # noqa: F401 (fixture)

FRAMES, FPS, HEIGHT, WIDTH = 40, 10.0, 48, 64


@pytest.fixture(scope="module")
def frames():
    return np.random.default_rng(0).integers(0, 256, (FRAMES, HEIGHT, WIDTH, 3), np.uint8)


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return buf.getvalue()


def _sample(key: str, media: Media, data: bytes):
    turns = [("user", "<video>what moves?"), ("assistant", "a square")]
    return cook_conversation(crude(key, conversation(turns, [media]), {media.part: data}))


def _encode(encoder, frames):
    from lookalikes.media import encode_h264

    sequence = pack_frames([(f"c01_{i + 1:04d}.png", _png(f)) for i, f in enumerate(frames)])
    mp4 = encode_h264(iter(frames), width=WIDTH, height=HEIGHT, fps=int(FPS),
                      options={"g": "5", "bf": "0"})
    seq_media = Media(part="vid0.tar", kind="video", format=FRAMES_FORMAT, width=WIDTH,
                      height=HEIGHT, bytes=len(sequence), frames=FRAMES, fps=FPS,
                      duration_s=FRAMES / FPS, codec="frames")
    mp4_media = video_media(0, frames=FRAMES, fps=FPS, height=HEIGHT, width=WIDTH, data=mp4)
    return (encoder.encode_sample(_sample("seq", seq_media, sequence)),
            encoder.encode_sample(_sample("mp4", mp4_media, mp4)))


@pytest.mark.parametrize("model", ["qwen2.5-vl", "qwen3-vl", "nemotron-omni"])
def test_frame_sequence_budgets_like_the_mp4_of_its_frames(tokenizer, frames, model):
    config = TaskEncoderConfig(model=model, max_num_frames=6, video_fps=2.0,
                               **({"max_pixels": None} if model == "nemotron-omni" else {}))
    encoder = task_encoder_for(config, tokenizer=tokenizer)
    seq, mp4 = _encode(encoder, frames)
    assert seq.input_ids.tolist() == mp4.input_ids.tolist()  # same spans, timestamps, tokens
    assert seq.video_grid_thw.tolist() == mp4.video_grid_thw.tolist()
    assert seq.pixel_values_videos.shape == mp4.pixel_values_videos.shape
    assert seq.video_grid_thw.tolist()[0][0] == 3  # 6 frames in temporal patches of 2


@pytest.mark.parametrize("model", ["qwen2.5-vl", "qwen3-vl"])
def test_frame_sequence_pixels_are_the_processors(tokenizer, frames, model,
                                                   qwen2_video_processor):  # noqa: F811
    import torch

    encoder = task_encoder_for(TaskEncoderConfig(model=model, max_num_frames=6, video_fps=2.0),
                               tokenizer=tokenizer)
    seq, _ = _encode(encoder, frames)
    geo = encoder.geometry
    picks = geo.video_frame_indices(FRAMES, FPS, video_fps=2.0, max_num_frames=6)
    (t, h, w), = seq.video_grid_thw.tolist()
    size = (w * geo.patch_size, h * geo.patch_size)
    chosen = np.stack([np.asarray(Image.fromarray(frames[i]).resize(size, Image.BICUBIC))
                       for i in picks])
    normalised = geo.normalize(chosen.transpose(0, 3, 1, 2))
    expected, *grid = qwen2_video_processor.patchify(torch.from_numpy(normalised)[None],
                                                     geo.patch_size, geo.merge_size, 2)
    assert grid == [t, h, w]
    np.testing.assert_allclose(seq.pixel_values_videos.numpy(), expected[0].numpy(), atol=1e-6)
