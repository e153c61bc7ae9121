"""The task encoder of every model (Qwen2.5-VL, Qwen3-VL, Nemotron-Omni) for Energon 7.x.

This module owns the path from a stored sample to model inputs; what depends on the model is
asked of the profile's hooks (``energon_tasks.profiles``: ``QwenVLHooks``, ``NemotronOmniHooks``),
which the encoder is composed with. Energon hooks, in Energon's order:

1. the sample arrives as a ``ConversationSample`` (``energon_tasks.energon_dataset``: parsed
   ``K.json`` + the checksum-verified media bytes, not decoded; subflavor ``config`` from the
   JSON); datasets of format-1 converters are crude and cooked by ``cook_conversation``;
2. ``encode_sample``: ChatML tokens of each turn -> ``budget.plan`` from metadata only (a skip
   decodes nothing) -> decode the kept media at their planned size -> tokens with the model's
   span (``hooks.span``) at each placeholder, labels (-100 outside assistant content + its
   ``<|im_end|>``), loss mask, positions (``hooks.position_ids``), ``pixel_values`` in the HF
   processors' row layout (``hooks.write_pixel_rows``), grids, ``visual_kinds`` (image / video
   code of each item in span order);
3. ``select_samples_to_pack`` / ``pack_selected_samples`` (packing on): rows of at most
   ``seq_length`` tokens, vision cost (patches) balanced across the rows of one buffer;
4. ``batch``: pad to the length multiple (or ``seq_length`` with ``fixed_length``) and carry the
   budget counters of this worker since its previous batch.

The hooks (``SPECIAL_TOKENS`` / ``default_pad_id``, ``span``, ``finish_decode``, ``pixel_grid``
/ ``pixel_row_width`` / ``write_pixel_rows``, ``position_ids``) are the only model-specific
steps; planning, decoding, labels, packing and batching are shared.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from megatron.energon import Cooker, DefaultTaskEncoder, SkipSample, stateless

from contract.batch import EncodedSample, VLMBatch
from contract.constants import IGNORE_INDEX, VISUAL_KINDS
from contract.errors import MediaError, UsageError
from energon_tasks import budget
from energon_tasks.collate import collate, pack_samples
from energon_tasks.config import TaskEncoderConfig
from energon_tasks.decode import decode_image
from energon_tasks.energon_dataset import (
    ConversationSample,
    conversation_sample,
    drain_skips,
    record_skip,
    worker_line,
)
from energon_tasks.image_grid import ImageGrid
from energon_tasks.pixel_memory import keep_freed_memory
from energon_tasks.sample_format import PLACEHOLDER_RE, CanonicalSample, Media
from energon_tasks.video_decode import decode_video_at

#: ``encode_text`` caches the ids of texts of up to this many characters, up to this many texts
SHORT_TEXT, SHORT_TEXTS = 48, 4096


@stateless
def cook_conversation(crude: dict) -> ConversationSample:
    """Crude webdataset dict -> ``ConversationSample``: the loader path of datasets written by
    format-1 converters (``CrudeWebdataset``); newer datasets load typed samples directly.

    Raises:
        DamagedSample: no or unreadable ``K.json``, a missing member, a checksum mismatch.
    """
    return conversation_sample(crude)


@dataclass(slots=True, kw_only=True)
class TurnTokens:
    """One turn of the ChatML template, tokenized around its placeholders."""

    header: list[int]  #: <|im_start|> + "role\n"
    pieces: list[list[int]]  #: content text before, between and after the placeholders
    footer: list[int]  #: <|im_end|> + "\n"
    supervised: bool  #: assistant turn: pieces + <|im_end|> carry loss

    def count(self) -> int:
        """Tokens of the turn outside its visual spans."""
        return len(self.header) + sum(map(len, self.pieces)) + len(self.footer)


class TooManySkips(UsageError):
    """``task_encoder.max_skips_in_a_row`` samples skipped in a row by one reader: a user error
    (one line, exit 2) that Energon's error handler passes on (``skip_handler``). Raised in a
    DataLoader worker, torch rebuilds it in the main process from the worker's traceback text
    (``TooManySkips("Caught TooManySkips in DataLoader worker ...")``): the one line is then the
    traceback's last line, taken back here (``worker_line``)."""

    def __init__(self, message: str):
        super().__init__(worker_line(message))


