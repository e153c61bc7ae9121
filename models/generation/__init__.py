"""Greedy generation of every family (``generate``: the megatron prefill, then the lean decode
step of ``decode_step`` with its per-layer builders in ``decode_layers``; a layer with a state of
its own plugs in its step, as the Gated DeltaNet does from ``models.layers``). It takes a built
model: checkpoints and HF folders are its callers' business."""
