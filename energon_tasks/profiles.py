"""The data side's one registry of input profiles: the family packages and their profiles.

A profile (named as in ``contract.families``: ``qwen2_5_vl``, ``qwen3_vl``, ``nemotron_omni``,
``nemotron_omni_tiled``) holds everything that differs between models on the data side: its
family, geometry, task-encoder hooks, default tokenizer and own knobs (``energon_tasks.families.
Profile``). Each family package (``energon_tasks/families/<package>/``) exposes its ``PROFILES``;
adding one is a line in ``PACKAGES``. The model side keeps its own registry under the same names
(``models.families``).
"""

from __future__ import annotations

from contract.families import profile_name
from energon_tasks.families import Geometry, Profile, nemotron_omni, qwen_vl

__all__ = ["PROFILES", "Profile", "get_geometry", "get_profile"]

#: the family packages of the data side, each with its ``PROFILES``
PACKAGES = (qwen_vl, nemotron_omni)
PROFILES: dict[str, Profile] = {profile.name: profile
                                for package in PACKAGES for profile in package.PROFILES}


def get_profile(name: str) -> Profile:
    """The profile of a model name (canonical or an alias, any case).

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    return PROFILES[profile_name(name)]


def get_geometry(name: str) -> Geometry:
    """The geometry of a model name (its processors' defaults); aliases (``qwen2.5-vl``, ...)
    accepted.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    return get_profile(name).geometry
