"""Process setup, model building and megatron-core distributed checkpoints of every model family
(Qwen-VL, Nemotron-Omni; the family dispatch itself is models/families.py).

This module owns ``init_parallel`` (gloo on CPU / nccl on GPU, parallel_state, seeded RNG
tracker; CPU accommodations: models.cpu), ``build_model``, TP slicing of a full (TP=1) state dict
for this rank (``shard_for_rank``: by each parameter's megatron attributes ``partition_dim`` and,
for a tensor packing several components, ``partition_sizes``; ``global_keys`` names a pipeline
stage's layers and an expert-parallel rank's experts by their PP=1 / EP=1 index), and save/load
of a self-describing checkpoint folder: megatron ``dist_checkpointing`` files +
``qwen_vl_model.json`` (our config, any family: the name is kept so that existing checkpoints load)
+ ``hf_config.json`` (the source HF config when imported). dist_checkpointing stores global
tensors, so a checkpoint saved at one TP / PP / EP loads at any other (megatron reshards on load;
decoder layers and experts are stored by their global index).

Model checkpoints come in two kinds, both read by ``find_model_checkpoint`` / ``load_checkpoint``:
an import folder (``models.convert hf-to-mcore``, the cached ``model.hf`` imports) and a train.py
run / step folder (weights in ``model_optim/``, the model config in ``config.yaml``). Either may
hold ``hf/`` (``model_record``): what an export needs besides weights, i.e. the source HF
``config.json`` and processor files when the model came from a Hugging Face model, and the
tokenizer files (with its chat template).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from models import cpu
from models.families import config_from_dict, model_class

MODEL_JSON, HF_JSON = "qwen_vl_model.json", "hf_config.json"
#: folder of a checkpoint with the files an export ships besides weights (``model_record``)
HF_FILES = "hf"


def init_process_group() -> None:
    """torch.distributed for this process: from torchrun's environment, or, under plain python,
    a one-process group on an in-memory store (no TCP port to collide with other runs). First,
    on a machine without CUDA, the CPU accommodations (``models.cpu.activate``)."""
    import torch.distributed as dist

    cpu.activate()
    if dist.is_initialized():
        return
    backend = cpu.distributed_backend()
    if "RANK" in os.environ and "MASTER_PORT" in os.environ:  # torchrun / SLURM launchers
        dist.init_process_group(backend)
    else:
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 1234) -> None:
    """Initialise torch.distributed (single process when not under torchrun) and megatron."""
    init_process_group()
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size() == tp
                and ps.get_pipeline_model_parallel_world_size() == pp):
            seed_model_parallel(seed)
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    seed_model_parallel(seed)


def build_model(cfg, use_te: bool | None = None, vision_dp_over_cp: bool | None = None):
    """The model of ``cfg``'s family (``QwenVL`` / ``NemotronOmni``), on the GPU when present."""
    model = model_class(cfg)(cfg, use_te=use_te, vision_dp_over_cp=vision_dp_over_cp)
    return model.to(cpu.compute_device())


def seed_model_parallel(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker (after parallel_state is set up)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def weight_shapes(model) -> dict[str, torch.Size]:
    """Our key -> full (TP=1) shape, computed from this rank's shards."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    shapes = {}
    for name, p in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or not isinstance(p, torch.Tensor):
            continue
        shape = list(p.shape)
        if getattr(p, "tensor_model_parallel", False):
            shape[p.partition_dim] *= tp
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
    """Slice a full (TP=1) state dict to this rank's tensor-parallel shards of ``model``."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    local = {}
    for name, p in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        tensor = full[name]
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


def save_checkpoint(model, cfg, out: Path, hf_config: dict | None = None,
                    files: dict[str, bytes] | None = None):
    """dist_checkpointing.save + self-description (call on every rank); ``files``: relative path
    -> bytes written too (``model_record``)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    out = Path(out)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out))  # into an empty folder
    if dist.get_rank() == 0:
        (out / MODEL_JSON).write_text(json.dumps(cfg.to_dict(), indent=2))
        if hf_config is not None:
            (out / HF_JSON).write_text(json.dumps(hf_config, indent=2))
        write_files(out, files or {})
    dist.barrier()


def write_files(out: Path, files: dict[str, bytes]) -> None:
    """Write ``model_record``'s files (relative path -> bytes) under ``out``."""
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)


