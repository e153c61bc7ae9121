"""The MTP block of Nemotron 3.5 Super VL (``model.train_mtp``, models/layers/mtp.py, built from
the Nemotron-Omni family's own layer specs) against an independent reference written here from
the published architecture (vLLM's ``nemotron_h_mtp``; transformers builds no MTP module):
transformers' own NemotronH blocks of the block's kinds (attention, LatentMoE) loaded with
``language_model.mtp.layers.{j}.*``, its RMSNorm for ``enorm`` / ``hnorm`` / ``final_layernorm``,
``eh_proj`` over [embedding of token i+1; the LM's final-normed hidden state at i], the shared
``lm_head``; on the tiny Super VL folder (``super_hf``), text and an image. Also the weights' way
through import and export with the head built, and the layouts and configs train.py refuses."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lookalikes.models import NEMOTRON_MTP_PREFIX as P
from tests.models.test_nemotron_super import same_bytes, tensors
from tests.models.test_qwen3_5_mtp import model_with_mtp

TOL = 1e-4


def our_model(folder):
    from models.families.nemotron_omni import config

    return model_with_mtp(folder, config)


def reference_blocks(text_config, mtp: dict) -> list:
    """transformers' ``NemotronHBlock`` of each inner layer's kind, its ``norm`` and ``mixer``
    loaded from ``mtp`` (the routed experts stacked as transformers holds them: up (E, I, latent),
    down (E, latent, I)); eager attention (the causal mask passed explicitly)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

    config = copy.deepcopy(text_config)
    config.layers_block_type = list(text_config.mtp_layers_block_type)
    config._attn_implementation = "eager"
    blocks = []
    for j, _kind in enumerate(config.layers_block_type):
        block = NemotronHBlock(config, layer_idx=j)
        prefix = f"{P}{j}."
        sd = {k.removeprefix(prefix): v for k, v in mtp.items() if k.startswith(prefix)
              and k.removeprefix(prefix).split(".")[0] in ("norm", "mixer")}
        experts = range(config.n_routed_experts)
        if "mixer.experts.0.up_proj.weight" in sd:
            for name in ("up_proj", "down_proj"):
                sd[f"mixer.experts.{name}"] = torch.stack(
                    [sd.pop(f"mixer.experts.{e}.{name}.weight") for e in experts])
        block.load_state_dict(sd)
        blocks.append(block.eval())
    return blocks


