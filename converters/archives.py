"""Random access to media inside source archives and folders, without extracting them.

- `ZipMembers`: members of one or several zip files (Mantis `<split>_images.zip` or part zips),
  indexed from their central directories.
- `TarGzMembers`: members of `.tar.gz` parts (LLaVA-Video), indexed in ONE streaming pass with
  indexed_gzip, whose seek points make later reads random access; the gzip index is saved so
  resumed runs and worker processes do not pay the pass again.
- `FolderMembers`: an already-extracted folder.
- `FrameFolders`: videos published as folders of frame images (LLaVA-Video's llava_hound, whose
  frames live in another repository: `--frames-root`); a folder is read as one frame-sequence
  member (`energon_tasks.sample_format.pack_frames`).

Every `read(name, max_bytes)` is bounded: a member larger than `max_bytes` (as stored, or as it
turns out while reading, whatever its header says) raises `MediaError("member_too_large")` having
read at most `max_bytes + 1` bytes. A damaged archive never stops a run: a zip that cannot be
opened, a tar.gz that ends early or whose stream is corrupt, or a member whose bytes cannot be
read raise `MediaError("unreadable_archive")` for the rows that need them (a name the readable part
does not hold is `unreadable_archive` too when some archive of the set is damaged, since it may sit
in the lost part). Member names are untrusted: `safe_member_name` refuses absolute paths and `..`;
a folder never serves a file whose real path (symlinks resolved) leaves the folder. Open file
handles are per process (safe after `fork`).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import tarfile
import zipfile
import zlib
from pathlib import Path

from contract.errors import MediaError


def safe_member_name(name: str) -> str | None:
    """The normalised relative name, or None when it could escape the archive root."""
    if not name or "\x00" in name:
        return None
    name = name.replace("\\", "/")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return None
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts):
        return None
    return posixpath.join(*parts)


def inside(root: Path, path: Path) -> bool:
    """True when `path`, symlinks resolved, is `root` or lies below it (root already resolved)."""
    try:
        return path.resolve().is_relative_to(root)
    except (OSError, RuntimeError):  # a symlink loop
        return False


def _too_large(name: str, size: int, max_bytes: int) -> MediaError:
    return MediaError("member_too_large", f"{name}: {size} bytes is over --max-member-bytes "
                      f"{max_bytes}")


class _PerProcessHandles:
    """File handles opened lazily in the process that uses them (never shared across fork)."""

    def __init__(self):
        self._pid = None
        self._handles: dict = {}

    def get(self, key, opener):
        if self._pid != os.getpid():
            self._pid, self._handles = os.getpid(), {}
        if key not in self._handles:
            self._handles[key] = opener()
        return self._handles[key]


class _Damage:
    """Which archives of a set are damaged, and the answer for names they may have held."""

    def __init__(self):
        self.damaged: dict[str, str] = {}  #: archive file name -> what is wrong

    def note(self, archive: Path, exc: BaseException) -> None:
        self.damaged[archive.name] = f"{type(exc).__name__}: {exc}"[:200]

    def missing(self, name: str) -> None:
        """Called for a name the readable part does not hold: raise if it may be in a lost part."""
        if self.damaged:
            where = "; ".join(f"{a} ({why})" for a, why in sorted(self.damaged.items()))
            raise MediaError("unreadable_archive", f"{name} not in the readable part of {where}")


class ZipMembers:
    """Members of several zip archives by name. Unsafe names are never indexed."""

    def __init__(self, zip_paths: list[Path]):
        self.paths = list(zip_paths)
        self.index: dict[str, tuple[Path, str, int]] = {}  # safe name -> (zip, stored, size)
        self.unsafe: list[str] = []
        self.damage = _Damage()
        for path in self.paths:
            try:
                with zipfile.ZipFile(path) as zf:
                    infos = zf.infolist()
            except (OSError, zipfile.BadZipFile, ValueError, EOFError) as exc:
                self.damage.note(path, exc)
                continue
            for info in infos:
                if info.is_dir():
                    continue
                safe = safe_member_name(info.filename)
                if safe is None:
                    self.unsafe.append(info.filename)
                else:
                    self.index.setdefault(safe, (path, info.filename, info.file_size))
        self._handles = _PerProcessHandles()

    def read(self, name: str, max_bytes: int) -> bytes | None:
        """The bytes of a member (name normalised), or None when absent."""
        entry = self.index.get(name)
        if entry is None:
            self.damage.missing(name)
            return None
        path, stored, size = entry
        if size > max_bytes:
            raise _too_large(name, size, max_bytes)
        try:
            zf = self._handles.get(path, lambda: zipfile.ZipFile(path))
            with zf.open(stored) as member:  # decompression stops at max_bytes + 1
                data = member.read(max_bytes + 1)
        except (OSError, zipfile.BadZipFile, zlib.error, EOFError, ValueError) as exc:
            raise MediaError("unreadable_archive", f"{name} in {path.name}: "
                             f"{type(exc).__name__}: {exc}") from None
        if len(data) > max_bytes:
            raise _too_large(name, len(data), max_bytes)
        return data


class TarGzMembers:
    """Members of `.tar.gz` archives with random access through a saved gzip index."""

    SPACING = 16 * 1024 * 1024  # uncompressed bytes between seek points

    def __init__(self, archives: list[Path], index_dir: Path):
        import indexed_gzip

        self._igz = indexed_gzip
        self.index: dict[str, tuple[Path, Path, int, int]] = {}
        self.unsafe: list[str] = []
        self.damage = _Damage()
        index_dir.mkdir(parents=True, exist_ok=True)
        for archive in archives:
            stat = archive.stat()
            tag = hashlib.sha1(f"{archive.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
            gzidx = index_dir / f"{archive.name}.{tag.hexdigest()[:12]}.gzidx"
            try:
                self._index_archive(archive, gzidx)
            except Exception as exc:  # truncated or corrupt gzip / tar: keep what was read
                self.damage.note(archive, exc)
        self._handles = _PerProcessHandles()

    def _open(self, archive: Path, gzidx: Path):
        if gzidx.is_file():
            return self._igz.IndexedGzipFile(str(archive), index_file=str(gzidx),
                                             spacing=self.SPACING)
        return self._igz.IndexedGzipFile(str(archive), spacing=self.SPACING)

    def _index_archive(self, archive: Path, gzidx: Path) -> None:
        with self._open(archive, gzidx) as gz, tarfile.open(fileobj=gz, mode="r:") as tar:
            for member in tar:  # one streaming pass: headers read, data skipped by seeking
                if not member.isfile():
                    continue
                safe = safe_member_name(member.name)
                if safe is None:
                    self.unsafe.append(member.name)
                    continue
                self.index.setdefault(safe, (archive, gzidx, member.offset_data, member.size))
            gz.seek(0, os.SEEK_END)  # the whole stream decompresses: its end is not cut off
            if not gzidx.is_file():
                tmp = gzidx.with_name(f"{gzidx.name}.{os.getpid()}.tmp")
                gz.export_index(str(tmp))
                os.replace(tmp, gzidx)

    def read(self, name: str, max_bytes: int) -> bytes | None:
        entry = self.index.get(name)
        if entry is None:
            self.damage.missing(name)
            return None
        archive, gzidx, offset, size = entry
        if size > max_bytes:
            raise _too_large(name, size, max_bytes)
        try:
            gz = self._handles.get(archive, lambda: self._open(archive, gzidx))
            gz.seek(offset)
            data = gz.read(size)
        except Exception as exc:  # indexed_gzip / zlib errors in a damaged stream
            raise MediaError("unreadable_archive", f"{name} in {archive.name}: "
                             f"{type(exc).__name__}: {exc}") from None
        if len(data) != size:
            raise MediaError("unreadable_archive", f"{name} in {archive.name}: the archive ends "
                             f"{size - len(data)} bytes into the member")
        return data


class FolderMembers:
    """Regular files of an extracted folder, addressed like archive members; a file whose real
    path (symlinks resolved) leaves the folder is refused."""

    def __init__(self, root: Path):
        self.root = root.resolve()
        self.unsafe: list[str] = []

    def read(self, name: str, max_bytes: int) -> bytes | None:
        path = self.root / name
        if not path.exists() and not path.is_symlink():
            return None
        if not inside(self.root, path):
            raise MediaError("unsafe_member_name", f"{name}: leaves the source folder")
        if not path.is_file():
            return None
        size = path.stat().st_size
        if size > max_bytes:
            raise _too_large(name, size, max_bytes)
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise _too_large(name, len(data), max_bytes)
        return data


#: image files that make up a frame folder
FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class FrameFolders:
    """Videos given as folders of frame images under `root`: `read(name)` packs the folder's
    frames (natural name order, original bytes) into one frame-sequence member. A name is looked
    up as given, then by its last path component (sources write either)."""

    def __init__(self, root: Path):
        self.root = root.resolve()
        self.unsafe: list[str] = []

    def _folder(self, name: str) -> Path | None:
        return next((f for f in (self.root / name, self.root / posixpath.basename(name))
                     if f.is_dir()), None)

    def has(self, name: str) -> bool:
        """A folder for `name` exists (as given or by its last component)."""
        return self._folder(name) is not None

    def read(self, name: str, max_bytes: int) -> bytes | None:
        from energon_tasks.sample_format import pack_frames

        folder = self._folder(name)
        if folder is None:
            return None
        if not inside(self.root, folder):
            raise MediaError("unsafe_member_name", f"{name}: leaves the frames root")
        files = sorted((f for f in folder.iterdir()
                        if f.suffix.lower() in FRAME_SUFFIXES and f.is_file()
                        and inside(self.root, f)), key=lambda f: _natural(f.name))
        total = sum(f.stat().st_size for f in files)
        if total > max_bytes:
            raise _too_large(name, total, max_bytes)
        return pack_frames([(f.name, f.read_bytes()) for f in files])
