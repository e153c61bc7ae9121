"""Vision data-parallel over CP: the plan (fast, single process) and equivalence with the
unsharded run under torchrun/gloo (slow: 2 processes in tests/models/world2_checks.py's launch,
4 in a launch of its own)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.vision_dp import CostModel, VisionDPOverCP, count_split, plan_shares
from tests.models.conftest import world2_result

REPO = Path(__file__).resolve().parents[2]


def _units(plan):
    return sorted((s.item, t) for share in plan.shares for s in share
                  for t in range(s.t_start, s.t_stop))


def test_plan_covers_every_unit_once_and_is_deterministic():
    grid = [(1, 8, 8), (3, 4, 4), (1, 2, 2), (1, 40, 30), (2, 6, 6)]
    plan = plan_shares(grid, 2, 4)
    assert _units(plan) == sorted((i, k) for i, (t, _, _) in enumerate(grid) for k in range(t))
    assert plan == plan_shares(torch.tensor(grid), 2, 4)
    for rank in range(4):  # segments in original order, contiguous runs merged
        keys = [(s.item, s.t_start) for s in plan.shares[rank]]
        assert keys == sorted(keys)
        assert all(a.item != b.item or a.t_stop < b.t_start
                   for a, b in zip(plan.shares[rank], plan.shares[rank][1:]))


def test_plan_balances_by_cost_not_count():
    cm = CostModel()
    grid = [(1, 80, 64)] + [(1, 16, 16)] * 7  # one InfoVQA page + seven small images
    cost = plan_shares(grid, 2, 2, cm)
    count = count_split(grid, 2, 2, cm)
    assert cost.imbalance() < count.imbalance()
    assert [len(s) for s in count.shares] == [4, 4]
    assert cost.shares[0] == (cost.shares[0][0],) or cost.shares[1] == (cost.shares[1][0],)


def test_plan_splits_video_at_temporal_slices():
    plan = plan_shares([(8, 4, 4)], 2, 4)
    assert [[(s.t_start, s.t_stop) for s in share] for share in plan.shares] == \
        [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]
    assert plan.imbalance() == 1.0
    whole = plan_shares([(8, 4, 4)], 2, 4, split_videos=False)
    assert sum(1 for s in whole.shares if s) == 1


def test_plan_edge_cases():
    empty = plan_shares([], 2, 4)
    assert empty.shares == ((),) * 4 and empty.imbalance() == 1.0
    one = plan_shares([(1, 2, 2)], 2, 3)
    assert sum(len(s) for s in one.shares) == 1
    assert plan_shares([(1, 2, 2)] * 5, 2, 1).shares[0][0].item == 0
    with pytest.raises(ValueError, match=r"grid_thw\[1\]"):
        plan_shares([(1, 2, 2), (1, 3, 2)], 2, 2)


def test_plan_tokens_and_order():
    grid = [(1, 4, 4), (3, 2, 4), (1, 2, 2)]
    plan = plan_shares(grid, 2, 2)
    tokens = [plan.tokens(r) for r in range(2)]
    assert sum(tokens) == 4 + 6 + 1
    order = plan.order()
    assert sorted(order.tolist()) == list(range(11))


def test_cost_model_fit_recovers_constants():
    p = [256, 1024, 2048, 4096]
    cm = CostModel.fit(p, [3e-3 * x + 6e-8 * x * x for x in p])
    assert abs(cm.per_patch_sq - 2e-5) < 1e-9 and cm.per_patch == 1.0
    with pytest.raises(ValueError, match="fit needs"):
        CostModel.fit([1], [1.0])


def test_inactive_is_reported_once_and_passes_through(caplog):
    calls = []

    def encode(px, grid):
        calls.append(grid.shape[0])
        return px[::4, :3]

    vdp = VisionDPOverCP(encode, hidden_size=3, cp_group=None)
    px, grid = torch.randn(20, 3), torch.tensor([[1, 2, 2], [1, 4, 4]])
    with caplog.at_level(logging.INFO, logger="models.vision_dp"):
        out = vdp(px, grid)
        vdp(px, grid)
    assert not vdp.active and torch.equal(out, px[::4, :3]) and calls == [2, 2]
    msgs = [r.getMessage() for r in caplog.records if "INACTIVE" in r.getMessage()]
    assert len(msgs) == 1 and "context-parallel size is 1" in msgs[0]
    # CP = 1 is every one-process run: no warning (Python printed it as a stray stderr line)
    assert all(r.levelno < logging.WARNING for r in caplog.records), caplog.records
    assert "vision_dp_over_cp=False" in VisionDPOverCP(encode, hidden_size=3,
                                                       enabled=False).inactive_reason


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_vision_dp_matches_unsharded_run(nproc, tmp_path, request):
    """World 2: CP2 (a check of tests/models/world2_checks.py's launch). World 4: CP4, then
    TP2 x CP2 (a launch of its own). Every case: outputs and encoder gradients (summed over CP)
    equal the unsharded single-process run within 1e-5."""
    if nproc == 2:
        out = world2_result(request.getfixturevalue("world2"), "vision_dp_cp2")
    else:
        out = tmp_path
        torchrun = Path(sys.executable).with_name("torchrun")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
               "VISION_DP_OUT": str(tmp_path)}
        proc = subprocess.run([str(torchrun), "--standalone", f"--nproc-per-node={nproc}",
                               "tests/models/vision_dp_worker.py"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    results = [json.loads(line) for rank in range(nproc)
               for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad
    layouts = {(r["tp"], r["cp"]) for r in results}
    assert layouts == ({(1, 2)} if nproc == 2 else {(1, 4), (2, 2)})
    cases = {(r["case"], r["mode"]) for r in results}
    assert {("one_video", "train"), ("0_images", "train"), ("0_images", "frozen"),
            ("mixed", "frozen"), ("mixed", "tuple"), ("mixed", "disabled")} <= cases
    for layout in layouts:  # every rank ran every case of the layout (0..CP+1 images)
        rows = [r for r in results if (r["tp"], r["cp"]) == layout]
        names = {(r["case"], r["mode"]) for r in rows}
        cp = layout[1]
        assert {f"{n}_images" for n in (0, 1, cp - 1, cp, cp + 1)} <= {n for n, _ in names}
        assert len(rows) == nproc * len(names)


@pytest.mark.slow
def test_nemotron_omni_vision_dp_matches_unsharded_tower(world2):
    """CP2 on the real Nemotron-Omni tower (RADIO + pixel shuffle + projector; a check of
    tests/models/world2_checks.py's launch): dynamic images, tiles and a video split at
    frame-pair boundaries give the unsharded embeddings and, summed over CP, the unsharded tower
    gradients (1e-5)."""
    out = world2_result(world2, "nemotron_vision_dp_cp2")
    results = [json.loads(line) for rank in range(2)
               for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
    assert all(r["ok"] for r in results), results
    video = {r["rank"]: r["share"] for r in results if r["case"] == "video"}
    assert sorted(t for share in video.values() for t, _, _ in share) == [2, 3]  # 5 tubelets
    images = [r["share"] for r in results if r["case"] == "images"]
    assert all(images), images  # both ranks encode a share
