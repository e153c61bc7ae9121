"""Nemotron-Omni on megatron-core: HF import parity (patterns with Mamba2 layers, on CPU through
models/kernels/mamba.py, with attention, MLP and MoE layers; one image, interleaved images, tiles,
a video), round trip, count-mismatch errors, the model built where mamba_ssm is missing, mixed
image + video batches on the shared ``<image>`` token (``visual_kinds``), tiny config training,
generation (KV cache + Mamba states) against full forwards and against transformers' ``generate``,
FLOPs, TP=2 and PP=2 import parity."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO
from tests.models.conftest import train_steps, world2_result

TOL = 1e-4


@pytest.fixture(scope="module")
def imported(nemotron_imported):
    return nemotron_imported


@pytest.mark.parametrize("pattern", ["M*M-", "ME*E"])
def test_logits_match_transformers(pattern, tiny_nemotron_hf, imported):
    from models.convert import verify

    report = verify(tiny_nemotron_hf[pattern], imported[pattern])
    assert set(report) == {"one_image", "images_interleaved", "tiles", "video"}
    for name, row in report.items():
        assert row["max_abs_logit_diff"] <= TOL, (pattern, name, row)


@pytest.mark.parametrize("pattern", ["M*M-", "ME*E"])
def test_round_trip_identical(tiny_nemotron_hf, imported, tmp_path, pattern):
    """HF -> ours -> HF gives the same keys (every layer kind's names) and tensors."""
    from safetensors.torch import load_file

    from models.convert import mcore_to_hf

    source = tiny_nemotron_hf[pattern]
    mcore_to_hf(imported[pattern], tmp_path / "hf")
    before = load_file(str(source / "model.safetensors"))
    after = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert (json.loads((tmp_path / "hf" / "config.json").read_text())
            == json.loads((source / "config.json").read_text()))


def test_builds_without_mamba_ssm_through_the_kernel_choice(monkeypatch):
    """megatron's Mamba mixer as a machine without mamba_ssm imports it (a bare GPU image: no
    kernels, ``HAVE_MAMBA_SSM`` false): the model builds and runs, its mixers on the torch
    kernels ``models.kernels`` bound (no CPU branch does it)."""
    import importlib.util
    from unittest.mock import MagicMock

    from models import kernels
    from models.families import build_model
    from models.families.nemotron_omni.config import load_yaml
    from models.hf.verify_inputs import make_inputs
    from models.kernels.mamba import RMSNormGated
    from models.parallel import init_parallel

    if importlib.util.find_spec("mamba_ssm") is not None:
        pytest.skip("mamba_ssm is installed")
    init_parallel()
    from megatron.core.ssm import mamba_mixer

    for name in ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined",
                 "selective_state_update", "causal_conv1d_fn", "causal_conv1d_update"):
        monkeypatch.setattr(mamba_mixer, name, None, raising=False)
    monkeypatch.setattr(mamba_mixer, "RMSNormGated", MagicMock())
    monkeypatch.setattr(mamba_mixer, "HAVE_MAMBA_SSM", False)
    monkeypatch.setattr(kernels, "_BOUND", {})  # nothing chosen in this process yet
    cfg = load_yaml(REPO / "configs" / "nemotron_omni_tiny.yaml")
    model = build_model(cfg, use_te=False).eval()
    assert kernels.chosen("mamba").name == "torch"
    norms = [m.norm for m in model.modules() if type(m).__name__ == "MambaMixer"]
    assert norms and all(isinstance(norm, RMSNormGated) for norm in norms)
    with torch.no_grad():
        logits = model(**make_inputs(cfg)["one_image"])
    assert torch.isfinite(logits).all()


