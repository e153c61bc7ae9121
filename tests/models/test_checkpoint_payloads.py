"""Nothing executes from a checkpoint (models/checkpointing/dist_load.py, docs/training.md).

A payload (it writes a marker file) is planted in each kind of item a checkpoint holds: the DCP
``.metadata``, megatron's ``common.pt``, each kind of byte item of the ``.distcp`` files (every
layer's ``_extra_state``, also as the pickle-in-a-tensor TransformerEngine unpickles, and the
distributed optimizer's param groups and bucket sizes), a tensor item, and the RNG state file. It
is refused with one line naming the file (and the item), and the marker never appears: by the
load itself (the pre-load check bypassed) for tiny models of each family, and through train.py
``--resume``, the export and eval for train.py checkpoints of each family saved at TP 1 and 2.
The controls show the payloads are live: megatron's own loader runs them, and the bytes
TransformerEngine would ``pickle.loads`` are read with ``pickletools`` as a call of os.system.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import pickletools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contract.errors import UsageError
from tests.conftest import REPO
from tests.models.conftest import build_tiny
from tests.test_checkpoint_integrity import reseal

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "nemotron_omni")


class Planted:
    """Unpickled, it runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def saved_blob(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def te_state(obj) -> torch.Tensor:
    """A layer's extra state as TransformerEngine stores it: a uint8 tensor of a pickle."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _metadata(folder: Path):
    """The DCP metadata of a clean test checkpoint, through the project's restricted reader."""
    from models.checkpointing.dist_load import read_metadata

    return read_metadata(folder)


def item_kinds(folder: Path) -> dict[str, str]:
    """kind -> the key of its first item in a dist checkpoint: each kind of byte item (the last
    part of its key: ``_extra_state``, ``optimizer``, ``per_bucket_numel``, ...) and a tensor."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    kinds: dict[str, str] = {}
    for key, item in _metadata(folder).state_dict_metadata.items():
        kind = key.split("/", 1)[0].rsplit(".", 1)[-1]
        if not isinstance(item, BytesStorageMetadata):
            kind = "tensor"
        kinds.setdefault(kind, key)
    return kinds


def plant_item(folder: Path, key: str, blob: bytes) -> None:
    """The item ``key`` of the dist checkpoint in ``folder`` now reads as ``blob`` (appended to
    its file, the metadata pointed at it: what someone who can write the folder can do)."""
    metadata = _metadata(folder)
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == key:
            path = folder / info.relative_path
            offset = path.stat().st_size
            with open(path, "ab") as file:
                file.write(blob)
            metadata.storage_data[index] = dataclasses.replace(info, offset=offset,
                                                               length=len(blob))
    with open(folder / ".metadata", "wb") as file:
        pickle.dump(metadata, file)


def as_common_state_layout(folder: Path) -> None:
    """Rewrite the dist checkpoint ``folder`` as megatron-core >= 0.19 writes one, whichever
    version wrote it: no ``common.pt``, its state the byte item ``common_state/shard_0_1``
    (``torch.save([state])``), ``metadata.json`` naming no common backend."""
    import json

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from models.checkpointing.dist_load import load_blob

    common = folder / "common.pt"
    if not common.is_file():
        return  # written so already
    metadata = _metadata(folder)
    key = "common_state/shard_0_1"
    info = next(iter(metadata.storage_data.values()))
    blob = saved_blob([load_blob(common, "common.pt")])
    path = folder / info.relative_path
    offset = path.stat().st_size
    with open(path, "ab") as file:
        file.write(blob)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(fqn=key)] = dataclasses.replace(
        info, offset=offset, length=len(blob))
    with open(folder / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    common.unlink()
    config = json.loads((folder / "metadata.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("common_backend")}
    (folder / "metadata.json").write_text(json.dumps(config))


def plant(folder: Path, kind: str, marker: Path) -> str:
    """Plant a payload in the item of ``kind`` of the dist checkpoint ``folder`` (``.metadata``,
    ``common.pt``, ``te_extra_state``, ``common_state`` (the folder first rewritten in that
    layout: ``as_common_state_layout``) or a kind of ``item_kinds``); the file (and key)
    named."""
    if kind == "common_state":
        as_common_state_layout(folder)
    if kind == ".metadata":
        (folder / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
        return f"{folder}: .metadata"
    if kind == "common.pt":
        (folder / "common.pt").write_bytes(saved_blob({"optimizer": Planted(marker)}))
        return f"{folder}: common.pt"
    kinds = item_kinds(folder)
    key = kinds["_extra_state" if kind == "te_extra_state" else kind]
    payload = te_state(Planted(marker)) if kind == "te_extra_state" else Planted(marker)
    plant_item(folder, key, saved_blob([payload]))  # megatron stores a ShardedObject as [data]
    return key


def planted_copy(source: Path, tmp_path: Path, kind: str) -> tuple[Path, str, Path]:
    """(copy of ``source`` with ``kind`` planted, what the refusal names, the marker)."""
    folder = tmp_path / f"planted_{kind.strip('.')}"
    shutil.copytree(source, folder)
    marker = tmp_path / "MARKER"
    return folder, plant(folder, kind, marker), marker


# ---- the load itself, for tiny models of each family (TP 1, in this process) -------------------

@pytest.fixture(scope="module", params=FAMILIES)
def tiny_saved(request, tmp_path_factory):
    """(family, model, import folder saved by save_checkpoint)."""
    from models.checkpointing.checkpoint import save_checkpoint

    cfg, model = build_tiny(request.param)
    out = tmp_path_factory.mktemp(request.param) / "import"
    save_checkpoint(model, cfg, out)
    assert set(item_kinds(out)) <= set(MODEL_KINDS)  # every kind it holds is planted below
    return request.param, model, out


#: ``common.pt`` (megatron-core <= 0.18) and ``common_state`` (>= 0.19): the common state
MODEL_KINDS = (".metadata", "common.pt", "common_state", "_extra_state", "te_extra_state",
               "tensor")


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_the_load_refuses_a_planted_item(kind, tiny_saved, tmp_path):
    """``dist_load.load`` alone (no check before it) refuses the payload, one line naming the
    item; ``read_checkpoint`` / ``load_weights`` refuse it too (``check_dist_checkpoint``); the
    marker never appears and the process's safe-globals registry is as it was."""
    from models.checkpointing import dist_load
    from models.checkpointing.checkpoint import load_weights, read_checkpoint

    _family, model, saved = tiny_saved
    registered = set(torch.serialization.get_safe_globals())
    folder, named, marker = planted_copy(saved, tmp_path, kind)
    with pytest.raises(dist_load.RefusedCheckpoint) as refused:
        dist_load.load(model.sharded_state_dict(), folder)
    line = str(refused.value)
    assert "\n" not in line and "refused" in line and named.split("/shard_")[0] in line, line
    if kind != "tensor":  # tensors are read at load only (weights-only, by torch and by us)
        with pytest.raises(UsageError, match="refused"):
            read_checkpoint(folder)
    with pytest.raises(UsageError, match="refused"):
        load_weights(model, folder)
    assert not marker.exists()
    assert set(torch.serialization.get_safe_globals()) == registered


@pytest.mark.parametrize("layout", ["as_saved", "common_state"])
def test_the_loaded_weights_are_the_saved_ones(layout, tiny_saved, tmp_path):
    """A legitimate checkpoint loads through the restricted reading, every weight equal, in the
    layout this megatron-core writes and in the other one (``common.pt`` or the ``common_state``
    item: a checkpoint of either version loads with the other)."""
    from models.checkpointing import dist_load

    _family, model, saved = tiny_saved
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    if layout == "common_state":
        as_common_state_layout(folder)
        assert not (folder / "common.pt").exists()
    dist_load.check_dist_checkpoint(folder)
    state = dist_load.load(model.sharded_state_dict(), folder)
    weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert all(torch.equal(state[k], v) for k, v in weights.items())


@pytest.mark.parametrize("kind", ["_extra_state", "common.pt"])
def test_control_megatron_alone_runs_the_payload(kind, tiny_saved, tmp_path):
    """The planted payloads are live: megatron's own dist_checkpointing.load runs them."""
    from megatron.core import dist_checkpointing

    _family, model, saved = tiny_saved
    folder, _named, marker = planted_copy(saved, tmp_path, kind)
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1" if kind == "common.pt" else "0"
    try:  # common.pt: torch's default reads it weights-only unless the environment says not
        dist_checkpointing.load(model.sharded_state_dict(), str(folder))
    except BaseException:  # noqa: BLE001 - what megatron does after running it does not matter
        pass
    finally:
        os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    assert marker.exists()


def test_extra_state_pickles_are_read_as_transformer_engine_data(tmp_path):
    """What TransformerEngine's set_extra_state would ``pickle.loads``: FP8-like state (tensors,
    numbers) passes, an empty or absent state holds nothing, a payload is refused in any dtype's
    bytes (TE ignores the dtype) and in TE's older BytesIO format; the control: the planted
    bytes really are a call of ``os.system`` (read with ``pickletools``, never run)."""
    from models.checkpointing.dist_load import RefusedCheckpoint, check_extra_state

    marker = tmp_path / "MARKER"
    check_extra_state(te_state({"scale_fwd": torch.ones(3), "amax": torch.zeros(2, 4),
                                "extra_fp8_variables": {"num_gemms": 1}}), "ok")
    for empty in (None, torch.empty(0, dtype=torch.uint8), [None]):
        check_extra_state(empty, "empty")
    raw = te_state(Planted(marker))
    pad = (-len(raw)) % 2
    as_bf16 = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8)]).view(torch.bfloat16)
    for planted in (raw, [raw], {"state": raw}, io.BytesIO(saved_blob(Planted(marker)))):
        with pytest.raises(RefusedCheckpoint, match="names posix.system"):
            check_extra_state(planted, "layer._extra_state")
    with pytest.raises(RefusedCheckpoint, match="refused"):
        check_extra_state(as_bf16, "layer._extra_state")
    assert not marker.exists()
    ops = [(op.name, arg) for op, arg, _pos in pickletools.genops(raw.numpy().tobytes())]
    assert ("SHORT_BINUNICODE", "system") in ops and ("REDUCE", None) in ops


