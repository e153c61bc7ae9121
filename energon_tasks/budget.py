"""The budget planner: what of a sample is kept, at which size, decided from metadata only.

This module owns the budget policy of issue 3 as one pure function, ``plan``, for every model
family: it reads the resolved ``energon_tasks.families.Budget`` (``TaskEncoderConfig.resolve``),
whose geometry has the planner's interface (``image_grid`` / ``video_grid`` /
``video_frame_positions``, ``energon_tasks.families.Geometry``), and an image span is always its
context tokens plus two markers (``<|vision_start|>``/``<|vision_end|>`` or ``<img>``/``</img>``).
It reads the sample's JSON metadata (image sizes, video frame counts / fps) and the text token
count of each turn, and never touches a pixel, so a skipped sample costs no decoding and
``inspect`` predicts exactly what the loader does. Policy, in order:

1. every image goes through the model's resize rule (``smart_resize``; Nemotron-Omni: its dynamic
   patch grid, or its tile grid with ``max_pixels`` as a tile cap) with ``min_pixels`` /
   ``max_pixels``; every video is
   sampled uniformly in time over the whole clip at ``video_fps``, capped at ``max_num_frames``
   (``QwenVLGeometry.video_frame_positions``; the frame indices are the positions rounded, the
   processors' picks, and the loader reads the frame shown at each position's time), and sized
   by the model's video rule;
2. the conversation may only end after an assistant turn (turn boundaries; a visual span is never
   cut, since whole turns are kept or dropped);
3. the longest such prefix is kept whose image count fits ``max_num_images``, whose visual tokens
   fit ``max_visual_tokens`` once the resolution of all its images is lowered together (a shared
   pixel cap, never below ``min_pixels``), and whose text + visual tokens fit ``seq_length``;
4. if no prefix fits ``seq_length`` that way, the longest prefix that fits with its images lowered
   further (again never below ``min_pixels``) is kept: a smaller image beats a skipped sample;
5. otherwise the sample is skipped with the reason of its shortest prefix.

Actions counted per sample: ``resized`` (images lowered below their ``max_pixels`` size by the
budget), ``frames_sampled`` (a video keeps fewer frames than it has), ``turns_cut`` (trailing turns
dropped), ``images_cut`` (dropped turns held media), ``skipped_<reason>`` (see ``SKIP_REASONS``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from energon_tasks.families import Budget
from energon_tasks.image_grid import ImageGrid
from energon_tasks.sample_format import PLACEHOLDER_RE, CanonicalSample, Media

#: Why a sample can be skipped by the planner (decode-time reasons live in energon_tasks.decode).
SKIP_REASONS = (
    "no_assistant_turn",
    "bad_media_metadata",
    "too_many_images",
    "too_many_visual_tokens",
    "too_long",
)
ACTIONS = ("resized", "frames_sampled", "turns_cut", "images_cut")
#: the counters of media the budget dropped: with turns cut, or with the skipped sample
MEDIA_DROPS = ("images_cut", "skipped_too_many_images", "skipped_too_many_visual_tokens")


def media_dropped(counters: dict[str, int]) -> dict[str, int]:
    """The ``MEDIA_DROPS`` counters of ``counters`` that are not 0."""
    return {name: counters[name] for name in MEDIA_DROPS if counters.get(name)}

#: (media, frame indices, grid) -> tokens of a video span that are not video context tokens
#: (markers, timestamps, Nemotron-Omni's frame-pair labels). The default counts the two markers.
VideoExtraTokens = Callable[[Media, Sequence[int], ImageGrid], int]


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaPlan:
    """One kept media item and the size it will be decoded to."""

    index: int  #: position in ``sample.media`` (placeholder order)
    turn: int  #: index of the turn holding its placeholder
    kind: str  #: "image" | "video"
    grid: ImageGrid  #: resize target, grid_thw (before the merge) and visual tokens
    #: video only: the frames to decode, ascending (the processors' picks: ``frame_positions``
    #: rounded; after decoding, the frames read: ``VLMTaskEncoder.decode_sample``)
    frame_indices: tuple[int, ...] = ()
    #: video only: the fractional frame positions uniform in time (``video_frame_positions``);
    #: the loader reads the frame shown at each one's time
    frame_positions: tuple[float, ...] = ()
    #: video only: true seconds of each decoded frame when they are not index / fps (keyframe
    #: sampling moves the frames, a variable-rate clip's times are its own; set after decoding,
    #: ``VLMTaskEncoder.decode_sample``)
    timestamps: tuple[float, ...] | None = None
    span_tokens: int  #: tokens of the whole span: markers + pads (+ timestamps)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What the encoder will do with one sample; ``skip`` set means nothing is decoded."""

    key: str  #: the sample key (for messages)
    kept_turns: int = 0  #: conversation[:kept_turns] is encoded
    media: tuple[MediaPlan, ...] = ()  #: kept media in placeholder order
    text_tokens: int = 0  #: tokens outside visual spans of the kept turns
    visual_tokens: int = 0  #: <|image_pad|> + <|video_pad|> tokens
    total_tokens: int = 0  #: text + every span token: the encoded length
    actions: tuple[str, ...] = ()  #: subset of ACTIONS, in that order
    skip: str | None = None  #: one of SKIP_REASONS when skipped
    detail: str = ""  #: human-readable reason of the skip or of the actions
    extra: dict = field(default_factory=dict)  #: free-form numbers for reports

    def counters(self) -> dict[str, int]:
        """{"samples": 1, "kept" or "skipped_<reason>": 1, each action: 1}."""
        if self.skip:
            return {"samples": 1, f"skipped_{self.skip}": 1}
        return {"samples": 1, "kept": 1, **{action: 1 for action in self.actions}}


