"""The MTP head of Qwen3.5 / 3.6 / 3.8 (``model.train_mtp``, models/layers/mtp.py)
against an independent reference written here from the published architecture (vLLM's
``qwen3_5_mtp``): transformers' own Qwen3.5 decoder layer loaded with ``mtp.layers.0.*``, its
zero-centred norms, ``fc`` over [embedding of token i+1; the LM's final-normed hidden state at
i], the shared ``lm_head``; on the tiny folders of ``qwen3_5_hf`` (dense, experts one by one,
Qwen3.6's packed experts), text and an image. Also the targets two ahead under packing, the
weights' way through import and export, and the layouts train.py refuses."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_6_moe"]


def model_with_mtp(folder, config=None):
    """The family's model of the HF ``folder`` with its MTP head built and loaded (``config``:
    the family's config module; Qwen3.5's by default), in eval mode, and its config."""
    from models.checkpointing.sharding import load_hf_weights
    from models.families import build_model
    from models.parallel import init_parallel

    if config is None:
        from models.families.qwen3_5 import config
    cfg = config.from_hf_config(json.loads((folder / "config.json").read_text()))
    cfg = dataclasses.replace(cfg, train_mtp=True)
    init_parallel()
    model = build_model(cfg, use_te=False)
    load_hf_weights(model, cfg, folder)
    return cfg, model.eval()


def _reference_layer(hf_model, mtp: dict, text_config):
    """transformers' decoder layer of the family, full attention, with ``mtp.layers.0.*``; the
    packed MoE experts as transformers holds them ((E, 2I, H), (E, H, I))."""
    import importlib

    moe = getattr(text_config, "num_experts", 0)
    kind = "qwen3_5_moe" if moe else "qwen3_5"
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    layer_cls = getattr(module, "Qwen3_5MoeDecoderLayer" if moe else "Qwen3_5DecoderLayer")
    full = text_config.layer_types.index("full_attention")
    layer = layer_cls(text_config, layer_idx=full)
    sd = {k.removeprefix("mtp.layers.0."): v for k, v in mtp.items()
          if k.startswith("mtp.layers.0.")}
    if moe and "mlp.experts.gate_up_proj" not in sd:  # one by one: stack them
        e = range(text_config.num_experts)
        sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
            [sd.pop(f"mlp.experts.{n}.gate_proj.weight"),
             sd.pop(f"mlp.experts.{n}.up_proj.weight")]) for n in e])
        sd["mlp.experts.down_proj"] = torch.stack(
            [sd.pop(f"mlp.experts.{n}.down_proj.weight") for n in e])
    elif moe:  # the published x@W layout
        sd["mlp.experts.gate_up_proj"] = sd["mlp.experts.gate_up_proj"].transpose(1, 2)
        sd["mlp.experts.down_proj"] = sd["mlp.experts.down_proj"].transpose(1, 2)
    layer.load_state_dict(sd)
    return layer.eval(), module


def _reference_mtp_logits(hf_model, mtp: dict, inputs: dict) -> torch.Tensor:
    """The published MTP head on transformers' model: (1, L, V)."""
    text_config = hf_model.config.text_config
    layer, module = _reference_layer(hf_model, mtp, text_config)
    lm = hf_model.model.language_model
    seen = {}
    lm.register_forward_pre_hook(
        lambda _m, _a, kw: seen.update(embeds=kw["inputs_embeds"]), with_kwargs=True)
    full = text_config.layer_types.index("full_attention")
    lm.layers[full].register_forward_pre_hook(
        lambda _m, a, kw: seen.update(rope=kw["position_embeddings"], mask=kw["attention_mask"]),
        with_kwargs=True)
    hidden = hf_model.model(**inputs).last_hidden_state  # after the final norm

    def norm(name):
        n = getattr(module, "Qwen3_5MoeRMSNorm", None) or module.Qwen3_5RMSNorm
        out = n(text_config.hidden_size, eps=text_config.rms_norm_eps)
        out.weight.data.copy_(mtp[f"mtp.{name}.weight"])
        return out

    following = torch.zeros_like(seen["embeds"])
    following[:, :-1] = seen["embeds"][:, 1:]
    x = torch.cat([norm("pre_fc_norm_embedding")(following), norm("pre_fc_norm_hidden")(hidden)],
                  dim=-1) @ mtp["mtp.fc.weight"].T
    x = layer(x, position_embeddings=seen["rope"], attention_mask=seen["mask"])
    return hf_model.lm_head(norm("norm")(x))


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_logits_match_the_reference(qwen3_5_hf, family):
    """Our MTP logits (text and one image) equal the reference's within 1e-4 (fp32)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from models.families.qwen3_5.verify_inputs import verify_inputs

    folder = qwen3_5_hf[family]
    cfg, model = model_with_mtp(folder)
    mtp = {k: v for k, v in load_file(str(folder / "model.safetensors")).items()
           if k.startswith("mtp.")}
    hf_model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(3))
    cases = {"text": {"input_ids": ids, "position_ids": torch.arange(24).expand(3, 1, 24)},
             "image": verify_inputs(cfg)["one_image"]}
    with torch.no_grad():
        for name, inputs in cases.items():
            main, ours = model.mtp_logits(**inputs)
            theirs = _reference_mtp_logits(hf_model, mtp, inputs)
            assert float((main - hf_model(**inputs).logits).abs().max()) < 1e-4
            diff = float((ours - theirs).abs().max())
            print(f"{family} {name}: MTP logits max abs diff {diff:.2e}")
            assert diff <= 1e-4, (family, name, diff)


def test_targets_two_ahead_never_cross_a_packed_sample():
    from models.multimodal import mtp_targets

    labels = torch.tensor([[-100, 1, 2, 3, -100, 5, 6, 7], [10, 11, 12, 13, 14, 15, 16, -100]])
    target, mask = mtp_targets(labels, None)
    assert target[0, :6].tolist() == [2, 3, 0, 5, 6, 7] and mask[0].tolist() == [
        1, 1, 0, 1, 1, 1, 0, 0]
    # row 0 packs samples [0, 3) and [3, 8); row 1 one sample [8, 16)
    _, packed = mtp_targets(labels, None, torch.tensor([0, 3, 8, 16]))
    assert packed[0].tolist() == [1, 0, 0, 1, 1, 1, 0, 0]
    assert packed[1].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_6_moe"])
def test_trained_head_is_exported_in_the_source_layout(qwen3_5_hf, family, tmp_path):
    """An import with ``train_mtp``, its head changed, exported: every ``mtp.*`` key in the
    source's names and shapes (Qwen3.6's packed experts packed again), holding the new values;
    the rest as before; transformers loads it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from models.checkpointing.checkpoint import model_record, save_checkpoint
    from models.hf.export import mcore_to_hf

    folder = qwen3_5_hf[family]
    cfg, model = model_with_mtp(folder)
    with torch.no_grad():
        for param in model.mtp.parameters():
            param.add_(0.5)
    save_checkpoint(model, cfg, tmp_path / "mcore", hf_config=json.loads(
        (folder / "config.json").read_text()), files=model_record(folder))
    mcore_to_hf(tmp_path / "mcore", tmp_path / "export")
    before = load_file(str(folder / "model.safetensors"))
    after = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert sorted(after) == sorted(before)
    for key, tensor in before.items():
        assert after[key].shape == tensor.shape, key
        if key.startswith("mtp."):
            assert torch.allclose(after[key], tensor + 0.5, atol=1e-6), key
        else:
            assert torch.equal(after[key], tensor), key
    AutoModelForImageTextToText.from_pretrained(tmp_path / "export")


