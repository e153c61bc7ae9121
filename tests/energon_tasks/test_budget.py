"""The budget planner, one policy case at a time, plus a property test of its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.errors import ConfigError
from energon_tasks.budget import plan
from energon_tasks.config import TaskEncoderConfig
from energon_tasks.families.qwen_vl.geometry import QWEN2_5_VL
from tests.energon_tasks.conftest import conversation, image_media, video_media

F2 = 28 * 28  # Qwen2.5-VL: one visual token per 28x28 pixels


def run(turns, media, tokens=None, **knobs):
    config = TaskEncoderConfig(**{"min_pixels": 4 * F2, **knobs})
    sample = conversation(turns, media)
    return plan(sample, key="k", budget=config.resolve(),
                turn_text_tokens=tokens or [10] * len(turns))


def test_fits_without_action():
    result = run([("user", "<image>hi"), ("assistant", "yo")], [image_media(0, 280, 280)])
    assert result.skip is None and result.actions == () and result.kept_turns == 2
    assert result.visual_tokens == 100 and result.total_tokens == 20 + 102
    assert result.counters() == {"samples": 1, "kept": 1}


def test_resized_lowers_all_images_together_before_cutting():
    turns = [("user", "<image><image>a"), ("assistant", "b"), ("user", "<image>c"),
             ("assistant", "d")]
    media = [image_media(i, 1120, 1120) for i in range(3)]  # 1600 tokens each at full size
    result = run(turns, media, max_pixels=1600 * F2, max_visual_tokens=1200)
    assert result.actions == ("resized",) and result.kept_turns == 4
    assert result.visual_tokens <= 1200
    sizes = {(m.grid.resized_height, m.grid.resized_width) for m in result.media}
    assert len(sizes) == 1  # same source size -> same shared cap -> same target
    assert all(m.grid.resized_height * m.grid.resized_width >= 4 * F2 for m in result.media)


def test_images_cut_at_turn_boundary_when_too_many_images():
    turns = [("user", "<image><image>a"), ("assistant", "b"), ("user", "<image><image>c"),
             ("assistant", "d")]
    result = run(turns, [image_media(i, 56, 56) for i in range(4)], max_num_images=3)
    assert result.actions == ("turns_cut", "images_cut") and result.kept_turns == 2
    assert [m.index for m in result.media] == [0, 1]


def test_turns_cut_for_seq_length_without_resizing():
    turns = [("user", "<image>a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")]
    result = run(turns, [image_media(0, 280, 280)], tokens=[10, 10, 500, 10], seq_length=256)
    assert result.actions == ("turns_cut",) and result.kept_turns == 2
    assert result.media[0].grid.visual_tokens == 100


def test_resize_for_seq_length_is_the_last_resort_before_skipping():
    result = run([("user", "<image>a"), ("assistant", "b")], [image_media(0, 560, 560)],
                 seq_length=256)  # 400 visual tokens at full size
    assert result.actions == ("resized",) and result.total_tokens <= 256


def test_frames_sampled_uniformly_capped_and_even():
    media = [video_media(0, frames=300, fps=30.0)]
    result = run([("user", "<video>a"), ("assistant", "b")], media, max_num_frames=9)
    frames = result.media[0].frame_indices
    assert result.actions == ("frames_sampled",)
    assert len(frames) == 8 and frames[0] == 0 and frames[-1] == 299
    gaps = [b - a for a, b in zip(frames, frames[1:])]
    assert max(gaps) - min(gaps) <= 1
    assert result.media[0].grid.grid_thw[0] == 4


@pytest.mark.parametrize(
    ("reason", "turns", "media", "knobs"),
    [
        ("no_assistant_turn", [("user", "<image>a")], [image_media(0, 56, 56)], {}),
        ("bad_media_metadata", [("user", "<image>a"), ("assistant", "b")],
         [image_media(0, 1, 500)], {}),
        ("bad_media_metadata", [("user", "<video>a"), ("assistant", "b")],
         [video_media(0, frames=1, fps=30.0)], {}),
        ("too_many_images", [("user", "<image><image>a"), ("assistant", "b")],
         [image_media(i, 56, 56) for i in range(2)], {"max_num_images": 1}),
        ("too_many_visual_tokens", [("user", "<image>a"), ("assistant", "b")],
         [image_media(0, 560, 560)], {"min_pixels": 200 * F2, "max_visual_tokens": 100}),
        ("too_long", [("user", "a"), ("assistant", "b")], [], {"seq_length": 16}),
    ],
)
def test_each_skip_reason(reason, turns, media, knobs):
    result = run(turns, media, **knobs)
    assert result.skip == reason and result.media == ()
    assert result.counters() == {"samples": 1, f"skipped_{reason}": 1}
    assert "sample k" in result.detail


def test_config_reports_every_problem_and_rejects_unknown_keys():
    with pytest.raises(ConfigError) as error:
        TaskEncoderConfig(seq_length=-1, min_pixels=10, max_pixels=5, model="nope")
    message = str(error.value)
    assert "seq_length" in message and "min_pixels" in message and "model" in message
    with pytest.raises(ConfigError, match=r"unknown key task_encoder.max_pixel \(did you mean "
                                          r"task_encoder.max_pixels\?\); valid keys"):
        TaskEncoderConfig.from_dict({"max_pixel": 5})
    config = TaskEncoderConfig.from_dict({"seq_length": "1024", "packing": "true",
                                          "min_pixels": "null", "context_parallel_size": "2"})
    assert config.seq_length == 1024 and config.packing and config.min_pixels is None
    assert config.resolve().length_multiple == 8
    with pytest.raises(ConfigError, match="multiple of 24"):
        TaskEncoderConfig(seq_length=1000, pad_to_multiple_of=8, context_parallel_size=3)


turn_strategy = st.tuples(
    st.sampled_from(["user", "assistant", "system"]),
    st.lists(st.sampled_from(["image", "video"]), max_size=3),
    st.integers(1, 300),
)


@settings(max_examples=150, deadline=None)
@given(
    turns=st.lists(turn_strategy, min_size=1, max_size=6),
    sizes=st.lists(st.tuples(st.integers(20, 3000), st.integers(20, 3000)), min_size=18,
                   max_size=18),
    max_images=st.integers(1, 6),
    max_visual=st.integers(50, 4000),
    seq_length=st.sampled_from([256, 1024, 4096]),
)
def test_plan_invariants(turns, sizes, max_images, max_visual, seq_length):
    media, contents = [], []
    for _, kinds, _ in turns:
        text = ""
        for kind in kinds:
            h, w = sizes[len(media)]
            media.append(image_media(len(media), h, w) if kind == "image"
                         else video_media(len(media), frames=h // 10 + 2, fps=10.0))
            text += f"<{kind}>"
        contents.append(text + "q")
    roles = [role for role, _, _ in turns]
    result = run(list(zip(roles, contents)), media, tokens=[t for _, _, t in turns],
                 max_num_images=max_images, max_visual_tokens=max_visual, seq_length=seq_length,
                 max_num_frames=8)
    if result.skip:
        assert result.media == () and result.kept_turns == 0
        return
    kept = result.kept_turns
    assert roles[kept - 1] == "assistant"
    expected = sum(len(kinds) for _, kinds, _ in turns[:kept])
    assert [m.index for m in result.media] == list(range(expected))  # whole spans, in order
    assert result.total_tokens <= seq_length
    assert result.visual_tokens <= max_visual
    assert sum(m.kind == "image" for m in result.media) <= max_images
    assert result.total_tokens == sum(t for _, _, t in turns[:kept]) + sum(
        m.span_tokens for m in result.media)
    for item in result.media:
        assert item.span_tokens == item.grid.visual_tokens + 2
        if item.kind == "video":
            assert len(item.frame_indices) % 2 == 0 and len(item.frame_indices) <= 8
        else:
            # never below the grid at the min_pixels cap (which, as in transformers' smart_resize,
            # can be under min_pixels for an elongated image: e.g. 40x127 -> 28x84)
            floor = QWEN2_5_VL.image_grid(*sizes[item.index], min_pixels=4 * F2,
                                          max_pixels=4 * F2)
            area = item.grid.resized_height * item.grid.resized_width
            assert area >= floor.resized_height * floor.resized_width
