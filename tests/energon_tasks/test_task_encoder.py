"""encode_sample end to end on in-memory samples: tokens, labels, spans, positions, pixels."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.energon import SkipSample
from PIL import Image

from contract.constants import IGNORE_INDEX
from energon_tasks import task_encoder
from energon_tasks.families.qwen_vl.geometry import QWEN2_5_VL
from energon_tasks.task_encoder import cook_conversation
from tests.energon_tasks.conftest import (
    conversation,
    crude,
    image_bytes,
    image_media,
    image_sample,
    video_bytes,
    video_media,
)
from tests.energon_tasks.test_geometry import hf_image_processor


def runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of ``token``."""
    out, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            out.append((i, j - i))
            i = j
        else:
            i += 1
    return out


def test_interleaving_labels_and_pixels(make_encoder):
    encoder = make_encoder(min_pixels=784, max_pixels=200_000)
    turns = [("system", "Be brief."), ("user", "A <image> B <image> C"),
             ("assistant", "The second."), ("user", "And <image>?"), ("assistant", "No.")]
    sample = image_sample("k1", turns, [(56, 112), (140, 84), (28, 28)])
    out = encoder.encode_sample(sample)
    ids = out.input_ids.tolist()
    spans = runs(ids, encoder.image_pad)
    assert [length for _, length in spans] == [8, 15, 1]  # in placeholder order
    assert out.image_grid_thw.tolist() == [[1, 4, 8], [1, 10, 6], [1, 2, 2]]
    for start, length in spans:
        assert ids[start - 1] == encoder.vision_start and ids[start + length] == encoder.vision_end
    text = encoder.tokenizer.decode([i for i in ids if i != encoder.image_pad])
    assert text.index("A ") < text.index(" B ") < text.index(" C") < text.index("And")
    supervised = [i for i, label in zip(ids, out.labels.tolist()) if label != IGNORE_INDEX]
    assert encoder.tokenizer.decode(supervised) == "The second.<|im_end|>No.<|im_end|>"
    assert torch.equal(out.loss_mask.bool(), out.labels != IGNORE_INDEX)
    assert out.__subflavors__ == {"config": "cfg"}
    first = np.asarray(Image.open(io.BytesIO(image_bytes(56, 112, seed=0))))
    rows = QWEN2_5_VL.patchify(QWEN2_5_VL.normalize(first.transpose(2, 0, 1)[None]))
    np.testing.assert_array_equal(out.pixel_values[: len(rows)].numpy(), rows)
    assert out.pixel_values.shape == (32 + 60 + 4, 1176)


def test_pixel_values_equal_hf_processor(make_encoder):
    encoder = make_encoder()
    out = encoder.encode_sample(image_sample("k", [("user", "<image>"), ("assistant", "x")],
                                             [(300, 45)]))
    image = Image.open(io.BytesIO(image_bytes(300, 45, seed=0)))
    low, high = encoder.budget.min_pixels, encoder.budget.max_pixels
    expected = hf_image_processor(QWEN2_5_VL, low, high)(images=[image], return_tensors="np")
    assert out.image_grid_thw.tolist() == expected["image_grid_thw"].tolist()
    np.testing.assert_allclose(out.pixel_values.numpy(), expected["pixel_values"], atol=1e-5)


def test_mrope_positions_follow_the_tokens(make_encoder):
    encoder = make_encoder(min_pixels=784)
    out = encoder.encode_sample(image_sample("k", [("user", "hi <image> there"),
                                                   ("assistant", "ok")], [(56, 84)]))
    ids, pos = out.input_ids.tolist(), out.position_ids.numpy()
    (start, length), = runs(ids, encoder.image_pad)
    assert length == 6  # merged grid 2 x 3
    np.testing.assert_array_equal(pos[:, :start], np.tile(np.arange(start), (3, 1)))
    block = pos[:, start:start + 6]
    np.testing.assert_array_equal(block[0], [start] * 6)
    np.testing.assert_array_equal(block[1], start + np.array([0, 0, 0, 1, 1, 1]))
    np.testing.assert_array_equal(block[2], start + np.array([0, 1, 2, 0, 1, 2]))
    after = start + 3  # max position in the block is start + 2
    np.testing.assert_array_equal(pos[:, start + 6:], np.tile(
        np.arange(after, after + len(ids) - start - 6), (3, 1)))


@pytest.mark.parametrize("model", ["qwen2.5-vl", "qwen3-vl"])
def test_video_span_layout(make_encoder, model):
    encoder = make_encoder(model=model, max_num_frames=4, video_fps=1.0)
    data = video_bytes(40, fps=10)
    media = [video_media(0, frames=40, fps=10.0, data=data)]
    sample = cook_conversation(crude("v", conversation(
        [("user", "<video>what?"), ("assistant", "red")], media), {"vid0.mp4": data}))
    out = encoder.encode_sample(sample)
    ids = out.input_ids.tolist()
    (t, h, w), = out.video_grid_thw.tolist()
    assert t == 2 and out.pixel_values_videos.shape[0] == t * h * w
    spans = runs(ids, encoder.video_pad)
    assert len(spans) == (2 if model == "qwen3-vl" else 1)
    assert sum(length for _, length in spans) == t * h * w // 4
    if model == "qwen3-vl":
        assert "<0.7 seconds>" in encoder.tokenizer.decode(ids)  # frames 0, 13 -> mean 0.65 s
    assert out.position_ids.shape == (3, len(ids))


