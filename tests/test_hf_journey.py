"""From a Hugging Face model to a fine-tuned Hugging Face model: train.py started from a tiny HF
model (``model.hf``: weights imported at the run's layout and cached, tokenizer, chat template and
pixel settings from the model's own files), export of train.py checkpoints
(``models.convert mcore-to-hf``) that transformers loads with its Auto classes and that gives our
logits, and the round trip import -> train -> export -> import. Qwen2.5-VL, Qwen3.5 (Gated
DeltaNet layers), Cosmos3-Omni's reasoner and Nemotron-Omni; one slow run saved at TP=2
(Nemotron-Omni)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from lookalikes.models import build_tiny_hf_model
from tests.conftest import REPO
from tests.test_train import FAST, MANTIS_CFG, NEMOTRON_MANTIS_CFG, losses, ok, train

#: family -> (train config, the HF model's own image pixel limits: differ from the config's)
JOURNEYS = {"qwen2_5_vl": (MANTIS_CFG, (3136, 6272)),
            "qwen3_5": (MANTIS_CFG, (3136, 6272)),
            "cosmos3_omni": (MANTIS_CFG, (3136, 6272)),
            "nemotron_omni": (NEMOTRON_MANTIS_CFG, (8192, 16384))}
#: after the fine-tune steps the two stacks sum float32 in other orders: observed up to 1.0e-4
#: (qwen3_5, interleaved images, full suite); untrained parity is 1e-4 in the family tests
LOGITS_TOLERANCE = 2e-4


def train_from_hf(family: str, hf: Path, out: Path, cache: Path, mantis_out: Path, *extra: str,
                  nproc: int = 1, plain: bool = False):
    config = JOURNEYS[family][0]
    proc = train(str(config), f"model.hf={hf}", f"data.path={mantis_out}/metadataset.yaml",
                 f"out={out}", f"train.hf_import_cache={cache}", *FAST,
                 "checkpoint.save_final=true", *extra, nproc=nproc, plain=plain)
    ok(proc)
    return proc


def export(ckpt: Path, out: Path) -> Path:
    from models.convert import main

    assert main(["mcore-to-hf", "--mcore", str(ckpt), "--out", str(out)]) == 0
    return out


def state(path: Path) -> dict[str, torch.Tensor]:
    """Our weights (TP=1) of an import or a train.py checkpoint."""
    from models.checkpointing.checkpoint import load_checkpoint
    from models.parallel import init_parallel

    init_parallel()
    model, _cfg = load_checkpoint(path, use_te=False)
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def logits_diff(ckpt: Path, exported: Path) -> dict[str, float]:
    """Max abs logit difference, transformers' Auto class on the export vs ours on ``ckpt``,
    on generated inputs (images, interleaved images, video)."""
    from transformers import AutoModelForImageTextToText

    from models.checkpointing.checkpoint import load_checkpoint
    from models.convert import hf_logits, our_logits
    from models.hf.verify_inputs import hf_inputs, make_inputs
    from models.parallel import init_parallel

    init_parallel()
    model, cfg = load_checkpoint(ckpt, use_te=False)
    hf_model = AutoModelForImageTextToText.from_pretrained(
        exported, dtype=torch.float32, attn_implementation="eager").eval()
    return {name: (hf_logits(hf_model, hf_inputs(cfg, inputs)) - our_logits(model, inputs))
            .abs().max().item() for name, inputs in make_inputs(cfg).items()}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(JOURNEYS))
def test_journey_from_hf_to_hf(family, tmp_path, mantis_out):
    """import (model.hf) -> train -> export -> transformers (logits equal ours) -> import again
    (weights identical, cached for reruns); Qwen-VL: a run started from the export begins at
    the trained loss, far below the random start's."""
    from transformers import AutoTokenizer

    from models.convert import import_hf_cached
    from models.families import config_from_hf
    from models.parallel import init_parallel

    hf = build_tiny_hf_model(family, tmp_path / "hf", pixels=JOURNEYS[family][1])
    cache, run = tmp_path / "cache", tmp_path / "run"
    steps = 12 if family == "qwen2_5_vl" else 3
    proc = train_from_hf(family, hf, run, cache, mantis_out, f"train.steps={steps}")
    assert f"starting from the HF weights of {hf} (imported into {cache}" in proc.stdout
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["model"]["hf"] == str(hf)
    assert resolved["task_encoder"]["tokenizer"] == str(hf)  # the model's own tokenizer
    pixels = resolved["task_encoder"]["min_pixels"], resolved["task_encoder"]["max_pixels"]
    assert pixels == JOURNEYS[family][1]  # from its preprocessor_config.json

    if family == "cosmos3_omni":  # a new family: a short run's loss falls
        assert losses(run)[-1] < losses(run)[0], losses(run)
    exported = export(run, tmp_path / "export")
    diffs = logits_diff(run, exported)
    assert max(diffs.values()) <= LOGITS_TOLERANCE, diffs
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(hf).chat_template
    assert (exported / "preprocessor_config.json").read_bytes() == \
        (hf / "preprocessor_config.json").read_bytes()
    if family == "qwen2_5_vl":  # the PIL image processor imports here (no torchvision)
        from transformers import AutoImageProcessor

        assert AutoImageProcessor.from_pretrained(exported).size["longest_edge"] == pixels[1]

    trained = state(run)
    if family == "qwen2_5_vl":  # the export as a new start: trained weights, trained loss
        again = tmp_path / "again"
        train_from_hf(family, exported, again, cache, mantis_out, "train.steps=1")
        first = losses(run)[0]
        assert losses(again)[0] < first - 1.5, (losses(again), losses(run))
    init_parallel()
    cfg = config_from_hf(json.loads((exported / "config.json").read_text()))
    folder, reused = import_hf_cached(cfg, str(exported), cache)
    assert reused == (family == "qwen2_5_vl")  # the second run's import is reused
    imported = state(folder)
    assert imported.keys() == trained.keys()
    assert all(torch.equal(imported[k], trained[k]) for k in trained)
    assert import_hf_cached(cfg, str(exported), cache) == (folder, True)


