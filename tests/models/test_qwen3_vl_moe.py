"""Qwen3-VL MoE (``qwen3_vl_moe``) on megatron-core against transformers'
``Qwen3VLMoeForConditionalGeneration`` on tiny models (4 experts of width 48, top-2, hidden 64:
H, I and 2I all differ; layer 1 dense through ``mlp_only_layers``): logits in both expert layouts
(transformers' ``save_pretrained`` one and the published one) and with per-expert keys, the
one-line refusal of any other expert shape, the export in the published layout (transformers
loads it, weights equal), the aux loss against transformers', FLOPs against FlopCounterMode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from lookalikes.models import build_tiny_hf
from tests.conftest import REPO

TOL = 1e-4
EXPERTS = "model.language_model.layers.{i}.mlp.experts."


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory) -> Path:
    return build_tiny_hf("qwen3_vl_moe", tmp_path_factory.mktemp("moe_hf") / "hf")


def relayout(src: Path, out: Path, change) -> Path:
    """A copy of the HF folder ``src`` whose weights are ``change(state dict)``."""
    out.mkdir(parents=True)
    (out / "config.json").write_text((src / "config.json").read_text())
    save_file(change(load_file(str(src / "model.safetensors"))), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def published(sd: dict) -> dict:
    """transformers' (E, 2I, H) / (E, H, I) experts as the published (E, H, 2I) / (E, I, H)."""
    return {k: v.transpose(1, 2).contiguous() if k.endswith(("gate_up_proj", "down_proj")) else v
            for k, v in sd.items()}


def per_expert(sd: dict) -> dict:
    """The fused experts as per-expert ``gate_proj`` / ``up_proj`` / ``down_proj`` keys."""
    out = {}
    for key, value in sd.items():
        if key.endswith("experts.gate_up_proj"):
            prefix = key[:-len("gate_up_proj")]
            for e, w in enumerate(value):
                gate, up = w.chunk(2)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif key.endswith("experts.down_proj"):
            prefix = key[:-len("down_proj")]
            for e, w in enumerate(value):
                out[f"{prefix}{e}.down_proj.weight"] = w.clone()
        else:
            out[key] = value
    return out


def imported(hf: Path, out: Path) -> Path:
    from models.convert import hf_to_mcore

    hf_to_mcore(str(hf), out, tp=1, pp=1)
    return out


def test_logits_match_transformers_in_every_layout(moe_hf, tmp_path):
    """The save_pretrained layout, the published layout and per-expert keys import to the same
    weights, whose logits equal transformers' (one image, interleaved images, a video)."""
    from models.convert import verify

    shapes = load_file(str(moe_hf / "model.safetensors"))
    assert tuple(shapes[EXPERTS.format(i=0) + "gate_up_proj"].shape) == (4, 96, 64)
    assert EXPERTS.format(i=1) + "gate_up_proj" not in shapes  # mlp_only_layers: dense
    report = verify(moe_hf, imported(moe_hf, tmp_path / "a"))
    assert set(report) == {"one_image", "images_interleaved", "video"}
    for name, row in report.items():
        assert row["max_abs_logit_diff"] <= TOL, (name, row)
    for name, change in (("published", published), ("per_expert", per_expert)):
        folder = relayout(moe_hf, tmp_path / f"{name}_hf", change)
        for case, row in verify(moe_hf, imported(folder, tmp_path / name)).items():
            assert row["max_abs_logit_diff"] <= TOL, (name, case, row)


def test_other_expert_shape_refused(moe_hf, tmp_path):
    from contract.errors import UsageError
    from models.convert import hf_to_mcore

    def broken(sd):
        key = EXPERTS.format(i=0) + "down_proj"
        return {**sd, key: sd[key][:, :, :40].contiguous()}

    folder = relayout(moe_hf, tmp_path / "bad", broken)
    with pytest.raises(UsageError, match=r"layers\.0\.mlp\.experts\.gate_up_proj / down_proj have "
                                         r"shapes \(4, 96, 64\) / \(4, 64, 40\): expected the "
                                         r"published layout \(4, 64, 96\) / \(4, 48, 64\)"):
        hf_to_mcore(str(folder), tmp_path / "out", tp=1, pp=1)


