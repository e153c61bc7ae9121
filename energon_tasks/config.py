"""Settings of the task encoders: the knobs, validated as a whole, and nothing else.

This module owns every knob of the loader side (pixel limits, media caps, the visual-token and
sequence budgets, padding, context parallel divisibility, packing, the decompression-bomb cap, how
images are decoded (``image_decode``), how video frames are sampled (``video_sampling``), the
model / tokenizer names, and the knobs only some profiles read, such as Nemotron-Omni's
``max_num_tiles`` / ``video_maintain_aspect_ratio`` / ``video_target_num_patches``) and the rules
they must satisfy together. ``train.py`` loads YAML plus ``key=value`` overrides into
``TaskEncoderConfig.from_dict``; unknown keys are an error.

Models (``model``, a profile of ``energon_tasks.profiles``): "qwen2_5_vl", "qwen3_vl",
"nemotron_omni" (dynamic-resolution images), "nemotron_omni_tiled" (512x512 tiles + thumbnail);
the aliases of ``contract.families`` ("qwen2.5-vl", "nemotron-omni-tiled", ...) are read as these
names. A knob only some profiles read is an error on the others, and so is a knob a profile
ignores (``Profile.knobs`` / ``Profile.ignored``: e.g. ``video_min_pixels`` on Nemotron-Omni,
whose frame size is fixed by ``video_target_num_patches``).

Resolution is the profile's, done once: ``TaskEncoderConfig.resolve()`` gives the frozen
``energon_tasks.families.Budget`` (defaults filled from the geometry, the profile's knobs applied
to it) that the planner and the encoder read. Defaults: the fields' defaults below are the run's
(one source: the converters' token estimates read them too); ``None`` means the model
processor's own value, held by the geometry. When a profile reads a knob differently from its
name (``nemotron_omni_tiled`` reads ``max_pixels`` as a tile cap, ``max_pixels // 512**2``),
building the config says so once, in one line (``Geometry.image_cap_notice``).
"""


from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any

from contract.config import build, raise_problems
from contract.families import profile_name
from energon_tasks.families import Budget, Profile
from energon_tasks.profiles import PROFILES, get_profile

#: ``video_sampling`` values: "exact" = the frames shown at the uniform times (the processors'
#: frames on a constant-rate clip); "keyframe" = the keyframe nearest each of them, with its
#: true timestamp (cheaper: one keyframe decoded per frame; energon_tasks.video_decode,
#: docs/format.md)
VIDEO_SAMPLINGS = ("exact", "keyframe")
#: ``image_decode`` values: "exact" = the model's transformers processor's pixel values (whole
#: image decoded, the processor's resize); "fast" = JPEG decoded at a reduced DCT scale when the
#: target is at most half the source per side, then PIL bicubic (energon_tasks.decode)
IMAGE_DECODES = ("exact", "fast")

log = logging.getLogger("energon_tasks.config")