class VLMTaskEncoder(DefaultTaskEncoder):
    """Energon task encoder for VLM SFT (see the module docstring for stages), composed with the
    hooks of ``config.model``'s profile (``self.hooks``).

    Attributes read by the training loop: ``image_pad``, ``video_pad``, ``vision_start``,
    ``vision_end``, ``im_start``, ``im_end`` (token ids of the profile's ``SPECIAL_TOKENS``) and
    ``pad_id``.

    Args:
        config: every knob (``TaskEncoderConfig``).
        tokenizer: a transformers tokenizer with the profile's special tokens; loaded from
            ``config.resolve().tokenizer`` when None.
    """

    decoder = None  # raw bytes: media are decoded in encode_sample, at their planned size
    cookers = [Cooker(cook_conversation)]

    def __init__(self, config: TaskEncoderConfig, tokenizer=None) -> None:
        super().__init__()
        self.config, self.budget = config, config.resolve()
        if tokenizer is None:
            from energon_tasks.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.budget.tokenizer, config.model)
        self.tokenizer, self.geometry = tokenizer, self.budget.geometry
        self.hooks = self.budget.profile.hooks(self)
        for name, token in self.hooks.SPECIAL_TOKENS.items():
            setattr(self, name, tokenizer.convert_tokens_to_ids(token))
        pad = tokenizer.pad_token_id
        self.pad_id = self.hooks.default_pad_id() if pad is None else pad
        self._short_texts: dict[str, tuple[int, ...]] = {}  # encode_text's cache
        self.newline = self.encode_text("\n")
        self._pending: Counter = Counter()  # counters since the last batch (this process)
        self._totals: Counter = Counter()  # counters since creation (this process)
        self._in_a_row: Counter = Counter()  # skip reasons since the last encoded sample

    # ---- text ---------------------------------------------------------------------------------

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text; special-token strings inside it are NOT special. Texts of
        up to ``SHORT_TEXT`` characters (role headers, video timestamps, tile labels: the same
        few strings in every sample) come from a per-encoder cache of up to ``SHORT_TEXTS``."""
        known = self._short_texts.get(text)
        if known is None:
            known = tuple(self.encode_texts([text])[0])
            if len(text) <= SHORT_TEXT and len(self._short_texts) < SHORT_TEXTS:
                self._short_texts[text] = known
        return list(known)

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode_text`` of each text (not cached), in one call of the tokenizer: a fast
        tokenizer's Rust ``encode_batch`` directly, as transformers' ``__call__`` runs it (special
        tokens split, no special tokens added, no truncation or padding: where the backend holds
        either, the ``__call__`` itself); transformers' Python around the call costs more than
        the call (0.15 against 0.06 ms for a turn pair)."""
        ids: list[list[int]] = [[] for _ in texts]
        todo = [i for i, text in enumerate(texts) if text]
        if not todo:
            return ids
        batch = [texts[i] for i in todo]
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.truncation is None and backend.padding is None:
            before = backend.encode_special_tokens
            backend.encode_special_tokens = True
            try:
                encoded = [e.ids for e in backend.encode_batch(batch, add_special_tokens=False)]
            finally:
                backend.encode_special_tokens = before
        else:
            encoded = self.tokenizer(batch, add_special_tokens=False,
                                     split_special_tokens=True)["input_ids"]
        for i, tokens in zip(todo, encoded, strict=True):
            ids[i] = list(tokens)
        return ids

    def tokenize_turns(self, sample: CanonicalSample) -> list[TurnTokens]:
        """Each turn's template and content tokens, split at its placeholders (the contents of
        every turn in one ``encode_texts`` call)."""
        split = [PLACEHOLDER_RE.split(turn.content) for turn in sample.conversation]
        ids = iter(self.encode_texts([piece for pieces in split for piece in pieces]))
        return [
            TurnTokens(
                header=[self.im_start, *self.encode_text(f"{turn.role}\n")],
                pieces=[next(ids) for _ in pieces],
                footer=[self.im_end, *self.newline],
                supervised=turn.role == "assistant",
            )
            for turn, pieces in zip(sample.conversation, split, strict=True)
        ]

    # ---- vision spans ---------------------------------------------------------------------

    def _video_extra(self, media: Media, frames: Sequence[int], grid: ImageGrid) -> int:
        return len(self.hooks.span(media, grid.grid_thw, frames)) - grid.visual_tokens

    # ---- plan, decode, assemble -----------------------------------------------------------------

    def plan_sample(
        self, sample: CanonicalSample, key: str, turns: list[TurnTokens] | None = None
    ) -> budget.Plan:
        """The budget plan of a sample from its metadata and text tokens (nothing decoded)."""
        turns = self.tokenize_turns(sample) if turns is None else turns
        return budget.plan(sample, key=key, budget=self.budget,
                           turn_text_tokens=[t.count() for t in turns],
                           video_extra_tokens=self._video_extra)

    def image_decode_options(self) -> dict:
        """``decode_image``'s ``draft`` / ``resize`` for ``config.image_decode``: exact = the
        whole image, the processor's resize (``geometry.image_resize``); fast = JPEG draft, PIL."""
        if self.budget.image_decode == "exact":
            return {"draft": False, "resize": self.geometry.image_resize}
        return {"draft": True, "resize": "pil"}

    def decode_media(
        self, plan: budget.Plan, sample: CanonicalSample, media_bytes: dict
    ) -> list[np.ndarray]:
        """The pixels of ``decode_sample`` (whose plan holds keyframe sampling's frames)."""
        return self.decode_sample(plan, sample, media_bytes)[1]

    def decode_sample(
        self, plan: budget.Plan, sample: CanonicalSample, media_bytes: dict
    ) -> tuple[budget.Plan, list[np.ndarray]]:
        """(T, H, W, 3) pixels of each kept media item at its planned size (T = 1: image): uint8,
        or float32 for an image resized in float (``image_decode_options``); then the hooks'
        ``finish_decode`` (Nemotron-Omni tiled images: (tiles, 512, 512, 3)). A video's frames
        are those shown at its positions' times (``video_decode.decode_video_at``). With
        ``video_sampling: keyframe``, and for a clip whose frame times are not a constant rate's,
        the plan returned holds each such video's decoded frames and their true timestamps
        (``MediaPlan.frame_indices`` / ``timestamps``); else it is ``plan``.

        Raises:
            MediaError: a missing part or bad media (reason + key + part in the message).
        """
        out, items = [], []
        for item in plan.media:
            media = sample.media[item.index]
            name = f"{plan.key}.{media.part}"
            if media.part not in media_bytes:
                raise MediaError("missing_media", f"{name}: member not in the shard")
            size = (item.grid.resized_height, item.grid.resized_width)
            cap = self.budget.max_source_pixels
            if item.kind == "image":
                image = decode_image(media_bytes[media.part], size=size, max_source_pixels=cap,
                                     name=name, **self.image_decode_options())
                out.append(image.pixels[None])
            else:
                sampling = self.budget.video_sampling
                video = decode_video_at(media_bytes[media.part], item.frame_positions,
                                        size=size, max_source_pixels=cap, name=name,
                                        frames=media.frames, sampling=sampling)
                out.append(video.frames)
                if sampling == "keyframe" or video.variable_rate:
                    item = dataclasses.replace(item, frame_indices=video.indices,
                                               timestamps=video.timestamps)
            items.append(item)
        plan = dataclasses.replace(plan, media=tuple(items))
        return plan, self.hooks.finish_decode(plan, sample, media_bytes, out)

    def assemble(
        self, sample: CanonicalSample, plan: budget.Plan, turns: list[TurnTokens],
        pixels: list[np.ndarray], base: dict,
    ) -> EncodedSample:
        """Tokens, labels, positions and pixel rows of a planned, decoded sample."""
        keep_freed_memory()  # the rows' buffers reuse freed pages (energon_tasks.pixel_memory)
        ids, labels = [], []
        grids = {"image": [], "video": []}
        kinds = []  # VISUAL_KINDS code of each item, in span order
        videos = []
        # one float32 buffer per kind, sized from the decoded shapes; each item's rows are
        # written straight into its slice (no per-item arrays, no concatenate)
        counts = {"image": 0, "video": 0}
        hooks = self.hooks
        for item, frames in zip(plan.media, pixels, strict=True):
            counts[item.kind] += math.prod(hooks.pixel_grid(item.kind, frames))
        buffers = {kind: np.empty((n, hooks.pixel_row_width(kind)), dtype=np.float32)
                   for kind, n in counts.items()}
        filled = {"image": 0, "video": 0}
        items = iter(zip(plan.media, pixels, strict=True))
        for turn in turns[: plan.kept_turns]:
            ids += turn.header
            labels += [IGNORE_INDEX] * len(turn.header)
            for number, piece in enumerate(turn.pieces):
                if number:
                    item, frames = next(items)
                    media = sample.media[item.index]
                    grid = hooks.pixel_grid(item.kind, frames)
                    span = hooks.span(media, grid, item.frame_indices, item.timestamps)
                    ids += span
                    labels += [IGNORE_INDEX] * len(span)
                    grids[item.kind].append(grid)
                    kinds.append(VISUAL_KINDS.index(item.kind))
                    start = filled[item.kind]
                    filled[item.kind] += math.prod(grid)
                    hooks.write_pixel_rows(item.kind, frames,
                                           buffers[item.kind][start:filled[item.kind]])
                    if item.kind == "video":
                        videos.append((media, item.frame_indices, item.timestamps))
                ids += piece
                labels += piece if turn.supervised else [IGNORE_INDEX] * len(piece)
            ids += turn.footer
            labels += [self.im_end if turn.supervised else IGNORE_INDEX]
            labels += [IGNORE_INDEX] * (len(turn.footer) - 1)
        positions = hooks.position_ids(ids, grids, videos)
        if filled != counts:  # plan.media holds exactly the items of the kept turns
            raise ValueError(f"sample {plan.key}: pixel rows filled {filled}, expected {counts}")
        label_tensor = torch.tensor(labels, dtype=torch.int64)
        return EncodedSample(
            **base,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            labels=label_tensor,
            loss_mask=(label_tensor != IGNORE_INDEX).to(torch.float32),
            position_ids=torch.from_numpy(positions),
            pixel_values=torch.from_numpy(buffers["image"]),
            image_grid_thw=torch.tensor(grids["image"], dtype=torch.int64).reshape(-1, 3),
            pixel_values_videos=torch.from_numpy(buffers["video"]),
            video_grid_thw=torch.tensor(grids["video"], dtype=torch.int64).reshape(-1, 3),
            visual_kinds=torch.tensor(kinds, dtype=torch.int64),
            seq_lens=torch.tensor([len(ids)], dtype=torch.int64),
        )

    # ---- counters -----------------------------------------------------------------------------

    def _count(self, counters: dict[str, int]) -> None:
        self._pending.update(counters)
        self._totals.update(counters)

    def counters(self) -> dict[str, int]:
        """Budget counters of every sample this process encoded (workers: see batch field)."""
        return dict(self._totals)

    def reset_counters(self) -> None:
        """Forget the counters so far (train.py's probe of the first batch is not training)."""
        self._pending.clear()
        self._totals.clear()
        self._in_a_row.clear()

    def _skipped(self, reason: str) -> None:
        """One more sample skipped in a row by this reader.

        Raises:
            TooManySkips: ``max_skips_in_a_row`` reached (the reasons counted in the line).
        """
        self._in_a_row[f"skipped_{reason}"] += 1
        limit = self.config.max_skips_in_a_row
        if limit and sum(self._in_a_row.values()) >= limit:
            reasons = ", ".join(f"{k}={v}" for k, v in sorted(self._in_a_row.items()))
            raise TooManySkips(f"{limit} samples in a row skipped by one data reader ({reasons}): "
                               "its share of data.path yields nothing; raise task_encoder."
                               "seq_length / max_visual_tokens / max_num_images, or "
                               "task_encoder.max_skips_in_a_row")

    # ---- Energon hooks ------------------------------------------------------------------------

    @stateless
    def encode_sample(self, sample: ConversationSample) -> EncodedSample:
        """Plan, decode, tokenize one sample.

        Raises:
            SkipSample: over budget or bad media (counted as ``skipped_<reason>`` first).
        """
        key, conversation = sample.__key__, sample.conversation
        turns = self.tokenize_turns(conversation)
        plan = self.plan_sample(conversation, key, turns)
        if plan.skip:
            self._count(plan.counters())
            record_skip(key, plan.skip, plan.detail, count=False)  # counted in the plan's counters
            self._skipped(plan.skip)
            raise SkipSample(plan.detail)
        try:
            plan, pixels = self.decode_sample(plan, conversation, sample.media_bytes)
        except MediaError as error:
            self._skip_decoded(key, error.reason, error.detail, f"sample {key}: {error}")
        base = {name: getattr(sample, name)
                for name in ("__key__", "__restore_key__", "__subflavors__", "__sources__")}
        encoded = self.assemble(conversation, plan, turns, pixels, base)
        if len(encoded.input_ids) > self.budget.seq_length:  # true timestamps' digits
            detail = (f"sample {key}: {len(encoded.input_ids)} tokens with the frames' true "
                      f"timestamps > seq_length {self.budget.seq_length}")
            self._skip_decoded(key, "too_long", detail, detail)
        self._in_a_row.clear()
        self._count(plan.counters())
        return encoded

    def _skip_decoded(self, key: str, reason: str, detail: str, message: str) -> None:
        """Count and record a sample skipped after planning, then skip it.

        Raises:
            SkipSample: always (``TooManySkips`` first when too many in a row).
        """
        self._count({"samples": 1, f"skipped_{reason}": 1})
        record_skip(key, reason, detail, count=False)
        self._skipped(reason)
        raise SkipSample(message) from None

    def select_samples_to_pack(self, samples: list[EncodedSample]) -> list[list[EncodedSample]]:
        """Group a buffer into rows of <= seq_length tokens of nearly equal length, with balanced
        vision cost.

        Energon hands over the whole buffer and every sample must be placed, so the buffer needs
        at least ``ceil(tokens / seq_length)`` rows, and since a batch is padded to its longest
        row, the pad is smallest when those rows are as equal as possible (not when all but one
        are full). So: for the fewest rows ``k`` that work, samples are placed largest first
        into the row with the fewest tokens that still has room for both their tokens and their
        patches (longest-processing-time scheduling); the patch room of a row is 1.25x the
        buffer's mean patches per row (at least the largest sample). If no ``k`` up to the row
        count of best-fit decreasing works, best-fit decreasing itself is used. Rows come out
        longest first, so consecutive rows (one batch) have similar lengths.
        """
        capacity = self.budget.seq_length
        tokens = [len(s.input_ids) for s in samples]
        patches = [len(s.pixel_values) + len(s.pixel_values_videos) for s in samples]

        def patch_room(rows: int) -> int:
            return max([1, *patches, math.ceil(1.25 * sum(patches) / rows)])

        def order(room: int) -> list[int]:  # largest share first
            return sorted(range(len(samples)),
                          key=lambda i: (-max(tokens[i] / capacity, patches[i] / room), i))

        def best_fit_decreasing() -> list[list[int]]:
            room = patch_room(max(1, math.ceil(sum(tokens) / capacity)))
            rows: list[list[int]] = []  # [tokens, patches, *members]
            for i in order(room):
                fits = [r for r in rows if r[0] + tokens[i] <= capacity
                        and r[1] + patches[i] <= room]
                if fits:
                    row = max(fits, key=lambda r: r[0])
                    row[0], row[1] = row[0] + tokens[i], row[1] + patches[i]
                    row.append(i)
                else:
                    rows.append([tokens[i], patches[i], i])
            return rows

        def balanced(count: int) -> list[list[int]] | None:
            room = patch_room(count)
            rows = [[0, 0] for _ in range(count)]
            for i in order(room):
                fits = [r for r in rows if r[0] + tokens[i] <= capacity
                        and r[1] + patches[i] <= room]
                if not fits:
                    return None
                row = min(fits, key=lambda r: (r[0], r[1]))
                row[0], row[1] = row[0] + tokens[i], row[1] + patches[i]
                row.append(i)
            return [r for r in rows if len(r) > 2]

        fallback = best_fit_decreasing()
        chosen = fallback
        for count in range(max(1, math.ceil(sum(tokens) / capacity)), len(fallback) + 1):
            if (rows := balanced(count)) is not None:
                chosen = rows
                break
        chosen = sorted(chosen, key=lambda r: -r[0])  # stable: similar lengths side by side
        return [[samples[i] for i in sorted(row[2:])] for row in chosen]

    @stateless
    def pack_selected_samples(self, samples: list[EncodedSample]) -> EncodedSample:
        """Concatenate one selected group (positions restart per sample; ``seq_lens`` kept)."""
        return pack_samples(samples)

    @stateless
    def batch(self, samples: list[EncodedSample]) -> VLMBatch:
        """Pad rows (to the length multiple, or seq_length with fixed_length); add counters."""
        self._count(drain_skips())  # samples the dataset could not load (energon_dataset)
        counters = dict(self._pending)
        self._pending.clear()
        result = collate(
            samples, pad_id=self.pad_id, multiple=self.budget.length_multiple,
            fixed_length=self.budget.seq_length if self.budget.fixed_length else None,
            packed=self.budget.packing, budget_counters=counters)
        real = int(result.attention_mask.sum())
        result.budget_counters.update(tokens_real=real, tokens_total=result.input_ids.numel())
        return result

    @stateless
    def encode_batch(self, batch: VLMBatch) -> VLMBatch:
        """Identity: the batch is final."""
        return batch


def task_encoder_for(config: TaskEncoderConfig, tokenizer=None) -> VLMTaskEncoder:
    """The task encoder of ``config.model``: a ``VLMTaskEncoder`` composed with its profile's hooks.
    Every place that builds an encoder (``train.py``, ``eval.py``, ``python -m energon_tasks
    inspect / preview``) goes through it.

    Args:
        config: the task encoder settings.
        tokenizer: a loaded tokenizer; None loads ``config.resolve().tokenizer`` (special tokens
            of the model's profile checked by ``energon_tasks.tokenizer.load_tokenizer``).
    """
    return VLMTaskEncoder(config, tokenizer=tokenizer)
