"""The one place for CPU accommodations of megatron-core.

megatron-core has no CPU-only path: it calls ``torch.cuda.current_device()`` as a device in many
places, allocates ``device="cuda"`` tensors in a few constructors, forks the CUDA RNG for dropout,
and imports ``triton`` unconditionally in a few kernel modules (``_TRITON_MODULES``). This
module owns the shims that let the project's model, checkpoint and training code run unchanged
on a CPU machine (gloo). Everything here is applied by one explicit call and does nothing when
CUDA is available:

    from models.cpu_compat import enable_cpu_compat, seed_model_parallel
    enable_cpu_compat()                 # before importing megatron.core
    ... parallel_state.initialize_model_parallel(...)
    seed_model_parallel(1234)           # installs a CPU RNG tracker on CPU, megatron's own on GPU

megatron's optimizer (the distributed optimizer's parameter grouping, the grad-norm clip) asserts
that parameters are CUDA tensors by their ``Tensor.type()`` name; on CPU that name is reported
with ``cuda`` for calls from ``megatron.core.optimizer`` only (``_optimizer_type_names``), so the
same optimizer code runs.

Three accommodations of the hybrid (Nemotron) language model, called by its builder:
``use_local_mamba_final_norm()`` (``MambaStack`` builds its final norm with ``TENorm``
unconditionally, which raises without TransformerEngine), ``cpu_moe_overrides()`` (MoE config
values that avoid megatron's CUDA-only MoE paths on CPU) and ``use_torch_mamba_kernels()``
(megatron's ``MambaMixer`` takes its scan, gated norm and decode kernels from mamba_ssm /
causal_conv1d / Triton: on CPU without mamba_ssm they are bound to the plain-torch versions of
the sibling module ``models/cpu_mamba.py``, which only this module imports).

Written against megatron-core 0.16.1 and 0.19.x (attribute differences are guarded).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch

_ENABLED = False
_FACTORIES = ("zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like",
              "ones_like", "full_like", "randn", "rand", "randint")


def cpu_only() -> bool:
    """True when this process runs without CUDA (the shims are then active)."""
    return not torch.cuda.is_available()


#: megatron modules that import triton unconditionally -> constants they must still export.
#: 0.19.x: the MoE paged-stash kernels; 0.16.1: the dynamic-inference tensor ops that
#: ``ssm/mamba_mixer.py`` imports at module level (used only by dynamic batching)
_TRITON_MODULES = {
    "megatron.core.transformer.moe.ops.paged_stash": {"GLOBAL_BLOCK_SIZE": 1024},
    "megatron.core.inference.contexts.attention_context.triton.tensor_ops": {},
}


def _stub_triton_kernel_modules() -> None:
    """Without triton, register stand-ins for ``_TRITON_MODULES``: their constants, and any
    other name (a kernel or its launcher) a function that raises when called."""
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    for name, constants in _TRITON_MODULES.items():
        if name in sys.modules:
            continue
        stub = types.ModuleType(name)
        stub.__dict__.update(constants)

        def kernel(attr, _module=name):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def needs_triton(*_args, **_kwargs):
                raise RuntimeError(f"{_module}.{attr} needs triton and CUDA")

            return needs_triton

        stub.__getattr__ = kernel
        sys.modules[name] = stub


def _cpu_kwargs(kwargs: dict) -> dict:
    kwargs.pop("pin_memory", None)
    device = kwargs.get("device")
    if device is not None and str(device).startswith("cuda"):
        kwargs["device"] = "cpu"
    return kwargs


class _NullStream:
    def wait_stream(self, *_args):
        pass

    def synchronize(self):
        pass

    def record_event(self, *_args):
        return None


def enable_cpu_compat(remap_tensor_literals: bool = False) -> bool:
    """Apply the CPU shims once (idempotent); a no-op when CUDA is available.

    Call before importing megatron.core. Returns True when the shims are active.

    Args:
        remap_tensor_literals: also remap ``torch.tensor(..., device="cuda")`` (megatron's
            optimizer wrappers need it). Off by default: wrapping ``torch.tensor`` breaks
            transformers' ``from_pretrained`` in the same process (rotary buffers come out
            uninitialised), which the HF parity checks need.
    """
    global _ENABLED
    if not cpu_only():
        return False
    if remap_tensor_literals and not getattr(torch.tensor, "_cpu_compat", False):
        original_tensor = torch.tensor

        @functools.wraps(original_tensor)
        def tensor(*args, **kwargs):
            return original_tensor(*args, **_cpu_kwargs(kwargs))

        tensor._cpu_compat = True
        torch.tensor = tensor
    if _ENABLED:
        return True
    _stub_triton_kernel_modules()
    torch.cuda.current_device = lambda: "cpu"
    for name in _FACTORIES:
        original = getattr(torch, name)

        @functools.wraps(original)
        def wrapped(*args, __original=original, **kwargs):
            return __original(*args, **_cpu_kwargs(kwargs))

        setattr(torch, name, wrapped)
    torch.Tensor.cuda = lambda self, *_args, **_kwargs: self
    torch.Tensor.type = _optimizer_type_names(torch.Tensor.type)
    torch.cuda.synchronize = lambda *_args, **_kwargs: None
    torch.cuda.empty_cache = lambda *_args, **_kwargs: None
    torch.cuda.current_stream = lambda *_args, **_kwargs: _NullStream()
    _ENABLED = True
    return True


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
                    "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _optimizer_type_names(original):
    """``Tensor.type()`` that names CPU float tensors as CUDA ones when megatron's optimizer code
    asks (its dtype checks compare against ``torch.cuda.*Tensor`` names); unchanged elsewhere."""

    @functools.wraps(original)
    def type_name(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or name not in _CUDA_TYPE_NAMES:
            return name
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return _CUDA_TYPE_NAMES[name] if caller.startswith("megatron.core.optimizer") else name

    return type_name


def _cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's tracker, forking the CPU generator instead of torch.cuda's."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            original = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            original = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(original)

    return CPURNGStatesTracker


def seed_model_parallel(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker (after parallel_state is initialised).

    On CPU a tracker that forks the CPU generator is installed first (and megatron's CUDA
    generator save / restore, used by activation recomputation, does nothing); on GPU this is
    exactly ``model_parallel_cuda_manual_seed(seed)``.
    """
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(seed)
    if cpu_only():
        enable_cpu_compat()
        mrandom._CUDA_RNG_STATE_TRACKER = _cpu_tracker_class()()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        # activation recomputation (megatron's checkpoint) saves and restores the CUDA generator
        # next to the CPU one and the tracker's: there is none on CPU
        mrandom._get_cuda_rng_state = lambda *_args, **_kwargs: None
        mrandom._set_cuda_rng_state = lambda *_args, **_kwargs: None
    mrandom.model_parallel_cuda_manual_seed(seed)