def test_count_mismatch_names_row(imported):
    from models.checkpointing.checkpoint import load_checkpoint
    from models.hf.verify_inputs import make_inputs
    from models.parallel import init_parallel

    init_parallel()
    model, cfg = load_checkpoint(imported["M*M-"], use_te=False)
    inputs = make_inputs(cfg)["images_interleaved"]
    ids = inputs["input_ids"].clone()
    ids[0, (ids[0] == cfg.image_token_id).nonzero()[0]] = 5  # drop one context token
    inputs["input_ids"] = ids
    with pytest.raises(ValueError, match=r"batch row 0 \(k0\): .* 14 <\|image_pad\|> tokens "
                                         r"but 15 image embeddings"):
        with torch.no_grad():
            model(**inputs, sample_keys=["k0"])
    # one context token for images and videos (HF's processor): both need the batch's order
    model.cfg = dataclasses.replace(cfg, video_token_id=cfg.image_token_id)
    both = make_inputs(model.cfg)
    with pytest.raises(ValueError, match="share context token .* pass the batch's visual_kinds"):
        with torch.no_grad():
            model(**both["one_image"], pixel_values_videos=both["video"]["pixel_values_videos"],
                  video_grid_thw=both["video"]["video_grid_thw"])


def mixed_row(cfg, items, seed: int) -> dict:
    """One row of text and ``items`` ((kind, (t, h, w)) each, wrapped in <img>..</img>): its
    batch-contract fields, ``visual_kinds`` included (tokens: the config's context ids)."""
    g = torch.Generator().manual_seed(seed)
    v, merge = cfg.vision, cfg.merge_size
    widths = {"image": v.in_channels * v.patch_size ** 2}
    widths["video"] = widths["image"] * v.video_temporal_patch_size
    parts = [torch.randint(0, 400, (4,), generator=g)]
    grids = {"image": [], "video": []}
    for kind, (t, h, w) in items:
        token = cfg.image_token_id if kind == "image" else cfg.video_token_id
        parts += [torch.tensor([cfg.vision_start_token_id]),
                  torch.full((t * h * w // merge ** 2,), token),
                  torch.tensor([cfg.vision_end_token_id]), torch.randint(0, 400, (3,), generator=g)]
        grids[kind].append([t, h, w])
    row = {"input_ids": torch.cat(parts)[None],
           "visual_kinds": torch.tensor([0 if kind == "image" else 1 for kind, _ in items])}
    for kind, suffix in (("image", ""), ("video", "_videos")):
        grid = torch.tensor(grids[kind], dtype=torch.long).reshape(-1, 3)
        row[f"{kind}_grid_thw"] = grid
        row[f"pixel_values{suffix}"] = torch.randn(int(grid.prod(-1).sum()), widths[kind],
                                                   generator=g)
    return row


def stack_rows(rows: list[dict], pad_id: int) -> dict:
    """Rows -> one batch: ids right-padded to the longest row, media and kinds concatenated."""
    length = max(r["input_ids"].shape[1] for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :row["input_ids"].shape[1]] = row["input_ids"][0]
    batch = {key: torch.cat([r[key] for r in rows]) for key in rows[0] if key != "input_ids"}
    return {"input_ids": ids, "position_ids": torch.arange(length).expand(3, len(rows), -1),
            **batch}


def test_mixed_image_video_batch_matches_rows_alone():
    """Images and videos on the one ``<image>`` token (the tiny config, as HF): a batch whose rows
    mix both kinds, scattered in ``visual_kinds`` order, gives each row the logits it has alone;
    without the order (or with a wrong one) the model refuses, naming the row."""
    from models.families import build_model
    from models.families.nemotron_omni.config import load_yaml
    from models.parallel import init_parallel

    cfg = load_yaml(REPO / "configs" / "nemotron_omni_tiny.yaml")
    assert cfg.image_token_id == cfg.video_token_id
    init_parallel()
    torch.manual_seed(0)
    model = build_model(cfg, use_te=False).eval()
    rows = [mixed_row(cfg, [("image", (1, 4, 6)), ("video", (2, 4, 4)), ("image", (1, 2, 2))], 1),
            mixed_row(cfg, [("video", (2, 2, 4)), ("image", (2, 4, 4))], 2),  # 2 tiles
            mixed_row(cfg, [("image", (1, 4, 4))], 3)]
    batch = stack_rows(rows, pad_id=0)
    assert batch["visual_kinds"].tolist() == [0, 1, 0, 1, 0, 0]
    with torch.no_grad():
        logits = model(**batch, sample_keys=["k0", "k1", "k2"])
        for i, row in enumerate(rows):
            alone = model(**row, position_ids=None)
            n = row["input_ids"].shape[1]
            torch.testing.assert_close(logits[i, :n], alone[0], rtol=0, atol=1e-5)
        # one kind in the batch: the order is not needed (today's path)
        alone = model(**{k: v for k, v in rows[2].items() if k != "visual_kinds"},
                      position_ids=None)
        torch.testing.assert_close(logits[2, :rows[2]["input_ids"].shape[1]], alone[0],
                                   rtol=0, atol=1e-5)
        # the order matters: the same items in another order give other logits
        swapped = model(**dict(rows[0], visual_kinds=torch.tensor([1, 0, 0])), position_ids=None)
        assert not torch.allclose(swapped, logits[:1, :rows[0]["input_ids"].shape[1]])
        with pytest.raises(ValueError, match=r"visual_kinds \(3 codes: .*\) does not match"):
            model(**dict(rows[0], visual_kinds=torch.tensor([1, 1, 0])), position_ids=None)
        with pytest.raises(ValueError, match="pass the batch's visual_kinds"):
            model(**dict(batch, visual_kinds=None))
        wrong = dict(batch, visual_kinds=torch.tensor([0, 1, 1, 0, 0, 0]))
        message = (r"batch row 0 \(k0\): 15 shared image/video context \(420\) tokens but its "
                   r"visual items in order give 18 embeddings")
        with pytest.raises(ValueError, match=message):
            model(**wrong, sample_keys=["k0", "k1", "k2"])


def test_tiny_config_trains_and_generates():
    """configs/nemotron_omni_tiny.yaml ("M*M-"): loss falls within a few CPU steps; greedy
    generation (KV cache and Mamba conv / SSM states, a batch of two prompt lengths) equals greedy
    decoding by full forwards."""
    from models.families import build_model
    from models.families.nemotron_omni.config import load_yaml
    from models.generation.generate import Prompt, greedy_generate
    from models.hf.verify_inputs import make_inputs
    from models.parallel import init_parallel

    for path in sorted((REPO / "configs").glob("nemotron_omni_*.yaml")):
        load_yaml(path)  # every shipped model config parses
    cfg = load_yaml(REPO / "configs" / "nemotron_omni_tiny.yaml")
    init_parallel()
    torch.manual_seed(0)
    model = build_model(cfg, use_te=False).train()
    cases = make_inputs(cfg)
    batch = cases["images_interleaved"]
    losses = train_steps(model, batch)
    assert losses[-1] < losses[0]
    unused = {"embeddings.video_patch_projection.weight"}  # images only in this batch
    assert all(p.grad is not None for n, p in model.vision.named_parameters() if n not in unused)

    model.eval()
    prompts = [Prompt(input_ids=c["input_ids"][0], position_ids=c["position_ids"][:, 0],
                      pixel_values=c["pixel_values"], image_grid_thw=c["image_grid_thw"])
               for c in (cases["one_image"], cases["images_interleaved"])]
    generated = greedy_generate(model, prompts, eos_id=-1, max_new_tokens=5)
    lm = model.language_model
    for prompt, tokens in zip(prompts, generated):  # full forwards over prompt + generated
        reference = []
        with torch.no_grad():
            prefix, _ = model.embed(prompt.input_ids[None], prompt.pixel_values,
                                    prompt.image_grid_thw)
            for _ in range(5):
                new = lm.embedding(input_ids=torch.tensor([reference], dtype=torch.long),
                                   position_ids=None)
                logits = lm(None, None, None, decoder_input=torch.cat([prefix, new]))
                reference.append(int(logits[0, -1].argmax()))
        assert tokens == reference


def _prompt(case: dict):
    from models.generation.generate import Prompt

    return Prompt(input_ids=case["input_ids"][0], position_ids=case["position_ids"][:, 0],
                  **{k: case.get(k) for k in ("pixel_values", "image_grid_thw",
                                              "pixel_values_videos", "video_grid_thw")})


def _hf_greedy(hf, inputs: dict, new: int, eos: int) -> list[int]:
    ids = inputs["input_ids"]
    out = hf.generate(**inputs, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=new, eos_token_id=eos, pad_token_id=0)
    out = out[0, ids.shape[1]:].tolist()
    return out[:out.index(eos)] if eos in out else out


def test_greedy_tokens_equal_transformers_generate(tiny_nemotron_hf, imported):
    """"M*M-": models.generation.generate (megatron's KV cache, Mamba prefill states then one-token
    decode steps) gives transformers' ``generate`` tokens on one image, interleaved images, tiles
    and a video; stopping at a token of the video run stops both at the same place; the four prompts
    in one call (unequal lengths: one run per length) give what each gives alone."""
    from models.checkpointing.checkpoint import load_checkpoint
    from models.convert import load_hf_model
    from models.generation.generate import greedy_generate
    from models.hf.verify_inputs import hf_inputs, make_inputs
    from models.parallel import init_parallel

    never = 10 ** 6  # outside the vocabulary: never generated
    init_parallel()
    model, cfg = load_checkpoint(imported["M*M-"], use_te=False)
    hf = load_hf_model(tiny_nemotron_hf["M*M-"])
    cases = make_inputs(cfg)
    alone = {}
    for name, case in cases.items():
        ours = greedy_generate(model, [_prompt(case)], eos_id=never, max_new_tokens=6)[0]
        theirs = _hf_greedy(hf, hf_inputs(cfg, case), 6, never)
        assert len(ours) == 6 and ours == theirs, (name, ours, theirs)
        alone[name] = ours
    video, stop = cases["video"], alone["video"][4]
    ours_stopped = greedy_generate(model, [_prompt(video)], eos_id=stop, max_new_tokens=6)[0]
    assert ours_stopped == _hf_greedy(hf, hf_inputs(cfg, video), 6, stop) \
        == alone["video"][:alone["video"].index(stop)]
    batched = greedy_generate(model, [_prompt(c) for c in cases.values()], eos_id=never,
                              max_new_tokens=6)
    assert batched == list(alone.values())


def mixer_reference(mixer, x: torch.Tensor) -> torch.Tensor:
    """megatron's ``MambaMixer`` on x (L, B, H) in float64, one token at a time: in_proj, causal
    depthwise conv + SiLU, h_t = exp(dt_t A) h_(t-1) + dt_t B_t x_t, y_t = C_t.h_t + D x_t, times
    SiLU(z), grouped RMSNorm, out_proj."""
    import torch.nn.functional as F

    w = {n.replace("conv1d.", "conv1d_"): p.detach().double() for n, p in mixer.named_parameters()}
    heads, headdim, state, groups = mixer.nheads, mixer.headdim, mixer.d_state, mixer.ngroups
    inner, (length, batch, _) = heads * headdim, x.shape
    z, xbc, dt = (x.double().transpose(0, 1) @ w["in_proj.weight"].T).split(
        [inner, inner + 2 * groups * state, heads], -1)
    xbc = F.conv1d(xbc.transpose(1, 2), w["conv1d_weight"], w["conv1d_bias"],
                   padding=w["conv1d_weight"].shape[-1] - 1, groups=xbc.shape[-1])
    xs, B, C = F.silu(xbc[..., :length]).transpose(1, 2).split(
        [inner, groups * state, groups * state], -1)
    xs = xs.reshape(batch, length, heads, headdim)
    B, C = (t.reshape(batch, length, groups, state).repeat_interleave(heads // groups, 2)
            for t in (B, C))
    dt, A = F.softplus(dt + w["dt_bias"]), -torch.exp(w["A_log"])
    h = torch.zeros(batch, heads, headdim, state, dtype=torch.float64)
    ys = []
    for t in range(length):
        h = h * torch.exp(dt[:, t] * A)[..., None, None] \
            + (dt[:, t, :, None] * xs[:, t])[..., None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]) + w["D"][:, None] * xs[:, t])
    y = torch.stack(ys, 1).reshape(batch, length, groups, -1) \
        * F.silu(z).reshape(batch, length, groups, -1)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
    y = y.reshape(batch, length, inner) * w["norm.weight"]
    return (y @ w["out_proj.weight"].T).transpose(0, 1)


def test_mamba_mixer_on_torch_kernels():
    """megatron's ``MambaMixer`` alone, on the installed megatron-core (0.16.1 here, >= 0.17 on
    clusters): the training path equals the step-by-step float64 recurrence; a packed row of
    three segments (``packed_sequence_params``) equals each segment alone; the inference prefill
    then one-token decode steps (megatron's torch decode on the kernels' final states) equal the
    full forward, for the rows ``models.generation.generate`` runs together on this version."""
    from models import kernels
    from models.parallel import init_parallel

    init_parallel()
    kernels.prepare(("mamba",))  # the torch Mamba kernels bound into megatron's mixer
    from megatron.core import __version__
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from packaging.version import Version

    from models.families.nemotron_omni.config import load_yaml
    from models.families.nemotron_omni.model import lm_transformer_config
    from models.generation.generate import _inference_mode, _make_context
    from models.multimodal import packed_sequence_params

    cfg = load_yaml(REPO / "configs" / "nemotron_omni_tiny.yaml")
    torch.manual_seed(0)
    mixer = MambaMixer(lm_transformer_config(cfg), MambaMixerSubmodules(
        in_proj=ColumnParallelLinear, out_proj=RowParallelLinear), d_model=cfg.lm.hidden_size,
        chunk_size=cfg.lm.chunk_size, layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups()).eval()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        x = torch.randn(30, 2, cfg.lm.hidden_size)
        full = mixer(x)[0]
        torch.testing.assert_close(full.double(), mixer_reference(mixer, x), rtol=0, atol=5e-6)
        cu = torch.tensor([0, 7, 19, 30], dtype=torch.int32)  # segment ends inside chunks of 8
        packed = mixer(x[:, :1], packed_seq_params=packed_sequence_params(cu, None, "cpu"))[0]
        alone = torch.cat([mixer(x[a:b, :1])[0] for a, b in zip(cu[:-1], cu[1:])])
        torch.testing.assert_close(packed, alone, rtol=0, atol=1e-6)
        # as models.generation.generate._row_groups
        rows = 1 if Version(__version__) >= Version("0.17") else 2
        context = _make_context(rows, 40)
        context.seqlen_offset = 0  # set by MambaStack before its layers run
        with _inference_mode():
            steps = [mixer(x[:20, :rows], inference_context=context)[0]]
            for t in range(20, 30):
                context.sequence_len_offset = context.seqlen_offset = t
                steps.append(mixer(x[t:t + 1, :rows], inference_context=context)[0])
        torch.testing.assert_close(torch.cat(steps), full[:, :rows], rtol=0, atol=2e-6)


def test_batch_flops_counts_layers_and_vision():
    from models.families.nemotron_omni.config import load_yaml
    from models.flops import batch_flops

    cfg = load_yaml(REPO / "configs" / "nemotron_omni_tiny.yaml")
    empty = torch.zeros(0, 3, dtype=torch.long)

    def batch(images):
        return SimpleNamespace(cu_seqlens=None, attention_mask=torch.ones(1, 64),
                               image_grid_thw=images, video_grid_thw=empty)

    text = batch_flops(batch(empty), cfg)
    assert text > 0
    assert batch_flops(batch(torch.tensor([[1, 4, 4]])), cfg) > text
    cfg.lm.pattern = "*-*-*-"
    assert batch_flops(batch(empty), cfg) > text


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["ME*E"])
def test_tp2_parity_and_reshard_to_tp1(tiny_nemotron_hf, world2, pattern):
    """2 gloo ranks (tests/models/world2_checks.py's launch): import sharded at TP=2 and check
    TP=2 logits; then load that TP=2 checkpoint at TP=1 here and check logits again (Mamba:
    heads and groups sliced over TP inside the packed in_proj / conv1d; attention; MoE: routed
    and shared experts sliced over TP, the router whole). "ME*E" holds every layer kind but the
    dense MLP; "M*M-" at TP=2 (dense MLP included) is imported, trained and exported to
    transformers' logits by tests/test_hf_journey.py::test_checkpoint_saved_at_tp2_exports."""
    from models.convert import verify

    out = world2_result(world2, f"tp2_nemotron_{pattern}")
    report = json.loads((out / "tp2_report.json").read_text())["nemotron_h_omni"]
    assert set(report) == {"one_image", "images_interleaved", "tiles", "video"}
    assert all(diff <= TOL for diff in report.values()), report
    for name, row in verify(tiny_nemotron_hf[pattern], out / "nemotron_h_omni").items():
        assert row["max_abs_logit_diff"] <= TOL, (name, row)


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["M*M-", "ME*E"])
def test_pp2_parity_and_reshard(tiny_nemotron_hf, imported, world2, pattern):
    """2 gloo ranks (tests/models/world2_checks.py's launch): import at PP=2 (pattern "M*M-":
    "M*" and "M-", a Mamba layer on each stage; "ME*E": "ME" and "*E", MoE on both stages; each
    stage writes its own, global layer numbers), PP=2 logits vs transformers, the PP=1 import
    loaded at PP=2 equals it; then at PP=1: the PP=2 import's logits and tensors equal the PP=1
    import's."""
    from tests.models.pp2_check import check_pp2

    check_pp2(tiny_nemotron_hf[pattern], imported[pattern],
              world2_result(world2, f"pp2_nemotron_{pattern}"),
              {"one_image", "images_interleaved", "tiles", "video"}, TOL)


