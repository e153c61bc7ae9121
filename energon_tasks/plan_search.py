"""The local search of the global data plan (``energon_tasks.global_plan``): after the greedy
placement, ``balance_rows`` moves samples between the step's rows, and between the rows and the
samples left for the next step, so that the rows' tokens and vision cost come out as even as
possible; after the rank assignment, ``balance_ranks`` swaps whole rows between ranks.

A row's (or rank's) load is its tokens or its vision cost over the rows' (ranks') means,
whichever is larger; both searches make, round after round, the one move that lowers the
largest load most (ties: the first found), until none lowers it by 1e-4 or it is within 0.2 % of
the mean; while it is over 1 % above the mean, a move also counts first when it lowers the most
loaded row's own load with no other row rising above it (rows sharing the largest load, a
plateau, come down one by one; a search scored by the largest load alone stops there). Each
round is a few numpy operations over the step's samples, not a Python loop over pairs of them
(``bench/bench_data_plan.py`` reports the planning time per step). Every rank and loader worker
must come to the same plan: totals are exact sums (``math.fsum``), the rest is
element-wise IEEE arithmetic and first-index ties, the same on any machine.
"""

from __future__ import annotations

import math

import numpy as np

_EPS = 1e-9
_GAIN = 1e-4  #: a move must lower the largest load by more than this
_EVEN = 1.002  #: the search stops once the largest load is within this of the mean
_GIVE_BACK = 0.01  #: the share of the rows' tokens the search may leave out for the next step
_LOW_ROWS = 3
#: above this largest load, a move counts when it lowers the most loaded row's own load while
#: no other row rises above it, even if other rows share the largest load (a plateau)
_PLATEAU = 1.01  #: the least loaded rows that trade with the samples left out


def _over(value, mean):
    """value / mean, 0 where the mean is 0 (no vision at all: text only)."""
    mean = np.asarray(mean, dtype=np.float64)
    safe = np.where(mean > 0, mean, 1.0)
    return np.where(mean > 0, np.asarray(value, dtype=np.float64) / safe, 0.0)


def _load(tokens, vision, mean_t, mean_v):
    return np.maximum(_over(tokens, np.maximum(mean_t, _EPS)), _over(vision, mean_v))


def _rest(loads: np.ndarray, order: np.ndarray) -> np.ndarray:
    """rest[r]: the largest load of the units other than ``order[0]`` (the most loaded) and r."""
    rest = np.full(len(loads), loads[order[1]] if len(loads) > 1 else 0.0)
    if len(loads) > 1:
        rest[order[1]] = loads[order[2]] if len(loads) > 2 else 0.0
    return rest


def _best_exchange(unit_t, unit_v, owner, sizes_t, sizes_v, capacity, plateau=False):
    """The best move or swap of one element of the most loaded unit with another unit's:
    (score, [(element, new unit), ...]) or None. ``owner[i]``: the unit of element i (-1: not in
    any unit); elements move only when ``capacity`` (tokens) allows (None: swaps only, the units
    keep their sizes); with ``plateau``, scored by the two units' new loads alone."""
    count = len(unit_t)
    mean_t, mean_v = math.fsum(unit_t) / count, math.fsum(unit_v) / count
    loads = _load(unit_t, unit_v, mean_t, mean_v)
    order = np.argsort(-loads, kind="stable")
    worst, rest = order[0], _rest(loads, order)
    if plateau:
        rest = np.zeros_like(rest)
    best, change = loads[worst] - _GAIN, None
    if loads[worst] <= _EVEN:
        return None
    mine = np.flatnonzero(owner == worst)
    theirs = np.flatnonzero((owner >= 0) & (owner != worst))
    if not mine.size or count < 2:
        return None
    ta, va = sizes_t[mine, None], sizes_v[mine, None]
    if capacity is not None:  # a moves to unit r
        score = np.maximum(np.maximum(_load(unit_t[worst] - ta, unit_v[worst] - va, mean_t,
                                            mean_v),
                                      _load(unit_t + ta, unit_v + va, mean_t, mean_v)), rest)
        score[(unit_t + ta > capacity)] = np.inf
        score[:, worst] = np.inf
        i = int(np.argmin(score))
        if score.flat[i] < best:
            a, r = divmod(i, count)
            best, change = score.flat[i], [(int(mine[a]), int(r))]
    if theirs.size:  # a and b swap
        target = owner[theirs]
        tb, vb = sizes_t[theirs][None, :], sizes_v[theirs][None, :]
        worst_t, other_t = unit_t[worst] - ta + tb, unit_t[target] - tb + ta
        score = np.maximum(np.maximum(
            _load(worst_t, unit_v[worst] - va + vb, mean_t, mean_v),
            _load(other_t, unit_v[target] - vb + va, mean_t, mean_v)), rest[target])
        if capacity is not None:
            score[(worst_t > capacity) | (other_t > capacity)] = np.inf
        i = int(np.argmin(score))
        if score.flat[i] < best:
            a, b = divmod(i, len(theirs))
            best, change = score.flat[i], [(int(mine[a]), int(target[b])),
                                           (int(theirs[b]), int(worst))]
    return None if change is None else (best, change)


