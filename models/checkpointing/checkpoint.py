"""The self-describing model checkpoint folder of every family: written, read, loaded.

This module owns what a model checkpoint is on disk and the one reader of it (train.py's
resume aside, ``recipes.checkpointing``, which also reads the optimizer):

- ``save_checkpoint``: megatron ``dist_checkpointing`` files + ``model_config.json`` (our model
  config, any family; ``qwen_vl_model.json``, its name before, is still read) + ``hf_config.json``
  (the source HF config when imported) + ``hf/`` (``model_record``: what an export needs besides
  weights, i.e. the source HF ``config.json`` and processor files when the model came from a
  Hugging Face model, and the tokenizer files with its chat template);
- ``read_checkpoint``: the one reader of both kinds of model checkpoint, an import folder
  (``models.convert hf-to-mcore``, the cached ``model.hf`` imports) and a train.py run /
  checkpoints / step folder (weights in ``model_optim/``, the model and run config in
  ``config.yaml``; the folder layout is ``models.checkpointing.folders``). It reads only the
  self-description and every pickle of the dist checkpoint with the restricted unpicklers
  (``models.checkpointing.dist_load.check_dist_checkpoint``), and returns a ``ModelCheckpoint``;
  eval.py and ``models.convert`` read checkpoints through it;
- ``load_model`` / ``load_checkpoint``: the model built at this process's TP / PP and every
  weight loaded (for a checkpoint that holds only what trains, its recorded base first: the HF
  model or the init checkpoint, found by its content fingerprint; LoRA adapters merged into the
  base weights); ``load_weights``: a dist checkpoint's weights into a model built already
  (train.py's ``train.init_checkpoint`` / ``model.hf`` start), checked the same way and loaded
  through ``models.checkpointing.dist_load.load`` (nothing is unpickled but checkpoint data).

dist_checkpointing stores global tensors, so a checkpoint saved at one TP / PP / EP loads at any
other (megatron reshards on load; decoder layers and experts are stored by their global index).
Every bad checkpoint is one ``contract.errors.UsageError`` line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from contract.errors import UsageError
from models.checkpointing.dist_load import check_dist_checkpoint
from models.checkpointing.folders import (
    COMPLETE,
    PARTIAL,
    TRAIN_STATE,
    check_sizes,
    resolve_checkpoint,
)
from models.families import build_model, config_from_dict

#: our model config in an import folder; ``OLD_MODEL_JSON``: its name in older folders (read)
MODEL_JSON, OLD_MODEL_JSON = "model_config.json", "qwen_vl_model.json"
HF_JSON = "hf_config.json"
#: folder of a checkpoint with the files an export ships besides weights (``model_record``)
HF_FILES = "hf"
HF_IMPORT = "hf-import"  #: ``ModelCheckpoint.kind`` of an import folder


@dataclass(frozen=True, slots=True)
class ModelCheckpoint:
    """What a model checkpoint says of itself (``read_checkpoint``); nothing is built."""

    kind: str  #: ``"hf-import"``, or ``"train.py step_N"``
    path: Path  #: as given: an import folder, or a train.py run / checkpoints / step folder
    folder: Path  #: the import folder, or the step folder
    weights: Path  #: the megatron dist checkpoint folder
    model_config: object  #: QwenVLModelConfig | NemotronOmniModelConfig
    run_config: dict | None  #: the run config train.py stored (None for an import)
    hf_files: Path | None  #: ``hf/``: the files an export ships (``model_record``), if any
    #: the frozen base a checkpoint that holds only what trains refers to
    #: (``recipes.model_setup.base_source``); None: it holds every weight
    base: dict | None = None
    lora: object = None  #: ``models.lora.LoRAConfig`` of a LoRA / DoRA run, else None


def save_checkpoint(model, cfg, out: Path, hf_config: dict | None = None,
                    files: dict[str, bytes] | None = None):
    """dist_checkpointing.save + self-description (call on every rank); ``files``: relative path
    -> bytes written too (``model_record``)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    out = Path(out)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out))  # into an empty folder
    if dist.get_rank() == 0:
        (out / MODEL_JSON).write_text(json.dumps(cfg.to_dict(), indent=2))
        if hf_config is not None:
            (out / HF_JSON).write_text(json.dumps(hf_config, indent=2))
        write_files(out, files or {})
    dist.barrier()