def _media_turns(sample: CanonicalSample) -> list[int]:
    return [i for i, turn in enumerate(sample.conversation)
            for _ in PLACEHOLDER_RE.findall(turn.content)]


def _image_grids(sample, budget, indices, cap) -> dict[int, ImageGrid]:
    low, high, geometry = budget.min_pixels, budget.max_pixels, budget.geometry
    return {
        i: geometry.image_grid(sample.media[i].height, sample.media[i].width,
                               min_pixels=low, max_pixels=min(high, cap))
        for i in indices
    }


def _best_cap(sample, budget, images, limit: int) -> dict[int, ImageGrid] | None:
    """Grids at the largest shared pixel cap whose image tokens fit ``limit`` (None: none does).

    The caps searched are ``min_pixels`` and the multiples of the geometry's ``pixel_cap_step``
    above it, up to ``max_pixels`` (1 for Qwen: every area; Nemotron-Omni: whole patches, or
    whole tiles on the tiled path, where the cap is a tile count). Binary search assumes tokens
    never decrease with the cap, which Nemotron-Omni's dynamic rule breaks by a few tokens
    (docs/nemotron.md); the result still fits, since ``min_pixels`` fits and only caps that fit
    are kept: at worst a slightly larger fitting cap is missed.
    """
    low, high = budget.min_pixels, budget.max_pixels
    step = budget.geometry.pixel_cap_step

    def tokens(cap: int) -> int:
        return sum(g.visual_tokens for g in _image_grids(sample, budget, images, cap).values())

    if tokens(low) > limit:
        return None
    best, lo, hi = low, low // step + 1, high // step  # candidates above low: k * step
    while lo <= hi:
        mid = (lo + hi) // 2
        if tokens(mid * step) <= limit:
            best, lo = mid * step, mid + 1
        else:
            hi = mid - 1
    return _image_grids(sample, budget, images, best)


def _videos(sample, budget, video_extra) -> tuple[dict, dict[int, str]]:
    """Frame picks + grid + span tokens of each video, and the metadata errors by media index."""
    geometry, low, high = budget.geometry, budget.video_min_pixels, budget.video_max_pixels
    plans, bad = {}, {}
    for i, media in enumerate(sample.media):
        try:
            if media.kind == "image":
                geometry.image_grid(media.height, media.width)  # aspect / size check only
                continue
            positions = geometry.video_frame_positions(
                media.frames or 0, media.fps or 0.0,
                video_fps=budget.video_fps, max_num_frames=budget.max_num_frames)
            grid = geometry.video_grid(len(positions), media.height, media.width,
                                       min_pixels=low, max_pixels=high)
        except (ValueError, TypeError) as error:
            bad[i] = f"{media.part}: {error}"
            continue
        frames = [round(p) for p in positions]  # the processors' indices
        extra = 2 if video_extra is None else video_extra(media, frames, grid)
        plans[i] = (tuple(frames), grid, grid.visual_tokens + extra, tuple(positions))
    return plans, bad


