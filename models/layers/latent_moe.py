"""LatentMoE without TransformerEngine: megatron's ``MoELayer`` with its latent projections as
plain megatron-style linears.

This module owns ``LatentMoELayer`` and its ``ReplicatedLinear``. LatentMoE (Nemotron 3 Super,
transformers' NemotronH ``moe_latent_size``): the router and the shared expert read the hidden
state; the routed experts run on a narrower latent width, ``fc1_latent_proj`` (hidden -> latent)
before the dispatch and ``fc2_latent_proj`` (latent -> hidden) after the combine, then the
shared expert's output is added. megatron-core 0.16.1's ``MoELayer`` builds the two projections
as TransformerEngine ``TELinear(parallel_mode="duplicated")`` and asserts that TE is installed;
its experts (``SequentialMLP``, TE's grouped MLP) already take the latent width. The layer here
is megatron's in every step (route, dispatch, experts, combine, the projections at the places
megatron calls them); only the two projections are built without TE, as megatron shards them:
the whole weight on every tensor-parallel rank (not split), its gradient summed over TP under
sequence parallelism (``sequence_parallel`` on the parameter, as TE's duplicated linear marks
it), no expert attribute (reduced over data parallel like every dense weight), saved replicated
(megatron's default sharded state dict of a module without TP attributes). State-dict names are
megatron's (``mlp.fc1_latent_proj.weight`` / ``fc2_latent_proj.weight``), so a checkpoint moves
between this layer and TE's. Used by the local (non-TE) layer specs, on every device; the TE
specs keep megatron's ``MoELayer``.

megatron's ``TransformerLayer`` hands its process groups to the MLP classes it knows by identity
(``MoELayer``, not a subclass) and logs "Unknown MLP type" for any other; the layer here then
takes megatron's default groups (those of ``parallel_state``, the ones the model is built on),
and that one log line is dropped (``_QuietUnknownMLP``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import build_module


class _QuietUnknownMLP(logging.Filter):
    """Drops megatron's "Unknown MLP type" line (see module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unknown MLP type")


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_QuietUnknownMLP())


class ReplicatedLinear(MegatronModule):
    """y = x W^T (+ b): one whole weight per tensor-parallel rank (TE's ``duplicated`` mode);
    returns ``(output, None)`` like megatron's linears (the bias, if any, is added)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method,
                 bias: bool = False):
        super().__init__(config=config)
        # placed as megatron's linears place theirs: the default device (a meta-device build
        # stays on it) under CPU initialisation, else the current CUDA device
        where = ({} if config.use_cpu_initialization
                 else {"device": torch.cuda.current_device()})
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, **where,
                                                     dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)  # the default generator: the same on every TP rank
        self.bias = (torch.nn.Parameter(torch.zeros(output_size, **where,
                                                    dtype=config.params_dtype))
                     if bias else None)
        for param in (self.weight, self.bias):
            if param is not None:  # summed over TP when each rank holds other tokens
                param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.weight, self.bias), None


class LatentMoELayer(MoELayer):
    """megatron's ``MoELayer`` whose latent projections are ``ReplicatedLinear``s (see module
    docstring); without ``moe_latent_size`` it is megatron's layer unchanged."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        latent = config.moe_latent_size
        if not latent:
            super().__init__(config, submodules, layer_number, pg_collection)
            return
        # megatron's constructor without the latent size (its TE projections) and without
        # experts; then the experts at the latent width and the projections, under the config
        without = copy.copy(config)
        without.moe_latent_size = None
        super().__init__(without, dataclasses.replace(submodules, experts=IdentityOp),
                         layer_number, pg_collection)
        self.config = config
        self.experts = build_module(submodules.experts, self.num_local_experts, config,
                                    pg_collection=self._pg_collection(pg_collection))
        self.fc1_latent_proj = ReplicatedLinear(config.hidden_size, latent, config=config,
                                                init_method=config.init_method,
                                                bias=config.add_bias_linear)
        self.fc2_latent_proj = ReplicatedLinear(latent, config.hidden_size, config=config,
                                                init_method=config.output_layer_init_method,
                                                bias=config.add_bias_linear)

    @staticmethod
    def _pg_collection(pg_collection):
        """The process groups megatron's constructor used (its default when none was given)."""
        if pg_collection is not None:
            return pg_collection
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        return get_default_pg_collection()
