"""The model checkpoint folder (models/checkpointing/checkpoint.py): the one reader's description of
both kinds, its one-line refusals, the model config's old file name, and init_parallel's reuse
(models/parallel.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from contract.errors import UsageError
from tests.models.conftest import build_tiny


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny Qwen2.5-VL saved by ``save_checkpoint`` (an import folder without ``hf/``)."""
    from models.checkpointing.checkpoint import save_checkpoint

    cfg, model = build_tiny("qwen2_5_vl")
    out = tmp_path_factory.mktemp("ckpt") / "import"
    save_checkpoint(model, cfg, out, hf_config={"model_type": "qwen2_5_vl"})
    return out


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def test_import_folder_is_described_and_loads(saved):
    from models.checkpointing.checkpoint import (
        MODEL_JSON,
        OLD_MODEL_JSON,
        load_checkpoint,
        read_checkpoint,
    )

    assert (saved / MODEL_JSON).is_file() and not (saved / OLD_MODEL_JSON).exists()
    found = read_checkpoint(saved)
    assert (found.kind, found.folder, found.weights) == ("hf-import", saved, saved)
    assert found.run_config is None and found.hf_files is None
    assert found.model_config.family == "qwen2_5_vl"
    model, cfg = load_checkpoint(saved, use_te=False)
    assert cfg == found.model_config and not model.training


def test_folder_with_the_old_model_json_name_loads(saved, tmp_path):
    """Checkpoints written before the rename hold ``qwen_vl_model.json``: still read, same
    weights."""
    import shutil

    from models.checkpointing.checkpoint import (
        MODEL_JSON,
        OLD_MODEL_JSON,
        load_checkpoint,
        read_checkpoint,
    )

    old = tmp_path / "old"
    shutil.copytree(saved, old)
    (old / MODEL_JSON).rename(old / OLD_MODEL_JSON)
    found = read_checkpoint(old)
    assert found.kind == "hf-import" and found.model_config == read_checkpoint(saved).model_config
    new_model, _ = load_checkpoint(saved, use_te=False)
    old_model, _ = load_checkpoint(old, use_te=False)
    new, loaded = _weights(new_model), _weights(old_model)
    assert loaded.keys() == new.keys() and all(torch.equal(loaded[k], new[k]) for k in new)


def test_train_step_folder_is_described(saved, tmp_path):
    """A train.py run folder reads as its newest complete step: weights in model_optim/, the
    model from the stored run config, hf/ when recorded."""
    from models.checkpointing.checkpoint import read_checkpoint
    from models.checkpointing.folders import COMPLETE

    model = json.loads((saved / "model_config.json").read_text())
    run = tmp_path / "run"
    for step, complete in ((2, True), (4, False)):
        folder = run / "checkpoints" / f"step_{step:06d}"
        (folder / "model_optim").mkdir(parents=True)
        (folder / "model_optim" / "metadata.json").write_text("{}")
        (folder / "config.yaml").write_text(yaml.safe_dump({"out": str(run), "model": model}))
        (folder / "hf").mkdir()
        if complete:
            (folder / COMPLETE).write_text("{}")
    found = read_checkpoint(run)
    step = run / "checkpoints" / "step_000002"
    assert (found.kind, found.path, found.folder) == ("train.py step_000002", run, step)
    assert found.weights == step / "model_optim" and found.hf_files == step / "hf"
    assert found.run_config["out"] == str(run)
    assert found.model_config == read_checkpoint(saved).model_config


def test_bad_checkpoints_are_one_usage_line(tmp_path):
    from models.checkpointing.checkpoint import read_checkpoint

    with pytest.raises(UsageError, match="does not exist"):
        read_checkpoint(tmp_path / "nope")
    with pytest.raises(UsageError) as info:
        read_checkpoint(tmp_path)
    message = str(info.value)  # eval.py's and the export's tests look for either wording
    assert "is not a model checkpoint" in message and "not a checkpoint" in message
    (tmp_path / "model_config.json").write_text("{not json")
    with pytest.raises(UsageError, match="is unreadable"):
        read_checkpoint(tmp_path)


def test_load_weights_refuses_a_planted_metadata_pickle(saved, tmp_path):
    """train.py's start from an import (``train.init_checkpoint``, ``model.hf``) goes through
    the same check: a pickle planted as ``.metadata`` is refused, never unpickled."""
    import os
    import pickle
    import shutil

    from models.checkpointing.checkpoint import load_weights

    marker = tmp_path / "unpickled"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    planted = tmp_path / "planted"
    shutil.copytree(saved, planted)
    (planted / ".metadata").write_bytes(pickle.dumps(Planted()))
    _cfg, model = build_tiny("qwen2_5_vl")
    with pytest.raises(UsageError, match="refused"):
        load_weights(model, planted)
    assert not marker.exists()
    assert load_weights(model, saved) >= {k for k in model.state_dict()
                                          if not k.endswith("_extra_state")}


def test_init_parallel_keeps_the_same_layout_and_reseeds():
    from megatron.core import parallel_state as ps

    from models.parallel import init_parallel

    init_parallel(seed=7)
    group, first = ps.get_tensor_model_parallel_group(), torch.rand(3)
    init_parallel(tp=1, pp=1, cp=1, ep=1, seed=7, etp=1)
    assert ps.get_tensor_model_parallel_group() is group  # same sizes: kept
    assert torch.equal(torch.rand(3), first)  # reseeded


def test_a_missing_or_short_distcp_and_a_partial_step_are_one_line(saved, tmp_path, capsys):
    """A dist checkpoint missing one ``.distcp`` (or with one truncated) is named before
    anything is built; an explicitly named ``step_N.partial`` (a save that did not finish) is not
    exported."""
    import shutil

    from models.checkpointing.checkpoint import read_checkpoint
    from models.convert import main

    for damage in ("missing", "truncated"):
        broken = tmp_path / damage
        shutil.copytree(saved, broken)
        distcp = sorted(broken.glob("*.distcp"))[-1]
        if damage == "missing":
            distcp.unlink()
        else:
            distcp.write_bytes(distcp.read_bytes()[:-16])
        with pytest.raises(UsageError, match=f"{distcp.name} is {damage} .* copy the whole"):
            read_checkpoint(broken)
        code = main(["mcore-to-hf", "--mcore", str(broken), "--out", str(tmp_path / "x")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err[-1].startswith("models.convert: error: ") and \
            f"{distcp.name} is {damage}" in err[-1], err[-3:]

    model = json.loads((saved / "model_config.json").read_text())
    partial = tmp_path / "run" / "checkpoints" / "step_000004.partial"
    shutil.copytree(saved, partial / "model_optim")
    (partial / "config.yaml").write_text(yaml.safe_dump({"model": model}))
    with pytest.raises(UsageError, match=r"step_000004\.partial is a save that did not finish"):
        read_checkpoint(partial)