def reference_mtp_logits(hf_model, mtp: dict, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(transformers' LM logits, the published MTP block's logits on them), each (1, L, V)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm

    text_config = hf_model.config.text_config
    blocks = reference_blocks(text_config, mtp)
    lm = hf_model.language_model
    seen = {}
    handle = lm.model.register_forward_hook(
        lambda _m, _a, kw, out: seen.update(embeds=kw["inputs_embeds"],
                                            hidden=out.last_hidden_state),  # after norm_f
        with_kwargs=True)
    logits = hf_model(**inputs).logits
    handle.remove()

    def norm(name):
        out = NemotronHRMSNorm(text_config.hidden_size, eps=text_config.layer_norm_epsilon)
        out.weight.data.copy_(mtp[name])
        return out

    block = len(blocks)
    following = torch.zeros_like(seen["embeds"])
    following[:, :-1] = seen["embeds"][:, 1:]
    e, h = norm(f"{P}0.enorm.weight")(following), norm(f"{P}0.hnorm.weight")(seen["hidden"])
    x = torch.cat([e, h], dim=-1) @ mtp[f"{P}0.eh_proj.weight"].T
    length = x.shape[1]
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
    for layer in blocks:
        x = layer(x, attention_mask=causal)
    x = norm(f"{P}{block - 1}.final_layernorm.weight")(x)
    return logits, lm.lm_head(x)


def test_mtp_logits_match_the_reference(super_hf):
    """Our MTP logits (text and one image) equal the reference's within 1e-4 (fp32); the LM's
    own logits too."""
    from models.convert import load_hf_model
    from models.families.nemotron_omni.verify_inputs import hf_inputs, verify_inputs

    cfg, model = our_model(super_hf)
    assert [type(layer.mlp).__name__ for layer in model.mtp.layers] == [
        "IdentityOp", "LatentMoELayer"]  # attention, then LatentMoE, as the decoder's
    mtp = {k: v for k, v in tensors(super_hf).items() if k.startswith(P)}
    hf_model = load_hf_model(super_hf)
    ids = torch.randint(0, 400, (1, 24), generator=torch.Generator().manual_seed(3))
    cases = {"text": {"input_ids": ids}, "image": verify_inputs(cfg)["one_image"]}
    with torch.no_grad():
        for name, inputs in cases.items():
            main, ours = model.mtp_logits(**inputs)
            theirs_main, theirs = reference_mtp_logits(hf_model, mtp, hf_inputs(cfg, inputs))
            assert float((main - theirs_main).abs().max()) <= TOL, name
            diff = float((ours - theirs).abs().max())
            print(f"{name}: MTP logits max abs diff {diff:.2e} (logits' scale "
                  f"{float(theirs.abs().max()):.1f})")
            assert diff <= TOL, (name, diff)


def test_head_keeps_and_exports_the_published_names(super_hf, tmp_path):
    """An import with ``train_mtp``: exported untouched, every tensor byte for byte the source's
    (the MTP block through our head and back); its head changed (every tensor + 0.5, the router's
    expert bias included), exported: every ``language_model.mtp.*`` key in its source name and
    shape holding the new value, the rest byte for byte; transformers loads it."""
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3,
    )

    from models.checkpointing.checkpoint import model_record, save_checkpoint
    from models.hf.export import mcore_to_hf

    cfg, model = our_model(super_hf)
    before = tensors(super_hf)
    hf_config = json.loads((super_hf / "config.json").read_text())
    for name, change in (("same", 0.0), ("changed", 0.5)):
        with torch.no_grad():
            for key, value in model.mtp.state_dict().items():
                if not key.endswith("_extra_state"):
                    value.add_(change)
        save_checkpoint(model, cfg, tmp_path / name, hf_config=hf_config,
                        files=model_record(super_hf))
        mcore_to_hf(tmp_path / name, tmp_path / f"export_{name}")
        after = tensors(tmp_path / f"export_{name}")
        assert sorted(after) == sorted(before), name
        for key, tensor in before.items():
            if key.startswith(P) and change:
                assert after[key].shape == tensor.shape, key
                assert torch.allclose(after[key], tensor + change, atol=1e-6), key
            else:
                assert same_bytes(after[key], tensor), (name, key)
    _model, info = NemotronH_Omni_Reasoning_V3.from_pretrained(
        tmp_path / "export_changed", output_loading_info=True)
    assert not any(info.values()), info


def test_layouts_and_configs_train_mtp_refuses():
    from types import SimpleNamespace

    from models.families import nemotron_omni
    from models.families.nemotron_omni import config

    yaml, mtp = "configs/nemotron_omni_tiny.yaml", ["lm.num_nextn_predict_layers=1",
                                                     "train_mtp=true"]
    cfg = config.load_yaml(yaml, mtp)
    assert (cfg.lm.mtp_pattern, cfg.layer_kinds) == ("*E", cfg.lm.pattern + "*E")
    assert nemotron_omni.num_experts(cfg) == cfg.lm.num_experts  # the block's MoE layer
    one = dict(tp=1, pp=1, cp=1, ep=1)
    assert nemotron_omni.layout_problems(cfg, SimpleNamespace(**one)) == []
    assert nemotron_omni.layout_problems(cfg, SimpleNamespace(**{**one, "ep": 2})) == []
    for key in ("pp", "cp", "tp"):
        problems = nemotron_omni.layout_problems(cfg, SimpleNamespace(**{**one, key: 2}))
        assert f"model.train_mtp=true needs parallel.{key}=1 (the MTP head is not built for " \
               f"{key.upper()} > 1 yet), got 2" in problems
    with pytest.raises(ValueError, match="train_mtp needs the checkpoint's one MTP depth"):
        config.load_yaml(yaml, ["train_mtp=true"])
    with pytest.raises(ValueError, match="train_mtp builds attention"):
        config.load_yaml(yaml, [*mtp, "lm.mtp_pattern='M*'"])
    with pytest.raises(ValueError, match="mtp_loss_weight must be >= 0"):
        config.load_yaml(yaml, ["mtp_loss_weight=-1"])
    assert config.load_yaml(yaml, ["lm.mtp_pattern='M*'"]).lm.mtp_pattern == "M*"  # not built


