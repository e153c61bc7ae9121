"""models.kernels: each layer kind's implementation chosen by a check against the torch reference
(forward and backward on a packed row with segment restarts).

No fast kernel runs on this CPU machine, so the choice machinery is driven by planted
candidates (``needs_cuda`` false, checked on the CPU in float32): independent implementations
(a step-by-step recurrence, a per-segment conv) are accepted, which also proves the torch chunked
kernels against them; kernels made to disagree (a state that crosses a segment, a conv window
that reaches into the previous sample, one that raises) are rejected with their reason, and the
reference runs instead; a forced one is a one-line error. Also: the start-up lines, the run
config's ``kernels`` section, a Qwen3.5 layer training where fla-core is refused, and the chunked
kernels' memory staying linear in the row length (no (L x L) matrix)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from models import kernels
from models.kernels import candidates
from models.kernels import conv as torch_conv
from models.kernels import gated_delta as torch_delta
from models.kernels import mamba as torch_mamba


@pytest.fixture
def fresh(monkeypatch):
    """No choice or verdict of this process, restored afterwards; ``plant(kind, candidate)``
    puts a candidate before the kind's others."""
    from models.parallel import init_parallel

    init_parallel()
    monkeypatch.setattr(kernels, "_BOUND", {})
    monkeypatch.setattr(kernels, "_VERDICTS", {})

    def plant(kind: str, name: str, impl, check=None, label=None):
        known = candidates.CANDIDATES[kind]
        check = check or next(c.check for c in known if c.check is not None)
        loader = impl if callable(impl) else (lambda _ctx: impl)
        planted = candidates.Candidate(kind, name, label or f"planted {name}", loader, check,
                                       needs_cuda=False)
        monkeypatch.setitem(candidates.CANDIDATES, kind,
                            [planted, *[c for c in known if c.name != name]])

    yield plant


# ------------------------------------------------------------------ independent implementations
def recurrent_by_segment(q, k, v, g, beta, cu_seqlens=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, **_unused):
    """The gated delta rule token by token, segment by segment (an independent algorithm)."""
    outs, states = [], []
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        out, state = torch_delta.fused_recurrent_gated_delta_rule(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs.append(out)
        states.append(state)
    return torch.cat(outs, 1), (torch.cat(states, 0) if output_final_state else None)


def rule_across_segments(*args, cu_seqlens=None, **kwargs):
    """Wrong on purpose: the rule over the whole row, the state crossing every segment."""
    out, state = torch_delta.chunk_gated_delta_rule(*args, **kwargs)
    return out, None if state is None else state.expand(len(cu_seqlens) - 1, *state.shape[1:])


def conv_by_segment(x, weight, bias=None, seq_idx=None, activation=None, **_unused):
    """The causal depthwise conv through ``F.conv1d`` on each segment (an independent one)."""
    ids = seq_idx[0].tolist()
    bounds = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]] + [len(ids)]
    width = weight.shape[-1]
    parts = [F.conv1d(F.pad(x[..., a:b].float(), (width - 1, 0)), weight.float()[:, None],
                      None if bias is None else bias.float(), groups=weight.shape[0])
             for a, b in zip(bounds[:-1], bounds[1:])]
    out = torch.cat(parts, -1)
    return (F.silu(out) if activation else out).to(x.dtype)


def conv_across_segments(x, weight, bias=None, seq_idx=None, activation=None, **_unused):
    """Wrong on purpose: windows reach into the previous sample."""
    return torch_conv.causal_conv1d_fn(x, weight, bias, None, activation)


