"""What a family package of the data side provides, and the budget value its profile resolves.

A family package (``energon_tasks/families/<package>/``) holds the geometry, the task-encoder
hooks and the profiles of one processor family; its ``__init__`` exposes ``PROFILES``, a tuple of
``Profile`` values (one per profile name of ``contract.families``). The registry
(``energon_tasks.profiles``) lists the packages; nothing outside a package compares anything with
a family or profile name: what differs is asked of the profile, its geometry or its hooks.

- ``Geometry`` (Protocol): the sizes, grids, token counts, frame picks and pixel rows of a
  model's processors, the planner's interface (``QwenVLGeometry``, ``NemotronOmniGeometry``).
- ``Hooks`` (Protocol): the model-dependent steps of the one task encoder (tokens, spans, pixel
  rows, positions), built with the encoder.
- ``Profile``: one profile's geometry, hooks, default tokenizer, the family its batches feed, and
  the ``TaskEncoderConfig`` knobs only it reads (``knobs``) or ignores (``ignored``).
- ``Budget``: the task encoder's knobs resolved once by ``Profile.resolve`` (defaults filled
  from the geometry, the profile's knobs applied to it): the frozen value the planner
  (``energon_tasks.budget.plan``) and the encoder read.

"Adding a family" in docs/internals/architecture.md lists the files a new package adds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from energon_tasks.image_grid import ImageGrid

__all__ = ["Budget", "Geometry", "Hooks", "Knob", "Profile"]


class Geometry(Protocol):
    """The planner's and the encoder's interface to a model's processors (frozen dataclasses)."""

    name: str  #: the profile name
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    default_min_pixels: int
    default_max_pixels: int
    default_video_min_pixels: int
    default_video_max_pixels: int
    image_resize: str  #: how the exact path resizes ("pil" / "torch")

    @property
    def pixel_cap_step(self) -> int: ...

    def image_grid(self, height: int, width: int, *, min_pixels: int | None = None,
                   max_pixels: int | None = None) -> ImageGrid: ...

    def video_grid(self, num_frames: int, height: int, width: int, *,
                   min_pixels: int | None = None, max_pixels: int | None = None) -> ImageGrid: ...

    def video_frame_positions(self, total_frames: int, source_fps: float, *, video_fps: float,
                              max_num_frames: int) -> list[float]: ...

    def video_frame_indices(self, total_frames: int, source_fps: float, *, video_fps: float,
                            max_num_frames: int) -> list[int]: ...

    def image_cap_notice(self, max_pixels: int | None) -> str | None: ...


class Hooks(Protocol):
    """The model-dependent steps of ``energon_tasks.task_encoder.VLMTaskEncoder``."""

    REQUIRED_TOKENS: tuple[str, ...]  #: special tokens a tokenizer must have
    SPECIAL_TOKENS: Mapping[str, str]  #: encoder attribute -> special token (its id is set)

    def __init__(self, encoder) -> None: ...

    def default_pad_id(self) -> int: ...

    def span(self, media, grid_thw, frames=(), seconds=None) -> list[int]: ...

    def finish_decode(self, plan, sample, media_bytes: dict, decoded: dict) -> dict: ...

    def pixel_grid(self, kind: str, frames) -> tuple[int, int, int]: ...

    def pixel_row_width(self, kind: str) -> int: ...

    def write_pixel_rows(self, kind: str, frames, out) -> None: ...

    def position_ids(self, *args, **kwargs): ...


@dataclass(frozen=True, slots=True)
class Knob:
    """A ``TaskEncoderConfig`` knob only some profiles read; it sets the geometry field of the
    same name. ``valid`` checks a value that is set; ``expected`` words it for the error."""

    valid: Callable[[Any], bool]
    expected: str


@dataclass(frozen=True, slots=True)
class Budget:
    """The task encoder's settings after resolution: every value the planner and the encoder
    read, with the geometry's defaults filled in and the profile's knobs applied."""

    profile: Profile  #: the profile (name, family, hooks, default tokenizer)
    geometry: Geometry  #: the profile's geometry with its knobs applied
    tokenizer: str  #: hub id or folder (the profile's default when none is configured)
    min_pixels: int  #: image area floor
    max_pixels: int  #: image area ceiling (a tile cap on tiled images: ``pixel_cap_step``)
    video_min_pixels: int  #: video floor (per frame, or clip volume for Qwen3-VL)
    video_max_pixels: int  #: video ceiling
    video_fps: float
    max_num_frames: int
    max_num_images: int
    max_visual_tokens: int
    seq_length: int
    length_multiple: int  #: every batch length is a multiple of it (padding and 2 * CP)
    fixed_length: bool
    packing: bool
    packing_buffer_size: int
    max_source_pixels: int
    image_decode: str
    video_sampling: str  #: "exact" or "keyframe" (``TaskEncoderConfig.video_sampling``)


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """What the data side needs to make one model's inputs."""

    name: str  #: canonical profile name (contract.families)
    family: str  #: the model family fed (contract.families.FAMILIES)
    geometry: Geometry  #: the processor geometry with its own defaults
    hooks: type  #: task-encoder hooks class (a ``Hooks``), built with the encoder
    default_tokenizer: str  #: hub id of the tokenizer / processor when none is configured
    #: ``TaskEncoderConfig`` knobs only this profile reads -> their check (each sets the
    #: geometry field of its name); set on another profile they are an error
    knobs: Mapping[str, Knob] = field(default_factory=dict)
    #: ``TaskEncoderConfig`` knobs this profile does not read -> why (set, they are an error)
    ignored: Mapping[str, str] = field(default_factory=dict)

    def knob_problems(self, config) -> list[str]:
        """Bad values of this profile's knobs and knobs it ignores that are set."""
        problems = []
        for name, knob in self.knobs.items():
            value = getattr(config, name)
            if value is not None and not knob.valid(value):
                problems.append(f"{name}: must be {knob.expected} or null, got {value!r}")
        for name, why in self.ignored.items():
            if getattr(config, name) is not None:
                problems.append(f"{name}: not used by {self.name} ({why}); leave it null")
        return problems

    def geometry_for(self, config) -> Geometry:
        """The geometry with this profile's knobs that ``config`` sets."""
        changes = {name: getattr(config, name) for name in self.knobs
                   if getattr(config, name) is not None}
        return dataclasses.replace(self.geometry, **changes) if changes else self.geometry

    def resolve(self, config) -> Budget:
        """``config``'s knobs as the budget this profile reads (defaults from the geometry)."""
        geometry = self.geometry_for(config)

        def default(value, fallback):
            return fallback if value is None else value

        cp = 2 * config.context_parallel_size if config.context_parallel_size > 1 else 1
        return Budget(
            profile=self, geometry=geometry,
            tokenizer=config.tokenizer or self.default_tokenizer,
            min_pixels=default(config.min_pixels, geometry.default_min_pixels),
            max_pixels=default(config.max_pixels, geometry.default_max_pixels),
            video_min_pixels=default(config.video_min_pixels, geometry.default_video_min_pixels),
            video_max_pixels=default(config.video_max_pixels, geometry.default_video_max_pixels),
            video_fps=config.video_fps, max_num_frames=config.max_num_frames,
            max_num_images=config.max_num_images, max_visual_tokens=config.max_visual_tokens,
            seq_length=config.seq_length,
            length_multiple=math.lcm(config.pad_to_multiple_of, cp),
            fixed_length=config.fixed_length, packing=config.packing,
            packing_buffer_size=config.packing_buffer_size,
            max_source_pixels=config.max_source_pixels, image_decode=config.image_decode,
            video_sampling=config.video_sampling,
        )
