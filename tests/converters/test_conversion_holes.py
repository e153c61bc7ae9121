"""Conversion holes through the CLI: records nested beyond the depth cap, null ids, Mantis images
embedded in the row, a `--frames-root` that matches nothing, a source changed between a failed run
and its rerun, videos over the pixel cap or starting without a keyframe."""

from __future__ import annotations

import json

import pytest

from tests.conftest import one_error_line, read_samples, run_cli, summary
from tests.converters import hostile as h


def _convert(command: str, source, out, *extra: str, check: bool = True):
    return run_cli("converters", command, "--source", str(source), "--out", str(out),
                   "--val-fraction", "0", *extra, check=check)


def _rejects(out) -> list[dict]:
    return [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_deeply_nested_records_are_bad_record_rejects(tmp_path):
    ok = json.dumps(h.video_record("ok", "v/ok.mp4"))
    # 100 levels: parsed (by the json builder), over the cap; 100000: deeper than Python's
    # recursion limit, so the file is split into its records
    mid = json.dumps(h.video_record("mid", "v/ok.mp4"))[:-1] + f', "x": {_nested(100)}}}'
    deep = '{"id": "deep", "video": "v/ok.mp4", "conversations": ' + _nested(100_000) + "}"
    source = h.write_llava_video(tmp_path / "s", {
        "parsed": {"records": f"[{ok}, {mid}]".encode(), "extracted": {"v/ok.mp4": h.clip()}},
        "split": {"records": f"[{ok}, {deep}, {ok}]".encode(),
                  "extracted": {"v/ok.mp4": h.clip()}},
    })
    out = tmp_path / "out"
    proc = _convert("llava-video", source, out)
    assert "Traceback" not in proc.stderr and "RecursionError" not in proc.stdout
    rejects = _rejects(out)
    assert {(r["config"], r["row"], r["reason"]) for r in rejects} == {
        ("parsed", 1, "bad_record"), ("split", 1, "bad_record")}
    assert all("nested deeper than 64 levels" in r["detail"] for r in rejects)
    s = summary(out)
    assert s["samples_written"] == 3 and "internal_error" not in s["rejected_by_reason"]


def test_null_and_empty_ids_get_keys_from_the_row(tmp_path):
    records = [h.video_record(None, "v/ok.mp4"), h.video_record("", "v/ok.mp4"),
               {k: v for k, v in h.video_record("x", "v/ok.mp4").items() if k != "id"},
               h.video_record("named", "v/ok.mp4")]
    source = h.write_llava_video(tmp_path / "s", {"cfg": {
        "records": records, "extracted": {"v/ok.mp4": h.clip()}}})
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        _convert("llava-video", source, out)
    samples = read_samples(outs[0])
    ids = sorted(e["json"]["source"]["ids"][0] for e in samples.values())
    assert ids[0] == "named" and [i.split("-")[0] for i in ids[1:]] == ["row0", "row1", "row2"]
    assert len(set(ids)) == 4 and not any(k.startswith("None") for k in samples)
    assert summary(outs[0])["ids_from_row"] == 3
    assert set(read_samples(outs[1])) == set(samples)  # deterministic


def test_mantis_null_ids_and_embedded_image_bytes(tmp_path):
    rows = [h.mantis_row(None, "<image>x", [{"bytes": h.png(seed=1), "path": "emb.png"}]),
            h.mantis_row("nameless", "<image>x", [{"bytes": h.jpeg(seed=2), "path": None}]),
            h.mantis_row("mixed", "<image><image>x",
                         ["in_zip.png", {"bytes": h.png(seed=3), "path": "emb2.png"}]),
            h.mantis_row("broken", "<image>x", [{"bytes": b"not an image", "path": "b.png"}])]
    source = h.write_mantis(tmp_path / "s", {"cfg": {"rows": rows,
                                                     "zip": [("in_zip.png", h.png(seed=4))]}})
    out = tmp_path / "out"
    _convert("mantis", source, out)
    s = summary(out)
    assert s["samples_written"] == 3 and s["rejected_by_reason"] == {"undecodable_image": 1}
    assert s["ids_from_row"] == 1
    media = {e["json"]["source"]["ids"][0]: e["json"]["media"] for e in read_samples(out).values()}
    assert [m["format"] for m in media["nameless"]] == ["jpeg"]
    assert len(media["mixed"]) == 2
    assert [i for i in media if i.startswith("row0-")]


def _hound_source(tmp_path):
    records = [h.video_record(f"r{k}", f"clip{k}") for k in range(3)]
    source = h.write_llava_video(tmp_path / "s", {"hound": {"records": records}})
    frames = tmp_path / "frames" / "train_300k"
    for k in range(3):
        (frames / f"clip{k}").mkdir(parents=True)
        for f in range(3):
            (frames / f"clip{k}" / f"{f:03d}.png").write_bytes(h.png(seed=f))
    return source, frames


def test_frames_root_that_matches_nothing_is_one_line(tmp_path):
    source, frames = _hound_source(tmp_path)
    out = tmp_path / "out"
    line = one_error_line(_convert("llava-video", source, out, "--frames-root",
                                   str(frames.parent), check=False), 2)
    assert f"--frames-root {frames.parent}: none of the first 3 videos" in line
    assert str(frames.parent / "clip0") in line
    assert not (out / "shards").exists()
    _convert("llava-video", source, tmp_path / "ok", "--frames-root", str(frames))
    assert summary(tmp_path / "ok")["samples_written"] == 3


def test_help_texts_say_what_the_caps_do():
    text = run_cli("converters", "mantis", "--help").stdout
    assert "decided from the header" not in text
    assert "--max-video-pixels" in text and "--restart" in text


@pytest.mark.parametrize("command", ["mantis", "infovqa", "llava-video"])
def test_every_command_has_the_restart_flag(command):
    assert "--restart" in run_cli("converters", command, "--help").stdout


def test_source_changed_since_the_failed_run_is_refused_unless_restart(tmp_path):
    rows = [h.mantis_row("x", "<image>x", ["a.png"])]
    source = h.write_mantis(tmp_path / "s", {"cfg": {"rows": rows, "zip": []}})
    out = tmp_path / "out"
    line = one_error_line(_convert("mantis", source, out, check=False), 1)
    assert "no sample written" in line  # the image is missing: the run failed, shards recorded
    h.write_mantis(tmp_path / "s", {"cfg": {"rows": rows, "zip": [("a.png", h.png())]}})
    line = one_error_line(_convert("mantis", source, out, check=False), 2)
    assert f"--source {source} changed since the interrupted run" in line
    assert "cfg/train_images.zip" in line and "--restart" in line
    _convert("mantis", source, out, "--restart")
    s = summary(out)
    assert s["samples_written"] == 1 and s["rejected"] == 0
    _convert("mantis", source, out)  # unchanged since: the same command is accepted again
    line = one_error_line(_convert("mantis", source, out, "--restart", "--num-partitions", "2",
                                   check=False), 2)
    assert "--restart" in line and "--num-partitions" in line


def test_videos_over_the_pixel_cap_or_cut_before_a_keyframe_are_rejected(tmp_path):
    records = [h.video_record("ok", "v/ok.mp4"), h.video_record("huge", "v/huge.avi"),
               h.video_record("cut", "v/cut.mkv"), h.video_record("wide", "v/ok2.mp4")]
    source = h.write_llava_video(tmp_path / "s", {"cfg": {"records": records, "extracted": {
        "v/ok.mp4": h.clip(), "v/ok2.mp4": h.clip(seconds=0.5),
        "v/huge.avi": h.mjpeg_claiming(12000, 12000), "v/cut.mkv": h.cut_clip()}}})
    out = tmp_path / "out"
    _convert("llava-video", source, out)
    reasons = {r["id"]: (r["reason"], r["detail"]) for r in _rejects(out)}
    assert reasons["huge"] == ("video_too_large", "v/huge.avi: 12000x12000 frames (its first "
                               "frame's header) are over --max-video-pixels 89478485")
    assert reasons["cut"][0] == "no_leading_keyframe"
    assert set(reasons) == {"huge", "cut"} and summary(out)["samples_written"] == 2
    low = tmp_path / "low"
    line = one_error_line(_convert("llava-video", source, low, "--max-video-pixels", "700",
                                   check=False), 1)  # 32x24 = 768 pixels: every clip is over
    assert "(video_too_large=4)" in line
