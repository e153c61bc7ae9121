"""Tensor / pipeline / expert parallel slicing of a model's weights, for loading weights that
come whole (an HF import: ``load_hf_weights``, used by ``models.convert`` and by
``models.checkpointing.checkpoint`` for a checkpoint's recorded HF base).

This module owns ``weight_shapes`` (each parameter's full, TP=1 shape from this rank's shards),
``global_keys`` (a pipeline stage's layers and an expert-parallel rank's experts named by their
PP=1 / EP=1 index, the names ``sharded_state_dict`` stores them under too) and ``shard_for_rank``
(a full TP=1 state dict sliced to this rank's tensor-parallel shards: by each parameter's
megatron attributes ``partition_dim`` and, for a tensor packing several components,
``partition_sizes``). An MoE expert's weights (``.experts.`` in the name, its LoRA adapters too)
are sliced over the expert-TP group (``parallel.etp``), every other over TP. ``check_hf_fit``
compares the shapes a config declares with the HF weights' headers before the model is built.
"""

from __future__ import annotations

from pathlib import Path

import torch


def tensor_parallel_of(name: str) -> tuple[int, int]:
    """(size, rank) of the group the parameter ``name`` is tensor-parallel over: expert-TP for
    an MoE expert's (``.experts.`` in the name), TP for every other."""
    from megatron.core import parallel_state as ps

    if ".experts." in name:
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def weight_shapes(model) -> dict[str, torch.Size]:
    """Our key -> full (TP=1) shape, computed from this rank's shards."""
    shapes = {}
    for name, p in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or not isinstance(p, torch.Tensor):
            continue
        shape = list(p.shape)
        if getattr(p, "tensor_model_parallel", False):
            shape[p.partition_dim] *= tensor_parallel_of(name)[0]
        shapes[name] = torch.Size(shape)
    return shapes


def global_keys(model) -> dict[str, str]:
    """Our local key -> the key at PP=1 and EP=1 of every parameter of ``model``.

    Under pipeline parallelism a stage numbers its decoder layers from 0; megatron's
    ``layer_number`` (1-based, offset by the stage's first layer) gives the global index. Under
    expert parallelism a rank numbers its experts from 0; the expert-parallel rank times the
    local expert count gives the first global one. ``sharded_state_dict`` uses the same global
    indices, so dist checkpoints load at any PP / EP. Identity at PP=1, EP=1.
    """
    import re

    layer_pattern = re.compile(r"^(.*\.decoder\.layers\.)(\d+)\.")
    expert_pattern = re.compile(r"^(.*\.local_experts\.)(\d+)\.")
    out = {}
    for name in model.state_dict(keep_vars=True):
        key = name
        match = expert_pattern.match(name)
        if match is not None:
            experts = model.get_submodule(match.group(1)[:-len(".local_experts.")])
            first = experts.ep_group.rank() * experts.num_local_experts
            key = f"{match.group(1)}{first + int(match.group(2))}.{name[match.end():]}"
        match = layer_pattern.match(name)
        if match is not None:
            layer = model.get_submodule(match.group(1) + match.group(2))
            key = f"{match.group(1)}{layer.layer_number - 1}.{key[match.end():]}"
        out[name] = key
    return out


