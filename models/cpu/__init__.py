"""The one place for CPU accommodations: megatron-core on a machine without CUDA (gloo).

megatron-core has no CPU-only path. This package owns everything that lets the project's model,
checkpoint and training code run unchanged on CPU; that code reads as GPU code. One call
switches it on, once per process, and does nothing when CUDA is available:

    from models import cpu
    cpu.activate()      # models.parallel.init_process_group calls it: every process that
                        # sets up megatron (train.py, eval.py, models.convert, tests) goes there

Patches ``activate()`` applies (on CPU only; with CUDA every one of them is megatron's own path):

- torch, as megatron's modules see it (``_cpu_torch_view``): every ``megatron.core`` module,
  loaded now or later (an import hook), has its global ``torch`` replaced by a view of torch in
  which the tensor factories (``torch.zeros`` ... ``torch.tensor``) place ``device="cuda"`` on
  the CPU, ``torch.cuda.current_device()`` answers ``"cpu"`` (megatron uses it as a device in
  ~40 places) and ``torch.cuda.synchronize / empty_cache / current_stream`` do nothing
  (dist_checkpointing save, the pipeline's p2p, DDP). Needed by e.g. ``MixedPrecisionOptimizer``
  and ``FP32Optimizer`` (``torch.tensor(..., device='cuda')``), the schedules'
  ``total_num_tokens = torch.zeros(..., device="cuda")`` and megatron's layers
  (``device=torch.cuda.current_device()``). The process's own torch is not touched, so
  transformers and the project's code see plain torch (the project places models with
  ``compute_device()``).
  GPU: the real torch.
- ``Tensor.type``, only while these megatron optimizer functions run: the constructors of
  ``DistributedOptimizer`` (the default, ``train.distributed_optimizer``) and
  ``Float16OptimizerWithFloat16Params`` (bf16 without it), which sort parameters by
  ``param.type()`` against ``'torch.cuda.*Tensor'`` names and refuse others, and
  ``clip_grads.clip_grad_by_total_norm_fp32`` / ``count_zeros_fp32`` (``train.clip_grad``, which
  assert ``grad.type() == 'torch.cuda.FloatTensor'``; rebound in ``optimizer.py`` too, which
  imports them by name); for that time CPU float tensors report the CUDA names. GPU: real CUDA
  tensors report them.
- ``Tensor.cuda`` keeps a tensor on the CPU, only while these run: ``rope_utils.
  get_pos_emb_on_this_cp_rank`` (rotary under context parallelism; rebound where imported by
  name) and ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings under
  pipeline parallelism), each of which moves one tensor with ``.cuda()``. GPU: the real move.
- ``megatron.core.jit``: its ``jit_fuser`` (``torch.compile``, megatron's GPU kernel fusions)
  is megatron's own no-op decorator (``disable_jit_fuser``), set as the module loads, before any
  fusion is decorated: the ~40 decorations imported dynamo when megatron loaded, 1-2 s of every
  process (a 3-step tiny train.py run: 11.1 s against 12.5 s, the same losses bit for bit).
  GPU: megatron's fusions.
- megatron modules that import ``triton`` unconditionally (``_TRITON_MODULES``; 0.19.x imports
  one of them from ``import megatron.core``) are registered as stand-ins when triton is absent;
  their kernels raise if ever called. GPU: triton is installed.
- ``ModelParallelConfig.__post_init__`` (every ``TransformerConfig``): ``use_cpu_initialization``
  is set (megatron's GPU initialisation allocates on the CUDA device and forks the CUDA RNG) and
  the MoE ``alltoall`` token dispatcher becomes ``allgather`` (the alltoall one creates a
  ``torch.cuda.Stream`` in its constructor; same routing). GPU: the values the model sets.
- ``tensor_parallel.random``: ``CudaRNGStatesTracker`` is a subclass that forks the CPU generator
  (megatron's forks the CUDA one, ``model_parallel_cuda_manual_seed`` builds it), and
  ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (activation recomputation) do nothing.
- ``transformer/torch_norm.WrappedTorchNorm`` (the local spec's norm) refuses sequence
  parallelism (Qwen3-VL MoE at TP > 1): under it the norm is built without and its parameters
  are marked ``sequence_parallel``, as TE's norm marks them (their gradients summed over TP).
  GPU: TE's norm.

Not here: the Mamba and Gated DeltaNet kernels. Their plain-torch versions are the reference and
fallback kernels of every device (models/kernels/: ``models.kernels`` checks the fast ones on the
run's device and binds what runs; on a CPU that is always torch), as are megatron's Mamba mixer
globals and the hybrid stack's final norm without TransformerEngine
(models/kernels/megatron_mamba.py).

Named device decisions for the run code (each the GPU value with CUDA): ``distributed_backend``,
``compute_device``, ``cuda_rng_state`` / ``set_cuda_rng_state``, ``peak_memory_gb``,
``bf16_by_default``, ``ep_needs_fixed_length`` and ``use_cp_attention`` (megatron's local
attention refuses context parallelism: on CPU the all-gather attention of
``models/cpu/attention.py`` replaces it in a built model).

Written against megatron-core 0.16.1 and 0.19.x (attribute differences are guarded).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import resource
import sys
import types

import torch

_ACTIVE = False
_FACTORIES = ("zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like",
              "ones_like", "full_like", "randn", "rand", "randint", "tensor")

#: megatron modules that import triton unconditionally -> constants they must still export.
#: 0.19.x: the MoE paged-stash kernels; 0.16.1: the dynamic-inference tensor ops that
#: ``ssm/mamba_mixer.py`` imports at module level (used only by dynamic batching)
_TRITON_MODULES = {
    "megatron.core.transformer.moe.ops.paged_stash": {"GLOBAL_BLOCK_SIZE": 1024},
    "megatron.core.inference.contexts.attention_context.triton.tensor_ops": {},
}


# ------------------------------------------------------------------ activation
def activate() -> bool:
    """Apply the CPU accommodations once (idempotent); a no-op when CUDA is available.

    Call before building a megatron model (best before importing megatron.core: 0.19.x needs
    the triton stand-ins at import). Returns True when the accommodations are active.
    """
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    if _ACTIVE:
        return True
    _stub_triton_kernel_modules()
    _show_megatron_cpu_torch()
    _patch_megatron()
    _ACTIVE = True
    return True


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


# ------------------------------------------------------------------ torch as megatron sees it
class _NullStream:
    def wait_stream(self, *_args):
        pass

    def synchronize(self):
        pass

    def record_event(self, *_args):
        return None


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapped(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapped


def _view(module: types.ModuleType, overrides: dict) -> types.ModuleType:
    """A module with ``module``'s names (later-loaded ones looked up on it) and ``overrides``."""
    view = types.ModuleType(module.__name__)
    view.__dict__.update(module.__dict__)
    view.__dict__.update(overrides)
    view.__getattr__ = lambda name: getattr(module, name)
    return view


