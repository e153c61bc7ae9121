"""What a dataset's YAML may say: every file the loader reads is data, never code.

Energon instantiates what its YAML names: a mapping with ``__module__`` and ``__class__`` /
``__function__`` is imported and called wherever it stands (the dataset class of
``.nv-meta/dataset.yaml``, any of its arguments such as ``decoder``, a subflavor value, a
metadataset's class or a join's ``joiner``), and a ``dataset.yaml`` may name Python files of the
dataset folder that Energon executes (``sample_loader: x.py:fn``, ``part_filter``). Datasets are
downloaded and shared, so ``check_dataset_files(path)`` reads, before Energon does and with
Energon's own YAML parser, every YAML / JSON file Energon reads for ``path`` (a metadataset,
through all its members and nested metadatasets, or a dataset folder), and accepts only:

- a metadataset: ``__module__: megatron.energon``, ``__class__: MetadatasetV2`` and ``splits``,
  each split a ``blend`` / ``blend_epochized`` of members or one member; a member's keys are
  ``path`` (a local dataset folder or metadataset YAML), ``split_part``, ``subflavors``, ``weight``
  / ``repetitions`` (a positive finite number: 0, a negative, NaN, inf or text is refused, to
  leave a subset out its member is deleted), ``subset`` and ``shuffle_over_epochs_multiplier``,
  their values plain data;
- a dataset folder's ``.nv-meta/dataset.yaml``: exactly the project's (``DATASET_YAML``:
  ``ConversationWebdataset`` of ``ConversationSample``), or that of format-1 conversions
  (``CrudeWebdataset``, nothing else); its ``split.yaml`` (``split.json``) and ``.info.json``
  (``.info.yaml``): plain data.

Anything else (any ``__module__`` / ``__class__`` / ``__function__`` that is not ours, another
key, a join, auxiliary datasets, another ``dataset_config`` / ``split_config``, a JSONL or remote
dataset) is refused with one ``UsageError`` line naming the file and the key. Every loader of the
project calls it (``energon_tasks.loader``), as do ``inspect`` / ``preview``, train.py's and
eval.py's data check (``recipes.data.check_data_path``) and the converters' finalize (its own
output).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from contract.errors import UsageError
from energon_tasks.sample_format import DATASET_YAML

#: the keys by which Energon's config parser names code
CODE_KEYS = ("__module__", "__class__", "__function__")
#: the one metadataset class accepted (what the converters write)
METADATASET_HEAD = {"__module__": "megatron.energon", "__class__": "MetadatasetV2"}
#: the dataset.yaml of format-1 conversions (``energon prepare --sample-type CrudeWebdataset``)
FORMAT1_DATASET_YAML = {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
#: the keys of a metadataset member (Energon's ``DatasetReference`` less the code / file ones)
MEMBER_KEYS = ("path", "split_part", "subflavors", "subset", "shuffle_over_epochs_multiplier")
#: blend kind -> the member key of its share
BLENDS = {"blend": "weight", "blend_epochized": "repetitions"}
SPLIT_KEYS = ("split_parts", "exclude")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)
_WHY = "refused, a dataset's YAML is data and names no code (docs/format.md)"


def check_dataset_files(path: str | Path) -> None:
    """Every YAML / JSON file Energon would read for ``path`` (a dataset folder or a metadataset
    YAML) holds only what the project's datasets hold (see the module docstring).

    Raises:
        UsageError: the first file and key that is not accepted, or a file that cannot be read
            (one line).
    """
    _check_path(Path(path), frozenset(), "")


def _refuse(file: Path, where: str, problem: str) -> UsageError:
    return UsageError(f"{file}: {where}: {problem}" if where else f"{file}: {problem}")


def _named_code(value: Any) -> str | None:
    """``module.name`` a mapping names through Energon's code keys, or None."""
    if not isinstance(value, dict) or not any(key in value for key in CODE_KEYS):
        return None
    name = value.get("__class__", value.get("__function__", "?"))
    return f"{value.get('__module__', '?')}.{name}"