def write_files(out: Path, files: dict[str, bytes]) -> None:
    """Write ``model_record``'s files (relative path -> bytes) under ``out``."""
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)


def model_record(hf_folder: Path | None, tokenizer=None) -> dict[str, bytes]:
    """What a checkpoint records for export besides weights and the model config: relative
    path -> bytes under ``hf/``. From an HF model folder: its config.json and processor files;
    the tokenizer files (with the chat template) as the folder has them when ``tokenizer`` is
    the folder's (or None), else the tokenizer's own save; the HF weights the family's model does
    not hold but its exports carry (``CARRIED``: ``carried_record``). No other weights."""
    import tempfile

    from models.hf.source import PROCESSOR_FILES, TOKENIZER_FILES

    def read(folder: Path, names) -> dict[str, bytes]:
        return {f"{HF_FILES}/{name}": (folder / name).read_bytes() for name in names
                if (folder / name).is_file()}

    files = read(Path(hf_folder), ("config.json", *PROCESSOR_FILES)) if hf_folder else {}
    files.update(carried_record(hf_folder))
    own = tokenizer is None or (hf_folder is not None and Path(tokenizer.name_or_path).resolve()
                                == Path(hf_folder).resolve())
    if own:
        return {**files, **read(Path(hf_folder), TOKENIZER_FILES)}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {**files, **read(Path(tmp), TOKENIZER_FILES)}


#: under ``hf/``: the HF weights an export carries unchanged (``carried_record``)
CARRIED = "carried.safetensors"
#: under ``hf/``: how the source stored its MoE experts, when packed (``carried_record``)
EXPERTS_LAYOUT = "experts_layout.json"


def carried_record(hf_folder: Path | None) -> dict[str, bytes]:
    """What ``hf/`` keeps of ``hf_folder``'s weights for the export: ``CARRIED`` with the tensors
    its family's model does not hold and every export writes back unchanged (the keys its
    mapping module's ``CARRIED_PREFIXES`` name: the ``mtp.*`` layers of Qwen3.5 / 3.6 / 3.8, in
    either expert layout), and ``EXPERTS_LAYOUT`` (``{"experts": "packed"}``) when the source
    stored its LM experts as packed 3-D tensors where the family's export writes them one by one
    (``{"experts": "packed", "layout": "published" | "transformers"}``: x@W (E, H, 2I) or
    transformers' (E, 2I, H), by shape), so that the export keeps the source's names and layout;
    empty for other families."""
    import json

    from safetensors.torch import save

    from models.families import config_from_hf, mapping_module
    from models.hf.weights import FUSED, carried_hf_weights, weight_map

    config = Path(hf_folder) / "config.json" if hf_folder else None
    if config is None or not config.is_file():
        return {}
    try:
        cfg = config_from_hf(json.loads(config.read_text()))
    except ValueError:  # not a model a family imports: nothing to carry
        return {}
    mapping = mapping_module(cfg)
    prefixes = getattr(mapping, "CARRIED_PREFIXES", ())
    tensors = carried_hf_weights(Path(hf_folder), prefixes)
    out = {f"{HF_FILES}/{CARRIED}": save(tensors)} if tensors else {}
    packed = [shape for key, (_file, shape) in weight_map(Path(hf_folder)).items()
              if key.endswith("gate_up_proj") and FUSED.match(key)
              and not (prefixes and key.startswith(prefixes))]
    if getattr(mapping, "EXPERTS_ONE_BY_ONE", False) and packed:
        x_at_w = packed[0][-1] != cfg.lm.hidden_size  # (E, H, 2I), else transformers' (E, 2I, H)
        out[f"{HF_FILES}/{EXPERTS_LAYOUT}"] = json.dumps(
            {"experts": "packed", "layout": "published" if x_at_w else "transformers"}).encode()
    return out


