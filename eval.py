"""Evaluate a VLM checkpoint (Qwen-VL, Nemotron-Omni) on the val split: greedy answers, scores.

    python eval.py CONFIG --ckpt CKPT [key=value ...] [--split val] [--limit N] [--out DIR]
    make eval-qwen-vl-infovqa CKPT=runs/qwen_vl_infovqa/checkpoints DATA=... LIMIT=50

CONFIG is the run config of train.py (models/run_config.py): its ``task_encoder`` section (every
budget knob) and ``data.path`` decide what the model sees, exactly as in training; ``key=value``
overrides work the same way (``task_encoder.max_pixels=50176``). The model's shapes come from the
checkpoint: a train.py checkpoint (``<run>/checkpoints`` with ``latest``, or one ``step_N``
folder; loaded at this process's layout, TP=1) or an imported Hugging Face checkpoint
(``python -m models.convert hf-to-mcore``: a baseline before fine-tuning).

Each assistant turn of a val conversation is one question: the prompt is the conversation up to
that turn (earlier answers as given) ending with the assistant header; the references are the
turn's ``answers`` (or its content). Prompts go through the task encoder's own steps
(``tokenize_turns`` -> ``plan_sample`` -> ``decode_media`` -> ``assemble``), are generated
greedily with a KV cache (models/generate.py, batched, stop at ``<|im_end|>``), and are scored:
InfoVQA ANLS; multiple choice (options "A. ..." in the question) option accuracy; everything else
exact match (+ relaxed match). Writes ``predictions.jsonl`` and ``scores.json`` under --out and
prints a table and the budget counters. Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import yaml

from models.families import TASK_ENCODER_MODELS
from models.scores import (
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
    Video-MME's rule (models.scores.extract_option_letter). Everything else: exact and relaxed
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

    from energon_tasks.decode import MediaError
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
def check_split(path: str, split: str) -> None:
    """The dataset folder / metadataset must declare the split (before anything is built)."""
    p = Path(path)
    if not p.exists():
        raise EvalError(f"data path {path} does not exist")
    try:
        if p.is_file():
            splits = (yaml.safe_load(p.read_text()) or {}).get("splits") or {}
        else:
            meta = p / ".nv-meta" / "split.yaml"
            if not meta.is_file():
                raise EvalError(f"{path} is not an Energon dataset (no .nv-meta/split.yaml)")
            splits = (yaml.safe_load(meta.read_text()) or {}).get("split_parts") or {}
    except (OSError, yaml.YAMLError, AttributeError) as error:
        raise EvalError(f"data path {path} is unreadable ({error})") from None
    if not splits.get(split):
        have = ", ".join(sorted(k for k in splits if "/" not in k)) or "none"
        raise EvalError(f"dataset {path} has no {split!r} split (splits: {have})")


def read_samples(path: str, split: str, encoder_config, tokenizer, limit: int | None):
    """Cooked val samples (ConversationSample) in the loader's fixed order, up to ``limit``."""
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset, stateless

    from energon_tasks.encoders import task_encoder_class

    class _Reader(task_encoder_class(encoder_config.model)):  # cook only: encoded in this process
        @stateless
        def encode_sample(self, sample):
            return sample

        def batch(self, samples):
            return samples

        def encode_batch(self, batch):
            return batch

    dataset = get_val_dataset(path, split_part=split, batch_size=1,
                              worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                              task_encoder=_Reader(encoder_config, tokenizer))
    count = 0
    for batch in get_loader(dataset):
        for sample in batch:
            if limit is not None and count >= limit:
                return
            count += 1
            yield sample


# ------------------------------------------------------------------ checkpoint
def find_checkpoint(ckpt: str):
    """(model config, weights folder, description) of a train.py or an HF-import checkpoint.

    Reads only the self-description (nothing is built), so a wrong checkpoint fails fast.
    """
    from models.checkpoint import MODEL_JSON, read_model_config
    from models.families import config_from_dict

    path = Path(ckpt)
    if not path.exists():
        raise EvalError(f"checkpoint {ckpt} does not exist")
    try:
        if (path / MODEL_JSON).is_file():  # models/convert.py hf-to-mcore
            return read_model_config(path), path, "hf-import"
        from models.training import resolve_checkpoint

        step = resolve_checkpoint(path)
        config = step / "config.yaml"
        if not (step / "model_optim" / "metadata.json").is_file() or not config.is_file():
            raise EvalError(f"{ckpt} is not a checkpoint (neither {MODEL_JSON} nor a train.py "
                            "step folder with model_optim/ and config.yaml)")
        raw = yaml.safe_load(config.read_text()) or {}
        return (config_from_dict(raw.get("model") or {}), step / "model_optim",
                f"train.py {step.name}")
    except (OSError, ValueError, TypeError, yaml.YAMLError) as error:
        raise EvalError(f"checkpoint {ckpt} is unreadable: {error}") from None


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
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="run config YAML (the one used for training)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. data.path=...")
    parser.add_argument("--ckpt", required=True,
                        help="train.py checkpoint dir / step folder, or an hf-to-mcore import")
    parser.add_argument("--split", default="val", help="Energon split part (default: val)")
    parser.add_argument("--limit", type=int, default=None, help="val conversations to read")
    parser.add_argument("--out", default=None, help="output folder (default: <config out>/eval)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--turns", choices=("all", "first"), default="all",
                        help="questions per conversation: every assistant turn, or the first")
    parser.add_argument("--blank-media", action="store_true",
                        help="zero every pixel row (the vision-signal control; also "
                             "data.blank_media=true)")
    return parser.parse_intermixed_args(argv)


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


def run(args) -> dict:
    from energon_tasks.config import TaskEncoderConfig
    from models.run_config import load_run_config
    from models.training import check_data_path

    cfg = load_run_config(args.config, args.overrides, task_encoder_config=TaskEncoderConfig)
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit must be >= 1, got {args.limit}")
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise EvalError("--batch-size and --max-new-tokens must be >= 1")
    check_data_path(cfg.data.path)
    check_split(cfg.data.path, args.split)
    model_cfg, weights, kind = find_checkpoint(args.ckpt)
    out = Path(args.out or Path(cfg.out) / "eval")
    out.mkdir(parents=True, exist_ok=True)
    blank = args.blank_media or cfg.data.blank_media

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
    for sample in read_samples(cfg.data.path, args.split, te_cfg, tokenizer, args.limit):
        conversations += 1
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
    return result


def main(argv=None) -> int:
    from models.run_config import ConfigError
    from models.training import UsageError

    args = parse_args(argv)
    try:
        run(args)
    except (EvalError, ConfigError, UsageError) as error:
        print(f"eval.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":  # the guard matters: dist_checkpointing spawns a Manager process
    sys.exit(main())
