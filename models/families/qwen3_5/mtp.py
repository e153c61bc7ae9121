"""The multi-token-prediction (MTP) head of Qwen3.5 / 3.6 / 3.8 (``model.train_mtp``): one extra
layer that predicts token i+2 from the main model's state at i and the embedding of token i+1.

This module owns the head (``Qwen35MTP``) and the capture of what it reads from the main forward
(``capture_decoder``). The published architecture (Qwen3-Next's, as vLLM's ``qwen3_5_mtp`` and
Megatron's ``MultiTokenPredictionLayer`` run it), at position i:

    e = pre_fc_norm_embedding(embedding of token i+1)   (the LM's input embedding: a visual
                                                          token's is its vision embedding)
    h = pre_fc_norm_hidden(the decoder's output at i)   (after the final norm: what the output
                                                          layer reads; vLLM hands the MTP the
                                                          target model's normed output, megatron
                                                          the block's output, final norm included)
    x = fc(cat[e, h])                                    (embedding first: ``fc`` is H x 2H)
    x = norm(one gated full-attention decoder layer of the family (x))
    logits = the shared output layer (x)

Every norm is zero-centred (stored w, applied 1 + w) like the rest of the model; the decoder
layer is built from the family's own full-attention layer spec (gated attention, dense MLP or
the MoE with its gated shared expert) and runs with the main decoder's rotary table (M-RoPE
positions of i, as megatron's MTP) and its packed-sequence parameters. Under TP it runs as the
decoder does (megatron's sequence parallelism with MoE layers: each rank its share of the
tokens; ``fc`` and the norms replicated, their gradients summed over TP), under EP its experts
are split over the ranks as the decoder's; PP and CP > 1 are refused (``layout_problems``).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module


class Qwen35MTP(MegatronModule):
    """The MTP head (module docstring); its keys are the HF ones under ``mtp.`` except the
    decoder layer's (megatron's names under ``layers.0.``)."""

    def __init__(self, config, layer_spec, norm, num_layers: int):
        super().__init__(config=config)
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.pre_fc_norm_embedding = build_module(norm, config=config, hidden_size=h, eps=eps)
        self.pre_fc_norm_hidden = build_module(norm, config=config, hidden_size=h, eps=eps)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)  # replicated over TP
        config.init_method(self.fc.weight)
        if config.sequence_parallel:  # each TP rank its share of the tokens: gradients summed
            self.fc.weight.sequence_parallel = True
        # numbered after the decoder's layers (megatron numbers its MTP layers the same way)
        self.layers = torch.nn.ModuleList(
            [build_module(layer_spec, config=config, layer_number=num_layers + 1)])
        router = getattr(self.layers[0].mlp, "router", None)
        if router is not None:  # its aux loss applies; the per-layer trackers know no such layer
            router.layer_number = None
        self.norm = build_module(norm, config=config, hidden_size=h, eps=eps)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The decoder layer's TP / expert shards, the rest replicated over TP (megatron's
        default would take the ``ModuleList`` for replicated tensors)."""
        from models.layers.vision_layers import tower_sharded_state_dict

        return tower_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def forward(self, embeddings, hidden, rotary_pos_emb, packed_seq_params=None):
        """``embeddings`` / ``hidden``: the decoder's input and output (S, B, H) (packed: one
        THD row, (B*L, 1, H)) -> the head's output (S, B, H) before the output layer; position
        i reads the embedding at i+1 (zeros past the end). Under sequence parallelism both are
        this TP rank's share: the embeddings are gathered for the shift and scattered again."""
        from megatron.core import tensor_parallel

        parallel = self.config.sequence_parallel
        if parallel:
            embeddings = tensor_parallel.gather_from_sequence_parallel_region(  # backward: split
                embeddings, tensor_parallel_output_grad=False)
        following = torch.zeros_like(embeddings)
        following[:-1] = embeddings[1:]
        if parallel:
            following = tensor_parallel.scatter_to_sequence_parallel_region(following)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(following),
                               self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, _ = self.layers[0](x, attention_mask=None, rotary_pos_emb=rotary_pos_emb,
                              packed_seq_params=packed_seq_params)
        return self.norm(x)


@contextlib.contextmanager
def capture_decoder(decoder):
    """While the main forward runs: a dict filled with the decoder's input (``embeddings``),
    output (``hidden``), rotary table and packed-sequence parameters, read by the head."""
    seen: dict = {}

    def hook(_module, args, kwargs, output):
        seen.update(embeddings=kwargs.get("hidden_states", args[0] if args else None),
                    hidden=output[0] if isinstance(output, tuple) else output,
                    rotary_pos_emb=kwargs.get("rotary_pos_emb"),
                    packed_seq_params=kwargs.get("packed_seq_params"))

    handle = decoder.register_forward_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()
