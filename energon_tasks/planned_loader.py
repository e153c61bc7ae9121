"""The training loader of the global data plan (``data.global_plan``): every data-parallel rank
plans each step for the whole run, from the samples' metadata, then reads, decodes and encodes
only the rows the plan gives it.

Per step (``Planner.next_step``, the same on every rank and in every loader worker): samples come
from the global stream (``energon_tasks.global_stream``; DP-independent) with their budget plans
(``VLMTaskEncoder.plan_sample``: ``K.json`` alone, nothing decoded) until they fill the global
batch's ``rows`` (with packing: ``POOL`` x ``rows`` x ``seq_length`` tokens, the packer's
choice; without: ``rows`` samples);
``global_plan.pack_rows`` forms the rows and ``global_plan.assign_rows`` gives each rank
``rows / dp`` of them, balanced on tokens and vision cost (the model's tower FLOPs of the
planned grids, ``vision_cost``). A sample the budget skips is counted (``skipped_<reason>``, on
DP rank 0's batches) and not trained; one whose media fail to decode is counted and dropped from
its row by the rank that reads it.

The step's rows of this rank come out as ``rows / (dp x micro_batch)`` micro-batches
(``VLMBatch``, one collated batch of ``micro_batch`` rows each, in order). Loader workers share the
micro-batches round robin (micro-batch m is built by worker m mod W, which torch's DataLoader
hands out in order); each worker runs the planner itself (metadata only). Every batch carries
``plan`` (``VLMBatch.plan``): the step, the keys of the samples it trains, the step's
``dp_tokens_max_over_mean`` / ``dp_vision_max_over_mean`` over the ranks, the realised token
share of each blended dataset; the last micro-batch of a step also the plan's state after that
step (``PlanState``: the stream's position and the samples carried to the next step with the
steps each has waited, plain JSON). A checkpoint stores that state once; it is the same for
every DP size, so a run resumes at any DP size and trains the very samples the uninterrupted run
would have.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from energon_tasks.energon_dataset import DamagedSample, record_skip
from energon_tasks.global_plan import Item, assign_rows, imbalance, pack_rows, rank_loads
from energon_tasks.global_stream import Readers, SampleRef, Stream, StreamState, members

#: candidates a packed step draws, in rows' worth of tokens: the packer picks from more than
#: fills the rows (the rest waits, at most ``global_plan.MAX_WAIT`` steps); bench/bench_data_plan.py
POOL = 1.5
#: (image grids, video grids) of a sample -> its estimated vision-encoder cost
VisionCost = Callable[[list[list[int]], list[list[int]]], float]


@dataclass(slots=True)
class PlanState:
    """Where the plan is: the next step, the stream's position, the samples carried over and
    how many steps each has waited (``global_plan.MAX_WAIT`` bounds it)."""

    step: int = 0
    stream: StreamState = field(default_factory=StreamState)
    carried: list[SampleRef] = field(default_factory=list)
    waited: list[int] = field(default_factory=list)  #: steps each carried one was left out

    def to_plain(self) -> dict:
        return {"step": self.step, "stream": self.stream.to_plain(),
                "carried": [[member, key, waited] for (member, key), waited
                            in zip(self.carried, self.waited, strict=True)]}

    @classmethod
    def from_plain(cls, plain: dict, datasets: int) -> PlanState:
        """Raises ValueError: not a plan state of ``datasets`` datasets. (A state saved before
        the waits were kept: each carried one has waited one step.)"""
        try:
            entries = [(int(e[0]), str(e[1]), int(e[2]) if len(e) > 2 else 1)
                       for e in plain["carried"]]
            return cls(int(plain["step"]), StreamState.from_plain(plain["stream"], datasets),
                       [(m, k) for m, k, _ in entries], [w for _, _, w in entries])
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise ValueError(f"not a data plan state ({error})") from None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: its rows (global), which rank trains which, and the state after it."""

    step: int
    rows: list  #: global_plan.Row of the global batch
    ranks: list[list[int]]  #: row indices per rank
    skipped: dict  #: budget counters of the samples the plan skipped
    state: dict  #: PlanState.to_plain() after this step
    blend: dict  #: dataset name -> realised share of the planned tokens so far

    def metrics(self) -> dict:
        tokens, vision = rank_loads(self.rows, self.ranks)
        return {"dp_tokens_max_over_mean": imbalance(tokens),
                "dp_vision_max_over_mean": imbalance(vision)}


