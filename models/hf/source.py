"""What a run takes from a Hugging Face model (``model.hf``: a hub id or a local folder).

This module owns where the model's files come from (``resolve``: a local folder as it is, a hub id
through ``huggingface_hub.snapshot_download`` and its cache; an unreachable hub is one line),
what identifies its weights (``fingerprint``: config.json and the weight files' names and
contents, content hashes cached by path, size and time; a cached import is reused only for the
same weights, and a checkpoint's base is recognised wherever its files are), what the model's
own processor files set for the task encoder (``task_encoder_settings``: tokenizer, image /
video pixel limits, Nemotron-Omni video patches, and the patch / merge sizes the geometry must
have) and which of its files travel with checkpoints and exports (``TOKENIZER_FILES``,
``PROCESSOR_FILES``, ``copy_files``), and whether the model's special-token ids fit its tokenizer
(``special_token_problems``: an eos id outside the vocabulary never stops ``generate``;
``tokenizer_token_ids`` for exports).

Pixel settings: each family reads the keys its transformers processors save
(``processor_settings`` of its package, ``models.families``). A processor config may also sit
inside ``processor_config.json`` (``image_processor`` / ``video_processor`` entries); those are
read when the separate files are absent.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from models.families import get as get_family

#: the model's files other than weights: config, tokenizer, processors, chat template
SMALL_FILES = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json"]
#: tokenizer files a checkpoint records and an export ships (those the folder has)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
#: processor files (image / video preprocessing, processor class)
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json",
                   "processor_config.json")


class HFSourceError(ValueError):
    """``model.hf`` cannot be used (one line: what was given, what is wrong)."""


def resolve(source: str, *, weights: bool) -> Path:
    """The local folder of ``source``: the folder itself, or the hub snapshot of that id
    (``snapshot_download``: cached files are reused; ``weights`` adds the safetensors).

    Raises:
        HFSourceError: no such folder and the hub cannot serve the id, or no config.json.
    """
    path = Path(source).expanduser()
    if not path.is_dir():
        if path.exists() or source.startswith((".", "/", "~")) or source.count("/") > 1:
            raise HFSourceError(f"model.hf {source}: not a folder (give an HF model folder or a "
                                "hub id such as Qwen/Qwen2.5-VL-7B-Instruct)")
        from huggingface_hub import snapshot_download

        patterns = SMALL_FILES + (WEIGHT_FILES if weights else [])
        try:
            path = Path(snapshot_download(source, allow_patterns=patterns))
        except Exception as error:  # noqa: BLE001 - any hub failure is a bad model.hf
            first = (str(error).strip().splitlines() or [""])[0]
            raise HFSourceError(f"model.hf {source}: not a local folder, and the hub cannot "
                                f"serve it ({type(error).__name__}: {first}); pass a local "
                                "folder or check the id / network / HF_TOKEN") from None
    if not (path / "config.json").is_file():
        raise HFSourceError(f"model.hf {source}: {path} has no config.json")
    return path


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise HFSourceError(f"{path}: unreadable ({type(error).__name__})") from None


def hf_config(folder: Path) -> dict:
    """The folder's config.json."""
    return read_json(folder / "config.json")


def model_config_of(folder: Path):
    """Our model config of the folder's config.json (the family from its ``model_type``).

    Raises:
        HFSourceError: a model_type no family imports, or a config the family cannot read
            (one line naming the file and the supported families).
    """
    from models.families import config_from_hf

    try:
        return config_from_hf(hf_config(folder))
    except HFSourceError:
        raise
    except (ValueError, TypeError, KeyError) as error:
        raise HFSourceError(f"{folder / 'config.json'}: {error}") from None


def default_import_cache() -> Path:
    """Where imports of ``model.hf`` weights are cached by default: next to the hub cache."""
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "vlm-sft-imports"


#: what a content fingerprint starts with (``fingerprint``); a recorded one without it is the
#: name / size / modification-time fingerprint of earlier versions (``legacy_fingerprint``)
CONTENT = "content-"


