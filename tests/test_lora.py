"""LoRA and DoRA (``model.peft=lora`` / ``dora``): the settings, the adapters on megatron's
linears (B = 0 starts at the base model; merged equals adapted), and runs from tiny HF models of
both families through train.py and ``models.convert``: the first loss equals the base model's,
the checkpoint holds only what trains, resume is exact, TP = 2 equals TP = 1, and both exports
(merged, and the HF PEFT folder that ``peft`` loads onto the base) give the same logits, a tower
trained in full next to the adapters included."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from contract.errors import ConfigError
from lookalikes.models import build_tiny_hf_model
from recipes.run_config import dump_yaml, load_run_config
from tests.test_hf_journey import JOURNEYS, export, train_from_hf
from tests.test_train import MANTIS_CFG, losses

LORA = ("model.peft=lora", "model.lora.rank=4", "model.lora.alpha=8")


def test_settings_default_freeze_the_base_round_trip_and_refuse_nonsense():
    cfg = load_run_config(MANTIS_CFG, ["model.peft=lora"])
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout) == (16, 32.0, 0.0)
    assert cfg.lora.target_modules == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert cfg.lora.parts == ["language_model"] and cfg.lora.experts is False
    assert set(cfg.freeze.frozen()) == {"vision_model", "vision_projection", "language_model"}
    cfg = load_run_config(MANTIS_CFG, [*LORA, "model.freeze_vision_projection=false"])
    assert cfg.freeze.frozen() == ("vision_model", "language_model")  # the projector trains
    again = load_run_config(None, stored=yaml.safe_load(dump_yaml(cfg)))  # eval.py's path
    assert again.lora == cfg.lora and again.freeze == cfg.freeze
    assert load_run_config(MANTIS_CFG).lora is None
    dora = load_run_config(MANTIS_CFG, ["model.peft=dora", "model.lora.rank=4"])
    assert dora.lora.dora and dora.lora.rank == 4 and not cfg.lora.dora
    assert yaml.safe_load(dump_yaml(dora))["model"]["peft"] == "dora"
    assert load_run_config(None, stored=yaml.safe_load(dump_yaml(dora))).lora == dora.lora
    for bad, said in ((["model.lora.rank=4"], "add model.peft=lora"),
                      (["model.peft=qlora"], "model.peft must be lora, dora or none"),
                      (["model.peft=dora", "model.lora.experts=true"],
                       "model.peft=dora puts no magnitude on MoE experts"),
                      (["model.peft=dora", "model.lora.dora=true"], "model.lora.dora"),
                      (["model.peft=lora", "model.lora.rank=0"], "rank must be >= 1"),
                      (["model.peft=lora", "model.lora.parts=[vit]"], "model.lora.parts"),
                      (["model.peft=lora", "model.lora.rnk=3"], "did you mean model.lora.rank")):
        with pytest.raises(ConfigError, match=said):
            load_run_config(MANTIS_CFG, bad)


def _tiny(family: str):
    from models.families import build_model, config_module
    from models.parallel import init_parallel
    from tests.conftest import REPO

    init_parallel()
    torch.manual_seed(0)
    cfg = config_module(family).load_yaml(REPO / "configs" / f"{family}_tiny.yaml")
    return cfg, build_model(cfg, use_te=False).eval()


def _random_b(model) -> None:
    """Adapters that change the model: B drawn at random (it starts at zero), DoRA's magnitude
    off its start by up to 10 %."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b.weight"):
                param.normal_(0, 0.05)
            if name.endswith("_lora.magnitude"):
                param.mul_(1 + 0.1 * torch.rand_like(param))


@pytest.mark.parametrize("family,dora", [("qwen3_vl", False), ("nemotron_omni", False),
                                         ("qwen3_vl_moe", False), ("qwen3_5", False),
                                         ("qwen2_5_vl", True), ("nemotron_omni", True)])
