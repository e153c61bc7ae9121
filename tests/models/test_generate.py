"""Greedy generation (models/generation/generate.py: the megatron prefill, then the lean decode step
of models/generation/decode_step.py) against transformers' greedy ``generate``, for every family and
LM layer kind: attention (Qwen2.5-VL with q/k/v biases, Qwen3-VL with q/k norms), MoE
(Qwen3-VL-MoE's softmax router, Nemotron's sigmoid router with a shared expert), Mamba2 and MLP
(Nemotron-Omni's hybrid stack), Qwen3.5's Gated DeltaNet (conv and recurrent state; its pads kept
out of them in the padded prefill), gated attention with zero-centred norms and rotary on a quarter
of each head, and Qwen3.5 MoE's sigmoid-gated shared expert; four prompts of unequal length, alone
(batch 1) and together (batch 4, one row stopping early); the lean step is the one taken; the
plain-torch MoE routing equals the router modules'; megatron's own decode step (the fallback,
also taken when a hook sits on a weight the lean step reads) gives the same tokens."""

from __future__ import annotations

import inspect

import pytest
import torch

NEW = 6
NEVER = 10 ** 6  # outside the vocabulary: never generated


def _cases(cfg) -> list[dict]:
    """Four single-row inputs of unequal length: the family's verify cases (each media kind),
    the first again without its last two text tokens, to make four."""
    from models.hf.verify_inputs import make_inputs

    cases = list(make_inputs(cfg).values())[:3]
    short = dict(cases[0], input_ids=cases[0]["input_ids"][:, :-2],
                 position_ids=cases[0]["position_ids"][:, :, :-2])
    cases.append(short)
    assert len({c["input_ids"].shape[1] for c in cases}) == 4
    return cases


def _prompt(case: dict):
    from models.generation.generate import Prompt

    return Prompt(input_ids=case["input_ids"][0], position_ids=case["position_ids"][:, 0],
                  **{k: case.get(k) for k in ("pixel_values", "image_grid_thw",
                                              "pixel_values_videos", "video_grid_thw")})


