"""Command line: `python -m converters {mantis,infovqa,llava-video,finalize} ...`.

Each dataset command converts a source (hub id by default, or a local folder with the hub's
layout) into one Energon dataset at `--out`, then prints the summary. Bad arguments give one line
on stderr and exit code 2; bad data never stops a run (see rejects.jsonl).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from converters.base import UsageError
from converters.pipeline import Options, convert, precheck

_DEFAULT_SHARD_SIZE = {"mantis": 1000, "infovqa": 200, "llava-video": 100}


def _csv(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def common_options(dataset: str, hub_id: str):
    """Options every dataset command shares."""

    def decorate(fn):
        options = [
            click.option("--source", default=hub_id, show_default=True,
                         help="Hub id, or a local folder with the hub's layout."),
            click.option("--out", required=True, type=click.Path(path_type=Path),
                         help="Output folder: the Energon dataset."),
            click.option("--configs", help="Comma-separated source configs (default: all)."),
            click.option("--splits", help="Comma-separated source splits (default: all)."),
            click.option("--workers", default=1, show_default=True, type=int),
            click.option("--num-partitions", default=1, show_default=True, type=int,
                         help="Machines sharing the conversion (e.g. a SLURM array size)."),
            click.option("--partition-index", default=0, show_default=True, type=int),
            click.option("--val-fraction", default=0.01, show_default=True, type=float,
                         help="Share of train carved out as val when a config has no val split."),
            click.option("--shard-size", default=_DEFAULT_SHARD_SIZE[dataset],
                         show_default=True, type=int, help="Samples per shard."),
            click.option("--energon-media-metadata", is_flag=True,
                         help="Also store Energon's media metadata in .nv-meta/index.sqlite "
                              "(K.json always has it; ~2 ms per image at the final step)."),
        ]
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def _run(make_source, out: Path, **options) -> None:
    try:
        opts = Options(out=out, **options)
        precheck(opts)  # before opening the source, which may download or cache a lot
        summary = convert(make_source(), opts)
    except UsageError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    _report(out, summary)


def _report(out: Path, summary: dict | None) -> None:
    if summary is None:
        click.echo(f"partition done; the dataset at {out} is finalized by the last partition "
                   "(or `python -m converters finalize --out ...`)")
        return
    shown = {k: summary[k] for k in ("rows_read", "rows_written", "samples_written", "rejected",
                                     "rejected_by_reason", "fixups_by_kind", "samples_by_split",
                                     "shards", "conversion")}
    click.echo(json.dumps(shown, indent=1))
    if summary["rejected_by_reason"].get("internal_error"):
        click.echo(f"warning: {summary['rejected_by_reason']['internal_error']} rows hit an "
                   f"unexpected error, see {out}/rejects.jsonl", err=True)


@click.group()
def cli():
    """Convert Hugging Face VLM datasets into Megatron-Energon shards (docs/format.md)."""


def dataset_command(dataset: str, hub_id: str, *extra_options):
    """Register `fn(source, out, configs, splits, **extra) -> SourceDataset` as a command."""

    def decorate(fn):
        @functools.wraps(fn)
        def command(source, out, configs, splits, workers, num_partitions, partition_index,
                    val_fraction, shard_size, energon_media_metadata, **extra):
            def make_source():
                from converters.hub import Source

                cache = out / ".work" / "datasets_cache"
                return fn(Source(source, cache), out, _csv(configs), _csv(splits), **extra)

            _run(make_source, out, workers=workers, num_partitions=num_partitions,
                 partition_index=partition_index, val_fraction=val_fraction,
                 shard_size=shard_size, energon_media_metadata=energon_media_metadata)

        for option in reversed(extra_options):
            command = option(command)
        return cli.command(dataset, help=fn.__doc__)(common_options(dataset, hub_id)(command))

    return decorate


@dataset_command("mantis", "TIGER-Lab/Mantis-Instruct")
def mantis(source, out, configs, splits):
    """TIGER-Lab/Mantis-Instruct: interleaved multi-image conversations."""
    from converters.mantis import MantisSource

    return MantisSource(source, configs, splits)


@dataset_command("infovqa", "Ahren09/InfoVQA",
                 click.option("--one-question-per-sample", is_flag=True,
                              help="One sample per question instead of one per infographic."))
def infovqa(source, out, configs, splits, one_question_per_sample=False):
    """Ahren09/InfoVQA (or lmms-lab/DocVQA InfographicVQA): high-resolution infographics."""
    from converters.infovqa import InfoVQASource

    return InfoVQASource(source, configs, splits, one_question_per_sample)


@dataset_command("llava-video", "lmms-lab/LLaVA-Video-178K")
def llava_video(source, out, configs, splits):
    """lmms-lab/LLaVA-Video-178K: video conversations (videos from the tar.gz parts)."""
    from converters.llava_video import LlavaVideoSource

    return LlavaVideoSource(source, out / ".work", configs, splits)


@cli.command("finalize")
@click.option("--out", required=True, type=click.Path(path_type=Path))
@click.option("--workers", default=1, type=int)
def finalize_command(out: Path, workers: int):
    """Index the union of all partitions' shards (run once all partitions are done)."""
    from converters.finalize import finalize

    try:
        _report(out, finalize(out, workers=workers))
    except UsageError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    cli()
