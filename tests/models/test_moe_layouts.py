"""The MoE families (Qwen3-VL MoE, Qwen3.5 MoE) trained by train.py in every parallel layout
against one process: DP x PP x CP x TP, TP x CP x EP, expert-TP other than TP (with resume and
export), and ``model.hf`` imported at TP 2 / expert-TP 1 / EP 2. Multi-process and slow: a file
of its own so the suite's workers (``--dist loadfile``) share these runs with the rest of
tests/models/test_qwen3_vl_moe.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO

TOL = 1e-4


def assert_memory_line(proc, args: list[str], gpus: int) -> None:
    """The memory estimate train.py printed for its rank 0 (from the parameters it holds) is
    ``python -m recipes.memory``'s for stage 0 (from the whole model on the meta device)."""
    from recipes.estimate import estimate_run
    from recipes.run_config import load_run_config

    printed = [line for line in proc.stdout.splitlines() if "[train] memory of rank 0" in line]
    cfg = load_run_config(args[0], [*args[1:], "train.precision=fp32"])  # CPU: auto is fp32
    assert len(printed) == 1 and printed[0].endswith(estimate_run(cfg, gpus)[0].line()), printed


#: 4 LM layers (MoE, dense, MoE, MoE: two per pipeline stage, DeepStack's two on the first)
FOUR_LAYERS = ("model.lm.num_layers=4",)


def run_args(mantis_out, tmp_path, *shared: str,
             name: str = "train_qwen3_vl_moe_mantis.yaml") -> list[str]:
    """train.py's arguments of ``layouts_equal_one_process``'s runs of configs/``name`` (its
    init checkpoint in ``tmp_path / "init"``)."""
    from tests.test_train import FAST

    return [str(REPO / "configs" / name),
            f"data.path={mantis_out}/metadataset.yaml", "train.steps=3",
            "train.micro_batch_size=1", "task_encoder.fixed_length=true",
            "task_encoder.seq_length=768", f"train.init_checkpoint={tmp_path / 'init'}",
            *FOUR_LAYERS, *FAST, *shared]


def layouts_equal_one_process(mantis_out, tmp_path, layouts: dict, *shared: str,
                              one: tuple[str, ...] = (),
                              name: str = "train_qwen3_vl_moe_mantis.yaml"
                              ) -> list[tuple[float, float, float]]:
    """configs/``name`` (4 LM layers, + ``shared``) for 3 steps in one
    process (``tmp_path / "one"``, + ``one``) and at each of ``layouts`` (name -> (processes,
    overrides)) from one initial weights checkpoint, every run reading the data as 2 DP ranks:
    each layout's losses, gradient norms and aux-loss terms equal one process's, and its memory
    estimate is the CLI's. Returns one process's (loss, gradient norm, aux-loss term) per step."""
    from tests import runner
    from tests.test_train import ok, records

    config = str(REPO / "configs" / name)
    ok(runner.run("tests/init_checkpoint.py", config, str(tmp_path / "init"), *FOUR_LAYERS,
                  *shared, timeout=300))
    args = run_args(mantis_out, tmp_path, *shared, name=name)
    for run, (nproc, extra) in {"one": (1, ["data.virtual_dp=2", *one]), **layouts}.items():
        proc = runner.run("train.py", *args, *extra, f"out={tmp_path / run}", nproc=nproc,
                          timeout=600)
        ok(proc)
        assert_memory_line(proc, [*args, *extra], nproc)

    def steps(run):
        return [(r["loss"], r["grad_norm"], r["moe_aux_loss"], r["moe_load_per_layer"])
                for r in records(tmp_path / run, "grad_norm")]

    one = steps("one")
    assert len(one) == 3 and all(norm > 0 for _, norm, _, _ in one)
    for run in layouts:
        for got, want in zip(steps(run), one, strict=True):
            assert abs(got[0] - want[0]) < 1e-4, (run, steps(run), one)
            assert abs(got[1] - want[1]) < 1e-4 * want[1], (run, steps(run), one)
            assert abs(got[2] - want[2]) < 1e-7, (run, steps(run), one)
            # the expert load, summed over the ranks' token shares and the stages' layers (a
            # near-tie in routing may flip one assignment between layouts: 1 %)
            assert got[3].keys() == want[3].keys(), (run, steps(run), one)
            assert all(abs(got[3][k] - want[3][k]) <= 1e-2 * want[3][k] for k in want[3]), \
                (run, steps(run), one)
    return [step[:3] for step in one]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["train_qwen3_vl_moe_mantis.yaml",
                                  "train_qwen3_5_moe_mantis.yaml"])
