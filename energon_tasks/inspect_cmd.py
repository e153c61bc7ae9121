"""``python -m energon_tasks inspect``: predict the budget's effect from shard metadata only.

This module owns the dry run: it reads only the ``K.json`` members of a split's shards (tarfile;
no pixel is decoded), runs the task encoder's own planner (``VLMTaskEncoder.plan_sample``, the
encoder of ``--model`` from ``energon_tasks.task_encoder.task_encoder_for``, so
the prediction is what the loader does) and reports how many samples are kept / resized /
frame-sampled / cut / skipped per reason, the distributions of text, visual and total tokens, and
optionally PNG histograms. Only decode-time skips (corrupt media bytes) are not predictable here.
It also provides ``iter_samples``, the shard reader ``preview`` uses.
"""

from __future__ import annotations

import json
import tarfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import click
import numpy as np
import yaml

from contract.bounded_yaml import safe_load
from contract.families import QWEN2_5_VL
from energon_tasks.config import TaskEncoderConfig
from energon_tasks.dataset_files import check_dataset_files

#: Budget knobs exposed as options: (option name, config field, type).
KNOBS = [
    ("--min-pixels", "min_pixels", int),
    ("--max-pixels", "max_pixels", int),
    ("--video-min-pixels", "video_min_pixels", int),
    ("--video-max-pixels", "video_max_pixels", int),
    ("--video-fps", "video_fps", float),
    ("--max-num-frames", "max_num_frames", int),
    ("--max-num-images", "max_num_images", int),
    ("--max-visual-tokens", "max_visual_tokens", int),
    ("--seq-length", "seq_length", int),
    ("--max-num-tiles", "max_num_tiles", int),
    ("--video-maintain-aspect-ratio", "video_maintain_aspect_ratio", bool),
]


def shard_paths(dataset_dir: Path, split: str) -> list[Path]:
    """Tar files of a split part, from ``.nv-meta/split.yaml`` (brace patterns expanded).

    Raises:
        click.UsageError: no such split part (the message lists the existing ones).
        UsageError: a dataset file names code or holds what the project's datasets do not
            (``energon_tasks.dataset_files``: inspect and preview read as the loader does).
    """
    import braceexpand

    check_dataset_files(dataset_dir)

    splits = safe_load((dataset_dir / ".nv-meta" / "split.yaml").read_text())["split_parts"]
    if split not in splits:
        raise click.UsageError(f"{dataset_dir}: no split part {split!r}; have {sorted(splits)}")
    return [dataset_dir / name for pattern in splits[split]
            for name in braceexpand.braceexpand(pattern)]


def iter_samples(
    dataset_dir: Path, split: str, *, with_media: bool = False
) -> Iterator[tuple[str, bytes, dict[str, bytes]]]:
    """(key, K.json bytes, media parts) of every sample of a split, in shard order.

    Without ``with_media`` only the JSON members are read (media dict empty).
    """
    for path in shard_paths(dataset_dir, split):
        with tarfile.open(path) as tar:
            key, doc, media = None, None, {}
            for member in tar:
                name_key, _, part = member.name.partition(".")
                if name_key != key:
                    if doc is not None:
                        yield key, doc, media
                    key, doc, media = name_key, None, {}
                if part == "json":
                    doc = tar.extractfile(member).read()
                elif with_media:
                    media[part] = tar.extractfile(member).read()
            if doc is not None:
                yield key, doc, media


def _stats(values: list[int]) -> dict:
    if not values:
        return {"count": 0}
    array = np.asarray(values)
    quantiles = np.percentile(array, [50, 90, 99]).round(1).tolist()
    return {"count": len(values), "min": int(array.min()), "p50": quantiles[0],
            "p90": quantiles[1], "p99": quantiles[2], "max": int(array.max()),
            "mean": round(float(array.mean()), 1), "sum": int(array.sum())}


def predict(dataset_dir: Path, split: str, encoder) -> dict:
    """Counters and token distributions the loader will produce for one epoch of ``split``."""
    from energon_tasks.sample_format import CanonicalSample

    counters, tokens = Counter(), {"text": [], "visual": [], "total": []}
    for key, doc, _ in iter_samples(dataset_dir, split):
        plan = encoder.plan_sample(CanonicalSample.from_json(doc), key)
        counters.update(plan.counters())
        if not plan.skip:
            tokens["text"].append(plan.text_tokens)
            tokens["visual"].append(plan.visual_tokens)
            tokens["total"].append(plan.total_tokens)
    return {"dataset": str(dataset_dir), "split": split, "config": encoder.config.to_dict(),
            "counters": dict(sorted(counters.items())),
            "tokens": {name: _stats(values) for name, values in tokens.items()},
            "_values": tokens}


