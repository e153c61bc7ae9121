"""The export of a model checkpoint (an import folder, or a train.py run / step folder) as a
Hugging Face folder: the merged model transformers loads (``mcore_to_hf``), or a LoRA run's PEFT
adapter folder peft loads onto the base (``write_peft_folder``); ``python -m models.convert
mcore-to-hf`` runs it.

This module owns where an export may be written (``check_out``) and how (``export_folder``):

- ``--out`` is never the checkpoint (an import folder, a step folder, the run folder given), a
  folder inside the checkpoint or one holding it (a new folder inside a run folder is fine), and
  never the frozen base a checkpoint that holds only what trains loads (a LoRA run's
  ``model.hf`` or ``train.init_checkpoint``): writing there would overwrite what the checkpoint
  needs;
- ``--out`` is a new or empty folder, or a previous export of this command (its ``EXPORT_RECORD``
  says so) replaced with ``--overwrite``; any other folder with files is refused (stale files of
  another save, e.g. an ``adapter_config.json``, would be loaded with the export);
- everything is written into a sibling ``<out>.partial-<pid>`` folder, renamed to ``--out`` when
  complete (a previous export moved aside first, then deleted): a failure leaves ``--out`` as it
  was, and a full disk (or quota, or file-size limit) is one line (``RunFailure``, exit 1) with the
  partial folder removed.

The export's ``config.json`` is the source's without ``auto_map``: that key names Python files
of the source repository (remote code), which no export ships (nothing is executed from a model
folder here, and the families are transformers' own classes).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from contract.errors import RunFailure, UsageError, disk_full
from models.families import config_module, mapping_module
from models.families import get as get_family

#: written into every export (last): what it was exported from; ``--overwrite`` replaces only
#: a folder that holds it
EXPORT_RECORD = "export_record.json"
#: config.json keys an export drops (``auto_map``: the source repository's remote code)
DROPPED_KEYS = ("auto_map",)


def _related(a: Path, b: Path) -> bool:
    """``a`` and ``b`` are the same folder, or one is inside the other (symlinks resolved)."""
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def _base_folders(found, moved_to: Path | None) -> list[Path]:
    """The folders of the frozen base ``found`` refers to: where it was recorded (its
    ``model.hf`` folder or ``train.init_checkpoint``, if there) and ``moved_to``."""
    from models.hf.source import HFSourceError, resolve

    base, folders = found.base or {}, [moved_to] if moved_to else []
    try:
        if "hf" in base:
            folders.append(resolve(base["hf"], weights=False))
    except HFSourceError:
        pass
    if "init_checkpoint" in base:
        folders.append(Path(base["init_checkpoint"]))
    return folders


def check_out(out: Path, found, overwrite: bool, base: Path | None = None) -> None:
    """Where an export of ``found`` (a ``ModelCheckpoint``) may be written (module docstring);
    ``base``: where its base is now, when moved (``--base``).

    Raises:
        UsageError: ``out`` is the checkpoint, inside it or holding it, or the run's base; or a
            folder with files that is not a previous export (or is one, without
            ``overwrite``); one line each.
    """
    out = Path(out)
    given = Path(found.path).resolve()  # a run folder: a new folder inside it is fine
    if (any(_related(out, Path(place)) for place in (found.folder, found.weights))
            or given == out.resolve() or out.resolve() in given.parents):
        raise UsageError(f"--out {out}: is the checkpoint {found.folder}, inside it or holds "
                         "it: choose a folder outside the checkpoint")
    for folder in _base_folders(found, base):
        if _related(out, folder):
            raise UsageError(f"--out {out}: is the base {folder} that the checkpoint "
                             f"{found.path} holds only the trained part of (writing there would "
                             "overwrite the weights its checkpoints need): choose another folder")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / EXPORT_RECORD).is_file():
        raise UsageError(f"--out {out}: a folder with files that is not an export of "
                         "models.convert (no export_record.json): choose a new or empty folder")
    if not overwrite:
        raise UsageError(f"--out {out}: holds a previous export: add --overwrite to replace it "
                         "(as a whole), or choose another folder")


@contextmanager
def export_folder(out: Path) -> Iterator[Path]:
    """A new folder to write the export into, renamed to ``out`` when the block ends without an
    error (a previous export there moved aside first, then deleted); removed otherwise.

    Raises:
        RunFailure: a write failed for lack of space, a quota or a file-size limit (one line;
            ``out`` is as it was).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.mkdir()
        yield work
        if out.exists():
            aside = out.with_name(f"{out.name}.replaced-{os.getpid()}")
            out.rename(aside)
            work.rename(out)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            work.rename(out)
    except OSError as error:
        shutil.rmtree(work, ignore_errors=True)
        if not disk_full(error):
            raise
        free = shutil.disk_usage(out.parent).free / 2**30
        raise RunFailure(f"writing the export {out} failed ({error.strerror}; {free:.1f} GiB "
                         f"free there): {out} is as it was; free space and export again"
                         ) from None
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def mcore_to_hf(mcore: Path, out: Path, adapter: bool = False, overwrite: bool = False,
                base: Path | None = None) -> None:
    """Write an HF model folder (config.json, model.safetensors, tokenizer and processor files,
    generation_config.json) from an import folder or a train.py run / step folder, whatever TP /
    PP / EP it was saved with (loaded here at TP = PP = EP = 1). A run that named no HF model:
    config.json made from our config with the bos / eos / pad ids of the tokenizer it recorded,
    a generation config with that eos, the family's processor files from the run's
    ``task_encoder`` pixel settings (``processor_files``). A LoRA run's adapters are merged into
    the weights (W + alpha / r * B @ A; DoRA's rows then rescaled to their magnitude:
    ``models.lora``), and what it trained in full is written as trained; ``adapter``: write its
    HF PEFT folder instead (``write_peft_folder``). Where and how it is written: ``check_out``,
    ``export_folder``. ``base``: where the base of a checkpoint that holds only what trains is
    now, when it moved (``models.checkpointing.checkpoint.base_folder``).

    Raises:
        UsageError: not a checkpoint, ``--adapter`` of a run without LoRA, or an ``out`` that
            ``check_out`` refuses (one line, before anything is loaded).
        RunFailure: a full disk (``export_folder``).
    """
    from models.checkpointing.checkpoint import load_model, read_checkpoint
    from models.hf.weights import is_our_key
    from models.parallel import init_parallel

    found = read_checkpoint(mcore)  # a bad folder: one line, before any process group
    if adapter and found.lora is None:
        raise UsageError(f"--adapter: {mcore} is not a checkpoint of a LoRA run (model.peft=lora "
                         "or dora); export it without --adapter")
    check_out(out, found, overwrite, base)
    init_parallel()
    model = load_model(found, use_te=False, merge=not adapter, base=base)
    sd = {k: v.detach() for k, v in model.state_dict().items() if is_our_key(k)}
    with export_folder(out) as work:
        if adapter:
            write_peft_folder(work, sd, found)
        else:
            write_merged_folder(work, sd, found)
        (work / EXPORT_RECORD).write_text(json.dumps(
            {"exported_from": str(mcore), "kind": "peft adapter" if adapter else "merged model",
             "checkpoint": found.kind, "time": time.time()}, indent=2))