def _code_refusal(file: Path, where: str, value: dict) -> UsageError:
    return _refuse(file, where, f"names code ({_named_code(value)}): {_WHY}")


def _plain(file: Path, where: str, value: Any) -> None:
    """``value`` is plain data: no mapping in it names code."""
    if isinstance(value, dict):
        if _named_code(value):
            raise _code_refusal(file, where, value)
        for key, item in value.items():
            _plain(file, f"{where}.{key}" if where else str(key), item)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _plain(file, f"{where}[{index}]", item)


def _keys(file: Path, where: str, mapping: Any, accepted: tuple[str, ...], what: str) -> dict:
    """``mapping`` is a mapping of the ``accepted`` keys whose values are plain data."""
    if not isinstance(mapping, dict):
        raise _refuse(file, where, f"is not a mapping ({what})")
    if _named_code(mapping):
        raise _code_refusal(file, where, mapping)
    for key, value in mapping.items():
        inner = f"{where}.{key}" if where else str(key)
        if key not in accepted:
            if _named_code(value):
                raise _code_refusal(file, inner, value)
            raise _refuse(file, inner, f"is not accepted in {what} (accepted: "
                                       f"{', '.join(accepted)}): {_WHY}")
        _plain(file, inner, value)
    return mapping


def _read(file: Path) -> Any:
    """A YAML file as Energon parses it (its rapidyaml reader), or a JSON file."""
    try:
        data = file.read_bytes()
        if file.suffix == ".json":
            return json.loads(data)
        from megatron.energon.eyaml import load_yaml

        return load_yaml(data)
    except Exception as error:  # noqa: BLE001 - any parse failure: not a file we can accept
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise _refuse(file, "", f"cannot be read ({type(error).__name__}: {first[:160]})"
                      ) from None


def _check_path(path: Path, seen: frozenset[Path], named_by: str) -> None:
    """A dataset folder or a metadataset YAML (``named_by``: the member key that named it)."""
    by = f" (named by {named_by})" if named_by else ""
    if path.is_file():
        if path.suffix != ".yaml":
            raise UsageError(f"{path}{by}: only converted dataset folders and metadataset YAMLs "
                             "are read (not a JSONL or other file)")
        _check_metadataset(path, seen)
    elif path.is_dir():
        _check_dataset_folder(path, by)
    else:
        raise UsageError(f"{path}{by} does not exist")


def _check_metadataset(file: Path, seen: frozenset[Path]) -> None:
    real = file.resolve()
    if real in seen:
        raise _refuse(file, "", "a member leads back to this metadataset (a cycle)")
    seen = seen | {real}
    doc = _read(file)
    if not isinstance(doc, dict):
        raise _refuse(file, "", "is not a metadataset (not a mapping)")
    for key in CODE_KEYS:
        if doc.get(key) != METADATASET_HEAD.get(key):
            raise _refuse(file, key, f"{doc.get(key)!r} is not {METADATASET_HEAD.get(key)!r} "
                                     f"(names code: {_named_code(doc)}): only Energon's "
                                     f"MetadatasetV2 is accepted: {_WHY}")
    for key in doc:
        if key not in (*METADATASET_HEAD, "splits"):
            if _named_code(doc[key]):
                raise _code_refusal(file, key, doc[key])
            raise _refuse(file, key, f"is not accepted in a metadataset (accepted: "
                                     f"__module__, __class__, splits): {_WHY}")
    splits = doc.get("splits")
    if not isinstance(splits, dict) or not splits:
        raise _refuse(file, "splits", "is not a mapping of splits")
    for name, split in splits.items():
        where = f"splits.{name}"
        kinds = [kind for kind in BLENDS if isinstance(split, dict) and kind in split]
        if not kinds:
            _check_member(file, where, split, (), seen)
            continue
        kind = kinds[0]
        _keys(file, where, split, (kind, "subset"), f"a {kind}")
        if not isinstance(split[kind], list):
            raise _refuse(file, f"{where}.{kind}", "is not a list of members")
        for index, member in enumerate(split[kind]):
            _check_member(file, f"{where}.{kind}[{index}]", member, (BLENDS[kind],), seen)


