"""The plan of one optimizer step over every data-parallel rank: which samples form the global
batch's rows, and which rank trains which row, so that every rank gets the same tokens and the
same vision-encoder work (pure functions of the samples' metadata-based sizes).

A step trains ``rows`` rows (the global batch, ``train.global_batch_size``) of at most
``capacity`` tokens. ``pack_rows`` fills them from the candidates, in order, DP-independently:

- with packing, several samples share a row (never a split sample: a visual span is never cut);
  samples are placed by decreasing vision cost (then tokens) into the row with the least vision
  cost that has room for their tokens (ties: the fewest tokens, then the first row), so that the
  rows come out with nearly equal vision cost, then the text-only ones into the emptiest rows;
  a candidate no row has room for waits for the next step (it goes first there); then a local
  search (``plan_search.balance_rows``) moves and swaps samples between the rows and with the
  candidates left out, to even the rows' tokens and vision cost;
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
from dataclasses import dataclass, field

import numpy as np

from energon_tasks.plan_search import balance_ranks, balance_rows


@dataclass(frozen=True, slots=True)
class Item:
    """One sample as the plan sees it."""

    ref: tuple  #: where it comes from (``global_stream.SampleRef``), carried as is
    tokens: int  #: tokens once encoded (the budget plan's, from metadata)
    vision: float  #: estimated vision-encoder cost (the model's cost model; 0: text only)


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


def pack_rows(carried: Sequence[Item], fresh: Sequence[Item], rows: int, capacity: int,
              packing: bool) -> tuple[list[Row], list[Item]]:
    """(the step's rows, the candidates left for the next step, in their order) of the
    candidates ``carried`` over from the previous step (placed first, in their order, or
    largest first when that leaves one out; never left out again by the local search, so none
    waits twice) and ``fresh`` from the stream; see
    the module docstring. Rows may stay empty when the candidates run out."""
    candidates = [*carried, *fresh]
    if not packing:
        chosen = [_one(item) for item in candidates[:rows]]
        return chosen + [Row() for _ in range(rows - len(chosen))], candidates[rows:]

    def largest_first(positions: range) -> list[int]:
        return sorted(positions, key=lambda i: (-candidates[i].vision, -candidates[i].tokens, i))

    fresh_order = largest_first(range(len(carried), len(candidates)))
    placed, where = _greedy(candidates, [*range(len(carried)), *fresh_order], rows, capacity)
    if (where[:len(carried)] < 0).any():  # a carried one did not fit: the largest first
        placed, where = _greedy(candidates, [*largest_first(range(len(carried))),
                                             *fresh_order], rows, capacity)
    balance_rows(np.array([c.tokens for c in candidates], dtype=np.float64),
                 np.array([c.vision for c in candidates], dtype=np.float64), where, rows,
                 capacity, fixed=len(carried))
    for r, row in enumerate(placed):  # each row in stream order (loss-neutral)
        row.items = [candidates[i] for i in np.flatnonzero(where == r)]
        row.tokens = sum(item.tokens for item in row.items)
        row.vision = sum(item.vision for item in row.items)
    return placed, [candidates[i] for i in np.flatnonzero(where == -1)]


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
