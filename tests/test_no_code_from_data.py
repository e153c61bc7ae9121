"""Nothing executes from a data folder (energon_tasks/dataset_files.py, docs/format.md).

Each construct by which Energon's YAML names code is planted in a copy of a converted dataset
(``metadataset.yaml``, ``.nv-meta/dataset.yaml``, ``split.yaml``, ``.info.json``); its payload
writes a marker file. train.py, eval.py, ``energon_tasks inspect`` / ``preview`` and the loader
refuse each with one line naming the file and the key, and the marker never appears. The controls
show the payloads are live: Energon alone, without the check, runs them.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

MANTIS_CFG = REPO / "configs" / "train_qwen_vl_mantis.yaml"
FAST = ["data.num_workers=0", "log.tensorboard=false", "checkpoint.save_final=false"]


def payload(marker: Path) -> dict:
    """Energon's config parser calls ``os.system("touch MARKER")`` where this mapping stands."""
    return {"__module__": "os", "__function__": "system", "command": f"touch {marker}"}


def _dump(doc: dict) -> str:
    return yaml.safe_dump(doc, sort_keys=False)


def _edit_yaml(path: Path, edit) -> None:
    doc = yaml.safe_load(path.read_text())
    path.write_text(_dump(edit(doc) or doc))


def _member(doc: dict) -> dict:
    return doc["splits"]["train"]["blend"][0]


def _dataset_yaml(extra: dict) -> dict:
    from energon_tasks.sample_format import DATASET_YAML

    return {**DATASET_YAML, **extra}


# ---- the cases: (where it is planted, the key the refusal names) --------------------------------
# Each plants into the dataset copy ``root`` and returns the path the commands are given.

def plant_metadataset_class(root, marker):
    (root / "metadataset.yaml").write_text(_dump(payload(marker)))


def plant_subflavor(root, marker):
    _edit_yaml(root / "metadataset.yaml",
               lambda doc: _member(doc)["subflavors"].update(evil=payload(marker)))


def plant_split_entry(root, marker):
    _edit_yaml(root / "metadataset.yaml", lambda doc: doc["splits"].update(train=payload(marker)))


def plant_joiner(root, marker):
    join = {"joiner": payload(marker), "join": [{"path": "."}, {"path": "."}]}
    _edit_yaml(root / "metadataset.yaml", lambda doc: doc["splits"].update(train=join))


def plant_member_subset(root, marker):
    _edit_yaml(root / "metadataset.yaml", lambda doc: _member(doc).update(subset=payload(marker)))


def plant_dataset_config(root, marker):
    """A member names another dataset YAML of the folder, whose decoder names code."""
    (root / ".nv-meta" / "other.yaml").write_text(
        _dump(_dataset_yaml({"decoder": payload(marker)})))
    _edit_yaml(root / "metadataset.yaml",
               lambda doc: _member(doc).update(dataset_config="other.yaml"))


def plant_split_config(root, marker):
    (root / ".nv-meta" / "other_split.yaml").write_text(_dump(
        {"split_parts": {"train": payload(marker)}}))
    _edit_yaml(root / "metadataset.yaml",
               lambda doc: _member(doc).update(split_config="other_split.yaml"))


def plant_aux(root, marker):
    _edit_yaml(root / "metadataset.yaml",
               lambda doc: _member(doc).update(aux={"media": "filesystem://."}))


def plant_nested_metadataset(root, marker):
    """A member is another metadataset YAML, with the payload in its subflavors."""
    nested = yaml.safe_load((root / "metadataset.yaml").read_text())
    _member(nested)["subflavors"]["evil"] = payload(marker)
    (root / "nested.yaml").write_text(_dump(nested))
    _edit_yaml(root / "metadataset.yaml",
               lambda doc: doc["splits"].update(train={"blend": [{"path": "nested.yaml"}]}))


def plant_dataset_class(root, marker):
    (root / ".nv-meta" / "dataset.yaml").write_text(_dump(payload(marker)))


def plant_decoder(root, marker):
    (root / ".nv-meta" / "dataset.yaml").write_text(
        _dump(_dataset_yaml({"decoder": payload(marker)})))


def plant_sample_type(root, marker):
    (root / ".nv-meta" / "dataset.yaml").write_text(
        _dump(_dataset_yaml({"sample_type": payload(marker)})))


def plant_function_key(root, marker):
    (root / ".nv-meta" / "dataset.yaml").write_text(_dump(
        _dataset_yaml({"__function__": "system", "command": f"touch {marker}"})))


def plant_dataset_subflavors(root, marker):
    (root / ".nv-meta" / "dataset.yaml").write_text(
        _dump(_dataset_yaml({"subflavors": {"evil": payload(marker)}})))


def _sample_loader_py(root, marker) -> dict:
    (root / ".nv-meta" / "sample_loader.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "def sample_loader(raw):\n    return raw\n\n"
        "def part_filter(part):\n    return True\n")
    return {"sample_loader": "sample_loader.py:sample_loader",
            "part_filter": "sample_loader.py:part_filter"}