def checkpoint_record(folder: Path | None) -> dict[str, bytes]:
    """The ``hf/`` files of a checkpoint (an import or a train.py step folder) as
    ``model_record`` gives them: what a run started from it (``train.init_checkpoint``) records
    in its own checkpoints, so that their exports keep the source's config, processor files and
    carried weights (MTP layers)."""
    files = _hf_files(Path(folder)) if folder else None
    if files is None:
        return {}
    return {f"{HF_FILES}/{p.relative_to(files)}": p.read_bytes()
            for p in sorted(files.rglob("*")) if p.is_file()}


def _model_json(folder: Path) -> Path | None:
    """The model config file of an import folder (its new name first), or None."""
    return next((folder / name for name in (MODEL_JSON, OLD_MODEL_JSON)
                 if (folder / name).is_file()), None)


def _hf_files(folder: Path) -> Path | None:
    return folder / HF_FILES if (folder / HF_FILES).is_dir() else None


def read_checkpoint(path: str | Path) -> ModelCheckpoint:
    """What the model checkpoint at ``path`` is, from its self-description only: an import
    folder (``model_config.json``, or ``qwen_vl_model.json`` in older ones) or a train.py run /
    checkpoints / step folder (its newest complete step: ``models.checkpointing.folders``). Nothing
    is built; every pickle of its dist checkpoint is read by the restricted unpicklers first
    (``check_dist_checkpoint``), so a wrong or planted checkpoint fails fast.

    Raises:
        UsageError: ``path`` does not exist, is neither kind, its description is unreadable, or
            a pickle in it is refused (one line each).
    """
    import yaml

    path = Path(path)
    if not path.exists():
        raise UsageError(f"checkpoint {path} does not exist")
    try:
        model_json = _model_json(path)
        if model_json is not None:  # models/convert.py hf-to-mcore, model.hf's cached imports
            found = ModelCheckpoint(HF_IMPORT, path, path, path,
                                    config_from_dict(json.loads(model_json.read_text())), None,
                                    _hf_files(path))
        else:
            step = resolve_checkpoint(path)
            if step.name.endswith(PARTIAL):
                raise UsageError(f"checkpoint {step} is a save that did not finish ({PARTIAL}: "
                                 "killed or out of space mid-save): name a complete step_N "
                                 "folder, or the run folder for its newest")
            damaged = check_sizes(step) if (step / COMPLETE).is_file() else None
            if damaged:  # before anything of it is read (the checksums: train.py's resume)
                raise UsageError(f"checkpoint {step} failed its checks: {damaged}")
            config = step / "config.yaml"
            if not (step / "model_optim" / "metadata.json").is_file() or not config.is_file():
                raise UsageError(
                    f"{path} is not a model checkpoint (not a checkpoint of train.py: a run, "
                    "checkpoints or step folder with model_optim/ and config.yaml; nor an "
                    f"hf-to-mcore import: {MODEL_JSON})")
            raw = yaml.safe_load(config.read_text()) or {}
            state = step / TRAIN_STATE
            base = json.loads(state.read_text()).get("base") if state.is_file() else None
            found = ModelCheckpoint(f"train.py {step.name}", path, step, step / "model_optim",
                                    config_from_dict(raw.get("model") or {}), raw,
                                    _hf_files(step), base, _lora_of(raw.get("model") or {}))
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError) as error:
        raise UsageError(f"checkpoint {path} is unreadable: {error}") from None
    check_dist_checkpoint(found.weights)
    return found


def _lora_of(model_section: dict):
    """The ``LoRAConfig`` a stored run config's model section names (``peft: lora`` or
    ``dora``), else None.

    Raises:
        ValueError: its ``lora`` settings do not build (the stored config was edited).
    """
    from models.lora import METHODS, read_settings

    if model_section.get("peft") not in METHODS:
        return None
    problems: list[str] = []
    found = read_settings(model_section["peft"], model_section.get("lora"), problems)
    if found is None:
        raise ValueError("; ".join(problems))
    return found


