"""Fixtures and builders of the task-encoder tests: a local tokenizer, media bytes, samples."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from energon_tasks.config import TaskEncoderConfig
from energon_tasks.sample_format import CanonicalSample, Media, SourceRef, Turn
from lookalikes.media import encode_h264


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """Folder of the small byte-level BPE with the Qwen special tokens."""
    from energon_tasks.tokenizer import build_test_tokenizer

    return build_test_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    """The test tokenizer, loaded through AutoTokenizer."""
    from energon_tasks.tokenizer import load_tokenizer

    return load_tokenizer(str(tokenizer_dir))


@pytest.fixture(scope="session")
def make_encoder(tokenizer):
    """encoder(**config fields) -> the task encoder (Qwen-VL by default) with the test tokenizer."""
    from energon_tasks.task_encoder import VLMTaskEncoder

    def build(**fields):
        return VLMTaskEncoder(TaskEncoderConfig(**fields), tokenizer=tokenizer)

    return build


def image_bytes(height: int, width: int, *, seed: int = 0, fmt: str = "PNG") -> bytes:
    """Random RGB noise image of the given size, encoded as ``fmt``."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def video_bytes(frames: int, fps: int = 10, *, height: int = 48, width: int = 64,
                gop: int = 5) -> bytes:
    """H.264 mp4 whose frame i has red = 2 * i (the frame index is readable back)."""
    def frame(i):
        array = np.zeros((height, width, 3), np.uint8)
        array[..., 0] = 2 * i
        return array

    return encode_h264((frame(i) for i in range(frames)), width=width, height=height, fps=fps,
                       options={"g": str(gop), "keyint_min": str(gop), "sc_threshold": "0",
                                "bf": "0", "qp": "0"})


def b_frame_video_bytes(frames: int, fps: int = 30, *, height: int = 64, width: int = 96,
                       gop: int = 30) -> bytes:
    """H.264 mp4 with B-frames (x264 defaults: 3, pyramid) of a panning noisy texture."""
    texture = np.random.default_rng(3).integers(0, 256, (height, 4 * width, 3), dtype=np.uint8)
    shifts = ((2 * i) % (3 * width) for i in range(frames))
    return encode_h264((texture[:, s:s + width] for s in shifts), width=width, height=height,
                       fps=fps, options={"g": str(gop), "keyint_min": str(gop),
                                         "sc_threshold": "0", "preset": "veryfast", "crf": "28"})


def image_media(i: int, height: int, width: int, data: bytes = b"x") -> Media:
    return Media(part=f"img{i}.png", kind="image", format="png", width=width, height=height,
                 bytes=len(data))


def video_media(i: int, frames: int, fps: float, height: int = 48, width: int = 64,
                data: bytes = b"x") -> Media:
    return Media(part=f"vid{i}.mp4", kind="video", format="mp4", width=width, height=height,
                 bytes=len(data), frames=frames, fps=fps, duration_s=frames / fps, codec="h264")


def conversation(turns: list[tuple[str, str]], media: list[Media]) -> CanonicalSample:
    """A canonical sample from (role, content) pairs and its media list."""
    return CanonicalSample(
        dataset="mantis",
        source=SourceRef(config="cfg", split="train", ids=["x"], rows=[0]),
        conversation=[Turn(role=role, content=content) for role, content in turns],
        media=media,
    )


def crude(key: str, sample: CanonicalSample, parts: dict[str, bytes]) -> dict:
    """The crude dict Energon hands a cooker (decoder=None: raw bytes)."""
    return {"__key__": key, "__restore_key__": ("test", 0), "__subflavors__": {},
            "__sources__": (), "json": sample.to_json_bytes(), **parts}


def image_sample(key: str, turns: list[tuple[str, str]], sizes: list[tuple[int, int]]):
    """A cooked ConversationSample whose images (PNG noise) have the given (h, w) sizes."""
    from energon_tasks.task_encoder import cook_conversation

    parts = {f"img{i}.png": image_bytes(h, w, seed=i) for i, (h, w) in enumerate(sizes)}
    media = [image_media(i, h, w, parts[f"img{i}.png"]) for i, (h, w) in enumerate(sizes)]
    return cook_conversation(crude(key, conversation(turns, media), parts))


def json_of(sample: CanonicalSample) -> dict:
    return json.loads(sample.to_json_bytes())
