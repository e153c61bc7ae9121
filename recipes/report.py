"""Training report: loss curves (PNG) and a short markdown summary of runs' metrics.jsonl.

`python -m recipes.report OUT RUN [RUN ...] [--pair WITH:BLANKED]` reads each run folder's
`metrics.jsonl` (written by train.py; each step counted once, the last record of a step wins),
plots every loss curve (and validation loss, dashed) into `OUT/loss_curves.png`, writes
`OUT/report.md` (first/last loss, last val_loss, median step time, throughput) and prints the
same table. A
`--pair` compares a run with media against the same run with media blanked (the vision-signal
check): the mean loss of the last quarter of steps must be clearly higher without media.
`--eval NAME=DIR` adds eval.py's overall score from DIR/scores.json, and `--eval-pair A:B`
checks that the score with media (A) is clearly above the blanked one (B) and above `--chance`.
A bad argument (a run folder without metrics.jsonl, a --pair / --eval that names no run) is one
line, `recipes.report: error: <message>`, exit code 2 (contract/cli.py).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import click

from contract.cli import run_click

#: The blanked run must end at least this much higher (relative) for the check to pass.
VISION_SIGNAL_MARGIN = 0.10
#: Accuracy with media must beat the blanked run and chance by this much (absolute).
ACCURACY_MARGIN = 0.10


def _records(run: Path, field: str) -> list[dict]:
    """The records of ``metrics.jsonl`` that hold ``field``, one per step (the last one written:
    a resumed run replays steps), in step order."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise click.ClickException(f"{run}: no metrics.jsonl (did the run finish?)")
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip() and field in (record := json.loads(line)):
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def read_metrics(run: Path) -> list[dict]:
    """The training records of a run (``loss``, throughput, ...), one per logged step."""
    return _records(run, "loss")


def read_validation(run: Path) -> list[dict]:
    """The validation records of a run (``val_loss``), one per evaluated step."""
    return _records(run, "val_loss")


