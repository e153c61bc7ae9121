"""The multi-token-prediction (MTP) head (``model.train_mtp``): one MTP depth that predicts token
i+2 from the main model's state at i and the embedding of token i+1; every family whose
checkpoints carry one builds it from its own layer specs (Qwen3.5 / 3.6 / 3.8: one gated
full-attention layer; Nemotron-H / Nemotron 3.5 Super VL: the block of ``mtp_layers_block_type``,
attention then LatentMoE by default).

This module owns the head (``MTPHead``), the capture of what it reads from the main forward
(``capture_decoder``) and its token losses and logits through the LM's shared output layer
(``with_head_loss``, ``with_head_logits``). The published architecture (DeepSeek-V3's MTP module, as
Megatron's ``MultiTokenPredictionLayer`` and vLLM's ``qwen3_5_mtp`` / ``nemotron_h_mtp`` run it),
at position i:

    e = norm_e(embedding of token i+1)      (the LM's input embedding: a visual token's is its
                                             vision embedding; zeros past the end)
    h = norm_h(the decoder's output at i)   (after the final norm: what the output layer reads;
                                             vLLM hands the MTP the target model's normed output,
                                             megatron the block's output, final norm included)
    x = proj(cat[e, h])                      (embedding first: ``proj`` is H x 2H)
    x = the inner layers (pre-norm residual layers of the family) (x)
    logits = the shared output layer (final_norm(x))

Qwen names the four ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc``, ``norm``;
Nemotron-H ``enorm``, ``hnorm``, ``eh_proj`` (on the first inner layer), ``final_layernorm``
(on the last). Our keys are Qwen's (the families' HF tables map their names onto them); the inner
layers are megatron layers under ``layers.{j}.``. The layers run with the main decoder's rotary
table (positions of i, as megatron's MTP) and packed-sequence parameters. Under TP the head runs
as the decoder does (megatron's sequence parallelism where the decoder runs it: each rank its
share of the tokens; ``fc`` and the norms replicated, their gradients summed over TP), under EP
its experts are split over the ranks as the decoder's; PP and CP > 1 are refused by the families
(``layout_problems``).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module


class MTPHead(MegatronModule):
    """The MTP head (module docstring) with the inner layers of ``layer_specs`` (megatron layer
    specs, numbered after the decoder's ``num_layers`` as megatron numbers its MTP layers) and
    ``norm`` (the family's norm class) for its four norms."""

    def __init__(self, config, layer_specs: list, norm, num_layers: int):
        super().__init__(config=config)
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.pre_fc_norm_embedding = build_module(norm, config=config, hidden_size=h, eps=eps)
        self.pre_fc_norm_hidden = build_module(norm, config=config, hidden_size=h, eps=eps)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)  # replicated over TP
        config.init_method(self.fc.weight)
        if config.sequence_parallel:  # each TP rank its share of the tokens: gradients summed
            self.fc.weight.sequence_parallel = True
        self.layers = torch.nn.ModuleList(
            [build_module(spec, config=config, layer_number=num_layers + 1 + j)
             for j, spec in enumerate(layer_specs)])
        for layer in self.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:  # its aux loss applies; the per-layer tables know no such layer
                router.layer_number = None
        self.norm = build_module(norm, config=config, hidden_size=h, eps=eps)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The layers' TP / expert shards, the rest replicated over TP (megatron's default
        would take the ``ModuleList`` for replicated tensors)."""
        from models.layers.vision_layers import tower_sharded_state_dict

        return tower_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def forward(self, embeddings, hidden, rotary_pos_emb=None, packed_seq_params=None):
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
        for layer in self.layers:
            x, _ = layer(x, attention_mask=None, rotary_pos_emb=rotary_pos_emb,
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


def head_logits(language_model, head: MTPHead, seen: dict) -> torch.Tensor:
    """The head's logits (S, B, V/TP) through the LM's output layer (its tied embedding where
    it shares one), from what ``capture_decoder`` saw."""
    x = head(seen["embeddings"], seen["hidden"], seen["rotary_pos_emb"],
             seen["packed_seq_params"])
    weight = (language_model.shared_embedding_or_output_weight()
              if language_model.share_embeddings_and_output_weights else None)
    return language_model.output_layer(x, weight=weight)[0]


def with_head_loss(language_model, head: MTPHead, run, labels: torch.Tensor,
                   loss_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None):
    """A training forward with the head: ``run()`` (the main LM's forward, -> (per-token loss,
    mask)) while the decoder is watched, then (loss, mask, the head's per-token loss (B, L)
    times its mask: the label two ahead in the same packed sample,
    ``models.multimodal.mtp_targets``)."""
    from models.multimodal import mtp_targets

    with capture_decoder(language_model.decoder) as seen:
        loss, mask = run()
    batch, length = labels.shape
    target, mtp_mask = mtp_targets(labels, loss_mask, cu_seqlens)
    logits = head_logits(language_model, head, seen)
    mtp_loss = language_model.compute_language_model_loss(
        target.reshape(logits.shape[1], -1), logits)
    return loss, mask, mtp_loss.reshape(batch, length) * mtp_mask


def with_head_logits(language_model, head: MTPHead, run):
    """``run()`` (the main LM's forward without labels: logits (B, L, V)) and the head's logits
    (B, L, V) on the same input: position i of the second predicts token i+2 (parity checks)."""
    with capture_decoder(language_model.decoder) as seen:
        logits = run()
    return logits, head_logits(language_model, head, seen).transpose(0, 1)