def test_adapters_start_at_the_base_and_merge_into_it(family, dora):
    """B = 0 (and DoRA's magnitude at the rows' norms): the adapted model computes the base's
    logits; with B (and the magnitude) drawn at random, folding the adapters into the weights
    (``merge_adapters``) computes what the adapted model does (Qwen3-VL MoE: the experts'
    linears adapted too, ``model.lora.experts=true``; DoRA: Qwen2.5-VL's biased q/k/v and
    Nemotron's megatron-returned biases)."""
    from models.convert import our_logits
    from models.families import get
    from models.lora import LoRAConfig, add_adapters, merge_adapters

    cfg, model = _tiny(family)
    inputs = next(iter(get(family).verify_inputs(cfg).values()))  # an image and its text
    base = our_logits(model, inputs)
    experts = family == "qwen3_vl_moe"
    lora = LoRAConfig(rank=4, alpha=8, experts=experts)
    lora.dora = dora
    adapted = add_adapters(model, lora, get(family).parameter_group)
    assert adapted and all(n.startswith("language_model.") for n in adapted)
    assert any(".experts." in n for n in adapted) == experts
    torch.testing.assert_close(our_logits(model, inputs), base, rtol=0,
                               atol=0 if not dora else 1e-5)  # DoRA: m / ||W|| rounds
    _random_b(model)
    lora = our_logits(model, inputs)
    assert (lora - base).abs().max() > 1e-3
    assert merge_adapters(model) == len(adapted)
    assert not any("_lora." in name for name, _ in model.named_parameters())
    torch.testing.assert_close(our_logits(model, inputs), lora, rtol=1e-4, atol=1e-4)


def test_packed_rows_with_adapters_equal_samples_alone():
    """LoRA under packing (Qwen3-VL MoE, experts adapted): each sample of a packed row gets the
    per-token losses it has alone (the adapters act token by token, the segments stay apart)."""
    from lookalikes.model_inputs import pack_inputs
    from models.families import get
    from models.hf.verify_inputs import make_inputs
    from models.lora import LoRAConfig, add_adapters
    from tests.models.test_packed_lm import with_labels

    cfg, model = _tiny("qwen3_vl_moe")
    add_adapters(model, LoRAConfig(rank=4, alpha=8, experts=True), get(cfg.family).parameter_group)
    _random_b(model)
    cases = [with_labels(c) for c in make_inputs(cfg).values()]
    rows = [cases[:2], cases[2:]]
    with torch.no_grad():
        packed, _mask = model(**pack_inputs(rows, tail=5))
        for r, row in enumerate(rows):
            at = 0
            for case in row:
                n = case["input_ids"].shape[1]
                alone, _ = model(**case)
                torch.testing.assert_close(packed[r, at:at + n], alone[0], rtol=0, atol=2e-5)
                at += n


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, mantis_out):
    """A tiny HF Qwen2.5-VL; 3 LoRA steps with the projector trained in full (checkpoints at
    steps 2 and 3), and 1 step of the base model from the same weights and data."""
    root = tmp_path_factory.mktemp("lora")
    hf = build_tiny_hf_model("qwen2_5_vl", root / "hf", pixels=JOURNEYS["qwen2_5_vl"][1])
    cache = root / "cache"
    train_from_hf("qwen2_5_vl", hf, root / "base", cache, mantis_out, "train.steps=1")
    proc = train_from_hf("qwen2_5_vl", hf, root / "run", cache, mantis_out, *LORA,
                         "model.freeze_vision_projection=false", "train.steps=3",
                         "checkpoint.interval=2", "train.keep_checkpoints=0")
    return {"root": root, "hf": hf, "cache": cache, "stdout": proc.stdout}


#: Qwen3.5's adapters: attention, MLP and the Gated DeltaNet's projections but its in_proj_k
#: (the PEFT export's fused in_proj_qkv adapter then has a zero block)
QWEN3_5_TARGETS = ("model.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2,"
                   "in_proj_q,in_proj_v,in_proj_z,in_proj_b,in_proj_a,out_proj]")


@pytest.fixture(scope="module")
def qwen3_5_lora_run(tmp_path_factory, mantis_out):
    """A tiny HF Qwen3.5; 2 LoRA steps (``QWEN3_5_TARGETS``) with the projector trained in
    full."""
    root = tmp_path_factory.mktemp("lora35")
    hf = build_tiny_hf_model("qwen3_5", root / "hf", pixels=JOURNEYS["qwen3_5"][1])
    train_from_hf("qwen3_5", hf, root / "run", root / "cache", mantis_out, *LORA,
                  QWEN3_5_TARGETS, "model.freeze_vision_projection=false", "train.steps=2")
    return {"root": root, "hf": hf}


