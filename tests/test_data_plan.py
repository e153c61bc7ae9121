"""The global data plan (``data.global_plan``): the planner's rows and rank assignment
(energon_tasks/global_plan.py), the DP-independent stream (energon_tasks/global_stream.py), and
train.py under it: the same samples at every step and the same losses at DP 1 and DP 2, and a
run resumed at another DP size (2 -> 1 -> 2) continuing the uninterrupted run's very samples."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from energon_tasks.global_plan import (
    MAX_WAIT,
    Item,
    assign_rows,
    imbalance,
    pack_rows,
    rank_loads,
)
from tests.test_train import FAST, MANTIS_CFG, losses, ok, records, train


def _items(seed: int, n: int) -> list[Item]:
    """A mix like the three datasets: photo sets (1-5 images, a few with 20-50), one large page,
    frame-heavy clips, text-only turns; tokens within one 4096-token row."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.4:
            images = rng.choice([1, 2, 3, 4, 5] * 9 + [rng.randint(20, 50)])
            tokens, vision = 250 + images * 60, images * rng.uniform(200, 400) ** 1.1
        elif kind < 0.6:
            tokens = rng.randint(800, 3000)
            vision = tokens ** 1.3
        elif kind < 0.8:
            frames = rng.choice([8, 16, 32, 64])
            tokens, vision = 100 + frames * 40, frames * 60 ** 1.1 * 4
        else:
            tokens, vision = rng.randint(50, 1500), 0.0
        out.append(Item(("m", i), min(tokens, 4096), vision))
    return out