def tail_loss(rows: list[dict]) -> float:
    """Mean loss over the last quarter of the logged steps."""
    tail = rows[-max(1, len(rows) // 4):]
    return statistics.fmean(r["loss"] for r in tail)


def _split(item: str, sep: str, option: str, names=None) -> tuple[str, str]:
    """``A<sep>B`` of an option value (each a name among ``names`` when given)."""
    first, found, second = item.partition(sep)
    if not (found and first and second):
        raise click.BadParameter(f"{item!r} is not A{sep}B", param_hint=option)
    unknown = [n for n in (first, second) if names is not None and n not in names]
    if unknown:
        raise click.BadParameter(f"{item!r}: {unknown[0]!r} is none of {sorted(names)}",
                                 param_hint=option)
    return first, second


def summarize(name: str, rows: list[dict], val: list[dict] = ()) -> dict:
    return {
        "run": name,
        "steps": rows[-1]["step"],
        "loss_first": round(rows[0]["loss"], 4),
        "loss_last": round(rows[-1]["loss"], 4),
        "loss_tail_mean": round(tail_loss(rows), 4),
        "val_loss_last": round(val[-1]["val_loss"], 4) if val else "-",
        "step_time_s_median": round(statistics.median(r["step_time_s"] for r in rows), 3),
        "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in rows), 1),
        "samples_per_s_median": round(statistics.median(r["samples_per_s"] for r in rows), 2),
        "visual_tokens_per_s_median": round(
            statistics.median(r["visual_tokens_per_s"] for r in rows), 1),
    }


def vision_signal(with_media: list[dict], blanked: list[dict]) -> dict:
    a, b = tail_loss(with_media), tail_loss(blanked)
    return {"loss_with_media": round(a, 4), "loss_media_blanked": round(b, 4),
            "relative_gap": round((b - a) / b, 4) if b else 0.0,
            "passed": b > a * (1 + VISION_SIGNAL_MARGIN)}


def run_info(run: Path) -> tuple[str, str]:
    """(model family, dataset) of a run folder, from the resolved config train.py wrote there
    (the dataset: the folder its ``data.path`` names); ("", the run's name) without one."""
    from contract.bounded_yaml import safe_load

    config = run / "config.yaml"
    if not config.is_file():
        return "", run.name
    raw = safe_load(config.read_text()) or {}
    path = Path(str((raw.get("data") or {}).get("path") or run.name))
    dataset = path.parent.name if path.suffix in (".yaml", ".yml") else path.name
    return str((raw.get("model") or {}).get("family", "")), dataset


def plot(path: Path, runs: dict[str, list[dict]], validation: dict[str, list[dict]],
         info: dict[str, tuple[str, str]], pairs: list[tuple[str, str]]) -> None:
    """One panel per dataset (training loss solid, validation loss dashed with markers, one
    colour per family) and one for the vision-signal pairs (with media solid, blanked dashed,
    one colour per family); legends beside the panels; log loss axis with 1-2-5 ticks (every
    integer multiple when the panel spans under a decade)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    paired = {name for pair in pairs for name in pair}
    panels: dict[str, list[str]] = {}
    for name in runs:
        if name not in paired:
            panels.setdefault(info[name][1], []).append(name)
    if pairs:
        panels["vision-signal check (solid: with media, dashed: blanked)"] = [
            name for pair in pairs for name in pair]
    families = sorted({family for family, _ in info.values()})
    colour = {family: f"C{i}" for i, family in enumerate(families)}
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.8 * len(panels)), squeeze=False)
    for ax, (title, names) in zip(axes[:, 0], panels.items()):
        for name in names:
            family, style = info[name][0], "--" if name in {b for _, b in pairs} else "-"
            rows = runs[name]
            ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], style,
                    color=colour[family], label=name, linewidth=1.2)
            if validation.get(name):
                val = validation[name]
                ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--",
                        color=colour[family], label=f"{name} (val)", markersize=4,
                        linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
        ax.set_ylabel("loss per supervised token")
        ax.set_yscale("log")
        low, high = ax.get_ylim()  # under a decade: a tick on every integer multiple
        subs = (1.0, 2.0, 5.0) if high / low > 10 else tuple(float(k) for k in range(1, 10))
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--pair", "pairs", multiple=True,
              help="WITH_MEDIA_RUN:BLANKED_RUN (folder names among RUNS): vision-signal check.")
@click.option("--eval", "evals", multiple=True, help="NAME=DIR of an eval.py output.")
@click.option("--eval-pair", "eval_pairs", multiple=True, help="WITH_MEDIA:BLANKED eval names.")
@click.option("--chance", default=0.0, help="Chance accuracy of the --eval-pair questions.")
def cli(out: Path, runs: tuple[Path, ...], pairs: tuple[str, ...], evals: tuple[str, ...],
         eval_pairs: tuple[str, ...], chance: float) -> None:
    """Plot loss curves and write report.md for the given run folders."""
    metrics = {run.name: read_metrics(run) for run in runs}
    validation = {run.name: read_validation(run) for run in runs}
    info = {run.name: run_info(run) for run in runs}
    paired = [_split(pair, ":", "--pair", metrics) for pair in pairs]
    out.mkdir(parents=True, exist_ok=True)
    plot(out / "loss_curves.png", metrics, validation, info, paired)
    rows = [summarize(name, m, validation[name]) for name, m in metrics.items()]
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(r[k]) for k in header) + " |" for r in rows]
    checks = []
    for with_media, blanked in paired:
        result = vision_signal(metrics[with_media], metrics[blanked])
        checks.append({"with_media": with_media, "blanked": blanked,
                       "family": info[with_media][0], **result})
    text = ["# Training report", "", *lines, "", "![loss curves](loss_curves.png)", ""]
    for c in checks:
        verdict = "PASSED" if c["passed"] else "NOT PASSED"
        text.append(f"Vision-signal check {verdict} ({c['family'] or c['with_media']}): tail "
                    f"loss with media {c['loss_with_media']}"
                    f" vs media blanked {c['loss_media_blanked']} (gap {c['relative_gap']:.0%},"
                    f" needs > {VISION_SIGNAL_MARGIN:.0%}).")
    scores = {}
    for item in evals:
        name, folder = _split(item, "=", "--eval")
        if not (Path(folder) / "scores.json").is_file():
            raise click.BadParameter(f"{folder}: no scores.json (an eval.py output folder?)",
                                     param_hint="--eval")
        found = json.loads((Path(folder) / "scores.json").read_text())
        scores[name] = {**found["overall"], "family": found.get("family", "")}
    if scores:
        text += ["| eval | questions | score |", "|---|---|---|"]
        text += [f"| {n} | {v['n']} | {v['score']:.3f} |" for n, v in scores.items()]
    for pair in eval_pairs:
        with_media, blanked = (scores[n]["score"] for n in _split(pair, ":", "--eval-pair",
                                                                  scores))
        passed = with_media > max(blanked, chance) + ACCURACY_MARGIN
        family = scores[pair.split(":")[0]]["family"] or pair
        checks.append({"eval_pair": pair, "family": family, "score_with_media": with_media,
                       "score_media_blanked": blanked, "chance": chance, "passed": passed})
        text.append(f"Accuracy check {'PASSED' if passed else 'NOT PASSED'} ({family}): with media "
                    f"{with_media:.3f} vs blanked {blanked:.3f}, chance {chance:.3f} (needs "
                    f"+{ACCURACY_MARGIN:.2f} over both).")
    (out / "report.md").write_text("\n".join(text) + "\n")
    (out / "report.json").write_text(json.dumps({"runs": rows, "checks": checks,
                                                 "scores": scores}, indent=1))
    click.echo("\n".join(text))


def main(argv: list[str] | None = None) -> int:
    """The command line (contract/cli.py); returns the exit code."""
    return run_click(cli, "recipes.report", argv)


if __name__ == "__main__":
    sys.exit(main())