def test_dp2_pp2_cp2_tp2_equal_one_process(mantis_out, tmp_path, name):
    """The MoE model (Qwen3-VL MoE; Qwen3.5 MoE: 3 Gated DeltaNet layers + 1 gated attention)
    at DP = 2 (distributed optimizer), PP = 2 (1F1B, MoE layers on both stages),
    CP = 2 (each rank routes its zig-zag share; megatron's router counts tokens over the CP
    group; the DeltaNet gathers the shares) and TP = 2 (megatron's sequence parallelism, which
    its MoE layers need under TP: each rank runs a contiguous share of the sequence through the
    norms, the router and the experts, sliced over TP; DeepStack rows follow the share; the
    DeltaNet's projections gather the sequence and its gated norm's gradient is summed over TP)
    gives one process's losses, gradient norms and aux-loss terms over 3 steps from the same
    initial weights (``layouts_equal_one_process``); the PP = 2 (each stage its layers), CP = 2
    and TP = 2 (experts sliced over TP) step-2 checkpoints resume exactly."""
    from tests import runner
    from tests.test_train import losses, ok

    resumable = {run: ["data.virtual_dp=2", "checkpoint.interval=2", *extra] for run, extra in
                 (("pp2", ["parallel.pp=2"]), ("cp2", ["parallel.cp=2"]),
                  ("tp2", ["parallel.tp=2"]))}
    one = layouts_equal_one_process(mantis_out, tmp_path, {
        "dp2": (2, []), **{run: (2, extra) for run, extra in resumable.items()}}, name=name)
    assert one[-1][0] < one[0][0]
    for run, extra in resumable.items():
        step = tmp_path / run / "checkpoints" / "step_000002"
        ok(runner.run("train.py", *run_args(mantis_out, tmp_path, name=name), *extra,
                      f"out={tmp_path / f'{run}_resumed'}", "--resume", str(step), nproc=2,
                      timeout=600))
        assert losses(tmp_path / f"{run}_resumed") == losses(tmp_path / run)[2:], run  # bit-exact


@pytest.mark.slow
@pytest.mark.parametrize("name,shared", [
    ("train_qwen3_vl_moe_mantis.yaml", ()),
    ("train_qwen3_5_moe_mantis.yaml", ()),
    ("train_qwen3_5_moe_mantis.yaml", ("model.lm.linear_num_key_heads=4",
                                       "model.lm.linear_num_value_heads=8"))],
    ids=["qwen3_vl_moe", "qwen3_5_moe_gathered", "qwen3_5_moe_heads"])
def test_tp2_cp2_ep2_equals_one_process(mantis_out, tmp_path, name, shared):
    """TP = 2 (sequence parallel) and CP = 2 together, the 4 experts over EP = 2 (expert-TP 2), on
    4 processes: each rank holds a TP piece of its zig-zag CP share. Qwen3-VL MoE: DeepStack rows
    and the visual scatter follow both splits. Qwen3.5 MoE: with 1 key head per TP rank the
    Gated DeltaNet gathers the pieces over TP and the shares over CP (its SP path); with 2 it
    shares them over CP after its projections gathered the TP pieces. Losses, gradient norms,
    aux-loss terms and expert loads equal one process's (``layouts_equal_one_process``)."""
    layouts_equal_one_process(mantis_out, tmp_path, {
        "tp2cp2ep2": (4, ["parallel.tp=2", "parallel.cp=2", "parallel.ep=2",
                             "data.virtual_dp=2"])}, *shared,
        name=name)


#: the published Qwen3-VL-235B-A22B SFT layout's expert side, at 2 processes: TP 2 (sequence
#: parallel), each expert whole on one rank (expert-TP 1), the 4 experts over EP 2
ETP1 = ["parallel.tp=2", "parallel.etp=1", "parallel.ep=2", "data.virtual_dp=2"]


#: expert-TP above TP, at 4 processes: the dense layers whole on each of 4 DP ranks, each
#: expert's linears sliced over 2 of them (expert-TP 2), the 4 experts over EP 2
ETP2 = ["parallel.tp=1", "parallel.etp=2", "parallel.ep=2"]


@pytest.mark.slow
@pytest.mark.parametrize("run,nproc,layout,dp", [("etp1", 2, ETP1, 2), ("etp2", 4, ETP2, 4)])
def test_expert_tp_other_than_tp_equals_one_process_resumes_and_exports(mantis_out, tmp_path,
                                                                        run, nproc, layout, dp):
    """Expert-TP other than TP: TP 2 with expert-TP 1 and EP 2 (the dense layers sliced over both
    ranks, each expert whole on the rank of its EP group), and TP 1 with expert-TP 2 and EP 2 on
    4 processes (each expert sliced over 2 ranks that hold the whole dense layers), give one
    process's losses, gradient norms and aux-loss terms (``layouts_equal_one_process``, read as
    as many DP ranks); the step-2 checkpoint resumes bit-exactly; the export (``models.convert
    mcore-to-hf``) holds the one-process export's tensors within float tolerance, and
    transformers loads it with our logits. (Measured on CPU: equal losses, gradient norms within
    2e-7 relative.)"""
    from models.convert import mcore_to_hf
    from tests import runner
    from tests.test_hf_journey import logits_diff
    from tests.test_train import losses, ok

    final = "checkpoint.save_final=true"
    args = [*layout, "checkpoint.interval=2", final]
    layouts_equal_one_process(mantis_out, tmp_path, {run: (nproc, args)},
                              one=(final, f"data.virtual_dp={dp}"))
    step = tmp_path / run / "checkpoints" / "step_000002"
    ok(runner.run("train.py", *run_args(mantis_out, tmp_path), *args,
                  f"out={tmp_path / 'resumed'}", "--resume", str(step), nproc=nproc,
                  timeout=600))
    assert losses(tmp_path / "resumed") == losses(tmp_path / run)[2:]  # bit-exact on CPU
    for name in ("one", run):
        mcore_to_hf(tmp_path / name, tmp_path / f"{name}_hf")
    one = load_file(str(tmp_path / "one_hf" / "model.safetensors"))
    got = load_file(str(tmp_path / f"{run}_hf" / "model.safetensors"))
    assert sorted(got) == sorted(one)
    for key in one:  # 3 Adam steps of up to 3e-3 amplify the float noise: 4.4e-6 measured
        torch.testing.assert_close(got[key], one[key], rtol=0, atol=1e-5, msg=key)
    assert max(logits_diff(tmp_path / run, tmp_path / f"{run}_hf").values()) <= TOL