def _best_trade(row_t, row_v, where, sizes_t, sizes_v, capacity, fixed, floor, pairs,
                plateau=False):
    """The best trade of one of the rows (the most loaded and the least loaded ones) with the
    samples left out: a row gives one of its own (not a ``fixed`` one) for one left out, or for
    nothing, or takes one for nothing; with ``pairs``, the least loaded rows take two left out,
    for nothing or for one of their own; the rows' tokens stay at ``floor`` or more; with
    ``plateau``, the most loaded row's trades are scored by its own new load (the others may not
    rise above its load). (score, change) or None."""
    count = len(row_t)
    sum_t, sum_v = math.fsum(row_t), math.fsum(row_v)
    loads = _load(row_t, row_v, sum_t / count, sum_v / count)
    order = np.argsort(-loads, kind="stable")
    best, change = loads[order[0]] - _GAIN, None
    if loads[order[0]] <= _EVEN:
        return None
    left = np.flatnonzero(where == -1)
    if pairs:
        if len(left) > 48:  # an even spread of their sizes
            by_size = left[np.argsort(sizes_t[left], kind="stable")]
            left = by_size[np.linspace(0, len(by_size) - 1, 48).round().astype(int)]
        first, second = np.triu_indices(len(left), k=1)
        ins = [np.stack([left[first], left[second]], axis=1)]
        rows = order[::-1][:_LOW_ROWS]
    else:
        ins = [np.full((1, 1), -1), left[:, None]]
        rows = dict.fromkeys([int(order[0]), *order[::-1][:_LOW_ROWS].tolist()])
    ins = np.concatenate(ins) if ins[-1].size else ins[0]
    if not ins.size:
        return None
    present = ins >= 0
    in_t = np.where(present, sizes_t[ins], 0.0).sum(axis=1)[None, :]
    in_v = np.where(present, sizes_v[ins], 0.0).sum(axis=1)[None, :]
    for row in rows:
        outs = np.concatenate([[-1], np.flatnonzero(where == row)])
        outs = outs[(outs == -1) | ~fixed[outs]]
        out_t = np.where(outs >= 0, sizes_t[outs], 0.0)[:, None]
        out_v = np.where(outs >= 0, sizes_v[outs], 0.0)[:, None]
        others = np.arange(count) != row
        top_t = row_t[others].max() if count > 1 else 0.0
        top_v = row_v[others].max() if count > 1 else 0.0
        new_t, new_v = row_t[row] - out_t + in_t, row_v[row] - out_v + in_v
        mean_t = np.maximum((sum_t - out_t + in_t) / count, _EPS)
        mean_v = (sum_v - out_v + in_v) / count
        others = np.maximum(_over(top_t, mean_t), _over(top_v, mean_v))
        if plateau and row == order[0]:
            others = np.where(others > loads[order[0]], np.inf, 0.0)
        score = np.maximum(others, _load(new_t, new_v, mean_t, mean_v))
        score[(new_t > capacity) | (sum_t - out_t + in_t < floor)] = np.inf
        if not pairs:
            score[0, 0] = np.inf  # nothing for nothing
        i = int(np.argmin(score))
        if score.flat[i] < best:
            o, j = divmod(i, score.shape[1])
            best = score.flat[i]
            change = [(int(b), int(row)) for b in ins[j] if b >= 0]
            change += [(int(outs[o]), -1)] if outs[o] >= 0 else []
    return None if change is None else (best, change)


def balance_rows(sizes_t: np.ndarray, sizes_v: np.ndarray, where: np.ndarray, rows: int,
                 capacity: int, fixed: np.ndarray, rounds: int = 0) -> None:
    """Even the ``rows`` rows' tokens and vision cost: ``where[i]`` is the row of candidate i
    (-1: left for the next step), updated in place; the ``fixed`` candidates (a mask: the due
    ones) are never left out. Per round, the best of: the most loaded row gives a sample
    to another row or swaps one with one; the most loaded or one of the least loaded rows gives
    one back, takes one left out, or swaps one of its own for one (while the largest load is
    over ``_PLATEAU``, first scored as a plateau move: the most loaded row's own new load, so
    that rows sharing the largest load come down one by one; then as usual); when none helps,
    one of the least loaded rows takes two left out, for nothing or for one of its own (rows of
    few large samples: video clips). At most ``rounds`` moves (default 4 per row, plus 32)."""
    placed = where >= 0
    floor = math.fsum(sizes_t[placed]) - _GIVE_BACK * rows * capacity
    for _ in range(rounds or 4 * rows + 32):
        placed = where >= 0
        row_t = np.bincount(where[placed], sizes_t[placed], minlength=rows)
        row_v = np.bincount(where[placed], sizes_v[placed], minlength=rows)
        loads = _load(row_t, row_v, math.fsum(row_t) / rows, math.fsum(row_v) / rows)
        moves = []
        for plateau in [True] * bool(loads.max() > _PLATEAU) + [False]:
            moves = [_best_exchange(row_t, row_v, where, sizes_t, sizes_v, capacity, plateau),
                     _best_trade(row_t, row_v, where, sizes_t, sizes_v, capacity, fixed, floor,
                                 False, plateau)]
            moves = [m for m in moves if m is not None]
            if moves:
                break
        if not moves:
            moves = [m for m in [_best_trade(row_t, row_v, where, sizes_t, sizes_v, capacity,
                                             fixed, floor, True)] if m is not None]
        if not moves:
            return
        for candidate, row in min(moves, key=lambda m: m[0])[1]:
            where[candidate] = row


def balance_ranks(row_t: np.ndarray, row_v: np.ndarray, rank_of: np.ndarray, ranks: int,
                  rounds: int = 0) -> None:
    """Even the ranks' tokens and vision cost by swapping whole rows (each rank keeps its number
    of rows): ``rank_of[i]`` is the rank of row i, updated in place; at most ``rounds`` swaps
    (default 4 per rank)."""
    for _ in range(rounds or 4 * ranks):
        rank_t = np.bincount(rank_of, row_t, minlength=ranks)
        rank_v = np.bincount(rank_of, row_v, minlength=ranks)
        move = _best_exchange(rank_t, rank_v, rank_of, row_t, row_v, None)
        if move is None:
            return
        for row, rank in move[1]:
            rank_of[row] = rank