def _hf_greedy(hf, cfg, case: dict, eos: int) -> list[int]:
    """transformers' greedy ``generate`` of one row (with the token types its M-RoPE reads
    where its forward takes them)."""
    from models.hf.verify_inputs import hf_inputs

    inputs = hf_inputs(cfg, case)
    ids = inputs["input_ids"]
    if "mm_token_type_ids" in inspect.signature(hf.forward).parameters:
        inputs["mm_token_type_ids"] = ((ids == cfg.image_token_id).int()
                                       + 2 * (ids == cfg.video_token_id).int())
    out = hf.generate(**inputs, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    out = out[0, ids.shape[1]:].tolist()
    return out[:out.index(eos)] if eos in out else out


def _check(hf_dir, mcore_dir, monkeypatch):
    from models.checkpointing.checkpoint import load_checkpoint
    from models.convert import load_hf_model
    from models.generation import decode_step
    from models.generation.generate import GenerationStats, greedy_generate
    from models.parallel import init_parallel

    init_parallel()
    model, cfg = load_checkpoint(mcore_dir, use_te=False)
    hf = load_hf_model(hf_dir)
    cases = _cases(cfg)
    prompts = [_prompt(c) for c in cases]
    theirs = [_hf_greedy(hf, cfg, c, NEVER) for c in cases]
    stats = GenerationStats()
    alone = [greedy_generate(model, [p], eos_id=NEVER, max_new_tokens=NEW, stats=stats)[0]
             for p in prompts]
    assert stats.extra["lean_decode"]
    assert alone == theirs and all(len(t) == NEW for t in theirs), (alone, theirs)
    together = greedy_generate(model, prompts, eos_id=NEVER, max_new_tokens=NEW, stats=stats)
    assert together == theirs and stats.extra["lean_decode"]
    row = theirs[1]  # row 1 stops early (at a token new to it), the others where it comes
    first_new = next(i for i, t in enumerate(row) if i and t not in row[:i])
    want = [_hf_greedy(hf, cfg, c, row[first_new]) for c in cases]
    assert len(want[1]) == first_new
    assert greedy_generate(model, prompts, eos_id=row[first_new], max_new_tokens=NEW) == want
    _check_routers(model)
    hook = model.language_model.output_layer.register_forward_hook(lambda *a: None)
    try:  # a hook on a weight the lean step reads (an unmerged LoRA adapter): megatron's step
        assert greedy_generate(model, prompts[:1], eos_id=NEVER, max_new_tokens=NEW,
                               stats=stats) == theirs[:1]
        assert not stats.extra["lean_decode"]
    finally:
        hook.remove()
    monkeypatch.setattr(decode_step, "build", lambda *a, **k: None)  # megatron's decode step
    assert greedy_generate(model, prompts, eos_id=NEVER, max_new_tokens=NEW,
                           stats=stats) == theirs
    assert not stats.extra["lean_decode"]


def _check_routers(model) -> None:
    """The lean step's plain-torch routing equals each MoE router module's own, on rows far
    from the decode's."""
    from megatron.core.transformer.moe.router import TopKRouter

    from models.generation.decode_layers import router_step

    g = torch.Generator().manual_seed(0)
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
        x = torch.randn(16, router.weight.shape[1], generator=g)
        with torch.inference_mode():
            probs, picked = router(x)
            ours, top = router_step(router)(x)
        assert torch.equal(torch.zeros_like(probs).scatter(1, top, ours), probs)
        assert torch.equal(torch.zeros_like(picked).scatter(1, top, True), picked)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_vl_tokens_equal_transformers(family, tiny_hf, qwen_imported, monkeypatch):
    _check(tiny_hf[family], qwen_imported[family], monkeypatch)


def test_qwen3_vl_moe_tokens_equal_transformers(tmp_path, monkeypatch):
    from lookalikes.models import build_tiny_hf
    from models.convert import hf_to_mcore

    hf_dir = build_tiny_hf("qwen3_vl_moe", tmp_path / "hf")
    hf_to_mcore(str(hf_dir), tmp_path / "mcore", tp=1, pp=1)
    _check(hf_dir, tmp_path / "mcore", monkeypatch)


@pytest.mark.parametrize("pattern", ["M*M-", "ME*E"])
def test_nemotron_omni_tokens_equal_transformers(pattern, tiny_nemotron_hf, nemotron_imported,
                                                 monkeypatch):
    _check(tiny_nemotron_hf[pattern], nemotron_imported[pattern], monkeypatch)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_tokens_equal_transformers(family, qwen3_5_hf, qwen3_5_imported, monkeypatch):
    _check(qwen3_5_hf[family], qwen3_5_imported[family], monkeypatch)


@pytest.mark.parametrize("check", ["tp2_qwen", "tp2_nemotron_ME*E", "tp2_qwen3_5"])
def test_tokens_at_tp2_equal_transformers(world2, check):
    """Greedy generation at TP = 2 (2 gloo ranks; megatron's decode step, the vocab-parallel
    logits gathered): two prompts of unequal length as one batch give transformers' tokens
    (Qwen2.5-VL, Qwen3-VL, Nemotron-Omni with MoE and Mamba layers, Qwen3.5 with the Gated
    DeltaNet's states split over the TP ranks)."""
    import json

    from tests.models.conftest import world2_result

    out = world2_result(world2, check)
    generated = json.loads((out / "tp2_generate.json").read_text())
    assert generated
    for family, got in generated.items():
        assert "error" not in got, (family, got)
        assert got["ours"] == got["hf"] and got["lean_decode"] is False, (family, got)


def test_moe_models_under_sequence_parallelism_verify_and_refuse_to_generate(world2):
    """Qwen3-VL-MoE and Qwen3.5 MoE at TP 2 (megatron's MoE layers need sequence parallelism
    there): ``verify`` pads the odd-length inputs to a multiple of TP and gives transformers'
    logits; generation is refused in one line (a one-token decode step cannot be split)."""
    import json

    from tests.models.conftest import world2_result

    out = world2_result(world2, "tp2_moe")
    report = json.loads((out / "tp2_report.json").read_text())
    assert set(report) == {"qwen3_vl_moe", "qwen3_5_moe"}
    for family, diffs in report.items():
        assert max(diffs.values()) < 1e-4, (family, diffs)
    generated = json.loads((out / "tp2_generate.json").read_text())
    for family, got in generated.items():
        assert got == {"error": "ValueError: greedy_generate: a model under sequence "
                       "parallelism (MoE layers at TP > 1) cannot split a one-token decode step "
                       "over the TP ranks: load it at TP 1, its experts over ranks if it needs "
                       "them (EP)"}, (family, got)
