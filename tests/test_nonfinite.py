"""NaN / Inf through train.py: a learning rate that makes the weights explode (``train.lr=1e30``,
a real input path: the config) gives non-finite losses and gradient norms; each such step is
skipped (no update, counted as ``nonfinite_steps``), ``train.max_nonfinite_steps`` in a row stop
the run with one line naming the step and the batch's sample keys, and the checkpoints saved in
between hold the last finite weights. Infinite weights (``train.lr=.inf``) are never saved.
Under the project's torchrun (NPROC=2) the stop is printed once and names both ranks' samples."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.test_train import FAST, MANTIS_CFG, REPO, ok, records, train

EXPLODE = ["train.lr=1e30", "train.min_lr=0", "train.warmup_steps=0"]


def failure_line(proc, code: int = 1) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("train.py: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def sample_keys(mantis_out) -> set[str]:
    import tarfile

    keys = set()
    for shard in mantis_out.rglob("*.tar"):
        with tarfile.open(shard) as tar:
            keys |= {m.name.split(".")[0] for m in tar.getmembers()}
    return keys


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_then_stop_the_run(mantis_out, tmp_path):
    out = tmp_path / "run"
    base = [str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", *FAST, *EXPLODE,
            "checkpoint.interval=1", "train.keep_checkpoints=0"]
    line = failure_line(train(*base, f"out={out}", "train.steps=8"))
    assert "step 4: loss nan / grad norm nan not finite for 3 steps in a row" in line, line
    assert "train.max_nonfinite_steps=3" in line and "step_000003" in line, line
    named = line.split("samples of the batch: ")[1].split(";")[0].split(", ")
    assert named and set(named) <= sample_keys(mantis_out), named
    logged = records(out)
    assert [r["nonfinite_steps"] for r in logged] == [0, 1, 2], logged
    # the skipped steps applied nothing: their checkpoints hold step 1's finite weights (a NaN
    # update would have been refused at save), the run ended without a step 4 checkpoint
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == [
        "step_000001", "step_000002", "step_000003"]
    # more allowed in a row: the run goes on to its end, every skip counted
    ok(proc := train(*base, f"out={tmp_path / 'tolerant'}", "train.steps=4",
                     "train.max_nonfinite_steps=10"))
    assert records(tmp_path / "tolerant")[-1]["nonfinite_steps"] == 3, proc.stdout


@pytest.mark.slow
def test_nonfinite_weights_are_never_saved(mantis_out, tmp_path):
    out = tmp_path / "run"
    line = failure_line(train(str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
                              f"out={out}", *FAST, "train.lr=.inf", "train.warmup_steps=0",
                              "train.steps=2", "checkpoint.interval=1"))
    assert "the weights are not finite: checkpoint step_000001 not saved" in line, line
    assert not list((out / "checkpoints").glob("step_*"))


@pytest.mark.slow
def test_nonfinite_stop_under_torchrun_is_printed_once(mantis_out, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.launch", "--standalone", "--nproc-per-node", "2",
         "train.py", str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml",
         f"out={tmp_path}", *FAST, *EXPLODE, "train.steps=6"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    line = failure_line(proc)
    assert "not finite for 3 steps in a row" in line, line
    # the line names the samples of both data-parallel ranks (rank 1's would be lost otherwise:
    # only rank 0 prints), each rank's keys real and the two ranks' batches different
    named = line.split("samples of the batch: ")[1].split("; the last checkpoint")[0]
    per_rank = dict(part.split(": ", 1) for part in named.split(" | "))
    assert sorted(per_rank) == ["rank 0", "rank 1"], named
    keys = [set(part.split(" (+")[0].split(", ")) for part in per_rank.values()]
    assert keys[0] != keys[1] and keys[0] | keys[1] <= sample_keys(mantis_out), named


@pytest.mark.slow
def test_a_checkpoint_before_any_applied_step_is_saved_and_resumes(mantis_out, tmp_path):
    """A base whose logits overflow (finite weights: the final norm scaled by 1e38) makes every
    step non-finite from step 1, so no optimizer step is ever applied; the checkpoint due then
    (megatron's distributed optimizer reads torch Adam's step count from a state that does not
    exist yet) is saved, no ``.partial`` left, and the run resumes from it."""
    from safetensors.torch import load_file, save_file

    from lookalikes.models import build_tiny_hf_model
    from tests.test_hf_journey import JOURNEYS, train_from_hf

    hf = build_tiny_hf_model("qwen2_5_vl", tmp_path / "hf", pixels=JOURNEYS["qwen2_5_vl"][1])
    weights = load_file(str(hf / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1e38
    save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "run"
    shared = ("checkpoint.interval=1", "train.max_nonfinite_steps=10")
    train_from_hf("qwen2_5_vl", hf, out, tmp_path / "cache", mantis_out, "train.steps=2",
                  *shared)
    assert [r["nonfinite_steps"] for r in records(out)] == [1, 2]
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000001", "step_000002"]
    ok(train(str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", f"out={out}", *FAST,
             f"train.hf_import_cache={tmp_path / 'cache'}", "train.steps=3", *shared,
             "--resume", str(ckpts / "step_000001")))
    assert records(out)[-1]["step"] == 3 and not list(ckpts.glob("*.partial"))