def fingerprint(folder: Path) -> str:
    """What the folder's model is, by content: a short hash of config.json's bytes and, for each
    weight file the model is read from (``models.hf.weights.weight_map``: the index's shards, or
    every safetensors file), its name and the sha256 of its bytes (``content_hash``, cached by
    path, size and modification time). No path and no time enters it: the same files copied
    without ``-p``, restored, moved or on another node give the same fingerprint.

    Raises:
        HFSourceError: the weight files cannot be told (``weight_map``'s one line).
    """
    from models.hf.weights import weight_map

    try:
        files = sorted({file for file, _shape in weight_map(folder).values()})
    except ValueError as error:
        raise HFSourceError(str(error)) from None
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for file in files:
        digest.update(f"{file.name}:{content_hash(file)}".encode())
    return CONTENT + digest.hexdigest()[:16]


def legacy_fingerprint(folder: Path) -> str:
    """The fingerprint earlier versions recorded: config.json and the weight files' names,
    sizes and modification times (a checkpoint that records one still loads while its base's
    files are unchanged)."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for pattern in WEIGHT_FILES:
        for file in sorted(folder.glob(pattern)):
            stat = file.stat()  # follows the hub cache's symlinks to the blobs
            digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def same_model(recorded: str | None, folder: Path) -> tuple[bool, str]:
    """(whether ``folder`` holds the model a ``recorded`` fingerprint names, its fingerprint now),
    comparing a content fingerprint by content and an earlier version's by its own kind."""
    now = (fingerprint(folder) if recorded is None or recorded.startswith(CONTENT)
           else legacy_fingerprint(folder))
    return now == recorded, now


#: content hashes of weight files already computed: (path, size, mtime) -> sha256
_HASHES: dict[tuple[str, int, int], str] = {}
HASH_CACHE = "content_hashes.json"  #: under ``default_import_cache()``, shared by runs


def content_hash(file: Path) -> str:
    """The sha256 of ``file``'s bytes, cached by its real path, size and modification time (in
    this process and in ``HASH_CACHE`` beside the import cache, so a base of many gigabytes is
    read once, not at every resume or export)."""
    from models.checkpointing.folders import sha256_of

    real = Path(file).resolve()
    stat = real.stat()
    key = (str(real), stat.st_size, stat.st_mtime_ns)
    if key in _HASHES:
        return _HASHES[key]
    cache = default_import_cache() / HASH_CACHE
    stored = _read_hash_cache(cache).get(key[0])
    if stored is not None and list(stored[:2]) == [key[1], key[2]]:
        _HASHES[key] = stored[2]
        return stored[2]
    _HASHES[key] = sha256_of(real)
    _store_hash(cache, key, _HASHES[key])
    return _HASHES[key]


def _read_hash_cache(cache: Path) -> dict:
    try:
        found = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _store_hash(cache: Path, key: tuple[str, int, int], digest: str) -> None:
    """Add one hash to the shared cache file (replaced whole, entries of files that are gone
    dropped; not written when it cannot be: the hash is then computed again next time)."""
    import os

    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        entries = {path: entry for path, entry in _read_hash_cache(cache).items()
                   if Path(path).exists()}
        entries[key[0]] = [key[1], key[2], digest]
        work = cache.with_name(f"{cache.name}.{os.getpid()}")
        work.write_text(json.dumps(entries))
        work.replace(cache)
    except OSError:
        pass


