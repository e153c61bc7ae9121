"""Evaluate a VLM checkpoint (Qwen-VL, Nemotron-Omni) on the val split: greedy answers, scores.

    python eval.py --ckpt CKPT [CONFIG] [key=value ...] [--split val] [--limit N] [--out DIR]
    make eval-qwen-vl-infovqa CKPT=runs/qwen_vl_infovqa LIMIT=50

The checkpoint is either a train.py checkpoint (a run folder, its ``checkpoints`` folder (the
newest complete step) or one ``step_N`` folder; loaded at this process's layout, TP=1; a MoE
model too big for one GPU: under torchrun with its experts over the ranks, ``expert_ranks``), whose
stored run config (recipes/run_config.py) decides what the model sees, exactly as in training:
its ``task_encoder`` section (every budget knob) and ``data.path``; or an imported Hugging Face
checkpoint (``python -m models.convert hf-to-mcore``: a baseline before fine-tuning), which needs
a run config (CONFIG). A CONFIG given with a train.py checkpoint only refines the stored one, and
``key=value`` overrides work as in training (``task_encoder.max_pixels=50176``). Output goes next
to the checkpoint (``eval_<step>``) unless --out says otherwise.

Each assistant turn of a val conversation is one question: the prompt is the conversation up to
that turn (earlier answers as given) ending with the assistant header; the references are the
turn's ``answers`` (or its content). Prompts go through the task encoder's own steps
(``tokenize_turns`` -> ``plan_sample`` -> ``decode_sample`` -> ``assemble``), are generated
greedily with a KV cache (models/generation/generate.py, batched, stop at ``<|im_end|>``), and are
scored: InfoVQA ANLS; multiple choice (options "A. ..." in the question) option accuracy; everything
else exact match (+ relaxed match). Writes ``predictions.jsonl`` and ``scores.json`` (last) under
--out and prints a table and the budget counters (and a progress line every --progress-every
seconds when stdout is not a terminal). Bad input: one line on stderr, exit code 2; a full
disk: one line, exit code 1, no scores.json left (``out_of_space``).
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click

from contract.errors import ConfigError, RunFailure, UsageError, disk_full


# ------------------------------------------------------------------ main
@dataclass(slots=True)
class Args:
    """The command line of eval.py."""

    ckpt: str
    config: str | None = None
    overrides: tuple[str, ...] = ()
    split: str = "val"
    limit: int | None = None
    out: str | None = None
    batch_size: int = 4
    max_new_tokens: int = 32
    turns: str = "all"
    blank_media: bool = False
    progress_every: float = 30.0
    expect: str | None = None  #: a train config whose family and dataset the checkpoint must have
    base: str | None = None  #: where a checkpoint's base is now, when it moved (``--base``)


def default_out(found, split: str, blank: bool) -> Path:
    """``eval_<checkpoint folder>[_<split>][_blank]`` beside the checkpoint."""
    suffix = (f"_{split}" if split != "val" else "") + ("_blank" if blank else "")
    return found.folder.parent / f"eval_{found.folder.name}{suffix}"


def format_table(result: dict) -> str:
    metrics = ["score", "anls", "option_acc", "exact", "relaxed"]
    rows = [("subset", "n", *metrics)]
    entries = [*result["subsets"].items(), *(
        (f"[{k}]", v) for k, v in result["datasets"].items()), ("[overall]", result["overall"])]
    for name, s in entries:
        rows.append((name, str(s["n"]), *(f"{s[m]:.3f}" if m in s else "-" for m in metrics)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))) for r in rows)


def check_args(args: Args) -> None:
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise UsageError("--batch-size and --max-new-tokens must be >= 1")


def load_config(args: Args):
    """The checkpoint and the run config that decides what its model sees (the stored one, refined
    by CONFIG and the overrides); its data and split must exist."""
    from models.checkpointing.checkpoint import read_checkpoint
    from recipes.data import check_data_path, check_split
    from recipes.run_config import load_run_config

    found = read_checkpoint(args.ckpt)
    if args.expect:
        check_expected(found, args.expect)
    if found.run_config is None and args.config is None:
        raise UsageError(f"--ckpt {args.ckpt} is an hf-to-mcore import, which stores no run "
                         "config: give one (e.g. configs/train_qwen_vl_infovqa.yaml)")
    cfg = load_run_config(args.config, args.overrides, stored=found.run_config)
    check_data_path(cfg.data.path)
    check_split(cfg.data.path, args.split)
    return found, cfg


def dataset_name(data_path: str) -> str:
    """The dataset a data path holds: its converter's name (``summary.json`` beside
    ``metadataset.yaml``), else the folder's name."""
    folder = Path(data_path)
    folder = folder.parent if folder.suffix in (".yaml", ".yml") else folder
    try:
        return str(json.loads((folder / "summary.json").read_text())["dataset"])
    except (OSError, ValueError, KeyError, TypeError):
        return folder.name


