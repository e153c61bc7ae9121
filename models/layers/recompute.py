"""Activation recomputation (the ``recompute`` field of a model config): what is kept for backward.

Vision-heavy samples (tens of images, long videos, 10k+ token sequences) make activations the
largest share of training memory. Three modes, for the vision tower and the language model alike:

- ``none``: every layer keeps its activations (fastest);
- ``selective``: megatron recomputes the core attention in backward (its score / probability
  tensors, quadratic in the segment length, are not kept): ``recompute_granularity="selective"``;
- ``full``: only each layer's input is kept and the whole layer is recomputed in backward
  (megatron's ``recompute_granularity="full"``, uniform, one layer per checkpoint, in the
  language model's ``TransformerBlock``; ``run_layer`` in the vision towers, which call their
  layers themselves). megatron's ``MambaStack`` (Nemotron-Omni's hybrid LM) has no full
  recomputation, and Qwen3-VL's LM adds its DeepStack features through forward hooks that a
  rerun in backward would not repeat: those two LMs recompute the core attention under ``full``
  (``selective``); their vision towers are fully recomputed.

Gradients are the same in every mode (recomputation reruns the same forward; tested).
"""

from __future__ import annotations

RECOMPUTE_MODES = ("none", "selective", "full")


def check_mode(mode: str) -> None:
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")


def transformer_config_kwargs(mode: str, *, block_recompute: bool = True) -> dict:
    """megatron ``TransformerConfig`` fields of ``mode``; ``block_recompute=False`` for stacks
    without full-layer recomputation (they get ``selective`` for ``full``)."""
    check_mode(mode)
    if mode == "none":
        return {}
    if mode == "full" and block_recompute:
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}
    return {"recompute_granularity": "selective"}


def run_layer(layer, hidden, mode: str, **kwargs):
    """One megatron TransformerLayer of a vision tower on ``hidden``; under ``full`` (while
    gradients are recorded) through megatron's checkpoint, keeping only ``hidden``."""
    def forward(h):
        out = layer(h, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    import torch

    if mode == "full" and torch.is_grad_enabled() and hidden.requires_grad:
        from megatron.core import tensor_parallel

        return tensor_parallel.checkpoint(forward, False, hidden)
    return forward(hidden)


def backward_footprint(model, batch: dict) -> tuple[int, float, dict]:
    """One training forward + backward of ``model`` on batch-contract ``batch`` (labels = its input
    ids) -> (bytes of the distinct tensors autograd kept for backward, CPU seconds, gradients).
    What the recompute modes are compared by (tests, bench/bench_recompute.py)."""
    import time

    import torch

    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    start = time.process_time()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, mask = model(**batch, labels=batch["input_ids"])
    (loss.sum() / mask.sum()).backward()
    seconds = time.process_time() - start
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return sum(kept.values()), seconds, grads
