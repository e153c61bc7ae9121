"""Vision encoder data-parallel over the context-parallel (CP) group, balanced by cost.

Every CP rank of one data-parallel replica holds the same samples. Without this module each of
them would run the vision encoder on ALL images. Here each rank encodes a share of whole images
and whole temporal slices of videos, then the embeddings are gathered so every rank again holds
the full sequence, in the original order.

Stages of :class:`VisionDPOverCP` (``__call__``):

1. plan: :func:`plan_shares` splits units (an image, or one temporal slice of a video) over the
   CP ranks to balance ``CostModel`` cost. Pure function of ``grid_thw``: every rank computes
   the same plan, so no sizes are exchanged.
2. encode: the rank runs ``encode(pixel_rows_of_its_share, grid_of_its_share)``.
3. gather: pad to the longest share, ``all_gather_into_tensor``; backward ``reduce_scatter_tensor``
   (sums every rank's gradient of this rank's share). Both accept a fixed size per rank, which is
   what gloo supports (uneven ``all_gather`` / ``all_to_all(list)`` fail there).
4. reorder: rank-major rows -> original order (an index_select, its backward an index_add).

Encoder parameter gradients on a rank then come from its share only; the caller must sum them
over the CP group (megatron DDP does: it reduces grads over DP x CP), which gives exactly the
gradient of the unsharded run. See docs/internals/vision_dp.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

EncodeFn = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | Sequence[torch.Tensor]"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Estimated encoder cost of one unit (an image or one temporal slice) of ``p`` patches:
    ``per_patch * p + per_patch_sq * p**2`` (only the ratio matters).

    Defaults: Qwen2.5-VL ViT forward FLOPs (32 layers, hidden 1280, gated MLP 3420, window
    attention of 64 patches except 4 full-attention layers): 1.27e9 * p + 2.05e4 * p**2 FLOPs,
    normalised; each family package holds its towers' cost models. Calibrate on the target
    hardware with :meth:`fit` on measured per-image encoder times (forward + backward) over a
    range of sizes.
    """

    per_patch: float = 1.0  #: linear term (patch embed, MLPs, projections, window attention)
    per_patch_sq: float = 1.6e-5  #: quadratic term (full attention within the unit)

    def cost(self, patches: int) -> float:
        return self.per_patch * patches + self.per_patch_sq * patches * patches

    @classmethod
    def fit(cls, patches: Sequence[int], seconds: Sequence[float]) -> CostModel:
        """Least-squares ``seconds ~ a*p + b*p**2`` (no intercept), normalised to a = 1.

        Raises:
            ValueError: fewer than 2 measurements, or a non-positive fitted linear term.
        """
        if len(patches) < 2 or len(patches) != len(seconds):
            raise ValueError(f"fit needs >= 2 (patches, seconds) pairs, got {len(patches)}")
        p = torch.tensor(patches, dtype=torch.float64)
        y = torch.tensor(seconds, dtype=torch.float64)
        a, b = torch.linalg.lstsq(torch.stack([p, p * p], 1), y[:, None]).solution[:, 0].tolist()
        if a <= 0:
            raise ValueError(f"fitted per-patch cost {a:.3g} <= 0: measure more/larger sizes")
        return cls(per_patch=1.0, per_patch_sq=max(b, 0.0) / a)


@dataclass(frozen=True, slots=True)
class Segment:
    """Temporal slices ``[t_start, t_stop)`` of row ``item`` of ``grid_thw``."""

    item: int
    t_start: int
    t_stop: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardPlan:
    """Which slices of which item every CP rank encodes."""

    grid: tuple[tuple[int, int, int], ...]  #: the full grid_thw, one (t, h, w) per item
    merge_size: int
    shares: tuple[tuple[Segment, ...], ...]  #: per rank, in original order, contiguous merged
    costs: tuple[float, ...]  #: estimated cost per rank

    @property
    def cp_size(self) -> int:
        return len(self.shares)

    def imbalance(self) -> float:
        """max / mean estimated cost over ranks (1.0 = perfect; 1.0 when nothing to encode)."""
        mean = sum(self.costs) / len(self.costs)
        return max(self.costs) / mean if mean > 0 else 1.0

    def _slice_rows(self, seg: Segment, per_token: bool) -> tuple[int, int]:
        """Row range of a segment in pixel rows (or output tokens when per_token)."""
        div = self.merge_size**2 if per_token else 1
        off = sum(t * h * w for t, h, w in self.grid[: seg.item]) // div
        _, h, w = self.grid[seg.item]
        return off + seg.t_start * h * w // div, off + seg.t_stop * h * w // div

    def local_grid(self, rank: int) -> list[tuple[int, int, int]]:
        return [(s.t_stop - s.t_start, *self.grid[s.item][1:]) for s in self.shares[rank]]

    def rows(self, rank: int, per_token: bool = False) -> list[tuple[int, int]]:
        return [self._slice_rows(s, per_token) for s in self.shares[rank]]

    def tokens(self, rank: int) -> int:
        return sum(b - a for a, b in self.rows(rank, per_token=True))

    def order(self) -> torch.Tensor:
        """Index into the rank-major concatenation of shares that restores the original order."""
        starts, lengths, pos = [], [], 0
        for rank in range(self.cp_size):
            for a, b in self.rows(rank, per_token=True):
                starts.append((a, pos))
                lengths.append(b - a)
                pos += b - a
        total = pos
        idx = torch.empty(total, dtype=torch.long)
        for (a, p), n in zip(starts, lengths, strict=True):
            idx[a : a + n] = torch.arange(p, p + n)
        return idx


