"""slurm/prepare.sbatch and slurm/train.sbatch submitted as they are to a real one-node SLURM
started on this machine (Debian's slurm-wlm + munge, ``slurm/local_cluster.sh``): a 3-task
conversion array equals the one-machine conversion byte for byte, a training job runs, a
requeued training job resumes exactly, and a 2-task job (two launchers meeting at the c10d
rendezvous as two nodes) equals DP=2 started here. Dry runs check the scripts' parameters.
Skipped (with the reason) where SLURM cannot be had: not root, or the packages do not install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.conftest import REPO, read_samples, run_cli
from tests.converters.test_pipeline import _same_output
from tests.test_train import FAST, MANTIS_CFG, losses, records

SLURM = REPO / "slurm"


def _dry(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SLURM / script), *args], cwd=REPO, text=True,
                          capture_output=True, env={**os.environ, "VLM_DRY_RUN": "1", **env})


def test_scripts_map_their_parameters_dry_run():
    proc = _dry("prepare.sbatch", "mantis", "src", "out", "--shard-size", "4",
                SLURM_ARRAY_TASK_COUNT="3", SLURM_ARRAY_TASK_ID="2", SLURM_CPUS_PER_TASK="16")
    assert proc.returncode == 0, proc.stderr
    assert ("-m converters mantis --source src --out out --num-partitions 3 "
            "--partition-index 2 --workers 16 --shard-size 4") in proc.stdout
    proc = _dry("prepare.sbatch", "mantis", "src", "out", "--workers", "3")
    assert "--num-partitions 1 --partition-index 0 --workers 3" in proc.stdout
    proc = _dry("prepare.sbatch", "coco", "src", "out")
    assert proc.returncode == 2 and "dataset must be mantis, infovqa or llava-video" in proc.stderr
    assert _dry("prepare.sbatch", "mantis").returncode == 2
    proc = _dry("train.sbatch", "configs/train_qwen_vl_mantis.yaml", "train.steps=5",
                SLURM_NNODES="4", SLURM_JOB_ID="77", GPUS_PER_NODE="8", MASTER_ADDR="node1")
    assert proc.returncode == 0, proc.stderr
    assert ("-m recipes.launch --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d "
            "--rdzv-endpoint node1:20077 --rdzv-id 77 train.py "
            "configs/train_qwen_vl_mantis.yaml train.steps=5 train.auto_resume=true"
            ) in proc.stdout
    # --ntasks-per-node=2 on one node: two launchers (SLURM_NTASKS), a two-"node" rendezvous
    proc = _dry("train.sbatch", "configs/train_qwen_vl_mantis.yaml", SLURM_NNODES="1",
                SLURM_NTASKS="2", SLURM_JOB_ID="5", MASTER_ADDR="node1")
    assert proc.returncode == 0, proc.stderr
    assert ("-m recipes.launch --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d "
            "--rdzv-endpoint node1:20005 --rdzv-id 5 train.py") in proc.stdout
    proc = _dry("train.sbatch", "configs/train_qwen_vl_mantis.yaml", VLM_PYTHON="/no/python")
    assert proc.returncode == 2 and "no venv python at /no/python" in proc.stderr
    # the node's GPUs over its launchers: 8 GPUs, 2 tasks on each of 3 nodes -> 4 processes each
    proc = _dry("train.sbatch", "configs/train_qwen_vl_mantis.yaml", SLURM_NTASKS="6",
                SLURM_GPUS_ON_NODE="8", SLURM_NTASKS_PER_NODE="2(x3)")
    assert "6 node(s) x 4 process(es)" in proc.stdout, proc.stdout
    assert "#SBATCH --gpus-per-node=8" in (SLURM / "train.sbatch").read_text()


def _make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", *args], cwd=REPO, text=True, capture_output=True,
                          timeout=60)


def test_make_slurm_targets_ask_for_gpus_and_never_run_a_value(tmp_path):
    """``make slurm-train-*`` prints the exact sbatch line (its dry run): N nodes, one launcher
    each, GPUS per node (default 8, 0 for none); ``make slurm-prepare-*`` the array. Values
    with shell syntax are printed quoted, as one argument each, and never run."""
    import shlex

    marker = tmp_path / "ran"
    proc = _make("slurm-train-qwen-vl-mantis", "NODES=4", "STEPS=5", f"OUT=x; touch {marker}",
                 f"ARGS=train.lr=1e-5 `touch {marker}` *")
    assert proc.returncode == 0, proc.stderr
    assert shlex.split(proc.stdout) == [
        "sbatch", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "slurm/train.sbatch",
        "configs/train_qwen_vl_mantis.yaml", "data.path=data/mantis/metadataset.yaml",
        "train.steps=5", f"out=x; touch {marker}", "train.lr=1e-5", "`touch", f"{marker}`", "*"]
    assert "--gpus-per-node=0 " in _make("slurm-train-nemotron-omni-infovqa", "GPUS=0").stdout
    proc = _make("slurm-prepare-mantis", "PARTS=3", f"OUT=a b; touch {marker}")
    assert shlex.split(proc.stdout) == [
        "sbatch", "--array=0-2", "--cpus-per-task=16", "slurm/prepare.sbatch", "mantis",
        "TIGER-Lab/Mantis-Instruct", f"a b; touch {marker}"]
    for bad in ("PARTS=1+2", "CPUS=x", "NODES=-1", "GPUS=1;2"):
        target = "slurm-prepare-mantis" if bad[0] in "PC" else "slurm-train-qwen-vl-mantis"
        proc = _make(target, bad)
        assert proc.returncode != 0
        assert f"make: {bad.split('=')[0]} must be a whole number" in proc.stderr, proc.stderr
    assert not marker.exists()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """SLURM_CONF of a running one-node cluster (torn down after the module)."""
    where = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(["bash", str(SLURM / "local_cluster.sh"), "up", str(where)],
                        capture_output=True, text=True, timeout=900)
    if up.returncode == 3:
        pytest.skip(f"no SLURM here: {up.stderr.strip()}")
    assert up.returncode == 0, up.stderr
    env = {**os.environ, "SLURM_CONF": str(where / "slurm.conf")}
    yield env
    subprocess.run(["scancel", "--user", "root"], env=env, capture_output=True)
    subprocess.run(["bash", str(SLURM / "local_cluster.sh"), "down", str(where)],
                   capture_output=True, timeout=60)


def _submit(env: dict, *args: str) -> str:
    proc = subprocess.run(["sbatch", "--parsable", *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _queued(env: dict, job: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i"], env=env, text=True,
                         capture_output=True).stdout
    return bool(out.strip())


def _requeue_now(env: dict, job: str, timeout: float = 300) -> None:
    """``scontrol requeue`` (SIGTERM to the job), then, once its run has ended (no longer
    COMPLETING), release it at once: SLURM holds a requeued job for ~2 minutes (BeginTime
    = requeue + 121 s, then the next scheduling pass, ~170 s in all) before it can run again;
    ``StartTime=now`` lifts that hold and nothing else (the same job, its restart count, its
    SIGTERM handling and auto-resume)."""
    subprocess.run(["scontrol", "requeue", job], env=env, check=True, capture_output=True)
    end = time.monotonic() + timeout
    while True:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, text=True,
                               capture_output=True).stdout.strip()
        if state != "COMPLETING":
            break
        assert time.monotonic() < end, f"job {job} still completing after {timeout} s"
        time.sleep(0.2)
    if state == "PENDING":
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env,
                       check=True, capture_output=True)


def _wait(env: dict, job: str, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while _queued(env, job):
        assert time.monotonic() < end, f"job {job} still queued after {timeout} s"
        time.sleep(1)


@pytest.mark.slow
def test_prepare_array_equals_one_machine(slurm, sources, mantis_out, tmp_path):
    """The 3-task array equals the same 3 partitions converted one after the other here, byte
    for byte (shards, their indexes, rejects, metadataset.yaml), and holds the very samples of
    the unpartitioned conversion (shard boundaries follow the partitions)."""
    options = ("--shard-size", "4", "--val-fraction", "0.2", "--workers", "1")
    out, here = tmp_path / "out", tmp_path / "here"
    job = _submit(slurm, "--array=0-2", "--cpus-per-task=1", f"--output={tmp_path}/%a.log",
                  "slurm/prepare.sbatch", "mantis", str(sources["mantis"]), str(out), *options)
    for index in range(3):
        run_cli("converters", "mantis", "--source", str(sources["mantis"]), "--out", str(here),
                "--num-partitions", "3", "--partition-index", str(index), *options)
    _wait(slurm, job)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("*.log")))
    assert (out / "summary.json").is_file(), logs[-3000:]
    assert logs.count("partition done") == 2  # two tasks left it to the one that finalized
    _same_output(here, out)
    assert (out / "metadataset.yaml").read_bytes() == (here / "metadataset.yaml").read_bytes()
    assert read_samples(out) == read_samples(mantis_out)


@pytest.mark.slow
def test_train_job_then_a_requeue_resumes_exactly(slurm, mantis_out, tmp_path):
    """The same run three ways: train.py here, a SLURM job, and a SLURM job requeued (SIGTERM:
    checkpoint, exit; the requeued job auto-resumes) after its second step: equal losses."""
    from tests.test_train import ok, train

    args = [str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", "train.steps=30",
            *FAST]
    ok(train(*args, f"out={tmp_path / 'here'}"))
    job = _submit(slurm, "--cpus-per-task=2", "--gpus-per-node=1",
                  f"--output={tmp_path}/job.log", "slurm/train.sbatch", *args,
                  f"out={tmp_path / 'job'}")
    _wait(slurm, job)
    assert losses(tmp_path / "job") == losses(tmp_path / "here"), \
        (tmp_path / "job.log").read_text()[-3000:]
    requeued = tmp_path / "requeued"
    job = _submit(slurm, "--cpus-per-task=2", "--gpus-per-node=1",
                  f"--output={tmp_path}/requeued.log", "slurm/train.sbatch", *args,
                  f"out={requeued}")
    end = time.monotonic() + 300
    while not ((requeued / "metrics.jsonl").is_file() and len(records(requeued)) >= 2):
        assert time.monotonic() < end and _queued(slurm, job), \
            (tmp_path / "requeued.log").read_text()[-3000:]
        time.sleep(0.2)
    _requeue_now(slurm, job)
    _wait(slurm, job)
    log = (tmp_path / "requeued.log").read_text()
    assert "stopped by SIGTERM" in log and "(restart 1)" in log, log[-3000:]
    assert [r["step"] for r in records(requeued)] == list(range(1, 31))
    assert losses(requeued) == losses(tmp_path / "here")
    shutil.rmtree(requeued / "checkpoints", ignore_errors=True)


@pytest.mark.slow
def test_two_task_job_rendezvous_equals_dp2(slurm, mantis_out, tmp_path):
    """``--nodes=1 --ntasks-per-node=2``: two SLURM tasks, each a launcher of one process, meet
    at the c10d rendezvous as two nodes would (the multi-node path on one machine); the DP=2
    run equals the same run started here by the project's launcher with 2 processes."""
    from tests.test_train import ok, train

    args = [str(MANTIS_CFG), f"data.path={mantis_out}/metadataset.yaml", "train.steps=3",
            "train.micro_batch_size=2", *FAST]
    ok(train(*args, f"out={tmp_path / 'here'}", nproc=2))
    job = _submit(slurm, "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                  "--gpus-per-node=2", f"--output={tmp_path}/job.log", "slurm/train.sbatch",
                  *args, f"out={tmp_path / 'job'}")
    _wait(slurm, job)
    log = (tmp_path / "job.log").read_text()
    assert "2 node(s) x 1 process(es)" in log and "--nnodes 2" in log, log[-3000:]
    assert "world 2 = tp 1 x pp 1 x cp 1 x dp 2" in log, log[-3000:]
    # bit-equal: the same DP=2 arithmetic (one thread a rank; a sum of two is order-free)
    assert losses(tmp_path / "job") == losses(tmp_path / "here"), log[-3000:]
    assert records(tmp_path / "job", "val_loss") == records(tmp_path / "here", "val_loss")


