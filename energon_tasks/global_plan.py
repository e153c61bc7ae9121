"""The plan of one optimizer step over every data-parallel rank: which samples form the global
batch's rows, and which rank trains which row, so that every rank gets the same tokens and the
same vision-encoder work (pure functions of the samples' metadata-based sizes).

A step trains ``rows`` rows (the global batch, ``train.global_batch_size``) of at most
``capacity`` tokens. ``pack_rows`` fills them from the candidates, in order, DP-independently:

- with packing, several samples share a row (never a split sample: a visual span is never cut);
  the candidates carried over from earlier steps are placed first (the oldest first), then the
  fresh ones by decreasing vision cost (then tokens), each into the row with the least vision
  cost that has room for its tokens (ties: the fewest tokens, then the first row), so that the
  rows come out with nearly equal vision cost, the text-only ones into the emptiest rows;
  then a local search (``plan_search.balance_rows``) moves and swaps samples between the rows
  and with the candidates left out, to even the rows' tokens and vision cost; a candidate left
  out waits for a later step, at most ``MAX_WAIT`` steps: one that has waited that long is due
  and placed first, and the search never leaves it out (when the next step could not place all
  of its due ones, the step is planned again with the deadline one step earlier);
- without packing, a row is one sample: the first ``rows`` candidates.

``assign_rows`` gives each rank ``rows / dp`` rows: longest-processing-time scheduling on the
rows' vision cost (ties: tokens) with that many rows per rank, then swaps of whole rows between
the most loaded rank and the others (``plan_search.balance_ranks``), so that the vision work and
the tokens of the ranks are nearly equal; ``imbalance`` is max / mean over the ranks (1.0 =
equal).
The loss is the mean over the whole global batch's supervised tokens (train.py's normalisation),
so which rank trains which row changes nothing but the time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from energon_tasks.plan_search import balance_ranks, balance_rows


@dataclass(frozen=True, slots=True)
class Item:
    """One sample as the plan sees it."""

    ref: tuple  #: where it comes from (``global_stream.SampleRef``), carried as is
    tokens: int  #: tokens once encoded (the budget plan's, from metadata)
    vision: float  #: estimated vision-encoder cost (the model's cost model; 0: text only)
    waited: int = 0  #: steps it has been left out of so far (a candidate carried over)


@dataclass(slots=True)
class Row:
    """One row of the global batch: its samples in order, their tokens and vision cost."""

    items: list[Item] = field(default_factory=list)
    tokens: int = 0
    vision: float = 0.0

    def add(self, item: Item) -> None:
        self.items.append(item)
        self.tokens += item.tokens
        self.vision += item.vision


#: steps a candidate may be left out; then it is due and goes first (bench/bench_data_plan.py)
MAX_WAIT = 3


def pack_rows(carried: Sequence[Item], fresh: Sequence[Item], rows: int, capacity: int,
              packing: bool, max_wait: int = MAX_WAIT) -> tuple[list[Row], list[Item]]:
    """(the step's rows, the candidates left for the next step, in their order, each with
    ``waited`` one more) of the candidates ``carried`` over from the previous step and ``fresh``
    from the stream; see the module docstring. A candidate is left out at most ``max_wait``
    steps: one that has waited that long is due (placed first, never left out by the local
    search), and the step leaves out no more than the next step can place first (else the
    step is planned again with the deadline one step earlier). Rows may stay empty when the
    candidates run out."""
    candidates = [*carried, *fresh]
    if not packing:
        chosen = [_one(item) for item in candidates[:rows]]
        return chosen + [Row() for _ in range(rows - len(chosen))], candidates[rows:]
    for deadline in range(max_wait, 0, -1):
        placed, where = _pack(candidates, rows, capacity, deadline)
        late = [c for c, w in zip(candidates, where, strict=True)
                if w < 0 and c.waited + 1 >= max_wait]
        if (_greedy(late, _largest_first(late, range(len(late))), rows, capacity)[1] >= 0).all():
            break  # the next step can place its due ones
    return placed, [replace(candidates[i], waited=candidates[i].waited + 1)
                    for i in np.flatnonzero(where == -1)]


def _largest_first(candidates: Sequence[Item], positions) -> list[int]:
    return sorted(positions, key=lambda i: (-candidates[i].vision, -candidates[i].tokens, i))


def _pack(candidates: Sequence[Item], rows: int, capacity: int,
          deadline: int) -> tuple[list[Row], np.ndarray]:
    """(rows, each candidate's row: -1 for none): the candidates that waited ``deadline`` steps
    placed first (in their order, or largest first when that leaves one out), then the other
    carried ones in their order, then the fresh ones largest first; then the local search, which
    may leave out any but a due one."""
    due = [i for i, c in enumerate(candidates) if c.waited >= deadline]
    rest = [i for i, c in enumerate(candidates) if 0 < c.waited < deadline]
    rest += _largest_first(candidates, [i for i, c in enumerate(candidates) if not c.waited])
    placed, where = _greedy(candidates, [*due, *rest], rows, capacity)
    if (where[due] < 0).any():  # a due one did not fit: the largest first
        placed, where = _greedy(candidates, [*_largest_first(candidates, due), *rest], rows,
                                capacity)
    fixed = np.zeros(len(candidates), dtype=bool)
    fixed[due] = True
    balance_rows(np.array([c.tokens for c in candidates], dtype=np.float64),
                 np.array([c.vision for c in candidates], dtype=np.float64), where, rows,
                 capacity, fixed)
    for r, row in enumerate(placed):  # each row in stream order (loss-neutral)
        row.items = [candidates[i] for i in np.flatnonzero(where == r)]
        row.tokens = sum(item.tokens for item in row.items)
        row.vision = sum(item.vision for item in row.items)
    return placed, where


def _greedy(candidates: Sequence[Item], order: list[int], rows: int,
            capacity: int) -> tuple[list[Row], np.ndarray]:
    """(rows, each candidate's row: -1 for none) of the candidates placed in ``order``, each into
    the row with the least vision cost that has room (text only: the fewest tokens)."""
    placed = [Row() for _ in range(rows)]
    where = np.full(len(candidates), -1)
    for i in order:
        item = candidates[i]
        fits = [r for r in range(rows) if placed[r].tokens + item.tokens <= capacity]
        if not fits:
            continue
        if item.vision > 0:
            best = min(fits, key=lambda r: (placed[r].vision, placed[r].tokens, r))
        else:  # text only: the emptiest row
            best = min(fits, key=lambda r: (placed[r].tokens, r))
        placed[best].add(item)
        where[i] = best
    return placed, where


def _one(item: Item) -> Row:
    row = Row()
    row.add(item)
    return row


def assign_rows(rows: Sequence[Row], dp: int) -> list[list[int]]:
    """Row indices of each of ``dp`` ranks (``len(rows) / dp`` each, ascending); see the
    module docstring.

    Raises:
        ValueError: ``dp`` does not divide the rows.
    """
    if len(rows) % dp:
        raise ValueError(f"{len(rows)} rows do not divide over {dp} data-parallel ranks")
    per_rank = len(rows) // dp
    load = [[0.0, 0, r] for r in range(dp)]  # vision, tokens, rank
    ranks: list[list[int]] = [[] for _ in range(dp)]
    order = sorted(range(len(rows)), key=lambda i: (-rows[i].vision, -rows[i].tokens, i))
    for i in order:
        open_ranks = [entry for entry in load if len(ranks[entry[2]]) < per_rank]
        entry = min(open_ranks, key=lambda e: (e[0], e[1], e[2]))
        entry[0] += rows[i].vision
        entry[1] += rows[i].tokens
        ranks[entry[2]].append(i)
    rank_of = np.empty(len(rows), dtype=np.int64)
    for rank, indices in enumerate(ranks):
        rank_of[indices] = rank
    balance_ranks(np.array([row.tokens for row in rows], dtype=np.float64),
                  np.array([row.vision for row in rows], dtype=np.float64), rank_of, dp)
    return [np.flatnonzero(rank_of == rank).tolist() for rank in range(dp)]


def imbalance(values: Sequence[float]) -> float:
    """max / mean (1.0 when all are equal or all zero)."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


def rank_loads(rows: Sequence[Row], ranks: Sequence[Sequence[int]]) -> tuple[list[int],
                                                                               list[float]]:
    """(tokens, vision cost) of each rank."""
    return ([sum(rows[i].tokens for i in r) for r in ranks],
            [sum(rows[i].vision for i in r) for r in ranks])