def plan(
    sample: CanonicalSample,
    *,
    key: str,
    budget: Budget,
    turn_text_tokens: Sequence[int],
    video_extra_tokens: VideoExtraTokens | None = None,
) -> Plan:
    """Decide, from metadata only, which turns and media of a sample are kept and at which size.

    Args:
        sample: the parsed ``K.json``.
        key: the sample key (named in details).
        budget: the resolved budget (``TaskEncoderConfig.resolve``).
        turn_text_tokens: tokens of each turn outside its visual spans (template tokens included).
        video_extra_tokens: tokens of a video span besides its pads (default 2: the markers).

    Returns:
        The plan; ``plan.skip`` names the reason when nothing can be kept.

    Raises:
        ValueError: ``turn_text_tokens`` does not have one entry per turn.
    """
    turns = sample.conversation
    if len(turn_text_tokens) != len(turns):
        raise ValueError(f"sample {key}: {len(turn_text_tokens)} token counts, {len(turns)} turns")
    cuts = [k for k in range(len(turns), 0, -1) if turns[k - 1].role == "assistant"]
    if not cuts:
        return Plan(key=key, skip="no_assistant_turn", detail=f"sample {key}: no assistant turn")
    media_turn = _media_turns(sample)
    videos, bad = _videos(sample, budget, video_extra_tokens)
    unconstrained = _image_grids(sample, budget, [i for i, m in enumerate(sample.media)
                                                  if m.kind == "image" and i not in bad], 1 << 62)
    reason = detail = ""
    for shrink_for_length in (False, True):
        for kept in cuts:
            indices = [i for i, t in enumerate(media_turn) if t < kept]
            text = sum(turn_text_tokens[:kept])
            result = _fit(sample, budget, indices, videos, bad, text, shrink_for_length)
            if isinstance(result, tuple):
                reason, detail = result
                continue
            return _finish(sample, key, kept, result, videos, unconstrained, media_turn, text)
    return Plan(key=key, skip=reason, detail=f"sample {key}: {detail}")


def _fit(sample, budget, indices, videos, bad, text, shrink_for_length):
    """Image grids of a prefix, or (reason, detail) when it cannot fit."""
    if broken := [bad[i] for i in indices if i in bad]:
        return "bad_media_metadata", "; ".join(broken)
    images = [i for i in indices if sample.media[i].kind == "image"]
    if len(images) > budget.max_num_images:
        return "too_many_images", f"{len(images)} images > max_num_images {budget.max_num_images}"
    video_pads = sum(videos[i][1].visual_tokens for i in indices if i in videos)
    video_span = sum(videos[i][2] for i in indices if i in videos)
    grids = _best_cap(sample, budget, images, budget.max_visual_tokens - video_pads)
    if grids is None:
        return "too_many_visual_tokens", (
            f"visual tokens above max_visual_tokens {budget.max_visual_tokens} even at min_pixels")
    room = budget.seq_length - text - video_span - 2 * len(images)
    if shrink_for_length and room < sum(g.visual_tokens for g in grids.values()):
        grids = _best_cap(sample, budget, images, min(room, budget.max_visual_tokens - video_pads))
    used = sum(g.visual_tokens for g in grids.values()) if grids is not None else None
    if used is None or used > room:
        shown = text + video_span + 2 * len(images) + (used or 0)
        return "too_long", f"{shown} tokens > seq_length {budget.seq_length}"
    return grids


def _finish(sample, key, kept, grids, videos, unconstrained, media_turn, text) -> Plan:
    media, actions = [], []
    for i, turn in enumerate(media_turn):
        if turn >= kept:
            continue
        if i in grids:
            media.append(MediaPlan(index=i, turn=turn, kind="image", grid=grids[i],
                                   span_tokens=grids[i].visual_tokens + 2))
        else:
            frames, grid, span, positions = videos[i]
            media.append(MediaPlan(index=i, turn=turn, kind="video", grid=grid,
                                   frame_indices=frames, frame_positions=positions,
                                   span_tokens=span))
    if any(grids[i] != unconstrained[i] for i in grids):
        actions.append("resized")
    if any(m.kind == "video" and len(m.frame_indices) < sample.media[m.index].frames
           for m in media):
        actions.append("frames_sampled")
    if kept < len(sample.conversation):
        actions.append("turns_cut")
        if len(media) < len(sample.media):
            actions.append("images_cut")
    visual = sum(m.grid.visual_tokens for m in media)
    total = text + sum(m.span_tokens for m in media)
    detail = ", ".join(actions)
    return Plan(key=key, kept_turns=kept, media=tuple(media), text_tokens=total - visual,
                visual_tokens=visual, total_tokens=total, actions=tuple(actions), detail=detail)
