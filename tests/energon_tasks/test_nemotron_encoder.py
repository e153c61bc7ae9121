"""Nemotron-Omni encoding end to end: real converted shards of the three lookalike datasets,
token spans against the geometry formulas and ``video_span_text``, pixel rows against transformers'
Nemotron-Omni processors (video: the processor itself; image: its normalisation and patch layout at
formula level, the module needs the missing torchvision), the budget policy, tiles, packing, batch,
``visual_kinds`` (the image / video order that the shared ``<image>`` token does not carry).
"""

from __future__ import annotations

import io
import json
import math
import random
import types

import numpy as np
import pytest
import torch
from megatron.energon import SkipSample
from PIL import Image

from contract.constants import IGNORE_INDEX, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, VISUAL_KINDS
from contract.errors import ConfigError
from energon_tasks import budget, task_encoder, task_encoder_for
from energon_tasks.config import TaskEncoderConfig
from energon_tasks.decode import decode_image
from energon_tasks.families.nemotron_omni.geometry import NEMOTRON_OMNI, NEMOTRON_OMNI_TILED
from energon_tasks.families.nemotron_omni.hooks import NemotronOmniHooks
from energon_tasks.families.qwen_vl.hooks import QwenVLHooks
from energon_tasks.profiles import PROFILES
from energon_tasks.sample_format import CanonicalSample
from energon_tasks.task_encoder import VLMTaskEncoder, cook_conversation
from tests.conftest import read_samples
from tests.energon_tasks.conftest import (
    conversation,
    crude,
    image_bytes,
    image_media,
    image_sample,
    video_bytes,
    video_media,
)
from tests.energon_tasks.test_nemotron import HF_PATCHES
from tests.energon_tasks.test_task_encoder import runs

MODELS = ["nemotron-omni", "nemotron-omni-tiled"]


@pytest.fixture(scope="module")
def make_nemotron(tokenizer):
    """encoder(**config fields) -> the Nemotron-Omni encoder (dynamic unless model= is given)."""
    def build(**fields):
        fields.setdefault("model", "nemotron-omni")
        fields.setdefault("max_pixels", None)
        return task_encoder_for(TaskEncoderConfig(**fields), tokenizer=tokenizer)

    return build


# ------------------------------------------------------------------------------- references
def hf_image_rows(pixels: np.ndarray) -> np.ndarray:
    """(H, W, 3) uint8 -> the image processor's rows: its fused rescale + normalise
    (``TorchvisionBackend.rescale_and_normalize``) then ``convert_image_to_patches``."""
    from transformers.image_processing_backends import TorchvisionBackend

    mean, std, _ = TorchvisionBackend._fuse_mean_std_and_rescale_factor(
        object(), do_normalize=True, image_mean=tuple(OPENAI_CLIP_MEAN),
        image_std=tuple(OPENAI_CLIP_STD), do_rescale=True, rescale_factor=1 / 255)
    image = torch.from_numpy(pixels).permute(2, 0, 1).to(torch.float32)
    image = image.sub(mean[:, None, None]).div(std[:, None, None])  # torchvision normalize
    return HF_PATCHES(image[None], 16)[0].numpy()


def nemotron_resize(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """(H, W, 3) uint8 -> (height, width, 3) float32 as the image processor resizes (it needs
    torchvision, absent here): the channel-first tensor in float32, then torchvision's
    ``resize_image``, which for a float32 tensor is ``F.interpolate(bicubic, align_corners=False,
    antialias=True)`` and nothing else (skipped at the same size)."""
    tensor = torch.from_numpy(np.array(pixels)).permute(2, 0, 1).contiguous()[None].float()
    if tensor.shape[-2:] != (height, width):
        tensor = torch.nn.functional.interpolate(tensor, size=(height, width), mode="bicubic",
                                                 align_corners=False, antialias=True)
    return tensor[0].permute(1, 2, 0).numpy()


def hf_video_rows(frames: np.ndarray) -> np.ndarray:
    """(T, H, W, 3) uint8 at the target size -> the video processor's tubelets, cut into rows
    as RADIO's ``_image_to_patches`` does."""
    from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3VideoProcessor as VP,
    )
    from transformers.models.radio.modeling_radio import RadioPatchEmbeddings

    processor = VP(norm_mean=list(OPENAI_CLIP_MEAN), norm_std=list(OPENAI_CLIP_STD))
    video = torch.from_numpy(frames).permute(0, 3, 1, 2)
    out = processor._preprocess([video], temporal_patch_size=2)
    tubelets = out["pixel_values_videos"][0]  # (pairs, 6, H, W)
    patches = RadioPatchEmbeddings._image_to_patches(types.SimpleNamespace(patch_size=16),
                                                     tubelets)
    return patches.reshape(-1, patches.shape[-1]).numpy()