def test_skipped_sample_decodes_nothing_and_cut_media_are_not_decoded(make_encoder, monkeypatch):
    calls = []
    real = task_encoder.decode_image
    monkeypatch.setattr(task_encoder, "decode_image",
                        lambda *a, **k: calls.append(k["name"]) or real(*a, **k))
    encoder = make_encoder(max_num_images=1, min_pixels=784)
    over = image_sample("over", [("user", "<image><image>x"), ("assistant", "y")],
                        [(28, 28), (28, 28)])
    with pytest.raises(SkipSample, match="over"):
        encoder.encode_sample(over)
    assert calls == [] and encoder.counters()["skipped_too_many_images"] == 1
    cut = image_sample("cut", [("user", "<image>x"), ("assistant", "y"), ("user", "<image>z"),
                               ("assistant", "w")], [(28, 28), (28, 28)])
    encoder.encode_sample(cut)
    assert calls == ["cut.img0.png"]
    assert encoder.counters()["images_cut"] == 1 and encoder.counters()["samples"] == 2


def test_bad_media_skipped_with_reason(make_encoder):
    encoder = make_encoder()
    sample = image_sample("bad", [("user", "<image>x"), ("assistant", "y")], [(28, 28)])
    sample.media_bytes["img0.png"] = b"garbage"
    with pytest.raises(SkipSample, match="bad.img0.png"):
        encoder.encode_sample(sample)
    del sample.media_bytes["img0.png"]
    with pytest.raises(SkipSample):
        encoder.encode_sample(sample)
    counters = encoder.counters()
    assert counters["skipped_undecodable_image"] == 1 and counters["skipped_missing_media"] == 1


@settings(max_examples=25, deadline=None)
@given(
    turns=st.lists(st.tuples(st.sampled_from(["user", "assistant"]),
                             st.lists(st.sampled_from(["t", "i"]), max_size=4)),
                   min_size=1, max_size=5),
    seq_length=st.sampled_from([64, 128, 256]),
    max_images=st.integers(1, 4),
)
def test_no_visual_span_is_ever_cut(make_encoder, turns, seq_length, max_images):
    encoder = make_encoder(seq_length=seq_length, max_num_images=max_images, min_pixels=784,
                           max_pixels=56 * 84, max_visual_tokens=40)
    contents = ["".join("<image>" if p == "i" else "word " for p in parts) for _, parts in turns]
    count = sum(parts.count("i") for _, parts in turns)
    sizes = [(28 * (1 + n % 3), 28 * (1 + n % 2)) for n in range(count)]
    sample = image_sample("h", [(role, c) for (role, _), c in zip(turns, contents)], sizes)
    try:
        out = encoder.encode_sample(sample)
    except SkipSample:
        return
    ids = out.input_ids.tolist()
    assert len(ids) <= seq_length
    spans = runs(ids, encoder.image_pad)
    assert [n for _, n in spans] == [t * h * w // 4 for t, h, w in out.image_grid_thw.tolist()]
    for start, length in spans:
        assert ids[start - 1] == encoder.vision_start and ids[start + length] == encoder.vision_end
    assert ids.count(encoder.vision_start) == ids.count(encoder.vision_end) == len(spans)
    assert (out.labels != IGNORE_INDEX).any()
    assert ids[-2] == encoder.im_end and out.labels[-2] == encoder.im_end


TEXTS = ["", "user\n", " What does <image> say?", "plain <|im_start|>assistant\n and <|im_end|>",
         "  spaces,\ttabs\n\nnewlines ", "unicode: é ü 漢字 🙂", "<|vision_start|><|image_pad|>",
         "x" * 3000]


def test_text_ids_are_the_tokenizers(make_encoder, tokenizer):
    """encode_texts / encode_text / tokenize_turns give the tokenizer's own ids (special-token
    strings split, none added), through the Rust backend or, where the backend was left
    truncating, through the tokenizer's call."""
    encoder = make_encoder()
    expected = [tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                if text else [] for text in TEXTS]
    tokenizer.backend_tokenizer.encode_special_tokens = False
    assert encoder.encode_texts(TEXTS) == expected
    assert tokenizer.backend_tokenizer.encode_special_tokens is False  # left as it was
    assert [encoder.encode_text(text) for text in TEXTS] == expected
    assert [encoder.encode_text(text) for text in TEXTS] == expected  # the cache's answers
    sample = conversation([("user", TEXTS[2] + TEXTS[3]), ("assistant", TEXTS[4])],
                          [image_media(0, 32, 32)])
    turns = encoder.tokenize_turns(sample)
    assert turns[0].pieces == [encoder.encode_text(p) for p in (" What does ", " say?" + TEXTS[3])]
    assert turns[1].header[1:] == encoder.encode_text("assistant\n")
    backend = tokenizer.backend_tokenizer
    backend.enable_truncation(max_length=4)
    try:
        assert encoder.encode_texts(TEXTS) == expected
    finally:
        backend.no_truncation()
