"""The model side's one registry of families, and what a family package provides.

A family package (``models/families/<package>/``) holds everything one architecture needs: its
model config (``config.py``), model (``model.py``, + its tower), HF weight table
(``hf_mapping.py``), the generated inputs of ``verify`` (``verify_inputs.py``) and its FLOP
formulas (``flops.py``). Its ``__init__`` is the package's public face, the ``ModelFamily``
Protocol below; a package may serve several family names (``qwen_vl``: ``qwen2_5_vl``,
``qwen3_vl`` and ``qwen3_vl_moe``). Nothing outside a package compares anything with a family
name: what differs is asked of ``family_of(cfg)`` / ``get(name)``; ``build_model(cfg)`` is the
model of a config.

Families are named in ``contract.families`` (the names the data side's ``energon_tasks.profiles``
uses too, with the HF ``model_type`` of each and which profiles feed which family).
"Adding a family" in docs/internals/architecture.md lists the files a new package adds and the
registry lines it touches (``PACKAGES`` here, ``energon_tasks.profiles.PACKAGES``,
``contract.families``).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Protocol

from contract import families as F

#: family name -> its package (imported on first use: building a config needs no megatron)
PACKAGES = {
    F.QWEN2_5_VL: "models.families.qwen_vl",
    F.QWEN3_VL: "models.families.qwen_vl",
    F.QWEN3_VL_MOE: "models.families.qwen_vl",
    F.QWEN3_5: "models.families.qwen3_5",
    F.QWEN3_5_MOE: "models.families.qwen3_5",
    F.NEMOTRON_OMNI: "models.families.nemotron_omni",
    F.COSMOS3_OMNI: "models.families.qwen_vl",
}
FAMILIES = tuple(PACKAGES)
#: what a model's parameters are, for freezing (``ModelFamily.parameter_group``)
PARAMETER_GROUPS = ("vision_model", "vision_projection", "language_model")
#: keys of a run config's model section that are run settings, not the model's shape: the HF
#: model a run starts from, which parameter groups it freezes, its LoRA adapters
RUN_KEYS = ("hf", *(f"freeze_{group}" for group in PARAMETER_GROUPS), "peft", "lora")


class ModelFamily(Protocol):
    """The public face of a family package (its ``__init__`` module)."""

    #: the package's config module: ``from_dict``, ``from_hf_config``, ``to_hf_dict``,
    #: ``load_yaml`` (and the config dataclasses)
    config: ModuleType

    def model_class(self) -> type:
        """The model (``QwenVL``, ``NemotronOmni``): constructor ``(cfg, use_te=...,
        vision_dp_over_cp=...)``, forward over the batch contract's ``model_inputs``."""

    def mapping(self) -> ModuleType:
        """The HF weight table module: ``hf_to_ours``, ``hf_to_ours_stage``, ``ours_to_hf``."""

    def hf_model_class(self, model_type: str) -> type:
        """The transformers class that ``verify`` and the parity tests compare against."""

    def verify_inputs(self, cfg, seed: int = 0) -> dict[str, dict]:
        """Named single-row inputs in our batch contract (``models.hf.verify_inputs``)."""

    def hf_inputs(self, cfg, inputs: dict) -> dict:
        """Our inputs as transformers' forward of the family takes them."""

    def lm_flops(self, lm, tokens: float, lengths: list[int]) -> float:
        """Forward FLOPs of the language model (``models.flops`` conventions)."""

    def head_flops(self, cfg, tokens: float, lengths: list[int]) -> float:
        """Forward FLOPs of heads trained beside the LM (the MTP head under
        ``model.train_mtp``, ``models.layers.mtp``; 0 for none)."""

    def vision_flops(self, cfg, grids) -> float:
        """Forward FLOPs of the vision tower + projector on (t, h, w) grids."""

    def patch_embed_flops(self, cfg, grids) -> float:
        """Forward FLOPs of the patch embedding (its backward has no input gradient)."""

    def processor_settings(self, image: dict, video: dict) -> tuple[dict, dict]:
        """(task encoder values, geometry) that the model's processor configs set
        (``models.hf.source.task_encoder_settings``)."""

    def processor_files(self, cfg, task_encoder: dict) -> dict[str, dict]:
        """File name -> JSON of the transformers processor files an export writes when the run
        named no HF model (from the run config's ``task_encoder`` section and ``cfg``)."""

    def vision_geometry(self, cfg) -> dict[str, int]:
        """``patch_size`` / ``merge_size`` / ``temporal_patch_size`` of the model's tower (the
        task encoder's geometry must have the same)."""

    def layout_problems(self, cfg, parallel) -> list[str]:
        """What of the run's parallel layout this model cannot take (one line each)."""

    def num_experts(self, cfg) -> int:
        """Experts per MoE layer (0: no MoE layers; expert parallelism needs them)."""

    def parameter_group(self, name: str) -> str:
        """Which of ``PARAMETER_GROUPS`` the model's parameter ``name`` (a state-dict key)
        belongs to: the vision tower, the projection into the LM (mergers, projector), or the
        language model (embeddings and output layer included)."""


