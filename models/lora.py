"""LoRA and DoRA adapters on megatron-core's tensor-parallel linears: what ``model.peft=lora``
(or ``dora``) adds to a model, how it trains at any TP, how it is merged back into the base
weights.

This module owns the adapter (``LoRAAdapter``), where adapters go (``add_adapters``: the
``model.lora`` settings, ``LoRAConfig``), their merge into the base weights (``merge_adapters``,
for eval, generation and the merged export) and their factors in our (TP = 1) names
(``adapter_factors``, for the HF PEFT export of ``models.convert``).

An adapter of the linear ``<parent>.<name>`` is the sibling module ``<parent>.<name>_lora``
(``lora_a``: in -> r, ``lora_b``: r -> out); a forward hook on the linear adds
``alpha / r * B(A(dropout(x)))`` to its output. Laid out so that TP > 1 computes what TP = 1 does
(Megatron-Bridge's layout, new-families.md):

- column-parallel base (out sharded): A replicated, B sharded like the base's rows; A's output
  enters the TP region (all-reduce of its gradient; under sequence parallelism, gathered over the
  sequence);
- row-parallel base (in sharded): A sharded like the base's columns, B replicated; A's partial
  outputs are summed over TP (reduce-scattered over the sequence under sequence parallelism).

A replicated factor whose gradient is computed on a sequence shard is marked
``sequence_parallel`` (megatron all-reduces those over TP). An MoE expert's adapter (``experts``)
is laid out the same over expert-TP (``parallel.etp``, which may differ from TP) but, like the
expert's linears, communicates nothing in its output (megatron's token dispatcher gathers the
tokens over expert-TP and sums the partial outputs); its replicated factor's gradient is a share
per expert-TP rank, summed over the expert-TP group in the backward of its use
(``_replicated_weight``). A starts from a seeded Kaiming uniform draw (the seed from the
adapter's global name, so every TP / PP layout starts equal), B at zero: step 1 computes the base
model's loss. Sharded checkpoint entries carry each factor's own TP axis, an expert's over the
expert-TP group with its replicas counted over the expert-DP group, and a gated MLP's
``linear_fc1`` rows split gate | up as megatron splits the weight's, so that any TP loads them
in TP = 1's order (``sharded_state_dict``).

DoRA (``model.peft=dora``, HF PEFT's ``use_dora``): the adapted linear computes
``m * (W + s B A) x / ||W + s B A||`` (s = alpha / r; the norm over each output row, detached from
the gradient as in the DoRA paper and peft) with the magnitude ``m`` a trained vector that starts
at the rows' norms of W, so that step 1 computes the base model's loss too. The hook turns the
base output ``W x`` into ``g W x + g s B A x`` with ``g = m / ||W + s B A||`` (a bias the base adds
stays as it is; dropout acts on the adapter's branch only). ``m`` is laid out like the base's
output rows: sharded with a column-parallel base, whole with a row-parallel one, whose row norms
sum their squares over TP (each rank holds a slice of every row). MoE experts take LoRA only.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
from torch import nn

#: the base linears that get adapters by default: attention and MLP linears (megatron names)
DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
#: parameter groups whose linears get adapters by default (the ViT only when asked)
DEFAULT_PARTS = ("language_model",)
SUFFIX = "_lora"  #: an adapter's module name: the base linear's name + SUFFIX
#: ``model.peft`` values that add adapters (``model.lora.*`` configures both)
METHODS = ("lora", "dora")


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """``model.lora.*`` (with ``model.peft=lora``): the adapters of a run."""

    rank: int = 16  #: r: the adapters' inner width
    alpha: float = 32.0  #: the update is scaled by alpha / r
    dropout: float = 0.0  #: dropout on the adapters' input (training only)
    #: names of the linears that get adapters (megatron's: linear_qkv, linear_proj, linear_fc1,
    #: linear_fc2; Nemotron's Mamba mixers: in_proj, out_proj; Qwen3.5's Gated DeltaNet:
    #: in_proj_q / _k / _v / _z / _b / _a, out_proj, not adapted by default: docs/training.md)
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    #: parameter groups whose linears get adapters (language_model, vision_model,
    #: vision_projection)
    parts: list[str] = field(default_factory=lambda: list(DEFAULT_PARTS))
    experts: bool = False  #: adapters on MoE experts' linears too (vLLM does not load those)
    #: DoRA: a trained magnitude per output row (set by ``model.peft=dora``, not a model.lora key)
    dora: bool = field(default=False, init=False)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def method(self) -> str:
        """The ``model.peft`` value of these settings."""
        return "dora" if self.dora else "lora"

    def stored(self) -> dict:
        """These settings as a run config's ``model`` keys (``peft`` and ``lora``)."""
        settings = asdict(self)
        del settings["dora"]
        return {"peft": self.method, "lora": settings}

    def problems(self, groups: tuple[str, ...],
                 widths: dict[str, int] | None = None) -> list[str]:
        """What is wrong with these settings (one line each). ``widths``: parameter group ->
        the narrowest width its adapted linears connect (the model's hidden sizes): the rank is
        at most the narrowest of the adapted parts' (a wider one adds nothing, and a huge one
        allocates gigabytes)."""
        out = []
        if self.rank < 1:
            out.append(f"model.lora.rank must be >= 1, got {self.rank}")
        sized = [(widths[part], part) for part in self.parts if (widths or {}).get(part)]
        if sized and self.rank > min(sized)[0]:
            width, part = min(sized)
            out.append(f"model.lora.rank {self.rank} is more than the {width} features of the "
                       f"narrowest adapted part ({part}): at most {width}")
        if not math.isfinite(self.alpha) or self.alpha == 0:
            out.append(f"model.lora.alpha must be a finite number other than 0, got {self.alpha} "
                       "(the update is scaled by alpha / rank: 0 trains nothing; default 32)")
        if not 0.0 <= self.dropout < 1.0:
            out.append(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if self.dora and self.experts:
            out.append("model.peft=dora puts no magnitude on MoE experts (model.lora.experts="
                       "true): set model.lora.experts=false, or use model.peft=lora")
        if not self.target_modules:
            out.append("model.lora.target_modules is empty: no linear would get an adapter")
        unknown = [p for p in self.parts if p not in groups]
        if unknown or not self.parts:
            out.append(f"model.lora.parts must be a non-empty list of {list(groups)}, "
                       f"got {self.parts}")
        return out


def read_settings(peft, lora, problems: list[str]) -> LoRAConfig | None:
    """The adapters of ``model.peft`` (one of ``METHODS``) with the ``model.lora`` section
    ``lora`` (a mapping or None), or None with the problems added to ``problems``."""
    from contract.config import build_into

    found = build_into(LoRAConfig, lora, "model.lora", problems)
    if found is not None:
        found.dora = peft == "dora"
    return found


def _tp(is_expert: bool = False):
    """(size, rank) of the TP group a base linear is sharded over (the experts': expert-TP)."""
    from megatron.core import parallel_state as ps

    if is_expert:
        return (ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_rank())
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _kind(base: nn.Module) -> str | None:
    """``column`` / ``row`` for megatron's parallel linears (``plain`` for torch's), else None."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(base, ColumnParallelLinear):
        return "column"
    if isinstance(base, RowParallelLinear):
        return "row"
    if type(base).__name__ in ("TELayerNormColumnParallelLinear", "TEColumnParallelLinear"):
        return "column"
    if type(base).__name__ == "TERowParallelLinear":
        return "row"
    return "plain" if isinstance(base, nn.Linear) else None


def _features(base: nn.Module) -> tuple[int, int]:
    """(in, out) features of the base linear on this rank."""
    out_features, in_features = base.weight.shape
    return in_features, out_features


class LoRAAdapter(nn.Module):
    """The adapter of one base linear (see the module docstring); ``global_name``: the base's
    name at TP = PP = 1 (its layer numbered globally), which seeds A."""

    def __init__(self, base: nn.Module, cfg: LoRAConfig, global_name: str, *, is_expert: bool,
                 gated: bool = False):
        super().__init__()
        self.kind, self.is_expert, self.gated = _kind(base), is_expert, gated
        tp, tp_rank = (1, 0) if self.kind == "plain" else _tp(is_expert)
        self.tp = tp
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and tp > 1
        in_local, out_local = _features(base)
        in_full = in_local * tp if self.kind == "row" else in_local
        device, dtype = base.weight.device, base.weight.dtype
        a_in = in_local if self.kind == "row" else in_full
        self.lora_a = nn.Linear(a_in, cfg.rank, bias=False, device=device, dtype=dtype)
        self.lora_b = nn.Linear(cfg.rank, out_local, bias=False, device=device, dtype=dtype)
        self.scale, self.dropout = cfg.scale, nn.Dropout(cfg.dropout)
        self.norm = _fused_norm(base)
        with torch.no_grad():
            full_a = _seeded_a(global_name, cfg.rank, in_full)
            if self.kind == "row":
                full_a = full_a.chunk(tp, dim=1)[tp_rank]
            self.lora_a.weight.copy_(full_a)
            self.lora_b.weight.zero_()
        for factor, replicated in ((self.lora_a, self.kind != "row"),
                                   (self.lora_b, self.kind == "row")):
            weight = factor.weight
            weight.tensor_model_parallel = not replicated and tp > 1
            weight.partition_dim = 0 if factor is self.lora_b else 1
            weight.partition_stride = 1
            if replicated and self.sequence_parallel and not is_expert:
                weight.sequence_parallel = True  # its gradient: a share per rank, summed
            if is_expert:
                weight.allreduce = False  # experts reduce over the expert-DP group
        self.register_parameter("magnitude", None)
        if cfg.dora:  # the rows' norms of W (B = 0): the base model
            self.magnitude = nn.Parameter(self.row_norms(base.weight).to(dtype))
            self.magnitude.tensor_model_parallel = self.kind == "column" and tp > 1
            self.magnitude.partition_dim, self.magnitude.partition_stride = 0, 1
            if self.kind == "row" and self.sequence_parallel:
                self.magnitude.sequence_parallel = True  # scales a sequence shard's outputs

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """alpha / r * B(A(x)) with x the base linear's input; the same layout as its output."""
        from megatron.core import tensor_parallel as tpl

        if self.norm is not None:
            x = self.norm(x)
        if self.is_expert:  # like the expert's own linears: megatron's dispatcher communicates
            h = nn.functional.linear(self.dropout(x), self._replicated_weight(self.lora_a))
            return nn.functional.linear(h, self._replicated_weight(self.lora_b)) * self.scale
        h = self.lora_a(self.dropout(x))
        if self.kind == "column" and self.tp > 1:
            h = (tpl.gather_from_sequence_parallel_region(h) if self.sequence_parallel
                 else tpl.copy_to_tensor_model_parallel_region(h))
        elif self.kind == "row" and self.tp > 1:
            h = (tpl.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel
                 else tpl.reduce_from_tensor_model_parallel_region(h))
        return self.lora_b(h) * self.scale

    @torch.no_grad()
    def row_norms(self, weight: torch.Tensor) -> torch.Tensor:
        """||W + s B A|| of each of this rank's output rows (float32), ``weight``: the base's W
        on this rank; a row-parallel base's rows are split over TP: their squares summed."""
        full = weight.float() + self.update()
        squares = full.pow(2).sum(dim=1)
        if self.kind == "row" and self.tp > 1:
            from megatron.core import parallel_state as ps

            torch.distributed.all_reduce(squares, group=ps.get_tensor_model_parallel_group())
        return squares.sqrt()

    def dora_output(self, base: torch.Tensor, unbiased: torch.Tensor, delta: torch.Tensor,
                    weight: torch.Tensor) -> torch.Tensor:
        """DoRA's output from the base's ``base`` (``unbiased``: without the bias it adds) and
        the adapter's ``delta`` (s B A x): ``base + (g - 1) W x + g s B A x``, g = m / ||W + s B A||
        (the norm detached)."""
        scale = (self.magnitude.float() / self.row_norms(weight)).to(base.dtype)
        return base + (scale - 1) * unbiased + scale * delta

    def _replicated_weight(self, factor: nn.Linear) -> torch.Tensor:
        """An expert adapter's factor weight as its forward uses it: a factor replicated over
        expert-TP > 1 gets its gradient summed over the expert-TP group (each rank computes a
        share: the other factor is sliced), a sliced one is used as it is."""
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel as tpl

        weight = factor.weight
        if self.tp == 1 or weight.tensor_model_parallel:
            return weight
        return tpl.copy_to_tensor_model_parallel_region(
            weight, group=ps.get_expert_tensor_parallel_group())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Each factor sharded on its own TP axis (B's rows and DoRA's magnitude for a column
        base, A's columns for a row base), the rest replicated over TP; an expert's over
        expert-TP, its replicas over the expert-DP group (megatron's experts' own groups); a
        gated ``linear_fc1``'s rows split gate | up as megatron's MLP splits the weight (so TP = 1
        reads them in its own order)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        rows = ("lora_b.weight", "magnitude")  # laid out like the base's output rows
        axis = (dict.fromkeys(rows, 0) if self.kind == "column" else
                {"lora_a.weight": 1} if self.kind == "row" else {})
        groups = {}
        if self.is_expert:
            groups = dict(tp_group=ps.get_expert_tensor_parallel_group(),
                          dp_cp_group=ps.get_expert_data_parallel_group())
        state = self.state_dict(prefix="", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(state, prefix, axis if self.tp > 1 else {},
                                                      sharded_offsets, **groups)
        if self.gated and self.tp > 1:  # each rank's rows are its gate | up slices: split
            singleton = (metadata or {}).get("singleton_local_shards", False)
            for key in (prefix + row for row in rows if prefix + row in sharded):
                sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets,
                                                            singleton)
        return sharded

    @torch.no_grad()
    def update(self) -> torch.Tensor:
        """alpha / r * B @ A on this rank (float32): LoRA's update of the base weight."""
        return (self.lora_b.weight.float() @ self.lora_a.weight.float()) * self.scale

    @torch.no_grad()
    def merge_into(self, weight: torch.Tensor) -> None:
        """Fold the adapter into the base weight (TP = 1): W + s B A; DoRA's rows then rescaled
        to the magnitude, m (W + s B A) / ||W + s B A||."""
        merged = weight.float() + self.update()
        if self.magnitude is not None:
            merged *= (self.magnitude.float() / merged.norm(dim=1)).unsqueeze(1)
        weight.copy_(merged.to(weight.dtype))


def _fused_norm(base: nn.Module):
    """The layer norm a TransformerEngine ``LayerNormColumnParallelLinear`` applies to its input
    before the matmul (the adapter must see the normalised input too), or None."""
    weight = getattr(base, "layer_norm_weight", None)
    if weight is None:
        return None
    bias = getattr(base, "layer_norm_bias", None)
    eps = getattr(base, "eps", 1e-5)
    kind = getattr(base, "normalization", "LayerNorm")

    def norm(x):
        if kind == "RMSNorm":
            y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
            return (y * (1 + weight.float() if getattr(base, "zero_centered_gamma", False)
                         else weight.float())).to(x.dtype)
        return nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)

    return norm


def _seeded_a(name: str, rank: int, in_features: int) -> torch.Tensor:
    """A's start: Kaiming uniform (torch's Linear init, as PEFT) from a generator seeded by the
    adapter's global name: equal at every layout and on every rank."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound


def _added_bias(module: nn.Module, output) -> torch.Tensor | None:
    """The bias the base linear added to its output (not one megatron returns apart:
    ``skip_bias_add``), or None."""
    if isinstance(output, tuple) and output[1] is not None:
        return None
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, torch.Tensor) and bias.numel() else None


def _hook(adapter: LoRAAdapter):
    def add_delta(module, args, output):
        base = output[0] if isinstance(output, tuple) else output  # megatron: (output, bias)
        delta = adapter.delta(args[0]).to(base.dtype)
        if adapter.magnitude is None:
            new = base + delta
        else:
            bias = _added_bias(module, output)
            unbiased = base if bias is None else base - bias.to(base.dtype)
            new = adapter.dora_output(base, unbiased, delta, module.weight)
        return (new, *output[1:]) if isinstance(output, tuple) else new

    return add_delta


def _global_name(model: nn.Module, name: str) -> str:
    """``name`` with each ``layers.<i>`` numbered as at PP = 1 (megatron's 1-based
    ``layer_number`` of the layer) and each ``local_experts.<j>`` as at EP = 1 (the MoE layer's
    ``local_expert_indices``), so an adapter is seeded alike on every pipeline / expert layout."""
    parts = name.split(".")
    for at in range(len(parts) - 1):
        if parts[at] == "layers" and parts[at + 1].isdigit():
            layer = model.get_submodule(".".join(name.split(".")[: at + 2]))
            number = getattr(layer, "layer_number", None)
            if isinstance(number, int):
                parts[at + 1] = str(number - 1)
        if parts[at] == "local_experts" and parts[at + 1].isdigit() and at >= 2:
            moe = model.get_submodule(".".join(name.split(".")[: at - 1]))
            indices = getattr(moe, "local_expert_indices", None)
            if indices is not None:
                parts[at + 1] = str(indices[int(parts[at + 1])])
    return ".".join(parts)


def add_adapters(model: nn.Module, cfg: LoRAConfig, group_of) -> list[str]:
    """Add an adapter to every linear of ``model`` named in ``cfg.target_modules`` whose
    parameter group (``group_of(<name>.weight)``) is in ``cfg.parts`` (MoE experts' linears only
    with ``cfg.experts``). Returns the adapted linears' names.

    Raises:
        ValueError: a targeted linear of a kind adapters do not support (e.g. grouped experts).
    """
    adapted = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in cfg.target_modules or group_of(f"{name}.weight") not in cfg.parts:
            continue
        is_expert = ".experts." in name
        if is_expert and not cfg.experts:
            continue
        if _kind(module) is None or getattr(module, "weight", None) is None:
            raise ValueError(f"model.lora.target_modules: {name} ({type(module).__name__}) "
                             "is not a linear LoRA supports")
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if type(parent).__name__ == "MambaMixer" and leaf == "in_proj" and _tp()[0] > 1:
            raise ValueError(f"model.lora.target_modules: {name} (a Mamba mixer's in_proj, "
                             "whose rows are split over TP part by part) takes an adapter at "
                             "parallel.tp=1 only")
        adapter = LoRAAdapter(module, cfg, _global_name(model, name), is_expert=is_expert,
                              gated=_gated_fc1(parent, leaf))
        parent.add_module(leaf + SUFFIX, adapter)
        module.register_forward_hook(_hook(adapter))
        module.lora_adapter = [adapter]  # a list: not registered as a child a second time
        adapted.append(name)
    if not adapted:
        raise ValueError(f"model.lora: no linear named {cfg.target_modules} in {cfg.parts}")
    return adapted


def _gated_fc1(parent: nn.Module, leaf: str) -> bool:
    """The linear is a gated MLP's ``linear_fc1`` (rows gate | up on each TP rank), whose
    weight megatron's MLP checkpoints split in two (``apply_swiglu_sharded_factory``)."""
    from megatron.core.transformer.mlp import MLP

    return (leaf == "linear_fc1" and isinstance(parent, MLP)
            and bool(parent.config.gated_linear_unit))


def is_adapter_key(key: str) -> bool:
    """A state-dict key of an adapter (a factor or DoRA's magnitude)."""
    return any(f"{SUFFIX}.{name}" in key for name in ("lora_a.", "lora_b.", "magnitude"))


@torch.no_grad()
def merge_adapters(model: nn.Module) -> int:
    """Fold every adapter into its base weight (``LoRAAdapter.merge_into``) and remove it
    (TP = 1: eval, generation and the merged export load at TP = 1). Returns how many were
    merged."""
    merged = 0
    for name, module in list(model.named_modules()):
        adapters = getattr(module, "lora_adapter", None)
        if not adapters:
            continue
        adapter = adapters[0]
        if adapter.tp > 1:
            raise ValueError("merge_adapters runs at TP = 1")
        adapter.merge_into(module.weight)
        module._forward_hooks.clear()
        del module.lora_adapter
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        delattr(parent, name.rsplit(".", 1)[-1] + SUFFIX)
        merged += 1
    return merged


class Factors(NamedTuple):
    """One adapter's tensors at TP = 1."""

    a: torch.Tensor  #: (r, in)
    b: torch.Tensor  #: (out, r)
    magnitude: torch.Tensor | None = None  #: (out,): DoRA's, else None


def adapter_factors(state: dict[str, torch.Tensor]) -> dict[str, Factors]:
    """base linear's weight key -> its adapter's ``Factors`` of a TP = 1 state dict."""
    out = {}
    for key in state:
        if key.endswith(f"{SUFFIX}.lora_a.weight"):
            base = key[: -len(f"{SUFFIX}.lora_a.weight")]
            out[f"{base}.weight"] = Factors(state[key], state[f"{base}{SUFFIX}.lora_b.weight"],
                                            state.get(f"{base}{SUFFIX}.magnitude"))
    return out
