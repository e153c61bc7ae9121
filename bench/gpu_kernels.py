"""The ``kernels`` part of the GPU check (bench/gpu_check.py): every implementation of every
layer kind checked against the torch reference on this GPU, bf16 and fp32
(``models.kernels.survey``), then the chosen Mamba and Gated DeltaNet kernels against torch's,
forward + backward timed on one 16K-token row of 8 packed samples at the published layer shapes
(Nemotron-3 Nano's Mamba: 64 heads of 64, 8 groups, state 128, chunks of 128; Qwen3.5-9B's
DeltaNet: 32 value heads of 128), with each one's peak memory. ``smoke``: tiny shapes on CPU.
"""

from __future__ import annotations

import time
from functools import partial


def kernels_part(report, smoke: bool, guarded) -> None:
    """Every kernel's verdict in bf16 and fp32 (rows added to ``report``), then the chosen Mamba /
    DeltaNet kernels timed against torch's at training size (``guarded(part, label, work)``
    adds a row or its error)."""
    import torch

    from models import kernels
    from models.parallel import init_parallel

    init_parallel()
    for dtype in (torch.bfloat16, torch.float32):
        for row in kernels.survey(dtype=dtype):
            report.add("kernels", row)
    kernels.select(None, dtype=torch.float32 if smoke else torch.bfloat16)
    guarded("kernels", {"speed": "mamba"}, partial(kernel_speed, "mamba", smoke))
    guarded("kernels", {"speed": "deltanet"}, partial(kernel_speed, "deltanet", smoke))


def kernel_speed(kind: str, smoke: bool) -> dict:
    """The chosen kernel of ``kind`` and torch's: forward + backward seconds and peak memory on
    one packed row of 16K tokens (8 segments) at the published layer shape."""
    import torch

    from models import cpu, kernels
    from models.kernels.candidates import REFERENCES

    device = torch.device(cpu.compute_device())
    dtype = torch.float32 if smoke else torch.bfloat16
    length = 512 if smoke else 16384
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    segments = torch.full((8,), length // 8)
    seq_idx = torch.repeat_interleave(torch.arange(8), segments)[None].to(device, torch.int32)
    if kind == "mamba":  # Nemotron-3 Nano 30B-A3B: 64 heads of 64, 8 groups, state 128
        heads, headdim, groups, state, chunk = (4, 16, 2, 16, 64) if smoke else (64, 64, 8, 128,
                                                                                 128)
        dim = heads * headdim
        inputs = {"zxbcdt": randn(1, length, 2 * dim + 2 * groups * state + heads, scale=0.5),
                  "conv1d_weight": randn(dim + 2 * groups * state, 4, scale=0.5),
                  "conv1d_bias": randn(dim + 2 * groups * state, scale=0.1),
                  "dt_bias": torch.full((heads,), -3.0, device=device),
                  "A": -torch.arange(1, heads + 1, device=device, dtype=torch.float32),
                  "D": torch.ones(heads, device=device), "chunk_size": chunk,
                  "activation": "silu", "headdim": headdim, "ngroups": groups,
                  "norm_before_gate": False, "seq_idx": seq_idx}
        grads = ("zxbcdt", "conv1d_weight")
        fast, reference = kernels.chosen("mamba").impl.combined, REFERENCES["mamba"].combined
        shape = {"heads": heads, "head_dim": headdim, "groups": groups, "state": state,
                 "chunk": chunk}
    else:  # Qwen3.5-9B: 32 value heads of 128 (key heads repeated)
        heads, dim = (4, 32) if smoke else (32, 128)
        inputs = {name: randn(1, length, heads, dim) for name in ("q", "k", "v")}
        inputs["g"] = torch.nn.functional.logsigmoid(
            torch.randn(1, length, heads, generator=gen) + 3).to(device)
        inputs["beta"] = torch.rand(1, length, heads, generator=gen).to(device, dtype)
        inputs.update(use_qk_l2norm_in_kernel=True, cu_seqlens=torch.nn.functional.pad(
            segments.cumsum(0), (1, 0)).to(device))
        grads = ("q", "k", "v", "g", "beta")
        fast, reference = kernels.chosen("deltanet").impl.chunk, REFERENCES["deltanet"].chunk
        shape = {"value_heads": heads, "head_dim": dim}

    def timed(fn) -> tuple[float, float]:
        def step():
            xs = {k: v.detach().clone().requires_grad_(k in grads) if torch.is_tensor(v) else v
                  for k, v in inputs.items()}
            out = fn(**xs)
            out = out[0] if isinstance(out, tuple) else out
            out.float().square().mean().backward()

        step()  # compile / warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        tick = time.perf_counter()
        for _ in range(3):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else 0.0
        return (time.perf_counter() - tick) / 3, peak

    fast_s, fast_gb = timed(fast)
    torch_s, torch_gb = timed(reference)
    return {"chosen": kernels.chosen(kind).name, "dtype": str(dtype).replace("torch.", ""),
            "tokens": length, "segments": 8, **shape, "chosen_fwd_bwd_s": round(fast_s, 4),
            "torch_fwd_bwd_s": round(torch_s, 4), "speedup": round(torch_s / fast_s, 2),
            "chosen_peak_gb": round(fast_gb, 2), "torch_peak_gb": round(torch_gb, 2)}
