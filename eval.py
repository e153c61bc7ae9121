"""Evaluate a VLM checkpoint (Qwen-VL, Nemotron-Omni) on the val split: greedy answers, scores.

    python eval.py --ckpt CKPT [CONFIG] [key=value ...] [--split val] [--limit N] [--out DIR]
    make eval-qwen-vl-infovqa CKPT=runs/qwen_vl_infovqa LIMIT=50

The checkpoint is either a train.py checkpoint (a run folder, its ``checkpoints`` folder (the
newest complete step) or one ``step_N`` folder; loaded at this process's layout, TP=1), whose
stored run config (recipes/run_config.py) decides what the model sees, exactly as in training:
its ``task_encoder`` section (every budget knob) and ``data.path``; or an imported Hugging Face
checkpoint (``python -m models.convert hf-to-mcore``: a baseline before fine-tuning), which needs
a run config (CONFIG). A CONFIG given with a train.py checkpoint only refines the stored one, and
``key=value`` overrides work as in training (``task_encoder.max_pixels=50176``). Output goes next
to the checkpoint (``eval_<step>``) unless --out says otherwise.

Each assistant turn of a val conversation is one question: the prompt is the conversation up to
that turn (earlier answers as given) ending with the assistant header; the references are the
turn's ``answers`` (or its content). Prompts go through the task encoder's own steps
(``tokenize_turns`` -> ``plan_sample`` -> ``decode_media`` -> ``assemble``), are generated
greedily with a KV cache (models/generate.py, batched, stop at ``<|im_end|>``), and are scored:
InfoVQA ANLS; multiple choice (options "A. ..." in the question) option accuracy; everything else
exact match (+ relaxed match). Writes ``predictions.jsonl`` and ``scores.json`` under --out and
prints a table and the budget counters (and a progress line every --progress-every seconds when
stdout is not a terminal). Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import click
import yaml

from contract.families import TASK_ENCODER_MODELS
from recipes.scores import (
    anls_one,
    answer_letter,
    exact_match,
    extract_option_letter,
    option_letters,
    relaxed_match,
)

_OPTION_LINE = re.compile(r"\s*\(?([A-Z])[.)]\s+(.+?)\s*$")


class EvalError(Exception):
    """Bad input (checkpoint, data, split, budget): one line, exit code 2."""


# ------------------------------------------------------------------ scoring
def parse_options(question: str) -> dict[str, str] | None:
    """The options a multiple-choice question lists, {letter: text}, or None.

    LLaVA-Video's form: an "Options:" line, then one "A. text" line per option (up to E), then the
    instruction ("Please provide your answer by stating the letter followed by the full
    option."): the option lines right after the last "Options:" line are read. Without that line,
    option lines ("A. text", "(B) text", "C) text") anywhere in the question. None when there are
    fewer than two or the letters are not A, B, C, ... in order.
    """
    lines = question.splitlines()
    headers = [i for i, line in enumerate(lines) if line.strip().lower() == "options:"]
    if headers:
        matches = []
        for line in lines[headers[-1] + 1:]:
            if not (match := _OPTION_LINE.match(line)):
                break
            matches.append(match)
    else:
        matches = [m for m in map(_OPTION_LINE.match, lines) if m]
    letters = [m.group(1) for m in matches]
    if len(letters) < 2 or letters != [chr(ord("A") + i) for i in range(len(letters))]:
        return None
    return {m.group(1): m.group(2) for m in matches}


def score_answer(dataset: str, question: str, prediction: str, references: list[str]
                 ) -> tuple[str, dict[str, float]]:
    """(primary metric name, {metric: value}) of one generated answer.

    InfoVQA: ANLS. A question listing options whose reference names one of them ("E. training.",
    "E", the option's text): option accuracy, the letter read from the answer by lmms-eval
    Video-MME's rule (recipes.scores.extract_option_letter). Everything else: exact and relaxed
    match.
    """
    if dataset == "infovqa":
        return "anls", {"anls": anls_one(prediction, references)}
    options = parse_options(question)
    letter = answer_letter(references[0], options) if options else None
    if letter is not None:
        chosen = extract_option_letter(prediction, option_letters(options))
        return "option_acc", {"option_acc": float(chosen == letter)}
    return "exact", {"exact": exact_match(prediction, references),
                     "relaxed": relaxed_match(prediction, references)}


def aggregate(records: list[dict]) -> dict:
    """Mean of every metric and of the primary score, per subset, per dataset and overall."""
    groups: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for name in (r["subset"], r["dataset"], "overall"):
            groups[name]["score"].append(r["score"])
            for metric, value in r["scores"].items():
                groups[name][metric].append(value)

    def summary(values: dict[str, list]) -> dict:
        return {"n": len(values["score"]),
                **{k: sum(v) / len(v) for k, v in sorted(values.items())}}

    datasets = sorted({r["dataset"] for r in records})
    subsets = sorted({r["subset"] for r in records})
    return {"overall": summary(groups["overall"]),
            "datasets": {d: summary(groups[d]) for d in datasets},
            "subsets": {s: summary(groups[s]) for s in subsets}}


# ------------------------------------------------------------------ prompts
@dataclass(slots=True)
class Item:
    """One question: its prompt encoding and what it is scored against."""

    key: str
    dataset: str
    subset: str
    question: str
    references: list[str]
    prompt: object  # models.generate.Prompt
    media: str


def subset_of(conversation) -> str:
    parts = [conversation.dataset, conversation.source.config]
    if conversation.dataset == "llava-video":
        parts.append(conversation.source.split)  # caption / open_ended / multi_choice
    return "/".join(parts)


def encode_prompts(encoder, sample, counters: Counter, turns_mode: str = "all",
                   blank_media: bool = False) -> list[Item]:
    """Prompt-only encodings of a cooked val sample: one per assistant turn (or the first).

    Uses the task encoder's public steps; budget counters go to ``counters`` as in training
    (one plan per prompt), plus ``skipped_prompt_cut`` when the budget would cut the question.
    """
    import torch

    from contract.errors import MediaError
    from energon_tasks.sample_format import PLACEHOLDER_RE, Turn
    from models.generate import Prompt

    conv = sample.conversation
    targets = [i for i, t in enumerate(conv.conversation) if t.role == "assistant"]
    if turns_mode == "first":
        targets = targets[:1]
    items = []
    base = {name: getattr(sample, name)
            for name in ("__key__", "__restore_key__", "__subflavors__", "__sources__")}
    for number, index in enumerate(targets):
        prefix = conv.conversation[:index]
        n_media = sum(len(PLACEHOLDER_RE.findall(t.content)) for t in prefix)
        prompt_sample = dataclasses.replace(
            conv, conversation=[*prefix, Turn(role="assistant", content="")],
            media=conv.media[:n_media])
        key = sample.__key__ if len(targets) == 1 else f"{sample.__key__}#{number}"
        turns = encoder.tokenize_turns(prompt_sample)
        turns[-1].footer, turns[-1].supervised = [], False  # ends with "<|im_start|>assistant\n"
        plan = encoder.plan_sample(prompt_sample, key, turns)
        if not plan.skip and plan.kept_turns < len(turns):
            counters.update({"samples": 1, "skipped_prompt_cut": 1})
            continue
        counters.update(plan.counters())
        if plan.skip:
            continue
        try:
            pixels = encoder.decode_media(plan, prompt_sample, sample.media_bytes)
        except MediaError as error:
            counters.update({"kept": -1, f"skipped_{error.reason}": 1})
            continue
        enc = encoder.assemble(prompt_sample, plan, turns, pixels, dict(base))
        if blank_media:
            enc.pixel_values = torch.zeros_like(enc.pixel_values)
            enc.pixel_values_videos = torch.zeros_like(enc.pixel_values_videos)
        target = conv.conversation[index]
        kinds = Counter(m.kind for m in prompt_sample.media)
        items.append(Item(
            key=key, dataset=conv.dataset, subset=subset_of(conv),
            question=PLACEHOLDER_RE.sub("", prefix[-1].content if prefix else "").strip(),
            references=list(target.answers or [target.content]),
            prompt=Prompt(enc.input_ids, enc.position_ids, enc.pixel_values, enc.image_grid_thw,
                          enc.pixel_values_videos, enc.video_grid_thw, enc.visual_kinds),
            media=", ".join(f"{n} {k}{'s' * (n > 1)}" for k, n in sorted(kinds.items()))))
    return items


# ------------------------------------------------------------------ data
def read_samples(path: str, split: str, encoder_config, tokenizer, limit: int | None):
    """Cooked val samples (ConversationSample) in the loader's fixed order, up to ``limit``."""
    from megatron.energon import get_loader, get_val_dataset, stateless

    from energon_tasks.loader import worker_config
    from energon_tasks.task_encoder import VLMTaskEncoder

    class _Reader(VLMTaskEncoder):  # cook only: encoded in this process
        @stateless
        def encode_sample(self, sample):
            return sample

        def batch(self, samples):
            return samples

        def encode_batch(self, batch):
            return batch

    dataset = get_val_dataset(path, split_part=split, batch_size=1,
                              worker_config=worker_config(),
                              task_encoder=_Reader(encoder_config, tokenizer))
    count = 0
    for batch in get_loader(dataset):
        for sample in batch:
            if limit is not None and count >= limit:
                return
            count += 1
            yield sample


# ------------------------------------------------------------------ checkpoint
@dataclass(slots=True)
class Checkpoint:
    """What eval.py reads of a checkpoint before building anything."""

    model: object  #: the model config (QwenVLModelConfig | NemotronOmniModelConfig)
    weights: Path  #: the megatron dist checkpoint folder
    kind: str  #: "train.py step_N" or "hf-import"
    folder: Path  #: the step folder, or the import folder
    run_config: dict | None  #: the run config stored by train.py (None for an import)


def find_checkpoint(ckpt: str) -> Checkpoint:
    """A train.py or an HF-import checkpoint, from its self-description only (nothing is
    built, its one pickle is checked), so a wrong checkpoint fails fast."""
    from models.checkpoint import MODEL_JSON, read_model_config
    from models.families import config_from_dict
    from models.run_state import check_dist_metadata, resolve_checkpoint

    path = Path(ckpt)
    if not path.exists():
        raise EvalError(f"checkpoint {ckpt} does not exist")
    try:
        if (path / MODEL_JSON).is_file():  # models/convert.py hf-to-mcore
            found = Checkpoint(read_model_config(path), path, "hf-import", path, None)
        else:
            step = resolve_checkpoint(path)
            config = step / "config.yaml"
            if not (step / "model_optim" / "metadata.json").is_file() or not config.is_file():
                raise EvalError(f"{ckpt} is not a checkpoint (neither {MODEL_JSON} nor a "
                                "train.py step folder with model_optim/ and config.yaml)")
            raw = yaml.safe_load(config.read_text()) or {}
            found = Checkpoint(config_from_dict(raw.get("model") or {}), step / "model_optim",
                               f"train.py {step.name}", step, raw)
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError) as error:
        raise EvalError(f"checkpoint {ckpt} is unreadable: {error}") from None
    check_dist_metadata(found.weights)
    return found


def load_model(cfg, weights: Path, ckpt: str):
    """Build the model of ``cfg`` at this process's layout (TP=1) and load ``weights``."""
    from megatron.core import dist_checkpointing

    from models.checkpoint import build_model

    model = build_model(cfg, use_te=False)
    try:
        state = dist_checkpointing.load(model.sharded_state_dict(), str(weights))
        model.load_state_dict(state, strict=False)
    except Exception as error:  # noqa: BLE001 - any load failure is a bad --ckpt for the user
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise EvalError(f"checkpoint {ckpt} does not load into its {cfg.family} model: "
                        f"{type(error).__name__}: {first[:300]}") from None
    missing = [k for k in model.state_dict() if not k.endswith("_extra_state") and k not in state]
    if missing:
        raise EvalError(f"checkpoint {ckpt} lacks {missing[0]!r}")
    return model.eval()


def check_compatible(cfg, encoder, tokenizer, te_model: str) -> None:
    """The checkpoint's family, patch geometry and token ids must match the task encoder's."""
    want = TASK_ENCODER_MODELS.get(cfg.family, (cfg.family,))
    geometry = encoder.geometry
    if geometry.name not in want:
        raise EvalError(f"checkpoint is a {cfg.family} model, the config's task encoder is "
                        f"{te_model!r} (set task_encoder.model={want[0]})")
    v = cfg.vision
    temporal = (v.video_temporal_patch_size if cfg.family == "nemotron_omni"
                else v.temporal_patch_size)
    for name, ours, theirs in (("patch_size", v.patch_size, geometry.patch_size),
                               ("merge_size", cfg.merge_size, geometry.merge_size),
                               ("temporal_patch_size", temporal, geometry.temporal_patch_size)):
        if ours != theirs:
            raise EvalError(f"checkpoint vision {name} is {ours}, the task encoder's "
                            f"{geometry.name} geometry uses {theirs}")
    ids = {"image_token_id": encoder.image_pad, "video_token_id": encoder.video_pad,
           "vision_start_token_id": encoder.vision_start,
           "vision_end_token_id": encoder.vision_end}
    for name, token in ids.items():
        if getattr(cfg, name) != token:
            raise EvalError(f"checkpoint {name} is {getattr(cfg, name)}, the tokenizer's is "
                            f"{token}: checkpoint and tokenizer do not belong together")
    if len(tokenizer) > cfg.lm.vocab_size:
        raise EvalError(f"tokenizer has {len(tokenizer)} tokens, the checkpoint's vocabulary "
                        f"{cfg.lm.vocab_size}")


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


def default_out(found: Checkpoint, split: str, blank: bool) -> Path:
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


def run(args: Args) -> dict:
    from energon_tasks.config import TaskEncoderConfig
    from models.console import KnownWarnings, Progress
    from recipes.run_config import load_run_config
    from recipes.training import check_data_path, check_split

    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit must be >= 1, got {args.limit}")
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise EvalError("--batch-size and --max-new-tokens must be >= 1")
    found = find_checkpoint(args.ckpt)
    if found.run_config is None and args.config is None:
        raise EvalError(f"--ckpt {args.ckpt} is an hf-to-mcore import, which stores no run "
                        "config: give one (e.g. configs/train_qwen_vl_infovqa.yaml)")
    cfg = load_run_config(args.config, args.overrides, task_encoder_config=TaskEncoderConfig,
                          stored=found.run_config)
    quiet = KnownWarnings(enabled=not cfg.log.all_warnings)
    check_data_path(cfg.data.path)
    check_split(cfg.data.path, args.split)
    model_cfg, weights, kind = found.model, found.weights, found.kind
    blank = args.blank_media or cfg.data.blank_media
    out = Path(args.out) if args.out else default_out(found, args.split, blank)
    out.mkdir(parents=True, exist_ok=True)

    from energon_tasks import task_encoder_for
    from energon_tasks.tokenizer import build_test_tokenizer, load_tokenizer
    from models.checkpoint import init_parallel
    from models.generate import GenerationStats, greedy_generate

    te_cfg = cfg.task_encoder
    name = te_cfg.tokenizer_name
    if te_cfg.tokenizer == "test":
        name = str(build_test_tokenizer(out / "tokenizer"))
    try:
        tokenizer = load_tokenizer(name, te_cfg.model)
    except ValueError as error:
        raise EvalError(str(error)) from None
    encoder = task_encoder_for(te_cfg, tokenizer)
    check_compatible(model_cfg, encoder, tokenizer, te_cfg.model)
    init_parallel(tp=1, pp=1, seed=cfg.train.seed)
    model = load_model(model_cfg, weights, args.ckpt)

    counters: Counter = Counter()
    stats = GenerationStats()
    records: list[dict] = []
    pending: list[Item] = []
    conversations = 0

    def flush():
        batch = list(pending)
        pending.clear()
        outputs = greedy_generate(model, [i.prompt for i in batch], eos_id=encoder.im_end,
                                  max_new_tokens=args.max_new_tokens, pad_id=encoder.pad_id,
                                  stats=stats)
        for item, tokens in zip(batch, outputs):
            text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
            metric, scores = score_answer(item.dataset, item.question, text, item.references)
            records.append({
                "key": item.key, "dataset": item.dataset, "subset": item.subset,
                "prompt": {"question": item.question[:300], "media": item.media,
                           "tokens": int(item.prompt.input_ids.numel())},
                "prediction": text, "references": item.references, "metric": metric,
                "score": scores[metric], "scores": scores, "generated_tokens": len(tokens)})

    start = time.perf_counter()
    progress = Progress("eval", args.progress_every)
    for sample in read_samples(cfg.data.path, args.split, te_cfg, tokenizer, args.limit):
        conversations += 1
        progress.update(conversations, args.limit, "conversations",
                        f" ({len(records)} questions answered)")
        pending.extend(encode_prompts(encoder, sample, counters, args.turns, blank))
        while len(pending) >= args.batch_size:
            head, rest = pending[:args.batch_size], pending[args.batch_size:]
            pending[:] = head
            flush()
            pending[:] = rest
    if pending:
        flush()
    wall = time.perf_counter() - start
    budget = {k: v for k, v in sorted(counters.items()) if v}
    if conversations == 0:
        raise EvalError(f"split {args.split!r} of {cfg.data.path} is empty")
    if not records:
        raise EvalError(f"no {args.split} question left after budgeting ({conversations} "
                        f"conversations read; counters {json.dumps(budget)}): relax the "
                        "task_encoder budget knobs")

    with open(out / "predictions.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    result = {
        "checkpoint": str(args.ckpt), "checkpoint_kind": kind, "family": model_cfg.family,
        "data": cfg.data.path, "split": args.split, "limit": args.limit, "turns": args.turns,
        "blank_media": blank, "conversations": conversations, "questions": len(records),
        **aggregate(records),
        "budget_counters": budget,
        "generation": {
            "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
            "prompt_tokens": stats.prompt_tokens, "generated_tokens": stats.generated_tokens,
            "forwards": stats.forwards, "generate_seconds": round(stats.seconds, 3),
            "samples_per_s": round(stats.prompts / stats.seconds, 3) if stats.seconds else None,
            "tokens_per_s": (round(stats.generated_tokens / stats.seconds, 2)
                             if stats.seconds else None),
            "wall_seconds": round(wall, 3)},
        "task_encoder": te_cfg.to_dict(),
    }
    (out / "scores.json").write_text(json.dumps(result, indent=2))
    print(format_table(result))
    print("[eval] budget counters: " + ", ".join(f"{k}={v}" for k, v in budget.items()))
    g = result["generation"]
    print(f"[eval] {len(records)} questions from {conversations} conversations; "
          f"{g['generated_tokens']} tokens generated in {g['generate_seconds']} s "
          f"({g['samples_per_s']} samples/s, {g['tokens_per_s']} tokens/s); wrote "
          f"{out / 'predictions.jsonl'} and {out / 'scores.json'}", flush=True)
    if quiet.summary("log.all_warnings=true"):
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
def cli(args: tuple[str, ...], ckpt: str | None, **options) -> None:
    """Answer the val questions of a checkpoint greedily and score them. CONFIG (a run config
    YAML) refines the config stored with a train.py checkpoint (required for an hf-to-mcore
    import); KEY=VALUE overrides as in train.py."""
    if not ckpt:
        raise click.UsageError(USAGE)
    config = args[0] if args and "=" not in args[0] else None
    run(Args(ckpt=ckpt, config=config, overrides=args[1:] if config else args, **options))


def main(argv=None) -> int:
    from models.cli import run_click
    from recipes.run_config import ConfigError
    from recipes.training import UsageError

    return run_click(cli, "eval.py", argv, (EvalError, ConfigError, UsageError))


if __name__ == "__main__":  # the guard matters: dist_checkpointing spawns a Manager process
    sys.exit(main())