def get(family: str) -> ModelFamily:
    """The package of a family name.

    Raises:
        ValueError: an unknown family (the valid ones listed).
    """
    if family not in PACKAGES:
        raise ValueError(f"model family must be one of {sorted(PACKAGES)}, got {family!r}")
    return importlib.import_module(PACKAGES[family])


def family_of(cfg) -> ModelFamily:
    """The package of a model config (by its ``family``)."""
    return get(cfg.family)


def config_module(family: str) -> ModuleType:
    """The config module of a family (``from_dict``, ``from_hf_config``, ``to_hf_dict``,
    ``load_yaml``)."""
    return get(family).config


def config_from_dict(raw: dict):
    """The model config of a YAML/JSON dict, by its ``family`` key (default qwen2_5_vl's
    module, which then names the missing/invalid family). The run settings a saved run config
    names next to the full model (``RUN_KEYS``: ``hf``, the ``freeze_*`` switches, the LoRA
    settings) are not part
    of the model's shape and are left aside."""
    raw = {key: value for key, value in raw.items() if key not in RUN_KEYS}
    family = raw.get("family")
    return config_module(family if family in PACKAGES else F.QWEN2_5_VL).from_dict(raw)


def config_from_hf(hf_config: Any):
    """Our config of an HF config (dict or object), by its ``model_type``.

    Raises:
        ValueError: a model_type no family imports (named).
    """
    model_type = (hf_config.get("model_type") if isinstance(hf_config, dict)
                  else getattr(hf_config, "model_type", None))
    return config_module(F.family_of_hf_model_type(model_type)).from_hf_config(hf_config)


def model_class(cfg) -> type:
    """The model class of a config's family."""
    return family_of(cfg).model_class()


def build_model(cfg, use_te: bool | None = None, vision_dp_over_cp: bool | None = None):
    """The model of ``cfg``'s family (``QwenVL`` / ``NemotronOmni``) at this process's parallel
    layout (``models.parallel.init_parallel`` first), on the GPU when present. megatron's MoE
    aux-loss tracker (process-wide, sized by the layer count of the first model that logs into it)
    is dropped, so that a second model of another depth in the process never indexes past it."""
    from models import cpu
    from models.layers import moe_aux

    model = model_class(cfg)(cfg, use_te=use_te, vision_dp_over_cp=vision_dp_over_cp)
    moe_aux.forget()
    return model.to(cpu.compute_device())


def meta_model(cfg):
    """The model of ``cfg`` on the meta device, shapes only: built at this process's parallel
    layout (the local spec, no TransformerEngine) without initialising a weight (megatron's
    ``perform_initialization`` off while it is built: the normal draws and master-weight copies
    on meta tensors took 27 of the 29 s a Qwen3-VL-30B-A3B took), then every megatron parallel
    linear and embedding marked as megatron's initialisation marks it (``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride``: how TP splits it). What the memory estimate and the
    layout planner read (recipes/memory.py; tests/test_memory.py checks it equals an
    initialised build), and the checks of what a config declares before the real model is
    built (models/checkpointing/checkpoint.py)."""
    import torch
    from megatron.core.model_parallel_config import ModelParallelConfig

    from models.layers import moe_aux

    post_init = ModelParallelConfig.__post_init__

    def shapes_only(config) -> None:
        post_init(config)
        config.perform_initialization = False

    ModelParallelConfig.__post_init__ = shapes_only
    try:
        with torch.device("meta"):
            model = model_class(cfg)(cfg, use_te=False)
    finally:
        ModelParallelConfig.__post_init__ = post_init
    moe_aux.forget()
    _mark_tensor_parallel(model)
    return model


def _mark_tensor_parallel(model) -> None:
    """What megatron's weight initialisation sets on the weights of its TP layers (column
    parallel: the output rows, with the bias; row parallel and the vocabulary embedding: as
    megatron splits them), on weights it left unmarked."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for module in model.modules():
        if isinstance(module, layers.ColumnParallelLinear):
            marks = [(module.weight, 0)] + ([(module.bias, 0)] if module.bias is not None
                                            else [])
        elif isinstance(module, layers.RowParallelLinear):
            marks = [(module.weight, 1)]
        elif isinstance(module, layers.VocabParallelEmbedding):
            marks = [(module.weight, 0)]
        else:
            continue
        for tensor, dim in marks:
            if tensor is not None and not hasattr(tensor, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(tensor, is_parallel=True, dim=dim,
                                                     stride=getattr(module, "stride", 1))


def mapping_module(cfg) -> ModuleType:
    """The HF weight table module of a config's family."""
    return family_of(cfg).mapping()


def hf_model_class(model_type: str) -> type:
    """The transformers class of an HF ``model_type`` (for ``verify``)."""
    return get(F.family_of_hf_model_type(model_type)).hf_model_class(model_type)
