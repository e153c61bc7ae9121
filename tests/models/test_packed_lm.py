"""Packed batches through the VLM families: megatron's THD path (the rows flattened into one
sequence over ``cu_seqlens``; on CPU ``models.layers.segment_attention.PackedCausalAttention``
stands in for TE's varlen attention, and Mamba layers restart their conv window and state at every
segment: ``models.kernels.mamba``, as do Gated DeltaNet layers: ``models.kernels.gated_delta``)
gives every packed sample the logits and per-token losses it has alone."""

from __future__ import annotations

import pytest
import torch

from tests.models.conftest import build_tiny

IGNORE = -100
#: (family, overrides): Qwen2.5-VL, Qwen3-VL (DeepStack rows land on the flattened tokens), and
#: Nemotron-Omni with Mamba and MoE layers (images and videos share one context token:
#: visual_kinds), Qwen3.5 dense and MoE (Gated DeltaNet layers restart their conv and state per
#: sample: ``models.layers.gated_deltanet``)
CASES = [("qwen2_5_vl", ()), ("qwen3_vl", ()), ("nemotron_omni", ("lm.pattern='ME*E'",)),
         ("qwen3_5", ()), ("qwen3_5_moe", ())]


def with_labels(case: dict) -> dict:
    """Labels = the sample's own tokens, the first (a prompt token in real data) unsupervised."""
    labels = case["input_ids"].clone()
    labels[0, 0] = IGNORE
    return dict(case, labels=labels, loss_mask=(labels != IGNORE).float())


@pytest.mark.parametrize("family,overrides", CASES, ids=[c[0] for c in CASES])
def test_packed_samples_match_samples_alone(family, overrides):
    from lookalikes.model_inputs import pack_inputs
    from models.hf.verify_inputs import make_inputs

    cfg, model = build_tiny(family, *overrides)
    model.eval()
    cases = [with_labels(c) for c in make_inputs(cfg).values()]
    rows = [cases[:2], cases[2:]]  # row 1 holds 1-2 samples and a pad tail
    batch = pack_inputs(rows, tail=5)
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "loss_mask")}
    with torch.no_grad():
        logits = model(**inputs)
        loss, mask = model(**batch)
        leaky = model(**dict(inputs, cu_seqlens=None, max_seqlen=None))  # one causal row
        for r, row in enumerate(rows):
            at = 0
            for case in row:
                n = case["input_ids"].shape[1]
                alone_logits = model(**{k: v for k, v in case.items()
                                        if k not in ("labels", "loss_mask")})
                alone_loss, alone_mask = model(**case)
                torch.testing.assert_close(logits[r, at:at + n], alone_logits[0], rtol=0,
                                           atol=2e-5)
                torch.testing.assert_close(loss[r, at:at + n], alone_loss[0], rtol=0, atol=2e-5)
                assert torch.equal(mask[r, at:at + n], alone_mask[0])
                if at:  # a later sample of a row: without its segment it sees the one before
                    assert not torch.allclose(leaky[r, at:at + n], alone_logits[0], atol=1e-3)
                at += n
        assert mask[-1, at:].sum() == 0  # the pad tail of the last row carries no loss


@pytest.mark.parametrize("causal", [False, True])
def test_segments_of_one_length_are_attended_as_one_batch_exactly(causal):
    """The segment attention (the vision towers' block-diagonal one, and the LM's causal one with
    grouped-query heads) batches the segments of each length (window layers have thousands of
    equal windows): every segment's output equals attention over that segment alone, and no
    segment sees another (lengths 1, repeated, and a lone long one)."""
    import torch.nn.functional as F

    from models.kernels.attention import sdpa_segments

    lengths = [64, 64, 1, 64, 40, 1, 40, 97]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(int(cu[-1]), 4, 16, generator=gen)
    k, v = (torch.randn(int(cu[-1]), 2 if causal else 4, 16, generator=gen) for _ in range(2))
    out = sdpa_segments(q, k, v, cu, scale=0.25, causal=causal)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        kv = [t[start:end].repeat_interleave(4 // t.shape[1], 1) for t in (k, v)]
        alone = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None]
                                                 for t in (q[start:end], *kv)),
                                               scale=0.25, is_causal=causal)
        torch.testing.assert_close(out[start:end], alone[0].transpose(0, 1), rtol=0, atol=1e-6)
