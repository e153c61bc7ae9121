"""Which implementation runs each layer kind, each fast kernel proven where it runs.

Layer kinds (``LAYER_KINDS``) and their implementations, fastest first (models/kernels/
candidates.py), the plain-torch reference last:

- ``attention``: ``te`` (TransformerEngine layer specs: its THD core attention for the LM, its
  linears, norms and grouped experts), ``flash_attn`` (flash-attn's varlen kernel), ``sdpa``
  (torch SDPA over the segments of each length); the vision towers' segment attention is
  flash-attn where it passed its check, else SDPA, whatever the LM uses;
- ``conv`` (the causal depthwise conv of Mamba and Gated DeltaNet layers): ``causal_conv1d``
  (CUDA), ``fla`` (fla-core's Triton conv), ``torch``;
- ``mamba``: ``mamba_ssm`` (its Triton chunked scan and gated norm; fused with causal-conv1d's
  conv where that is the conv, else after the chosen conv: a Triton-only mamba_ssm), ``torch``;
- ``deltanet`` (the gated delta rule): ``fla`` (fla-core's Triton chunked rule), ``torch``;
- ``experts`` (MoE): ``te_grouped_gemm`` (needs the TE layers), ``sequential`` (megatron's
  per-expert experts).

For each kind a run uses (its model config's ``kernel_kinds()``), ``select`` takes the first
implementation that is installed, not refused (fla-core's Hopper backward refusal with Triton
< 3.7.1) and that AGREES with the torch reference on the run's own device and dtype
(checks.py: a small packed row with segment restarts, forward and backward, ``TOLERANCE`` per
dtype); else the next one down, finally torch. On a CPU every kind is torch (the fast kernels
need CUDA). Verdicts are cached per process (device, dtype); a check costs milliseconds once its
kernels are compiled. ``model.kernels.<kind>`` (``KernelsConfig``, a section of every family's
model config) forces one implementation: a forced one that is missing, refused or disagrees is a
one-line ``UsageError``. ``Choice.line()`` is the start-up line of a kind, e.g.
``mamba: torch chunked scan (mamba_ssm not installed)``; train.py and eval.py print one per kind
(``recipes.model_setup.select_kernels``).

How the choice reaches the model: the family models call ``prepare(cfg.kernels, kinds)`` first
(the TE layer specs when attention is ``te``: ``use_te``; ``grouped_gemm``); megatron's Mamba
mixer gets the chosen kernels bound into its module (models/kernels/megatron_mamba.py; then it
builds without mamba_ssm on any device); the Gated DeltaNet layer and the segment attention ask
``chosen(kind).impl``. ``select`` (train.py's explicit call with the run's dtype) replaces what
was bound; ``prepare`` keeps a kind already chosen with the same setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from contract.errors import UsageError

LAYER_KINDS = ("attention", "conv", "mamba", "deltanet", "experts")
AUTO = "auto"
#: the values ``model.kernels.<kind>`` takes besides auto (candidates.CANDIDATES' names)
NAMES = {"attention": ("te", "flash_attn", "sdpa"), "conv": ("causal_conv1d", "fla", "torch"),
         "mamba": ("mamba_ssm", "torch"), "deltanet": ("fla", "torch"),
         "experts": ("te_grouped_gemm", "sequential")}


@dataclass(kw_only=True, slots=True)
class KernelsConfig:
    """``kernels.<kind>`` of the run config: auto (the fastest implementation that passes its
    check) or one implementation forced (``NAMES``; docs/models.md "Kernels")."""

    attention: str = AUTO  #: auto | te | flash_attn | sdpa
    conv: str = AUTO  #: auto | causal_conv1d | fla | torch
    mamba: str = AUTO  #: auto | mamba_ssm | torch
    deltanet: str = AUTO  #: auto | fla | torch
    experts: str = AUTO  #: auto | te_grouped_gemm | sequential

    def __post_init__(self):
        problems = [f"{kind} must be one of {', '.join((AUTO, *names))}, got "
                    f"{getattr(self, kind)!r}" for kind, names in NAMES.items()
                    if getattr(self, kind) not in (AUTO, *names)]
        if problems:
            from contract.errors import ConfigError

            raise ConfigError("; ".join(problems), problems)


class KernelError(UsageError):
    """A forced implementation (``model.kernels.<kind>=<name>``) that cannot run here."""


@dataclass(frozen=True)
class Choice:
    """What runs one layer kind, and why."""

    kind: str
    name: str  #: the implementation (a ``NAMES`` value)
    label: str  #: what the line calls it
    reason: str  #: why this one (the check it passed, or why the faster ones did not run)
    errors: dict = field(default_factory=dict)  #: the accepted check's relative differences
    impl: Any = field(default=None, compare=False, repr=False)  #: the implementation itself
    #: attention only: the vision towers' segment kernel and its label
    segments: Any = field(default=None, compare=False, repr=False)
    segments_label: str = ""

    def line(self) -> str:
        towers = f"; vision segments: {self.segments_label}" if self.segments_label else ""
        return f"{self.kind}: {self.label} ({self.reason}){towers}"


#: kind -> (setting, Choice) bound in this process
_BOUND: dict[str, tuple[str, Choice]] = {}
#: (kind, name, device, dtype, choices it builds on) -> (impl or None, errors, reason)
_VERDICTS: dict[tuple, tuple[Any, dict, str]] = {}


def _context(device, dtype, chosen: dict):
    import torch

    from models import cpu
    from models.kernels.candidates import Context

    device = torch.device(cpu.compute_device() if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return Context(device, dtype or torch.get_default_dtype(), chosen)


def _verdict(candidate, ctx) -> tuple[Any, dict, str]:
    """(impl or None, check errors, reason) of a fast candidate, cached per process."""
    import torch

    from models.kernels.candidates import AFTER, REFERENCES, Unavailable
    from models.kernels.checks import TOLERANCE

    after = tuple(ctx.chosen[k].name for k in AFTER.get(candidate.kind, ()))
    key = (candidate.kind, candidate.name, str(ctx.device), ctx.dtype, after, candidate.check)
    if key in _VERDICTS:
        return _VERDICTS[key]
    try:
        impl = candidate.load(ctx)
    except Unavailable as error:
        found = (None, {}, str(error))
    else:
        reference = REFERENCES[candidate.kind]
        try:
            with torch.device("cpu"):  # the checks place their tensors themselves (not on
                # a caller's default device, e.g. recipes.memory's meta-device build)
                errors = candidate.check(impl, reference, ctx.device, ctx.dtype)
        except Exception as error:  # noqa: BLE001 - a kernel that fails its check is not used
            lines = str(error).strip().splitlines()
            found = (None, {}, f"{candidate.label} failed its check ({type(error).__name__}: "
                               f"{lines[-1][:200] if lines else ''})")
        else:
            tolerance = TOLERANCE.get(ctx.dtype, TOLERANCE[next(iter(TOLERANCE))])
            worst = max(errors, key=errors.get)
            if errors[worst] > tolerance:
                found = (None, errors, f"{candidate.label} disagrees with torch ({worst} off by "
                                       f"{errors[worst]:.1e} > {tolerance:.0e})")
            else:
                found = (impl, errors, f"agrees with torch on {ctx.device.type} "
                                       f"{str(ctx.dtype).replace('torch.', '')}: worst "
                                       f"{errors[worst]:.1e}")
    _VERDICTS[key] = found
    return found


def _choose(kind: str, setting: str, ctx) -> Choice:
    from models.kernels.candidates import CANDIDATES

    reasons, on_cpu = [], False
    for candidate in CANDIDATES[kind]:
        if setting not in (AUTO, candidate.name):
            continue
        if candidate.check is None:  # the reference
            why = "; ".join(reasons) or (f"kernels.{kind}={setting}" if setting != AUTO
                                         else "the reference")
            if on_cpu:
                why = "on CPU: the fast kernels need CUDA" + (f"; {why}" if reasons else "")
            return Choice(kind, candidate.name, candidate.label, why,
                          impl=candidate.load(ctx))
        if candidate.needs_cuda and ctx.device.type != "cuda":
            on_cpu = True
            if setting != AUTO:
                raise KernelError(f"kernels.{kind}={setting}: {candidate.label} needs a "
                                  "CUDA device (this process runs on the CPU)")
            continue
        impl, errors, reason = _verdict(candidate, ctx)
        if impl is not None:
            return Choice(kind, candidate.name, candidate.label, reason, errors, impl)
        if setting != AUTO:
            raise KernelError(f"kernels.{kind}={setting}: {reason}")
        reasons.append(reason)
    raise KernelError(f"kernels.{kind}: no implementation runs ({'; '.join(reasons)})")


def _with_segments(choice: Choice, ctx) -> Choice:
    """The attention choice with the towers' segment kernel: flash-attn where it passed its
    check (the LM's choice or not), else SDPA."""
    from dataclasses import replace

    from models.kernels.attention import sdpa_segments
    from models.kernels.candidates import CANDIDATES

    if choice.name == "flash_attn":
        return replace(choice, segments=choice.impl)
    if choice.name == "sdpa":
        return replace(choice, segments=sdpa_segments)
    flash = next(c for c in CANDIDATES["attention"] if c.name == "flash_attn")
    impl = _verdict(flash, ctx)[0] if ctx.device.type == "cuda" else None
    if impl is not None:
        return replace(choice, segments=impl, segments_label=flash.label)
    return replace(choice, segments=sdpa_segments, segments_label="torch SDPA per segment")


def _order(kinds) -> list[str]:
    """``kinds`` with the kinds they build on, in ``LAYER_KINDS`` order."""
    from models.kernels.candidates import AFTER

    wanted = set(kinds)
    for kind in kinds:
        wanted.update(AFTER.get(kind, ()))
    return [kind for kind in LAYER_KINDS if kind in wanted]


def _bind(kinds, config, device, dtype, keep: bool) -> dict[str, Choice]:
    from models.kernels import megatron_mamba

    chosen: dict[str, Choice] = {}
    for kind in _order(kinds):
        setting = getattr(config, kind) if config is not None else AUTO
        if keep and kind in _BOUND:
            chosen[kind] = _BOUND[kind][1]
            continue
        ctx = _context(device, dtype, dict(chosen))
        choice = _choose(kind, setting, ctx)
        if kind == "attention":
            choice = _with_segments(choice, ctx)
        if kind == "mamba":
            megatron_mamba.bind(choice.impl, chosen["conv"])
        _BOUND[kind] = (setting, choice)
        chosen[kind] = choice
    return {kind: chosen[kind] for kind in _order(kinds)}


def select(config: KernelsConfig | None = None, kinds=LAYER_KINDS, *, device=None,
           dtype=None) -> dict[str, Choice]:
    """Choose (checks included) and bind every kind of ``kinds`` (and the kinds they build on)
    for ``device`` (default: this process's compute device) and ``dtype`` (default: torch's
    default dtype); returns kind -> Choice.

    Raises:
        KernelError: a forced implementation (``config``) that is missing, refused or
            disagrees with torch (one line naming the key).
    """
    return _bind(kinds, config, device, dtype, keep=False)


def prepare(kinds) -> dict[str, Choice]:
    """The choices of ``kinds``: what this process chose already (``select``), the others
    chosen now automatically for this process's device and torch's default dtype; the model
    builders call it before building their layers."""
    return _bind(kinds, None, None, None, keep=True)


def chosen(kind: str) -> Choice:
    """What runs ``kind`` in this process (chosen now, automatically, when nothing is yet)."""
    return prepare((kind,))[kind]


def grouped_gemm(te_layers: bool) -> bool:
    """Whether MoE experts run TE's grouped GEMM (only within the TE layer specs: a model built
    with local specs runs megatron's sequential experts)."""
    return te_layers and chosen("experts").name == "te_grouped_gemm"


def survey(kinds=LAYER_KINDS, *, device=None, dtype=None) -> list[dict]:
    """Every implementation of ``kinds`` on ``device`` / ``dtype`` and its verdict (the check's
    relative differences, or why it did not run) with the seconds its first check took (loading
    and compiling included); what bench/gpu_check.py reports. Binds nothing."""
    import time

    from models.kernels.candidates import CANDIDATES

    rows, chosen = [], {}
    for kind in _order(kinds):
        ctx = _context(device, dtype, dict(chosen))
        for candidate in CANDIDATES[kind]:
            row = {"kind": kind, "name": candidate.name, "label": candidate.label,
                   "dtype": str(ctx.dtype).replace("torch.", "")}
            if candidate.check is None:
                rows.append(row | {"status": "reference"})
                continue
            if candidate.needs_cuda and ctx.device.type != "cuda":
                rows.append(row | {"status": "unavailable", "reason": "on CPU"})
                continue
            tick = time.perf_counter()
            impl, errors, reason = _verdict(candidate, ctx)
            status = "accepted" if impl is not None else "rejected" if errors else "unavailable"
            rows.append(row | {"status": status, "reason": reason, "errors": errors,
                               "check_s": round(time.perf_counter() - tick, 3)})
        chosen[kind] = _choose(kind, AUTO, ctx)
    return rows


def reset() -> None:
    """Forget every choice and verdict of this process (tests)."""
    _BOUND.clear()
    _VERDICTS.clear()