def plant_sample_loader_py(root, marker):
    """Energon's own factory running a Python file of the dataset folder."""
    (root / ".nv-meta" / "dataset.yaml").write_text(_dump({
        "__module__": "megatron.energon", "__class__": "StandardWebdatasetFactory",
        "sample_type": {"__module__": "megatron.energon", "__class__": "CaptioningSample"},
        **_sample_loader_py(root, marker)}))


def plant_sample_loader_key(root, marker):
    """Our class, with a sample_loader / part_filter naming a Python file of the folder."""
    (root / ".nv-meta" / "dataset.yaml").write_text(
        _dump(_dataset_yaml(_sample_loader_py(root, marker))))


def plant_split_yaml(root, marker):
    _edit_yaml(root / ".nv-meta" / "split.yaml",
               lambda doc: doc["split_parts"].update(evil=payload(marker)))


def plant_info_json(root, marker):
    info = root / ".nv-meta" / ".info.json"
    info.write_text(json.dumps({**json.loads(info.read_text()), "evil": payload(marker)}))


#: name -> (planting, file the line names, key the line names, planted in the dataset folder)
CASES = {
    "metadataset_class": (plant_metadataset_class, "metadataset.yaml", "__module__", False),
    "subflavor": (plant_subflavor, "metadataset.yaml", "splits.train.blend[0].subflavors.evil",
                  False),
    "split_entry": (plant_split_entry, "metadataset.yaml", "splits.train", False),
    "joiner": (plant_joiner, "metadataset.yaml", "splits.train.joiner", False),
    "member_subset": (plant_member_subset, "metadataset.yaml", "splits.train.blend[0].subset",
                      False),
    "dataset_config": (plant_dataset_config, "metadataset.yaml",
                       "splits.train.blend[0].dataset_config", False),
    "split_config": (plant_split_config, "metadataset.yaml",
                     "splits.train.blend[0].split_config", False),
    "aux": (plant_aux, "metadataset.yaml", "splits.train.blend[0].aux", False),
    "nested_metadataset": (plant_nested_metadataset, "nested.yaml",
                           "splits.train.blend[0].subflavors.evil", False),
    "dataset_class": (plant_dataset_class, ".nv-meta/dataset.yaml", "__module__", True),
    "decoder": (plant_decoder, ".nv-meta/dataset.yaml", "decoder", True),
    "sample_type": (plant_sample_type, ".nv-meta/dataset.yaml", "sample_type", True),
    "function_key": (plant_function_key, ".nv-meta/dataset.yaml", "__function__", True),
    "dataset_subflavors": (plant_dataset_subflavors, ".nv-meta/dataset.yaml", "subflavors",
                           True),
    "sample_loader_py": (plant_sample_loader_py, ".nv-meta/dataset.yaml", "__module__", True),
    "sample_loader_key": (plant_sample_loader_key, ".nv-meta/dataset.yaml", "sample_loader",
                          True),
    "split_yaml": (plant_split_yaml, ".nv-meta/split.yaml", "split_parts.evil", True),
    "info_json": (plant_info_json, ".nv-meta/.info.json", "evil", True),
}
FOLDER_CASES = [name for name, case in CASES.items() if case[3]]


def hostile(mantis_out: Path, tmp_path: Path, name: str) -> tuple[Path, Path]:
    """(a copy of the converted dataset with case ``name`` planted, the payload's marker)."""
    root = tmp_path / "data"
    shutil.copytree(mantis_out, root)
    marker = tmp_path / "MARKER"
    CASES[name][0](root, marker)
    return root, marker


def _one_line(capsys, prog: str, code: int) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith(f"{prog}: error:")]
    assert code == 2 and len(errors) == 1 and lines[-1] == errors[0], (code, lines[-5:])
    return errors[0]


def _names(line: str, root: Path, name: str) -> None:
    _, file, key, _ = CASES[name]
    assert f"{root / file}: {key}:" in line, line
    assert "refused" in line or "not accepted" in line, line


def _train(capsys, data: Path, tmp_path: Path) -> str:
    sys.path.insert(0, str(REPO))
    import train as script

    code = script.main([str(MANTIS_CFG), f"data.path={data}", f"out={tmp_path / 'run'}", *FAST])
    return _one_line(capsys, "train.py", code)


@pytest.mark.parametrize("name", list(CASES))
def test_train_refuses_code_in_the_data(name, mantis_out, tmp_path, capsys):
    """train.py (in process): the planted construct is one line naming file and key; the
    payload never ran."""
    root, marker = hostile(mantis_out, tmp_path, name)
    line = _train(capsys, root / "metadataset.yaml", tmp_path)
    _names(line, root, name)
    assert not marker.exists()


@pytest.mark.parametrize("name", FOLDER_CASES)
def test_train_on_the_dataset_folder_refuses_it(name, mantis_out, tmp_path, capsys):
    """data.path the dataset folder itself (no metadataset): the same refusals."""
    root, marker = hostile(mantis_out, tmp_path, name)
    _names(_train(capsys, root, tmp_path), root, name)
    assert not marker.exists()


