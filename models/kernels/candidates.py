"""The implementations of every layer kind, fastest first, the plain-torch reference last: what
each needs to load (package, CUDA, a refusal) and which check proves it (models/kernels/checks.py).

``CANDIDATES[kind]`` lists them in the order ``models.kernels`` tries them. A candidate's ``load``
returns its implementation (a namespace of functions / classes with the reference's signatures)
or raises ``Unavailable`` with the reason (not installed, refused on this GPU, the TE layers not in
use); its ``check`` compares it with the reference's implementation on the run's device and
dtype. The reference (``check`` None) always loads and runs on every device. ``after`` names the
kinds whose choice a candidate builds on (the Mamba kernel composes the chosen conv; the grouped
experts need the TransformerEngine layers, which the attention choice decides).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from models.kernels import checks
from models.kernels import conv as torch_conv
from models.kernels import gated_delta as torch_delta
from models.kernels import mamba as torch_mamba
from models.kernels.attention import flash_segments, sdpa_segments


class Unavailable(Exception):
    """Why a candidate cannot run here (the text is the reason the start-up line gives)."""


@dataclass(frozen=True)
class Context:
    """What a candidate is loaded and checked for: the device, the dtype, and the choices of the
    kinds it builds on (kind -> ``models.kernels.Choice``)."""

    device: torch.device
    dtype: torch.dtype
    chosen: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    """One implementation of a layer kind (the module docstring)."""

    kind: str
    name: str  #: the ``model.kernels.<kind>`` value that forces it
    label: str  #: what the start-up line calls it
    load: Callable[[Context], Any]
    #: (fast, reference, device, dtype) -> {what: relative difference}; None: the reference
    check: Callable[..., dict] | None = None
    needs_cuda: bool = True  #: skipped on a CPU run without loading it


def _module(name: str, package: str):
    """Import ``name`` or say why not (``package`` is what the user installs)."""
    if importlib.util.find_spec(name.split(".")[0]) is None:
        raise Unavailable(f"{package} not installed")
    try:
        return importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - a broken build (missing symbol, no CUDA ext)
        text = str(error).strip().splitlines()
        raise Unavailable(f"{package} does not import ({type(error).__name__}: "
                          f"{text[-1][:160] if text else ''})") from None


# ------------------------------------------------------------------ attention
def _te_layers(_ctx: Context) -> str:
    _module("transformer_engine", "TransformerEngine")
    from megatron.core.extensions import transformer_engine as te_ext

    if not getattr(te_ext, "HAVE_TE", False):
        raise Unavailable("megatron-core does not see TransformerEngine (HAVE_TE is false)")
    _parallel_state()
    return "te"


def _parallel_state() -> None:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise Unavailable("megatron's parallel state is not set up (models.parallel.init_parallel)")


def _flash(_ctx: Context):
    _module("flash_attn", "flash-attn")
    return flash_segments


# ------------------------------------------------------------------ conv
def _causal_conv1d(_ctx: Context):
    package = _module("causal_conv1d", "causal-conv1d")
    return SimpleNamespace(fn=package.causal_conv1d_fn, update=package.causal_conv1d_update)


def _fla_conv(_ctx: Context):
    _module("fla.modules.causal_conv1d", "fla-core")
    return SimpleNamespace(fn=torch_conv.fla_causal_conv1d_fn,
                           update=torch_conv.fla_causal_conv1d_update)


TORCH_CONV = SimpleNamespace(fn=torch_conv.causal_conv1d_fn, update=torch_conv.causal_conv1d_update)


# ------------------------------------------------------------------ mamba
def _mamba1_stand_in() -> None:
    """mamba_ssm <= 2.3.2.post1 imports its Mamba-1 CUDA extension (``selective_scan_cuda``) in
    the package's ``__init__``; a Triton-only build (``MAMBA_SKIP_CUDA_BUILD=TRUE``) has none, so
    not even its Mamba2 Triton kernels import. Where the package is installed without it, a
    stand-in module takes its name; calling Mamba-1's scan (which Mamba2 never does) raises."""
    import sys
    import types

    if "selective_scan_cuda" in sys.modules or importlib.util.find_spec("mamba_ssm") is None:
        return
    if importlib.util.find_spec("selective_scan_cuda") is not None:
        return

    def missing(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError("selective_scan_cuda: this mamba_ssm is a Triton-only build "
                           "(Mamba-1's CUDA scan is not built)")

    stand_in = types.ModuleType("selective_scan_cuda")
    stand_in.__getattr__ = missing
    sys.modules["selective_scan_cuda"] = stand_in


def _mamba_ssm(ctx: Context):
    _mamba1_stand_in()
    ssd = _module("mamba_ssm.ops.triton.ssd_combined", "mamba_ssm")
    norm = _module("mamba_ssm.ops.triton.layernorm_gated", "mamba_ssm").RMSNorm
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except ImportError:
        selective_state_update = None
    conv = ctx.chosen["conv"]
    if conv.name == "causal_conv1d":  # mamba_ssm's fused kernel calls causal-conv1d's CUDA conv
        combined = ssd.mamba_split_conv1d_scan_combined
    else:  # a Triton-only mamba_ssm: its chunked scan after the chosen conv
        combined = torch_mamba.split_conv1d_scan(conv.impl.fn, ssd.mamba_chunk_scan_combined)
    return SimpleNamespace(combined=combined, chunk_scan=ssd.mamba_chunk_scan_combined,
                           norm=norm, state_update=selective_state_update)


def _torch_mamba(ctx: Context):
    conv = ctx.chosen.get("conv")
    fn = conv.impl.fn if conv is not None else torch_conv.causal_conv1d_fn
    return SimpleNamespace(combined=torch_mamba.split_conv1d_scan(fn),
                           chunk_scan=torch_mamba.mamba_chunk_scan_combined,
                           norm=torch_mamba.RMSNormGated, state_update=None)


TORCH_MAMBA = SimpleNamespace(combined=torch_mamba.mamba_split_conv1d_scan_combined,
                              chunk_scan=torch_mamba.mamba_chunk_scan_combined,
                              norm=torch_mamba.RMSNormGated, state_update=None)


# ------------------------------------------------------------------ gated delta rule
def fla_backward_refusal(device: torch.device) -> str | None:
    """Why fla-core would refuse the gated delta rule's backward on this GPU, else None:
    fla-core >= 0.6 raises at the first backward on Hopper GPUs (H100 / H200) with Triton >= 3.4
    and < 3.7.1 (wrong gradients there) unless tilelang is installed; seen on an H200 with torch
    2.11's Triton 3.6.0."""
    if device.type != "cuda":
        return None
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # an fla-core without the check
        return None
    if (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1
            and importlib.util.find_spec("tilelang") is None):
        import triton

        return (f"fla-core refuses the delta rule's backward with Triton {triton.__version__} "
                f"on {torch.cuda.get_device_name(device)} (Hopper; wrong gradients below 3.7.1: "
                "install triton>=3.7.1 or tilelang)")
    return None


def _fla_rule(ctx: Context):
    rule = _module("fla.ops.gated_delta_rule", "fla-core")
    problem = fla_backward_refusal(ctx.device)
    if problem:
        raise Unavailable(problem)
    return SimpleNamespace(chunk=rule.chunk_gated_delta_rule,
                           recurrent=rule.fused_recurrent_gated_delta_rule)


TORCH_DELTA = SimpleNamespace(chunk=torch_delta.chunk_gated_delta_rule,
                              recurrent=torch_delta.fused_recurrent_gated_delta_rule)


# ------------------------------------------------------------------ experts
def _grouped_gemm(ctx: Context) -> str:
    attention = ctx.chosen["attention"]
    if attention.name != "te":
        raise Unavailable("the TransformerEngine layers are not in use")
    from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear

    if TEColumnParallelGroupedLinear is None:
        raise Unavailable("this TransformerEngine has no grouped linear (needs >= 1.9)")
    return "te_grouped_gemm"


def _device_check(check):
    """A check that builds its own modules: (fast, reference, device, dtype) -> check(device,
    dtype)."""
    return lambda _fast, _reference, device, dtype: check(device, dtype)


CANDIDATES: dict[str, list[Candidate]] = {
    "attention": [
        Candidate("attention", "te", "TransformerEngine attention (THD)", _te_layers,
                  _device_check(checks.check_te_attention)),
        Candidate("attention", "flash_attn", "flash-attn varlen", _flash, checks.check_segments),
        Candidate("attention", "sdpa", "torch SDPA per segment", lambda ctx: sdpa_segments,
                  needs_cuda=False),
    ],
    "conv": [
        Candidate("conv", "causal_conv1d", "causal-conv1d (CUDA)", _causal_conv1d,
                  checks.check_conv),
        Candidate("conv", "fla", "fla-core Triton conv", _fla_conv, checks.check_conv),
        Candidate("conv", "torch", "torch causal conv", lambda ctx: TORCH_CONV,
                  needs_cuda=False),
    ],
    "mamba": [
        Candidate("mamba", "mamba_ssm", "mamba_ssm chunked scan (Triton)", _mamba_ssm,
                  checks.check_mamba),
        Candidate("mamba", "torch", "torch chunked scan", _torch_mamba, needs_cuda=False),
    ],
    "deltanet": [
        Candidate("deltanet", "fla", "fla-core chunked delta rule (Triton)", _fla_rule,
                  checks.check_deltanet),
        Candidate("deltanet", "torch", "torch chunked delta rule", lambda ctx: TORCH_DELTA,
                  needs_cuda=False),
    ],
    "experts": [
        Candidate("experts", "te_grouped_gemm", "TransformerEngine grouped GEMM", _grouped_gemm,
                  _device_check(checks.check_grouped_experts)),
        Candidate("experts", "sequential", "megatron sequential experts",
                  lambda ctx: "sequential", needs_cuda=False),
    ],
}
#: what every fast candidate of a kind is checked against (the kind's torch implementation)
REFERENCES = {"attention": sdpa_segments, "conv": TORCH_CONV, "mamba": TORCH_MAMBA,
              "deltanet": TORCH_DELTA, "experts": "sequential"}
#: kinds whose choice a kind's candidates build on (chosen first)
AFTER = {"mamba": ("conv",), "deltanet": ("conv",), "experts": ("attention",)}
