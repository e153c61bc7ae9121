"""The plan of one optimizer step over every data-parallel rank: which samples form the global
batch's rows, and which rank trains which row, so that every rank gets the same tokens and the
same vision-encoder work (pure functions of the samples' metadata-based sizes).

A step trains ``rows`` rows (the global batch, ``train.global_batch_size``) of at most
``capacity`` tokens. ``pack_rows`` fills them from the candidates, in order, DP-independently:

- with packing, several samples share a row (never a split sample: a visual span is never cut);
  samples are placed by decreasing vision cost (then tokens) into the row with the least vision
  cost that has room for their tokens (ties: the fewest tokens, then the first row), so that the
  rows come out with nearly equal vision cost, then the text-only ones into the emptiest rows;
  a candidate no row has room for waits for the next step (it goes first there);
- without packing, a row is one sample: the first ``rows`` candidates.

``assign_rows`` gives each rank ``rows / dp`` rows: longest-processing-time scheduling on the
rows' vision cost (ties: tokens) with that many rows per rank, so that the vision work and the
tokens of the ranks are nearly equal; ``imbalance`` is max / mean over the ranks (1.0 = equal).
The loss is the mean over the whole global batch's supervised tokens (train.py's normalisation),
so which rank trains which row changes nothing but the time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


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
    candidates ``carried`` over from the previous step (placed first, in their order, so none
    waits twice for long) and ``fresh`` from the stream; see the module docstring. Rows may stay
    empty when the candidates run out."""
    candidates = [*carried, *fresh]
    if not packing:
        chosen = [_one(item) for item in candidates[:rows]]
        return chosen + [Row() for _ in range(rows - len(chosen))], candidates[rows:]
    placed = [Row() for _ in range(rows)]
    slots: list[list[int]] = [[] for _ in range(rows)]  # candidate positions per row
    left = []
    fresh_order = sorted(range(len(carried), len(candidates)),
                         key=lambda i: (-candidates[i].vision, -candidates[i].tokens, i))
    for i in [*range(len(carried)), *fresh_order]:
        item = candidates[i]
        fits = [r for r in range(rows) if placed[r].tokens + item.tokens <= capacity]
        if not fits:
            left.append(i)
            continue
        if item.vision > 0:
            best = min(fits, key=lambda r: (placed[r].vision, placed[r].tokens, r))
        else:  # text only: the emptiest row
            best = min(fits, key=lambda r: (placed[r].tokens, r))
        placed[best].add(item)
        slots[best].append(i)
    _balance(placed, slots, left, candidates, capacity)
    for row, positions in zip(placed, slots):  # each row in stream order (loss-neutral)
        row.items = [candidates[i] for i in sorted(positions)]
        row.tokens = sum(item.tokens for item in row.items)
        row.vision = sum(item.vision for item in row.items)
    return placed, [candidates[i] for i in sorted(left)]


def _balance(rows: list[Row], slots: list[list[int]], left: list[int], candidates,
             capacity: int, rounds: int = 0) -> None:
    """Local search after the greedy placement, on the largest load (a row's tokens or vision
    cost over the rows' means, whichever is larger): the most loaded row gives a sample to
    another row or swaps one with another row, or the least loaded row takes a candidate left
    out or swaps one of its samples for one, whichever lowers the largest load most; until no
    move lowers it, at most ``rounds`` (default 4 per row) moves. Deterministic: ties go to the
    first move found."""
    count = len(rows)
    tokens = [r.tokens for r in rows]
    vision = [r.vision for r in rows]

    def largest(t: list, v: list) -> float:
        mean_t, mean_v = max(sum(t) / count, 1e-9), sum(v) / count
        return max(max(a / mean_t, b / mean_v if mean_v > 0 else 0.0) for a, b in zip(t, v))

    for _ in range(rounds or 16 * count):
        mean_t, mean_v = max(sum(tokens) / count, 1e-9), sum(vision) / count
        loads = [max(t / mean_t, v / mean_v if mean_v > 0 else 0.0)
                 for t, v in zip(tokens, vision)]

        def load(t: float, v: float, mean_t=mean_t, mean_v=mean_v) -> float:
            return max(t / mean_t, v / mean_v if mean_v > 0 else 0.0)

        worst = max(range(count), key=lambda r: (loads[r], -r))
        best, move = loads[worst], None
        for r in range(count):  # within the rows: totals and means stay
            if r == worst:
                continue
            rest = max((loads[q] for q in range(count) if q not in (r, worst)), default=0.0)
            if rest >= best:
                continue
            for a in slots[worst]:
                ta, va = candidates[a].tokens, candidates[a].vision
                if tokens[r] + ta <= capacity:  # a moves to r
                    score = max(rest, load(tokens[worst] - ta, vision[worst] - va),
                                load(tokens[r] + ta, vision[r] + va))
                    if score < best - 1e-9:
                        best, move = score, ("row", a, None, r)
                for b in slots[r]:  # a and b swap
                    tb, vb = candidates[b].tokens, candidates[b].vision
                    if tokens[worst] - ta + tb <= capacity and tokens[r] - tb + ta <= capacity:
                        score = max(rest, load(tokens[worst] - ta + tb, vision[worst] - va + vb),
                                    load(tokens[r] - tb + ta, vision[r] - vb + va))
                        if score < best - 1e-9:
                            best, move = score, ("row", a, b, r)
        low = min(range(count), key=lambda r: (loads[r], r))
        for b in left:  # the least loaded row takes b, for nothing or for one of its own
            tb, vb = candidates[b].tokens, candidates[b].vision
            for a in [None, *slots[low]]:
                ta = candidates[a].tokens if a is not None else 0
                va = candidates[a].vision if a is not None else 0.0
                if tokens[low] - ta + tb > capacity or tb <= ta:
                    continue
                t, v = list(tokens), list(vision)
                t[low], v[low] = t[low] - ta + tb, v[low] - va + vb
                score = largest(t, v)
                if score < best - 1e-9:
                    best, move = score, ("left", a, b, low)
        if move is None:
            return
        kind, a, b, r = move
        if kind == "row":
            slots[worst].remove(a)
            slots[r].append(a)
            _shift(tokens, vision, candidates[a], worst, r)
            if b is not None:
                slots[r].remove(b)
                slots[worst].append(b)
                _shift(tokens, vision, candidates[b], r, worst)
        else:
            left.remove(b)
            slots[r].append(b)
            tokens[r] += candidates[b].tokens
            vision[r] += candidates[b].vision
            if a is not None:
                slots[r].remove(a)
                left.append(a)
                tokens[r] -= candidates[a].tokens
                vision[r] -= candidates[a].vision


def _shift(tokens: list, vision: list, item: Item, source: int, target: int) -> None:
    tokens[source] -= item.tokens
    vision[source] -= item.vision
    tokens[target] += item.tokens
    vision[target] += item.vision


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
    return [sorted(indices) for indices in ranks]


def imbalance(values: Sequence[float]) -> float:
    """max / mean (1.0 when all are equal or all zero)."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


def rank_loads(rows: Sequence[Row], ranks: Sequence[Sequence[int]]) -> tuple[list[int],
                                                                               list[float]]:
    """(tokens, vision cost) of each rank."""
    return ([sum(rows[i].tokens for i in r) for r in ranks],
            [sum(rows[i].vision for i in r) for r in ranks])