def _check_grid(grid_thw: torch.Tensor | Sequence, merge_size: int) -> list[tuple[int, int, int]]:
    grid = [tuple(int(v) for v in row) for row in (grid_thw.tolist() if torch.is_tensor(grid_thw)
                                                   else grid_thw)]
    for i, (t, h, w) in enumerate(grid):
        if t < 1 or h % merge_size or w % merge_size:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: needs t >= 1 and h, w multiples of "
                             f"merge_size {merge_size}")
    return grid


def _make_plan(grid, merge_size, assignment, loads) -> ShardPlan:
    """assignment: rank -> list of (item, t) units; merges contiguous slices into segments."""
    shares = []
    for units in assignment:
        segs: list[Segment] = []
        for item, t in sorted(units):
            if segs and segs[-1].item == item and segs[-1].t_stop == t:
                segs[-1] = Segment(item, segs[-1].t_start, t + 1)
            else:
                segs.append(Segment(item, t, t + 1))
        shares.append(tuple(segs))
    return ShardPlan(grid=tuple(grid), merge_size=merge_size, shares=tuple(shares),
                     costs=tuple(loads))


def plan_shares(
    grid_thw: torch.Tensor | Sequence,
    merge_size: int,
    cp_size: int,
    cost_model: CostModel | None = None,
    *,
    split_videos: bool = True,
) -> ShardPlan:
    """Cost-balanced split of whole images and whole temporal slices over ``cp_size`` ranks.

    Greedy LPT (largest unit first onto the least-loaded rank) followed by a move/swap
    refinement of the most-loaded rank. Deterministic: a pure function of its arguments (ties
    break by unit order and lowest rank), so every CP rank computes the same plan.

    Raises:
        ValueError: a malformed grid row (named) or cp_size < 1.
    """
    if cp_size < 1:
        raise ValueError(f"cp_size {cp_size}: must be >= 1")
    cm = cost_model or CostModel()
    grid = _check_grid(grid_thw, merge_size)
    units = []  # (cost, (item, t) list): a video is one unit per slice, or one unit
    for i, (t, h, w) in enumerate(grid):
        if split_videos:
            units += [(cm.cost(h * w), [(i, k)]) for k in range(t)]
        else:
            units.append((t * cm.cost(h * w), [(i, k) for k in range(t)]))
    order = sorted(range(len(units)), key=lambda u: (-units[u][0], u))
    loads = [0.0] * cp_size
    owner = [0] * len(units)
    for u in order:
        r = min(range(cp_size), key=lambda k: (loads[k], k))
        owner[u] = r
        loads[r] += units[u][0]
    _refine(units, owner, loads)
    if split_videos:  # slices of one item cost the same: give each rank a contiguous run
        base = 0
        for t, _, _ in grid:
            owner[base : base + t] = sorted(owner[base : base + t])
            base += t
    assignment: list[list] = [[] for _ in range(cp_size)]
    for u, r in enumerate(owner):
        assignment[r] += units[u][1]
    return _make_plan(grid, merge_size, assignment, loads)


def _refine(units, owner, loads, max_steps: int = 1000) -> None:
    """Lower the max load: move a unit off the busiest rank, or swap it for a smaller one."""
    n_ranks = len(loads)
    for _ in range(max_steps):
        top = max(range(n_ranks), key=lambda k: (loads[k], -k))
        best = None  # (new max of the two ranks, u, v or None, r)
        for u in (u for u in range(len(units)) if owner[u] == top):
            cu = units[u][0]
            for r in range(n_ranks):
                if r == top:
                    continue
                cand = max(loads[top] - cu, loads[r] + cu)
                if best is None or cand < best[0] - 1e-9:
                    best = (cand, u, None, r)
                for v in (v for v in range(len(units)) if owner[v] == r):
                    d = cu - units[v][0]
                    if d <= 0:
                        continue
                    cand = max(loads[top] - d, loads[r] + d)
                    if cand < best[0] - 1e-9:
                        best = (cand, u, v, r)
        if best is None or best[0] >= loads[top] - 1e-9 * max(loads[top], 1.0):
            return
        _, u, v, r = best
        d = units[u][0] - (units[v][0] if v is not None else 0.0)
        owner[u] = r
        if v is not None:
            owner[v] = top
        loads[top] -= d
        loads[r] += d