class Planner:
    """The plan of every step from a state (see the module docstring)."""

    def __init__(self, task_encoder, vision_cost: VisionCost, data: list, *, rows: int,
                 dp: int, seed: int, by_tokens: bool, state: PlanState) -> None:
        self.encoder, self.vision_cost, self.data = task_encoder, vision_cost, data
        self.rows, self.dp = rows, dp
        self.readers = Readers(data)
        self.step = state.step
        self.stream = Stream(data, seed, by_tokens=by_tokens,  # a copy: the state moves on
                             state=StreamState.from_plain(state.stream.to_plain(), len(data)))
        self.carried = [self.item(ref, waited)
                        for ref, waited in zip(state.carried, state.waited, strict=True)]
        self.carried = [item for item in self.carried if item is not None]
        self._skipped: Counter = Counter()

    def item(self, ref: SampleRef, waited: int = 0) -> Item | None:
        """The plan's view of a sample (None: skipped, and counted)."""
        try:
            conversation = self.readers.conversation(ref)
        except DamagedSample as error:
            self._skipped.update({"samples": 1, f"skipped_{error.reason}": 1})
            record_skip(ref[1], error.reason, error.detail, count=False)
            return None
        plan = self.encoder.plan_sample(conversation, ref[1])
        if plan.skip:
            self._skipped.update(plan.counters())
            record_skip(ref[1], plan.skip, plan.detail, count=False)
            return None
        grids = {"image": [], "video": []}
        for media in plan.media:
            grids[media.kind].append(list(media.grid.grid_thw))
        return Item(ref, plan.total_tokens, float(self.vision_cost(grids["image"],
                                                                   grids["video"])), waited)

    def next_step(self) -> StepPlan:
        budget = self.encoder.budget
        capacity, packing = budget.seq_length, budget.packing
        fresh = []
        have = sum(i.tokens if packing else 1 for i in self.carried)
        need = self.rows * (capacity * POOL if packing else 1)
        while have < need:
            ref = self.stream.draw()
            item = self.item(ref)
            if item is None:
                continue
            self.stream.observe(ref, item.tokens)
            fresh.append(item)
            have += item.tokens if packing else 1
        rows, left = pack_rows(self.carried, fresh, self.rows, capacity, packing)
        self.carried = left
        skipped, self._skipped = dict(self._skipped), Counter()
        self.step += 1
        state = PlanState(self.step, self.stream.state, [i.ref for i in left],
                          [i.waited for i in left]).to_plain()
        total = sum(self.stream.state.tokens) or 1
        blend = {}
        for member, tokens in zip(self.data, self.stream.state.tokens, strict=True):
            blend[member.name] = blend.get(member.name, 0.0) + tokens / total
        return StepPlan(self.step - 1, rows, assign_rows(rows, self.dp), skipped, state, blend)


class _Steps(torch.utils.data.IterableDataset):
    """This rank's micro-batches, step after step, built by the loader workers in turn."""

    def __init__(self, loader: PlannedLoader, state: PlanState) -> None:
        super().__init__()
        self.loader, self.state = loader, state

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        spec = self.loader
        planner = Planner(spec.encoder, spec.vision_cost, spec.data, rows=spec.rows,
                          dp=spec.dp_size, seed=spec.seed, by_tokens=spec.by_tokens,
                          state=self.state)
        count = 0
        while True:
            plan = planner.next_step()
            mine = plan.ranks[spec.dp_rank]
            groups = [mine[i:i + spec.micro_batch] for i in range(0, len(mine),
                                                                   spec.micro_batch)]
            for j, group in enumerate(groups):
                if count % workers == worker:
                    yield self._batch(planner, plan, group, first=j == 0,
                                      last=j == len(groups) - 1)
                count += 1

    def _batch(self, planner: Planner, plan: StepPlan, group: list[int], first: bool,
               last: bool):
        from megatron.energon import SkipSample

        encoder = self.loader.encoder
        rows, keys = [], []
        for index in group:
            encoded = []
            for item in plan.rows[index].items:
                try:
                    encoded.append(encoder.encode_sample(planner.readers.sample(item.ref)))
                except DamagedSample as error:
                    encoder._count({"samples": 1, f"skipped_{error.reason}": 1})
                    record_skip(error.key, error.reason, error.detail, count=False)
                except SkipSample:
                    pass  # counted and recorded by the encoder
            if encoded:
                rows.append(encoder.pack_selected_samples(encoded) if encoder.budget.packing
                            else encoded[0])
                keys += [s.__key__ for s in encoded]
        if self.loader.dp_rank == 0 and first:
            encoder._count(plan.skipped)  # the plan's own skips, counted once per step
        batch = encoder.batch(rows or [empty_row(encoder)])
        batch.plan = {"step": plan.step, "keys": keys, **plan.metrics(),
                      "blend_token_share": plan.blend,
                      **({"state": plan.state} if last else {})}
        return batch


