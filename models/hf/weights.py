"""The machinery of every family's Hugging Face weight mapping: fused layouts, whole state-dict
conversions over a family's table, HF checkpoint folders.

A family's mapping module (``models/families/<package>/hf_mapping.py``) owns its literal table:
HF key -> (our key, part of a fused tensor or None), expanded for the model's layer counts. This
module runs it: ``hf_to_ours`` (every key and shape checked; the first offender named in a
one-line ``ValueError``), ``hf_to_ours_stage`` (one pipeline stage), ``ours_to_hf``; and reads /
writes HF folders (safetensors, single or sharded: ``weight_map`` says which file holds each
weight, through ``model.safetensors.index.json`` when the folder has one).

Fused tensors (part column): q/k/v -> ``linear_qkv`` in megatron's grouped layout (per KV group:
its queries, then k, then v; with a gated attention's ``qg``, HF's per-head [query; gate] rows:
per group its queries, their gates, k, v, megatron's ``attention_output_gate`` layout); the
ViT's fused ``qkv`` (3, heads, d) -> (heads, 3, d); gate/up -> ``linear_fc1`` = [gate; up]; the
Conv3d patch kernel (out, C, T, P, P) -> Linear (out, C*T*P*P).

Fused experts of the Qwen MoE checkpoints (``split_fused_experts`` / ``fuse_experts``): the 3-D
``gate_up_proj`` / ``down_proj`` of each MoE layer in either layout, told apart by shape: the
published checkpoints' x@W layout, gate_up (E, H, 2I) and down (E, I, H), or transformers'
``save_pretrained`` layout (E, 2I, H) / (E, H, I); written in the published one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

#: an expanded mapping table: HF key -> (our key, part of a fused tensor or None)
Table = dict[str, tuple[str, "str | None"]]
#: a key translation (HF key of one layout -> another)
KeyMap = Callable[[str], str]


def _same(key: str) -> str:
    return key


# ------------------------------------------------------------------ fused layouts
def _fuse(cfg, part_kind: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    if part_kind in ("q", "qg", "k", "v"):
        t = cfg.lm
        groups, per = t.num_kv_heads, t.num_heads // t.num_kv_heads
        k, v = parts["k"], parts["v"]
        tail = k.shape[1:]
        if "qg" in parts:  # gated attention: per head [query; gate] -> per group [queries; gates]
            x = parts["qg"].reshape(groups, per, 2, t.head_dim, *tail)
            q = torch.cat([x[:, :, 0], x[:, :, 1]], dim=1).reshape(groups, -1, *tail)
        else:
            q = parts["q"].reshape(groups, per * t.head_dim, *tail)
        k, v = k.reshape(groups, t.head_dim, *tail), v.reshape(groups, t.head_dim, *tail)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tail)
    if part_kind in ("gate", "up"):
        return torch.cat([parts["gate"], parts["up"]], dim=0)
    x = parts[part_kind]
    if part_kind == "vit_qkv":
        heads = cfg.vision.num_heads
        return x.reshape(3, heads, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)
    if part_kind == "patch":
        return x.reshape(x.shape[0], -1)
    return x


def _split(cfg, part: str, x: torch.Tensor, hf_shape) -> torch.Tensor:
    if part in ("q", "qg", "k", "v"):
        t = cfg.lm
        per = t.num_heads // t.num_kv_heads
        queries = 2 * per if getattr(t, "attention_output_gate", False) else per
        tail = x.shape[1:]
        g = x.reshape(t.num_kv_heads, (queries + 2) * t.head_dim, *tail)
        q, k, v = g.split([queries * t.head_dim, t.head_dim, t.head_dim], dim=1)
        if part == "qg":  # per group [queries; gates] -> per head [query; gate]
            q = q.reshape(t.num_kv_heads, 2, per, t.head_dim, *tail).transpose(1, 2)
        return {"q": q, "qg": q, "k": k, "v": v}[part].reshape(-1, *tail)
    if part in ("gate", "up"):
        return x.chunk(2, dim=0)[0 if part == "gate" else 1]
    if part == "vit_qkv":
        heads = cfg.vision.num_heads
        return x.reshape(heads, 3, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)
    if part == "patch":
        return x.reshape(hf_shape)
    return x


def hf_to_ours(hf_sd: dict[str, torch.Tensor], cfg, expected: dict[str, torch.Size],
               table: Table, canonical: KeyMap = _same) -> dict[str, torch.Tensor]:
    """Map an HF state dict to our (TP=1) keys with a family's expanded ``table``;
    ``expected`` = our key -> shape; ``canonical`` turns an HF key of another layout (e.g. the
    hub's legacy prefixes) into the table's.

    Raises:
        ValueError: an HF key not in the table, a table key missing, or a shape mismatch
            (the first offender is named).
    """
    hf_sd = {canonical(k): v for k, v in hf_sd.items()}
    if cfg.lm.tie_embeddings:
        hf_sd.pop("lm_head.weight", None)
    for key in hf_sd:
        if key not in table:
            raise ValueError(f"HF key {key!r} has no entry in the {cfg.family} mapping table")
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    kinds: dict[str, str | None] = {}
    for hf_key, (ours, part) in table.items():
        if hf_key not in hf_sd:
            raise ValueError(f"HF checkpoint lacks {hf_key!r} (needed for {ours!r})")
        grouped.setdefault(ours, {})[part or "x"] = hf_sd[hf_key]
        kinds[ours] = part or "x"
    out = {}
    for ours, parts in grouped.items():
        if ours not in expected:
            raise ValueError(f"our model has no parameter {ours!r}")
        tensor = _fuse(cfg, kinds[ours], parts)
        if tuple(tensor.shape) != tuple(expected[ours]):
            raise ValueError(f"{ours!r}: HF weights give shape {tuple(tensor.shape)}, model "
                             f"expects {tuple(expected[ours])}")
        out[ours] = tensor.contiguous()
    missing = [k for k in expected if k not in out]
    if missing:
        raise ValueError(f"no HF weight maps to our parameter {missing[0]!r}")
    return out


def hf_to_ours_stage(hf_sd: dict[str, torch.Tensor], cfg, expected: dict[str, torch.Size],
                     table: Table, embed_key: str = "model.language_model.embed_tokens.weight",
                     lm_head_key: str = "lm_head.weight", canonical: KeyMap = _same
                     ) -> dict[str, torch.Tensor]:
    """``hf_to_ours`` for one pipeline stage: ``expected`` = this stage's parameters under their
    PP=1 keys (``models.checkpointing.sharding.global_keys``) -> shape; HF weights of other stages
    are skipped (each is still checked against the full table).

    With tied embeddings a last stage without the embedding holds its own copy of the output
    weight (megatron keeps it equal to the first stage's): it is filled from ``embed_key``.
    ``table`` / ``embed_key`` / ``lm_head_key``: the family's full table and the HF names of the
    token embedding and the output layer (default: the Qwen-VL ones).

    Raises:
        ValueError: as ``hf_to_ours``.
    """
    full = table
    for key in hf_sd:
        name = canonical(key)
        if name not in full and not (name == lm_head_key and cfg.lm.tie_embeddings):
            raise ValueError(f"HF key {key!r} has no entry in the {cfg.family} mapping table")
    table = dict(full)
    output, embedding = "language_model.output_layer.weight", \
        "language_model.embedding.word_embeddings.weight"
    if cfg.lm.tie_embeddings and output in expected and embedding not in expected:
        table[embed_key] = (output, None)
    table = {hf: row for hf, row in table.items() if row[0] in expected}
    stage_sd = {k: v for k, v in hf_sd.items() if canonical(k) in table}
    return hf_to_ours(stage_sd, cfg, expected, table, canonical)


def ours_to_hf(sd: dict[str, torch.Tensor], cfg, table: Table,
               hf_shapes: dict[str, tuple] | None = None,
               hub_key: KeyMap | None = None,
               only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Map our (TP=1) state dict to HF keys with a family's expanded ``table``; ``hub_key``
    turns a table key into the layout to write (default: as in the table); ``hf_shapes``: the HF
    shape of a reshaped tensor (default: the patch kernel's); ``only``: map just these keys of
    ours (e.g. a LoRA B factor in place of its weight: fused rows split the same way)."""
    if only is not None:
        table = {hf: row for hf, row in table.items() if row[0] in only}
    v = cfg.vision
    patch_shape = (v.hidden_size, v.in_channels, getattr(v, "temporal_patch_size", 1),
                   v.patch_size, v.patch_size)
    out = {}
    for hf_key, (ours, part) in table.items():
        if ours not in sd:
            raise ValueError(f"checkpoint lacks {ours!r} (needed for {hf_key!r})")
        shape = (hf_shapes or {}).get(hf_key, patch_shape)
        tensor = _split(cfg, part, sd[ours], shape) if part else sd[ours]
        out[hub_key(hf_key) if hub_key else hf_key] = tensor.contiguous()
    return out


# ------------------------------------------------------------------ fused experts
#: the HF prefix of an LM layer of the Qwen VLMs (Qwen3-VL MoE, Qwen3.5 MoE)
LM_LAYER = "model.language_model.layers.{i}."
#: the fused expert tensors of a Qwen MoE checkpoint (no ``.weight`` suffix)
FUSED = re.compile(r"^((?:model\.language_model|mtp)\.layers\.\d+\.mlp\.experts\.)"
                   r"(gate_up_proj|down_proj)$")


def split_fused_experts(hf_sd: dict[str, torch.Tensor], cfg
                        ) -> dict[str, torch.Tensor]:
    """``hf_sd`` with each MoE layer's fused ``gate_up_proj`` / ``down_proj`` replaced by the
    per-expert keys of the table (layout decided by shape: module docstring).

    Raises:
        ValueError: a fused tensor of a shape neither layout has (key, shape, both layouts
            named), or a layer with only one of the two.
    """
    fused: dict[str, dict[str, torch.Tensor]] = {}
    out = {}
    for key, value in hf_sd.items():
        match = FUSED.match(key)
        if match:
            fused.setdefault(match.group(1), {})[match.group(2)] = value
        else:
            out[key] = value
    t = cfg.lm
    e, h, i = t.num_experts, t.hidden_size, t.moe_intermediate_size
    layouts = {"published": {"gate_up_proj": (e, h, 2 * i), "down_proj": (e, i, h)},
               "transformers": {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}}
    for prefix, pair in fused.items():
        if set(pair) != {"gate_up_proj", "down_proj"}:
            missing = ({"gate_up_proj", "down_proj"} - set(pair)).pop()
            raise ValueError(f"HF checkpoint lacks {prefix + missing!r} (it has "
                             f"{prefix + next(iter(pair))!r})")
        fits = [name for name, shapes in layouts.items()
                if all(tuple(pair[k].shape) == shapes[k] for k in shapes)]
        if not fits:
            shapes = {k: tuple(v.shape) for k, v in pair.items()}
            raise ValueError(f"{prefix}gate_up_proj / down_proj have shapes "
                             f"{shapes['gate_up_proj']} / {shapes['down_proj']}: expected the "
                             f"published layout {layouts['published']['gate_up_proj']} / "
                             f"{layouts['published']['down_proj']} or transformers' "
                             f"{layouts['transformers']['gate_up_proj']} / "
                             f"{layouts['transformers']['down_proj']} (E, H, I = {e}, {h}, {i})")
        gate_up, down = pair["gate_up_proj"], pair["down_proj"]
        if fits[0] == "published":  # x @ W: to the (out, in) of a linear
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        for n in range(e):
            gate, up = gate_up[n].chunk(2, dim=0)
            out[f"{prefix}{n}.gate_proj.weight"] = gate
            out[f"{prefix}{n}.up_proj.weight"] = up
            out[f"{prefix}{n}.down_proj.weight"] = down[n]
    return out


def fuse_experts(hf_sd: dict[str, torch.Tensor], cfg, transformers_layout: bool = False
                 ) -> dict[str, torch.Tensor]:
    """The per-expert keys of each MoE layer as the published fused tensors: gate_up
    (E, H, 2I) = [gate; up]^T per expert, down (E, I, H); ``transformers_layout``: as
    transformers holds them, (E, 2I, H) and (E, H, I) (what a checkpoint of a family whose
    transformers loader does not transpose, Qwen3.5 MoE, has when packed)."""
    if not any(cfg.lm.moe_layers):
        return hf_sd
    out = {k: v for k, v in hf_sd.items()
           if not (k.startswith("model.language_model.") and ".mlp.experts." in k)}
    for i, moe in enumerate(cfg.lm.moe_layers):
        if moe:
            out.update(_packed(hf_sd, LM_LAYER.format(i=i) + "mlp.experts.",
                               cfg.lm.num_experts, transformers_layout))
    return out


def fuse_experts_like(hf_sd: dict[str, torch.Tensor], source: dict[str, torch.Tensor], cfg
                      ) -> dict[str, torch.Tensor]:
    """``hf_sd`` with the experts of each layer that ``source`` (the tensors an import recorded,
    e.g. Qwen3.6's MTP layer) holds packed, packed again in that tensor's layout (by shape, as
    ``models.checkpointing.checkpoint.carried_record`` tells the LM's apart)."""
    out = dict(hf_sd)
    for key, tensor in source.items():
        match = FUSED.match(key)
        if not match or match.group(2) != "gate_up_proj" or \
                f"{match.group(1)}0.gate_proj.weight" not in out:
            continue
        prefix, experts = match.group(1), tensor.shape[0]
        packed = _packed(out, prefix, experts, tensor.shape[-1] == cfg.lm.hidden_size)
        for n in range(experts):
            for name in ("gate_proj", "up_proj", "down_proj"):
                out.pop(f"{prefix}{n}.{name}.weight")
        out.update(packed)
    return out


def _packed(hf_sd: dict[str, torch.Tensor], prefix: str, experts: int,
            transformers_layout: bool) -> dict[str, torch.Tensor]:
    """One layer's per-expert tensors under ``prefix`` as its packed gate_up / down."""
    def oriented(x: torch.Tensor) -> torch.Tensor:
        return x if transformers_layout else x.T

    return {prefix + "gate_up_proj": torch.stack([oriented(torch.cat(
        [hf_sd[f"{prefix}{n}.gate_proj.weight"], hf_sd[f"{prefix}{n}.up_proj.weight"]]))
        for n in range(experts)]).contiguous(),
        prefix + "down_proj": torch.stack(
            [oriented(hf_sd[f"{prefix}{n}.down_proj.weight"]) for n in range(experts)]
        ).contiguous()}


# ------------------------------------------------------------------ HF folders
#: the index of a sharded HF checkpoint: ``weight_map`` = tensor key -> the shard file holding it
INDEX = "model.safetensors.index.json"
#: weight files in pickle formats (never loaded: named when a folder has only those)
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def _header(file: Path) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a safetensors file, from its header only (safetensors checks that the
    header's offsets cover exactly the file's bytes, so no shape outgrows the file).

    Raises:
        ValueError: the file is no safetensors file (named).
    """
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape())
                    for key in handle.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{file}: unreadable safetensors file ({exc})") from None


def _index(folder: Path) -> dict[str, str]:
    """The ``weight_map`` of ``folder``'s ``INDEX`` (key -> shard file name).

    Raises:
        ValueError: an unreadable index, or one naming a file outside the folder (one line).
    """
    path = folder / INDEX
    try:
        listed = json.loads(path.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as error:
        raise ValueError(f"{path}: unreadable index ({type(error).__name__})") from None
    if not isinstance(listed, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v == Path(v).name
            and v.endswith(".safetensors") for k, v in listed.items()):
        raise ValueError(f"{path}: weight_map must map each tensor name to a *.safetensors "
                         "file of the folder")
    return listed


def weight_map(folder: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every weight of a local HF model folder -> (the safetensors file holding it, its shape),
    from the files' headers only. With ``model.safetensors.index.json`` (a sharded save) only
    the shards it lists are read, each key where the index places it (a shard of an older save
    left in the folder is not read); without one every ``*.safetensors`` file is, and no key
    may be in two of them.

    Raises:
        ValueError: no weight files; a listed shard missing; a shard holding a key the index
            does not list or places in another shard; a key the index places in a shard that
            lacks it; without an index, a key in two files (one line naming the files).
    """
    folder = Path(folder)
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    if (folder / INDEX).is_file():
        listed = _index(folder)
        for name in sorted(set(listed.values())):
            if not (folder / name).is_file():
                raise ValueError(f"{folder / INDEX} lists the shard {name}, which is missing "
                                 f"from {folder}: copy the whole model folder again")
            for key, shape in _header(folder / name).items():
                if listed.get(key) != name:
                    where = (f"places it in {listed[key]}" if key in listed
                             else "does not list it")
                    raise ValueError(f"{folder / name} holds {key!r}, but {INDEX} {where} (a "
                                     "shard of another save?): re-save or re-download the "
                                     "model folder")
                found[key] = (folder / name, shape)
        lacking = next((key for key in listed if key not in found), None)
        if lacking is not None:
            raise ValueError(f"{folder / INDEX} places {lacking!r} in {listed[lacking]}, which "
                             "lacks it: re-save or re-download the model folder")
        return found
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for pattern in PICKLED for p in folder.glob(pattern))
        raise ValueError(f"{folder}: no *.safetensors files" + (
            f" ({pickles[0]} is a pickle, which is never loaded here: save the model with "
            "safetensors, save_pretrained(..., safe_serialization=True))" if pickles else ""))
    for file in files:
        for key, shape in _header(file).items():
            if key in found:
                raise ValueError(f"{key!r} is in both {found[key][0].name} and {file.name} of "
                                 f"{folder}, which has no {INDEX} to say which is the model's: "
                                 "remove the stale file")
            found[key] = (file, shape)
    return found


def read_hf_folder(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, state dict) of a local HF model folder (safetensors; the files
    ``weight_map`` says hold the model's weights).

    Raises:
        ValueError: as ``weight_map``, or an unreadable file (named).
    """
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())
    files = weight_map(path)
    sd: dict[str, torch.Tensor] = {}
    for f in sorted({file for file, _shape in files.values()}):
        try:
            sd.update({k: v for k, v in load_file(str(f)).items() if files[k][0] == f})
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type
            raise ValueError(f"{f}: unreadable safetensors file ({exc})") from None
    return config, sd


def carried_hf_weights(path: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of an HF folder whose keys start with one of ``prefixes``: weights a family's
    model does not hold and its exports carry unchanged (Qwen3.5's multi-token-prediction layers,
    ``mtp.*``). Read key by key from the files ``weight_map`` names (the rest of the checkpoint
    is not loaded)."""
    from safetensors import safe_open

    if not prefixes:
        return {}
    wanted = {key: file for key, (file, _shape) in weight_map(Path(path)).items()
              if key.startswith(prefixes)}
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(wanted.values())):
        with safe_open(str(file), framework="pt") as handle:
            for key in sorted(k for k, f in wanted.items() if f == file):
                out[key] = handle.get_tensor(key)
    return out


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' ``save_file`` (metadata ``format: pt``), an I/O error of it raised as the
    ``OSError`` it is (safetensors reports one as its own error type, "... (os error 28)"), so
    that a full disk is told apart from a bug."""
    import errno
    import os

    from safetensors.torch import save_file

    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
                  metadata={"format": "pt"})
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error type
        found = re.search(r"\(os error (\d+)\)", str(error))
        if found is None:
            raise
        number = int(found.group(1))
        raise OSError(number, os.strerror(number) if number in errno.errorcode else str(error),
                      str(path)) from None


def write_hf_folder(path: Path, config: dict, sd: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_safetensors(sd, path / "model.safetensors")


def is_our_key(key: str) -> bool:
    """Parameters of our state dict that carry weights (not TE/megatron extra state)."""
    return not key.endswith("_extra_state") and not re.search(r"\.inv_freq$", key)