def count_split(
    grid_thw: torch.Tensor | Sequence,
    merge_size: int,
    cp_size: int,
    cost_model: CostModel | None = None,
) -> ShardPlan:
    """Baseline of existing implementations: contiguous runs of whole items (a video is one
    item), by COUNT only (the first ``n % cp_size`` ranks get one extra item)."""
    cm = cost_model or CostModel()
    grid = _check_grid(grid_thw, merge_size)
    n = len(grid)
    assignment, loads, start = [], [], 0
    for r in range(cp_size):
        stop = start + n // cp_size + (1 if r < n % cp_size else 0)
        assignment.append([(i, k) for i in range(start, stop) for k in range(grid[i][0])])
        loads.append(sum(grid[i][0] * cm.cost(grid[i][1] * grid[i][2])
                         for i in range(start, stop)))
        start = stop
    return _make_plan(grid, merge_size, assignment, loads)


class _GatherShares(torch.autograd.Function):
    """Forward: pad each share to the longest, all_gather_into_tensor, unpad (rank-major rows).
    Backward: pad each rank's gradient slice, reduce_scatter_tensor (SUM): every rank receives
    the gradient of its own share summed over all ranks. Sizes come from the shared plan."""

    @staticmethod
    def forward(ctx, local, sizes, rank, group):
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        m = max(sizes)
        padded = local.new_zeros(m, *local.shape[1:])
        padded[: local.shape[0]] = local
        buf = local.new_empty(len(sizes) * m, *local.shape[1:])
        dist.all_gather_into_tensor(buf, padded, group=group)
        return torch.cat([buf[r * m : r * m + s] for r, s in enumerate(sizes)])

    @staticmethod
    def backward(ctx, grad):
        sizes, m = ctx.sizes, max(ctx.sizes)
        buf = grad.new_zeros(len(sizes) * m, *grad.shape[1:])
        off = 0
        for r, s in enumerate(sizes):
            buf[r * m : r * m + s] = grad[off : off + s]
            off += s
        out = grad.new_empty(m, *grad.shape[1:])
        dist.reduce_scatter_tensor(out, buf, op=dist.ReduceOp.SUM, group=ctx.group)
        return out[: sizes[ctx.rank]], None, None, None