@functools.cache
def _cpu_torch_view() -> types.ModuleType:
    """torch for megatron's modules on CPU (see the module docstring)."""
    cuda = _view(torch.cuda, {
        "current_device": lambda: "cpu",
        "synchronize": lambda *_args, **_kwargs: None,
        "empty_cache": lambda *_args, **_kwargs: None,
        "current_stream": lambda *_args, **_kwargs: _NullStream()})
    return _view(torch, {"cuda": cuda, **{name: _on_cpu(getattr(torch, name))
                                          for name in _FACTORIES}})


def _use_cpu_torch(module: types.ModuleType) -> None:
    for name, value in list(vars(module).items()):
        if value is torch:
            setattr(module, name, _cpu_torch_view())


class _MegatronLoader(importlib.abc.Loader):
    """Loads a megatron.core module as usual, then gives it the CPU view of torch."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _use_cpu_torch(module)
        if module.__name__ == "megatron.core.jit":  # before any fusion is decorated with it
            module.disable_jit_fuser()


class _MegatronFinder(importlib.abc.MetaPathFinder):
    """Import hook: every ``megatron.core`` module loaded from now on sees the CPU torch view."""

    def find_spec(self, name, path, target=None):
        if not name.startswith("megatron.core"):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _MegatronLoader(spec.loader)
                return spec
        return None


def _show_megatron_cpu_torch() -> None:
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and module is not None:
            _use_cpu_torch(module)
    sys.meta_path.insert(0, _MegatronFinder())


# ------------------------------------------------------------------ megatron patches
def _patch_megatron() -> None:
    from megatron.core import model_parallel_config
    from megatron.core.models.common.embeddings import (
        rope_utils,
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )
    from megatron.core.models.common.language_module import language_module
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    post_init = model_parallel_config.ModelParallelConfig.__post_init__

    @functools.wraps(post_init)
    def cpu_post_init(self):
        self.use_cpu_initialization = True
        if getattr(self, "moe_token_dispatcher_type", None) == "alltoall":
            self.moe_token_dispatcher_type = "allgather"
        post_init(self)

    model_parallel_config.ModelParallelConfig.__post_init__ = cpu_post_init
    for optimizer_class in (distrib_optimizer.DistributedOptimizer,
                            optimizer.Float16OptimizerWithFloat16Params):
        optimizer_class.__init__ = _with_tensor_methods(optimizer_class.__init__,
                                                        type=_cuda_type_name)
    for name in ("clip_grad_by_total_norm_fp32", "count_zeros_fp32"):  # optimizer.py imports them
        checked = _with_tensor_methods(getattr(clip_grads, name), type=_cuda_type_name)
        setattr(clip_grads, name, checked)
        setattr(optimizer, name, checked)
    cp_share = _with_tensor_methods(rope_utils.get_pos_emb_on_this_cp_rank, cuda=_stay)
    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):  # by name
        module.get_pos_emb_on_this_cp_rank = cp_share
    lm_class = language_module.LanguageModule
    lm_class.setup_embeddings_and_output_layer = _with_tensor_methods(
        lm_class.setup_embeddings_and_output_layer, cuda=_stay)
    _use_cpu_rng_tracker()
    _torch_norms_under_sequence_parallelism()


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
                    "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


_TENSOR_TYPE = torch.Tensor.type


def _cuda_type_name(tensor, *args, **kwargs):
    """``Tensor.type`` naming CPU float tensors as the CUDA ones."""
    name = _TENSOR_TYPE(tensor, *args, **kwargs)
    return name if args or kwargs else _CUDA_TYPE_NAMES.get(name, name)


def _torch_norms_under_sequence_parallelism() -> None:
    """``WrappedTorchNorm`` (the local spec's norm) asserts ``not config.sequence_parallel``;
    TE's norm takes it. Under sequence parallelism it is built as without, its parameters
    marked ``sequence_parallel`` as TE marks them (``finalize_model_grads`` then sums their
    gradients, each rank's from its sequence share, over TP)."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build = WrappedTorchNorm.__new__

    def cpu_new(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = build(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = staticmethod(functools.wraps(build)(cpu_new))


def _stay(tensor, *_args, **_kwargs):
    """``Tensor.cuda`` keeping the tensor where it is (on the CPU)."""
    return tensor


def _with_tensor_methods(function, **methods):
    """``function`` during which ``torch.Tensor`` has ``methods`` (restored afterwards)."""

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        originals = {name: getattr(torch.Tensor, name) for name in methods}
        for name, method in methods.items():
            setattr(torch.Tensor, name, method)
        try:
            return function(*args, **kwargs)
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)

    return wrapped


def _use_cpu_rng_tracker() -> None:
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

    mrandom.CudaRNGStatesTracker = CPURNGStatesTracker
    mrandom._get_cuda_rng_state = lambda *_args, **_kwargs: None
    mrandom._set_cuda_rng_state = lambda *_args, **_kwargs: None


# ------------------------------------------------------------------ named device decisions
def distributed_backend() -> str:
    """torch.distributed backend: nccl with CUDA, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def compute_device():
    """Where this process's model and collectives live: the current CUDA device, or the CPU."""
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def cuda_rng_state():
    """The CUDA generator's state (saved with a checkpoint); None on CPU."""
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def set_cuda_rng_state(state) -> None:
    """Restore a saved CUDA generator state (nothing to restore on CPU, or when none was saved)."""
    if state is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state)


def peak_memory_gb() -> float:
    """Peak CUDA memory allocated by this process; on CPU its peak resident set size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


def bf16_by_default() -> bool:
    """``train.precision=auto``: bf16 with CUDA, fp32 on CPU."""
    return torch.cuda.is_available()


def ep_needs_fixed_length() -> bool:
    """Expert parallelism needs equal token counts per rank on CPU, where MoE layers use the
    allgather dispatcher (``activate``); with CUDA the alltoall one takes any counts."""
    return not torch.cuda.is_available()


def use_cp_attention(language_model) -> None:
    """On CPU under context parallelism, give every attention layer of a built megatron LM the
    all-gather CP attention (models/cpu/attention.py); otherwise nothing."""
    from megatron.core import parallel_state

    if torch.cuda.is_available() or parallel_state.get_context_parallel_world_size() == 1:
        return
    from models.cpu.attention import use_cp_attention as swap

    swap(language_model)