@pytest.mark.slow  # 3 train.py runs of 2 processes and 2 exports: 96 s on 2 shared cores
def test_mtp_block_trains_resumes_and_exports(super_hf, tmp_path, mantis_out):
    """``model.train_mtp=true`` from the Super VL folder, DP 2 (equal rows: the CPU expert
    dispatcher needs them under EP), 4 steps: the loss and ``mtp_loss`` (logged apart) fall; a
    resume from step 2 gives the same losses; EP 2 (the block's and the decoder's experts split
    over the ranks) gives DP 2's losses and gradient norms; the exports' ``language_model.mtp.*``
    keep the source's names and shapes but hold trained values, the rest of the model trained
    too, and they load in transformers. (``train_mtp=false``: the byte-identical carry of
    tests/models/test_nemotron_super.py.)"""
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3,
    )

    from tests.test_hf_journey import export
    from tests.test_train import FAST, NEMOTRON_MANTIS_CFG, ok, records, train

    common = [str(NEMOTRON_MANTIS_CFG), f"model.hf={super_hf}",
              f"data.path={mantis_out}/metadataset.yaml", *FAST, "checkpoint.save_final=true",
              f"train.hf_import_cache={tmp_path / 'cache'}", "train.eval_interval=0",
              "model.train_mtp=true", "task_encoder.fixed_length=true", "train.warmup_steps=1",
              "train.micro_batch_size=2", "checkpoint.interval=2", "train.keep_checkpoints=0"]
    runs = {"dp2": ("train.steps=4",),
            "resumed": ("train.steps=4", "--resume",
                        str(tmp_path / "dp2" / "checkpoints" / "step_000002")),
            "ep2": ("train.steps=4", "parallel.ep=2")}
    logged = {}
    for name, extra in runs.items():
        proc = train(*common, f"out={tmp_path / name}", *extra, nproc=2)
        ok(proc)
        assert "mtp_loss" in proc.stdout, name
        logged[name] = {key: [r[key] for r in records(tmp_path / name)]
                        for key in ("loss", "mtp_loss", "mtp_loss_tokens", "grad_norm")}
    print({name: {k: [round(v, 5) for v in values] for k, values in rows.items()}
           for name, rows in logged.items()})
    dp2 = logged["dp2"]
    assert len(dp2["loss"]) == 4 and min(dp2["mtp_loss_tokens"]) > 0
    for key in ("loss", "mtp_loss"):
        assert dp2[key][-1] < dp2[key][0], (key, dp2[key])
        assert logged["resumed"][key] == pytest.approx(dp2[key][2:], rel=1e-5), key
    for key in ("loss", "mtp_loss", "grad_norm"):
        assert logged["ep2"][key] == pytest.approx(dp2[key], rel=1e-5), key
    source = tensors(super_hf)
    for name in ("dp2", "ep2"):
        exported = tensors(export(tmp_path / name / "checkpoints" / "step_000004",
                                  tmp_path / f"export_{name}"))
        assert sorted(exported) == sorted(source), name
        for key, tensor in source.items():
            assert exported[key].shape == tensor.shape, key
            if key.startswith(P):  # trained (the router's expert bias updated by its load)
                assert not torch.equal(exported[key], tensor), (name, key)
        assert any(not torch.equal(exported[k], source[k]) for k in source
                   if not k.startswith(P)), name  # the model itself trained
        NemotronH_Omni_Reasoning_V3.from_pretrained(tmp_path / f"export_{name}")
