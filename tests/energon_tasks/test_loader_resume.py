"""The savable loader over converted shards: exact resume with 0 and 2 workers (the state through
its JSON form, energon_tasks.loader_state), counters."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from energon_tasks.loader import get_train_loader, get_val_loader
from energon_tasks.loader_state import LoaderStateError, from_plain, to_plain


def take(iterator, count):
    return [(batch.__key__, batch.input_ids.clone(), batch.budget_counters)
            for _, batch in zip(range(count), iterator)]


def assert_same(got, expected):
    assert [keys for keys, _, _ in got] == [keys for keys, _, _ in expected]
    for (_, ids, _), (_, want, _) in zip(got, expected):
        assert torch.equal(ids, want)


@pytest.mark.parametrize(
    ("workers", "packing"),
    [(0, False), (0, True), pytest.param(2, False, marks=pytest.mark.slow)],
)
def test_resume_gives_the_same_next_batches(make_encoder, video_out, workers, packing):
    def loader():
        encoder = make_encoder(seq_length=1024, packing=packing, packing_buffer_size=6,
                               max_num_frames=8)
        return get_train_loader(video_out, task_encoder=encoder, batch_size=2,
                                num_workers=workers, shuffle_buffer_size=6,
                                max_samples_per_sequence=3)

    first = loader()
    iterator = iter(first)
    seen = take(iterator, 3)
    saved = json.dumps(to_plain(first.save_state_rank()))  # what a checkpoint stores
    expected = take(iterator, 3)
    del iterator, first
    resumed = loader()
    resumed.restore_state_rank(from_plain(json.loads(saved)))
    iterator = iter(resumed)
    got = take(iterator, 3)
    del iterator, resumed  # shut the workers down now, not during a later test
    gc.collect()
    assert_same(got, expected)
    counters = [c for _, _, c in seen + expected]
    assert sum(c.get("samples", 0) for c in counters) >= 6  # counters cross worker processes
    assert sum(c.get("frames_sampled", 0) for c in counters) >= 6


def test_val_loader_reads_every_sample_once_with_subflavors(make_encoder, mantis_out):
    encoder = make_encoder(max_pixels=100_000)
    keys, configs, counted = [], set(), 0
    for batch in get_val_loader(mantis_out, task_encoder=encoder, batch_size=3, num_workers=0):
        keys += batch.__key__
        configs |= {flavors["config"] for flavors in batch.__subflavors__}
        counted += batch.budget_counters.get("samples", 0)
    assert len(keys) == len(set(keys)) == counted
    assert len(configs) > 1


def test_loader_state_refuses_foreign_classes():
    """Only Energon's own state classes are rebuilt: a name elsewhere is refused, not imported."""
    for name in ("os:system", "subprocess:Popen", "megatron.energon.nope:X"):
        with pytest.raises(LoaderStateError, match="unknown state class"):
            from_plain({"__t": "state", "class": name, "v": {}})
    with pytest.raises(LoaderStateError, match="untagged"):
        from_plain({"args": ["rm", "-rf", "/"]})
