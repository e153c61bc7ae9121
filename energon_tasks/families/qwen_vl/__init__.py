"""The Qwen-VL family package of the data side: Qwen2.5-VL, Qwen3-VL (dense) and Qwen3-VL MoE,
Qwen3.5 / Qwen3.5 MoE and Cosmos3-Omni's reasoner (whose processor is Qwen3-VL's: their profiles
have the Qwen3-VL geometry and hooks; the special-token ids come from each model's tokenizer).

- ``geometry.py``: every size the processors impose (``QwenVLGeometry``: resize, grids, token
  counts, frame picks, pixel rows), equal to transformers';
- ``mrope.py``: the 3-D M-RoPE position ids (the models' ``get_rope_index``);
- ``hooks.py``: the task-encoder hooks (ChatML tokens, spans, pixel rows, positions).

``PROFILES`` are this package's profiles (``energon_tasks.families.Profile``); Qwen-VL reads no
profile-only knob.
"""

from __future__ import annotations

from contract import families as F
from energon_tasks.families import Profile
from energon_tasks.families.qwen_vl.geometry import (
    COSMOS3_OMNI,
    QWEN2_5_VL,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_VL,
    QWEN3_VL_MOE,
)
from energon_tasks.families.qwen_vl.hooks import QwenVLHooks

PROFILES = (
    Profile(name=F.QWEN2_5_VL, family=F.PROFILES[F.QWEN2_5_VL], geometry=QWEN2_5_VL,
            hooks=QwenVLHooks, default_tokenizer="Qwen/Qwen2.5-VL-7B-Instruct"),
    Profile(name=F.QWEN3_VL, family=F.PROFILES[F.QWEN3_VL], geometry=QWEN3_VL,
            hooks=QwenVLHooks, default_tokenizer="Qwen/Qwen3-VL-8B-Instruct"),
    Profile(name=F.QWEN3_VL_MOE, family=F.PROFILES[F.QWEN3_VL_MOE], geometry=QWEN3_VL_MOE,
            hooks=QwenVLHooks, default_tokenizer="Qwen/Qwen3-VL-30B-A3B-Instruct"),
    Profile(name=F.QWEN3_5, family=F.PROFILES[F.QWEN3_5], geometry=QWEN3_5,
            hooks=QwenVLHooks, default_tokenizer="Qwen/Qwen3.5-9B"),
    Profile(name=F.QWEN3_5_MOE, family=F.PROFILES[F.QWEN3_5_MOE], geometry=QWEN3_5_MOE,
            hooks=QwenVLHooks, default_tokenizer="Qwen/Qwen3.5-35B-A3B"),
    Profile(name=F.COSMOS3_OMNI, family=F.PROFILES[F.COSMOS3_OMNI], geometry=COSMOS3_OMNI,
            hooks=QwenVLHooks, default_tokenizer="nvidia/Cosmos3-Nano"),
)
