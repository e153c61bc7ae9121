"""LLaVA-Video-178K conversion: tar.gz parts, probing, rejects, JSON fallback, extracted folder."""

from __future__ import annotations

import io

import av

from tests.conftest import manifest, read_samples, run_cli, summary


def test_accounting_matches_manifest(sources, video_out):
    expected = manifest(sources["llava-video"])
    s = summary(video_out)
    assert s["rows_read"] == sum(expected["rows"].values()) == s["rows_written"] + s["rejected"]
    assert s["rejected_by_reason"] == expected["expected_rejects"]
    assert s["fixups_by_kind"] == expected["expected_fixups"]
    assert s["samples_written"] == sum(expected["expected_samples"].values())


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
        codecs.add(media["codec"])
    assert {"h264", "mpeg4"} <= codecs


def test_mixed_type_annotation_file_is_read(sources, video_out):
    by_config = summary(video_out)["by_config"]
    rows = manifest(sources["llava-video"])["rows"]
    for config, counts in by_config.items():
        assert counts["rows_read"] == sum(n for k, n in rows.items() if k.split("/")[0] == config)


def test_extracted_folder_gives_the_same_samples(tmp_path, sources, video_out):
    from converters.lookalikes import build_llava_video

    root = build_llava_video(tmp_path / "src", extracted=True)
    out = tmp_path / "out"
    run_cli("converters", "llava-video", "--source", str(root), "--out", str(out),
            "--shard-size", "4", "--val-fraction", "0.2")
    assert read_samples(out) == read_samples(video_out)