def check_expected(found, expect: str) -> None:
    """``--expect CONFIG`` (what ``make eval-<family>-<dataset>`` passes): the checkpoint's model
    is of CONFIG's make family (``contract.families.MAKE_FAMILIES``: ``make eval-qwen-vl-*``
    takes every Qwen family ``make train-qwen-vl-* HF=`` trains) and was trained on CONFIG's
    dataset (an hf-to-mcore import: the family only).

    Raises:
        UsageError: one line naming both, and the make target that fits when there is one.
    """
    from contract.families import MAKE_FAMILIES
    from recipes.make_targets import make_target
    from recipes.run_config import load_run_config

    target = load_run_config(expect)
    family, data = target.model.family, target.data.path
    ours = found.model_config.family
    trained = dataset_name(found.run_config["data"]["path"]) if found.run_config else None
    wanted = dataset_name(data)
    if MAKE_FAMILIES.get(ours) == MAKE_FAMILIES.get(family) and trained in (None, wanted):
        return
    got = f"{ours}" + (f" trained on {trained}" if trained else "")
    fits = make_target("eval", MAKE_FAMILIES.get(ours), trained or wanted)
    use = (f"use {fits} CKPT={found.path}" if fits else
           "no make eval target fits it: run eval.py without --expect")
    raise UsageError(f"--ckpt {found.path} is {got}, but {expect} is {family} on {wanted}: "
                     f"{use} (or eval.py without --expect to evaluate across)")


def build_encoder_and_model(cfg, found, args: Args, out: Path):
    """Tokenizer and task encoder of the run config, checked against the checkpoint's model,
    then the model with the checkpoint's weights."""
    import torch

    from energon_tasks import task_encoder_for
    from models.checkpointing.checkpoint import load_model
    from models.parallel import init_parallel, init_process_group
    from recipes.compatibility import TOKEN_IDS, check_compatible
    from recipes.data import load_run_tokenizer
    from recipes.model_setup import select_kernels

    te_cfg = cfg.task_encoder
    tokenizer = load_run_tokenizer(te_cfg, out)
    encoder = task_encoder_for(te_cfg, tokenizer)
    check_compatible(found.model_config, te_cfg, weights=f"checkpoint {args.ckpt}",
                     tokenizer=tokenizer, encoder=encoder, token_ids=tuple(TOKEN_IDS))
    init_process_group()  # torchrun's processes, or this one alone
    world = torch.distributed.get_world_size()
    init_parallel(seed=cfg.train.seed, ep=expert_ranks(cfg, found.model_config, world))
    select_kernels(cfg.kernels, found.model_config, log=reporting(), prefix="[eval]")
    return tokenizer, encoder, load_model(found, use_te=False, base=args.base)


def reporting() -> bool:
    """Whether this process prints and writes the results: rank 0 of a torchrun eval (the others
    generated the same answers), or the one process."""
    import torch

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def expert_ranks(cfg, model_config, world: int) -> int:
    """The expert-parallel size of an eval over ``world`` processes. One process: 1, whatever
    layout the run trained at. Under torchrun (a MoE model too big for one GPU): the experts over
    all ranks (``parallel.ep`` = the world size, TP = PP = CP = 1); every rank generates the same
    answers in step (the experts' all-to-all needs it), rank 0 writes them.

    Raises:
        UsageError: another layout, or a dense model, at world > 1 (one line saying what to pass).
    """
    if world == 1:
        return 1
    from models.families import family_of

    p = cfg.parallel
    etp = p.tp if p.etp is None else p.etp
    experts = family_of(model_config).num_experts(model_config)
    fix = f"torchrun --nproc-per-node {world} eval.py ... parallel.tp=1 parallel.pp=1 " \
          f"parallel.cp=1 parallel.ep={world} parallel.etp=1"
    if not experts:
        raise UsageError(f"eval.py over {world} processes holds the experts of a MoE model over "
                         f"the ranks; {model_config.family} has none: run it in one process")
    if (p.tp, p.pp, p.cp, p.ep, etp) != (1, 1, 1, world, 1):
        got = f"parallel.tp {p.tp}, pp {p.pp}, cp {p.cp}, ep {p.ep}, etp {etp}"
        raise UsageError(f"eval.py over {world} processes runs at expert parallel {world} only "
                         f"(got {got}, e.g. the run's training layout): {fix}")
    if experts % world:
        raise UsageError(f"{experts} experts do not split over {world} ranks: run eval.py over "
                         "a number of processes that divides them")
    return world


