"""Settings of the task encoders (Qwen-VL and Nemotron-Omni): one dataclass, validated as a whole.

This module owns every knob of the loader side (pixel limits, media caps, the visual-token and
sequence budgets, padding, context parallel divisibility, packing, the decompression-bomb cap, how
images are decoded (``image_decode``), the model / tokenizer names, and the two Nemotron-Omni
knobs ``max_num_tiles`` / ``video_maintain_aspect_ratio``) and the rules they must satisfy
together. ``train.py`` loads YAML plus ``key=value`` overrides into
``TaskEncoderConfig.from_dict``; unknown keys are an error.

Models (``model``, a profile of ``energon_tasks.profiles``): "qwen2_5_vl", "qwen3_vl"
(``QwenVLGeometry``) and "nemotron_omni" (dynamic-resolution images), "nemotron_omni_tiled"
(512x512 tiles + thumbnail) (``NemotronOmniGeometry``); the aliases of ``contract.families``
("qwen2.5-vl", "nemotron-omni-tiled", ...) are read as these names. The Nemotron knobs are an
error on a model they do not apply to (``max_num_tiles``: only "nemotron_omni_tiled";
``video_maintain_aspect_ratio``: both Nemotron profiles), and so are ``video_min_pixels`` /
``video_max_pixels`` on Nemotron (its frame size is fixed by ``video_target_num_patches``).

Defaults: the fields' defaults below are the run's (one source: the converters' token estimates
read them too); ``None`` means the model processor's own value, held by the geometry.
On ``nemotron_omni_tiled`` the image cap is in tiles: ``max_num_tiles`` (default 12), further capped
by ``max_pixels // 512**2`` (at least 1; ``tile_cap``). When ``max_pixels`` lowers the tile cap,
building the config logs that once, in one line.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

from contract.errors import ConfigError
from contract.families import NEMOTRON_OMNI, profile_name
from energon_tasks.geometry import QwenVLGeometry
from energon_tasks.profiles import Profile, get_profile

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
    packing_buffer_size: int = 64  #: samples Energon buffers before each packing selection
    max_source_pixels: int = 89_478_485  #: decompression-bomb cap on stored pixels (PIL default)
    #: "exact" (pixel values equal to the transformers processor's) or "fast" (JPEG draft decode:
    #: cheaper, pixels differ; docs/benchmarks_task_encoder.md measures both), see IMAGE_DECODES
    image_decode: str = "exact"
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
        cap = self.tile_cap
        if cap is not None and cap < self.geometry.max_num_tiles:
            _notice_tile_cap(self.model, self.max_pixels, cap, self.geometry.max_num_tiles)

    @property
    def profile(self) -> Profile:
        """The model's profile (geometry, hooks, default tokenizer, family)."""
        return get_profile(self.model)

    @property
    def family(self) -> str:
        """The model family the batches feed (``contract.families``), e.g. "nemotron_omni"."""
        return self.profile.family

    @property
    def geometry(self) -> QwenVLGeometry:
        """The model's geometry with the Nemotron knobs applied (``QwenVLGeometry`` or
        ``NemotronOmniGeometry``; both have the planner's interface)."""
        return _geometry(self.model, self.max_num_tiles, self.video_maintain_aspect_ratio,
                         self.video_target_num_patches)

    @property
    def tokenizer_name(self) -> str:
        """``tokenizer`` or the model's default hub id."""
        return self.tokenizer or self.profile.default_tokenizer

    @property
    def tile_cap(self) -> int | None:
        """Tiled images only: the tile cap ``max_pixels`` leaves, max(min_num_tiles,
        min(max_num_tiles, max_pixels // tile_size**2)) (the geometry's ``image_grid`` rule);
        None on other models or with ``max_pixels: null``."""
        geometry = self.geometry
        if getattr(geometry, "image_mode", None) != "tiled" or self.max_pixels is None:
            return None
        return max(geometry.min_num_tiles,
                   min(geometry.max_num_tiles, self.max_pixels // geometry.tile_size**2))

    def image_pixels(self) -> tuple[int, int]:
        """(min_pixels, max_pixels) of images, defaults filled from the geometry."""
        geometry = self.geometry
        low = geometry.default_min_pixels if self.min_pixels is None else self.min_pixels
        high = geometry.default_max_pixels if self.max_pixels is None else self.max_pixels
        return low, high

    def video_pixels(self) -> tuple[int, int]:
        """(video_min_pixels, video_max_pixels), defaults filled from the geometry."""
        geometry = self.geometry
        low = self.video_min_pixels
        high = self.video_max_pixels
        return (
            geometry.default_video_min_pixels if low is None else low,
            geometry.default_video_max_pixels if high is None else high,
        )

    def length_multiple(self) -> int:
        """Every batch length is a multiple of this: lcm(pad_to_multiple_of, 2 * CP if CP > 1)."""
        cp = 2 * self.context_parallel_size if self.context_parallel_size > 1 else 1
        return math.lcm(self.pad_to_multiple_of, cp)

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
            problems += self._family_problems(profile)
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
        if not problems and self.seq_length % self.length_multiple():
            problems.append(
                f"seq_length ({self.seq_length}) must be a multiple of {self.length_multiple()} "
                "(pad_to_multiple_of and 2 * context_parallel_size)"
            )
        if problems:
            raise ConfigError("invalid task encoder config:\n  " + "\n  ".join(problems),
                              problems)

    def _family_problems(self, profile: Profile) -> list[str]:
        """Knobs set on a model they do not apply to, and bad Nemotron knob values."""
        problems = []
        nemotron = profile.family == NEMOTRON_OMNI
        tiled = nemotron and profile.geometry.image_mode == "tiled"
        tiles = self.max_num_tiles
        if tiles is not None and not tiled:
            problems.append(f"max_num_tiles: only applies to nemotron_omni_tiled, not {self.model}")
        elif tiles is not None and (not isinstance(tiles, int) or isinstance(tiles, bool)
                                    or tiles < 1):
            problems.append(f"max_num_tiles: must be a positive integer or null, got {tiles!r}")
        keep = self.video_maintain_aspect_ratio
        if keep is not None and not nemotron:
            problems.append(f"video_maintain_aspect_ratio: only applies to nemotron_omni models, "
                            f"not {self.model}")
        elif keep is not None and not isinstance(keep, bool):
            problems.append(f"video_maintain_aspect_ratio: must be true, false or null, got "
                            f"{keep!r}")
        target = self.video_target_num_patches
        if target is not None and not nemotron:
            problems.append(f"video_target_num_patches: only applies to nemotron_omni models, "
                            f"not {self.model}")
        elif target is not None and (not isinstance(target, int) or isinstance(target, bool)
                                     or target < 4):
            problems.append(f"video_target_num_patches: must be an integer >= 4 or null, got "
                            f"{target!r}")
        if nemotron:
            for name in ("video_min_pixels", "video_max_pixels"):
                if getattr(self, name) is not None:
                    problems.append(f"{name}: not used by {self.model} (video frames are sized by "
                                    "video_target_num_patches); leave it null")
        return problems

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TaskEncoderConfig":
        """Build from a mapping (YAML, or ``key=value`` strings from the command line).

        String values are converted to the field's type ("true"/"false", numbers, "null").

        Raises:
            ConfigError: unknown keys, unconvertible values, or invalid settings (all listed).
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        problems = [f"unknown key {key!r}" for key in values if key not in fields]
        kwargs = {}
        for key, value in values.items():
            if key not in fields:
                continue
            try:
                kwargs[key] = _coerce(value, str(fields[key].type))
            except ValueError:
                problems.append(f"{key}: cannot read {value!r} as {fields[key].type}")
        if problems:
            valid = ", ".join(fields)
            raise ConfigError(
                "invalid task encoder config:\n  " + "\n  ".join(problems) + f"\n  valid: {valid}",
                problems)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (for logs and checkpoints)."""
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=32)
def _geometry(model: str, max_num_tiles: int | None, keep_aspect: bool | None,
              video_target: int | None):
    """The profile's geometry with the Nemotron knobs that are set (cached: the planner asks for
    it many times per sample)."""
    geometry = get_profile(model).geometry
    changes = {"max_num_tiles": max_num_tiles, "video_maintain_aspect_ratio": keep_aspect,
               "video_target_num_patches": video_target}
    changes = {name: value for name, value in changes.items() if value is not None}
    return dataclasses.replace(geometry, **changes) if changes else geometry


@functools.lru_cache(maxsize=None)
def _notice_tile_cap(model: str, max_pixels: int, cap: int, max_num_tiles: int) -> None:
    """Say once per setting that ``max_pixels`` caps the tiles (the rule of ``tile_cap``)."""
    log.warning("task_encoder: %s reads max_pixels %d as a cap of %d tile(s) per image (below "
                "max_num_tiles %d); set max_pixels: null to use max_num_tiles", model, max_pixels,
                cap, max_num_tiles)


def _coerce(value: Any, type_name: str) -> Any:
    """Convert a command-line string to the annotated type; other values pass through."""
    if not isinstance(value, str) or type_name.startswith("str"):
        return value
    if value.lower() in ("null", "none") and "None" in type_name:
        return None
    if type_name.startswith("bool"):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(value)
        return value.lower() in ("true", "1", "yes")
    if type_name.startswith("int"):
        return int(value)
    if type_name.startswith("float"):
        return float(value)
    return value
