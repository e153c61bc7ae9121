"""The model side's one registry of families: config module, model class, HF mapping.

Families (named in ``contract.families``, the names the data side's ``energon_tasks.profiles``
uses too): "qwen2_5_vl" and "qwen3_vl" (``models.qwen_vl``) and "nemotron_omni"
(``models.nemotron_omni``). Everything that depends on the family asks here:

* ``config_module(family)``: the config module (``from_dict``, ``from_hf_config``,
  ``to_hf_dict``, ``load_yaml``); ``config_from_dict(raw)`` picks it by ``raw["family"]``;
  ``config_from_hf(hf_config)`` by the HF ``model_type``.
* ``model_class(cfg)``: ``QwenVL`` or ``NemotronOmni`` (same constructor and forward).
* ``mapping_module(cfg)``: the HF weight table module (``hf_to_ours``, ``ours_to_hf``).
* ``hf_model_class(model_type)``: the transformers class that ``verify`` compares against.

Which task encoder models feed which family is ``contract.families.TASK_ENCODER_MODELS``; the HF
``model_type`` of each family is ``contract.families.HF_MODEL_TYPES``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from contract import families as F

#: family -> (config module, model module:class, HF mapping module), imported on first use
FAMILIES = {
    F.QWEN2_5_VL: ("models.qwen_vl_config", "models.qwen_vl:QwenVL", "models.hf_mapping"),
    F.QWEN3_VL: ("models.qwen_vl_config", "models.qwen_vl:QwenVL", "models.hf_mapping"),
    F.NEMOTRON_OMNI: ("models.nemotron_omni_config", "models.nemotron_omni:NemotronOmni",
                      "models.nemotron_hf_mapping"),
}


def _family(family: str) -> tuple[str, str, str]:
    if family not in FAMILIES:
        raise ValueError(f"model family must be one of {sorted(FAMILIES)}, got {family!r}")
    return FAMILIES[family]


def config_module(family: str) -> ModuleType:
    return importlib.import_module(_family(family)[0])


def config_from_dict(raw: dict):
    """The model config of a YAML/JSON dict, by its ``family`` key (default qwen2_5_vl's
    module, which then names the missing/invalid family). An ``hf`` key (the Hugging Face model
    a run started from, which a saved run config names next to the full model) is not part of
    the model's shape and is left aside."""
    raw = {key: value for key, value in raw.items() if key != "hf"}
    family = raw.get("family")
    module = config_module(family) if family in FAMILIES else config_module(F.QWEN2_5_VL)
    return module.from_dict(raw)


def config_from_hf(hf_config: Any):
    """Our config of an HF config (dict or object), by its ``model_type``.

    Raises:
        ValueError: a model_type no family imports (named).
    """
    model_type = (hf_config.get("model_type") if isinstance(hf_config, dict)
                  else getattr(hf_config, "model_type", None))
    return config_module(F.family_of_hf_model_type(model_type)).from_hf_config(hf_config)


def model_class(cfg) -> type:
    module, name = _family(cfg.family)[1].split(":")
    return getattr(importlib.import_module(module), name)


def mapping_module(cfg) -> ModuleType:
    return importlib.import_module(_family(cfg.family)[2])


def hf_model_class(model_type: str) -> type:
    """The transformers class of an HF ``model_type`` (for ``verify``)."""
    import transformers

    if model_type == F.HF_MODEL_TYPES[F.NEMOTRON_OMNI]:
        from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import (
            NemotronH_Omni_Reasoning_V3,
        )
        return NemotronH_Omni_Reasoning_V3
    if model_type == F.HF_MODEL_TYPES[F.QWEN3_VL]:
        return transformers.Qwen3VLForConditionalGeneration
    return transformers.Qwen2_5_VLForConditionalGeneration
