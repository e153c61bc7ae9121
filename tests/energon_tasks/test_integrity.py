"""Integrity at load: a flipped byte in a media member fails its SHA-256 and a damaged tar header
cannot be read; each skips one sample (its key logged, its reason counted) and the loader goes on;
Energon's own `lint` names the damaged samples."""

from __future__ import annotations

import logging
import shutil
import tarfile

import pytest

from energon_tasks.loader import get_val_loader
from tests.conftest import energon, read_samples


def _member_offsets(tar_path):
    with tarfile.open(tar_path) as tar:
        return {m.name: (m.offset, m.offset_data, m.size) for m in tar}


@pytest.fixture(scope="module")
def damaged(tmp_path_factory, mantis_out):
    """A copy of the Mantis conversion with one media byte flipped and one tar header broken."""
    out = tmp_path_factory.mktemp("damaged") / "out"
    shutil.copytree(mantis_out, out)
    tars = sorted((out / "shards" / "train").rglob("*.tar"))
    first, second = tars[0], tars[1]
    members = _member_offsets(first)
    name = next(n for n in members if ".img" in n)
    _, data_at, size = members[name]
    blob = bytearray(first.read_bytes())
    blob[data_at + size // 2] ^= 0x55
    first.write_bytes(bytes(blob))
    members = _member_offsets(second)
    header_at = members[sorted(members)[-1]][0]  # the last member of the second shard
    blob = bytearray(second.read_bytes())
    blob[header_at + 148:header_at + 156] = b"garbage!"  # its header checksum field
    second.write_bytes(bytes(blob))
    flipped = name.split(".")[0]
    return out, flipped, second.relative_to(out).as_posix()


def test_damaged_samples_are_skipped_counted_and_logged(make_encoder, damaged, mantis_out,
                                                        caplog):
    out, flipped, broken_shard = damaged
    encoder = make_encoder(max_pixels=100_000)
    keys, counters = [], {}
    with caplog.at_level(logging.WARNING, logger="energon_tasks.skips"):
        for batch in get_val_loader(out, split_part="train", task_encoder=encoder,
                                    batch_size=2, num_workers=0):
            keys += batch.__key__
            for name, value in batch.budget_counters.items():
                counters[name] = counters.get(name, 0) + value
    total = sum(1 for s in read_samples(mantis_out).values() if s["split"] == "train")
    total -= counters.get("skipped_too_many_images", 0)  # the budget's own skip
    assert counters.get("skipped_checksum_mismatch") == 1
    assert counters.get("skipped_unreadable_tar_member") == 1
    assert flipped not in keys and len(keys) == total - 2
    logged = caplog.text
    assert f"skipped sample {flipped}: checksum_mismatch" in logged
    assert f"skipped sample {broken_shard}@" in logged and "unreadable_tar_member" in logged


def test_energon_lint_names_the_damaged_samples(damaged):
    out, flipped, broken_shard = damaged
    lint = energon("lint", str(out))
    # Energon 7.4.1's lint logs every failing sample but ignores its own failure handler (it
    # passes the deprecated `handler` kwarg), so its exit code stays 0: read what it names
    report = lint.stdout + lint.stderr
    assert f"{flipped}: checksum_mismatch" in report
    assert f"{broken_shard}@" in report and "unreadable_tar_member" in report


def test_eval_reads_past_damaged_samples(damaged, tokenizer, caplog):
    """eval.py reads its samples with the loaders' worker config: the same two skips, no stop."""
    from energon_tasks.config import TaskEncoderConfig
    from recipes import evaluation

    out, flipped, _ = damaged
    with caplog.at_level(logging.WARNING, logger="energon_tasks.skips"):
        keys = [s.__key__ for s in evaluation.read_samples(str(out), "train", TaskEncoderConfig(),
                                                           tokenizer, limit=None)]
    assert keys and flipped not in keys
    assert f"skipped sample {flipped}: checksum_mismatch" in caplog.text
    assert "unreadable_tar_member" in caplog.text