@pytest.mark.slow
def test_make_submits_a_job_that_asks_for_its_gpus(slurm, mantis_out, tmp_path):
    """``make slurm-train-* SUBMIT=1 GPUS=2``: the job SLURM queues asks for 2 GPUs per node
    (its TRES), its launcher starts one process per GPU, and it trains (here on the CPU: the
    test cluster's GPUs are declared, not present)."""
    env = {**slurm, "SBATCH_OUTPUT": str(tmp_path / "job.log")}
    proc = subprocess.run(
        ["make", "-s", "slurm-train-qwen-vl-mantis", "SUBMIT=1", "GPUS=2", "STEPS=2",
         f"DATA={mantis_out}/metadataset.yaml", f"OUT={tmp_path / 'run'}",
         f"ARGS={' '.join(FAST)} train.micro_batch_size=1"],
        cwd=REPO, env=env, text=True, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.split()[-1]
    shown = subprocess.run(["scontrol", "show", "job", job], env=slurm, text=True,
                           capture_output=True).stdout
    assert "TresPerNode=gres:gpu:2" in shown, shown
    _wait(slurm, job)
    log = (tmp_path / "job.log").read_text()
    assert "1 node(s) x 2 process(es)" in log and "world 2 = " in log, log[-3000:]
    assert len(losses(tmp_path / "run")) == 2, log[-3000:]
