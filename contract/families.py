"""The model families and input profiles by name: one spelling each, and the aliases users may type.

This module owns the names, nothing else: each side keeps its own registry keyed by them
(``energon_tasks.profiles``: geometry, task-encoder hooks, special tokens, default tokenizer;
``models.families``: config module, model class, HF weight mapping).

- A *family* is a model architecture: ``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_vl_moe``,
  ``qwen3_5``, ``qwen3_5_moe``, ``nemotron_omni``, ``cosmos3_omni`` (the
  ``family`` key of a model config;
  ``HF_MODEL_TYPES`` gives the Hugging Face ``model_type`` of each).
- A *profile* is how the data side makes a family's inputs (``TaskEncoderConfig.model``): one per
  family (``qwen3_vl_moe``'s and Qwen3.5's read Qwen3-VL's processor), plus ``nemotron_omni_tiled``
  (Nemotron-Omni with InternVL-style tiled images).
- A *make family* is what a make target names (``MAKE_FAMILIES``): ``qwen-vl`` (every Qwen VLM
  family, the one trained following ``model.hf``'s ``model_type``) or ``nemotron-omni``.

Aliases (the hyphenated spellings ``qwen2.5-vl``, ``qwen3-vl``, ``nemotron-omni``,
``nemotron-omni-tiled``, and any letter case) are accepted where a user types a name (configs,
command lines) and turned into the one spelling there (``profile_name`` / ``family_name``); the
code after that sees only the canonical names.
"""

from __future__ import annotations

QWEN2_5_VL = "qwen2_5_vl"
QWEN3_VL = "qwen3_vl"
QWEN3_VL_MOE = "qwen3_vl_moe"
QWEN3_5 = "qwen3_5"
QWEN3_5_MOE = "qwen3_5_moe"
NEMOTRON_OMNI = "nemotron_omni"
#: Cosmos3-Omni's reasoner: a Qwen3-VL checkpoint in its own layout (generator / sound / action
#: towers of the unified checkpoint not built)
COSMOS3_OMNI = "cosmos3_omni"
NEMOTRON_OMNI_TILED = "nemotron_omni_tiled"

FAMILIES = (QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, QWEN3_5, QWEN3_5_MOE, NEMOTRON_OMNI,
            COSMOS3_OMNI)
#: profile -> the family whose model its batches feed
PROFILES = {QWEN2_5_VL: QWEN2_5_VL, QWEN3_VL: QWEN3_VL, QWEN3_VL_MOE: QWEN3_VL_MOE,
            QWEN3_5: QWEN3_5, QWEN3_5_MOE: QWEN3_5_MOE,
            NEMOTRON_OMNI: NEMOTRON_OMNI,
            NEMOTRON_OMNI_TILED: NEMOTRON_OMNI, COSMOS3_OMNI: COSMOS3_OMNI}
#: family -> the profiles whose batches it takes (train.py and eval.py refuse other pairings)
TASK_ENCODER_MODELS = {family: tuple(p for p, f in PROFILES.items() if f == family)
                       for family in FAMILIES}
#: family -> the Hugging Face config.json ``model_type`` of its checkpoints
HF_MODEL_TYPES = {QWEN2_5_VL: "qwen2_5_vl", QWEN3_VL: "qwen3_vl", QWEN3_VL_MOE: "qwen3_vl_moe",
                  QWEN3_5: "qwen3_5", QWEN3_5_MOE: "qwen3_5_moe",
                  NEMOTRON_OMNI: "nemotron_h_omni", COSMOS3_OMNI: "cosmos3_omni"}
#: family -> the family of the make targets that train / export / evaluate it (``make
#: train-qwen-vl-<dataset> HF=<a Qwen3.5 model>`` trains Qwen3.5: the Makefile's ``FAMILIES``)
MAKE_FAMILIES = {QWEN2_5_VL: "qwen-vl", QWEN3_VL: "qwen-vl", QWEN3_VL_MOE: "qwen-vl",
                 QWEN3_5: "qwen-vl", QWEN3_5_MOE: "qwen-vl", NEMOTRON_OMNI: "nemotron-omni",
                 COSMOS3_OMNI: "qwen-vl"}
#: other spellings a user may type -> the canonical name
ALIASES = {"qwen2.5-vl": QWEN2_5_VL, "qwen3-vl": QWEN3_VL, "qwen3-vl-moe": QWEN3_VL_MOE,
           "qwen3.5": QWEN3_5, "qwen3.5-moe": QWEN3_5_MOE,
           "nemotron-omni": NEMOTRON_OMNI,
           "nemotron-omni-tiled": NEMOTRON_OMNI_TILED, "cosmos3-omni": COSMOS3_OMNI}


def _canonical(name: str, valid, what: str) -> str:
    key = name.lower() if isinstance(name, str) else name
    key = ALIASES.get(key, key)
    if key not in valid:
        aliases = ", ".join(alias for alias, target in ALIASES.items() if target in valid)
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(valid)} (also spelled "
                         f"{aliases})")
    return key


def profile_name(name: str) -> str:
    """The canonical profile of a name a user typed (an alias, any case).

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    return _canonical(name, tuple(PROFILES), "model")


def family_name(name: str) -> str:
    """The canonical family of a name a user typed (an alias, any case).

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    return _canonical(name, FAMILIES, "model family")


def family_of_hf_model_type(model_type: str) -> str:
    """The family of a Hugging Face ``model_type``.

    Raises:
        ValueError: a model_type no family imports (named).
    """
    for family, hf_type in HF_MODEL_TYPES.items():
        if hf_type == model_type:
            return family
    supported = ", ".join(f"{family} (model_type {hf_type})"
                          for family, hf_type in HF_MODEL_TYPES.items())
    raise ValueError(f"model_type {model_type!r} is no supported family; supported: {supported}")