@dataclass(slots=True, kw_only=True)
class TaskEncoderConfig:
    """Every knob of the task encoders (``None`` = the model's processor default)."""

    model: str = "qwen2_5_vl"  #: profile name (``energon_tasks.profiles``; aliases read as it)
    tokenizer: str | None = None  #: hub id or local folder; None -> the profile's default
    min_pixels: int | None = None  #: image area floor after resize
    max_pixels: int | None = 1003520  #: image area ceiling after resize (1280 * 28**2)
    video_min_pixels: int | None = None  #: video floor (per frame, or clip volume for Qwen3-VL)
    video_max_pixels: int | None = None  #: video ceiling (per frame, or clip volume for Qwen3-VL)
    video_fps: float = 2.0  #: frames sampled per second of video, uniformly over the clip
    max_num_frames: int = 60  #: cap on sampled frames per video
    max_num_images: int = 10  #: cap on images per sample (turns are cut beyond it)
    max_visual_tokens: int = 16384  #: cap on visual tokens per sample (resize, then cut, then skip)
    seq_length: int = 4096  #: cap on tokens per sample, and the packed row length
    pad_to_multiple_of: int = 8  #: batch length multiple
    fixed_length: bool = False  #: pad every batch to seq_length (pipeline parallel)
    context_parallel_size: int = 1  #: lengths are padded to a multiple of 2 * CP when CP > 1
    packing: bool = False  #: pack several samples per row (Energon packing hooks)
    #: samples skipped in a row by one reader (budget, media) that end the run in one line
    #: (``TooManySkips``) instead of a reader that never yields and ranks that wait on it
    max_skips_in_a_row: int = 1000
    packing_buffer_size: int = 64  #: samples Energon buffers before each packing selection
    max_source_pixels: int = 89_478_485  #: decompression-bomb cap on stored pixels (PIL default)
    #: "exact" (pixel values equal to the transformers processor's) or "fast" (JPEG draft decode:
    #: cheaper, pixels differ; docs/benchmarks_task_encoder.md measures both), see IMAGE_DECODES
    image_decode: str = "exact"
    #: "exact" (the frames at the uniform times, as the processors) or "keyframe" (the
    #: keyframe nearest each, true timestamps in the span and positions), see VIDEO_SAMPLINGS
    video_sampling: str = "exact"
    #: nemotron_omni_tiled only: tiles per image before the thumbnail (None: the geometry's 12).
    #: ``max_pixels`` caps it further to max_pixels // 512**2 tiles (at least 1): ``tile_cap``.
    max_num_tiles: int | None = None
    #: nemotron_omni* only: video frames keep their aspect ratio around 1024 patches (True), or
    #: are 512x512 (False); None: the geometry's (True, the transformers processor default).
    video_maintain_aspect_ratio: bool | None = None
    #: nemotron_omni* only: patches per video frame (the processor's video_target_num_patches;
    #: 1024 = 512x512 for a square frame); None: the geometry's 1024. Lower it to shrink videos.
    video_target_num_patches: int | None = None

    def __post_init__(self) -> None:
        try:
            self.model = profile_name(self.model)  # the one spelling from here on
        except ValueError:
            pass  # validate() reports it with the other problems
        self.validate()
        notice = self.resolve().geometry.image_cap_notice(self.max_pixels)
        if notice:
            _notice_once(notice)

    def resolve(self) -> Budget:
        """These knobs as the frozen budget the planner and the encoder read: defaults filled
        from the profile's geometry, the profile's own knobs applied to it
        (``energon_tasks.families.Profile.resolve``)."""
        return get_profile(self.model).resolve(self)

    def validate(self) -> None:
        """Check all settings together.

        Raises:
            ConfigError: every problem found, one per line.
        """
        problems = []
        try:
            profile = get_profile(self.model)
        except ValueError as error:
            problems.append(f"model: {error}")
        else:
            problems += self._knob_problems(profile)
        positive = [
            "video_fps", "max_num_frames", "max_num_images", "max_visual_tokens", "seq_length",
            "pad_to_multiple_of", "context_parallel_size", "packing_buffer_size",
            "max_source_pixels",
        ]
        for name in positive:
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                problems.append(f"{name}: must be a positive number, got {getattr(self, name)!r}")
        for low, high in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
            lo, hi = getattr(self, low), getattr(self, high)
            for name, value in ((low, lo), (high, hi)):
                if value is not None and (not isinstance(value, int) or value < 1):
                    problems.append(f"{name}: must be a positive integer or null, got {value!r}")
            if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
                problems.append(f"{low} ({lo}) is above {high} ({hi})")
        if self.image_decode not in IMAGE_DECODES:
            problems.append(f"image_decode: must be one of {', '.join(IMAGE_DECODES)}, got "
                            f"{self.image_decode!r}")
        if self.video_sampling not in VIDEO_SAMPLINGS:
            problems.append(f"video_sampling: must be one of {', '.join(VIDEO_SAMPLINGS)}, got "
                            f"{self.video_sampling!r}")
        multiple = None if problems else self.resolve().length_multiple
        if multiple and self.seq_length % multiple:
            problems.append(
                f"seq_length ({self.seq_length}) must be a multiple of {multiple} "
                "(pad_to_multiple_of and 2 * context_parallel_size)"
            )
        raise_problems(problems)

    def _knob_problems(self, profile: Profile) -> list[str]:
        """Profile-only knobs set on a profile that does not read them, and the profile's own
        checks (its knobs' values, the knobs it ignores)."""
        problems = []
        for name in sorted({name for other in PROFILES.values() for name in other.knobs}):
            if getattr(self, name) is not None and name not in profile.knobs:
                readers = [other.name for other in PROFILES.values() if name in other.knobs]
                problems.append(f"{name}: only applies to {', '.join(readers)}, not "
                                f"{self.model}")
        return problems + profile.knob_problems(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TaskEncoderConfig":
        """Build from a mapping (YAML, or ``key=value`` strings from the command line) with the
        project's one config builder (``contract.config.build``: strings read as command-line
        values, types checked, unknown keys named with the valid ones).

        Raises:
            ConfigError: unknown keys, values of the wrong type, or invalid settings (all
                listed, each under ``task_encoder.``).
        """
        return build(cls, values, "task_encoder")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (for logs and checkpoints)."""
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=None)
def _notice_once(notice: str) -> None:
    """Say once per setting what a profile reads a knob as (``Geometry.image_cap_notice``)."""
    log.warning("task_encoder: %s", notice)
