"""LLaVA-Video-178K conversion on the hub's real layout: every config kind in a default run (the
activitynet folder quirk included), llava_hound skipped by default and converted from
--frames-root as frame sequences, repeated placeholders, tar.gz parts, probing, rejects, the
JSON fallback, the extracted folder."""

from __future__ import annotations

import io
import json

import av
import pytest

from energon_tasks.sample_format import FRAMES_FORMAT, unpack_frames
from tests.conftest import manifest, read_samples, run_cli, summary


def test_a_default_run_converts_every_config_kind(sources, video_out):
    expected = manifest(sources["llava-video"])
    s = summary(video_out)
    skipped_rows = sum(expected["skipped_by_default"].values())
    assert s["rows_read"] == sum(expected["rows"].values()) - skipped_rows
    assert s["rows_read"] == s["rows_written"] + s["rejected"]
    assert s["rejected_by_reason"] == expected["expected_rejects"]
    assert s["fixups_by_kind"] == expected["expected_fixups"]
    assert s["samples_written"] == sum(expected["expected_samples"].values())
    converted = set(s["by_config"])
    assert {"0_30_s_academic_v0_1", "0_30_s_youtube_v0_1", "0_30_s_nextqa", "0_30_s_activitynet",
            "0_30_s_perceptiontest"} == converted  # activitynet's files are in *_activitynetqa/
    assert s["skipped_configs"] == {"llava_hound": {
        "rows": expected["skipped_by_default"]["llava_hound"],
        "why": "its videos are not in the repository but frame folders of "
               "ShareGPTVideo/train_video_and_instruction (train_300k); pass --frames-root DIR "
               "to convert it"}}


def test_video_samples(video_out):
    samples = read_samples(video_out)
    codecs = set()
    for entry in samples.values():
        sample = entry["json"]
        assert [m["kind"] for m in sample["media"]] == ["video"]
        text = "".join(t["content"] for t in sample["conversation"])
        assert text.count("<video>") == 1 and "<image>" not in text
        media = sample["media"][0]
        data = entry[media["part"]]
        assert media["bytes"] == len(data)
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            assert (stream.codec_context.width, stream.codec_context.height) == \
                (media["width"], media["height"])
        assert media["frames"] > 0 and media["duration_s"] > 0 and media["fps"] > 0
        assert sample["extra"]["data_source"] == (
            "0_30_s_activitynetqa" if sample["source"]["config"] == "0_30_s_activitynet"
            else sample["source"]["config"])
        codecs.add(media["codec"])
    assert {"h264", "mpeg4"} <= codecs


def test_repeated_placeholders_keep_one_span_where_it_first_appears(video_out):
    repeated = [e["json"] for e in read_samples(video_out).values()
                if "repeated_video_placeholder_removed" in e["json"]["fixups"]]
    assert repeated
    for sample in repeated:
        users = [t["content"] for t in sample["conversation"] if t["role"] == "user"]
        assert users[0].startswith("<video>\n") and len(users) > 1
        assert not any("<video>" in u or "<image>" in u for u in users[1:])


def test_mixed_type_annotation_file_is_read(sources, video_out):
    by_config = summary(video_out)["by_config"]
    rows = manifest(sources["llava-video"])["rows"]
    for config, counts in by_config.items():
        assert counts["rows_read"] == sum(n for k, n in rows.items() if k.split("/")[0] == config)


@pytest.mark.slow
def test_llava_hound_converts_from_frames_root(tmp_path, sources):
    from energon_tasks.config import TaskEncoderConfig
    from energon_tasks.energon_dataset import conversation_sample
    from energon_tasks.task_encoder import task_encoder_for
    from energon_tasks.tokenizer import build_test_tokenizer, load_tokenizer

    expected = manifest(sources["llava-video"])
    frames_root = (sources["llava-video"] / expected["frames_root"]).resolve()
    out = tmp_path / "hound"
    run_cli("converters", "llava-video", "--source", str(sources["llava-video"]), "--out",
            str(out), "--configs", "llava_hound", "--frames-root", str(frames_root),
            "--frames-fps", "2", "--val-fraction", "0")
    s = summary(out)
    assert s["samples_written"] == expected["with_frames_root"]["samples"]
    assert s["skipped_configs"] == {} and s["fixups_by_kind"] == \
        expected["with_frames_root"]["fixups"]
    tokenizer = load_tokenizer(str(build_test_tokenizer(tmp_path / "tokenizer")))
    encoder = task_encoder_for(TaskEncoderConfig(max_num_frames=4, video_fps=2.0), tokenizer)
    for key, entry in read_samples(out).items():
        media = entry["json"]["media"][0]
        assert media["format"] == FRAMES_FORMAT and media["part"] == "vid0.tar"
        frames = unpack_frames(entry["vid0.tar"])
        folder = frames_root / entry["json"]["media"][0]["source_name"]
        assert frames == [f.read_bytes() for f in sorted(folder.iterdir())]  # original bytes
        assert media["frames"] == len(frames) and media["fps"] == 2.0
        raw = {"__key__": key, "json": json.dumps(entry["json"]).encode(),
               "vid0.tar": entry["vid0.tar"]}
        encoded = encoder.encode_sample(conversation_sample(raw))
        assert encoded.video_grid_thw.shape[0] == 1


@pytest.mark.slow
def test_extracted_folder_gives_the_same_samples(tmp_path, sources, video_out):
    from lookalikes import build_llava_video

    root = build_llava_video(tmp_path / "src", extracted=True)
    out = tmp_path / "out"
    run_cli("converters", "llava-video", "--source", str(root), "--out", str(out),
            "--shard-size", "4", "--val-fraction", "0.2")
    assert read_samples(out) == read_samples(video_out)