@pytest.mark.slow
def test_checkpoint_saved_at_tp2_exports(tmp_path, mantis_out):
    """Nemotron-Omni imported and trained at TP=2 (torchrun, 2 processes), exported from its
    step folder (loaded at TP=1): the export gives our logits in transformers."""
    hf = build_tiny_hf_model("nemotron_omni", tmp_path / "hf", pixels=(16384, 16384))
    run = tmp_path / "run"
    train_from_hf("nemotron_omni", hf, run, tmp_path / "cache", mantis_out, "train.steps=2",
                  "parallel.tp=2", nproc=2, plain=True)  # the real torchrun launch of train.py
    assert json.loads((run / "checkpoints" / "step_000002" / "train_state.json").read_text()
                      )["layout"]["tp"] == 2
    diffs = logits_diff(run, export(run / "checkpoints" / "step_000002", tmp_path / "export"))
    assert max(diffs.values()) <= LOGITS_TOLERANCE, diffs


def test_unreachable_hub_is_one_line():
    """A hub id goes through huggingface_hub; offline it is one line naming the id."""
    from recipes.run_config import ConfigError, load_run_config

    with pytest.raises(ConfigError) as info:
        load_run_config(MANTIS_CFG, ["model.hf=nobody-here/NoSuch-VL-1B"])
    message = str(info.value)
    assert "\n" not in message and "model.hf nobody-here/NoSuch-VL-1B" in message, message