def test_extra_state_pickled_after_megatron_0_19_replaced_the_storage_loader(monkeypatch):
    """megatron-core >= 0.19 sets ``torch.storage._load_from_bytes`` to its own
    ``megatron.core.safe_globals.safe_load_from_bytes`` on import, so a TE extra state pickled in
    such a process names that loader: it is read as checkpoint data (the same pickle made here on
    any version, as 0.19 makes it)."""
    import megatron.core.safe_globals as safe_globals

    from models.checkpointing.dist_load import check_extra_state

    def safe_load_from_bytes(b):  # what 0.19 assigns; never called here
        raise AssertionError("the checkpoint reader must not call a loader a pickle names")

    safe_load_from_bytes.__module__ = "megatron.core.safe_globals"
    safe_load_from_bytes.__qualname__ = "safe_load_from_bytes"
    monkeypatch.setattr(safe_globals, "safe_load_from_bytes", safe_load_from_bytes,
                        raising=False)
    monkeypatch.setattr(torch.storage, "_load_from_bytes", safe_load_from_bytes)
    state = te_state({"scale_fwd": torch.ones(3), "amax": torch.zeros(2, 4)})
    names = [arg for op, arg, _pos in pickletools.genops(state.numpy().tobytes())
             if op.name == "SHORT_BINUNICODE"]
    assert "megatron.core.safe_globals" in names and "safe_load_from_bytes" in names
    check_extra_state(state, "layer._extra_state")