def weights_fingerprint(folder: str | Path) -> str:
    """A short hash of a dist checkpoint folder: every file's relative name and size, and the
    bytes of its metadata files (what a frozen base is recognised by)."""
    import hashlib

    folder, digest = Path(folder), hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = file.relative_to(folder).as_posix()
        digest.update(f"{name}:{file.stat().st_size}".encode())
        if not name.endswith(".distcp"):
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def check_fit(cfg, weights: str | Path, name: str | Path | None = None) -> None:
    """Before the model of ``cfg`` is built: every tensor of the dist checkpoint ``weights`` that
    the model has is of the shape ``cfg`` declares (a meta-device model's sharded state dict
    against the checkpoint's metadata), so that a model config declaring more than its weights
    hold (a ``vocab_size`` of 2**40) is refused before anything is allocated.

    Raises:
        UsageError: the first tensor of another shape (one line: the checkpoint, the key, both
            shapes).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from models.checkpointing import dist_load
    from models.families import meta_model

    held = dist_load.read_metadata(weights).state_dict_metadata

    def tensors(entries):
        for entry in nested_values(entries):
            if isinstance(entry, ShardedTensorFactory):
                yield from tensors(entry.build())
            elif isinstance(entry, ShardedTensor):
                yield entry

    for entry in tensors(meta_model(cfg).sharded_state_dict()):
        size = getattr(held.get(entry.key), "size", None)
        if size is not None and tuple(size) != tuple(entry.global_shape):
            raise UsageError(f"checkpoint {name or weights}: its model config declares "
                             f"{entry.key} of shape {tuple(entry.global_shape)}, its weights hold "
                             f"{tuple(size)}: the config does not belong to these weights "
                             "(nothing was allocated)")


def _held(sharded: dict, keys: set[str]) -> dict:
    """The entries of a sharded state dict whose checkpoint key ``keys`` holds."""
    return {name: entry for name, entry in sharded.items()
            if getattr(entry, "key", None) is None or entry.key in keys}


def load_weights(model, weights: str | Path, name: str | Path | None = None, *,
                 partial: bool = False) -> set[str]:
    """Load the dist checkpoint folder ``weights`` into ``model`` (built at this process's
    layout), every pickle in it read by the restricted unpicklers
    (``models.checkpointing.dist_load``: checked first, then loaded through them). ``partial``: only
    the weights the checkpoint holds (one that holds only what trains); the others keep their
    values. Returns the keys it held.

    Raises:
        UsageError: a refused pickle, or weights that do not load into ``model`` (``name``: the
            checkpoint as messages name it; default ``weights``).
    """
    from models.checkpointing import dist_load

    dist_load.check_dist_checkpoint(weights)
    try:
        sharded = model.sharded_state_dict()
        if partial:
            sharded = _held(sharded, set(dist_load.read_metadata(weights).state_dict_metadata))
        state = dist_load.load(sharded, weights)
        model.load_state_dict(state, strict=False)
    except UsageError:
        raise
    except Exception as error:  # noqa: BLE001 - any load failure is a bad checkpoint
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UsageError(f"checkpoint {name or weights} does not load into its "
                         f"{model.cfg.family} model: {type(error).__name__}: {first[:300]}"
                         ) from error
    return set(state)


def base_folder(base: dict, checkpoint: Path, moved_to: str | Path | None = None) -> Path:
    """The folder of a checkpoint's recorded base (an HF model folder or a dist checkpoint):
    ``moved_to`` (where the base is now: ``--base`` of the export and eval.py) or the recorded
    place, the first that holds the weights the recorded fingerprint names (by content:
    ``models.hf.source.same_model``; a dist checkpoint by ``weights_fingerprint``), so a copy,
    a restore or the same snapshot on another node loads.

    Raises:
        UsageError: no place holds that base (one line naming each place and what it holds).
    """
    from models.hf.source import HFSourceError, resolve, same_model

    recorded = base.get("hf") or base.get("init_checkpoint")
    tried = []
    for place in ([moved_to] if moved_to else []) + [recorded]:
        try:
            if "hf" in base:
                folder = resolve(str(place), weights=True)
                found, now = same_model(base.get("fingerprint"), folder)
            else:
                folder = Path(place)
                now = weights_fingerprint(folder) if folder.is_dir() else None
                found = now is not None and now == base.get("fingerprint")
        except (HFSourceError, OSError):
            found, now = False, None
        if found:
            return folder
        tried.append(f"{place} {'is gone' if now is None else f'holds other weights ({now})'}")
    raise UsageError(f"checkpoint {checkpoint} holds only what trains on the base "
                     f"{base.get('fingerprint')}: {'; '.join(tried)}: restore the base, or name "
                     "where it is now with --base (models.convert mcore-to-hf, eval.py)")


def _check_fits(found: ModelCheckpoint, base: Path | None) -> None:
    """The shapes ``found``'s model config declares against its weights and its base's, before
    the model is built (``check_fit``, ``models.checkpointing.sharding.check_hf_fit``)."""
    cfg = found.model_config
    if base is not None and "hf" in found.base:
        from models.checkpointing.sharding import check_hf_fit

        try:
            check_hf_fit(cfg, base)
        except UsageError as error:
            raise UsageError(f"checkpoint {found.path}: base: {error}") from None
    elif base is not None:
        check_fit(cfg, base)
    check_fit(cfg, found.weights, found.path)


def _load_base(model, found: ModelCheckpoint, folder: Path) -> None:
    """The recorded base's weights (in ``folder``) into ``model`` (HF weights mapped, or a dist
    checkpoint)."""
    if "hf" in found.base:
        from models.checkpointing.sharding import load_hf_weights

        try:
            load_hf_weights(model, found.model_config, folder)
        except UsageError as error:
            raise UsageError(f"checkpoint {found.path}: base: {error}") from None
    else:
        load_weights(model, folder)


def load_model(found: ModelCheckpoint, use_te: bool | None = None, merge: bool = True,
               base: str | Path | None = None):
    """The model of ``found``'s config built at this process's TP / PP (``init_parallel``
    first) with every weight of the checkpoint loaded, in eval mode: for a checkpoint that
    holds only what trains, its base first (``base``: where it is now, when moved:
    ``base_folder``); a LoRA run's adapters merged into the base weights (``merge``; at TP = 1).

    Raises:
        UsageError: the weights do not load into the model, or one is missing (one line).
    """
    from models.families import PARAMETER_GROUPS, family_of
    from models.lora import add_adapters, is_adapter_key, merge_adapters

    folder = base_folder(found.base, found.path, base) if found.base is not None else None
    _check_fits(found, folder)
    model = build_model(found.model_config, use_te=use_te)
    if folder is not None:
        _load_base(model, found, folder)
    if found.lora is not None:
        add_adapters(model, found.lora, family_of(found.model_config).parameter_group)
    state = load_weights(model, found.weights, found.path, partial=found.base is not None)
    group = family_of(found.model_config).parameter_group
    frozen = {g for g in PARAMETER_GROUPS if (found.run_config or {}).get("model", {}).get(
        f"freeze_{g}")} if found.base is not None else set()
    missing = [k for k in model.state_dict() if not k.endswith("_extra_state") and k not in state
               and (is_adapter_key(k) or group(k) not in frozen)]
    if missing:
        raise UsageError(f"checkpoint {found.path} lacks {missing[0]!r}")
    if found.lora is not None and merge:
        merge_adapters(model)
    return model.eval()


def load_checkpoint(path: str | Path, use_te: bool | None = None):
    """(model, model config) of the checkpoint at ``path`` (``read_checkpoint``, then
    ``load_model``)."""
    found = read_checkpoint(path)
    return load_model(found, use_te=use_te), found.model_config
