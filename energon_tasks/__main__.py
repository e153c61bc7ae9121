"""Command line of the task-encoder package: ``python -m energon_tasks <command> ...``.

This module owns the command group and the ``grid`` command (model geometry of given image / video
sizes, printed as JSON). Later commands live in their own modules and join the group with
``cli.add_command(...)`` here. Every user error ends as one line on stderr,
``energon_tasks: error: <message>``, and exit code 2 (contract/cli.py); a bug is a traceback.
"""

from __future__ import annotations

import json
import sys

import click

from contract.cli import run_click
from energon_tasks.families import Geometry
from energon_tasks.image_grid import ImageGrid
from energon_tasks.profiles import get_geometry


class _Size(click.ParamType):
    """Click type of a size "HxW" (or "FRAMESxHxW") of positive integers -> tuple of ints."""

    def __init__(self, parts: tuple[str, ...], example: str) -> None:
        self.parts, self.example = parts, example
        self.name = "x".join(parts)

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        fields = str(value).lower().split("x")
        if len(fields) != len(self.parts) or not all(f.isdigit() and int(f) > 0 for f in fields):
            self.fail(f"{value!r} is not {self.name} (positive integers, e.g. {self.example})")
        return tuple(int(f) for f in fields)


class _MediaOrderCommand(click.Command):
    """Records the order of --image / --video flags on the command line (click groups by option)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        flags = (arg.split("=", 1)[0] for arg in args)
        ctx.meta["media_order"] = [flag for flag in flags if flag in ("--image", "--video")]
        return super().parse_args(ctx, args)


@click.group()
def cli() -> None:
    """Tools of the Energon task encoders (VLM SFT)."""


def _image_entry(geometry: Geometry, size: tuple[int, int], options: dict) -> dict:
    grid = geometry.image_grid(
        *size, min_pixels=options["min_pixels"], max_pixels=options["max_pixels"]
    )
    return {"kind": "image", "input": list(size), **_grid_fields(grid)}


def _video_entry(geometry: Geometry, size: tuple[int, int, int], options: dict) -> dict:
    frames, height, width = size
    if options["source_fps"] is not None:
        frames = len(
            geometry.video_frame_indices(
                frames,
                options["source_fps"],
                video_fps=options["video_fps"],
                max_num_frames=options["max_num_frames"],
            )
        )
    grid = geometry.video_grid(
        frames,
        height,
        width,
        min_pixels=options["video_min_pixels"],
        max_pixels=options["video_max_pixels"],
    )
    return {"kind": "video", "input": list(size), **_grid_fields(grid), "frames_sampled": frames}


def _grid_fields(grid: ImageGrid) -> dict:
    return {
        "resized_height": grid.resized_height,
        "resized_width": grid.resized_width,
        "grid_thw": list(grid.grid_thw),
        "visual_tokens": grid.visual_tokens,
    }


@cli.command(cls=_MediaOrderCommand)
@click.option("--model", required=True,
              help="qwen2_5_vl, qwen3_vl, nemotron_omni or nemotron_omni_tiled (also spelled "
                   "qwen2.5-vl, qwen3-vl, nemotron-omni, nemotron-omni-tiled).")
@click.option(
    "--image", "images", multiple=True, type=_Size(("H", "W"), "480x640"),
    help="Image HxW: height x width (as preview prints sizes), e.g. 480x640 for a landscape "
         "640 wide."
)
@click.option(
    "--video",
    "videos",
    multiple=True,
    type=_Size(("FRAMES", "H", "W"), "16x480x640"),
    help="Video FRAMESxHxW (frames x height x width): all its frames, or those already "
         "sampled without --source-fps.",
)
@click.option("--source-fps", type=float, help="Frame rate of the videos: sample them first.")
@click.option("--video-fps", type=float, help="Sampling rate (default: the model's, 2).")
@click.option("--max-num-frames", type=int, help="Frame cap of sampling (default: 768).")
@click.option("--min-pixels", type=int, help="Image area floor (default: the model's).")
@click.option("--max-pixels", type=int, help="Image area ceiling (default: the model's).")
@click.option("--video-min-pixels", type=int, help="Video area floor (per frame or per clip).")
@click.option("--video-max-pixels", type=int, help="Video area ceiling (per frame or per clip).")
@click.pass_context
def grid(ctx: click.Context, model: str, images, videos, **options) -> None:
    """Print resize size, patch grid and visual tokens of each input as a JSON list.

    Entries follow the command-line order of --image / --video.
    """
    try:
        geometry = get_geometry(model)
    except ValueError as error:  # an unknown --model (the message lists the valid ones)
        raise click.BadParameter(str(error), param_hint="--model") from None
    if not images and not videos:
        raise click.UsageError("give at least one --image HxW or --video FRAMESxHxW")
    sampling = ("video_fps", "max_num_frames")
    if options["source_fps"] is None and any(options[k] is not None for k in sampling):
        raise click.UsageError("--video-fps and --max-num-frames need --source-fps")
    queues = {"--image": iter(images), "--video": iter(videos)}
    builders = {"--image": _image_entry, "--video": _video_entry}
    try:
        entries = [builders[flag](geometry, next(queues[flag]), options)
                   for flag in ctx.meta["media_order"]]
    except ValueError as error:  # the geometry's checks of the sizes and knobs given here
        raise click.UsageError(str(error)) from None
    click.echo(json.dumps(entries, indent=2))


from energon_tasks.inspect_cmd import inspect  # noqa: E402
from energon_tasks.preview_cmd import preview  # noqa: E402

cli.add_command(inspect)
cli.add_command(preview)


def main(argv: list[str] | None = None) -> int:
    """The command line (contract/cli.py); returns the exit code."""
    return run_click(cli, "energon_tasks", argv)


if __name__ == "__main__":
    sys.exit(main())