def test_export_is_the_published_layout_transformers_loads(moe_hf, tmp_path):
    """hf-to-mcore -> mcore-to-hf: the experts in the published layout (E, H, 2I) / (E, I, H),
    every other tensor as saved; transformers loads the export with the original weights."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from models.convert import mcore_to_hf

    mcore_to_hf(imported(moe_hf, tmp_path / "mcore"), tmp_path / "export")
    before = load_file(str(moe_hf / "model.safetensors"))
    after = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    want = published(before)
    for key in before:
        assert torch.equal(after[key], want[key]), key
    assert tuple(after[EXPERTS.format(i=2) + "down_proj"].shape) == (4, 48, 64)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl_moe"
    ours = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "export").state_dict()
    theirs = Qwen3VLMoeForConditionalGeneration.from_pretrained(moe_hf).state_dict()
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


def test_aux_loss_equals_transformers(tmp_path):
    """One MoE layer (layers 1, 2 dense): the aux-loss term our training forward adds (megatron's
    router, logged by ``models.layers.moe_aux``) equals ``router_aux_loss_coef * aux_loss`` of
    transformers (``output_router_logits=True``) on the same tokens; its gradient reaches the
    router."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from models.checkpointing.checkpoint import load_checkpoint
    from models.hf.verify_inputs import hf_inputs, make_inputs
    from models.layers import moe_aux

    hf = build_tiny_hf("qwen3_vl_moe", tmp_path / "hf", moe={"mlp_only_layers": [1, 2]})
    model, cfg = load_checkpoint(imported(hf, tmp_path / "mcore"), use_te=False)
    assert cfg.lm.moe_layers == [True, False, False]
    inputs = make_inputs(cfg)["images_interleaved"]
    hf_model = Qwen3VLMoeForConditionalGeneration.from_pretrained(hf).eval()
    with torch.no_grad():
        out = hf_model(**hf_inputs(cfg, inputs), output_router_logits=True)
    want = cfg.lm.router_aux_loss_coef * float(out.aux_loss)
    model.train()
    moe_aux.begin_step()  # as each training step: no earlier forward of this process counts
    moe_aux.set_backward_scale(model, 1, 1)
    loss, mask = model(**inputs, labels=inputs["input_ids"])
    (loss.sum() / mask.sum()).backward()
    got = moe_aux.step_metrics(model, 1)["moe_aux_loss"]
    assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (got, want)
    assert moe_aux.step_metrics(model, 1)["moe_aux_loss"] == 0.0  # cleared after a step
    router = model.language_model.decoder.layers[0].mlp.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def _routed_counts(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Tokens per expert of transformers' router (fp32 softmax, top-k) on its logits."""
    picks = router_logits.float().softmax(-1).topk(top_k, dim=-1).indices
    return torch.bincount(picks.flatten(), minlength=router_logits.shape[-1]).double()


def _train_forward_metrics(model, inputs) -> dict:
    """One training forward + backward of ``model`` (routers tracked) and its step metrics."""
    from models.layers import moe_aux

    moe_aux.track_router_load(model)
    model.train()
    moe_aux.begin_step()
    moe_aux.set_backward_scale(model, 1, 1)
    loss, mask = model(**inputs, labels=inputs["input_ids"])
    (loss.sum() / mask.sum()).backward()
    return moe_aux.step_metrics(model, 1)


def test_router_load_and_capacity_drops_equal_transformers_routing(moe_hf, tmp_path):
    """Router health: each MoE layer's expert load (most loaded expert / mean) that a training
    forward logs equals the load of transformers' own router logits on the same tokens (layers 0
    and 2; layer 1 is dense); with ``model.moe_capacity_factor`` 0.5 on a one-MoE-layer model,
    each expert keeps min(its tokens, ceil(tokens * k / E * 0.5)) and the dropped assignments are
    counted exactly. A validation (eval) forward counts nothing."""
    import dataclasses
    import math

    from transformers import Qwen3VLMoeForConditionalGeneration

    from models.checkpointing.checkpoint import load_checkpoint
    from models.families import build_model
    from models.hf.verify_inputs import hf_inputs, make_inputs
    from models.layers import moe_aux

    def hf_logits(hf: Path, cfg, inputs):
        hf_model = Qwen3VLMoeForConditionalGeneration.from_pretrained(hf).eval()
        with torch.no_grad():
            return hf_model(**hf_inputs(cfg, inputs), output_router_logits=True).router_logits

    model, cfg = load_checkpoint(imported(moe_hf, tmp_path / "mcore"), use_te=False)
    inputs = make_inputs(cfg)["images_interleaved"]
    got = _train_forward_metrics(model, inputs)
    k = cfg.lm.experts_per_token
    want = {}
    for layer, logits in zip([0, 2], hf_logits(moe_hf, cfg, inputs)):
        counts = _routed_counts(logits, k)
        want[str(layer)] = float(counts.max() / counts.mean())
    assert got["moe_load_per_layer"].keys() == want.keys()
    for layer, ratio in want.items():
        assert abs(got["moe_load_per_layer"][layer] - ratio) <= 1e-6, (layer, got, want)
    assert abs(got["moe_load_max_over_mean"] - max(want.values())) <= 1e-12
    assert 1.0 < got["moe_load_max_over_mean"] <= cfg.lm.num_experts / k
    assert "moe_tokens_dropped" not in got  # no capacity: nothing dropped, nothing logged
    model.eval()
    moe_aux.begin_step()
    with torch.no_grad():
        model(**inputs, labels=inputs["input_ids"])
    assert "moe_load_max_over_mean" not in moe_aux.step_metrics(model, 1)

    one = build_tiny_hf("qwen3_vl_moe", tmp_path / "one", moe={"mlp_only_layers": [1, 2]})
    base, cfg = load_checkpoint(imported(one, tmp_path / "one_mcore"), use_te=False)
    capped = build_model(dataclasses.replace(cfg, moe_capacity_factor=0.5), use_te=False)
    capped.load_state_dict(base.state_dict())
    got = _train_forward_metrics(capped, inputs)
    counts = _routed_counts(hf_logits(one, cfg, inputs)[0], k)
    tokens = int(counts.sum()) // k
    capacity = math.ceil(tokens * k / cfg.lm.num_experts * 0.5)
    kept = counts.clamp(max=capacity)
    assert got["moe_tokens_dropped"] == int(counts.sum() - kept.sum()) > 0
    assert abs(got["moe_dropped_fraction"] - got["moe_tokens_dropped"] / (tokens * k)) < 1e-12
    assert abs(got["moe_load_per_layer"]["0"] - float(kept.max() / kept.mean())) <= 1e-6


def test_capacity_factor_refused_without_experts_or_not_positive():
    """``model.moe_capacity_factor`` on a dense model, or zero, is one config error."""
    from models.families.qwen_vl.config import from_dict

    raw = yaml.safe_load((REPO / "configs" / "qwen3_vl_moe_tiny.yaml").read_text())
    with pytest.raises(ValueError, match="moe_capacity_factor must be positive"):
        from_dict({**raw, "moe_capacity_factor": 0})
    dense = yaml.safe_load((REPO / "configs" / "qwen3_vl_tiny.yaml").read_text())
    with pytest.raises(ValueError, match="needs MoE layers"):
        from_dict({**dense, "moe_capacity_factor": 1.0})


def test_tiny_config_trains():
    """configs/qwen3_vl_moe_tiny.yaml builds (MoE layers 0 and 2, dense 1) and its loss falls
    within a few CPU steps; every expert gets a gradient."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from models.families import build_model
    from models.families.qwen_vl.config import load_yaml
    from models.hf.verify_inputs import make_inputs
    from models.parallel import init_parallel
    from tests.models.conftest import train_steps

    cfg = load_yaml(REPO / "configs" / "qwen3_vl_moe_tiny.yaml", ["lm.max_position_embeddings=512"])
    init_parallel()
    torch.manual_seed(0)
    model = build_model(cfg, use_te=False).train()
    kinds = [isinstance(layer.mlp, MoELayer) for layer in model.language_model.decoder.layers]
    assert kinds == [True, False, True]
    losses = train_steps(model, make_inputs(cfg)["images_interleaved"])
    assert losses[-1] < losses[0]
    experts = [p for n, p in model.named_parameters() if ".local_experts." in n]
    assert len(experts) == 2 * 4 * 2 and all(p.grad is not None for p in experts)


def test_moe_models_of_other_depths_train_in_one_process():
    """megatron's aux-loss tracker is process-wide and sized by the first model that logs into
    it: a 4-layer MoE model trained after a 3-layer one in the same process (a test worker, a
    notebook) used to end in an IndexError inside megatron; building a model empties it."""
    from models.families import build_model, config_from_dict
    from models.hf.verify_inputs import make_inputs
    from models.parallel import init_parallel
    from tests.models.conftest import train_steps

    init_parallel()
    for name in ("qwen3_vl_moe_tiny.yaml", "qwen3_5_moe_tiny.yaml"):  # 3 layers, then 4
        cfg = config_from_dict(yaml.safe_load((REPO / "configs" / name).read_text()))
        model = build_model(cfg, use_te=False).train()
        assert len(train_steps(model, make_inputs(cfg)["images_interleaved"], steps=1)) == 1


def test_flops_count_active_experts(moe_hf):
    """``models.flops``' LM formula (router + the top-k experts per token) equals torch's
    FlopCounterMode on transformers' model within 1e-3 (its eager expert loop runs only the
    experts a token picked; the grouped-mm one is not counted by FlopCounterMode); the dense MLP
    of layer 1 counts at full width."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3VLMoeForConditionalGeneration

    from models.families import config_from_hf, family_of

    cfg = config_from_hf(json.loads((moe_hf / "config.json").read_text()))
    lm = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        moe_hf, attn_implementation="eager", experts_implementation="eager").eval()
    length = 48
    ids = torch.randint(0, 280, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        lm(input_ids=ids)
    measured = counter.get_total_flops()
    # the eager attention computes the whole L x L score matrix; the formula counts causal pairs
    full_pairs = length * length - length * (length + 1) // 2
    q = cfg.lm.num_heads * cfg.lm.head_dim
    formula = family_of(cfg).lm_flops(cfg.lm, length, [length]) + \
        cfg.lm.num_layers * 4 * q * full_pairs
    assert abs(formula - measured) / measured <= 1e-3, (formula, measured)


@pytest.mark.slow
def test_train_from_hf_logs_aux_loss_and_exports(tmp_path, mantis_out):
    """make train-qwen-vl-mantis HF=<a Qwen3-VL MoE folder>: the family comes from the folder's
    model_type; the run logs the aux-loss term on its own; its export gives transformers our
    logits (the HF journey of tests/test_hf_journey.py for this family)."""
    from lookalikes.models import build_tiny_hf_model
    from tests.test_hf_journey import export, logits_diff
    from tests.test_train import FAST, MANTIS_CFG, ok, train

    hf = build_tiny_hf_model("qwen3_vl_moe", tmp_path / "hf", pixels=(3136, 6272))
    run = tmp_path / "run"
    ok(train(str(MANTIS_CFG), f"model.hf={hf}", f"data.path={mantis_out}/metadataset.yaml",
             f"out={run}", f"train.hf_import_cache={tmp_path / 'cache'}", "train.steps=3",
             *FAST, "checkpoint.save_final=true"))
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["model"]["family"] == "qwen3_vl_moe"
    assert resolved["task_encoder"]["model"] == "qwen3_vl_moe"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    aux = [r["moe_aux_loss"] for r in records if "loss" in r and "step" in r
           and "moe_aux_loss" in r]
    assert len(aux) == 3 and all(0 < a < 1e-2 for a in aux), records
    loads = [r["moe_load_max_over_mean"] for r in records if "moe_load_max_over_mean" in r]
    assert len(loads) == 3 and all(1.0 <= x <= 4 / 2 for x in loads), records  # E 4, top-2
    diffs = logits_diff(run, export(run, tmp_path / "export"))
    assert max(diffs.values()) <= TOL, diffs


#: config -> (published total parameters in billions, as rounded on the model cards; active B)
PUBLISHED = {"qwen3_vl_30b_a3b": (31.07, 3.0), "qwen3_vl_235b_a22b": (236.0, 22.0)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shapes_on_the_meta_device(name):
    """configs/qwen3_vl_30b_a3b.yaml / qwen3_vl_235b_a22b.yaml built on the meta device (no
    memory): total parameters equal the published ones (31.07 B: 31,070,754,032; ~236 B:
    235,670,022,896); the active ones (everything but the 120 experts a token skips per layer:
    3,891,664,112 / 22,767,151,856) are the A3B / A22B of the names plus the tower and the
    vocabulary matrices."""
    from models.families import model_class
    from models.families.qwen_vl.config import load_yaml
    from models.parallel import init_parallel

    cfg = load_yaml(REPO / "configs" / f"{name}.yaml")
    init_parallel()
    with torch.device("meta"):
        model = model_class(cfg)(cfg, use_te=False)
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters()
                 if ".local_experts.0." in n) // cfg.lm.num_layers
    active = total - (cfg.lm.num_experts - cfg.lm.experts_per_token) * expert * cfg.lm.num_layers
    want_total, want_active = PUBLISHED[name]
    assert round(total / 1e9, 2 if want_total < 100 else 0) == want_total, total
    # the names count the LM's active weights; ours add the vision tower and both untied
    # vocabulary matrices (about 0.4 B + 2 x 0.3 B / 2 x 0.6 B)
    assert want_active <= active / 1e9 < want_active + 2, active


def test_expert_tp_other_than_tp_at_ep1_refused_in_one_line(tmp_path, capsys):
    """Expert-TP other than TP at EP = 1 (megatron-core 0.16.1 gives the experts' linears
    megatron's dense all-reduce there, over the dense DP group, not the experts': such a run
    drifted, grad norm 4.963 vs 4.945), and Nemotron-Omni's MoE layers under TP: train.py
    refuses them before building anything (one line, exit 2); a world that expert-TP x PP x EP
    does not divide is named with etp; the Qwen-VL family takes TP, PP, CP, EP, and
    configs/train_qwen3_vl_235b_a22b_mantis.yaml at Megatron-Bridge's layout (TP 4, expert-TP 1,
    EP 32) passes every check at 32 processes but its data path's."""
    from types import SimpleNamespace

    from contract.errors import UsageError
    from models.families import get
    from models.families.qwen_vl.config import load_yaml
    from recipes.layout import check_layout
    from recipes.run_config import load_run_config
    from recipes.run_plan import check_run

    cfg = load_yaml(REPO / "configs" / "qwen3_vl_moe_tiny.yaml")
    assert get(cfg.family).layout_problems(cfg, SimpleNamespace(tp=2, pp=2, cp=2, ep=2)) == []
    import train

    config = str(REPO / "configs" / "train_qwen3_vl_moe_mantis.yaml")
    assert train.main([config, "parallel.tp=2", "parallel.etp=1", f"data.path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parallel.etp 1 other than parallel.tp 2 needs " \
        "parallel.ep > 1" in err, err
    published = load_run_config(REPO / "configs" / "train_qwen3_vl_235b_a22b_mantis.yaml",
                                [f"data.path={tmp_path / 'none'}", "parallel.tp=4",
                                 "parallel.etp=1", "parallel.ep=32",
                                 "task_encoder.fixed_length=true"], world=32)  # (EP on CPU)
    assert (published.parallel.tp, published.parallel.etp, published.parallel.ep) == (4, 1, 32)
    with pytest.raises(UsageError, match="data.path .* does not exist"):  # its layout passes
        check_run(published, 32)
    with pytest.raises(UsageError, match=r"world size 4 is not divisible by etp\*pp\*ep = "
                                         r"2\*1\*4 \(the expert-parallel ranks"):
        check_layout(4, 1, 1, 1, True, ep=4, etp=2)
    # Nemotron-Omni's MoE layers under TP (its LM runs no sequence parallelism): one line too
    nemotron = str(REPO / "configs" / "train_nemotron_omni_mantis.yaml")
    assert train.main([nemotron, "parallel.tp=2", "model.lm.pattern='*E-E'",
                       f"data.path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parallel.tp 2 with MoE layers" in err, err


def test_greedy_tokens_equal_transformers_generate(moe_hf, tmp_path):
    """models.generation.generate (megatron's KV cache, MoE layers in the decode steps) gives
    transformers' ``generate`` tokens on one image, interleaved images and a video."""
    from models.checkpointing.checkpoint import load_checkpoint
    from models.convert import load_hf_model
    from models.generation.generate import greedy_generate
    from models.hf.verify_inputs import hf_inputs, make_inputs
    from tests.models.test_nemotron_omni import _hf_greedy, _prompt

    never = 10 ** 6  # outside the vocabulary: never generated
    model, cfg = load_checkpoint(imported(moe_hf, tmp_path / "mcore"), use_te=False)
    hf = load_hf_model(moe_hf)
    for name, case in make_inputs(cfg).items():
        ours = greedy_generate(model, [_prompt(case)], eos_id=never, max_new_tokens=6)[0]
        theirs = _hf_greedy(hf, hf_inputs(cfg, case), 6, never)
        assert len(ours) == 6 and ours == theirs, (name, ours, theirs)


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_top1_routing_equals_transformers(family, tmp_path):
    """``num_experts_per_tok: 1`` (which megatron-core's config check refuses without
    pre-softmax, ``models.layers.moe_aux.transformer_config``) imports, and its logits equal
    transformers' (each token's one expert at weight 1)."""
    from lookalikes.models import build_tiny_qwen3_5
    from models.convert import verify

    hf = (build_tiny_hf(family, tmp_path / "hf", moe={"num_experts_per_tok": 1})
          if family == "qwen3_vl_moe" else
          build_tiny_qwen3_5(tmp_path / "hf", moe=True, text={"num_experts_per_tok": 1}))
    for name, row in verify(hf, imported(hf, tmp_path / "mcore")).items():
        assert row["max_abs_logit_diff"] <= TOL, (name, row)
