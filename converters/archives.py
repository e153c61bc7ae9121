"""Random access to media inside source archives, without extracting them.

- `ZipMembers`: members of one or several zip files (Mantis `<split>_images.zip` or part zips),
  indexed from their central directories.
- `TarGzMembers`: members of `.tar.gz` parts (LLaVA-Video), indexed in ONE streaming pass with
  indexed_gzip, whose seek points make later reads random access; the gzip index is saved so
  resumed runs and worker processes do not pay the pass again.
- `FolderMembers`: an already-extracted folder.

Member names are untrusted: `safe_member_name` normalises `./` prefixes and refuses absolute
paths and `..` components. Open file handles are per process (safe after `fork`).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import tarfile
import zipfile
from pathlib import Path


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


class ZipMembers:
    """Members of several zip archives by name. Unsafe names are never indexed."""

    def __init__(self, zip_paths: list[Path]):
        self.paths = list(zip_paths)
        self.index: dict[str, tuple[Path, str]] = {}  # safe name -> (zip, stored name)
        self.unsafe: list[str] = []
        for path in self.paths:
            with zipfile.ZipFile(path) as zf:
                for info in zf.infolist():
                    if info.is_dir():
                        continue
                    safe = safe_member_name(info.filename)
                    if safe is None:
                        self.unsafe.append(info.filename)
                    else:
                        self.index.setdefault(safe, (path, info.filename))
        self._handles = _PerProcessHandles()

    def read(self, name: str) -> bytes | None:
        """The bytes of a member (name normalised), or None when absent."""
        entry = self.index.get(name)
        if entry is None:
            return None
        path, stored = entry
        zf = self._handles.get(path, lambda: zipfile.ZipFile(path))
        return zf.read(stored)


class TarGzMembers:
    """Members of `.tar.gz` archives with random access through a saved gzip index."""

    SPACING = 16 * 1024 * 1024  # uncompressed bytes between seek points

    def __init__(self, archives: list[Path], index_dir: Path):
        import indexed_gzip

        self._igz = indexed_gzip
        self.index: dict[str, tuple[Path, Path, int, int]] = {}
        self.unsafe: list[str] = []
        index_dir.mkdir(parents=True, exist_ok=True)
        for archive in archives:
            stat = archive.stat()
            tag = hashlib.sha1(f"{archive.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
            gzidx = index_dir / f"{archive.name}.{tag.hexdigest()[:12]}.gzidx"
            self._index_archive(archive, gzidx)
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
            if not gzidx.is_file():
                tmp = gzidx.with_name(gzidx.name + ".tmp")
                gz.export_index(str(tmp))
                os.replace(tmp, gzidx)

    def read(self, name: str) -> bytes | None:
        entry = self.index.get(name)
        if entry is None:
            return None
        archive, gzidx, offset, size = entry
        gz = self._handles.get(archive, lambda: self._open(archive, gzidx))
        gz.seek(offset)
        return gz.read(size)


class FolderMembers:
    """Files of an extracted folder, addressed like archive members."""

    def __init__(self, root: Path):
        self.root = root
        self.unsafe: list[str] = []

    def read(self, name: str) -> bytes | None:
        path = self.root / name
        return path.read_bytes() if path.is_file() else None