def test_other_backends_and_foreign_files_are_refused(tiny_saved, tmp_path):
    """metadata.json naming another backend, an item stored outside the folder: one line."""
    import json

    from models.checkpointing.dist_load import RefusedCheckpoint, check_dist_checkpoint

    _family, _model, saved = tiny_saved
    other = tmp_path / "zarr"
    shutil.copytree(saved, other)
    config = json.loads((other / "metadata.json").read_text())
    (other / "metadata.json").write_text(json.dumps({**config, "sharded_backend": "zarr"}))
    with pytest.raises(RefusedCheckpoint, match="only .* are read"):
        check_dist_checkpoint(other)
    outside = tmp_path / "outside"
    shutil.copytree(saved, outside)
    metadata = _metadata(outside)
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[index] = dataclasses.replace(info, relative_path="../secret.distcp")
    with open(outside / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    with pytest.raises(RefusedCheckpoint, match="not a file of the checkpoint folder"):
        check_dist_checkpoint(outside)


# ---- train.py checkpoints of each family at TP 1 and 2, through the commands ------------------

MANTIS_CFG = REPO / "configs" / "train_qwen_vl_mantis.yaml"
NEMOTRON_CFG = REPO / "configs" / "train_nemotron_omni_mantis.yaml"
FAST = ["data.num_workers=0", "log.tensorboard=false", "checkpoint.save_final=false"]
FAMILY_ARGS = {
    "qwen2_5_vl": [str(MANTIS_CFG)],
    "qwen3_vl": [str(MANTIS_CFG), "model.base=configs/qwen3_vl_tiny.yaml",
                 "model.lm.vocab_size=640", "task_encoder.model=qwen3-vl"],
    "nemotron_omni": [str(NEMOTRON_CFG)],
}
#: every kind of item a train.py step folder holds (model_optim/ + the RNG state file)
TRAIN_KINDS = (".metadata", "common.pt", "common_state", "_extra_state", "te_extra_state",
               "optimizer", "per_bucket_numel", "per_bucket_numel_unpadded", "tensor", "rng")


def train(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py"] if nproc == 1 else [
        sys.executable, "-m", "recipes.launch", "--standalone", "--nproc-per-node",
        str(nproc), "train.py"]
    return subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=600)


