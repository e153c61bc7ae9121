"""Command line for the lookalikes: `python -m lookalikes --out DIR`.

Owns argument parsing and the one-line-per-dataset summary; building is in the builders. A bad
argument is one line, `lookalikes: error: <message>`, exit code 2 (contract/cli.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from contract.cli import run_click

from . import MANIFEST_NAME, build_infovqa, build_llava_video, build_mantis

BUILDERS = {"mantis": build_mantis, "infovqa": build_infovqa, "llava-video": build_llava_video}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@click.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Parent folder of the dataset folders (each is replaced).")
@click.option("--only", default=",".join(BUILDERS), show_default=True,
              help="Comma-separated datasets to build.")
@click.option("--pitfalls/--no-pitfalls", default=True, show_default=True,
              help="Plant the pitfalls (bad rows, odd files) listed in each manifest.")
@click.option("--seed", default=0, show_default=True, type=int)
def cli(out: Path, only: str, pitfalls: bool, seed: int) -> None:
    """Build local lookalikes of the hub datasets under OUT."""
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BUILDERS))
    if unknown or not names:
        raise click.BadParameter(f"unknown {unknown}, expected some of {sorted(BUILDERS)}",
                                 param_hint="--only")
    for name in names:
        start = time.perf_counter()
        root = BUILDERS[name](out, pitfalls=pitfalls, seed=seed)
        manifest = json.loads((root / MANIFEST_NAME).read_text())
        click.echo(f"{name}: {root} rows={sum(manifest['rows'].values())} "
                   f"samples={sum(manifest['expected_samples'].values())} "
                   f"rejects={manifest['expected_rejects']} fixups={manifest['expected_fixups']} "
                   f"{_size(root) / 1e6:.2f} MB in {time.perf_counter() - start:.1f} s")


def main(argv: list[str] | None = None) -> int:
    """The command line (contract/cli.py); returns the exit code."""
    return run_click(cli, "lookalikes", argv)


if __name__ == "__main__":
    sys.exit(main())