def shard_samples(out, count: int):
    """The first ``count`` samples of a converted dataset as cooked ConversationSamples."""
    cooked = []
    for key, entry in sorted(read_samples(out).items())[:count]:
        parts = {k: v for k, v in entry.items() if k not in ("json", "split")}
        crude = {"__key__": key, "__restore_key__": ("t", 0), "__subflavors__": {},
                 "__sources__": (), "json": json.dumps(entry["json"]).encode(), **parts}
        cooked.append(cook_conversation(crude))
    return cooked


# ------------------------------------------------------------------------------- real shards
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("fixture", ["mantis_out", "infovqa_out", "video_out"])
def test_real_shards_spans_pixels_and_grids(request, make_nemotron, model, fixture):
    out = request.getfixturevalue(fixture)
    encoder = make_nemotron(model=model, max_pixels=2048 * 256, max_num_frames=8,
                            seq_length=32768, max_visual_tokens=32768, max_num_images=16)
    geo, low, high = encoder.geometry, encoder.budget.min_pixels, encoder.budget.max_pixels
    seen = set()
    for sample in shard_samples(out, 3):
        conv = sample.conversation
        plan = encoder.plan_sample(conv, sample.__key__)
        assert not plan.skip and "resized" not in plan.actions
        pixels = encoder.decode_media(plan, conv, sample.media_bytes)
        encoded = encoder.encode_sample(sample)
        ids = encoded.input_ids.tolist()
        assert len(ids) == plan.total_tokens
        spans = iter(runs(ids, encoder.image_pad))
        images = iter(encoded.image_grid_thw.tolist())
        videos = iter(encoded.video_grid_thw.tolist())
        image_rows = video_rows = 0
        for item, frames in zip(plan.media, pixels, strict=True):
            media = conv.media[item.index]
            seen.add(item.kind)
            if item.kind == "image":
                expected = geo.image_grid(media.height, media.width, min_pixels=low,
                                          max_pixels=high)
                grid = next(images)
                assert grid == list(expected.grid_thw)
                start, length = next(spans)
                assert length == expected.visual_tokens == math.prod(grid) // 4
                assert ids[start - 1] == encoder.vision_start
                assert ids[start + length] == encoder.vision_end
                rows = encoded.pixel_values[image_rows:image_rows + math.prod(grid)].numpy()
                image_rows += math.prod(grid)
                if model == "nemotron-omni":
                    assert grid[0] == 1
                    np.testing.assert_array_equal(rows, hf_image_rows(frames[0]))
                else:
                    assert grid[1:] == [32, 32] and frames.shape[0] == grid[0]
                    np.testing.assert_array_equal(rows[:1024], hf_image_rows(frames[0]))
            else:
                expected = geo.video_grid(len(item.frame_indices), media.height, media.width)
                grid = next(videos)
                assert grid == list(expected.grid_thw)
                text = geo.video_span_text(item.frame_indices, media.fps, expected)
                span = encoder.tokenizer(text, add_special_tokens=False)["input_ids"]
                pads = [next(spans)[1] for _ in range(grid[0])]
                assert pads == [grid[1] * grid[2] // 4] * grid[0]
                assert sum(pads) == expected.visual_tokens
                assert any(ids[i:i + len(span)] == span for i, token in enumerate(ids)
                           if token == span[0])
                rows = encoded.pixel_values_videos[video_rows:video_rows + math.prod(grid)]
                video_rows += math.prod(grid)
                np.testing.assert_array_equal(rows.numpy(), hf_video_rows(frames))
        assert image_rows == len(encoded.pixel_values)
        assert video_rows == len(encoded.pixel_values_videos)
        assert encoded.pixel_values.shape[1] == 768 and encoded.pixel_values_videos.shape[1] == 1536
        assert (encoded.position_ids == torch.arange(len(ids))).all()
        supervised = encoded.labels != IGNORE_INDEX
        assert supervised.any()
        assert (encoded.labels[supervised] == encoded.input_ids[supervised]).all()
    assert seen == ({"video"} if fixture == "video_out" else {"image"})


# ------------------------------------------------------------------------------- tiles
def test_tiled_image_tiles_thumbnail_and_small_max_num_tiles(make_nemotron):
    sample = image_sample("t", [("user", "<image> which?"), ("assistant", "a")], [(250, 550)])
    encoder = make_nemotron(model="nemotron-omni-tiled")
    out = encoder.encode_sample(sample)
    assert out.image_grid_thw.tolist() == [[3, 32, 32]]  # (2 cols, 1 row) + thumbnail
    assert [n for _, n in runs(out.input_ids.tolist(), encoder.image_pad)] == [768]
    resized = decode_image(sample.media_bytes["img0.png"], size=(512, 1024),
                           max_source_pixels=1 << 30).pixels
    thumb = decode_image(sample.media_bytes["img0.png"], size=(512, 512),
                         max_source_pixels=1 << 30).pixels
    expected = np.concatenate([hf_image_rows(resized[:, :512]), hf_image_rows(resized[:, 512:]),
                               hf_image_rows(thumb)])
    np.testing.assert_array_equal(out.pixel_values.numpy(), expected)
    one = make_nemotron(model="nemotron-omni-tiled", max_num_tiles=1).encode_sample(sample)
    assert one.image_grid_thw.tolist() == [[1, 32, 32]] and one.pixel_values.shape == (1024, 768)
    assert make_nemotron(model="nemotron-omni-tiled", max_num_tiles=1).geometry.max_num_tiles == 1


# ------------------------------------------------------------------------------- budget
def test_budget_resizes_then_cuts_then_skips(make_nemotron, monkeypatch):
    calls = []
    real = task_encoder.decode_image
    monkeypatch.setattr(task_encoder, "decode_image",
                        lambda *a, **k: calls.append(k["name"]) or real(*a, **k))
    turns = [("user", "<image><image> compare"), ("assistant", "left"),
             ("user", "and <image>?"), ("assistant", "no")]
    sample = image_sample("b", turns, [(640, 640), (640, 640), (640, 640)])
    full = make_nemotron(max_visual_tokens=4096).encode_sample(sample)
    assert full.image_grid_thw.tolist() == [[1, 40, 40]] * 3  # 400 tokens each
    lowered = make_nemotron(max_visual_tokens=1000)
    out = lowered.encode_sample(sample)
    tokens = [t * h * w // 4 for t, h, w in out.image_grid_thw.tolist()]
    assert len(tokens) == 3 and sum(tokens) <= 1000 and max(tokens) < 400
    assert lowered.counters() == {"samples": 1, "kept": 1, "resized": 1}
    cut = make_nemotron(max_visual_tokens=700)  # 3 x 256 (the 1024-patch floor) > 700
    out = cut.encode_sample(sample)
    assert len(out.image_grid_thw) == 2 and sum(out.image_grid_thw.prod(1) // 4) <= 700
    assert cut.counters() == {"samples": 1, "kept": 1, "resized": 1, "turns_cut": 1,
                              "images_cut": 1}
    calls.clear()
    skip = make_nemotron(max_visual_tokens=400)  # 2 x 256 > 400 in the first turn already
    with pytest.raises(SkipSample):
        skip.encode_sample(sample)
    assert calls == [] and skip.counters() == {"samples": 1, "skipped_too_many_visual_tokens": 1}
    tiled = make_nemotron(model="nemotron-omni-tiled", max_visual_tokens=600)
    one = image_sample("t", [("user", "<image>"), ("assistant", "a")], [(250, 550)])
    assert tiled.encode_sample(one).image_grid_thw.tolist() == [[1, 32, 32]]  # 768 > 600
    assert tiled.counters()["resized"] == 1


@pytest.mark.parametrize("model", MODELS)
def test_best_cap_always_fits(tokenizer, model):
    rng = random.Random(0)
    sizes = [(4204, 3996)] + [(rng.randint(64, 6000), rng.randint(64, 6000)) for _ in range(30)]
    for limit in (300, 700, 1405, 2000, 5000):
        config = TaskEncoderConfig(model=model, max_pixels=None, max_visual_tokens=limit,
                                   seq_length=65536, max_num_images=64)
        for first in range(0, len(sizes), 3):
            chunk = sizes[first:first + 3]
            media = [image_media(i, h, w) for i, (h, w) in enumerate(chunk)]
            sample = conversation([("user", "<image>" * len(chunk)), ("assistant", "x")], media)
            plan = budget.plan(sample, key="c", budget=config.resolve(), turn_text_tokens=[5, 3])
            if plan.skip:
                assert plan.skip == "too_many_visual_tokens"
                continue
            assert plan.visual_tokens <= limit
            assert plan.total_tokens == 8 + sum(g.grid.visual_tokens + 2 for g in plan.media)


# ------------------------------------------------------------------------------- packing / batch
def test_packing_and_batch_shapes(make_nemotron, video_out):
    encoder = make_nemotron(packing=True, seq_length=4096, max_visual_tokens=4000,
                            max_num_frames=4, max_pixels=1024 * 256)
    images = [encoder.encode_sample(image_sample(f"i{n}", [("user", "<image>x"),
                                                            ("assistant", "y")], [(64, 96)]))
              for n in range(3)]
    videos = [encoder.encode_sample(s) for s in shard_samples(video_out, 2)]
    rows = encoder.select_samples_to_pack(images + videos)
    packed = [encoder.pack_selected_samples(row) for row in rows]
    assert sum(len(p.seq_lens) for p in packed) == 5
    for row in packed:
        assert row.pixel_values_videos.shape[1] == 1536 and row.pixel_values.shape[1] == 768
        start = 0
        for length in row.seq_lens.tolist():  # positions restart per packed sample
            assert row.position_ids[:, start:start + length].tolist() == [list(range(length))] * 3
            start += length
    batch = encoder.batch(packed)
    b, length = batch.input_ids.shape
    assert batch.position_ids.shape == (3, b, length) and length % 8 == 0
    # max_pixels = min_pixels (1024 patches): no lift, 64x96 -> 4x6 patches
    assert batch.image_grid_thw.tolist() == [[1, 4, 6]] * 3
    assert batch.pixel_values.shape[0] == int(batch.image_grid_thw.prod(1).sum())
    assert batch.pixel_values_videos.shape == (int(batch.video_grid_thw.prod(1).sum()), 1536)
    assert batch.cu_seqlens is not None and int(batch.cu_seqlens[-1]) == b * length
    only_images = encoder.batch(images[:2])
    assert only_images.pixel_values_videos.shape == (0, 1536)
    assert only_images.video_grid_thw.shape == (0, 3)


# ------------------------------------------------------------------------------- visual_kinds
def mixed_sample(key: str):
    """A cooked sample with an image, a video and another image in one user turn."""
    parts = {"img0.png": image_bytes(64, 96), "vid1.mp4": video_bytes(8, fps=4),
             "img2.png": image_bytes(48, 48, seed=2)}
    media = [image_media(0, 64, 96, parts["img0.png"]),
             video_media(1, frames=8, fps=4.0, data=parts["vid1.mp4"]),
             image_media(2, 48, 48, parts["img2.png"])]
    turns = [("user", "<image> then <video> and <image>?"), ("assistant", "ok")]
    return cook_conversation(crude(key, conversation(turns, media), parts))


def item_tokens(batch, merge: int = 2) -> list[tuple[str, int]]:
    """(kind, context tokens) of each visual item in ``visual_kinds`` order."""
    grids = {"image": iter(batch.image_grid_thw.tolist()),
             "video": iter(batch.video_grid_thw.tolist())}
    out = []
    for code in batch.visual_kinds.tolist():
        kind = VISUAL_KINDS[code]
        out.append((kind, math.prod(next(grids[kind])) // merge**2))
    return out


def assert_kinds_follow_spans(batch, encoder) -> None:
    """Walking the context-token runs in row-major order, the items given by ``visual_kinds``
    take them exactly: an image one run, a video one run per frame pair (Qwen: the runs of its own
    token)."""
    ids = batch.input_ids.reshape(-1).tolist()
    shared = encoder.image_pad == encoder.video_pad
    token_runs = {kind: iter(runs(ids, getattr(encoder, f"{kind}_pad"))) for kind in VISUAL_KINDS}
    if shared:
        token_runs["video"] = token_runs["image"]
    starts = {kind: [] for kind in VISUAL_KINDS}
    for kind, tokens in item_tokens(batch):
        start, length = next(token_runs[kind])
        starts[kind].append(start)
        while length < tokens:  # a video's frame pairs (or Qwen3-VL's temporal patches)
            length += next(token_runs[kind])[1]
        assert length == tokens
    for kind in VISUAL_KINDS:
        assert next(token_runs[kind], None) is None
    if not shared:  # separate tokens: visual_kinds is the order of the first tokens of the items
        order = sorted((s, VISUAL_KINDS.index(k)) for k, ss in starts.items() for s in ss)
        assert [code for _, code in order] == batch.visual_kinds.tolist()


@pytest.mark.parametrize("model", ["nemotron-omni", "qwen2.5-vl"])
def test_visual_kinds_mixed_sample_batch_and_packing(tokenizer, model, video_out):
    encoder = task_encoder_for(TaskEncoderConfig(
        model=model, packing=True, seq_length=8192, max_visual_tokens=8000, max_num_frames=4,
        max_pixels=1024 * 256 if model == "nemotron-omni" else 64 * 28 * 28), tokenizer=tokenizer)
    mixed = encoder.encode_sample(mixed_sample("m"))
    image = encoder.encode_sample(image_sample("i", [("user", "<image>x"), ("assistant", "y")],
                                               [(64, 96)]))
    video = encoder.encode_sample(shard_samples(video_out, 1)[0])
    text = encoder.encode_sample(image_sample("t", [("user", "hi"), ("assistant", "y")], []))
    from models.multimodal import VISUAL_KINDS as MODEL_CODES

    assert VISUAL_KINDS == MODEL_CODES == ("image", "video")  # one code table on both sides
    assert mixed.visual_kinds.tolist() == [0, 1, 0] and mixed.visual_kinds.dtype == torch.int64
    assert image.visual_kinds.tolist() == [0] and video.visual_kinds.tolist() == [1]
    assert text.visual_kinds.shape == (0,) and text.visual_kinds.dtype == torch.int64
    assert_kinds_follow_spans(encoder.batch([mixed]), encoder)

    # batching an image sample and a video sample (a blended dataset): rows in order
    batch = encoder.batch([image, video, text])
    assert batch.visual_kinds.tolist() == [0, 1]
    assert_kinds_follow_spans(batch, encoder)
    assert encoder.batch([text]).visual_kinds.shape == (0,)

    # packing keeps the order of the packed samples and of their items
    packed = [encoder.pack_selected_samples([video, mixed]),
              encoder.pack_selected_samples([image, text, video])]
    assert packed[0].visual_kinds.tolist() == [1, 0, 1, 0]
    assert packed[1].visual_kinds.tolist() == [0, 1]
    batch = encoder.batch(packed)
    assert batch.visual_kinds.tolist() == [1, 0, 1, 0, 0, 1]
    assert batch.cu_seqlens is not None
    assert_kinds_follow_spans(batch, encoder)
    assert encoder.pack_selected_samples([text]).visual_kinds.shape == (0,)


# ------------------------------------------------------------------------------- config / wiring
def test_config_knobs_tokenizer_and_encoder_choice(tokenizer, tokenizer_dir, tmp_path):
    assert TaskEncoderConfig(model="nemotron-omni").resolve().geometry is NEMOTRON_OMNI
    assert TaskEncoderConfig(model="nemotron_omni_tiled").resolve().geometry is NEMOTRON_OMNI_TILED
    tiled = TaskEncoderConfig.from_dict({"model": "nemotron-omni-tiled", "max_num_tiles": "4",
                                         "video_maintain_aspect_ratio": "false"}).resolve()
    assert tiled.geometry.max_num_tiles == 4 and not tiled.geometry.video_maintain_aspect_ratio
    assert tiled.geometry.image_mode == "tiled" and tiled.profile.family == "nemotron_omni"
    for bad in ({"model": "qwen2.5-vl", "max_num_tiles": 4},
                {"model": "nemotron-omni", "max_num_tiles": 4},
                {"model": "qwen3-vl", "video_maintain_aspect_ratio": False},
                {"model": "nemotron-omni-tiled", "max_num_tiles": 0},
                {"model": "nemotron-omni", "video_max_pixels": 100}):
        with pytest.raises(ConfigError):
            TaskEncoderConfig(**bad)
    assert TaskEncoderConfig(model="nemotron-omni").resolve().tokenizer == PROFILES[
        "nemotron_omni"].default_tokenizer == "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16"
    qwen = task_encoder_for(TaskEncoderConfig(), tokenizer)
    assert type(qwen) is VLMTaskEncoder and type(qwen.hooks) is QwenVLHooks
    nemotron = task_encoder_for(TaskEncoderConfig(model="nemotron-omni-tiled"), tokenizer)
    assert type(nemotron) is VLMTaskEncoder and type(nemotron.hooks) is NemotronOmniHooks
    ids = tokenizer.convert_tokens_to_ids
    assert (nemotron.vision_start, nemotron.vision_end) == (ids("<img>"), ids("</img>"))
    assert nemotron.image_pad == nemotron.video_pad == ids("<image>")
    assert (nemotron.im_start, nemotron.im_end, nemotron.pad_id) == (
        ids("<|im_start|>"), ids("<|im_end|>"), ids("<|endoftext|>"))
    assert len(tokenizer) == 421
    # the family check: a tokenizer without <img> / </img> / <image> is refused for Nemotron only
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from energon_tasks.families.qwen_vl.hooks import QWEN_SPECIAL_TOKENS
    from energon_tasks.tokenizer import load_tokenizer

    bare = Tokenizer(models.BPE())
    bare.pre_tokenizer = pre_tokenizers.ByteLevel()
    bare.add_special_tokens(list(QWEN_SPECIAL_TOKENS))
    PreTrainedTokenizerFast(tokenizer_object=bare).save_pretrained(str(tmp_path))
    load_tokenizer(str(tmp_path), "qwen3-vl")
    with pytest.raises(ValueError, match="<img>"):
        load_tokenizer(str(tmp_path), "nemotron-omni")
    load_tokenizer(str(tokenizer_dir), "nemotron-omni")


def test_chatml_labels_and_span_layout(make_nemotron):
    encoder = make_nemotron()
    sample = image_sample("c", [("system", "Be brief."), ("user", "A <image> B"),
                                ("assistant", "yes")], [(100, 100)])
    out = encoder.encode_sample(sample)
    ids = out.input_ids.tolist()
    text = encoder.tokenizer.decode(ids)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nA <img>"
                    + "<image>" * 256 + "</img> B<|im_end|>\n<|im_start|>assistant\nyes"
                    "<|im_end|>\n")
    supervised = [i for i, label in zip(ids, out.labels.tolist()) if label != IGNORE_INDEX]
    assert encoder.tokenizer.decode(supervised) == "yes<|im_end|>"
    assert out.image_grid_thw.tolist() == [[1, 32, 32]]  # 100x100 lifted to 1024 patches
    pixels = np.asarray(Image.open(io.BytesIO(sample.media_bytes["img0.png"])))
    np.testing.assert_array_equal(out.pixel_values.numpy(),
                                  hf_image_rows(nemotron_resize(pixels, 512, 512)))
    parsed = CanonicalSample.from_json(sample.conversation.to_json_bytes())
    assert encoder.plan_sample(parsed, "c").total_tokens == len(ids)