def summarize(args: Args, cfg, found, answers, blank: bool) -> dict:
    """scores.json: the scores per subset / dataset / overall, budget counters, generation
    throughput, the task encoder config."""
    from recipes.scores import aggregate

    stats, wall = answers.stats, answers.seconds
    return {
        "checkpoint": str(args.ckpt), "checkpoint_kind": found.kind,
        "family": found.model_config.family,
        "data": cfg.data.path, "split": args.split, "limit": args.limit, "turns": args.turns,
        "blank_media": blank, "conversations": answers.conversations,
        "questions": len(answers.records),
        **aggregate(answers.records),
        "budget_counters": answers.budget(),
        "generation": {
            "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
            "prompt_tokens": stats.prompt_tokens, "generated_tokens": stats.generated_tokens,
            "forwards": stats.forwards, "generate_seconds": round(stats.seconds, 3),
            # the last generate call's decode: the lean step (models/generation/decode_step.py) or
            # megatron's
            "lean_decode": stats.extra.get("lean_decode"),
            "samples_per_s": round(stats.prompts / stats.seconds, 3) if stats.seconds else None,
            "tokens_per_s": (round(stats.generated_tokens / stats.seconds, 2)
                             if stats.seconds else None),
            "wall_seconds": round(wall, 3)},
        "task_encoder": cfg.task_encoder.to_dict(),
    }


def _write_whole(path: Path, text: str) -> None:
    """``text`` into ``path`` through a file beside it renamed into place (removed when a write
    fails): ``path`` is whole or absent."""
    import os

    work = path.with_name(f"{path.name}.partial-{os.getpid()}")
    try:
        work.write_text(text)
        work.replace(path)
    except OSError as error:
        error.filename = error.filename or str(path)  # a failed write names no file
        raise
    finally:
        work.unlink(missing_ok=True)


