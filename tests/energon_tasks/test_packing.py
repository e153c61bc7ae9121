"""Packing selection, packed rows (positions restart, cu_seqlens) and batch padding rules."""

from __future__ import annotations

import torch

from contract.constants import IGNORE_INDEX
from energon_tasks.loader import get_train_loader
from tests.energon_tasks.conftest import image_sample


def encoded(encoder, count: int):
    """``count`` encoded samples of varied length and image count."""
    out = []
    for n in range(count):
        turns = [("user", "<image>" * (n % 3) + "word " * (3 * n % 17)), ("assistant", "ok")]
        sizes = [(28 * (1 + (n + i) % 4), 56) for i in range(n % 3)]
        out.append(encoder.encode_sample(image_sample(f"s{n}", turns, sizes)))
    return out


def test_selection_respects_budget_and_balances_vision(make_encoder):
    encoder = make_encoder(seq_length=128, packing=True, min_pixels=784)
    samples = encoded(encoder, 24)
    groups = encoder.select_samples_to_pack(samples)
    keys = sorted(s.__key__ for group in groups for s in group)
    assert keys == sorted(s.__key__ for s in samples)  # each sample exactly once
    assert all(sum(len(s.input_ids) for s in g) <= 128 for g in groups)
    patches = [sum(len(s.pixel_values) for s in g) for g in groups]
    mean = sum(patches) / len(groups)
    assert max(patches) <= max(1.25 * sum(patches) / max(1, len(groups) - 1), mean * 1.6)
    tokens = sum(len(s.input_ids) for s in samples)
    assert len(groups) <= -(-tokens // 128) + 2  # close to the minimum number of rows


def test_packed_positions_restart_and_cu_seqlens(make_encoder):
    encoder = make_encoder(seq_length=256, packing=True, min_pixels=784)
    samples = encoded(encoder, 4)
    row = encoder.pack_selected_samples(samples)
    lengths = [len(s.input_ids) for s in samples]
    assert row.seq_lens.tolist() == lengths
    start = 0
    for sample, length in zip(samples, lengths):
        assert torch.equal(row.position_ids[:, start:start + length], sample.position_ids)
        assert row.position_ids[:, start].tolist() == [0, 0, 0]
        start += length
    assert row.image_grid_thw.tolist() == [g for s in samples for g in s.image_grid_thw.tolist()]
    batch = encoder.batch([row, encoder.pack_selected_samples(samples[:1])])
    length = batch.input_ids.shape[1]
    assert length % 8 == 0 and length >= sum(lengths)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist(), length,
              length + lengths[0], 2 * length]
    assert batch.cu_seqlens.tolist() == bounds and batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == max(max(lengths), length - sum(lengths), length - lengths[0])
    assert batch.position_ids.shape == (3, 2, length)


def test_batch_padding_multiple_cp_and_fixed_length(make_encoder):
    samples = encoded(make_encoder(min_pixels=784), 3)
    longest = max(len(s.input_ids) for s in samples)
    cp = make_encoder(min_pixels=784, pad_to_multiple_of=8, context_parallel_size=3,
                      seq_length=4080)
    batch = cp.batch(samples)
    assert batch.input_ids.shape[1] % 24 == 0 and batch.input_ids.shape[1] - longest < 24
    assert batch.cu_seqlens is None
    for i, sample in enumerate(samples):
        n = len(sample.input_ids)
        assert batch.attention_mask[i].sum() == n
        assert (batch.labels[i, n:] == IGNORE_INDEX).all() and (batch.loss_mask[i, n:] == 0).all()
        assert (batch.input_ids[i, n:] == cp.pad_id).all()
    fixed = make_encoder(min_pixels=784, fixed_length=True, seq_length=512).batch(samples)
    assert fixed.input_ids.shape == (3, 512)
    assert fixed.budget_counters["tokens_total"] == 3 * 512
    assert fixed.budget_counters["tokens_real"] == sum(len(s.input_ids) for s in samples)


def test_packed_loader_efficiency(make_encoder, mantis_out):
    encoder = make_encoder(seq_length=512, packing=True, packing_buffer_size=16,
                           max_pixels=100_000)
    loader = get_train_loader(mantis_out, task_encoder=encoder, batch_size=1, num_workers=0,
                              shuffle_buffer_size=8, max_samples_per_sequence=8)
    real = total = 0
    for _, batch in zip(range(6), loader):
        real += batch.budget_counters["tokens_real"]
        total += batch.budget_counters["tokens_total"]
        assert batch.cu_seqlens[-1] == batch.input_ids.numel()
        starts = batch.cu_seqlens[:-1].long()
        assert (batch.position_ids[:, 0].reshape(3, -1)[:, starts] == 0).all()
    assert real / total > 0.8, f"packing efficiency {real / total:.2f}"
