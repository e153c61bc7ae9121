"""The start-up checks: a fast kernel against the plain-torch reference on the run's own device and
dtype, same inputs (a small packed row with segment restarts), forward AND backward.

Every check returns ``{what: relative difference}``: each output and the gradient of each input
under one fixed random cotangent, as max |fast - torch| / max |torch| (the worst element against
the largest reference value; NaN or a missing gradient is ``inf``). ``models.kernels`` accepts a
kernel when every difference is within ``TOLERANCE`` of the dtype. The inputs are small (a row of
229 tokens in 3 segments that end inside and across the kernels' chunks, realistic head widths),
so a check costs milliseconds once its kernels are compiled; a kernel that lets a segment leak
into the next, drops a term or gets a gradient wrong is off by far more than the tolerance.

Attention and experts checks build megatron modules (TransformerEngine's core attention and
grouped experts): they need megatron's parallel state (``models.parallel.init_parallel``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

#: accepted relative difference per dtype: float32 allows TF32 matmuls inside the Triton kernels,
#: bf16 / fp16 one rounding of the outputs and the gradients' accumulation order
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
#: the check row: 229 tokens in segments of 37, 63 and 129 (segment ends inside chunks of 64)
SEGMENTS = (37, 63, 129)


def relative(fast: torch.Tensor | None, torch_out: torch.Tensor | None) -> float:
    """max |fast - torch| / max |torch| (``inf`` for NaN, a missing value or other shapes)."""
    if fast is None or torch_out is None or fast.shape != torch_out.shape:
        return float("inf")
    fast, torch_out = fast.detach().float(), torch_out.detach().float()
    diff = (fast - torch_out).abs().max()
    scale = torch_out.abs().max().clamp_min(1e-12)
    value = float(diff / scale)
    return value if value == value else float("inf")


def agreement(fast: Callable, reference: Callable, inputs: dict, grads: tuple[str, ...],
              label: str = "") -> dict[str, float]:
    """``fast(**inputs)`` against ``reference(**inputs)`` (each on its own copy of the inputs):
    every tensor output, and the gradient of every input named in ``grads`` under one fixed
    random cotangent per output."""
    runs = []
    for fn in (fast, reference):
        copies = {name: (value.detach().clone().requires_grad_(name in grads)
                         if torch.is_tensor(value) else value) for name, value in inputs.items()}
        out = fn(**copies)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if torch.is_tensor(o)]
        runs.append((outs, copies))
    if len(runs[0][0]) != len(runs[1][0]):
        raise ValueError(f"{len(runs[0][0])} outputs where torch gives {len(runs[1][0])}")
    gen = torch.Generator().manual_seed(7)
    cotangents = [torch.randn(o.shape, generator=gen).to(o.device) for o in runs[1][0]]
    if grads:
        for outs, _ in runs:
            terms = [(o.float() * w).sum() for o, w in zip(outs, cotangents) if o.requires_grad]
            if terms:
                torch.stack(terms).sum().backward()
    errors = {f"{label}out{i}": relative(a, b)
              for i, (a, b) in enumerate(zip(runs[0][0], runs[1][0]))}
    errors.update({f"{label}grad_{name}": relative(runs[0][1][name].grad, runs[1][1][name].grad)
                   for name in grads})
    return errors


def _randn(gen: torch.Generator, *shape, device, dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _seq_idx(device) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(SEGMENTS)),
                                   torch.tensor(SEGMENTS))[None].to(device, torch.int32)


def _cu_seqlens(device) -> torch.Tensor:
    return F.pad(torch.tensor(SEGMENTS).cumsum(0), (1, 0)).to(device)


# ------------------------------------------------------------------ conv
def check_conv(fast, reference, device, dtype) -> dict[str, float]:
    """A conv (``fn`` / ``update`` with causal-conv1d's contract) against torch's: a packed row
    (x channels-last, as both layers lay it), with bias, SiLU; then one decode update."""
    gen = torch.Generator().manual_seed(3)
    channels, width, length = 256, 4, sum(SEGMENTS)
    x = _randn(gen, 1, length, channels, device=device, dtype=dtype).transpose(1, 2)
    inputs = {"x": x, "weight": _randn(gen, channels, width, device=device, dtype=dtype),
              "bias": _randn(gen, channels, device=device, dtype=dtype),
              "seq_idx": _seq_idx(device), "activation": "silu"}
    errors = agreement(fast.fn, reference.fn, inputs, ("x", "weight", "bias"))
    state = _randn(gen, 3, channels, width - 1, device=device, dtype=dtype)
    token = _randn(gen, 3, channels, device=device, dtype=dtype)
    states, steps = [], []
    for impl in (fast, reference):
        own = state.clone()
        steps.append(impl.update(token, own, inputs["weight"], inputs["bias"], "silu"))
        states.append(own)
    errors["update_out"] = relative(steps[0], steps[1])
    errors["update_state"] = relative(states[0], states[1])
    return errors


# ------------------------------------------------------------------ mamba
def check_mamba(fast, reference, device, dtype) -> dict[str, float]:
    """The Mamba training kernel (``combined``: conv + chunked scan as megatron's
    ``_ssm_training`` calls it) and the gated norm (``norm``) against torch's. The time steps are
    Mamba2's (dt of 0.001 - 0.1, as megatron initialises ``dt_bias``): a state lives for tens of
    tokens, so one that leaks into the next segment is far off."""
    gen = torch.Generator().manual_seed(4)
    heads, headdim, groups, state, width, chunk = 4, 64, 2, 64, 4, 64
    dim, length = heads * headdim, sum(SEGMENTS)
    conv_dim = dim + 2 * groups * state
    zxbc = torch.randn(1, length, 2 * dim + 2 * groups * state, generator=gen)
    dt = torch.exp(torch.empty(heads).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
    inputs = {
        "zxbcdt": torch.cat([zxbc, 0.1 * torch.randn(1, length, heads, generator=gen)],
                            -1).to(device=device, dtype=dtype),
        "conv1d_weight": _randn(gen, conv_dim, width, device=device, dtype=dtype, scale=0.5),
        "conv1d_bias": _randn(gen, conv_dim, device=device, dtype=dtype, scale=0.1),
        "dt_bias": (dt + torch.log(-torch.expm1(-dt))).to(device),  # softplus^-1(dt)
        "A": -torch.empty(heads).uniform_(1, 16, generator=gen).to(device),
        "D": _randn(gen, heads, device=device, dtype=torch.float32),
        "chunk_size": chunk, "activation": "silu", "headdim": headdim, "ngroups": groups,
        "norm_before_gate": False, "seq_idx": _seq_idx(device)}
    errors = agreement(fast.combined, reference.combined, inputs,
                       ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D"))

    layers = []
    weight = 1 + _randn(gen, dim, device=device, dtype=dtype, scale=0.1)
    for kind in (fast.norm, reference.norm):
        layer = kind(dim, eps=1e-5, group_size=dim // groups, norm_before_gate=False,
                     device=device, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(weight)
        layers.append(layer)
    norm_inputs = {"x": _randn(gen, length, dim, device=device, dtype=dtype),
                   "z": _randn(gen, length, dim, device=device, dtype=dtype)}
    errors.update(agreement(layers[0], layers[1], norm_inputs, ("x", "z"), label="norm_"))
    errors["norm_grad_weight"] = relative(layers[0].weight.grad, layers[1].weight.grad)
    return errors


# ------------------------------------------------------------------ gated delta rule
def check_deltanet(fast, reference, device, dtype) -> dict[str, float]:
    """fla's ``chunk`` rule (packed row, l2-normalised q / k, final states) and its ``recurrent``
    decode step against torch's; q, k, v, beta in ``dtype``, g in float32 (as the layer)."""
    gen = torch.Generator().manual_seed(5)
    heads, dim, length = 4, 128, sum(SEGMENTS)
    inputs = {name: _randn(gen, 1, length, heads, dim, device=device, dtype=dtype)
              for name in ("q", "k", "v")}
    inputs["g"] = F.logsigmoid(torch.randn(1, length, heads, generator=gen) + 3).to(device)
    inputs["beta"] = torch.rand(1, length, heads, generator=gen).to(device=device, dtype=dtype)
    inputs.update(output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=_cu_seqlens(device).long())
    errors = agreement(fast.chunk, reference.chunk, inputs, ("q", "k", "v", "g", "beta"))
    _, states = reference.chunk(**inputs)
    step = {name: _randn(gen, 3, 1, heads, dim, device=device, dtype=dtype)
            for name in ("q", "k", "v")}
    step.update(g=-torch.rand(3, 1, heads, generator=gen).to(device),
                beta=torch.rand(3, 1, heads, generator=gen).to(device=device, dtype=dtype),
                initial_state=states.detach(), output_final_state=True,
                use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        errors.update(agreement(fast.recurrent, reference.recurrent, step, (), label="decode_"))
    return errors


# ------------------------------------------------------------------ attention
def check_segments(fast, reference, device, dtype) -> dict[str, float]:
    """Segment attention (``fn(q, k, v, cu_seqlens, scale, causal)``) against torch SDPA's:
    causal with grouped-query heads (the LM) and non-causal (the towers), forward + backward."""
    gen = torch.Generator().manual_seed(6)
    length, heads, groups, dim = sum(SEGMENTS), 8, 2, 128
    errors = {}
    for causal, kv in ((True, groups), (False, heads)):
        inputs = {"q": _randn(gen, length, heads, dim, device=device, dtype=dtype),
                  "k": _randn(gen, length, kv, dim, device=device, dtype=dtype),
                  "v": _randn(gen, length, kv, dim, device=device, dtype=dtype),
                  "cu_seqlens": _cu_seqlens(device).to(torch.int32), "scale": dim ** -0.5,
                  "causal": causal}
        errors.update(agreement(fast, reference, inputs, ("q", "k", "v"),
                                label="causal_" if causal else "full_"))
    return errors


def check_te_attention(device, dtype) -> dict[str, float]:
    """megatron's ``TEDotProductAttention`` (the TE spec's core attention) on a packed THD row,
    causal, grouped-query heads, against torch SDPA per segment."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from models.kernels.attention import sdpa_segments

    core_attention, config = _te_module("attention", dtype)
    heads, groups, dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
    cu = _cu_seqlens(device).to(torch.int32)
    longest = max(SEGMENTS)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    gen = torch.Generator().manual_seed(8)
    length = sum(SEGMENTS)
    inputs = {"query": _randn(gen, length, heads, dim, device=device, dtype=dtype),
              "key": _randn(gen, length, groups, dim, device=device, dtype=dtype),
              "value": _randn(gen, length, groups, dim, device=device, dtype=dtype)}

    def te(query, key, value):
        out = core_attention(query, key, value, None, attn_mask_type=AttnMaskType.causal,
                             packed_seq_params=params)
        return out.reshape(length, heads, dim)

    def torch_segments(query, key, value):
        return sdpa_segments(query, key, value, cu, dim ** -0.5, causal=True)

    return agreement(te, torch_segments, inputs, ("query", "key", "value"))


# ------------------------------------------------------------------ experts
def check_grouped_experts(device, dtype) -> dict[str, float]:
    """TransformerEngine's grouped-GEMM experts (``TEGroupedMLP``) against megatron's sequential
    torch experts on the same weights: tokens already permuted per expert (one expert gets
    none), router probabilities, SwiGLU; the output and the gradients of the tokens, the
    probabilities and both experts' weights."""
    grouped, config = _te_module("experts", dtype)
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    sequential = SequentialMLP(
        config.num_moe_experts, config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                      linear_fc2=RowParallelLinear),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups()).to(device)
    with torch.no_grad():
        for i, expert in enumerate(sequential.local_experts):
            getattr(grouped.linear_fc1, f"weight{i}").copy_(expert.linear_fc1.weight)
            getattr(grouped.linear_fc2, f"weight{i}").copy_(expert.linear_fc2.weight)
    counts = torch.tensor([5, 0, 7, 4])
    gen = torch.Generator().manual_seed(9)
    inputs = {"hidden": _randn(gen, int(counts.sum()), config.hidden_size, device=device,
                               dtype=dtype),
              "probs": torch.rand(int(counts.sum()), generator=gen).to(device)}

    errors = agreement(lambda hidden, probs: grouped(hidden, counts, probs)[0],
                       lambda hidden, probs: sequential(hidden, counts, probs)[0], inputs,
                       ("hidden", "probs"))
    for i, expert in enumerate(sequential.local_experts):
        for name in ("linear_fc1", "linear_fc2") if counts[i] else ():  # experts with tokens
            errors[f"grad_{name}_{i}"] = relative(
                getattr(getattr(grouped, name), f"weight{i}").grad,
                getattr(expert, name).weight.grad)
    return errors


def _te_module(kind: str, dtype):
    """A small TransformerConfig and the TE module the check runs (built on the current CUDA
    device; megatron's parallel state must exist)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2,
        kv_channels=128, ffn_hidden_size=256, moe_ffn_hidden_size=256, num_moe_experts=4,
        moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_activation_fusion=False, attention_dropout=0.0,
        hidden_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, moe_grouped_gemm=kind == "experts")
    if kind == "attention":
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
        from megatron.core.transformer.enums import AttnMaskType

        return TEDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self"), config
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelGroupedLinear,
        TERowParallelGroupedLinear,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    return TEGroupedMLP(config.num_moe_experts, config, MLPSubmodules(
        linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups()), config