def test_generation_batch_mixing_images_and_videos():
    """eval.py batches prompts: an image prompt, a video prompt and a prompt with both on the one
    ``<image>`` token generate in one batch exactly what each generates alone."""
    from models.families import build_model
    from models.families.nemotron_omni.config import load_yaml
    from models.generation.generate import Prompt, greedy_generate
    from models.parallel import init_parallel

    cfg = load_yaml(REPO / "configs" / "nemotron_omni_tiny.yaml")
    init_parallel()
    torch.manual_seed(0)
    model = build_model(cfg, use_te=False).eval()
    rows = [mixed_row(cfg, [("image", (1, 4, 6))], 1), mixed_row(cfg, [("video", (2, 4, 4))], 2),
            mixed_row(cfg, [("video", (2, 2, 4)), ("image", (1, 2, 2))], 3)]
    prompts = [Prompt(input_ids=r["input_ids"][0],
                      position_ids=torch.arange(r["input_ids"].shape[1]).expand(3, -1),
                      pixel_values=r["pixel_values"], image_grid_thw=r["image_grid_thw"],
                      pixel_values_videos=r["pixel_values_videos"],
                      video_grid_thw=r["video_grid_thw"], visual_kinds=r["visual_kinds"])
               for r in rows]
    together = greedy_generate(model, prompts, eos_id=-1, max_new_tokens=4)
    alone = [greedy_generate(model, [p], eos_id=-1, max_new_tokens=4)[0] for p in prompts]
    assert together == alone
