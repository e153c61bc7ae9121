"""InfoVQA conversion: one sample per infographic, answers kept, test rows rejected, spellings."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.conftest import manifest, read_samples, run_cli, summary


def test_accounting_and_grouping(sources, infovqa_out):
    expected = manifest(sources["infovqa"])
    s = summary(infovqa_out)
    assert s["rows_read"] == sum(expected["rows"].values()) == s["rows_written"] + s["rejected"]
    assert s["rejected_by_reason"] == expected["expected_rejects"]
    assert s["samples_written"] == sum(expected["expected_samples"].values())
    samples = [e["json"] for e in read_samples(infovqa_out).values()]
    for sample in samples:
        assert len(sample["media"]) == 1  # the infographic is stored once per sample
        users = [t for t in sample["conversation"] if t["role"] == "user"]
        assert len(users) == len(sample["source"]["rows"])
        assert users[0]["content"].startswith("<image>\n")
        assert all("<image>" not in t["content"] for t in users[1:])
        for turn in sample["conversation"]:
            if turn["role"] == "assistant":
                assert turn["content"] == turn["answers"][0]
    assert max(len(s["source"]["rows"]) for s in samples) >= 4  # several questions per image
    assert any(len(t.get("answers", [])) > 1 for s in samples for t in s["conversation"])
    assert set(Counter(e["split"] for e in read_samples(infovqa_out).values())) == {"train", "val"}


def test_original_resolution_kept(infovqa_out):
    samples = read_samples(infovqa_out).values()
    sizes = [(m["width"], m["height"]) for e in samples for m in e["json"]["media"]]
    assert max(w * h for w, h in sizes) >= 3000 * 4000
    assert any(h >= 3 * w for w, h in sizes)


@pytest.mark.slow
def test_one_question_per_sample(sources, infovqa_out, tmp_path):
    out = tmp_path / "perq"
    run_cli("converters", "infovqa", "--source", str(sources["infovqa"]), "--out", str(out),
            "--one-question-per-sample")
    s = summary(out)
    assert s["samples_written"] == s["rows_written"] == summary(infovqa_out)["rows_written"]


@pytest.mark.slow
def test_lmms_lab_spelling(tmp_path):
    from lookalikes import build_infovqa

    root = build_infovqa(tmp_path / "src", spelling="lmms-lab")
    out = tmp_path / "out"
    proc = run_cli("converters", "infovqa", "--source", str(root), "--out", str(out))
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "declares no train split" in notes[0]
    assert "validation (" in notes[0] and "-> val" in notes[0] and "Ahren09/InfoVQA" in notes[0]
    expected = manifest(root)
    s = summary(out)
    assert s["rows_read"] == sum(expected["rows"].values())
    assert s["rejected_by_reason"] == expected["expected_rejects"]
    samples = [e["json"] for e in read_samples(out).values()]
    assert samples and all(e["source"]["split"] == "validation" for e in samples)
    assert {e["split"] for e in read_samples(out).values()} == {"val"}
