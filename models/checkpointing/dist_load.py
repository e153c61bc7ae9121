"""Reading a megatron dist checkpoint with nothing unpickled but checkpoint data.

megatron's ``torch_dist`` backend is torch's distributed checkpoint (DCP): a pickled
``.metadata``, ``.distcp`` files holding each tensor and, for every item that is no tensor
(megatron's ShardedObjects: each layer's ``_extra_state``, the distributed optimizer's param
groups and bucket sizes), a ``torch.save`` blob; and megatron's ``common.pt``. Left to themselves,
torch reads ``.metadata`` with a plain unpickler and every byte item with a full (not
weights-only) ``torch.load`` (``DefaultLoadPlanner.load_bytes``), megatron reads
``common.pt`` with torch's default, and TransformerEngine's ``set_extra_state`` runs
``pickle.loads`` on the bytes of a non-empty ``_extra_state`` tensor: a payload planted in any of
them would run on ``--resume``, eval or export. This module owns the project's one way to read
such a checkpoint, in which every pickle goes through a restricted unpickler:

- ``.metadata``: ``MetadataUnpickler`` (DCP's metadata dataclasses and enums, ``torch.Size``,
  dtypes, layouts, nothing else);
- every byte item of the ``.distcp`` files, ``common.pt`` and the RNG state files
  (``load_blob``): torch's weights-only unpickler with torch's own allowlist (tensors, storages,
  containers, numbers, strings; ``io.BytesIO`` for TransformerEngine's older extra state); the
  globals other libraries add to that allowlist (megatron-core registers its own) are set aside
  while it runs;
- a non-empty ``_extra_state`` (``check_extra_state``): the pickle TransformerEngine will load is
  read first by ``ExtraStateUnpickler`` (its recipe dataclasses and enums, tensors whose storages
  go through ``load_blob``, containers, dtypes): what it refuses never reaches TE;
- ``metadata.json``: plain JSON, and only the ``torch_dist`` sharded backend is read (with the
  ``torch`` common backend where one is named); every item's file is a name inside the
  checkpoint folder, with no storage transform;
- the **common state** (``_common_state``), whichever megatron-core wrote it: ``common.pt``
  (<= 0.18; ``metadata.json`` names ``common_backend: torch``) or the ``common_state`` byte item
  of the ``.distcp`` files (>= 0.19, no ``common_backend``), both by ``load_blob``; either
  version reads either kind.

``check_dist_checkpoint(folder)`` reads all of that before a model is built (``read_checkpoint``,
``read_train_state``: a planted checkpoint fails in seconds). ``load(sharded_state_dict, folder)``
is ``dist_checkpointing.load`` with megatron's own strategies at two seams replaced (the DCP
reader: ``MetadataUnpickler``, file names checked; the planner's ``load_bytes``: ``load_blob``)
and its common-state reader replaced by ``_common_state`` (megatron-core <= 0.16: a common
strategy passed to ``load``; 0.17 and 0.18: ``serialization.load_common``; >= 0.19:
``serialization.load_common_state_dict``, which would otherwise read the item with torch's
full unpickler); the extra states it loaded are checked before the caller hands them to the
model. ``models.checkpointing.checkpoint`` (import folders, eval,
export, ``train.init_checkpoint``) and ``recipes.checkpointing`` (resume) load only through it.

Every refusal is ``RefusedCheckpoint`` (a ``contract.errors.UsageError``): one line naming the
file and, for a byte item, its key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import io
import json
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from contract.errors import UsageError

METADATA = ".metadata"
COMMON = "common.pt"
CONFIG = "metadata.json"
#: megatron's dist_checkpointing backends this module reads (``metadata.json``; megatron-core
#: >= 0.19 names no common backend: its common state is a DCP item, ``COMMON_ITEM``)
BACKENDS = {"sharded_backend": "torch_dist", "common_backend": "torch"}
COMMON_ITEM = "common_state"
#: what the weights-only unpickler accepts besides torch's own allowlist
EXTRA_SAFE = (io.BytesIO,)
_SIMPLE_NAME = re.compile(r"^[\w.-]+$")


class RefusedCheckpoint(UsageError):
    """A checkpoint file holds something that is not checkpoint data (one line)."""


def _why(error: BaseException) -> str:
    """The one telling line of an unpickling failure (torch's is a page long)."""
    text = str(error)
    found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", text)
    if found:
        return f"it names {found.group(1)}"
    first = (text.strip().splitlines() or [type(error).__name__])[0]
    return first[:160]


def _refused(where: str, what: str, error: BaseException | str) -> RefusedCheckpoint:
    reason = error if isinstance(error, str) else _why(error)
    return RefusedCheckpoint(f"checkpoint {where} is not {what} ({reason}): refused, nothing in "
                             "a checkpoint is unpickled but checkpoint data")


# ---- the unpicklers ----------------------------------------------------------------------------

class MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch DCP's checkpoint metadata and nothing else: the dataclasses and enums
    its metadata modules define, ``torch.Size``, dtypes and tensor layouts."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
               "torch.distributed.checkpoint.filesystem")

    def find_class(self, module, name):
        if module in self.MODULES:
            found = getattr(importlib.import_module(module), name, None)
            if (isinstance(found, type) and found.__module__ == module
                    and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))):
                return found
        elif (module, name) in (("torch", "Size"), ("torch.serialization", "_get_layout"),
                                ("collections", "OrderedDict")):
            return getattr(importlib.import_module(module), name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def read_metadata(folder: str | Path):
    """A dist checkpoint's ``.metadata`` read by ``MetadataUnpickler``.

    Raises:
        RefusedCheckpoint: it holds anything else, or cannot be read.
    """
    path = Path(folder) / METADATA
    try:
        with open(path, "rb") as file:
            return MetadataUnpickler(file).load()
    except Exception as error:  # noqa: BLE001 - any failure: the file is not DCP metadata
        raise _refused(f"{folder}: {METADATA}", "dist-checkpoint metadata", error) from None


@contextlib.contextmanager
def _torch_allowlist_only():
    """torch's weights-only allowlist alone (+ ``EXTRA_SAFE``) while the block runs: the
    globals other libraries registered (megatron-core's) are set aside and put back after."""
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(list(EXTRA_SAFE))
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(registered)


def load_blob(data: bytes | io.BytesIO | Path, where: str) -> Any:
    """A ``torch.save`` blob (a DCP byte item, ``common.pt``, an RNG state file) read by torch's
    weights-only unpickler with torch's own allowlist (``where``: the file and key messages name).

    Raises:
        RefusedCheckpoint: it names anything else, or is no torch file.
    """
    if isinstance(data, Path):
        data = data.read_bytes()
    stream = io.BytesIO(data if isinstance(data, bytes) else data.getvalue())
    try:
        with _torch_allowlist_only(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on a foreign pickle protocol
            return torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - every failure: not a plain torch file
        raise _refused(where, "plain checkpoint data", error) from None


def _storage_from_bytes(data: bytes):
    """``torch.storage._load_from_bytes`` (how plain pickle stores a tensor's storage), with the
    storage's own bytes read by ``load_blob``'s unpickler instead of an unrestricted one."""
    with _torch_allowlist_only():
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


class ExtraStateUnpickler(pickle.Unpickler):
    """TransformerEngine's FP8 extra state (``pickle.dumps`` of a dict of its recipe, tensors and
    numbers): the dataclasses and enums of TE's recipe module, tensors (their storages read by
    the weights-only unpickler), ``OrderedDict``, ``torch.Size``, dtypes; nothing else."""

    RECIPE = "transformer_engine.common.recipe"
    #: how plain pickle names a storage's loader: torch's, or megatron-core >= 0.19's, which
    #: replaces ``torch.storage._load_from_bytes`` with its own weights-only version on import
    #: (a state pickled in a process that imported it names that); both read by ours
    STORAGE_FROM_BYTES = {("torch.storage", "_load_from_bytes"),
                          ("megatron.core.safe_globals", "safe_load_from_bytes")}
    NAMES = {("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict"),
             ("torch", "Size")}

    def find_class(self, module, name):
        if module == self.RECIPE:
            found = getattr(importlib.import_module(module), name, None)
            if (isinstance(found, type) and found.__module__ == module
                    and (dataclasses.is_dataclass(found) or issubclass(found, (enum.Enum, tuple)))):
                return found
        elif (module, name) in self.STORAGE_FROM_BYTES:
            return _storage_from_bytes
        elif (module, name) in self.NAMES:
            return getattr(importlib.import_module(module), name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def check_extra_state(value: Any, where: str) -> None:
    """A layer's loaded ``_extra_state`` holds nothing TransformerEngine's ``set_extra_state``
    would unpickle beyond ``ExtraStateUnpickler``'s classes: the bytes of a non-empty tensor (TE
    ``pickle.loads`` them, whatever the dtype), an ``io.BytesIO`` (TE's older format,
    ``torch.load``-ed); containers are searched. ``None`` and empty tensors hold nothing.

    Raises:
        RefusedCheckpoint: a pickle naming anything else.
    """
    if isinstance(value, torch.Tensor):
        if value.numel():
            raw = value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            try:
                ExtraStateUnpickler(io.BytesIO(raw)).load()
            except Exception as error:  # noqa: BLE001 - any failure: TE would unpickle it
                raise _refused(where, "TransformerEngine extra state", error) from None
    elif isinstance(value, io.BytesIO):
        load_blob(value.getvalue(), where)
    elif isinstance(value, dict):
        for item in value.values():
            check_extra_state(item, where)
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_extra_state(item, where)


def check_extra_states(state: Any, where: str, _key: str = "") -> None:
    """Every ``*_extra_state`` value of a loaded state dict (nested), by ``check_extra_state``."""
    if isinstance(state, dict):
        for key, value in state.items():
            name = f"{_key}.{key}" if _key else str(key)
            if str(key).endswith("_extra_state"):
                check_extra_state(value, f"{where}: {name}")
            else:
                check_extra_states(value, where, name)
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            check_extra_states(value, where, f"{_key}[{index}]")


# ---- the checks before anything is built ----------------------------------------------------

def _check_backends(folder: Path) -> None:
    """``metadata.json`` names the ``torch_dist`` sharded backend and, where it names a common
    backend (megatron-core <= 0.18), ``torch``."""
    path = folder / CONFIG
    try:
        config = json.loads(path.read_text())
        backends = {key: config[key] for key in BACKENDS if key in config}
    except (OSError, ValueError, TypeError) as error:
        raise _refused(f"{folder}: {CONFIG}", "megatron's checkpoint description",
                       f"{type(error).__name__}: {str(error)[:80]}") from None
    if "sharded_backend" not in backends:
        raise _refused(f"{folder}: {CONFIG}", "megatron's checkpoint description",
                       "it names no sharded_backend")
    if any(BACKENDS[key] != value for key, value in backends.items()):
        raise _refused(f"{folder}: {CONFIG}", "a torch_dist checkpoint",
                       f"backends {backends}; only {BACKENDS} are read")


def _check_file_name(folder: Path, name: Any, key: str) -> Path:
    if not isinstance(name, str) or not _SIMPLE_NAME.match(name) or name in (".", ".."):
        raise _refused(f"{folder}: {METADATA}", "dist-checkpoint metadata",
                       f"{key} is stored in {name!r}, not a file of the checkpoint folder")
    return folder / name


def check_dist_checkpoint(folder: str | Path) -> None:
    """Read every pickle of a megatron dist checkpoint folder with the restricted unpicklers,
    before megatron or a model sees any (``.metadata``, ``common.pt``, each byte item of the
    ``.distcp`` files, the extra states among them), and every ``.distcp`` file the metadata
    stores an item in is there, long enough to hold it. A folder without ``.metadata`` is left
    to the loader (another layout, or no checkpoint: it says so).

    Raises:
        RefusedCheckpoint: the first file (and item) that holds anything else (one line).
        UsageError: a ``.distcp`` file missing or shorter than its items (one line).
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = Path(folder)
    if not (folder / METADATA).is_file():
        return
    metadata = read_metadata(folder)
    _check_backends(folder)
    if (folder / COMMON).is_file():
        load_blob(folder / COMMON, f"{folder}: {COMMON}")
    storage = getattr(metadata, "storage_data", None) or {}
    items = getattr(metadata, "state_dict_metadata", None) or {}
    sizes: dict[Path, int | None] = {}
    for index, info in storage.items():
        path = _check_file_name(folder, getattr(info, "relative_path", None), index.fqn)
        if path not in sizes:
            sizes[path] = path.stat().st_size if path.is_file() else None
        if sizes[path] is None or sizes[path] < int(info.offset) + int(info.length):
            raise UsageError(f"checkpoint {folder}: {path.name} is "
                             f"{'missing' if sizes[path] is None else 'truncated'} (its "
                             f"{METADATA} stores {index.fqn} there): copy the whole checkpoint "
                             "folder again")
        if not isinstance(items.get(index.fqn), BytesStorageMetadata):
            continue  # a tensor: torch reads it with weights_only=True (under load's allowlist)
        value = _byte_item(folder, info, index.fqn)
        if index.fqn.split("/", 1)[0].endswith("_extra_state"):
            check_extra_state(value, f"{path}: {index.fqn}")


def _byte_item(folder: Path, info, fqn: str) -> Any:
    """The ``load_blob`` of one byte item (its file, offset and length from ``.metadata``)."""
    path = _check_file_name(folder, getattr(info, "relative_path", None), fqn)
    if getattr(info, "transform_descriptors", None):
        raise _refused(f"{path.name}: {fqn}", "plain checkpoint data",
                       "stored with a storage transform this project does not write")
    with open(path, "rb") as file:
        file.seek(int(info.offset))
        data = file.read(int(info.length))
    return load_blob(data, f"{path}: {fqn}")


def _common_state(folder: str | Path) -> dict:
    """A dist checkpoint's common (non-sharded) state: ``common.pt`` (megatron-core <= 0.18) or
    its ``.distcp`` item ``common_state`` (>= 0.19: ``torch.save([state])``), by ``load_blob``.

    Raises:
        RefusedCheckpoint: it holds anything but checkpoint data, or the checkpoint has neither.
    """
    folder = Path(folder)
    if (folder / COMMON).is_file():
        return load_blob(folder / COMMON, f"{folder}: {COMMON}")
    metadata = read_metadata(folder)
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        if index.fqn.split("/", 1)[0] == COMMON_ITEM:
            state = _byte_item(folder, info, index.fqn)
            if not (isinstance(state, list) and len(state) == 1 and isinstance(state[0], dict)):
                raise _refused(f"{folder}: {index.fqn}", "megatron's common state",
                               f"a {type(state).__name__}, not [dict]")
            return state[0]
    raise _refused(str(folder), "a complete dist checkpoint",
                   f"neither {COMMON} nor a {COMMON_ITEM} item")


# ---- loading ------------------------------------------------------------------------------------

def _sharded_strategy(folder: Path):
    """megatron's torch_dist load strategy with the DCP reader and the planner's ``load_bytes``
    replaced."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        """DCP's file reader: ``.metadata`` by ``MetadataUnpickler`` (read once per reader),
        item files confined."""

        def read_metadata(self, *args, **kwargs):
            if getattr(self, "_read", None) is None:
                metadata = read_metadata(folder)
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                self._read = metadata
            return self._read

        def read_data(self, plan, planner):
            for item in plan.items:
                _check_file_name(folder, self.storage_data[item.storage_index].relative_path,
                                 item.storage_index.fqn)
            try:
                return super().read_data(plan, planner)
            except pickle.UnpicklingError:  # a tensor item torch's weights-only load refused
                for item in plan.items:  # name the first one
                    info = self.storage_data[item.storage_index]
                    with open(folder / info.relative_path, "rb") as file:
                        file.seek(int(info.offset))
                        load_blob(file.read(int(info.length)),
                                  f"{folder / info.relative_path}: {item.storage_index.fqn}")
                raise

    class Planner(torch_strategy.MCoreLoadPlanner):
        """megatron's load planner whose byte items are read by ``load_blob``."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = load_blob(value.getvalue(), f"{folder}: {fqn}")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    def seams():
        stack = contextlib.ExitStack()
        stack.enter_context(_patch(torch_strategy, "_get_filesystem_reader",
                                   lambda path, *_, **__: Reader(path)))
        stack.enter_context(_patch(torch_strategy, "MCoreLoadPlanner", Planner))
        return stack

    class Sharded(torch_strategy.TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
            with seams():  # >= 0.17 passes its async strategy too
                return super().load(sharded_state_dict, checkpoint_dir, *args, **kwargs)

        def load_tensors_metadata(self, checkpoint_dir, metadata=None):
            with seams():
                return super().load_tensors_metadata(checkpoint_dir, metadata)

        def load_sharded_metadata(self, checkpoint_dir):
            with seams():
                return super().load_sharded_metadata(checkpoint_dir)

    return Sharded()


def _common_strategy():
    """megatron-core <= 0.16's common load strategy, reading the common state by
    ``_common_state`` (0.17 dropped the class)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class Common(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return _common_state(checkpoint_dir)

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            raise _refused(str(checkpoint_dir), "a torch_dist checkpoint",
                           "ShardedObjects stored as separate .pt files are not read")

    return Common()


@contextlib.contextmanager
def _patch(module, name: str, value):
    """``module.name`` = ``value`` while the block runs (it must exist: a megatron that renamed
    its seam fails here, loudly, rather than reading with its own unpickler)."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def load(sharded_state_dict: dict, folder: str | Path) -> dict:
    """``dist_checkpointing.load`` of ``folder`` into ``sharded_state_dict`` with every pickle
    read by the restricted unpicklers (see the module docstring); the loaded extra states are
    checked before they are returned.

    Raises:
        RefusedCheckpoint: a file or item holds anything but checkpoint data (one line, on
            every rank: DCP gathers each rank's failures).
        Exception: megatron's / torch's own error of a checkpoint that does not fit (the first
            rank's, for DCP's gathered ``CheckpointException``).
    """
    from megatron.core import __version__, dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    from packaging.version import Version
    from torch.distributed.checkpoint.api import CheckpointException

    folder = Path(folder)
    if (folder / METADATA).is_file():  # read here too: DCP would turn a refusal into its own
        read_metadata(folder)
        _check_backends(folder)
    strategies = {"sharded_strategy": _sharded_strategy(folder)}
    version = Version(__version__)
    with contextlib.ExitStack() as seams:
        if version < Version("0.17"):  # the common state through a strategy
            strategies["common_strategy"] = _common_strategy()
        else:  # a module function of megatron's serialization reads it
            reader = "load_common" if version < Version("0.19") else "load_common_state_dict"
            seams.enter_context(_patch(serialization, reader, _common_state))
        try:
            with _torch_allowlist_only():
                state = dist_checkpointing.load(sharded_state_dict, str(folder), **strategies)
        except CheckpointException as error:
            failures = [failure[0] for failure in error.failures.values()]
            refused = [f for f in failures if isinstance(f, RefusedCheckpoint)]
            first = (refused or [f for f in failures if isinstance(f, Exception)] or [None])[0]
            if first is None:
                raise
            raise first from None
    check_extra_states(state, str(folder))
    return state
