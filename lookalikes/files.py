"""Deterministic writers shared by the lookalike builders.

Owns everything that puts bytes on disk in a hub-like form: parquet files (with or without the
Hugging Face features metadata), zip and tar.gz archives with fixed timestamps, JSON files, the
README.md dataset card with its `configs:` YAML front matter, and the `lookalike_manifest.json`
ground truth (`Manifest`). Same inputs give byte-identical files.
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import tarfile
import zipfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from datasets import Features

MANIFEST_NAME = "lookalike_manifest.json"
ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def fresh_dir(path: Path) -> Path:
    """Remove `path` if it exists and create it empty (only ever called on a lookalike root)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def write_parquet(path: Path, rows: list[dict], features: Features, *, hf_metadata: bool) -> None:
    """Write `rows` with the arrow schema of `features`.

    Args:
        path: Output file.
        rows: One dict per row, keys as in `features`.
        features: The `datasets` features; their arrow schema is used for the columns.
        hf_metadata: Keep the `huggingface` schema metadata (what `datasets` writes, so that
            e.g. `Image()` features survive); False writes a plain arrow schema.
    """
    schema = features.arrow_schema
    if not hf_metadata:
        schema = schema.remove_metadata()
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def shard_names(prefix: str, n: int) -> list[str]:
    """Hub parquet shard names: `train-00000-of-00002.parquet`, ..."""
    return [f"{prefix}-{k:05d}-of-{n:05d}.parquet" for k in range(n)]


def write_zip(path: Path, members: Iterable[tuple[str, bytes]]) -> None:
    """Write a stored (uncompressed) zip with fixed timestamps; names are kept verbatim."""
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members:
            info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
            info.external_attr = 0o644 << 16
            zf.writestr(info, data)


def write_tar_gz(path: Path, members: Iterable[tuple[str, bytes | None]]) -> None:
    """Write a gzip tar with mtime 0 everywhere; `None` data makes a directory entry."""
    with open(path, "wb") as raw, gzip.GzipFile("", "wb", 6, raw, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                if data is None:
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
                else:
                    info.size, info.mode = len(data), 0o644
                    tar.addfile(info, io.BytesIO(data))


def write_json(path: Path, obj, *, indent: int | None = 2) -> None:
    """Write `obj` as UTF-8 JSON (key order as given, like the hub's annotation files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")


def card_info(config: str, features: Features, splits: dict[str, list[Path]]) -> dict:
    """A `dataset_info` card entry as `push_to_hub` writes it (features, split sizes).

    Args:
        config: Config name.
        features: The config's features.
        splits: split name -> its parquet files; num_bytes is their size on disk (the hub
            gives the arrow size) and num_examples their row count.
    """
    sizes = {s: sum(f.stat().st_size for f in files) for s, files in splits.items()}
    rows = {s: sum(pq.read_metadata(f).num_rows for f in files) for s, files in splits.items()}
    return {
        "config_name": config,
        "features": features._to_yaml_list(),
        "splits": [{"name": s, "num_bytes": sizes[s], "num_examples": rows[s]} for s in splits],
        "download_size": sum(sizes.values()),
        "dataset_size": sum(sizes.values()),
    }


def write_card(root: Path, configs: dict[str, dict[str, str]], title: str, body: str,
               infos: list[dict] | None = None) -> None:
    """Write README.md with a hub-style front matter: `dataset_info` (optional) and `configs`.

    `dataset_info` also makes the card, hence datasets' cache key for the local folder, change
    whenever a split's row count or file size changes (the key ignores file contents).

    Args:
        root: Dataset root folder.
        configs: config name -> {split name: data_files path pattern relative to root}.
        title: Markdown title under the front matter.
        body: Free text after the title.
        infos: `card_info` entries, one per config.
    """
    meta = {}
    if infos and len(infos) == 1 and infos[0]["config_name"] == "default":
        meta["dataset_info"] = {k: v for k, v in infos[0].items() if k != "config_name"}
    elif infos:
        meta["dataset_info"] = infos
    meta |= {
        "configs": [
            {
                "config_name": name,
                "data_files": [{"split": s, "path": p} for s, p in splits.items()],
            }
            for name, splits in configs.items()
        ]
    }
    front = yaml.safe_dump(meta, sort_keys=False, default_flow_style=False)
    (root / "README.md").write_text(f"---\n{front}---\n\n# {title}\n\n{body}\n", encoding="utf-8")


@dataclass
class Manifest:
    """Ground truth a converter must reproduce on a lookalike (`lookalike_manifest.json`).

    `rows` and `expected_samples` are keyed `"<config>/<split>"`; `pitfalls` lists every planted
    pitfall with where it lives and what the converter should do with it.
    """

    dataset: str
    rows: dict[str, int] = field(default_factory=dict)
    expected_rejects: Counter = field(default_factory=Counter)
    expected_fixups: Counter = field(default_factory=Counter)
    expected_samples: dict[str, int] = field(default_factory=dict)
    pitfalls: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  #: dataset-specific expectations, written as is

    def note(self, where: str, row: int | None, row_id, pitfall: str, expect: str) -> None:
        """Record a pitfall.

        Args:
            where: `<config>/<split>`, or `<config>/<archive name>` for archive-level pitfalls.
            row: Row index in the split (None: the pitfall concerns the split or archive).
            row_id: The row's source id, or the archive member name.
            pitfall: What is odd.
            expect: `kept`, `reject:<reason>`, `fixup:<kind>`, `ignored` (never referenced,
                must be skipped safely) or `error` (`datasets.load_dataset` raises).
        """
        self.pitfalls.append(
            {"where": where, "row": row, "id": row_id, "pitfall": pitfall, "expect": expect}
        )

    def write(self, root: Path) -> None:
        """Write the manifest as `root/lookalike_manifest.json`."""
        write_json(
            root / MANIFEST_NAME,
            {
                "dataset": self.dataset,
                "rows": self.rows,
                "expected_rejects": dict(sorted(self.expected_rejects.items())),
                "expected_fixups": dict(sorted(self.expected_fixups.items())),
                "expected_samples": self.expected_samples,
                "pitfalls": self.pitfalls,
                **self.extra,
            },
        )