def use_local_mamba_final_norm() -> bool:
    """Let ``MambaStack`` build its final norm without TransformerEngine (idempotent).

    megatron's ``ssm/mamba_block.py`` calls ``TENorm(config, hidden_size, eps)`` for the final
    norm whatever the layer spec says; without TE that raises ImportError. When TE is missing,
    the name is rebound (in that module only) to megatron's ``WrappedTorchNorm`` (torch LayerNorm /
    RMSNorm from ``config.normalization``, same ``weight`` parameter name, so checkpoints are
    unchanged). Returns True when the rebinding is in effect; a no-op when TE is installed.
    """
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.ssm import mamba_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if getattr(te_ext, "HAVE_TE", False):
        return False
    mamba_block.TENorm = WrappedTorchNorm
    return True


def cpu_moe_overrides() -> dict:
    """TransformerConfig MoE values for CPU runs ({} with CUDA).

    megatron's alltoall token dispatcher creates a ``torch.cuda.Stream`` in its constructor: on
    CPU the allgather dispatcher (same routing, no stream) is used. Also, without TE,
    ``moe_utils.router_gating_linear`` reads the name ``te_general_gemm`` that its failed TE
    import never bound (NameError in 0.16.1): it is bound to None here (megatron's own "no TE"
    value), which selects the plain torch GEMM.
    """
    if not cpu_only():
        return {}
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    return {"moe_token_dispatcher_type": "allgather"}


def use_torch_mamba_kernels() -> bool:
    """Let megatron's ``MambaMixer`` run on CPU without mamba_ssm (idempotent).

    In ``megatron.core.ssm.mamba_mixer`` (0.16.1 and >= 0.17):

    - the scan kernels (``mamba_split_conv1d_scan_combined``: training / eval forwards;
      ``mamba_chunk_scan_combined``: the inference prefill) and the gated norm
      (``RMSNormGated``; ``ExtendedRMSNorm``, which megatron builds on a mock without mamba_ssm,
      is rebuilt with megatron's ``sharded_state_dict``) are bound to ``models.cpu_mamba``;
    - ``HAVE_MAMBA_SSM`` is set, so the mixer builds;
    - packed training sequences are reported supported (megatron checks installed mamba_ssm /
      causal_conv1d versions; the torch scan restarts at every ``seq_idx`` change);
    - the decode-step kernels (mamba_ssm's, or megatron's own Triton ones in >= 0.17) are set to
      None, which selects megatron's own torch decode step.

    Returns True when the torch kernels are in effect; a no-op (False) with CUDA or when
    mamba_ssm is installed.
    """
    from megatron.core.ssm import mamba_mixer

    if getattr(mamba_mixer, "_torch_kernels", False):
        return True
    if not cpu_only() or getattr(mamba_mixer, "HAVE_MAMBA_SSM", False):
        return False
    from models import cpu_mamba

    def packing_support(for_inference_not_training: bool = True):
        if for_inference_not_training:  # megatron's dynamic-batching inference
            return False, "packed Mamba inference needs mamba_ssm (not the CPU torch kernels)"
        return True, None

    mamba_mixer.RMSNormGated = cpu_mamba.RMSNormGated
    mamba_mixer.ExtendedRMSNorm = _sharded_gated_norm(cpu_mamba.RMSNormGated)
    mamba_mixer.mamba_chunk_scan_combined = cpu_mamba.mamba_chunk_scan_combined
    mamba_mixer.mamba_split_conv1d_scan_combined = cpu_mamba.mamba_split_conv1d_scan_combined
    mamba_mixer._check_mamba_sequence_packing_support = packing_support
    for name in ("causal_conv1d_update", "selective_state_update"):
        setattr(mamba_mixer, name, None)
    mamba_mixer.HAVE_MAMBA_SSM = True
    mamba_mixer._torch_kernels = True
    return True


def _sharded_gated_norm(norm_class):
    """megatron's ``mamba_mixer.ExtendedRMSNorm`` over ``norm_class``: the same sharded state
    dict (the weight split on dim 0 over tensor parallel, as in 0.16.1 and >= 0.17)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        make_sharded_tensors_for_checkpoint,
    )

    class ExtendedRMSNorm(norm_class):
        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            if not hasattr(self, "tp_group"):
                self.tp_group = parallel_state.get_tensor_model_parallel_group()
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    return ExtendedRMSNorm
