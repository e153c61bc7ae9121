"""The Nemotron-Omni family package of the data side: dynamic-resolution and tiled images, frame
pairs for video.

- ``geometry.py``: ``NemotronOmniGeometry`` (dynamic / tiled image grids, frame-pair video,
  timestamps, pixel rows), equal to transformers' ``nemotron_h_omni`` processors (tiled: InternVL);
- ``hooks.py``: the task-encoder hooks (tokens, spans, tiles, pixel rows, positions).

``PROFILES``: ``nemotron_omni`` (dynamic images) and ``nemotron_omni_tiled``. Their own knobs
(``TaskEncoderConfig``): ``video_maintain_aspect_ratio`` and ``video_target_num_patches`` (both),
``max_num_tiles`` (tiled); ``video_min_pixels`` / ``video_max_pixels`` are not read (frames are
sized by ``video_target_num_patches``).
"""

from __future__ import annotations

from contract import families as F
from energon_tasks.families import Knob, Profile
from energon_tasks.families.nemotron_omni.geometry import NEMOTRON_OMNI, NEMOTRON_OMNI_TILED
from energon_tasks.families.nemotron_omni.hooks import NemotronOmniHooks


def _int_at_least(low: int):
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= low


_VIDEO_KNOBS = {
    "video_maintain_aspect_ratio": Knob(lambda value: isinstance(value, bool), "true, false"),
    "video_target_num_patches": Knob(_int_at_least(4), "an integer >= 4"),
}
_IGNORED = {name: "video frames are sized by video_target_num_patches"
            for name in ("video_min_pixels", "video_max_pixels")}
_TOKENIZER = "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16"

PROFILES = (
    Profile(name=F.NEMOTRON_OMNI, family=F.PROFILES[F.NEMOTRON_OMNI], geometry=NEMOTRON_OMNI,
            hooks=NemotronOmniHooks, default_tokenizer=_TOKENIZER, knobs=_VIDEO_KNOBS,
            ignored=_IGNORED),
    Profile(name=F.NEMOTRON_OMNI_TILED, family=F.PROFILES[F.NEMOTRON_OMNI_TILED],
            geometry=NEMOTRON_OMNI_TILED, hooks=NemotronOmniHooks, default_tokenizer=_TOKENIZER,
            knobs={"max_num_tiles": Knob(_int_at_least(1), "a positive integer"),
                   **_VIDEO_KNOBS},
            ignored=_IGNORED),
)
