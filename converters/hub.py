"""Access to a source dataset: a Hugging Face hub id, or a local folder with the hub's layout.

The same calls serve both: `datasets.load_dataset(source, config, split=...)` for tables, and
`file_path` / `list_files` / `open_data_file` for the files beside them (image zips, video
archives, raw JSON annotations). Local folders are what tests and the demo use; hub ids are what
users use. Every failure to find the source or a config becomes a one-line `UsageError`.

A hub id is pinned: its revision (`--revision`, default `main`) is resolved once, when the source
is opened, to a commit id, and every read (cards, configs, splits, tables, data files, the file
listing, downloads) names that commit, so a branch that moves during a long run cannot mix two
commits. A run that resumes a conversion continues at the commit it recorded.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import os
import sys
from pathlib import Path

import datasets

from contract.console import phase
from converters.base import UsageError

if not sys.stderr.isatty():  # batch logs get our periodic lines, not a bar per split
    datasets.disable_progress_bars()

DEFAULT_REVISION = "main"
#: seconds to wait for the hub when resolving the revision (a dead hub is one line, quickly)
RESOLVE_TIMEOUT_S = 10.0


class Source:
    """A dataset source: `location` is a local folder or a hub id ("owner/name").

    Args:
        location: the folder or hub id.
        cache_dir: `datasets` cache of a local folder's tables (see `load`).
        revision: branch, tag or commit id of a hub id (None: the recorded commit when resuming,
            else `main`); refused for a local folder.
        recorded: what the conversion this run continues recorded of its source (its
            `fingerprint()`; None when there is none): its commit is used when `revision` is
            None.
        recorded_binds: the recorded conversion has shards: a `revision` that resolves to
            another commit is refused.

    Raises:
        UsageError: no such folder, not a hub id, the hub unreachable or without that dataset
            or revision, or a revision other than the recorded one.
    """

    def __init__(self, location: str, cache_dir: Path | None = None,
                 revision: str | None = None, *, recorded: dict | None = None,
                 recorded_binds: bool = False):
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
        if self.local and revision is not None:
            raise UsageError(f"--revision {revision}: --source {location} is a local folder "
                             "(revisions are for hub ids)")
        same_source = bool(recorded) and recorded.get("location") == location
        recorded_commit = recorded.get("revision") if same_source else None
        #: the commit every read names (None for a local folder)
        self.revision = None if self.local else self._pin(revision, recorded_commit,
                                                          recorded_binds)
        self._listing: list[str] | None = None

    def _pin(self, wanted: str | None, recorded: str | None, binds: bool) -> str:
        if wanted is None and recorded:
            phase(f"source {self.location} at {recorded} (the commit of the conversion "
                  "being resumed)")
            return recorded
        wanted = wanted or DEFAULT_REVISION
        sha = self._resolve(wanted)
        if recorded and binds and sha != recorded:
            raise UsageError(f"--revision {wanted} is commit {sha} of {self.location}, but the "
                             f"conversion being resumed read commit {recorded}: rerun without "
                             "--revision (or with that commit), or use another --out")
        phase(f"source {self.location} at {wanted} = {sha}")
        return sha

    def _resolve(self, revision: str) -> str:
        """The commit id of `revision` (one request to the hub)."""
        from huggingface_hub import HfApi
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        try:
            return HfApi().dataset_info(self.location, revision=revision,
                                        timeout=RESOLVE_TIMEOUT_S).sha
        except RepositoryNotFoundError:
            raise UsageError(f"--source {self.location}: no such dataset on {_endpoint()} (or "
                             "it is private or gated: log in with `hf auth login`)") from None
        except RevisionNotFoundError:
            raise UsageError(f"--revision {revision}: no such branch, tag or commit in "
                             f"{self.location}") from None
        except Exception as exc:  # no connection, a timeout, an error page: one line
            raise UsageError(f"--source {self.location}: {_hub_failure(exc)}") from None

    @property
    def ref(self) -> str:
        return str(self.local) if self.local else self.location

    def fingerprint(self) -> dict:
        """Where the rows come from: the location and, for a hub id, the pinned commit (which
        fixes every file); for a local folder, `files`: a fingerprint of each annotation file
        and archive (`file_fingerprints`), so that a source changed since an interrupted run
        is told apart from the one it planned."""
        doc = {"location": self.location, "revision": self.revision}
        if self.local:
            doc["files"] = file_fingerprints(self.local)
        return doc

    def config_names(self) -> list[str]:
        try:
            return list(datasets.get_dataset_config_names(self.ref, revision=self.revision))
        except Exception as exc:
            raise UsageError(f"--source {self.location}: cannot read its configs "
                             f"({type(exc).__name__}: {_first_line(exc)})") from None

    def split_names(self, config: str | None) -> list[str]:
        try:
            return list(datasets.get_dataset_split_names(self.ref, config,
                                                         revision=self.revision))
        except Exception as exc:
            raise UsageError(f"--source {self.location}: cannot read the splits of config "
                             f"{config!r} ({type(exc).__name__}: {_first_line(exc)})") from None

    def load(self, config: str | None, split: str) -> datasets.Dataset:
        """The split as a memory-mapped Arrow table (no media decoding).

        A local folder gets its own cache (`cache_dir`): `datasets` keys the cache of a local
        folder by its name and card only, so a shared cache can serve stale rows.
        """
        cache = str(self.cache_dir) if self.local and self.cache_dir else None
        pinned = {"cache_dir": cache, "revision": self.revision}
        try:
            return datasets.load_dataset(self.ref, config, split=split, **pinned)
        except Exception as exc:  # datasets raises many kinds; an empty split is one of them
            reraise_full_disk(exc)
            if self._is_empty(config, split):
                return datasets.Dataset.from_list([])
            try:  # datasets prepares every split of a config at once: an empty one fails all
                return datasets.load_dataset(self.ref, config, split=split, **pinned,
                                             data_files={split: self.data_files(config, split)})
            except Exception:
                pass
            raise UsageError(f"--source {self.location}: config {config!r} split {split!r} "
                             f"cannot be loaded ({type(exc).__name__}: {_first_line(exc)})"
                             ) from None

    def _is_empty(self, config: str | None, split: str) -> bool:
        """True when every data file of the split holds zero rows (datasets cannot load it)."""
        import pyarrow.parquet as pq

        for url in self.data_files(config, split):
            with open_data_file(url) as f:
                if url.endswith(".parquet"):
                    if pq.read_metadata(f).num_rows:
                        return False
                elif f.read(4096).strip() not in (b"", b"[]"):
                    return False
        return True

    def data_files(self, config: str | None, split: str) -> list[str]:
        """Resolved data file URLs/paths of a split, as `load_dataset` would read them (a hub
        id's are `hf://datasets/<id>@<commit>/...`).

        Raises:
            UsageError: a local data file lies outside the source folder (the card's globs, or a
                symlink, point out of it).
        """
        builder = datasets.load_dataset_builder(self.ref, config, revision=self.revision)
        files = [str(f) for f in builder.config.data_files[split]]
        if self.local:
            from converters.archives import inside

            for f in files:
                if os.path.exists(f) and not inside(self.local, Path(f)):
                    raise UsageError(f"--source {self.location}: data file {f} of config "
                                     f"{config!r} lies outside the source")
        return files

    def file_path(self, relpath: str) -> Path | None:
        """A file of the repository on local disk (downloaded from the hub when needed), None
        when the repository (at the pinned commit) has no such file.

        Raises:
            UsageError: `relpath` would leave the repository (`..`, absolute, or a symlink out),
                or the hub failed to give it.
        """
        from converters.archives import inside, safe_member_name

        name = safe_member_name(relpath)
        if name is None:
            raise UsageError(f"--source {self.location}: {relpath!r} leaves the source")
        relpath = name
        if self.local:
            path = self.local / relpath
            if (path.exists() or path.is_symlink()) and not inside(self.local, path):
                raise UsageError(f"--source {self.location}: {relpath} leaves the source "
                                 "(a symlink out of it)")
            return path if path.is_file() else None
        if relpath not in self._hub_listing():
            return None
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(self.location, relpath, repo_type="dataset",
                                        revision=self.revision))
        except Exception as exc:
            reraise_full_disk(exc)
            raise UsageError(f"--source {self.location}: cannot download {relpath} at "
                             f"{self.revision} ({_hub_failure(exc)})") from None

    def list_files(self, pattern: str) -> list[str]:
        """Repository-relative file names matching a glob pattern (`*` stays within a folder,
        as in `Path.glob`), sorted."""
        if self.local:
            from converters.archives import inside

            names = [str(p.relative_to(self.local)) for p in self.local.glob(pattern)
                     if p.is_file() and inside(self.local, p)]
        else:
            names = [f for f in self._hub_listing() if _glob_match(f, pattern)]
        return sorted(names)

    def _hub_listing(self) -> list[str]:
        """Every file of the repository at the pinned commit (listed once)."""
        if self._listing is None:
            from huggingface_hub import HfApi

            try:
                self._listing = HfApi().list_repo_files(self.location, repo_type="dataset",
                                                        revision=self.revision)
            except Exception as exc:
                raise UsageError(f"--source {self.location}: cannot list its files at "
                                 f"{self.revision} ({_hub_failure(exc)})") from None
        return self._listing


#: the files of a local source whose change changes the plan: annotations, cards, archives
FINGERPRINTED_SUFFIXES = (".parquet", ".arrow", ".json", ".jsonl", ".csv", ".txt", ".md", ".zip",
                          ".tar", ".gz", ".tgz")
#: files up to this size are hashed whole; larger ones (archives) by size, head and tail
_WHOLE_HASH_BYTES = 64 * 1024 * 1024
_EDGE_BYTES = 1024 * 1024


def _file_digest(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha1(str(size).encode())
    with open(path, "rb") as f:
        if size <= _WHOLE_HASH_BYTES:
            for block in iter(lambda: f.read(_EDGE_BYTES), b""):
                digest.update(block)
        else:
            digest.update(f.read(_EDGE_BYTES))
            f.seek(size - _EDGE_BYTES)
            digest.update(f.read(_EDGE_BYTES))
    return digest.hexdigest()[:16]


def file_fingerprints(root: Path) -> dict[str, str]:
    """relative path -> content fingerprint of every annotation file, card and archive under a
    local source (`FINGERPRINTED_SUFFIXES`; hidden folders skipped): SHA-1 of the whole file up
    to 64 MiB, else of its size, first and last MiB. Content, not mtimes: a copy or a `touch`
    changes nothing."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(p.startswith(".") for p in rel.parts) or not path.is_file() or \
                not path.name.lower().endswith(FINGERPRINTED_SUFFIXES):
            continue
        found[rel.as_posix()] = _file_digest(path)
    return found


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


def reraise_full_disk(exc: BaseException) -> None:
    """Re-raise the OSError behind `exc` when the disk (or a file size limit) is full, so that it
    reads as such rather than as a bad source."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise seen
        seen = seen.__cause__ or seen.__context__


def _glob_match(name: str, pattern: str) -> bool:
    """`name` matches `pattern` segment by segment (a wildcard never crosses a `/`)."""
    names, patterns = name.split("/"), pattern.split("/")
    return len(names) == len(patterns) and all(
        fnmatch.fnmatchcase(n, p) for n, p in zip(names, patterns))


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _hub_failure(exc: BaseException) -> str:
    """What went wrong talking to the hub, in a few words."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(exc, OfflineModeIsEnabled):
        return "offline mode is on (HF_HUB_OFFLINE)"
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return f"{_endpoint()} answered HTTP {exc.response.status_code}"
    return f"cannot reach {_endpoint()}: {type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def _check_columns(source: Source, config: str, split: str, table, required) -> None:
    if not len(table):
        return  # an empty split: nothing to read, whatever its schema
    columns = set(getattr(table, "column_names", None) or ())
    for group in required:
        if not group & columns:
            raise UsageError(f"--source {source.location}: config {config!r} split {split!r} has "
                             f"no {' / '.join(sorted(group))} column (it has "
                             f"{', '.join(sorted(columns)) or 'none'})")


def open_splits(source: Source, configs: list[str], wanted: list[str] | None, load=None,
                required: tuple[set[str], ...] = ()):
    """Load every (config, split) to convert.

    Args:
        source: where the dataset is.
        configs: configs to convert (already checked).
        wanted: split names to keep (None: all); unknown names are a UsageError.
        load: `(config, split) -> table` (default `source.load`); a table needs `len()`.
        required: column groups a `datasets` table must have (one name of each group).

    Returns:
        (splits, tables): `SourceSplit`s in a fixed order and their tables by (config, split).
    """
    from converters.base import SourceSplit, check_config_folders, target_of

    check_config_folders(configs)

    load = load or source.load
    splits, tables, seen = [], {}, set()
    for config in configs:
        names = source.split_names(config)
        seen.update(names)
        chosen = [n for n in names if wanted is None or n in wanted]
        has_val = any(target_of(n, True) == "val" for n in chosen)
        for name in chosen:
            if source.local:
                source.data_files(config, name)  # refuses files outside the source
            table = load(config, name)
            _check_columns(source, config, name, table, required)
            tables[(config, name)] = table
            splits.append(SourceSplit(config=config, split=name, target=target_of(name, has_val),
                                      num_rows=len(table)))
    if wanted:
        unknown = sorted(set(wanted) - seen)
        if unknown:
            raise UsageError(f"unknown split(s) {', '.join(unknown)}; the source has: "
                             f"{', '.join(sorted(seen))}")
    return splits, tables