def test_layouts_train_mtp_refuses():
    from types import SimpleNamespace

    from models.families import qwen3_5
    from models.families.qwen3_5 import config

    cfg = config.load_yaml("configs/qwen3_5_moe_tiny.yaml", ["lm.mtp_num_layers=1",
                                                             "train_mtp=true"])
    one = dict(tp=1, pp=1, cp=1, ep=1)
    assert qwen3_5.layout_problems(cfg, SimpleNamespace(**one)) == []
    assert qwen3_5.layout_problems(cfg, SimpleNamespace(**{**one, "tp": 2, "ep": 2})) == []
    for key in ("pp", "cp"):
        problems = qwen3_5.layout_problems(cfg, SimpleNamespace(**{**one, key: 2}))
        assert problems == [f"model.train_mtp=true needs parallel.{key}=1 (the MTP head is not "
                            f"built for {key.upper()} > 1 yet), got 2"]
    with pytest.raises(ValueError, match="train_mtp needs the checkpoint's one MTP layer"):
        config.load_yaml("configs/qwen3_5_moe_tiny.yaml", ["train_mtp=true"])
    with pytest.raises(ValueError, match="mtp_loss_weight must be >= 0"):
        config.load_yaml("configs/qwen3_5_moe_tiny.yaml", ["mtp_loss_weight=-1"])


def test_train_py_refuses_what_the_head_does_not_run(mantis_out, capsys):
    """train.py: each refusal one line before anything is built (exit 2)."""
    from tests.conftest import REPO
    from tests.test_train import MANTIS_CFG, main_error

    config = str(REPO / "configs" / "train_qwen3_5_moe_mantis.yaml")
    mtp = (f"data.path={mantis_out}/metadataset.yaml", "model.lm.mtp_num_layers=1",
           "model.train_mtp=true")
    line = main_error(capsys, config, *mtp, "parallel.pp=2", "task_encoder.fixed_length=true",
                      env={"WORLD_SIZE": "2"})
    assert "model.train_mtp=true needs parallel.pp=1 (the MTP head is not built for PP > 1" in line
    line = main_error(capsys, config, *mtp, "model.peft=lora")
    assert "model.train_mtp=true with model.lora" in line
    line = main_error(capsys, config, *mtp[:2], "model.train_mtp=yes please")
    assert "model.train_mtp" in line
    line = main_error(capsys, str(MANTIS_CFG), mtp[0], "model.train_mtp=true")  # Qwen-VL: none
    assert "train_mtp" in line