def write_merged_folder(out: Path, sd: dict[str, torch.Tensor], found) -> None:
    """The merged model's HF folder (``mcore_to_hf``) into the existing folder ``out``."""
    from models.checkpointing.checkpoint import CARRIED, EXPERTS_LAYOUT, HF_JSON
    from models.hf.source import (
        PROCESSOR_FILES,
        SPECIAL_IDS,
        TOKENIZER_FILES,
        copy_files,
        tokenizer_token_ids,
    )
    from models.hf.weights import write_hf_folder

    cfg, files = found.model_config, found.hf_files
    source = next((p for p in (files and files / "config.json", found.folder / HF_JSON)
                   if p and p.is_file()), None)
    config = (json.loads(source.read_text()) if source is not None
              else config_module(cfg.family).to_hf_dict(cfg))
    for key in DROPPED_KEYS:  # remote code the export does not ship
        config.pop(key, None)
        if isinstance(config.get("text_config"), dict):
            config["text_config"].pop(key, None)
    tokenizer = _recorded_tokenizer(files)
    if source is None and tokenizer is not None:  # the ids of the run's own tokenizer
        ids = tokenizer_token_ids(tokenizer)
        ids = {key: ids.get(key) for key in SPECIAL_IDS}  # None: the tokenizer has none
        config.update(ids)
        config["text_config"].update(ids)
    weights = mapping_module(cfg).ours_to_hf(sd, cfg)
    if files is not None and (files / EXPERTS_LAYOUT).is_file():  # the source's packed experts
        from models.hf.weights import fuse_experts

        layout = json.loads((files / EXPERTS_LAYOUT).read_text()).get("layout", "published")
        weights = fuse_experts(weights, cfg, transformers_layout=layout == "transformers")
    if files is not None and (files / CARRIED).is_file():  # e.g. Qwen3.5's MTP layers
        from safetensors.torch import load_file

        from models.hf.weights import fuse_experts_like

        carried = load_file(str(files / CARRIED))  # unchanged, unless the model holds them
        weights = fuse_experts_like(weights, carried, cfg)  # (model.train_mtp: trained)
        weights.update({k: v for k, v in carried.items() if k not in weights})
    write_hf_folder(out, config, weights)
    copied = copy_files(files, out, TOKENIZER_FILES + PROCESSOR_FILES) if files else []
    if "generation_config.json" not in copied and tokenizer is not None:
        (out / "generation_config.json").write_text(json.dumps(
            {**tokenizer_token_ids(tokenizer), "do_sample": False}, indent=2))  # stops at eos
    if not any(name in copied for name in PROCESSOR_FILES):  # a run that named no HF model
        for name, content in get_family(cfg.family).processor_files(
                cfg, (found.run_config or {}).get("task_encoder") or {}).items():
            (out / name).write_text(json.dumps(content, indent=2))