@pytest.mark.parametrize("dp", [2, 8, 32])
def test_rows_hold_every_sample_whole_and_ranks_get_equal_work(dp):
    """Over 50 steps of the mix: no row is over its capacity, every candidate is placed whole
    or waits for a later step (at most ``MAX_WAIT``), and the ranks' tokens and vision cost are
    within 5 % of their mean on average (max over mean)."""
    stream, carried = _items(dp, 40000), []
    rows_per_step, capacity, tokens_ratio, vision_ratio = 2 * dp, 4096, [], []
    taken = 0
    for _ in range(50):
        fresh = []
        need = rows_per_step * capacity - sum(i.tokens for i in carried)
        while need > 0:
            fresh.append(stream[taken])
            need -= stream[taken].tokens
            taken += 1
        rows, left = pack_rows(carried, fresh, rows_per_step, capacity, packing=True)
        placed = [item for row in rows for item in row.items]
        assert _refs(placed + left) == _refs(carried + fresh)
        assert all(row.tokens <= capacity for row in rows)
        assert all(1 <= item.waited <= MAX_WAIT for item in left)
        ranks = assign_rows(rows, dp)
        assert sorted(i for r in ranks for i in r) == list(range(rows_per_step))
        assert all(len(r) == rows_per_step // dp for r in ranks)
        tokens, vision = rank_loads(rows, ranks)
        tokens_ratio.append(imbalance(tokens))
        vision_ratio.append(imbalance(vision))
        carried = left
    assert sum(tokens_ratio) / 50 <= 1.05, tokens_ratio
    assert sum(vision_ratio) / 50 <= 1.05, vision_ratio


def _refs(items: list[Item]) -> list[tuple]:
    return sorted(item.ref for item in items)


def test_unpacked_rows_are_the_first_candidates():
    items = _items(0, 10)
    rows, left = pack_rows(items[:2], items[2:], 4, 4096, packing=False)
    assert [r.items for r in rows] == [[i] for i in items[:4]] and left == items[4:]


def test_the_stream_is_a_function_of_seed_and_draws(mantis_out):
    """Two streams from a saved state draw what the original drew next; each member gives
    every sample once per epoch; token-share weights move the draws toward the cheaper
    dataset's share of tokens."""
    from energon_tasks.global_stream import Stream, StreamState, members

    data = members(mantis_out / "metadataset.yaml")
    assert len(data) > 1 and all(m.keys for m in data)
    stream = Stream(data, seed=3)
    first = [stream.draw() for _ in range(50)]
    saved = StreamState.from_plain(json.loads(json.dumps(stream.state.to_plain())), len(data))
    again = Stream(data, seed=3)
    assert [again.draw() for _ in range(50)] == first
    assert [Stream(data, seed=3, state=saved).draw() for _ in range(1)] == [stream.draw()]
    one = Stream(data[:1], seed=3)
    epoch = [one.draw()[1] for _ in range(len(data[0].keys))]
    assert sorted(epoch) == sorted(data[0].keys)
    by_tokens = Stream(data[:2], seed=3, by_tokens=True)
    for _ in range(400):
        ref = by_tokens.draw()
        by_tokens.observe(ref, 1000 if ref[0] == 0 else 100)  # member 0: 10x the tokens
    tokens = by_tokens.state.tokens
    weights = [m.weight for m in data[:2]]
    assert abs(tokens[0] / sum(tokens) - weights[0] / sum(weights)) < 0.1, tokens


PLAN = ["data.global_plan=true", "train.global_batch_size=4", "train.micro_batch_size=1",
        "task_encoder.packing=true", "log.sample_keys=true", "train.eval_interval=0", *FAST]


def _keys(out: Path) -> dict[int, list[str]]:
    """step -> the sorted keys all ranks trained."""
    steps: dict[int, list[str]] = {}
    for line in (out / "sample_keys.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], []).extend(row["keys"])
    return {step: sorted(keys) for step, keys in steps.items()}


@pytest.mark.slow
def test_dp2_trains_dp1s_samples_and_losses_and_resumes_at_any_dp(mantis_out, tmp_path):
    """DP 2 (two gloo ranks) trains at each step the very samples DP 1 does, the ranks'
    tokens and vision cost within 5 % of their mean, and the same losses and gradient norms
    (fp tolerance); a DP 2 run's step 2 resumed at DP 1, and that run's step 4 at DP 2 again,
    train the uninterrupted run's samples at every step, with its losses (the
    checkpoints' data position is the plan's, the same at any DP size)."""
    data = f"data.path={mantis_out}/metadataset.yaml"
    args = [str(MANTIS_CFG), data, *PLAN, "checkpoint.interval=2", "train.keep_checkpoints=0"]
    one, two = tmp_path / "dp1", tmp_path / "dp2"
    ok(train(*args, "train.steps=6", f"out={one}"))
    ok(train(*args, "train.steps=6", f"out={two}", nproc=2))
    assert _keys(one) == _keys(two) and len(_keys(one)) == 6
    assert losses(one) == pytest.approx(losses(two), rel=1e-4)
    assert [r["grad_norm"] for r in records(one)] == pytest.approx(
        [r["grad_norm"] for r in records(two)], rel=1e-3)
    for record in records(two):
        assert record["dp_tokens_max_over_mean"] <= 1.05, record
        assert record["dp_vision_max_over_mean"] <= 1.05, record
    # the DP 2 run's step-2 checkpoint resumed at DP 1 (to step 6, saving step 4), that one's
    # step 4 resumed at DP 2: each step trains what the uninterrupted run trained
    hop, back = tmp_path / "hop", tmp_path / "back"
    ok(train(*args, "train.steps=6", f"out={hop}",
             f"--resume={two / 'checkpoints' / 'step_000002'}"))
    ok(train(*args, "train.steps=6", f"out={back}",
             f"--resume={hop / 'checkpoints' / 'step_000004'}", nproc=2))
    uninterrupted = _keys(two)
    assert _keys(hop) == {s: uninterrupted[s] for s in range(3, 7)}
    assert _keys(back) == {s: uninterrupted[s] for s in range(5, 7)}
    assert losses(hop) == pytest.approx(losses(two)[2:], rel=1e-4)
    assert losses(back) == pytest.approx(losses(two)[4:], rel=1e-4)


def _clips(seed: int, n: int) -> list[Item]:
    """LLaVA-Video-like clips: 2-16 k tokens of a 16384-token row, vision ~ 4 x tokens."""
    rng = random.Random(seed)
    return [Item(("v", i), tokens, tokens * rng.uniform(3.9, 4.2))
            for i, tokens in enumerate(rng.randint(2500, 16000) for _ in range(n))]


def _plan(stream: list[Item], rows_per_step: int, steps: int, max_wait: int = MAX_WAIT):
    """(each step's rows, each ref's (step first offered, step trained)) of ``steps`` steps
    drawing candidates worth 1.5 steps' tokens (the loader's POOL) from ``stream``."""
    capacity, carried, taken, plans, when = 16384, [], 0, [], {}
    for step in range(steps):
        fresh, have = [], sum(i.tokens for i in carried)
        while have < 1.5 * rows_per_step * capacity:
            fresh.append(stream[taken])
            when[stream[taken].ref] = (step, None)
            have, taken = have + stream[taken].tokens, taken + 1
        rows, left = pack_rows(carried, fresh, rows_per_step, capacity, packing=True,
                               max_wait=max_wait)
        placed = [item for row in rows for item in row.items]
        assert _refs(placed + left) == _refs(carried + fresh)  # each once, whole
        assert all(row.tokens <= capacity for row in rows)
        for item in placed:
            when[item.ref] = (when[item.ref][0], step)
        plans.append(rows)
        carried = left
    return plans, when


@pytest.mark.parametrize("dp, rows_per_rank", [(2, 1), (8, 1), (8, 4)])
def test_video_rows_stay_whole_and_ranks_get_equal_work(dp, rows_per_rank):
    """Clips of up to a whole row, candidates worth 1.5 steps (the loader's POOL): over 40
    steps every candidate is placed exactly once (or carried), whole; at 4 rows per rank the
    ranks' tokens and vision are within 2 % of their mean on average (whole clips limit the
    rows' own balance; rank-level swaps of whole rows even them out)."""
    plans, _ = _plan(_clips(dp, 5000), dp * rows_per_rank, 40)
    ratios = []
    for rows in plans:
        ranks = assign_rows(rows, dp)
        assert sorted(i for r in ranks for i in r) == list(range(dp * rows_per_rank))
        assert all(len(r) == rows_per_rank for r in ranks)
        tokens, vision = rank_loads(rows, ranks)
        ratios.append(max(imbalance(tokens), imbalance(vision)))
    if rows_per_rank > 1:
        assert sum(ratios) / len(ratios) <= 1.02, ratios


@pytest.mark.parametrize("kind, rows_per_step, max_wait", [
    ("clips", 2, MAX_WAIT), ("clips", 8, MAX_WAIT), ("mix", 16, MAX_WAIT), ("clips", 8, 2)])
def test_a_candidate_left_out_is_trained_within_max_wait_steps(kind, rows_per_step, max_wait):
    """Bounded waiting: over 60 steps, every candidate offered at step s that the run trained is
    trained by step s + max_wait, and those offered early enough all are; candidates do wait
    (the plan chooses which to train), some up to the bound. Clips of up to a whole row at 2
    rows per step are the hard case: the candidates left out can outnumber the rows."""
    stream = _clips(rows_per_step, 3000) if kind == "clips" else _items(rows_per_step, 20000)
    if kind == "mix":
        stream = [Item(i.ref, i.tokens * 4, i.vision) for i in stream]  # 16384-token rows
    steps = 60
    _, when = _plan(stream, rows_per_step, steps, max_wait)
    waits = [trained - offered for offered, trained in when.values() if trained is not None]
    assert max(waits) <= max_wait, max(waits)
    assert all(trained is not None for offered, trained in when.values()
               if offered < steps - max_wait)
    assert max(waits) >= 1


def test_the_plan_state_keeps_the_waits():
    """The carried samples' waits survive the checkpoint's plain JSON; a state saved before
    waits were kept reads as one step each."""
    from energon_tasks.global_stream import StreamState
    from energon_tasks.planned_loader import PlanState

    state = PlanState(3, StreamState(5, [5], [900]), [(0, "a"), (0, "b")], [2, 1])
    plain = json.loads(json.dumps(state.to_plain()))
    assert PlanState.from_plain(plain, 1) == state
    plain["carried"] = [[0, "a"], [0, "b"]]
    assert PlanState.from_plain(plain, 1).waited == [1, 1]
    with pytest.raises(ValueError, match="not a data plan state"):
        PlanState.from_plain({**plain, "carried": [[0]]}, 1)


def test_rank_swaps_fix_what_longest_processing_time_misses():
    """Rows of 8, 7, 6, 5, 4 and 2 units over two ranks of three rows: longest-processing-time
    scheduling alone gives 17 / 15 (8 + 5 + 4, 7 + 6 + 2); one swap of whole rows (8 and 7)
    evens them at 16 / 16."""
    from energon_tasks.global_plan import Row

    rows = [Row([], 1000 * units, 1000.0 * units) for units in (8, 7, 6, 5, 4, 2)]
    ranks = assign_rows(rows, 2)
    assert sorted(map(len, ranks)) == [3, 3]
    assert rank_loads(rows, ranks) == ([16000, 16000], [16000.0, 16000.0]), ranks