def _owner_module(encode) -> torch.nn.Module | None:
    if isinstance(encode, torch.nn.Module):
        return encode
    owner = getattr(encode, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


class VisionDPOverCP:
    """Run ``encode`` data-parallel over the CP group; return the full embeddings on every rank.

    Args:
        encode: ``encode(pixel_values[rows, D], grid_thw[n, 3]) -> Tensor[tokens, H]`` (or a
            tuple of such tensors, e.g. Qwen3-VL's main + DeepStack features); an item
            (t, h, w) contributes t*h*w pixel rows and t*h*w/merge_size**2 tokens and items
            (and temporal slices) are independent.
        hidden_size: H of the output, or one H per output tensor. A rank with no share uses it
            to join the collectives with an empty [0, H] tensor.
        merge_size: spatial merge (2 for Qwen-VL).
        cp_group: the CP process group (``parallel_state.get_context_parallel_group()``);
            None or a group of size 1 = inactive.
        enabled: the ``vision_dp_over_cp`` flag; None = on when CP > 1.
        cost_model: unit cost estimate for the plan (default: Qwen2.5-VL FLOPs).
        out_dtype: dtype of the gathered embeddings; None = ``pixel_values.dtype``. Local
            outputs are cast to it so every rank (including an empty one) agrees.
        trainable: whether the backward collective runs (it must run on EVERY rank or none).
            None = grad mode is on and ``encode`` (an nn.Module, or a bound method of one) has a
            parameter with requires_grad, or pixel_values requires grad.

    The caller sums encoder parameter gradients over the CP group (megatron DDP does this when
    the encoder is part of the DDP-wrapped model: it reduces over DP x CP), and must use the
    returned tensor in the loss graph on every rank (otherwise the backward collective hangs).
    """

    def __init__(self, encode: EncodeFn, *, hidden_size: int | Sequence[int], merge_size: int = 2,
                 cp_group=None, enabled: bool | None = None, cost_model: CostModel | None = None,
                 out_dtype: torch.dtype | None = None, trainable: bool | None = None):
        self.encode = encode
        self.hidden = [hidden_size] if isinstance(hidden_size, int) else list(hidden_size)
        self.tuple_out = not isinstance(hidden_size, int)
        self.merge_size = merge_size
        self.cp_group = cp_group
        self.cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        self.cost_model = cost_model or CostModel()
        self.out_dtype, self.trainable = out_dtype, trainable
        if enabled is False:
            self.inactive_reason = (f"disabled by vision_dp_over_cp=False (CP={self.cp_size}): "
                                    "every CP rank encodes ALL images")
        elif self.cp_size == 1:
            self.inactive_reason = "context-parallel size is 1: nothing to share"
        else:
            self.inactive_reason = None
        self._reported = False
        self.last_plan: ShardPlan | None = None

    @property
    def active(self) -> bool:
        return self.inactive_reason is None

    def _report(self) -> None:
        if self._reported:
            return
        self._reported = True
        if self.active:
            log.info("vision_dp_over_cp ACTIVE: encoder shares balanced by cost over CP=%d",
                     self.cp_size)
        elif self.cp_size == 1:  # the usual case: nothing to say in a run's output
            log.info("vision_dp_over_cp INACTIVE: %s", self.inactive_reason)
        else:  # asked for (parallel.vision_dp=false) at CP > 1: the cost is said, prefixed
            log.warning("[vision_dp] vision_dp_over_cp INACTIVE: %s", self.inactive_reason)

    def _needs_grad(self, pixel_values: torch.Tensor) -> bool:
        if self.trainable is not None:
            return self.trainable and torch.is_grad_enabled()
        if not torch.is_grad_enabled():
            return False
        module = _owner_module(self.encode)
        params = module is not None and any(p.requires_grad for p in module.parameters())
        return params or pixel_values.requires_grad

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """Returns the embeddings of all items in the original order (a tuple when
        ``hidden_size`` is a sequence).

        Raises:
            ValueError: pixel rows disagree with grid_thw, or the encoder returned a wrong
                number of rows / a wrong width (message names the rank and the shapes).
        """
        self._report()
        if not self.active:
            return self.encode(pixel_values, grid_thw)
        plan = plan_shares(grid_thw, self.merge_size, self.cp_size, self.cost_model)
        self.last_plan = plan
        rows = sum(t * h * w for t, h, w in plan.grid)
        if pixel_values.shape[0] != rows:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows, grid_thw "
                             f"{plan.grid} needs {rows}")
        rank = dist.get_rank(self.cp_group)
        dtype = self.out_dtype or pixel_values.dtype
        n_local = plan.tokens(rank)
        if plan.shares[rank]:
            local_px = torch.cat([pixel_values[a:b] for a, b in plan.rows(rank)])
            local_grid = torch.tensor(plan.local_grid(rank), dtype=torch.long,
                                      device=grid_thw.device if torch.is_tensor(grid_thw)
                                      else pixel_values.device)
            out = self.encode(local_px, local_grid)
            outs = list(out) if self.tuple_out else [out]
            for o, h in zip(outs, self.hidden, strict=True):
                if tuple(o.shape) != (n_local, h):
                    raise ValueError(f"CP rank {rank}: encoder returned {tuple(o.shape)} for "
                                     f"grid {plan.local_grid(rank)}, expected ({n_local}, {h})")
            local = torch.cat([o.to(dtype) for o in outs], dim=1)
        else:
            local = pixel_values.new_zeros(0, sum(self.hidden), dtype=dtype)
        needs_grad = self._needs_grad(pixel_values)
        if needs_grad and not local.requires_grad:  # join the backward reduce-scatter anyway
            local = local.detach().requires_grad_(True)
        sizes = [plan.tokens(r) for r in range(self.cp_size)]
        if needs_grad:
            gathered = _GatherShares.apply(local, sizes, rank, self.cp_group)
        else:
            with torch.no_grad():
                gathered = _GatherShares.apply(local.detach(), sizes, rank, self.cp_group)
        full = gathered.index_select(0, plan.order().to(gathered.device))
        if not self.tuple_out:
            return full
        return tuple(torch.split(full, self.hidden, dim=1))


def allreduce_grads(module: torch.nn.Module, cp_group) -> None:
    """Sum parameter gradients over the CP group, for runs without megatron DDP (tests).

    A rank with no share has no gradients (``None``): they become zeros so that every rank
    joins every all-reduce (skipping them would hang the ranks that have one).
    """
    for p in module.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=cp_group)
