"""A train.py checkpoint folder as every reader sees it (train.py, eval.py, ``models.convert``).

This module owns the layout of the checkpoints folder and what makes a step folder trustworthy:

- a save writes ``step_N.partial/`` and renames it ``step_N`` once complete (``partial_dir``), so
  a kill or a full disk mid-save leaves no ``step_N`` behind;
- ``COMPLETE``, written last into the step folder, is its manifest: the size and sha256 of every
  other file (``write_manifest``). ``check_sizes`` (stat only: a deleted or truncated file) and
  ``check_hashes`` (a share of the files, or all: flipped bytes) compare the folder with it and
  name the first file that differs. A ``COMPLETE`` without ``files`` (an earlier version) holds
  no checksums and is taken as it is;
- a resume from an older step renames the later step folders ``step_N.abandoned``
  (``ABANDONED``), which nothing resumes from;
- ``latest`` names the newest step folder for people (``point_latest``);
- ``newest_complete`` never picks a half-written one; ``resolve_checkpoint``: a run, checkpoints
  or step folder -> the step folder.

What is unpickled of the dist checkpoint inside (``model_optim/``, an import folder) is
``models.checkpointing.dist_load``'s.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

#: Written last into a step folder: the checkpoint is complete; its manifest.
COMPLETE = "COMPLETE"
STEP_GLOB = "step_*"
#: A step folder's training state: step, scheduler, layout, the base it refers to (if any).
TRAIN_STATE = "train_state.json"
PARTIAL = ".partial"  #: a step folder being written
ABANDONED = ".abandoned"  #: a later step folder left behind by a resume from an older step
LATEST = "latest"
_CHUNK = 8 << 20


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def partial_dir(ckpt_dir: Path, step: int) -> Path:
    return Path(ckpt_dir) / (step_name(step) + PARTIAL)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(step_dir: Path) -> list[str]:
    """Every file of a step folder but ``COMPLETE``, as sorted relative paths."""
    step_dir = Path(step_dir)
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*")
                  if p.is_file() and p.name != COMPLETE)


def hash_files(step_dir: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"size", "sha256"}} of ``names`` (relative to ``step_dir``)."""
    return {name: {"size": (Path(step_dir) / name).stat().st_size,
                   "sha256": sha256_of(Path(step_dir) / name)} for name in names}


def write_manifest(step_dir: Path, step: int, files: dict[str, dict]) -> None:
    """``COMPLETE`` with ``files`` (``hash_files`` of every file): the last file written."""
    (Path(step_dir) / COMPLETE).write_text(
        json.dumps({"step": step, "time": time.time(), "files": files}, indent=1) + "\n")


def manifest(step_dir: Path) -> dict[str, dict] | None:
    """The recorded files of a complete step folder; None without checksums (an earlier
    version's ``COMPLETE``) or when unreadable (``check_sizes`` says so)."""
    try:
        record = json.loads((Path(step_dir) / COMPLETE).read_text())
    except (OSError, ValueError):
        return None
    files = record.get("files") if isinstance(record, dict) else None
    return files if isinstance(files, dict) else None


def check_sizes(step_dir: Path) -> str | None:
    """The first file of the manifest that is missing or of another size (stat only), as
    ``"<file>: <what>"``; None when every file is there at its recorded size."""
    step_dir = Path(step_dir)
    try:
        record = json.loads((step_dir / COMPLETE).read_text())
    except (OSError, ValueError) as error:
        return f"{COMPLETE}: unreadable manifest ({type(error).__name__})"
    files = record.get("files") if isinstance(record, dict) else None
    if files is None:
        return None
    if not isinstance(files, dict):
        return f"{COMPLETE}: unreadable manifest (no file list)"
    for name in sorted(files):
        problem = _size_problem(step_dir, name, files[name])
        if problem:
            return problem
    return None


def _size_problem(step_dir: Path, name: str, entry) -> str | None:
    path = step_dir / name
    if not isinstance(entry, dict) or ".." in Path(name).parts or Path(name).is_absolute():
        return f"{COMPLETE}: unreadable manifest entry {name!r}"
    if not path.is_file():
        return f"{name}: missing (recorded at save)"
    size = path.stat().st_size
    if size != entry.get("size"):
        recorded = entry.get("size")
        what = "truncated" if isinstance(recorded, int) and size < recorded else "changed"
        return f"{name}: {size} bytes, {recorded} recorded at save ({what})"
    return None


def check_hashes(step_dir: Path, share: tuple[int, int] = (0, 1)) -> tuple[int, str] | None:
    """Hash this share (``(index, count)``: every count-th file of the sorted manifest from
    index) of the recorded files; (position in the manifest, problem) of the first that differs,
    None when all match (or the manifest holds no checksums)."""
    files = manifest(step_dir)
    if not files:
        return None
    names = sorted(files)
    index, count = share
    for position in range(index, len(names), count):
        name = names[position]
        problem = _size_problem(Path(step_dir), name, files[name])
        if problem is None and sha256_of(Path(step_dir) / name) != files[name].get("sha256"):
            problem = f"{name}: sha256 differs from the one recorded at save (corrupted bytes)"
        if problem:
            return position, problem
    return None


def point_latest(ckpt_dir: Path, step_dir: Path | None) -> None:
    """``latest`` names ``step_dir`` (removed when None)."""
    latest = Path(ckpt_dir) / LATEST
    if step_dir is None:
        latest.unlink(missing_ok=True)
    else:
        latest.write_text(Path(step_dir).name + "\n")


def step_of(path: Path) -> int | None:
    number = path.name.removeprefix("step_")
    return int(number) if path.is_dir() and number.isdigit() else None


def step_folders(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step folder, oldest first, complete or not (never a
    ``.partial`` or ``.abandoned`` one)."""
    found = [(step_of(p), p) for p in Path(ckpt_dir).glob(STEP_GLOB)]
    return sorted((s, p) for s, p in found if s is not None)


def complete_folders(ckpt_dir: Path) -> list[Path]:
    """The step folders with ``COMPLETE``, oldest first."""
    return [p for _, p in step_folders(ckpt_dir) if (p / COMPLETE).is_file()]


def newest_complete(ckpt_dir: Path) -> Path | None:
    complete = complete_folders(ckpt_dir)
    return complete[-1] if complete else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A step folder, a checkpoint dir, or a run folder (its ``checkpoints/``) -> the step
    folder: the newest complete one of a checkpoint dir (``COMPLETE``)."""
    path = Path(path)
    if (path / "checkpoints").is_dir() and not step_folders(path):
        path = path / "checkpoints"
    if step_folders(path):
        return newest_complete(path) or path
    return path


def weights_folder(path: str | Path) -> Path:
    """The dist checkpoint of weights at ``path``: a train.py run, checkpoints or step folder
    (the step its run printed) -> its ``model_optim``; anything else (an import folder,
    ``<step>/model_optim`` itself) as given."""
    step = resolve_checkpoint(path)
    return step / "model_optim" if (step / "model_optim").is_dir() else Path(path)
