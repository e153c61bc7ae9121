"""Access to a source dataset: a Hugging Face hub id, or a local folder with the hub's layout.

The same calls serve both: `datasets.load_dataset(source, config, split=...)` for tables, and
`file_path` / `list_files` / `open_data_file` for the files beside them (image zips, video
archives, raw JSON annotations). Local folders are what tests and the demo use; hub ids are what
users use. Every failure to find the source or a config becomes a one-line `UsageError`.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import datasets

from converters.base import UsageError


class Source:
    """A dataset source: `location` is a local folder or a hub id ("owner/name")."""

    def __init__(self, location: str, cache_dir: Path | None = None):
        self.location = location
        self.cache_dir = cache_dir
        path = Path(location).expanduser()
        if path.exists():
            if not path.is_dir():
                raise UsageError(f"--source {location}: not a folder")
            self.local: Path | None = path.resolve()
        elif location.startswith(("/", ".", "~")) or location.count("/") != 1:
            raise UsageError(f"--source {location}: no such folder (and not a hub id owner/name)")
        else:
            self.local = None

    @property
    def ref(self) -> str:
        return str(self.local) if self.local else self.location

    def config_names(self) -> list[str]:
        try:
            return list(datasets.get_dataset_config_names(self.ref))
        except Exception as exc:
            raise UsageError(f"--source {self.location}: cannot read its configs "
                             f"({type(exc).__name__}: {_first_line(exc)})") from None

    def split_names(self, config: str | None) -> list[str]:
        try:
            return list(datasets.get_dataset_split_names(self.ref, config))
        except Exception as exc:
            raise UsageError(f"--source {self.location}: cannot read the splits of config "
                             f"{config!r} ({type(exc).__name__}: {_first_line(exc)})") from None

    def load(self, config: str | None, split: str) -> datasets.Dataset:
        """The split as a memory-mapped Arrow table (no media decoding).

        A local folder gets its own cache (`cache_dir`): `datasets` keys the cache of a local
        folder by its name and card only, so a shared cache can serve stale rows.
        """
        cache = str(self.cache_dir) if self.local and self.cache_dir else None
        return datasets.load_dataset(self.ref, config, split=split, cache_dir=cache)

    def data_files(self, config: str | None, split: str) -> list[str]:
        """Resolved data file URLs/paths of a split, as `load_dataset` would read them."""
        builder = datasets.load_dataset_builder(self.ref, config)
        return [str(f) for f in builder.config.data_files[split]]

    def file_path(self, relpath: str) -> Path | None:
        """A file of the repository on local disk (downloaded from the hub when needed)."""
        if self.local:
            path = self.local / relpath
            return path if path.is_file() else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return Path(hf_hub_download(self.location, relpath, repo_type="dataset"))
        except EntryNotFoundError:
            return None

    def list_files(self, pattern: str) -> list[str]:
        """Repository-relative file names matching a glob pattern, sorted."""
        if self.local:
            names = [str(p.relative_to(self.local)) for p in self.local.glob(pattern)]
        else:
            from huggingface_hub import HfApi

            files = HfApi().list_repo_files(self.location, repo_type="dataset")
            names = [f for f in files if fnmatch.fnmatch(f, pattern)]
        return sorted(names)


def open_data_file(url: str):
    """Open a resolved data file (local path or hf:// URL) for binary reading."""
    if os.path.exists(url):
        return open(url, "rb")
    import fsspec

    return fsspec.open(url, "rb").open()


def resolve_configs(source: Source, wanted: list[str] | None) -> list[str]:
    """The configs to convert: all of the source's, or the requested ones (checked)."""
    available = source.config_names()
    if not wanted:
        return available
    unknown = [c for c in wanted if c not in available]
    if unknown:
        raise UsageError(f"unknown config(s) {', '.join(unknown)}; the source has: "
                         f"{', '.join(available)}")
    return wanted


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def open_splits(source: Source, configs: list[str], wanted: list[str] | None, load=None):
    """Load every (config, split) to convert.

    Args:
        source: where the dataset is.
        configs: configs to convert (already checked).
        wanted: split names to keep (None: all); unknown names are a UsageError.
        load: `(config, split) -> table` (default `source.load`); a table needs `len()`.

    Returns:
        (splits, tables): `SourceSplit`s in a fixed order and their tables by (config, split).
    """
    from converters.base import SourceSplit, target_of

    load = load or source.load
    splits, tables, seen = [], {}, set()
    for config in configs:
        names = source.split_names(config)
        seen.update(names)
        chosen = [n for n in names if wanted is None or n in wanted]
        has_val = any(target_of(n, True) == "val" for n in chosen)
        for name in chosen:
            table = load(config, name)
            tables[(config, name)] = table
            splits.append(SourceSplit(config=config, split=name, target=target_of(name, has_val),
                                      num_rows=len(table)))
    if wanted:
        unknown = sorted(set(wanted) - seen)
        if unknown:
            raise UsageError(f"unknown split(s) {', '.join(unknown)}; the source has: "
                             f"{', '.join(sorted(seen))}")
    return splits, tables