def _check_member(file: Path, where: str, member: Any, share: tuple[str, ...],
                  seen: frozenset[Path]) -> None:
    _keys(file, where, member, (*MEMBER_KEYS, *share), "a metadataset member")
    for key in share:
        if key in member:
            _check_share(file, f"{where}.{key}", member[key])
    path = member.get("path")
    if not isinstance(path, str) or not path:
        raise _refuse(file, f"{where}.path", "is missing (a dataset folder or metadataset YAML)")
    if _URL.match(path):
        raise _refuse(file, f"{where}.path", f"{path!r} is remote: only local datasets are read")
    for key in ("subflavors", "subset"):
        if member.get(key) is not None and not isinstance(member[key], dict):
            raise _refuse(file, f"{where}.{key}", "is not a mapping")
    _check_path(file.parent / path, seen, f"{file}: {where}.path")


def _check_share(file: Path, where: str, value: Any) -> None:
    """A member's ``weight`` / ``repetitions`` (as Energon reads it) is a positive finite number:
    Energon refuses 0 and negative weights, and fails on text (``.nan`` is text to it) only once
    the model is built."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):
        raise _refuse(file, where, f"{value!r} is not a positive finite number: Energon blends "
                                   "by positive shares; to leave this subset out, delete its "
                                   "member from the blend")


def _expect(file: Path, where: str, doc: Any, expected: dict) -> None:
    """``doc`` is exactly ``expected`` (nested mappings compared key by key)."""
    if not isinstance(doc, dict):
        raise _refuse(file, where, f"is not a mapping ({expected})")
    for key in CODE_KEYS:  # first: the code the mapping names, if it is not ours
        if doc.get(key) != expected.get(key):
            raise _refuse(file, f"{where}.{key}" if where else key,
                          f"{doc.get(key)!r} is not {expected.get(key)!r} (names code: "
                          f"{_named_code(doc)}): only the project's dataset and sample classes "
                          f"are accepted: {_WHY}")
    for key, value in doc.items():
        inner = f"{where}.{key}" if where else str(key)
        if key not in expected:
            if _named_code(value):
                raise _code_refusal(file, inner, value)
            raise _refuse(file, inner, "is not accepted: the dataset class takes no argument "
                                       f"from the data: {_WHY}")
        if isinstance(expected[key], dict):
            if value != expected[key] and _named_code(value):
                raise _code_refusal(file, inner, value)
            _expect(file, inner, value, expected[key])
        elif value != expected[key]:
            raise _refuse(file, inner, f"{value!r} is not {expected[key]!r}: {_WHY}")
    missing = [key for key in expected if key not in doc]
    if missing:
        raise _refuse(file, f"{where}.{missing[0]}" if where else missing[0],
                      f"is missing (expected {expected[missing[0]]!r})")


def _check_dataset_folder(folder: Path, by: str) -> None:
    meta = folder / ".nv-meta"
    dataset_yaml = meta / "dataset.yaml"
    if not dataset_yaml.is_file():
        raise UsageError(f"{folder}{by} is not a converted dataset (no .nv-meta/dataset.yaml)")
    doc = _read(dataset_yaml)
    format1 = isinstance(doc, dict) and all(doc.get(k) == v for k, v in
                                            FORMAT1_DATASET_YAML.items())
    _expect(dataset_yaml, "", doc, FORMAT1_DATASET_YAML if format1 else DATASET_YAML)
    splits = [meta / name for name in ("split.yaml", "split.json") if (meta / name).is_file()]
    for split in splits:
        _keys(split, "", _read(split), SPLIT_KEYS, "a split file")
    for name in (".info.json", ".info.yaml"):
        if (meta / name).is_file():
            _plain(meta / name, "", _read(meta / name))
