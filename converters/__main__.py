"""Command line: `python -m converters {mantis,infovqa,llava-video,finalize} ...`.

Each dataset command converts a source (hub id by default, or a local folder with the hub's
layout) into one Energon dataset at `--out`, then prints the summary. Bad data never stops a run
(see rejects.jsonl). What does stop one is ONE line on stderr, `converters: error: <message>`
(contract/cli.py): bad arguments, a source that cannot be planned, an `--out` in use by another
run (exit 2); a conversion with no sample, a full disk, a dead worker (exit 1); SIGINT / SIGTERM
(exit 130 / 143). After any of them the same command resumes. A bug is a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from contract.cli import run_click
from contract.console import DEFAULT_EVERY_S
from contract.errors import RunFailure
from converters.lock import LockedError
from converters.media import DEFAULT_LIMITS, Limits
from converters.pipeline import Interrupted, Options, convert, precheck

_DEFAULT_SHARD_SIZE = {"mantis": 1000, "infovqa": 200, "llava-video": 100}


def _csv(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def common_options(dataset: str, hub_id: str):
    """Options every dataset command shares."""

    def decorate(fn):
        options = [
            click.option("--source", default=hub_id, show_default=True,
                         help="Hub id, or a local folder with the hub's layout."),
            click.option("--revision",
                         help="Branch, tag or commit id of a hub --source (default: main), "
                              "resolved once to a commit that every read uses; a resumed run "
                              "continues at the commit it recorded."),
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
            click.option("--max-image-pixels", default=DEFAULT_LIMITS.max_image_pixels,
                         show_default=True, type=click.IntRange(1),
                         help="Reject images with more pixels (the size PIL reads from the "
                              "header is checked before decoding, and the image must then "
                              "decode whole)."),
            click.option("--max-member-bytes", default=DEFAULT_LIMITS.max_member_bytes,
                         show_default=True, type=click.IntRange(1),
                         help="Reject archive members / files larger than this without reading "
                              "them into memory."),
            click.option("--max-video-frames", default=DEFAULT_LIMITS.max_video_frames,
                         show_default=True, type=click.IntRange(1),
                         help="Reject videos with more frames (counted by demuxing)."),
            click.option("--max-video-seconds", default=DEFAULT_LIMITS.max_video_seconds,
                         show_default=True, type=click.FloatRange(min=0, min_open=True),
                         help="Reject videos lasting longer (measured from the packets)."),
            click.option("--restart", is_flag=True,
                         help="Discard what an earlier (interrupted) run left in --out and "
                              "convert from scratch, e.g. after the source changed."),
            click.option("--max-video-pixels", default=DEFAULT_LIMITS.max_video_pixels,
                         show_default=True, type=click.IntRange(1),
                         help="Reject videos whose frames have more pixels (read from the "
                              "stream, and for MJPEG from the first frame's JPEG header, "
                              "before decoding; the decoder is capped too)."),
            click.option("--progress-interval", default=DEFAULT_EVERY_S, show_default=True,
                         type=click.FloatRange(min=0),
                         help="Seconds between progress lines when stderr is not a terminal."),
        ]
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def _guarded(run, out: Path):
    """Run `run()`; a signal or an OS error that stops it becomes a `RunFailure` (one line and
    its exit code; the other failures already are one, or a user error)."""
    try:
        return run()
    except Interrupted as exc:
        raise RunFailure(f"interrupted ({exc}); run the same command again to resume",
                         128 + exc.signum) from None
    except KeyboardInterrupt:
        raise RunFailure("interrupted; run the same command again to resume", 130) from None
    except OSError as exc:
        raise RunFailure(f"{exc.strerror or exc} ({exc.filename or out})") from None


def _run(make_source, out: Path, **options) -> None:
    def run():
        opts = Options(out=out, **options)
        precheck(opts)  # before opening the source, which may download or cache a lot
        return convert(make_source, opts)

    _report(out, _guarded(run, out))


def _report(out: Path, summary: dict | None) -> None:
    if summary is None:
        click.echo(f"partition done; the dataset at {out} is finalized by the last partition to "
                   "finish (or `python -m converters finalize --out ...`)")
        return
    shown = {k: summary.get(k) for k in ("rows_read", "rows_written", "samples_written",
                                         "rejected", "rejected_by_reason", "ids_from_row",
                                         "fixups_by_kind",
                                         "samples_by_split", "skipped_configs", "shards",
                                         "conversion")}
    click.echo(json.dumps(shown, indent=1))
    if summary["rejected_by_reason"].get("internal_error"):
        click.echo(f"warning: {summary['rejected_by_reason']['internal_error']} rows hit an "
                   f"unexpected error, see {out}/rejects.jsonl", err=True)
    click.echo(f"[converters] wrote the Energon dataset to {out} (train on "
               f"{out / 'metadataset.yaml'}; rejects.jsonl, summary.json, stats.json, "
               "stats_histograms.png beside it)", err=True)


@click.group()
def cli():
    """Convert Hugging Face VLM datasets into Megatron-Energon shards (docs/format.md)."""


def dataset_command(dataset: str, hub_id: str, *extra_options):
    """Register `fn(source, out, configs, splits, **extra) -> SourceDataset` as a command."""

    def decorate(fn):
        @functools.wraps(fn)
        def command(source, revision, out, configs, splits, workers, num_partitions,
                    partition_index, val_fraction, shard_size, energon_media_metadata,
                    max_image_pixels, max_member_bytes, max_video_frames, max_video_seconds,
                    max_video_pixels, restart, progress_interval, **extra):
            limits = Limits(max_image_pixels=max_image_pixels, max_member_bytes=max_member_bytes,
                            max_video_frames=max_video_frames,
                            max_video_seconds=max_video_seconds,
                            max_video_pixels=max_video_pixels)

            def make_source():  # under the partition's lock
                from converters.hub import Source
                from converters.pipeline import recorded_source

                recorded, binds = recorded_source(out)  # none after --restart
                opened = Source(source, out / ".work" / "datasets_cache", revision,
                                recorded=recorded, recorded_binds=binds)
                return fn(opened, out, _csv(configs), _csv(splits), limits=limits, **extra)

            _run(make_source, out, workers=workers, num_partitions=num_partitions,
                 partition_index=partition_index, val_fraction=val_fraction,
                 shard_size=shard_size, energon_media_metadata=energon_media_metadata,
                 progress_interval=progress_interval, restart=restart)

        for option in reversed(extra_options):
            command = option(command)
        return cli.command(dataset, help=fn.__doc__)(common_options(dataset, hub_id)(command))

    return decorate


@dataset_command("mantis", "TIGER-Lab/Mantis-Instruct")
def mantis(source, out, configs, splits, limits):
    """TIGER-Lab/Mantis-Instruct: interleaved multi-image conversations."""
    from converters.mantis import MantisSource

    return MantisSource(source, configs, splits, limits=limits)


@dataset_command("infovqa", "Ahren09/InfoVQA",
                 click.option("--one-question-per-sample", is_flag=True,
                              help="One sample per question instead of one per infographic."))
def infovqa(source, out, configs, splits, limits, one_question_per_sample=False):
    """Ahren09/InfoVQA (or lmms-lab/DocVQA InfographicVQA): high-resolution infographics."""
    from converters.infovqa import InfoVQASource

    return InfoVQASource(source, configs, splits, one_question_per_sample, limits=limits)


@dataset_command("llava-video", "lmms-lab/LLaVA-Video-178K",
                 click.option("--frames-root", type=click.Path(path_type=Path),
                              help="A local copy of the frame folders of configs whose videos are "
                                   "not in the repository (llava_hound: ShareGPTVideo "
                                   "train_300k); without it those configs are skipped."),
                 click.option("--frames-fps", default=1.0, show_default=True,
                              type=click.FloatRange(min=0, min_open=True),
                              help="The rate the frames of --frames-root were taken at."))
def llava_video(source, out, configs, splits, limits, frames_root=None, frames_fps=1.0):
    """lmms-lab/LLaVA-Video-178K: video conversations (videos from the tar.gz parts)."""
    from converters.llava_video import LlavaVideoSource

    return LlavaVideoSource(source, out / ".work", configs, splits, limits=limits,
                            frames_root=frames_root, frames_fps=frames_fps)


@cli.command("finalize")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="The dataset folder every partition wrote into.")
@click.option("--workers", default=1, type=int, help="Workers for energon prepare.")
def finalize_command(out: Path, workers: int):
    """Index the union of all partitions' shards (run once all partitions are done)."""
    from converters.finalize import finalize
    from converters.pipeline import disk_errors, interruptible

    def run():
        with interruptible(), disk_errors():
            return finalize(out, workers=workers)

    _report(out, _guarded(run, out))


def main(argv: list[str] | None = None) -> int:
    """The command line (contract/cli.py); returns the exit code."""
    return run_click(cli, "converters", argv, (LockedError,))


if __name__ == "__main__":
    sys.exit(main())
