"""`make demo` (conversion part): lookalikes of the three datasets -> Energon datasets.

Builds small local copies of Mantis-Instruct, InfoVQA and LLaVA-Video-178K with the hub's exact
schema and layout (lookalikes), converts each with the same CLI users run, shows
`energon info` of every output and prints the accounting. Later stages (training, evaluation)
extend the demo from train.py. A bad argument is one line, `lookalikes.demo: error: <message>`,
exit code 2; a conversion that fails is the same line, exit code 1 (contract/cli.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from contract.cli import run_click
from contract.errors import RunFailure
from lookalikes import build_all, build_mantis

#: Rows of the vision-signal dataset: single-config Mantis lookalike whose every answer is the
#: colour of a shape in one of two images, so it can only be learnt from the pixels.
VISION_CHECK_ROWS = 300

#: (CLI command, lookalike name, extra options)
CONVERSIONS = (
    ("mantis", "mantis", ["--val-fraction", "0"]),
    ("infovqa", "infovqa", []),
    ("llava-video", "llava-video", ["--val-fraction", "0"]),
)


def run_conversions(out: Path, workers: int = 2) -> dict[str, dict]:
    """Build the lookalikes under out/sources and convert them into out/<dataset>."""
    sources = build_all(out / "sources")
    summaries = {}
    for command, name, extra in CONVERSIONS:
        target = out / command
        cmd = [sys.executable, "-m", "converters", command, "--source", str(sources[name]),
               "--out", str(target), "--workers", str(workers), *extra]
        click.echo(f"$ {' '.join(cmd[1:])}")
        if subprocess.run(cmd).returncode != 0:
            raise RunFailure(f"converting into {target} failed (its error is above); delete "
                             f"{out} to build the demo data afresh")
        summaries[command] = json.loads((target / "summary.json").read_text())
    return summaries


def build_vision_check(out: Path, workers: int = 2) -> Path:
    """The vision-signal dataset (answers depend only on the media) at out/vision-check."""
    root = build_mantis(out / "sources" / "vision-check",
                        configs={"birds-to-words": VISION_CHECK_ROWS}, pitfalls=False)
    target = out / "vision-check"
    subprocess.run([sys.executable, "-m", "converters", "mantis", "--source", str(root),
                    "--out", str(target), "--workers", str(workers), "--val-fraction", "0"],
                   check=True, stdout=subprocess.DEVNULL)
    return target


def show_energon_info(out: Path) -> None:
    energon = Path(sys.executable).with_name("energon")
    for command, _, _ in CONVERSIONS:
        click.echo(f"$ energon info {out / command}")
        subprocess.run([str(energon), "info", str(out / command)], check=True)


@click.command()
@click.option("--out", default="demo_out", type=click.Path(path_type=Path), show_default=True)
@click.option("--workers", default=2, show_default=True)
def cli(out: Path, workers: int) -> None:
    """Build lookalikes, convert them, show energon info and the accounting."""
    start = time.perf_counter()
    summaries = run_conversions(out, workers)
    build_vision_check(out, workers)
    show_energon_info(out)
    click.echo("\n== conversion summaries")
    for name, s in summaries.items():
        click.echo(f"{name:12s} rows {s['rows_read']:4d} -> samples {s['samples_written']:4d} "
                   f"{s['samples_by_split']}  rejected {s['rejected']} "
                   f"{s['rejected_by_reason']}  fixups {s['fixups_by_kind']}")
    click.echo(f"demo (conversion) done in {time.perf_counter() - start:.1f} s; outputs in {out}")


def main(argv: list[str] | None = None) -> int:
    """The command line (contract/cli.py); returns the exit code."""
    return run_click(cli, "lookalikes.demo", argv)


if __name__ == "__main__":
    sys.exit(main())
