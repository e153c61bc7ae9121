"""The chosen Mamba kernels bound into megatron-core's Mamba mixer (any device).

megatron's ``ssm/mamba_mixer.py`` takes its kernels from module globals it fills at import from
``mamba_ssm`` / ``causal_conv1d`` (without mamba_ssm ``HAVE_MAMBA_SSM`` is false and the mixer
refuses to build). ``bind`` sets them from ``models.kernels``' choice, so the mixer builds and
trains with mamba_ssm's kernels, a Triton-only mamba_ssm after another conv, or the torch ones:

- ``mamba_split_conv1d_scan_combined`` (training / eval), ``mamba_chunk_scan_combined``
  (inference prefill), ``RMSNormGated`` and ``ExtendedRMSNorm`` (the gated norm, with megatron's
  sharded state dict: the weight split on dim 0 over tensor parallel, as in 0.16.1 and >= 0.17);
- ``causal_conv1d_fn`` / ``causal_conv1d_update`` (prefill / decode conv) and
  ``selective_state_update`` (decode): causal-conv1d's and mamba_ssm's where those run, else None
  (megatron's own torch prefill conv and decode step);
- ``_check_mamba_sequence_packing_support``: packed training supported (every conv and scan here
  restarts at each ``seq_idx`` change); packed inference (dynamic batching) only with megatron's
  own check over causal-conv1d + mamba_ssm;
- the hybrid stack's final norm: megatron builds it with TE's ``TENorm`` whatever the spec says;
  without TransformerEngine it is megatron's ``WrappedTorchNorm`` (same parameter name).

Written against megatron-core 0.16.1 and 0.19.x (attribute differences are guarded).
"""

from __future__ import annotations

_ORIGINAL_PACKING_CHECK = []


def bind(impl, conv) -> None:
    """Put the chosen Mamba kernels (``impl``: candidates' namespace ``combined``, ``chunk_scan``,
    ``norm``, ``state_update``) and conv (``conv``: the conv ``Choice``) into megatron's mixer."""
    from megatron.core.ssm import mamba_mixer

    if not _ORIGINAL_PACKING_CHECK:
        _ORIGINAL_PACKING_CHECK.append(mamba_mixer._check_mamba_sequence_packing_support)
    native = conv.name == "causal_conv1d" and impl.state_update is not None
    original = _ORIGINAL_PACKING_CHECK[0]

    def packing_support(for_inference_not_training: bool = True):
        if not for_inference_not_training:
            return True, None
        if native:
            return original(for_inference_not_training)
        return False, ("packed Mamba inference (dynamic batching) needs mamba_ssm with "
                       "causal-conv1d (models.kernels chose other kernels)")

    mamba_mixer.RMSNormGated = impl.norm
    mamba_mixer.ExtendedRMSNorm = _sharded_gated_norm(impl.norm)
    mamba_mixer.mamba_chunk_scan_combined = impl.chunk_scan
    mamba_mixer.mamba_split_conv1d_scan_combined = impl.combined
    mamba_mixer._check_mamba_sequence_packing_support = packing_support
    mamba_mixer.selective_state_update = impl.state_update
    mamba_mixer.causal_conv1d_fn = conv.impl.fn if conv.name == "causal_conv1d" else None
    mamba_mixer.causal_conv1d_update = conv.impl.update if conv.name == "causal_conv1d" else None
    mamba_mixer.HAVE_MAMBA_SSM = True
    final_norm_without_te()


def final_norm_without_te() -> None:
    """The hybrid stack's final norm as megatron's torch norm where TransformerEngine is not
    installed (megatron builds it with ``TENorm`` whatever the spec says): called by ``bind`` and
    by every hybrid model before its stack is built, Mamba layers or not."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.ssm import mamba_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if getattr(te_ext, "HAVE_TE", False):
        return
    mamba_block.TENorm = WrappedTorchNorm
    try:  # >= 0.19: the stack lives in models/hybrid (mamba_block re-exports it)
        from megatron.core.models.hybrid import hybrid_block
    except ImportError:
        return
    hybrid_block.TENorm = WrappedTorchNorm


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