def write_and_report(out: Path, answers, result: dict) -> None:
    """predictions.jsonl, then scores.json (last: the results are complete once it is there),
    each whole (``_write_whole``), a previous eval's pair removed first; the table and a summary
    on stdout (rank 0 of a torchrun eval only: ``reporting``)."""
    if not reporting():
        return
    for name in ("scores.json", "predictions.jsonl"):
        (out / name).unlink(missing_ok=True)
    _write_whole(out / "predictions.jsonl",
                 "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in answers.records))
    _write_whole(out / "scores.json", json.dumps(result, indent=2))
    print(format_table(result))
    print("[eval] budget counters: " + ", ".join(f"{k}={v}" for k, v in answers.budget().items()))
    g = result["generation"]
    print(f"[eval] {len(answers.records)} questions from {answers.conversations} conversations; "
          f"{g['generated_tokens']} tokens generated in {g['generate_seconds']} s "
          f"({g['samples_per_s']} samples/s, {g['tokens_per_s']} tokens/s); wrote "
          f"{out / 'predictions.jsonl'} and {out / 'scores.json'}", flush=True)


@contextmanager
def out_of_space(out: Path | None):
    """A write that fails for lack of space anywhere in the evaluation (a full disk, a quota,
    a file-size limit) as one ``RunFailure`` line, exit 1: ``write_and_report`` leaves no
    results that look complete (no scores.json)."""
    import shutil

    try:
        yield
    except OSError as error:
        if not disk_full(error):
            raise
        where = out if out is not None and out.is_dir() else Path.cwd()
        free = shutil.disk_usage(where).free / 2**30
        raise RunFailure(f"writing {error.filename or out} failed ({error.strerror}; {free:.1f} "
                         f"GiB free there): no results kept (no scores.json in {out}); free "
                         "space and evaluate again") from None


def run(args: Args) -> dict:
    """The whole evaluation; returns what scores.json holds.

    Raises:
        RunFailure: a write failed for lack of space (``out_of_space``).
    """
    with out_of_space(Path(args.out) if args.out else None):
        return _run(args)


def _run(args: Args) -> dict:
    from contract.console import KnownWarnings, Progress
    from recipes.evaluation import answer_questions, read_samples

    check_args(args)
    found, cfg = load_config(args)
    quiet = KnownWarnings(enabled=not cfg.log.all_warnings)
    blank = args.blank_media or cfg.data.blank_media
    out = Path(args.out) if args.out else default_out(found, args.split, blank)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, encoder, model = build_encoder_and_model(cfg, found, args, out)
    samples = read_samples(cfg.data.path, args.split, cfg.task_encoder, tokenizer, args.limit)
    progress = Progress("eval", args.progress_every)
    progress.enabled &= reporting()
    answers = answer_questions(model, encoder, tokenizer, samples, batch_size=args.batch_size,
                               max_new_tokens=args.max_new_tokens, turns=args.turns,
                               blank_media=blank, progress=progress, limit=args.limit)
    if answers.conversations == 0:
        raise UsageError(f"split {args.split!r} of {cfg.data.path} is empty")
    if not answers.records:
        raise UsageError(f"no {args.split} question left after budgeting "
                         f"({answers.conversations} conversations read; counters "
                         f"{json.dumps(answers.budget())}): relax the task_encoder budget knobs")
    result = summarize(args, cfg, found, answers, blank)
    write_and_report(out, answers, result)
    if quiet.summary("log.all_warnings=true") and reporting():
        print(f"[eval] {quiet.summary('log.all_warnings=true')}", flush=True)
    return result


USAGE = ("--ckpt CKPT is required: a train.py run folder, its checkpoints folder or a step "
         "folder, or an hf-to-mcore import (eval.py --ckpt CKPT [CONFIG] [KEY=VALUE]...)")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("args", nargs=-1, metavar="[CONFIG] [KEY=VALUE]...")
@click.option("--ckpt", help="train.py run folder, checkpoints folder or step folder, or an "
                             "hf-to-mcore import.")
@click.option("--split", default="val", show_default=True, help="Energon split part.")
@click.option("--limit", type=int, help="Conversations to read (default: all).")
@click.option("--out", help="Output folder (default: eval_<step> beside the checkpoint).")
@click.option("--batch-size", default=4, show_default=True, help="Prompts per generate call.")
@click.option("--max-new-tokens", default=32, show_default=True, help="Tokens per answer.")
@click.option("--turns", type=click.Choice(["all", "first"]), default="all", show_default=True,
              help="Questions per conversation: every assistant turn, or the first.")
@click.option("--blank-media", is_flag=True,
              help="Zero every pixel row (the vision-signal control; also data.blank_media=true).")
@click.option("--progress-every", type=float, default=30.0, show_default=True,
              help="Seconds between progress lines when stdout is not a terminal.")
@click.option("--expect", help="A train config: refuse a checkpoint of another family or "
                               "trained on another dataset (make eval-<family>-<dataset>).")
@click.option("--base", help="Where the base of a checkpoint that holds only what trains (a LoRA "
                             "run) is now, when it moved (recognised by its content).")
def cli(args: tuple[str, ...], ckpt: str | None, **options) -> None:
    """Answer the val questions of a checkpoint greedily and score them. CONFIG (a run config
    YAML) refines the config stored with a train.py checkpoint (required for an hf-to-mcore
    import); KEY=VALUE overrides as in train.py."""
    if not ckpt:
        raise click.UsageError(USAGE)
    config = args[0] if args and "=" not in args[0] else None
    run(Args(ckpt=ckpt, config=config, overrides=args[1:] if config else args, **options))


def main(argv=None) -> int:
    from contract.cli import run_click

    return run_click(cli, "eval.py", argv, (ConfigError, UsageError))


if __name__ == "__main__":  # the guard matters: dist_checkpointing spawns a Manager process
    sys.exit(main())
