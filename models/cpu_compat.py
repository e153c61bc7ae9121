"""The one place for CPU accommodations of megatron-core.

megatron-core has no CPU-only path: it calls ``torch.cuda.current_device()`` as a device in many
places, allocates ``device="cuda"`` tensors in a few constructors, forks the CUDA RNG for dropout,
and (0.19.x) imports ``triton`` unconditionally for one MoE kernel module. This module owns the
shims that let the project's model, checkpoint and training code run unchanged on a CPU machine
(gloo). Everything here is applied by one explicit call and does nothing when CUDA is available:

    from models.cpu_compat import enable_cpu_compat, seed_model_parallel
    enable_cpu_compat()                 # before importing megatron.core
    ... parallel_state.initialize_model_parallel(...)
    seed_model_parallel(1234)           # installs a CPU RNG tracker on CPU, megatron's own on GPU

megatron's optimizer (the distributed optimizer's parameter grouping, the grad-norm clip) asserts
that parameters are CUDA tensors by their ``Tensor.type()`` name; on CPU that name is reported
with ``cuda`` for calls from ``megatron.core.optimizer`` only (``_optimizer_type_names``), so the
same optimizer code runs.

Two accommodations of the hybrid (Nemotron) language model, called by its builder:
``use_local_mamba_final_norm()`` (``MambaStack`` builds its final norm with ``TENorm``
unconditionally, which raises without TransformerEngine) and ``cpu_moe_overrides()`` (MoE config
values that avoid megatron's CUDA-only MoE paths on CPU).

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


def _stub_triton_kernel_module() -> None:
    """megatron-core >= 0.19 imports triton in transformer/moe/ops/paged_stash.py (MoE only)."""
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if name in sys.modules:
        return
    stub = types.ModuleType(name)
    stub.GLOBAL_BLOCK_SIZE = 1024

    def _needs_triton(*_args, **_kwargs):
        raise RuntimeError("MoE paged stash needs triton and CUDA")

    stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = _needs_triton
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
    _stub_triton_kernel_module()
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
