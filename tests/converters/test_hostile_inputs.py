"""Hostile inputs through the CLI: every bad row or medium is a reject with a specific reason and
the run goes on; a source that cannot be planned is one line (exit 2) before any shard; paths never
leave the source; sizes are proven by decoding within caps."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest

from energon_tasks.video_decode import decode_video_frames
from tests.conftest import energon, one_error_line, read_samples, run_cli, summary
from tests.converters import hostile as h


def _convert(command: str, source, out, *extra: str, check: bool = True):
    return run_cli("converters", command, "--source", str(source), "--out", str(out),
                   "--val-fraction", "0", "--shard-size", "3", *extra, check=check)


def _reasons(out) -> dict[str, str]:
    """Source id -> reject reason."""
    return {r["id"]: r["reason"] for r in map(json.loads, (out / "rejects.jsonl").open())}


# ---- Mantis: images and zips -------------------------------------------------------------------

@pytest.fixture(scope="module")
def mantis_hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    ok = [("ok.png", h.png()), ("ok.jpg", h.jpeg())]
    zip_members = ok + [("huge.png", h.png_claiming(100_000, 100_000)),
                        ("bad.png", h.png_damaged()), ("bad.jpg", h.jpeg_damaged()),
                        ("deep.png", h.png(40, 30, mode="I;16")), ("crc.png", h.png(seed=9))]
    rows = [
        h.mantis_row("ok", "<image><image>two", ["ok.png", "ok.jpg"]),
        h.mantis_row("none_entry", "<image>x", [None]),
        h.mantis_row("no_path", "<image>x", [{"bytes": None, "path": None}]),
        h.mantis_row("huge", "<image>x", ["huge.png"]),
        h.mantis_row("bad_png", "<image>x", ["bad.png"]),
        h.mantis_row("bad_jpeg", "<image>x", ["bad.jpg"]),
        h.mantis_row("deep", "<image>x", ["deep.png"]),
        h.mantis_row("crc", "<image>x", ["crc.png"]),
        h.mantis_row("escape", "<image>x", ["../../etc/passwd"]),
        h.mantis_row("video_text", "<image><video>x", ["ok.png"]),
    ]
    part_rows = [h.mantis_row("in_good_part", "<image>x", ["a.png"]),
                 h.mantis_row("in_cut_part", "<image>x", ["b.png"])]
    cut = h.zip_with_bad_crc([("b.png", h.png(seed=5)), ("c.png", h.png(seed=6))], "c.png")
    source = h.write_mantis(root / "Mantis-Instruct", {
        "broken": {"rows": rows, "zip": h.zip_with_bad_crc(zip_members, "crc.png")},
        "parts": {"rows": part_rows, "zips_txt": "part1.zip\npart2.zip\n",
                  "parts": {"part1.zip": [("a.png", h.png(seed=2))],
                            "part2.zip": cut[: len(cut) // 2]}},
    })
    out = root / "out"
    proc = _convert("mantis", source, out, "--workers", "2")
    return out, proc


def test_every_bad_image_row_is_a_specific_reject(mantis_hostile):
    out, proc = mantis_hostile
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert _reasons(out) == {
        "none_entry": "bad_record", "no_path": "bad_record", "huge": "image_too_large",
        "bad_png": "undecodable_image", "bad_jpeg": "undecodable_image",
        "crc": "unreadable_archive", "escape": "unsafe_member_name",
        "video_text": "bad_conversation", "in_cut_part": "unreadable_archive"}
    kept = {s["json"]["source"]["ids"][0] for s in read_samples(out).values()}
    assert kept == {"ok", "deep", "in_good_part"}
    s = summary(out)
    assert s["rows_read"] == s["rows_written"] + s["rejected"] == 12


def test_sixteen_bit_image_is_kept_as_stored_and_loads(mantis_hostile):
    from energon_tasks.decode import decode_image

    out, _ = mantis_hostile
    deep = next(s for s in read_samples(out).values() if s["json"]["source"]["ids"] == ["deep"])
    assert deep["img0.png"] == h.png(40, 30, mode="I;16")
    pixels = decode_image(deep["img0.png"], size=(28, 28), max_source_pixels=10**6).pixels
    assert pixels.shape == (28, 28, 3) and pixels.std() > 10  # scaled to 8 bits, not clipped


@pytest.mark.slow
def test_pixel_cap_is_an_option(tmp_path):
    source = h.write_mantis(tmp_path / "src", {"cfg": {
        "rows": [h.mantis_row("big", "<image>x", ["a.png"]),
                 h.mantis_row("small", "<image>x", ["b.png"])],
        "zip": [("a.png", h.png(64, 64)), ("b.png", h.png(8, 8))]}})
    _convert("mantis", source, tmp_path / "out", "--max-image-pixels", "1000")
    assert _reasons(tmp_path / "out") == {"big": "image_too_large"}


@pytest.mark.slow
def test_zip_bomb_is_rejected_unread_and_memory_stays_bounded(tmp_path):
    import subprocess
    import sys
    import time

    import psutil

    from tests.conftest import REPO

    folder = tmp_path / "src" / "cfg"
    folder.mkdir(parents=True)
    bomb = folder / "train_images.zip"
    h.zip_bomb(bomb, "bomb.png", 1 << 30)
    with __import__("zipfile").ZipFile(bomb, "a") as zf:
        zf.writestr("ok.png", h.png())
    assert bomb.stat().st_size < 3 << 20
    rows = [h.mantis_row("bomb", "<image>x", ["bomb.png"]),
            *(h.mantis_row(f"ok{i}", "<image>x", ["ok.png"]) for i in range(6))]
    source = h.write_mantis(tmp_path / "src2", {"cfg": {"rows": rows, "zip": bomb.read_bytes()}})
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "converters", "mantis", "--source", str(source), "--out",
           str(out), "--workers", "2", "--shard-size", "2", "--val-fraction", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        total = 0
        try:
            root = psutil.Process(proc.pid)
            for p in [root, *root.children(recursive=True)]:
                total += p.memory_full_info().pss  # shared pages counted once
        except psutil.Error:
            pass
        peak = max(peak, total)
        time.sleep(0.05)
    assert proc.returncode == 0, proc.stderr.read().decode()[-2000:]
    assert _reasons(out) == {"bomb": "member_too_large"}
    print(f"peak PSS of the --workers 2 conversion with a 1 GiB zip bomb: {peak / 2**20:.0f} MiB")
    assert 0 < peak < 1 << 30


# ---- InfoVQA: text and empty splits -------------------------------------------------------------

@pytest.mark.slow
def test_infovqa_placeholders_in_text_and_an_empty_split(tmp_path):
    page = {"bytes": h.jpeg(120, 200), "path": None}
    other = {"bytes": h.jpeg(120, 200, seed=8), "path": None}
    source = h.write_infovqa(tmp_path / "InfoVQA", {
        "train": [{"image": page, "question": "What is shown?", "answer": ["a chart"]},
                  {"image": page, "question": "Is <image> here?", "answer": ["yes"]},
                  {"image": page, "question": "Which tag?", "answer": ["<video>"]},
                  {"image": other, "question": "Colour?", "answer": ["blue"]},
                  {"image": {"bytes": h.png_claiming(60_000, 60_000), "path": None},
                   "question": "Big?", "answer": ["yes"]}],
        "val": []})
    out = tmp_path / "out"
    _convert("infovqa", source, out)
    assert _reasons(out) == {"train-1": "placeholder_in_text", "train-2": "placeholder_in_text",
                             "train-4": "image_too_large"}
    assert summary(out)["samples_written"] == 2 and summary(out)["rows_read"] == 5


# ---- LLaVA-Video: archives, records, videos ------------------------------------------------------

@pytest.fixture(scope="module")
def video_hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile_video")
    avi, real_frames = h.avi_claiming_frames()
    good = [("v/ok.mp4", h.clip()), ("v/one.mp4", h.one_frame_clip()),
            ("v/moov.mp4", h.broken_moov_clip()), ("v/claims.avi", avi),
            ("v/long.mp4", h.clip(seconds=3))]
    import gzip
    import io
    import tarfile

    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w") as tar:
        filler = np.random.default_rng(0).bytes(300_000)  # incompressible: the cut lands in it
        for name, data in [("v/early.mp4", h.clip(1.0)), ("v/filler.bin", filler),
                           ("v/late.mp4", h.clip(2.0))]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    truncated = buf.getvalue()[: len(buf.getvalue()) * 2 // 3]
    records = [h.video_record("ok", "v/ok.mp4"), h.video_record("one", "v/one.mp4"),
               h.video_record("moov", "v/moov.mp4"), h.video_record("claims", "v/claims.avi"),
               h.video_record("long", "v/long.mp4"), h.video_record("path_int", 42),
               "not an object", h.video_record("surrogate\ud800", "v/ok.mp4"),
               h.video_record("early", "v/early.mp4"), h.video_record("late", "v/late.mp4")]
    outside = root / "outside.mp4"
    outside.write_bytes(h.clip())
    source = h.write_llava_video(root / "LLaVA-Video-178K", {
        "tars": {"records": h.raw_json(records), "parts": [good, truncated]},
        "folder": {"records": [h.video_record("inside", "v/in.mp4"),
                               h.video_record("symlink", "v/link.mp4")],
                   "extracted": {"v/in.mp4": h.clip()}, "links": {"v/link.mp4": outside}},
    })
    out = root / "out"
    proc = _convert("llava-video", source, out, "--max-video-seconds", "2.5", "--workers", "2")
    return out, proc, real_frames


def test_every_bad_video_row_is_a_specific_reject(video_hostile):
    out, proc, _ = video_hostile
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    reasons = _reasons(out)
    # the record that is not an object has no id: it gets one from its row (position 6)
    row_made = [i for i in reasons if i.startswith("row6-")]
    assert len(row_made) == 1 and reasons.pop(row_made[0]) == "bad_record"
    assert reasons == {
        "one": "too_few_frames", "moov": "unreadable_video", "long": "video_too_long",
        "path_int": "bad_record", "surrogate\ud800": "bad_record",
        "late": "unreadable_archive", "symlink": "unsafe_member_name"}
    kept = {s["json"]["source"]["ids"][0] for s in read_samples(out).values()}
    assert kept == {"ok", "claims", "early", "inside"}


def test_claimed_frame_count_is_replaced_by_the_measured_one(video_hostile):
    out, _, real_frames = video_hostile
    sample = next(s for s in read_samples(out).values()
                  if s["json"]["source"]["ids"] == ["claims"])
    media = sample["json"]["media"][0]
    assert media["frames"] == real_frames and "video_frames_measured" in sample["json"]["fixups"]
    frames = decode_video_frames(sample["vid0.avi"], list(range(0, real_frames, 3)),
                                 size=(24, 32), max_source_pixels=10**6).frames
    assert len({f.mean().round() for f in frames}) == len(frames)  # not copies of frame 0
    assert Counter(summary(out)["fixups_by_kind"])["video_frames_measured"] == 1


# ---- planning problems: one line, exit 2, nothing written --------------------------------------

def _no_id(tmp):
    features = h.Features({k: v for k, v in h.MANTIS_FEATURES.items() if k != "id"})
    rows = [{k: v for k, v in h.mantis_row("x", "<image>x", ["a.png"]).items() if k != "id"}]
    return "mantis", h.write_mantis(tmp / "s", {"cfg": {"rows": rows, "zip": []}},
                                    features=features), "no id column"


def _escaping_zip_list(tmp):
    (tmp / "elsewhere.zip").write_bytes(b"")
    return "mantis", h.write_mantis(tmp / "s", {"cfg": {
        "rows": [h.mantis_row("x", "<image>x", ["a.png"])],
        "zips_txt": "../../elsewhere.zip\n"}}), "leaves the source"


def _dotdot_config(tmp):
    return "mantis", h.write_mantis(tmp / "s", {"..": {
        "folder": "dots", "rows": [h.mantis_row("x", "<image>x", ["a.png"])],
        "zip": [("a.png", h.png())]}}), "leaves the source"


def _truncated_annotations(tmp):
    text = json.dumps([h.video_record("a", "v.mp4")]).encode()
    return "llava-video", h.write_llava_video(tmp / "s", {"cfg": {
        "records": text[:-7], "extracted": {"v.mp4": h.clip()}}}), "cfg_oe_qa_processed.json"


def _latin1_annotations(tmp):
    text = json.dumps([h.video_record("caf\u00e9", "v.mp4")], ensure_ascii=False)
    return "llava-video", h.write_llava_video(tmp / "s", {"cfg": {
        "records": text.encode("latin-1"), "extracted": {"v.mp4": h.clip()}}}), "cannot be parsed"


@pytest.mark.parametrize("build", [_no_id, _escaping_zip_list, _dotdot_config,
                                   _truncated_annotations, _latin1_annotations])
def test_unplannable_source_is_one_line_before_any_shard(tmp_path, build):
    command, source, words = build(tmp_path)
    out = tmp_path / "out"
    line = one_error_line(_convert(command, source, out, check=False), 2)
    assert words in line, line
    assert not (out / "shards").exists()


@pytest.mark.slow
def test_configs_that_sanitise_alike_stay_apart_and_inside(tmp_path):
    configs = {name: {"rows": [h.mantis_row(f"r{k}", "<image>x", ["a.png"])],
                      "zip": [("a.png", h.png(seed=k))]}
               for k, name in enumerate(["a b", "a_b", "."])}
    out = tmp_path / "out"
    _convert("mantis", h.write_mantis(tmp_path / "s", configs), out)
    s = summary(out)
    assert s["samples_written"] == 3 and set(s["by_config"]) == set(configs)
    folders = {p.parent.relative_to(out / "shards" / "train").as_posix()
               for p in (out / "shards").rglob("*.tar")}
    assert len(folders) == 3 and all("/" not in f and f not in (".", "..") for f in folders)
    assert energon("info", str(out)).returncode == 0


def test_every_rejected_run_exits_1_with_one_line(tmp_path):
    source = h.write_mantis(tmp_path / "s", {"cfg": {
        "rows": [h.mantis_row("x", "<image>x", ["missing.png"])], "zip": []}})
    line = one_error_line(_convert("mantis", source, tmp_path / "out", check=False), 1)
    assert "no sample written" in line and "missing_image=1" in line
    assert os.path.exists(tmp_path / "out" / "rejects.jsonl")