def _recorded_tokenizer(files: Path | None):
    """The tokenizer a checkpoint recorded (``hf/``), or None."""
    from models.hf.source import TOKENIZER_FILES

    if files is None or not any((files / name).is_file() for name in TOKENIZER_FILES[:2]):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(files))


def write_peft_folder(out: Path, sd: dict[str, torch.Tensor], found) -> None:
    """The HF PEFT folder of a LoRA / DoRA run (``adapter_config.json`` +
    ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained(<the base HF model>,
    out)`` loads: each adapter under the HF names of transformers' modules (a fused q/k/v or
    gate/up adapter split per projection: B's rows and DoRA's magnitude split as the weight's, A
    shared; adapters of our linears that HF fuses into one, as the family's ``fuse_adapters``
    joins them, of the parts' ranks summed: ``rank_pattern`` / ``alpha_pattern``), DoRA's
    magnitude as peft's ``lora_magnitude_vector`` (``use_dora``), and the groups the run trained
    in full as ``modules_to_save`` (``_modules_to_save``)."""
    from models.families import family_of
    from models.hf.weights import save_safetensors
    from models.lora import Factors, adapter_factors

    cfg, lora, mapping = found.model_config, found.lora, mapping_module(found.model_config)
    factors = adapter_factors(sd)
    if any(".experts." in key for key in factors):
        raise UsageError(f"--adapter: {found.folder} adapted MoE experts (model.lora.experts="
                         "true), which have no PEFT folder layout here (transformers' experts are "
                         "fused tensors, not linears): export the merged model (without --adapter)")

    def as_hf(weight_key: str, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """HF module -> its part of ``rows`` (laid out as the weight's rows)."""
        return {k.removesuffix(".weight"): v for k, v in mapping.ours_to_hf(
            {weight_key: rows}, cfg, hub_layout=False, only={weight_key}).items()}

    modules = {}  # HF module -> Factors
    for weight_key, (a, b, magnitude) in factors.items():
        norms = {} if magnitude is None else as_hf(weight_key, magnitude[:, None])
        for module, b_part in as_hf(weight_key, b).items():
            modules[module] = Factors(a, b_part, norms[module][:, 0] if norms else None)
    if hasattr(mapping, "fuse_adapters"):  # adapters of our linears that HF fuses into one
        modules = mapping.fuse_adapters(modules, cfg, sd)
    tensors, targets, ranks = {}, sorted(modules), {}
    for module, (a, b, magnitude) in modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.clone()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        if magnitude is not None:
            tensors[f"base_model.model.{module}.lora_magnitude_vector"] = magnitude.contiguous()
        if a.shape[0] != lora.rank:  # a fused adapter: the parts' ranks stacked
            ranks[module] = a.shape[0]
    model_section = (found.run_config or {}).get("model", {})
    group = family_of(cfg).parameter_group
    trained = {k: v for k, v in sd.items() if "_lora." not in k
               and not model_section.get(f"freeze_{group(k)}", True)}
    saved = mapping.ours_to_hf(trained, cfg, hub_layout=False, only=set(trained)) if trained \
        else {}
    tensors |= {f"base_model.model.{k}": v for k, v in saved.items()}
    Path(out).mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, Path(out) / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": None, "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
              "use_dora": lora.dora, "target_modules": targets,
              # a fused adapter's rank r' keeps the scale alpha / r (alpha' = alpha r' / r)
              "rank_pattern": ranks,
              "alpha_pattern": {m: lora.alpha * r / lora.rank for m, r in ranks.items()},
              "modules_to_save": _modules_to_save(saved) or None,
              "base_model_name_or_path": (found.base or {}).get("hf"),
              "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True}
    (Path(out) / "adapter_config.json").write_text(json.dumps(config, indent=2))


def _modules_to_save(saved: dict[str, torch.Tensor]) -> list[str]:
    """peft's ``modules_to_save`` of these HF weights: the modules holding them, none inside
    another (peft wraps each named module whole, its copy loaded from ``<module>.<param>`` keys;
    a module named inside a wrapped one would be wrapped twice, its weights loaded nowhere)."""
    owners = {key.rsplit(".", 1)[0] for key in saved}
    return sorted(m for m in owners
                  if not any(m.startswith(other + ".") for other in owners))