def mamba_recurrence(restart: bool):
    """mamba_split_conv1d_scan_combined as the plain recurrence h_t = exp(dt A) h + dt B x,
    y = C h + D x, times SiLU(z), token by token in float64 (``restart``: the state reset at
    each segment; False is wrong on purpose)."""
    def combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, seq_idx=None,
                 activation="silu", headdim=None, ngroups=1, **_unused):
        heads = D.shape[0]
        dim = heads * headdim
        state = (conv1d_weight.shape[0] - dim) // (2 * ngroups)
        z, xbc, dt = zxbcdt.double().split([dim, dim + 2 * ngroups * state, heads], -1)
        xbc = conv_by_segment(xbc.transpose(1, 2), conv1d_weight.double(),
                              conv1d_bias.double(), seq_idx, activation).transpose(1, 2)
        x, B, C = xbc[0].split([dim, ngroups * state, ngroups * state], -1)
        x = x.reshape(-1, heads, headdim)
        B, C = (t.reshape(-1, ngroups, state).repeat_interleave(heads // ngroups, 1)
                for t in (B, C))
        dt = F.softplus(dt[0] + dt_bias.double())
        ids = seq_idx[0].tolist()
        h = x.new_zeros(heads, headdim, state)
        ys = []
        for t in range(x.shape[0]):
            if restart and t and ids[t] != ids[t - 1]:
                h = x.new_zeros(heads, headdim, state)
            h = (torch.exp(dt[t] * A.double())[:, None, None] * h
                 + (dt[t][:, None] * x[t])[..., None] * B[t][:, None, :])
            ys.append((h * C[t][:, None, :]).sum(-1) + D.double()[:, None] * x[t])
        y = torch.stack(ys).reshape(1, -1, dim) * F.silu(z)
        return y.to(zxbcdt.dtype)
    return SimpleNamespace(combined=combined, chunk_scan=torch_mamba.mamba_chunk_scan_combined,
                           norm=torch_mamba.RMSNormGated, state_update=None)


# ------------------------------------------------------------------ the choice
def test_on_cpu_every_kind_is_torch_and_says_so(fresh):
    choices = kernels.select(None)
    assert {kind: c.name for kind, c in choices.items()} == {
        "attention": "sdpa", "conv": "torch", "mamba": "torch", "deltanet": "torch",
        "experts": "sequential"}
    assert choices["mamba"].line() == ("mamba: torch chunked scan (on CPU: the fast kernels "
                                       "need CUDA)")


def test_forced_kernel_that_cannot_run_is_one_line_error(fresh):
    from contract.errors import UsageError

    with pytest.raises(UsageError, match=r"^kernels\.mamba=mamba_ssm: mamba_ssm chunked scan "
                                         r"\(Triton\) needs a CUDA device") as error:
        kernels.select(kernels.KernelsConfig(mamba="mamba_ssm"), ("mamba",))
    assert "\n" not in str(error.value)
    assert kernels.select(kernels.KernelsConfig(mamba="torch"), ("mamba",))["mamba"].line() == (
        "mamba: torch chunked scan (kernels.mamba=torch)")


def test_missing_package_is_the_reason(fresh):
    """The real mamba_ssm loader where CUDA is not the obstacle: not installed here."""
    real = next(c for c in candidates.CANDIDATES["mamba"] if c.name == "mamba_ssm")
    fresh("mamba", "mamba_ssm", real.load, real.check, label=real.label)
    line = kernels.select(None, ("mamba",))["mamba"].line()
    assert line == "mamba: torch chunked scan (mamba_ssm not installed)"


def test_independent_kernels_agree_and_are_chosen(fresh):
    """A segment-by-segment recurrent delta rule, a per-segment F.conv1d and a token-by-token
    float64 Mamba recurrence pass the checks against the torch chunked kernels: chosen."""
    fresh("deltanet", "recurrent", SimpleNamespace(
        chunk=recurrent_by_segment, recurrent=torch_delta.fused_recurrent_gated_delta_rule))
    fresh("conv", "segments", SimpleNamespace(fn=conv_by_segment,
                                              update=torch_conv.causal_conv1d_update))
    fresh("mamba", "recurrence", mamba_recurrence(restart=True))
    choices = kernels.select(None, ("conv", "deltanet", "mamba"))
    assert [choices[k].name for k in ("conv", "deltanet", "mamba")] == [
        "segments", "recurrent", "recurrence"]
    for kind in ("conv", "deltanet", "mamba"):
        assert choices[kind].reason.startswith("agrees with torch on cpu float32: worst")
        assert max(choices[kind].errors.values()) < 1e-4, (kind, choices[kind].errors)
    assert {"grad_q", "grad_g", "grad_beta", "out1", "decode_out0"} <= set(
        choices["deltanet"].errors)
    assert {"grad_zxbcdt", "grad_A", "norm_grad_weight"} <= set(choices["mamba"].errors)


@pytest.mark.parametrize("kind,name,impl,what", [
    ("deltanet", "leaky", SimpleNamespace(
        chunk=rule_across_segments, recurrent=torch_delta.fused_recurrent_gated_delta_rule),
     "out0"),
    ("conv", "leaky", SimpleNamespace(fn=conv_across_segments,
                                      update=torch_conv.causal_conv1d_update), "out0"),
    ("mamba", "leaky", mamba_recurrence(restart=False), "out0"),
])
def test_disagreeing_kernel_is_rejected_with_its_reason(fresh, kind, name, impl, what):
    """A kernel whose state or window crosses a segment: rejected (the worst difference named),
    torch runs; forced, it is a one-line error with the same reason."""
    from contract.errors import UsageError

    fresh(kind, name, impl)
    choice = kernels.select(None, (kind,))[kind]
    assert choice.name == "torch"
    assert f"planted {name} disagrees with torch (" in choice.reason
    assert "> 5e-03)" in choice.reason
    with pytest.raises(UsageError, match=rf"^kernels\.{kind}={name}: planted {name} disagrees"):
        kernels.select(SimpleNamespace(**{k: kernels.AUTO for k in kernels.LAYER_KINDS}
                                          | {kind: name}), (kind,))


def test_kernel_that_fails_its_check_is_rejected(fresh):
    def broken(*_args, **_kwargs):
        raise RuntimeError("an illegal memory access was encountered")

    fresh("deltanet", "broken", SimpleNamespace(chunk=broken, recurrent=broken))
    choice = kernels.select(None, ("deltanet",))["deltanet"]
    assert choice.name == "torch"
    assert choice.reason == ("on CPU: the fast kernels need CUDA; planted broken failed its check "
                             "(RuntimeError: an illegal memory access was encountered)")


def test_verdicts_are_cached_per_process(fresh):
    calls = []

    def counted(ctx):
        calls.append(ctx.dtype)
        return SimpleNamespace(chunk=recurrent_by_segment,
                               recurrent=torch_delta.fused_recurrent_gated_delta_rule)

    fresh("deltanet", "counted", counted)
    for _ in range(3):
        kernels.select(None, ("deltanet",))
    assert calls == [torch.float32]


def test_qwen3_5_trains_where_fla_refuses_its_backward(fresh):
    """A GPU whose fla-core refuses the delta rule's backward (planted: its refusal as the
    loader's reason): the choice is the torch rule, said in the line, and the Qwen3.5 model
    builds and takes a training step on it (no refusal before the model is built)."""
    from models.families import build_model, get
    from models.families.qwen3_5.config import load_yaml
    from models.hf.verify_inputs import make_inputs
    from tests.conftest import REPO

    refusal = ("fla-core refuses the delta rule's backward with Triton 3.6.0 on NVIDIA H200 "
               "(Hopper; wrong gradients below 3.7.1: install triton>=3.7.1 or tilelang)")

    def refused(_ctx):
        raise candidates.Unavailable(refusal)

    fresh("deltanet", "fla", refused, label="fla-core chunked delta rule (Triton)")
    cfg = load_yaml(REPO / "configs" / "qwen3_5_tiny.yaml")
    choices = kernels.select(None, cfg.kernel_kinds())
    assert choices["deltanet"].line() == f"deltanet: torch chunked delta rule ({refusal})"
    assert get(cfg.family).layout_problems(cfg, None) == []
    model = build_model(cfg, use_te=False).train()
    inputs = make_inputs(cfg)["one_image"]
    loss, mask = model(**inputs, labels=inputs["input_ids"])
    (loss.sum() / mask.sum()).backward()
    grads = [p.grad for name, p in model.named_parameters() if "in_proj_q" in name]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
                         for g in grads)