def shard_for_rank(full: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Slice a full (TP=1) state dict to this rank's tensor-parallel shards of ``model`` (an
    expert's over expert-TP: ``tensor_parallel_of``)."""
    local = {}
    for name, p in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        tensor = full[name]
        tp, rank = tensor_parallel_of(name)
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            dim = p.partition_dim
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            glu = name.split(".")[-2] == "linear_fc1" and owner.config.gated_linear_unit
            sizes = getattr(p, "partition_sizes", None)  # this rank's share of each component
            if glu:
                tensor = torch.cat([h.chunk(tp, dim)[rank] for h in tensor.chunk(2, 0)], dim=0)
            elif sizes:  # packed components (Mamba in_proj z|x|B|C|dt, conv1d x|B|C): each sliced
                parts = tensor.split([size * tp for size in sizes], dim)
                tensor = torch.cat([part.chunk(tp, dim)[rank] for part in parts], dim)
            else:
                tensor = tensor.chunk(tp, dim)[rank]
        local[name] = tensor.to(p.dtype)
    return local


def unused_hf_weights(cfg, keys) -> dict[str, list[str]]:
    """Part of the checkpoint -> its keys among ``keys`` that ``cfg``'s family never builds (the
    mapping module's ``unused_keys``: Cosmos3-Omni's generator, sound and action towers)."""
    from models.families import mapping_module

    found = getattr(mapping_module(cfg), "unused_keys", None)
    return found(keys, cfg) if found else {}


def without_unused(cfg, hf_sd: dict, folder, drop: bool) -> dict:
    """``hf_sd`` without the weights of parts the model does not have (``unused_hf_weights``)
    when ``drop``; else, if there are any, one line naming them and how to drop them.

    Raises:
        contract.errors.UsageError: unused weights and not ``drop``.
    """
    from contract.errors import UsageError

    unused = unused_hf_weights(cfg, hf_sd)
    if unused and not drop:
        what = ", ".join(f"{len(keys)} of the {part} ({keys[0]!r}...)"
                         for part, keys in unused.items())
        raise UsageError(f"the HF weights of {folder} hold weights the {cfg.family} model does "
                         f"not use: {what}; to drop them, import with python -m models.convert "
                         "hf-to-mcore --drop-unused and train from that import "
                         "(train.init_checkpoint=<import>)")
    dropped = {key for keys in unused.values() for key in keys}
    return {k: v for k, v in hf_sd.items() if k not in dropped}


def _mapped(model, cfg, hf_sd: dict[str, torch.Tensor], folder, drop_unused: bool = False
            ) -> dict[str, torch.Tensor]:
    """The HF state dict mapped onto this rank's part of ``model`` (full TP = 1 tensors under
    its local keys); ``drop_unused``: weights of parts the model does not have are left out
    (``without_unused``: else refused).

    Raises:
        contract.errors.UsageError: a key or shape that does not map (the first offender).
    """
    from megatron.core import parallel_state as ps

    from contract.errors import UsageError
    from models.families import mapping_module

    hf_sd = without_unused(cfg, hf_sd, folder, drop_unused)
    to_global = global_keys(model)
    shapes = {to_global[k]: shape for k, shape in weight_shapes(model).items()}
    whole = (ps.get_pipeline_model_parallel_world_size() == 1
             and ps.get_expert_model_parallel_world_size() == 1)
    try:
        if whole:  # the whole model is here (a first PP stage's names equal its PP=1 names too)
            return mapping_module(cfg).hf_to_ours(hf_sd, cfg, shapes)
        # this stage's layers / this rank's experts, mapped under their global numbers
        part = mapping_module(cfg).hf_to_ours_stage(hf_sd, cfg, shapes)
        return {local: part[glob] for local, glob in to_global.items() if glob in part}
    except ValueError as error:
        raise UsageError(f"the HF weights of {folder}: {error}") from None


def check_hf_fit(cfg, folder, drop_unused: bool = False) -> None:
    """Before the model of ``cfg`` is built: its shapes against the HF weights of ``folder``,
    read from the safetensors headers only (a meta-device model, the headers' shapes mapped as
    ``load_hf_weights`` maps the weights), so that a config.json declaring more than its weights
    hold (a ``vocab_size`` of 2**40) is refused before anything is allocated.

    Raises:
        contract.errors.UsageError: an unreadable folder, or a key or shape that does not map.
    """
    from contract.errors import UsageError
    from models.families import meta_model
    from models.hf.weights import weight_map

    try:
        headers = weight_map(folder)
    except ValueError as error:
        raise UsageError(str(error)) from None
    hf_sd = {key: torch.empty(shape, device="meta") for key, (_file, shape) in headers.items()}
    hf_sd = without_unused(cfg, hf_sd, folder, drop_unused)  # its own line, before the shapes
    try:
        _mapped(meta_model(cfg), cfg, hf_sd, folder, drop_unused)
    except UsageError as error:
        raise UsageError(f"{error} (the shapes {Path(folder) / 'config.json'} declares; "
                         "nothing was allocated)") from None


def load_hf_weights(model, cfg, folder, drop_unused: bool = False) -> dict:
    """Map the HF weights of ``folder`` onto this rank's part of ``model`` (local spec): its
    pipeline stage's layers, its experts (EP), its TP slices. Returns the HF config.

    Raises:
        contract.errors.UsageError: an unreadable folder, or a key or shape that does not map
            (the first offender named).
    """
    from contract.errors import UsageError
    from models.hf.weights import read_hf_folder

    try:
        hf_config, hf_sd = read_hf_folder(folder)  # its messages name the folder
    except ValueError as error:
        raise UsageError(str(error)) from None
    model.load_state_dict(shard_for_rank(_mapped(model, cfg, hf_sd, folder, drop_unused), model),
                          strict=False)
    return hf_config