def cache_name(source: str, folder: Path, tp: int, pp: int, ep: int,
               etp: int | None = None) -> str:
    """Folder name of the cached import of ``folder`` at a layout (expert-TP named only where it
    differs from TP: the experts are sliced otherwise)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", source.strip("/").split("/")[-1] or "model")
    experts = "" if etp in (None, tp) else f"-etp{etp}"
    return (f"{name}-{fingerprint(folder).removeprefix(CONTENT)}-tp{tp}-pp{pp}-ep{ep}"
            f"{experts}")


def _processor(folder: Path, file: str, entry: str) -> dict:
    """The processor config of ``file``, else the ``entry`` of ``processor_config.json`` (empty
    when neither is there), as a ``ProcessorFile`` that names where it came from.

    Raises:
        HFSourceError: unreadable, or not a JSON object (one line naming the file).
    """
    from models.model_config import ProcessorFile

    combined = folder / "processor_config.json"
    if (folder / file).is_file():
        values, source = read_json(folder / file), str(folder / file)
    elif combined.is_file():
        whole = read_json(combined)
        values = whole.get(entry) if isinstance(whole, dict) else whole
        values, source = {} if values is None else values, f"{combined} {entry}"
    else:
        return ProcessorFile({}, str(folder / file))
    if not isinstance(values, dict):
        raise HFSourceError(f"{source}: a {type(values).__name__}, not a JSON object of "
                            "processor settings: fix or remove the file")
    return ProcessorFile(values, source)


def task_encoder_settings(folder: Path, family: str) -> tuple[dict, dict]:
    """(task encoder values, geometry) the model's own files set.

    The values are ``TaskEncoderConfig`` fields (``tokenizer`` = the folder; the pixel limits
    its processor configs set, read by the family: its ``processor_settings``); the geometry is
    the ``patch_size`` / ``merge_size`` the processors use (absent keys are left out).

    Raises:
        HFSourceError: a processor file that is no JSON object, or a value no processor has (a
            ``merge_size`` of 0), in one line naming the file and the key.
    """
    image = _processor(folder, "preprocessor_config.json", "image_processor")
    video = _processor(folder, "video_preprocessor_config.json", "video_processor")
    try:
        values, geometry = get_family(family).processor_settings(image, video)
    except ValueError as error:  # a value no processor has: named by its file and key
        raise HFSourceError(str(error)) from None
    return {"tokenizer": str(folder), **values}, geometry


def copy_files(folder: Path, out: Path, names: tuple[str, ...]) -> list[str]:
    """Copy the files of ``names`` that ``folder`` has into ``out``; their names."""
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in names:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
            copied.append(name)
    return copied


#: the special-token ids of an HF config (top level, ``text_config``, ``generation_config.json``)
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def tokenizer_token_ids(tokenizer) -> dict[str, int]:
    """The bos / eos / pad ids a tokenizer defines (those it has)."""
    ids = {key: getattr(tokenizer, key, None) for key in SPECIAL_IDS}
    return {key: value for key, value in ids.items() if isinstance(value, int)}


def _ids(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def special_token_problems(folder: Path, tokenizer) -> list[str]:
    """What is wrong with the bos / eos / pad ids of ``folder``'s config.json (and its
    ``text_config``, and ``generation_config.json``) for ``tokenizer``: an id outside the
    tokenizer's vocabulary, or eos ids none of which is the tokenizer's eos token (``generate``
    would not stop where training ends a turn). One line each, naming the file and the key."""
    size = len(tokenizer)
    sections = [(folder / "config.json", "", hf_config(folder))]
    sections.append((folder / "config.json", "text_config.",
                     sections[0][2].get("text_config") or {}))
    if (folder / "generation_config.json").is_file():
        sections.append((folder / "generation_config.json", "",
                         read_json(folder / "generation_config.json")))
    problems, eos = [], set()
    for path, prefix, values in sections:
        for key in SPECIAL_IDS:
            ids = _ids(values.get(key))
            bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < size]
            if bad:
                problems.append(f"{path}: {prefix}{key} {values[key]} is outside the "
                                f"tokenizer's {size} tokens")
            if key == "eos_token_id":
                eos.update(ids)
    wanted = getattr(tokenizer, "eos_token_id", None)
    if eos and isinstance(wanted, int) and wanted not in eos:
        problems.append(f"{folder / 'config.json'}: eos_token_id {sorted(eos)} does not include "
                        f"the tokenizer's eos token {tokenizer.eos_token!r} (id {wanted})")
    return problems