def _integer_bins(values: list[int]) -> np.ndarray:
    """Bin edges for integer counts: one bin per integer, or an integer width that gives at
    most 40 bins; edges at half-integers so each bar is centred on the counts it holds."""
    low, high = (min(values), max(values)) if values else (0, 0)
    step = max(1, -(-(high - low + 1) // 40))
    return np.arange(low, high + step + 1, step) - 0.5


def write_histograms(report: dict, out: Path) -> Path:
    """One PNG with the text / visual / total token histograms of the kept samples: integer
    bins, axis labels with units, n and median per panel; the title names the dataset, the
    split, the model (task encoder profile) and the sequence length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for axis, (name, values) in zip(axes, report["_values"].items(), strict=True):
        axis.hist(values or [0], bins=_integer_bins(values), color="#4878a8")
        median = f"{np.median(values):g}" if values else "-"
        axis.set_title(f"{name} tokens per kept sample\nn = {len(values)}, median {median}",
                       fontsize=9)
        axis.set_xlabel("tokens per sample")
        axis.set_ylabel("samples")
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.yaxis.get_major_locator().set_params(integer=True)
        axis.grid(alpha=0.3)
    config = report["config"]
    figure.suptitle(f"{Path(report['dataset']).name} [{report['split']}], model "
                    f"{config['model']}: seq_length {config['seq_length']}, max_visual_tokens "
                    f"{config['max_visual_tokens']}", fontsize=10)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=80, metadata={"Software": None})
    plt.close(figure)
    return out


def run_config_task_encoder(path: Path | None) -> dict:
    """The ``task_encoder`` section of a train.py run config (YAML), or {}.

    Raises:
        click.UsageError: the file is not YAML or has no such mapping.
    """
    if path is None:
        return {}
    try:
        section = (safe_load(path.read_text()) or {}).get("task_encoder") or {}
    except (OSError, yaml.YAMLError, AttributeError) as error:
        raise click.UsageError(f"--config {path}: not a run config ({error})") from None
    if not isinstance(section, dict):
        raise click.UsageError(f"--config {path}: task_encoder is not a mapping")
    section.pop("context_parallel_size", None)  # follows parallel.cp in train.py
    return section


def make_encoder(model: str | None, tokenizer: str | None, knobs: dict,
                 config: Path | None = None):
    """The model's task encoder (``task_encoder_for``): the run config's ``task_encoder``
    section (``--config``), then the options given; the tokenizer from a hub id, a local folder
    or ``test``."""
    from energon_tasks.task_encoder import task_encoder_for
    from energon_tasks.tokenizer import load_tokenizer

    values = {"model": QWEN2_5_VL, **run_config_task_encoder(config),
              **{k: v for k, v in {"model": model, "tokenizer": tokenizer, **knobs}.items()
                 if v is not None}}
    try:
        settings = TaskEncoderConfig.from_dict(values)
        loaded = load_tokenizer(settings.resolve().tokenizer, settings.model, hint=TOKENIZER_HINT)
        return task_encoder_for(settings, loaded)
    except ValueError as error:  # config problems, or a tokenizer that cannot be loaded
        raise click.ClickException(str(error)) from None


TOKENIZER_HINT = ("pass --tokenizer test, --tokenizer <local tokenizer folder>, or --config "
                  "<run config>")


def knob_options(function):
    """Decorate a click command with the budget knobs, --model, --tokenizer and --config."""
    for flag, field, kind in reversed(KNOBS):
        function = click.option(flag, field, type=kind, help=f"TaskEncoderConfig.{field}")(function)
    function = click.option(
        "--config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="A train.py run config: its task_encoder section (model, tokenizer, budget knobs) "
             "is the default of these options.")(function)
    function = click.option(
        "--tokenizer", help="Hub id, local folder, or `test` (the tests' small tokenizer); "
                            "default: the run config's, else the model's hub id.")(function)
    return click.option("--model", help="qwen2_5_vl, qwen3_vl, nemotron_omni or "
                                        "nemotron_omni_tiled, also spelled qwen2.5-vl, ... "
                                        "(default: the run config's, else qwen2_5_vl).")(function)


@click.command("inspect")
@click.argument("dataset_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--split", default="train", show_default=True, help="Split part to read.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--plots", type=click.Path(path_type=Path), help="Write histograms to this PNG.")
@knob_options
def inspect(dataset_dir, split, as_json, plots, model, tokenizer, config, **knobs) -> None:
    """Dry run of the budget over DATASET_DIR's metadata (no pixel decoded)."""
    check_dataset_files(dataset_dir)  # before anything else: the folder's YAML names no code
    report = predict(dataset_dir, split, make_encoder(model, tokenizer, knobs, config))
    if plots:
        write_histograms(report, plots)
    report.pop("_values")
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _print_report(dataset_dir, split, report)
    if plots:  # the last line says where the picture went (stderr: --json stays JSON)
        click.echo(f"[inspect] wrote the token histograms to {plots}", err=True)


def _print_report(dataset_dir: Path, split: str, report: dict) -> None:
    click.echo(f"{dataset_dir} [{split}]: {report['counters'].get('samples', 0)} samples")
    for name, count in report["counters"].items():
        click.echo(f"  {name:28s} {count}")
    for name, stats in report["tokens"].items():
        shown = ", ".join(f"{k} {v}" for k, v in stats.items())
        click.echo(f"  {name} tokens: {shown}")
