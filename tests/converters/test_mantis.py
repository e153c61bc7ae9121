"""Mantis-Instruct conversion on the lookalike: accounting, repairs, rejects, media metadata."""

from __future__ import annotations

import io

from PIL import Image

from tests.conftest import manifest, read_samples, summary


def test_every_row_accounted_as_the_manifest_says(sources, mantis_out):
    expected = manifest(sources["mantis"])
    s = summary(mantis_out)
    assert s["rows_read"] == sum(expected["rows"].values())
    assert s["rows_read"] == s["rows_written"] + s["rejected"]
    assert s["rejected_by_reason"] == expected["expected_rejects"]
    assert s["fixups_by_kind"] == expected["expected_fixups"]
    assert s["samples_written"] == sum(expected["expected_samples"].values())
    rejects = (mantis_out / "rejects.jsonl").read_text().splitlines()
    assert len(rejects) == s["rejected"]


def test_samples_follow_the_format(mantis_out):
    from energon_tasks.sample_format import CanonicalSample, validate

    samples = read_samples(mantis_out)
    assert samples
    for key, entry in samples.items():
        assert "." not in key
        sample = CanonicalSample.from_json(entry["json"])
        parts = {m.part: entry[m.part] for m in sample.media}
        validate(key, sample, parts)
        for media in sample.media:  # stored sizes are the real ones, bytes the original
            with Image.open(io.BytesIO(parts[media.part])) as img:
                assert img.size == (media.width, media.height)
                assert img.format.lower() == media.format


def test_pitfall_rows(mantis_out):
    samples = [e["json"] for e in read_samples(mantis_out).values()]
    n_media = [len(s["media"]) for s in samples]
    assert 50 in n_media  # the 50-image sample survives whole
    # JPEG bytes under a .png name: stored as jpg, format from content
    png_named_jpeg = [m for s in samples for m in s["media"]
                      if m["source_name"].endswith(".png") and m["format"] == "jpeg"]
    assert png_named_jpeg and all(m["part"].endswith(".jpg") for m in png_named_jpeg)
    # dotted / slashed ids keep their id in the JSON and get a dot-free key
    assert any("." in i or "/" in i for s in samples for i in s["source"]["ids"])
    tall = [m for s in samples for m in s["media"] if m["height"] >= 20 * m["width"]]
    huge = [m for s in samples for m in s["media"] if m["width"] * m["height"] >= 10_000_000]
    assert tall and huge
    # prepended placeholders start the first user turn
    fixed = [s for s in samples if "prepended_image_placeholders" in s["fixups"]]
    assert fixed
    for s in fixed:
        first_user = next(t for t in s["conversation"] if t["role"] == "user")
        assert first_user["content"].startswith("<image>")


def test_part_zips_are_read(sources, mantis_out):
    listed = list(sources["mantis"].rglob("*_images_zips.txt"))
    assert listed, "the lookalike has a split stored as part zips"
    config = listed[0].parent.name
    samples = read_samples(mantis_out).values()
    assert any(e["json"]["source"]["config"] == config and e["json"]["media"] for e in samples)


def test_val_split_from_source_and_carved(sources, mantis_out):
    s = summary(mantis_out)
    assert s["samples_by_split"]["train"] > 0 and s["samples_by_split"]["val"] > 0
    samples = read_samples(mantis_out).values()
    val_sources = {e["json"]["source"]["split"] for e in samples if e["split"] == "val"}
    assert "val" in val_sources and "train" in val_sources  # own val kept, val carved from train
