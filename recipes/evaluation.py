"""eval.py's own pieces: the val samples, the prompts of a conversation, the scored answers.

The checkpoint is read and loaded by ``models.checkpointing.checkpoint`` (``read_checkpoint``,
``load_model``) and checked against the task encoder by ``recipes.compatibility``, as in training.
This module owns, in the order eval.py uses them:

- ``read_samples``: cooked val samples in the loader's fixed order (the loaders' worker config, so
  damaged samples are skipped as in training);
- ``encode_prompts``: one prompt encoding per assistant turn through the task encoder's own steps
  (``tokenize_turns`` -> ``plan_sample`` -> ``decode_sample`` -> ``assemble``), budget counters as
  in training;
- ``answer_questions``: batched greedy generation (models/generation/generate.py) and scoring
  (``recipes.scores.score_answer``) of every question, one record each.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from models.generation.generate import GenerationStats


# ------------------------------------------------------------------ prompts
@dataclass(slots=True)
class Item:
    """One question: its prompt encoding and what it is scored against."""

    key: str
    dataset: str
    subset: str
    question: str
    references: list[str]
    prompt: object  # models.generation.generate.Prompt
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
    from models.generation.generate import Prompt

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
            plan, pixels = encoder.decode_sample(plan, prompt_sample, sample.media_bytes)
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
    from megatron.energon import stateless

    from energon_tasks.loader import get_pass_loader
    from energon_tasks.task_encoder import VLMTaskEncoder

    class _Reader(VLMTaskEncoder):  # cook only: encoded in this process
        @stateless
        def encode_sample(self, sample):
            return sample

        def batch(self, samples):
            return samples

        def encode_batch(self, batch):
            return batch

    count = 0
    for batch in get_pass_loader(path, task_encoder=_Reader(encoder_config, tokenizer),
                                 split_part=split):
        for sample in batch:
            if limit is not None and count >= limit:
                return
            count += 1
            yield sample


# ------------------------------------------------------------------ answers
@dataclass(slots=True)
class Answers:
    """Every scored answer of an eval run and what generating them took."""

    stats: GenerationStats = dataclasses.field(default_factory=GenerationStats)
    records: list[dict] = dataclasses.field(default_factory=list)  #: one per question
    counters: Counter = dataclasses.field(default_factory=Counter)  #: budget counters
    conversations: int = 0  #: val conversations read
    seconds: float = 0.0  #: wall time of reading, encoding, generating and scoring

    def budget(self) -> dict[str, int]:
        """The non-zero budget counters, sorted by name."""
        return {k: v for k, v in sorted(self.counters.items()) if v}


def answer_questions(model, encoder, tokenizer, samples, *, batch_size: int, max_new_tokens: int,
                     turns: str, blank_media: bool, progress, limit: int | None) -> Answers:
    """Greedy answers to every question of ``samples`` (``batch_size`` prompts per generate
    call, in reading order), each scored against its references."""
    import time

    from models.generation.generate import greedy_generate
    from recipes.scores import score_answer

    answers = Answers()

    def generate(items: list[Item]) -> None:
        outputs = greedy_generate(model, [i.prompt for i in items], eos_id=encoder.im_end,
                                  max_new_tokens=max_new_tokens, pad_id=encoder.pad_id,
                                  stats=answers.stats)
        for item, tokens in zip(items, outputs):
            text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
            metric, scores = score_answer(item.dataset, item.question, text, item.references)
            answers.records.append({
                "key": item.key, "dataset": item.dataset, "subset": item.subset,
                "prompt": {"question": item.question[:300], "media": item.media,
                           "tokens": int(item.prompt.input_ids.numel())},
                "prediction": text, "references": item.references, "metric": metric,
                "score": scores[metric], "scores": scores, "generated_tokens": len(tokens)})

    start = time.perf_counter()
    pending: list[Item] = []
    for sample in samples:
        answers.conversations += 1
        progress.update(answers.conversations, limit, "conversations",
                        f" ({len(answers.records)} questions answered)")
        pending += encode_prompts(encoder, sample, answers.counters, turns, blank_media)
        while len(pending) >= batch_size:
            generate(pending[:batch_size])
            pending = pending[batch_size:]
    if pending:
        generate(pending)
    answers.seconds = time.perf_counter() - start
    return answers