def test_export_of_a_non_checkpoint_is_one_line(tmp_path, capsys):
    from models.convert import main

    assert main(["mcore-to-hf", "--mcore", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("models.convert: error: ") and \
        "is not a model checkpoint" in err, err


def test_make_prepare_writes_where_train_reads():
    """One data root: ``make prepare-<d>`` writes it, ``make train-<f>-<d>`` reads it; ``HF=``
    becomes model.hf; ``make export-<f>-<d>`` exports the run folder the config names."""
    def dry(*args):
        return subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout

    assert "--out data/mantis " in dry("prepare-mantis", "DATA_ROOT=data")
    line = dry("train-qwen-vl-mantis", "HF=Qwen/Qwen2.5-VL-7B-Instruct")
    assert "data.path=data/mantis/metadataset.yaml" in line
    assert "model.hf=Qwen/Qwen2.5-VL-7B-Instruct" in line
    assert "--out elsewhere/infovqa " in dry("prepare-infovqa", "DATA_ROOT=elsewhere")
    assert "data.path=elsewhere/infovqa/metadataset.yaml" in dry("train-nemotron-omni-infovqa",
                                                                 "DATA_ROOT=elsewhere")
    line = dry("export-nemotron-omni-mantis", "OUT=x")
    assert "mcore-to-hf --mcore runs/nemotron_omni_mantis --out x" in line
    for family in ("qwen_vl", "nemotron_omni"):  # the configs' own default is the same root
        config = yaml.safe_load((REPO / "configs" / f"train_{family}_mantis.yaml").read_text())
        assert config["data"]["path"] == "data/mantis/metadataset.yaml"
        assert config["out"] == f"runs/{family}_mantis"


@pytest.mark.slow
def test_mtp_weights_survive_training_resume_and_a_new_start(tmp_path, mantis_out):
    """A Qwen3.6-layout MoE folder (``qwen3_5_moe``, the LM's and the MTP layer's experts packed,
    every ``mtp.*`` tensor as published): trained 2 steps from ``model.hf``, resumed to step 3,
    then a new run started from that checkpoint (``train.init_checkpoint``, no ``model.hf``)
    for a step; each export holds every ``mtp.*`` tensor of the source byte for byte (the head
    is not trained) and the LM experts packed under the source's names, and loads in
    transformers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from lookalikes.models import add_qwen3_5_mtp, pack_qwen3_5_experts

    hf = build_tiny_hf_model("qwen3_5_moe", tmp_path / "hf")
    pack_qwen3_5_experts(hf)
    mtp = add_qwen3_5_mtp(hf, packed=True)
    source = load_file(str(hf / "model.safetensors"))
    run = tmp_path / "run"
    common = (f"data.path={mantis_out}/metadataset.yaml", *FAST, "checkpoint.interval=1",
              "train.keep_checkpoints=0")
    ok(train(str(MANTIS_CFG), f"model.hf={hf}", f"out={run}",
             f"train.hf_import_cache={tmp_path / 'cache'}", "train.steps=2", *common))
    ok(train(str(MANTIS_CFG), f"model.hf={hf}", f"out={run}",
             f"train.hf_import_cache={tmp_path / 'cache'}", "train.steps=3", *common,
             "--resume", str(run / "checkpoints" / "step_000002")))
    again, resolved = tmp_path / "again", yaml.safe_load((run / "config.yaml").read_text())
    del resolved["model"]["hf"]  # the same run, started from the step's weights instead
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(resolved))
    ok(train(str(tmp_path / "again.yaml"), f"out={again}",
             f"train.init_checkpoint={run / 'checkpoints' / 'step_000003'}", "train.steps=1",
             *common))
    for name, ckpt in (("resumed", run / "checkpoints" / "step_000003"),
                       ("new_start", again / "checkpoints" / "step_000001")):
        exported = export(ckpt, tmp_path / f"export_{name}")
        after = load_file(str(exported / "model.safetensors"))
        assert sorted(after) == sorted(source), name
        for key, tensor in mtp.items():
            assert after[key].numpy().tobytes() == tensor.numpy().tobytes(), (name, key)
        assert any(not torch.equal(after[k], source[k]) for k in source
                   if not k.startswith("mtp.")), name  # the model itself trained
        AutoModelForImageTextToText.from_pretrained(exported)  # every key and shape it expects


@pytest.mark.slow
def test_mtp_head_trains_resumes_and_exports(tmp_path, mantis_out):
    """``model.train_mtp=true`` from a Qwen3.6-layout MoE folder (experts packed, MTP experts
    too), DP 2 with packed rows: the loss and ``mtp_loss`` (logged apart) fall over 6 steps; a
    resume from step 3 gives the same losses as the run that went on; TP 2 (sequence parallel,
    the same batches: ``data.virtual_dp=2``) gives DP 2's losses over 3 steps and its first
    gradient norm (the head's TP shards saved and loaded as such); EP 2 (the head's experts
    split over the ranks) gives DP 2's losses and gradient norms; the exports' ``mtp.*`` tensors
    keep the source's names and shapes but hold trained values, and they load in transformers.
    (``train_mtp=false``: the byte-identical carry above.)"""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from lookalikes.models import add_qwen3_5_mtp, pack_qwen3_5_experts
    from tests.test_train import records

    hf = build_tiny_hf_model("qwen3_5_moe", tmp_path / "hf")
    pack_qwen3_5_experts(hf)
    mtp = add_qwen3_5_mtp(hf, packed=True)
    source = load_file(str(hf / "model.safetensors"))
    common = ("model.train_mtp=true", "task_encoder.packing=true", "train.lr=3e-3",
              "train.warmup_steps=1", "checkpoint.interval=3", "train.keep_checkpoints=0")
    runs = {"dp2": ("train.steps=6",),
            "resumed": ("train.steps=6", "--resume",
                        str(tmp_path / "dp2" / "checkpoints" / "step_000003")),
            "tp2": ("train.steps=3", "parallel.tp=2", "data.virtual_dp=2"),
            # EP on CPU needs equal rows (megatron's allgather dispatcher): its own DP baseline
            "dp2_fixed": ("train.steps=3", "task_encoder.fixed_length=true"),
            "ep2": ("train.steps=3", "task_encoder.fixed_length=true", "parallel.ep=2")}
    logged = {}
    for name, extra in runs.items():
        proc = train_from_hf("qwen3_5", hf, tmp_path / name, tmp_path / "cache", mantis_out,
                             *common, *extra, nproc=2)
        assert "mtp_loss" in proc.stdout, name
        logged[name] = {key: [r[key] for r in records(tmp_path / name)]
                        for key in ("loss", "mtp_loss", "mtp_loss_tokens", "grad_norm")}
    dp2 = logged["dp2"]
    print({name: {k: [round(v, 4) for v in values] for k, values in rows.items()}
           for name, rows in logged.items()})
    assert len(dp2["loss"]) == 6 and min(dp2["mtp_loss_tokens"]) > 0
    for key in ("loss", "mtp_loss"):
        assert dp2[key][-1] < dp2[key][0], (key, dp2[key])
        assert logged["resumed"][key] == pytest.approx(dp2[key][3:], rel=1e-5), key
        # float32 sums in other orders: 2.3e-5 relative at step 3 (later steps drift apart, as
        # without the head: 5e-4 by step 6 at this learning rate)
        assert logged["tp2"][key] == pytest.approx(dp2[key][:3], rel=1e-4), key
    assert logged["tp2"]["grad_norm"][0] == pytest.approx(dp2["grad_norm"][0], rel=1e-5)
    for key in ("loss", "mtp_loss", "grad_norm"):
        assert logged["ep2"][key] == pytest.approx(logged["dp2_fixed"][key], rel=1e-5), key
    for name, step in (("dp2", "step_000006"), ("tp2", "step_000003"), ("ep2", "step_000003")):
        exported = export(tmp_path / name / "checkpoints" / step, tmp_path / f"export_{name}")
        after = load_file(str(exported / "model.safetensors"))
        assert sorted(after) == sorted(source), name
        for key, tensor in mtp.items():
            assert after[key].shape == tensor.shape, key
            assert not torch.equal(after[key], tensor), key  # trained
        AutoModelForImageTextToText.from_pretrained(exported)