def test_run_config_kernels_section():
    from contract.errors import ConfigError
    from recipes.run_config import load_run_config
    from tests.conftest import REPO

    config = REPO / "configs" / "train_nemotron_omni_mantis.yaml"
    cfg = load_run_config(config, ["kernels.mamba=torch"])
    assert cfg.kernels.mamba == "torch" and cfg.kernels.attention == "auto"
    assert cfg.model.kernel_kinds() == ("attention", "conv", "mamba")
    with pytest.raises(ConfigError, match=r"kernels\.mamba must be one of auto, mamba_ssm, "
                                          r"torch, got 'triton'"):
        load_run_config(config, ["kernels.mamba=triton"])


# ------------------------------------------------------------------ memory
def _saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd keeps for ``fn()``'s backward."""
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("kind", ["mamba", "deltanet"])
def test_chunked_kernels_keep_memory_linear_in_the_row(kind):
    """What the torch chunked scan / rule keeps for backward doubles with the row (16K-token
    rows stay bounded): an (L x L) matrix over the row would quadruple it."""
    gen = torch.Generator().manual_seed(0)

    def run(length):
        if kind == "mamba":
            x = torch.randn(1, length, 2, 16, generator=gen, requires_grad=True)
            dt = torch.rand(1, length, 2, generator=gen)
            B, C = (torch.randn(1, length, 1, 16, generator=gen) for _ in range(2))
            return lambda: torch_mamba.mamba_chunk_scan_combined(x, dt, -torch.ones(2), B, C, 64)
        q, k, v = (torch.randn(1, length, 2, 16, generator=gen, requires_grad=True)
                   for _ in range(3))
        g, beta = -torch.rand(1, length, 2, generator=gen), torch.rand(1, length, 2, generator=gen)
        return lambda: torch_delta.chunk_gated_delta_rule(q, k, v, g, beta)

    small, large = _saved_bytes(run(1024)), _saved_bytes(run(4096))
    assert 3.0 < large / small < 5.0, (small, large)  # 4x the row: ~4x the memory (not 16x)