#: (family, TP) of the train.py runs planted into: every family at TP 2 (torchrun: every rank
#: refuses), and one at TP 1 (the one-process path); a TP 1 run of the others added no item kind
#: and no code path, only about a minute of the suite
TRAIN_RUNS = [(family, 2) for family in FAMILIES] + [("qwen2_5_vl", 1)]


@pytest.fixture(scope="module", params=TRAIN_RUNS, ids=lambda p: f"{p[0]}-tp{p[1]}")
def train_step(request, mantis_out, tmp_path_factory):
    """(family, tp, data args, the step folder of a 2-step train.py run saved at that TP)."""
    family, tp = request.param
    out = tmp_path_factory.mktemp(f"run_{family}_tp{tp}")
    args = [*FAMILY_ARGS[family], f"data.path={mantis_out}/metadataset.yaml", *FAST]
    proc = train(*args, f"out={out}", "train.steps=2", "checkpoint.interval=2",
                 f"parallel.tp={tp}", nproc=tp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = out / "checkpoints" / "step_000002"
    assert set(item_kinds(step / "model_optim")) <= set(TRAIN_KINDS)  # each kind is planted
    return family, tp, args, step


def planted_step(step: Path, tmp_path: Path, kind: str) -> tuple[Path, str, Path]:
    """(copy of a step folder with ``kind`` planted, what the refusal names, the marker)."""
    folder = tmp_path / f"step_{kind.strip('.')}" / step.name
    shutil.copytree(step, folder)
    marker = tmp_path / "MARKER"
    if kind == "rng":
        rng = folder / "rng" / "rank_00000.pt"
        rng.write_bytes(saved_blob({"torch": Planted(marker)}))
        named = "rng/rank_00000.pt"
    else:
        named = plant(folder / "model_optim", kind, marker)
    reseal(folder)  # its checksums match: the restricted unpicklers are what refuses it
    return folder, named, marker


def _error_line(text: str, prog: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.startswith(f"{prog}: error:")]
    assert len(lines) >= 1 and "Traceback" not in text, text[-3000:]
    assert len(set(lines)) == 1, lines  # one line (each rank of a torchrun says the same)
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRAIN_KINDS)
def test_resume_export_and_eval_refuse_a_planted_item(kind, train_step, tmp_path, capsys):
    """train.py --resume, the export (models.convert mcore-to-hf) and eval.py refuse the planted
    item with one line naming it; the marker never appears. What the check before any setup
    catches is run in this process; a tensor item, read only by the load, by train.py itself at
    the checkpoint's TP (torchrun at TP 2: every rank refuses) and the export at TP 1."""
    from models.convert import main as convert_main

    family, tp, args, step = train_step
    folder, named, marker = planted_step(step, tmp_path, kind)
    if kind == "tensor":
        proc = train(*args, f"out={tmp_path / 'resumed'}", f"parallel.tp={tp}", "train.steps=3",
                     "--resume", str(folder), nproc=tp)
        # exit 2; under torchrun (recipes.launch) the ranks' 2
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = _error_line(proc.stderr, "train.py")
    else:
        sys.path.insert(0, str(REPO))
        import train as script

        assert script.main([*args, f"out={tmp_path / 'resumed'}", "--resume", str(folder)]) == 2
        line = _error_line(capsys.readouterr().err, "train.py")
    assert "refused" in line and named in line, line
    if kind != "rng":  # the export reads the model checkpoint only (no RNG state)
        code = convert_main(["mcore-to-hf", "--mcore", str(folder), "--out",
                             str(tmp_path / "hf")])
        line = _error_line(capsys.readouterr().err, "models.convert")
        assert code == 2 and "refused" in line and named in line, line
    if kind not in ("rng", "tensor"):  # eval reads the model checkpoint (no RNG state) first
        sys.path.insert(0, str(REPO))
        import eval as evaluate

        assert evaluate.main(["--ckpt", str(folder), "--out", str(tmp_path / "eval")]) == 2
        line = _error_line(capsys.readouterr().err, "eval.py")
        assert "refused" in line and named in line, line
    assert not marker.exists()