@pytest.mark.parametrize("name", FOLDER_CASES)
def test_inspect_and_preview_refuse_code_in_the_data(name, mantis_out, tmp_path, capsys):
    from energon_tasks.__main__ import main

    root, marker = hostile(mantis_out, tmp_path, name)
    code = main(["inspect", str(root), "--tokenizer", "test"])
    _names(_one_line(capsys, "energon_tasks", code), root, name)
    code = main(["preview", str(root), "--index", "0", "--tokenizer", "test", "--out",
                 str(tmp_path / "p.html")])
    _names(_one_line(capsys, "energon_tasks", code), root, name)
    assert not marker.exists() and not (tmp_path / "p.html").exists()


@pytest.mark.parametrize("name", ["subflavor", "decoder", "sample_loader_py", "dataset_config"])
def test_eval_refuses_code_in_the_data(name, mantis_out, tmp_path, capsys):
    """eval.py (in process) reads its checkpoint's description, then refuses the data before any
    model is built (the import folder here holds only its model config)."""
    from recipes.run_config import load_run_config

    sys.path.insert(0, str(REPO))
    import eval as script

    ckpt = tmp_path / "import"
    ckpt.mkdir()
    model = load_run_config(str(MANTIS_CFG)).model
    (ckpt / "model_config.json").write_text(json.dumps(model.to_dict()))
    root, marker = hostile(mantis_out, tmp_path, name)
    code = script.main(["--ckpt", str(ckpt), str(MANTIS_CFG),
                        f"data.path={root / 'metadataset.yaml'}"])
    _names(_one_line(capsys, "eval.py", code), root, name)
    assert not marker.exists()


@pytest.mark.parametrize("name", list(CASES))
def test_every_loader_refuses_code_in_the_data(name, mantis_out, tmp_path):
    """The loader's three entries (train, val, one pass) check before Energon reads a file."""
    from contract.errors import UsageError
    from energon_tasks.config import TaskEncoderConfig
    from energon_tasks.loader import get_pass_loader, get_train_loader, get_val_loader
    from energon_tasks.task_encoder import task_encoder_for
    from energon_tasks.tokenizer import build_test_tokenizer, load_tokenizer

    build_test_tokenizer(str(tmp_path / "tok"))
    config = TaskEncoderConfig(tokenizer="test")
    encoder = task_encoder_for(config, load_tokenizer(str(tmp_path / "tok"), config.model))
    root, marker = hostile(mantis_out, tmp_path, name)
    data = root / "metadataset.yaml"
    for build in (lambda: get_train_loader(data, task_encoder=encoder, batch_size=1),
                  lambda: get_val_loader(data, task_encoder=encoder, batch_size=1),
                  lambda: get_pass_loader(data, task_encoder=encoder, split_part="train")):
        with pytest.raises(UsageError) as refused:
            build()
        _names(str(refused.value), root, name)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["subflavor", "decoder", "sample_loader_py", "dataset_config"])
def test_control_energon_alone_runs_the_payload(name, mantis_out, tmp_path):
    """The planted payloads are live: Energon's own loader, without the check, runs them."""
    from megatron.energon import WorkerConfig, get_val_dataset

    root, marker = hostile(mantis_out, tmp_path, name)
    try:
        get_val_dataset(str(root / "metadataset.yaml"), split_part="train", batch_size=1,
                        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    except Exception:  # noqa: BLE001 - what Energon does after running it does not matter
        pass
    assert marker.exists()


def test_the_converters_output_and_format1_datasets_are_accepted(mantis_out, tmp_path):
    """What finalize writes passes (finalize checks its own output too), and so does the
    dataset.yaml of format-1 conversions (CrudeWebdataset, no argument)."""
    from energon_tasks.dataset_files import FORMAT1_DATASET_YAML, check_dataset_files

    check_dataset_files(mantis_out / "metadataset.yaml")
    check_dataset_files(mantis_out)
    root = tmp_path / "format1"
    shutil.copytree(mantis_out, root)
    (root / ".nv-meta" / "dataset.yaml").write_text(_dump(FORMAT1_DATASET_YAML))
    check_dataset_files(root / "metadataset.yaml")


def test_other_refusals_name_the_file(mantis_out, tmp_path):
    """A JSONL or remote member, a missing member, a metadataset cycle: one line each."""
    from contract.errors import UsageError
    from energon_tasks.dataset_files import check_dataset_files

    root = tmp_path / "data"
    shutil.copytree(mantis_out, root)
    (root / "rows.jsonl").write_text("{}\n")
    mds = root / "metadataset.yaml"
    for path, expected in (("rows.jsonl", "not a JSONL"), ("msc://bucket/ds", "remote"),
                           ("missing", "does not exist"), ("metadataset.yaml", "cycle")):
        _edit_yaml(mds, lambda doc, p=path: _member(doc).update(path=p))
        with pytest.raises(UsageError) as refused:
            check_dataset_files(mds)
        assert expected in str(refused.value) and "\n" not in str(refused.value)
        assert str(mds) in str(refused.value)