def empty_row(encoder):
    """One pad token, nothing supervised: the row of a micro-batch whose samples all failed to
    decode (its rank still joins the step)."""
    from contract.batch import EncodedSample
    from contract.constants import IGNORE_INDEX

    width = {kind: encoder.hooks.pixel_row_width(kind) for kind in ("image", "video")}
    return EncodedSample(
        __key__="", __restore_key__=(), input_ids=torch.tensor([encoder.pad_id]),
        labels=torch.tensor([IGNORE_INDEX]), loss_mask=torch.zeros(1),
        position_ids=torch.zeros((3, 1), dtype=torch.int64),
        pixel_values=torch.zeros((0, width["image"])), image_grid_thw=torch.zeros((0, 3),
                                                                                 dtype=torch.int64),
        pixel_values_videos=torch.zeros((0, width["video"])),
        video_grid_thw=torch.zeros((0, 3), dtype=torch.int64),
        visual_kinds=torch.zeros(0, dtype=torch.int64), seq_lens=torch.tensor([1]))


class PlannedLoader:
    """This rank's training micro-batches under the global data plan (module docstring).

    Args:
        path: dataset folder or metadataset YAML; ``split_part`` its training split.
        task_encoder: the run's ``VLMTaskEncoder``.
        vision_cost: (image grids, video grids) -> cost (the model's tower FLOPs).
        rows: rows of the global batch (``train.global_batch_size``).
        micro_batch: rows per micro-batch; ``dp_rank`` / ``dp_size``: this reader's place.
        num_workers: loader worker processes (0: this process).
        seed: the stream's seed; ``by_tokens``: blend weights are shares of tokens.

    Raises:
        UsageError: a data path the plan cannot read, or rows that do not divide over DP x
            micro-batch.
    """

    def __init__(self, path, *, task_encoder, vision_cost: VisionCost, rows: int,
                 micro_batch: int, dp_rank: int, dp_size: int, num_workers: int, seed: int,
                 split_part: str = "train", by_tokens: bool = False) -> None:
        from contract.errors import UsageError

        if rows % (dp_size * micro_batch):
            raise UsageError(f"train.global_batch_size {rows} is not a multiple of DP x "
                             f"micro-batch = {dp_size} x {micro_batch} (data.global_plan)")
        self.encoder, self.vision_cost = task_encoder, vision_cost
        self.data = members(path, split_part)
        self.rows, self.micro_batch = rows, micro_batch
        self.dp_rank, self.dp_size, self.num_workers = dp_rank, dp_size, num_workers
        self.seed, self.by_tokens = seed, by_tokens
        self._start = PlanState(0, StreamState(0, [0] * len(self.data), [0] * len(self.data)))
        self._consumed = self._start.to_plain()
        self.worker_init_fn = None  #: of its DataLoader's workers (train.py wraps it)

    @property
    def micro_batches_per_step(self) -> int:
        return self.rows // (self.dp_size * self.micro_batch)

    def save_state(self) -> dict:
        """The plan's state after the last whole step handed out (DP-independent)."""
        return dict(self._consumed)

    def restore_state(self, plain: dict) -> None:
        """Continue after the step ``plain`` was saved at.

        Raises:
            ValueError: not a plan state of this data.
        """
        self._start = PlanState.from_plain(plain, len(self.data))
        self._consumed = self._start.to_plain()

    def __iter__(self):
        loader = torch.utils.data.DataLoader(
            _Steps(self, self._start), batch_size=None, num_workers=self.num_workers,
            worker_init_fn=self.worker_init_fn, prefetch_factor=2 if self.num_workers else None)
        for batch in loader:
            if "state" in batch.plan:
                self._consumed = batch.plan["state"]
            yield batch
