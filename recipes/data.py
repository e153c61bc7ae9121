"""What train.py and eval.py check of their inputs before a model is built.

This module owns ``load_run_tokenizer`` (the run's tokenizer; ``tokenizer: test`` built into the
run folder), ``check_data_path`` / ``check_split`` (a missing dataset, or split, of a dataset or a
metadataset blend) and ``probe_first_batch`` (one batch comes out with the run's budget, or the
skip reasons are counted in the message). Every problem is one ``UsageError`` line.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from contract.errors import RunFailure, UsageError

if TYPE_CHECKING:
    from energon_tasks.config import TaskEncoderConfig
    from energon_tasks.task_encoder import VLMTaskEncoder


def load_run_tokenizer(te_cfg: TaskEncoderConfig, run_folder: Path, *, builds: bool = True,
                       wait=lambda: None):
    """The tokenizer of ``task_encoder.tokenizer`` (a hub id or folder; default: the model's).
    ``tokenizer: test``, the small local BPE of the tests and the CPU demo, is built into
    ``run_folder/tokenizer`` (by the process that ``builds``; every process calls ``wait`` before
    reading it), so the run keeps the tokenizer it used.

    Raises:
        UsageError: the tokenizer cannot be loaded or lacks the family's special tokens.
    """
    from energon_tasks.tokenizer import build_test_tokenizer, load_tokenizer

    name = te_cfg.resolve().tokenizer
    if te_cfg.tokenizer == "test":
        name = str(run_folder / "tokenizer")
        if builds:
            build_test_tokenizer(name)
        wait()
    try:
        return load_tokenizer(name, te_cfg.model)
    except ValueError as error:
        raise UsageError(str(error)) from None


def check_data_path(path: str) -> None:
    """Raises UsageError when ``data.path`` is unset, missing, not an Energon dataset (each
    naming how to make one: ``make prepare-<dataset>``, ``DATA=`` / ``DATA_ROOT=``), a
    metadataset that is not bounded YAML (``contract.bounded_yaml``), or any file Energon would
    read for it names code, holds what the project's datasets do not or a blend share that is
    not a positive number (``energon_tasks.dataset_files``)."""
    if not path:
        raise UsageError(f"data.path is not set: {_how_to_get_data()}")
    p = Path(path)
    if not p.exists():
        raise UsageError(f"data.path {path} does not exist: {_how_to_get_data(p)}")
    if p.is_dir() and not (p / ".nv-meta" / "dataset.yaml").is_file():
        if (p / "metadataset.yaml").is_file():
            raise UsageError(f"data.path {path} is a converter output folder: "
                             f"use {p / 'metadataset.yaml'}")
        if not any(p.iterdir()):
            raise UsageError(f"data.path {path} is an empty folder: {_how_to_get_data(p)}")
        raise UsageError(f"data.path {path} is not an Energon dataset (no .nv-meta/"
                         "dataset.yaml): a source dataset (a hub download) is converted first: "
                         f"{_prepare_hint(p, source=True)} writes data/<dataset>; train on its "
                         "metadataset.yaml")
    from energon_tasks.dataset_files import check_dataset_files

    check_dataset_files(path)
    if p.is_file():
        _read_metadataset(p)  # bounded (Energon's own reader leaves aliases unexpanded)


def _datasets() -> dict[str, str]:
    """The datasets ``python -m converters`` (``make prepare-<dataset>``) converts, each with
    its default hub source (``--source``)."""
    from converters.__main__ import cli

    return {name: next((p.default for p in command.params if p.name == "source"), "")
            for name, command in cli.commands.items() if name != "finalize"}


def _prepare_hint(p: Path, source: bool = False) -> str:
    """The ``make prepare-<dataset>`` line that makes a dataset (``SOURCE=p``: convert the
    source folder ``p``): the dataset the path names (a converted dataset's folder, or a hub
    download of its source: ``Mantis-Instruct``, ``datasets--TIGER-Lab--Mantis-Instruct``),
    else each."""
    datasets = _datasets()
    parts = [part.lower() for part in p.parts]
    named = [name for name, hub in datasets.items()
             if (not source and name in (p.name, p.parent.name))
             or (source and hub and {hub.split("/")[-1].lower(),
                                     f"datasets--{hub.replace('/', '--')}".lower()} & set(parts))]
    target = f"make prepare-{named[0]}" if named else \
        f"make prepare-<dataset> ({', '.join(datasets)})"
    return f"{target} SOURCE={p}" if source else target


def _how_to_get_data(p: Path | None = None) -> str:
    """How to get a dataset: convert one (``make prepare-<dataset>``), or point at one."""
    return (f"convert one with {_prepare_hint(p or Path())} (it writes "
            "data/<dataset>/metadataset.yaml), or give DATA=<dataset folder or "
            "metadataset.yaml> / DATA_ROOT=<folder of converted datasets> (make demo writes "
            "demo_out)")


def _read_metadataset(p: Path) -> dict:
    """A metadataset YAML as a mapping (``contract.bounded_yaml``).

    Raises:
        UsageError: unreadable, not YAML, past the bounds, or not a mapping (one line).
    """
    import yaml

    from contract.bounded_yaml import safe_load

    try:
        doc = safe_load(p.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UsageError(f"data path {p} is unreadable ({first})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"data path {p} is not a metadataset (not a mapping)")
    return doc


def check_split(path: str, split: str, needed_by: str = "") -> None:
    """The dataset folder / metadataset must declare the split part (before anything is built).

    Raises:
        UsageError: a missing or unreadable path, or no such split (the message lists those
            there are, and names ``needed_by``: the setting that asks for the split).
    """
    import yaml

    from contract.bounded_yaml import safe_load

    p = Path(path)
    if not p.exists():
        raise UsageError(f"data path {path} does not exist")
    if p.is_file():
        splits = _read_metadataset(p).get("splits")
        splits = splits if isinstance(splits, dict) else {}
    else:
        try:
            meta = p / ".nv-meta" / "split.yaml"
            if not meta.is_file():
                raise UsageError(f"{path} is not an Energon dataset (no .nv-meta/split.yaml)")
            splits = (safe_load(meta.read_text()) or {}).get("split_parts") or {}
        except (OSError, yaml.YAMLError, AttributeError) as error:
            raise UsageError(f"data path {path} is unreadable ({error})") from None
    if not splits.get(split):
        have = ", ".join(sorted(k for k in splits if "/" not in k)) or "none"
        hint = f" for {needed_by} (set it to 0 or name another split)" if needed_by else ""
        raise UsageError(f"dataset {path} has no {split!r} split{hint} (splits: {have})")


def split_samples(path: str, split_part: str) -> int | None:
    """The samples of ``split_part`` as the dataset's ``.nv-meta`` counts them (a metadataset:
    its members' sum; a sanity bound, not a count to trust), or None when it cannot tell."""
    import json

    import braceexpand
    import yaml

    from contract.bounded_yaml import safe_load

    p = Path(path)
    if p.is_file():
        split = (_read_metadataset(p).get("splits") or {}).get(split_part)
        if not isinstance(split, dict):
            return None
        members = split.get("blend") or split.get("blend_epochized") or [split]
        counts = [split_samples(str(p.parent / m["path"]), m.get("split_part", split_part))
                  if isinstance(m, dict) and isinstance(m.get("path"), str) else None
                  for m in members]
        return None if None in counts else sum(counts)
    meta = p / ".nv-meta"
    try:
        info = (json.loads((meta / ".info.json").read_text()) if (meta / ".info.json").is_file()
                else safe_load((meta / ".info.yaml").read_text()))
        patterns = safe_load((meta / "split.yaml").read_text())["split_parts"][split_part]
        shards = info["shard_counts"]
        return sum(int(shards[name]) for pattern in patterns
                   for name in braceexpand.braceexpand(pattern))
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None


def _blend_members(path: str, split_part: str) -> list[tuple[str, str]]:
    """(dataset, split part) of each member of a metadataset blend (weighted blends cannot be
    read once without repeat); the path itself for a dataset folder or another layout."""
    p = Path(path)
    if p.is_file():
        try:
            blend = _read_metadataset(p)["splits"][split_part]["blend"]
            return [(str(p.parent / m["path"]), m.get("split_part", split_part)) for m in blend]
        except (KeyError, TypeError):
            pass
    return [(path, split_part)]


def probe_first_batch(path: str, split_part: str, task_encoder: VLMTaskEncoder) -> str | None:
    """Read the dataset once, member by member (no repeat, no shuffle), until one batch comes
    out (the data side's one-pass reader: damaged samples are skipped as in training). Returns
    a warning line when the budget dropped every image and video of the samples read (the run
    would train the VLM on text), else None.

    Raises:
        UsageError: the dataset cannot be loaded, is empty, or the budget skips every sample
            (the skip reasons are counted in the message).
    """
    from energon_tasks.loader import get_pass_loader

    try:
        for member, part in _blend_members(path, split_part):
            for batch in get_pass_loader(member, task_encoder=task_encoder, split_part=part):
                return _text_only_warning(batch, task_encoder.counters())
    except (UsageError, RunFailure):
        raise
    except Exception as error:  # noqa: BLE001 - energon raises many kinds; report in one line
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UsageError(f"data.path {path}: cannot load split {split_part!r}: "
                         f"{type(error).__name__}: {first}") from None
    counters = task_encoder.counters()
    skipped = {k: v for k, v in sorted(counters.items()) if k.startswith("skipped_")}
    if not counters.get("samples"):
        raise UsageError(f"data.path {path}: split {split_part!r} has no samples")
    if sum(skipped.values()) < counters["samples"]:  # not the budget: the batches failed
        raise UsageError(f"data.path {path}: no batch came out of the {counters['samples']} "
                         f"samples of split {split_part!r} ({sum(skipped.values())} skipped by "
                         "the budget): their batches failed (the errors above)")
    raise UsageError(f"data.path {path}: all {counters['samples']} samples are skipped by the "
                     f"budget ({', '.join(f'{k}={v}' for k, v in skipped.items())}); raise "
                     "task_encoder.seq_length / max_visual_tokens / max_num_images")


def _text_only_warning(batch, counters: dict[str, int]) -> str | None:
    """The warning of a first batch without an image or video whose samples' media the budget
    dropped (``energon_tasks.budget.MEDIA_DROPS``), else None."""
    from energon_tasks.budget import media_dropped

    dropped = media_dropped(counters)
    if len(batch.image_grid_thw) or len(batch.video_grid_thw) or not dropped:
        return None
    return (f"warning: the budget dropped every image and video of the first "
            f"{counters.get('samples', 0)} sample(s) read "
            f"({', '.join(f'{k} {v}' for k, v in dropped.items())}): the model would train on "
            "their text only; raise task_encoder.max_visual_tokens / max_num_images / "
            "seq_length (the step lines say 'text only' while it lasts)")
