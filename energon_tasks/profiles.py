"""The data side's one registry of input profiles: what the task encoders need per model.

A profile (named as in ``contract.families``: ``qwen2_5_vl``, ``qwen3_vl``, ``nemotron_omni``,
``nemotron_omni_tiled``) holds everything that differs between models on the data side:

- ``family``: the model family its batches feed (``contract.families.PROFILES``);
- ``geometry``: sizes, grids, token counts, frame picks, pixel rows (``energon_tasks.geometry``
  for Qwen-VL, ``energon_tasks.nemotron_geometry`` for Nemotron-Omni);
- ``hooks``: the task-encoder hooks class (special tokens, spans, pixel rows, positions; the
  encoder in ``energon_tasks.task_encoder`` is composed with it);
- ``default_tokenizer``: the hub id used when ``TaskEncoderConfig.tokenizer`` is not set.

The model side keeps its own registry under the same names (``models.families``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contract import families as F
from energon_tasks.geometry import QWEN2_5_VL, QWEN3_VL
from energon_tasks.nemotron_geometry import NEMOTRON_OMNI, NEMOTRON_OMNI_TILED
from energon_tasks.nemotron_omni import NemotronOmniHooks
from energon_tasks.qwen_vl import QwenVLHooks

__all__ = ["PROFILES", "Profile", "get_geometry", "get_profile"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """What the data side needs to make one model's inputs."""

    name: str  #: canonical profile name (contract.families)
    family: str  #: the model family fed (contract.families.FAMILIES)
    geometry: Any  #: QwenVLGeometry or NemotronOmniGeometry (the planner's interface)
    hooks: type  #: task-encoder hooks class, built with the encoder (QwenVLHooks, ...)
    default_tokenizer: str  #: hub id of the tokenizer / processor when none is configured


_NEMOTRON_TOKENIZER = "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16"
PROFILES = {profile.name: profile for profile in (
    Profile(name=F.QWEN2_5_VL, family=F.PROFILES[F.QWEN2_5_VL], geometry=QWEN2_5_VL,
            hooks=QwenVLHooks, default_tokenizer="Qwen/Qwen2.5-VL-7B-Instruct"),
    Profile(name=F.QWEN3_VL, family=F.PROFILES[F.QWEN3_VL], geometry=QWEN3_VL,
            hooks=QwenVLHooks, default_tokenizer="Qwen/Qwen3-VL-8B-Instruct"),
    Profile(name=F.NEMOTRON_OMNI, family=F.PROFILES[F.NEMOTRON_OMNI], geometry=NEMOTRON_OMNI,
            hooks=NemotronOmniHooks, default_tokenizer=_NEMOTRON_TOKENIZER),
    Profile(name=F.NEMOTRON_OMNI_TILED, family=F.PROFILES[F.NEMOTRON_OMNI_TILED],
            geometry=NEMOTRON_OMNI_TILED, hooks=NemotronOmniHooks,
            default_tokenizer=_NEMOTRON_TOKENIZER),
)}


def get_profile(name: str) -> Profile:
    """The profile of a model name (canonical or an alias, any case).

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    return PROFILES[F.profile_name(name)]


def get_geometry(name: str):
    """The geometry of a model name: ``QwenVLGeometry`` for qwen2_5_vl / qwen3_vl,
    ``NemotronOmniGeometry`` for nemotron_omni (dynamic images) / nemotron_omni_tiled (tiled
    images); aliases (``qwen2.5-vl``, ...) accepted.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    return get_profile(name).geometry