def read_model_config(path: Path):
    """The model config stored in an import folder (its family picks the config class)."""
    path = Path(path)
    if not (path / MODEL_JSON).is_file():
        raise ValueError(f"{path} is not a megatron model checkpoint (no {MODEL_JSON})")
    return config_from_dict(json.loads((path / MODEL_JSON).read_text()))


def find_model_checkpoint(path: str | Path):
    """(model config, weights folder, ``hf/`` folder or None) of an import folder or a train.py
    run / checkpoints / step folder (``models.checkpoint_folders.resolve_checkpoint``). Reads
    only the self-description.

    Raises:
        ValueError: neither kind, or an unreadable description (one line).
    """
    import yaml

    from models.checkpoint_folders import resolve_checkpoint

    path = Path(path)
    if (path / MODEL_JSON).is_file():
        return read_model_config(path), path, _hf_files(path)
    step = resolve_checkpoint(path)
    if not ((step / "model_optim" / "metadata.json").is_file()
            and (step / "config.yaml").is_file()):
        raise ValueError(f"{path} is not a model checkpoint: neither an import folder "
                         f"({MODEL_JSON}) nor a train.py run or step folder (model_optim/, "
                         "config.yaml)")
    try:
        raw = yaml.safe_load((step / "config.yaml").read_text()) or {}
        cfg = config_from_dict(raw.get("model") or {})
    except (OSError, yaml.YAMLError, TypeError) as error:
        raise ValueError(f"{step / 'config.yaml'} is unreadable ({error})") from None
    return cfg, step / "model_optim", _hf_files(step)


def _hf_files(folder: Path) -> Path | None:
    return folder / HF_FILES if (folder / HF_FILES).is_dir() else None


def model_record(hf_folder: Path | None, tokenizer=None) -> dict[str, bytes]:
    """What a checkpoint records for export besides weights and the model config: relative
    path -> bytes under ``hf/``. From an HF model folder: its config.json and processor files;
    the tokenizer files (with the chat template) as the folder has them when ``tokenizer`` is
    the folder's (or None), else the tokenizer's own save. Small files only (no weights)."""
    import tempfile

    from models.hf_source import PROCESSOR_FILES, TOKENIZER_FILES

    def read(folder: Path, names) -> dict[str, bytes]:
        return {f"{HF_FILES}/{name}": (folder / name).read_bytes() for name in names
                if (folder / name).is_file()}

    files = read(Path(hf_folder), ("config.json", *PROCESSOR_FILES)) if hf_folder else {}
    own = tokenizer is None or (hf_folder is not None and Path(tokenizer.name_or_path).resolve()
                                == Path(hf_folder).resolve())
    if own:
        return {**files, **read(Path(hf_folder), TOKENIZER_FILES)}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {**files, **read(Path(tmp), TOKENIZER_FILES)}


def load_checkpoint(path: Path, use_te: bool | None = None):
    """Build the model described by the checkpoint (an import folder or a train.py run / step
    folder, ``find_model_checkpoint``) at the current TP/PP and load its weights (its
    ``.metadata``, torch's pickle, is checked first by
    ``models.checkpoint_folders.check_dist_metadata``: a planted pickle is refused before
    megatron reads it)."""
    from megatron.core import dist_checkpointing

    from models.checkpoint_folders import check_dist_metadata

    cfg, weights, _files = find_model_checkpoint(path)
    check_dist_metadata(weights)
    model = build_model(cfg, use_te=use_te)
    state = dist_checkpointing.load(model.sharded_state_dict(), str(weights))
    model.load_state_dict(state, strict=False)
    missing = [k for k in model.state_dict() if not k.endswith("_extra_state") and k not in state]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {missing[0]!r}")
    return model.eval(), cfg