def _checkpoint_keys(step) -> list[str]:
    from models.checkpointing.dist_load import read_metadata

    return sorted(read_metadata(step / "model_optim").state_dict_metadata)


@pytest.mark.slow
def test_lora_run_starts_at_the_base_and_saves_only_what_trains(lora_run):
    root = lora_run["root"]
    assert losses(root / "run")[0] == losses(root / "base")[0]  # B = 0: the base model's loss
    assert "LoRA r 4 alpha 8 on 8 linears" in lora_run["stdout"]
    assert "checkpoints hold what trains" in lora_run["stdout"]
    step = root / "run" / "checkpoints" / "step_000003"
    keys = _checkpoint_keys(step)
    # common_state: megatron-core >= 0.19's common state item
    model_keys = [k for k in keys if not k.startswith(("optimizer.", "common_state/"))]
    assert model_keys and all("_lora." in k or k.startswith("vision.merger.")
                              for k in model_keys), model_keys
    assert any(k.startswith("vision.merger.") for k in model_keys)  # trained in full: saved
    assert not any("word_embeddings" in k or "linear_qkv.weight" in k for k in keys)
    base = json.loads((step / "train_state.json").read_text())["base"]
    assert base["hf"] == str(lora_run["hf"]) and base["fingerprint"]


@pytest.mark.slow
def test_lora_resume_is_exact_and_checks_its_base(lora_run, mantis_out, tmp_path, capsys):
    """The base is recognised by its content: a copy made without -p elsewhere (new times, a
    moved base) resumes exactly; other weights there are refused in one line. The export finds
    a moved base with --base (one line naming the recorded place without it)."""
    from models.convert import main
    from tests.test_hf_journey import FAST, train
    from tests.test_train import error_line

    root = lora_run["root"]
    out = tmp_path / "resumed"
    shutil.copytree(root / "run" / "checkpoints" / "step_000002",
                    out / "checkpoints" / "step_000002")
    moved = tmp_path / "moved_base"
    shutil.copytree(lora_run["hf"], moved, copy_function=shutil.copyfile)  # new times
    args = (str(JOURNEYS["qwen2_5_vl"][0]), f"data.path={mantis_out}/metadataset.yaml",
            f"out={out}", f"train.hf_import_cache={lora_run['cache']}", *FAST, *LORA,
            "model.freeze_vision_projection=false", "train.steps=3")
    proc = train(*args, f"model.hf={moved}", "--resume", str(out / "checkpoints" / "step_000002"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert losses(out) == losses(root / "run")[2:]  # bit-exact on CPU

    from safetensors.torch import load_file, save_file

    other = tmp_path / "other_base"
    shutil.copytree(lora_run["hf"], other)
    weights = load_file(str(other / "model.safetensors"))
    key = sorted(weights)[0]
    save_file({**weights, key: weights[key] * 2}, str(other / "model.safetensors"))
    proc = train(*args, f"model.hf={other}", "--resume", str(out / "checkpoints" / "step_000002"))
    assert proc.returncode == 2
    assert "holds only what trains on the base" in error_line(proc)
    assert "other weights" in error_line(proc)

    original = lora_run["hf"].with_name("hf_away")
    lora_run["hf"].rename(original)  # the recorded base is gone; the moved copy holds it
    try:
        step = root / "run" / "checkpoints" / "step_000002"
        assert main(["mcore-to-hf", "--mcore", str(step), "--out", str(tmp_path / "x")]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"{lora_run['hf']} is gone" in line and "--base" in line, line
        assert main(["mcore-to-hf", "--mcore", str(step), "--out", str(tmp_path / "x"),
                     "--base", str(moved)]) == 0
    finally:
        original.rename(lora_run["hf"])


@pytest.mark.slow
@pytest.mark.parametrize("family,fixture,target", [
    ("qwen2_5_vl", "lora_run", "model.language_model.layers.0.self_attn.q_proj"),
    ("qwen3_5", "qwen3_5_lora_run", "model.language_model.layers.0.linear_attn.in_proj_qkv")])
def test_merged_and_peft_exports_give_the_same_logits(family, fixture, target, request,
                                                      tmp_path):
    """The merged export loads in transformers with our logits; the PEFT folder loads with peft
    onto the base HF model and gives the merged export's logits (Qwen3.5: the DeltaNet's
    in_proj_q / _v adapters as one adapter of HF's fused in_proj_qkv, rank 2 r)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from models.checkpointing.checkpoint import read_checkpoint
    from models.convert import hf_logits, main
    from models.hf.verify_inputs import hf_inputs, make_inputs
    from tests.test_hf_journey import LOGITS_TOLERANCE, logits_diff

    lora_run = request.getfixturevalue(fixture)
    run = lora_run["root"] / "run"
    merged = export(run, tmp_path / "merged")
    assert max(logits_diff(run, merged).values()) <= LOGITS_TOLERANCE
    assert main(["mcore-to-hf", "--mcore", str(run), "--out", str(tmp_path / "peft"),
                 "--adapter"]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert target in config["target_modules"]
    if family == "qwen3_5":
        assert config["rank_pattern"][target] == 8 and config["alpha_pattern"][target] == 16
        assert {"in_proj_z", "in_proj_b", "in_proj_a", "out_proj"} <= {
            t.rsplit(".", 1)[1] for t in config["target_modules"]}
    assert config["modules_to_save"]  # the projector trained in full
    def hf(folder):
        return AutoModelForImageTextToText.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager").eval()

    peft_model = PeftModel.from_pretrained(hf(lora_run["hf"]), tmp_path / "peft").eval()
    full, cfg = hf(merged), read_checkpoint(run).model_config
    for inputs in make_inputs(cfg).values():  # images (the trained projector), video, text
        want = hf_logits(full, hf_inputs(cfg, inputs))
        assert (hf_logits(peft_model, hf_inputs(cfg, inputs)) - want).abs().max() \
            <= LOGITS_TOLERANCE
    base = lora_run["root"] / "base"
    if base.exists():
        assert main(["mcore-to-hf", "--mcore", str(base), "--out", str(tmp_path / "x"),
                     "--adapter"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("family,peft,targets,parts", [
    ("nemotron_omni", "lora", "[linear_qkv,linear_proj,linear_fc1,linear_fc2,out_proj]",
     "[language_model]"),
    ("qwen2_5_vl", "dora", "[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
     "[language_model,vision_model]")])
def test_tp2_adapters_equal_tp1(family, peft, targets, parts, tmp_path, mantis_out):
    """3 steps at TP = 2 (column and row adapters sharded, DoRA's magnitude sharded with a
    column base and its row norms summed over TP with a row base) give TP = 1's losses, and both
    checkpoints merge to the same weights (Qwen2.5-VL's gated MLPs: fc1's B and magnitude read
    back in TP = 1's gate | up order). Nemotron-Omni (Mamba + attention + MLP LM): LoRA on its
    Mamba output projections too; a Mamba in_proj adapter is refused at TP = 2 in one line."""
    from tests.test_hf_journey import state

    hf = build_tiny_hf_model(family, tmp_path / "hf", pixels=(16384, 16384))
    runs = {}
    for tp in (1, 2):
        runs[tp] = tmp_path / f"tp{tp}"
        train_from_hf(family, hf, runs[tp], tmp_path / "cache", mantis_out, *LORA,
                      f"model.peft={peft}", f"model.lora.target_modules={targets}",
                      f"model.lora.parts={parts}", "train.steps=3", "train.lr=1e-2",
                      f"parallel.tp={tp}", nproc=tp, plain=tp > 1)
    one, two = losses(runs[1]), losses(runs[2])
    assert one[0] != one[-1]  # the adapters trained
    torch.testing.assert_close(two, one, rtol=2e-4, atol=0)
    merged = {tp: state(runs[tp]) for tp in runs}
    for key, value in merged[1].items():
        torch.testing.assert_close(merged[2][key], value, rtol=1e-3, atol=1e-5, msg=key)
    if family != "nemotron_omni":
        return
    from tests.test_train import error_line, train

    proc = train(str(JOURNEYS[family][0]), f"model.hf={hf}", *LORA,
                 f"data.path={mantis_out}/metadataset.yaml", f"out={tmp_path / 'x'}",
                 f"train.hf_import_cache={tmp_path / 'cache'}", "parallel.tp=2",
                 "model.lora.target_modules=[in_proj]", nproc=2)
    assert proc.returncode == 2 and "in_proj" in error_line(proc)


@pytest.mark.slow
def test_lora_under_pp2_equals_pp1(mantis_out, tmp_path):
    """LoRA with a frozen LM split over two pipeline stages (each stage's layers adapted, seeded
    by their global layer numbers) gives the PP = 1 losses from the same base, which the
    checkpoints refer to (``train.init_checkpoint``)."""
    from tests.test_train import pp2_and_pp1_losses

    pp2_and_pp1_losses(MANTIS_CFG, mantis_out, tmp_path, "checkpoint.save_final=true",
                       shared=(*LORA, "train.lr=1e-2"))
    state = json.loads((tmp_path / "pp2" / "checkpoints" / "step_000003" /
                        "train_state.json").read_text())
    assert state["base"]["init_checkpoint"] == str(tmp_path / "init")


@pytest.mark.slow
def test_lora_under_cp2_ep2_tp2_equals_one_process(mantis_out, tmp_path):
    """LoRA on Qwen3-VL MoE with the experts adapted (``model.lora.experts=true``; each EP rank
    holds its experts' adapters, seeded by their global expert numbers) at CP = 2, EP = 2 (over
    DP = 2, distributed optimizer), TP = 2 (sequence parallel: replicated factors' gradients
    summed over TP) and TP = 2 with expert-TP 1 and EP = 2 (each expert's adapter whole on
    its EP rank) gives one
    process's losses, gradient norms and aux-loss terms from the same base
    (``layouts_equal_one_process``); the TP = 2 checkpoint (TP-sharded expert adapters)
    resumes exactly. The run's export merges the expert adapters into the
    published expert tensors (transformers' logits equal ours); ``--adapter`` refuses them in one
    line (PEFT has no layout for transformers' fused experts)."""
    from models.convert import main
    from tests.models.test_moe_layouts import ETP1, layouts_equal_one_process, run_args
    from tests.test_hf_journey import LOGITS_TOLERANCE, logits_diff

    shared = (*LORA, "model.lora.experts=true", "train.lr=1e-2")
    tp2 = ["parallel.tp=2", "data.virtual_dp=2", "checkpoint.interval=2"]
    args = run_args(mantis_out, tmp_path, *shared)
    layouts_equal_one_process(
        mantis_out, tmp_path, {"cp2": (2, ["parallel.cp=2", "data.virtual_dp=2"]),
                               "ep2": (2, ["parallel.ep=2"]),
                               "tp2": (2, tp2), "etp1": (2, ETP1)},
        *shared, one=("checkpoint.save_final=true",))
    from tests import runner
    from tests.test_train import ok

    step = tmp_path / "tp2" / "checkpoints" / "step_000002"  # TP-sharded expert adapters
    ok(runner.run("train.py", *args, *tp2, f"out={tmp_path / 'resumed'}", "--resume", str(step),
                  nproc=2, timeout=600))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "tp2")[2:]  # bit-exact on CPU
    run = tmp_path / "one"
    assert max(logits_diff(run, export(run, tmp_path / "merged")).values()) <= LOGITS_TOLERANCE
    assert main(["mcore-to-hf", "--mcore", str(run), "--out", str(tmp_path / "peft"),
                 "--adapter"]) == 2


def _tiny_hf_of(family: str, out):
    """A tiny HF model of ``family`` (``lookalikes.models`` builders)."""
    from lookalikes.models import build_tiny_hf, build_tiny_nemotron_omni, build_tiny_qwen3_5

    if family == "nemotron_omni":
        return build_tiny_nemotron_omni(out)
    if family.startswith("qwen3_5"):
        return build_tiny_qwen3_5(out, moe=family == "qwen3_5_moe")
    return build_tiny_hf(family, out)


#: per family, the linears given adapters: megatron's attention and MLP linears everywhere, and
#: the mixers' projections of Qwen3.5 (Gated DeltaNet; the MoE model's in_proj_k not: HF's fused
#: in_proj_qkv adapter then has a part without an update) and Nemotron-Omni (Mamba)
PEFT_TARGETS = {"qwen3_5": ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b",
                            "in_proj_a", "out_proj"),
                "nemotron_omni": ("in_proj", "out_proj")}
PEFT_TARGETS["qwen3_5_moe"] = tuple(t for t in PEFT_TARGETS["qwen3_5"] if t != "in_proj_k")


#: (``model.peft``, the vision tower's part): adapted (LoRA / DoRA on the LM and the tower), or
#: trained in full next to the LM's adapters (``modules_to_save``)
PEFT_CASES = [("lora", "adapted"), ("dora", "adapted"), ("dora", "trained")]


def _perturb_tower(model, group) -> None:
    """The vision tower as if trained in full: every weight of it moved by up to 5 %."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if group(name) == "vision_model" and "_lora." not in name:
                param.mul_(1 + 0.05 * torch.rand_like(param))


@pytest.mark.parametrize("method,tower", PEFT_CASES)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                                    "qwen3_5_moe", "nemotron_omni"])
def test_every_family_peft_folder_loads_in_peft_with_the_merged_export_logits(family, method,
                                                                             tower, tmp_path):
    """Every family's HF PEFT folder (``write_peft_folder``: LoRA or DoRA adapters on the LM's
    attention, MLP and mixer projections, and on the vision tower or the tower trained in full)
    loads with ``peft.PeftModel.from_pretrained`` onto the base HF model, and its logits equal
    the merged export's in transformers (<= 1e-4), and differ from the base's; a tower trained in
    full is in both exports: without it (the PEFT folder's ``modules_to_save`` dropped) the
    logits differ."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from models.checkpointing.checkpoint import ModelCheckpoint
    from models.checkpointing.sharding import load_hf_weights
    from models.convert import hf_logits
    from models.families import build_model, config_from_hf, get
    from models.hf.export import write_merged_folder, write_peft_folder
    from models.hf.verify_inputs import hf_inputs, make_inputs
    from models.hf.weights import is_our_key
    from models.lora import DEFAULT_TARGETS, LoRAConfig, add_adapters, merge_adapters
    from models.parallel import init_parallel

    hf = _tiny_hf_of(family, tmp_path / "hf")
    cfg = config_from_hf(json.loads((hf / "config.json").read_text()))
    init_parallel()
    model = build_model(cfg, use_te=False).eval()
    load_hf_weights(model, cfg, hf)
    trained = tower == "trained"
    lora = LoRAConfig(rank=4, alpha=8,
                      parts=["language_model"] if trained else ["language_model", "vision_model"],
                      target_modules=[*DEFAULT_TARGETS, *PEFT_TARGETS.get(family, ())])
    lora.dora = method == "dora"
    add_adapters(model, lora, get(family).parameter_group)
    torch.manual_seed(0)
    _random_b(model)
    if trained:
        _perturb_tower(model, get(family).parameter_group)
    run_config = {"model": {"freeze_vision_model": not trained}}
    found = ModelCheckpoint("test", hf, hf, hf, cfg, run_config, hf, {"hf": str(hf)}, lora)
    write_peft_folder(tmp_path / "peft", {k: v.detach() for k, v in model.state_dict().items()
                                          if is_our_key(k)}, found)
    merge_adapters(model)
    (tmp_path / "merged").mkdir()
    write_merged_folder(tmp_path / "merged", {k: v.detach() for k, v in
                                              model.state_dict().items() if is_our_key(k)}, found)

    def load(folder):
        return AutoModelForImageTextToText.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager").eval()

    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["use_dora"] == lora.dora and bool(config["modules_to_save"]) == trained
    inputs = hf_inputs(cfg, next(iter(make_inputs(cfg).values())))  # an image and its text
    before = hf_logits(load(hf), inputs)
    peft_model = PeftModel.from_pretrained(load(hf), tmp_path / "peft").eval()
    got, want = hf_logits(peft_model, inputs), hf_logits(load(tmp_path / "merged"), inputs)
    assert (want - before).abs().max() > 1e-2  # the adapters change the model
    assert (got - want).abs().max() <= 1e-4, (got - want).abs().max()
    if trained:  # the same adapters without the trained tower: other logits
        dropped = tmp_path / "dropped"
        dropped.mkdir()
        tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
        save_file({k: v for k, v in tensors.items() if ".lora_" in k},
                  str(dropped / "adapter_model.safetensors"))
        (dropped / "adapter_config.json").write_text(json.dumps(
            {**config, "modules_to_save": None}))
        without = hf_logits(PeftModel.from_pretrained(load(hf), dropped).eval(), inputs)
        assert (without - want).abs().max() > 1e-3, (without - want).abs().max()