@pytest.mark.slow
def test_train_from_hf_at_tp2_etp1_ep2_equals_one_process(tmp_path, mantis_out):
    """``model.hf`` imported at TP 2 / expert-TP 1 / EP 2 (each expert whole on its rank: the HF
    experts are sliced by expert-TP, the dense weights by TP) trains with one process's losses
    from the same HF weights; each layout's import is cached under its own name."""
    from lookalikes.models import build_tiny_hf_model
    from tests import runner
    from tests.test_train import FAST, MANTIS_CFG, losses, ok

    hf = build_tiny_hf_model("qwen3_vl_moe", tmp_path / "hf", pixels=(3136, 6272))
    cache = tmp_path / "cache"
    args = [str(MANTIS_CFG), f"model.hf={hf}", f"data.path={mantis_out}/metadataset.yaml",
            f"train.hf_import_cache={cache}", "train.steps=2", "train.micro_batch_size=1",
            "task_encoder.fixed_length=true", "task_encoder.seq_length=768", *FAST]
    ok(runner.run("train.py", *args, "data.virtual_dp=2", f"out={tmp_path / 'one'}",
                  timeout=600))
    ok(runner.run("train.py", *args, *ETP1, f"out={tmp_path / 'etp1'}", nproc=2, timeout=600))
    one, etp1 = losses(tmp_path / "one"), losses(tmp_path / "etp1")
    assert len(one) == 2 and all(abs(a - b) < 1e-4 for a, b in zip(one, etp1, strict=True)), \
        (one, etp1)
    names = sorted(p.name for p in cache.iterdir())
    assert any(n.endswith("tp1-pp1-ep1") for n in names), names
    assert any(n.endswith("tp2-pp1-ep2-etp1") for n in names), names


@pytest.mark.slow
@pytest.mark.parametrize("name", ["train_qwen3_vl_moe_mantis.yaml",
                                  "train_qwen3_5_moe_mantis.yaml"])
def test_ep2_equals_dp2_and_resumes_exactly(mantis_out, tmp_path, name):
    """configs/<name> (Qwen3-VL MoE; Qwen3.5 MoE: Gated DeltaNet layers, shared expert) at EP=2
    (2 experts per rank over the 2 DP ranks, fixed-length micro-batches) gives the DP=2 losses
    and aux-loss terms from the same initial weights (written at EP=1, resharded on load), and an
    EP=2 checkpoint resumes exactly; its memory estimate is the CLI's."""
    from tests import runner
    from tests.test_train import FAST, losses, ok, train

    config = str(REPO / "configs" / name)
    init = tmp_path / "init"
    ok(runner.run("tests/init_checkpoint.py", config, str(init), timeout=300))
    args = [config, f"data.path={mantis_out}/metadataset.yaml", "train.steps=3",
            "train.micro_batch_size=1", "task_encoder.fixed_length=true",
            "task_encoder.seq_length=768", f"train.init_checkpoint={init}", *FAST]
    ok(train(*args, f"out={tmp_path / 'dp2'}", nproc=2))
    proc = train(*args, "parallel.ep=2", "checkpoint.interval=2", f"out={tmp_path / 'ep2'}",
                 nproc=2)
    ok(proc)
    assert_memory_line(proc, [*args, "parallel.ep=2"], 2)
    ep2, dp2 = losses(tmp_path / "ep2"), losses(tmp_path / "dp2")
    assert ep2[-1] < ep2[0]
    for a, b in zip(ep2, dp2, strict=True):
        assert abs(a - b) < 1e-4

    def aux(run):
        return [json.loads(line).get("moe_aux_loss")
                for line in (run / "metrics.jsonl").read_text().splitlines()
                if "grad_norm" in json.loads(line)]

    for a, b in zip(aux(tmp_path / "ep2"), aux(tmp_path / "dp2"), strict=True):
        assert a is not None and abs(a - b) < 1e-7
    step = tmp_path / "ep2" / "checkpoints" / "step_000002"
    ok(train(*args, "parallel.ep=2", f"out={tmp_path / 'resumed'}", "--resume", str(step),
             nproc=2))
    assert losses(tmp_path / "resumed") == ep2[2:]  # bit-exact on CPU
