"""Reusable pieces of train.py: process layout, input checks, LR schedule, loss normalisation,
throughput and FLOP accounting, logging, and the training checkpoint.

Stages, in the order train.py uses them:

1. ``check_layout`` / ``init_distributed``: world size vs TP x PP x CP (x EP), gloo (CPU) or
   nccl (GPU), megatron ``parallel_state``, seeded RNG tracker (``models.checkpoint``).
2. ``load_run_tokenizer`` / ``check_data_path`` / ``check_split`` / ``probe_first_batch``: an
   unloadable tokenizer, a missing or empty dataset, a missing split, or one whose samples the
   budget all skips, is a ``UsageError`` before the model is built.
3. ``lr_at``: linear warmup then cosine decay (the scheduler state is the step).
4. ``loss_tokens`` / ``step_token_total``: per-token loss normalised over micro-batches, DP and CP.
5. ``StepMeter`` / ``MetricsLogger``: throughput, FLOPs (``models.flops.batch_flops``), peak
   memory, budget counters; console + metrics.jsonl + TensorBoard (+ wandb).
6. ``save_checkpoint`` / ``read_train_state`` / ``load_checkpoint``: megatron dist_checkpointing
   of model + (distributed) optimizer, the Energon loader state of every DP rank, RNG,
   scheduler, config; the safe state files, completion marker and retention are
   ``models.run_state``'s.

Raises ``UsageError`` (one line; train.py exits 2) for every input problem it detects.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from contract.batch import VLMBatch
from contract.constants import IGNORE_INDEX
from contract.errors import UsageError
from models.checkpoint import init_process_group, seed_model_parallel, write_files
from models.cpu import peak_memory_gb
from models.flops import batch_flops

if TYPE_CHECKING:
    from megatron.energon import WorkerConfig

    from energon_tasks.config import TaskEncoderConfig
    from energon_tasks.task_encoder import VLMTaskEncoder


# ------------------------------------------------------------------ 1. layout
@dataclass(frozen=True, slots=True)
class Layout:
    world: int
    rank: int
    tp: int
    pp: int
    cp: int
    dp: int
    dp_rank: int
    cp_rank: int
    first_in_replica: bool  #: tp, pp, cp rank 0: writes this replica's loader state


def check_layout(world: int, tp: int, pp: int, cp: int, fixed_length: bool, ep: int = 1) -> None:
    """Raises UsageError (every problem) when the layout cannot be built. (A sequence length
    that 2 * CP does not divide is the run config's error: ``TaskEncoderConfig.validate``.)"""
    problems = []
    if world % (tp * pp * cp):
        problems.append(f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    if ep > 1 and world % (tp * pp * ep):
        problems.append(f"world size {world} is not divisible by tp*pp*ep = {tp}*{pp}*{ep} "
                        "(the expert-parallel ranks come from the data-parallel ones)")
    if pp > 1 and not fixed_length:
        problems.append("parallel.pp > 1 needs task_encoder.fixed_length=true")
    if pp > 1 and cp > 1:
        problems.append("parallel.pp > 1 with parallel.cp > 1 is not supported yet")
    if problems:
        raise UsageError("impossible parallel layout: " + "; ".join(problems))


def init_distributed(tp: int, pp: int, cp: int, seed: int, ep: int = 1) -> Layout:
    """gloo/nccl process group (plain python = one process), parallel_state, RNG tracker."""
    init_process_group()
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep)
    seed_model_parallel(seed)
    return Layout(world=dist.get_world_size(), rank=dist.get_rank(), tp=tp, pp=pp, cp=cp,
                  dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                  cp_rank=ps.get_context_parallel_rank(),
                  first_in_replica=(ps.get_tensor_model_parallel_rank() == 0
                                    and ps.get_pipeline_model_parallel_rank() == 0
                                    and ps.get_context_parallel_rank() == 0))


# ------------------------------------------------------------------ 2. data checks
def load_run_tokenizer(te_cfg: TaskEncoderConfig, run_folder: Path, *, builds: bool = True,
                       wait=lambda: None):
    """The tokenizer of ``task_encoder.tokenizer`` (a hub id or folder; default: the model's).
    ``tokenizer: test``, the small local BPE of the tests and the CPU demo, is built into
    ``run_folder/tokenizer`` (by the process that ``builds``; every process calls ``wait`` before
    reading it), so the run keeps the tokenizer it used.

    Raises:
        UsageError: the tokenizer cannot be loaded or lacks the family's special tokens.
    """
    from energon_tasks.tokenizer import build_test_tokenizer, load_tokenizer

    name = te_cfg.tokenizer_name
    if te_cfg.tokenizer == "test":
        name = str(run_folder / "tokenizer")
        if builds:
            build_test_tokenizer(name)
        wait()
    try:
        return load_tokenizer(name, te_cfg.model)
    except ValueError as error:
        raise UsageError(str(error)) from None


def check_data_path(path: str) -> None:
    """Raises UsageError when ``data.path`` is unset, missing, or not an Energon dataset."""
    if not path:
        raise UsageError("data.path is not set (give DATA=<dataset folder or metadataset.yaml>)")
    p = Path(path)
    if not p.exists():
        raise UsageError(f"data.path {path} does not exist")
    if p.is_dir() and not (p / ".nv-meta" / "dataset.yaml").is_file():
        if (p / "metadataset.yaml").is_file():
            raise UsageError(f"data.path {path} is a converter output folder: "
                             f"use {p / 'metadataset.yaml'}")
        raise UsageError(f"data.path {path} is not an Energon dataset "
                         "(no .nv-meta/dataset.yaml) or it is empty")


def check_split(path: str, split: str, needed_by: str = "") -> None:
    """The dataset folder / metadataset must declare the split part (before anything is built).

    Raises:
        UsageError: a missing or unreadable path, or no such split (the message lists those
            there are, and names ``needed_by``: the setting that asks for the split).
    """
    import yaml

    p = Path(path)
    if not p.exists():
        raise UsageError(f"data path {path} does not exist")
    try:
        if p.is_file():
            splits = (yaml.safe_load(p.read_text()) or {}).get("splits") or {}
        else:
            meta = p / ".nv-meta" / "split.yaml"
            if not meta.is_file():
                raise UsageError(f"{path} is not an Energon dataset (no .nv-meta/split.yaml)")
            splits = (yaml.safe_load(meta.read_text()) or {}).get("split_parts") or {}
    except (OSError, yaml.YAMLError, AttributeError) as error:
        raise UsageError(f"data path {path} is unreadable ({error})") from None
    if not splits.get(split):
        have = ", ".join(sorted(k for k in splits if "/" not in k)) or "none"
        hint = f" for {needed_by} (set it to 0 or name another split)" if needed_by else ""
        raise UsageError(f"dataset {path} has no {split!r} split{hint} (splits: {have})")


def _blend_members(path: str, split_part: str) -> list[tuple[str, str]]:
    """(dataset, split part) of each member of a metadataset blend (weighted blends cannot be
    read once without repeat); the path itself for a dataset folder or another layout."""
    import yaml

    p = Path(path)
    if p.is_file():
        try:
            blend = yaml.safe_load(p.read_text())["splits"][split_part]["blend"]
            return [(str(p.parent / m["path"]), m.get("split_part", split_part)) for m in blend]
        except (KeyError, TypeError, yaml.YAMLError):
            pass
    return [(path, split_part)]


def probe_first_batch(path: str, split_part: str, task_encoder: VLMTaskEncoder,
                      worker_config: WorkerConfig) -> None:
    """Read the dataset once (no repeat) until one batch comes out (with the data side's
    ``worker_config``, so damaged samples are skipped as in training).

    Raises:
        UsageError: the dataset cannot be loaded, is empty, or the budget skips every sample
            (the skip reasons are counted in the message).
    """
    from megatron.energon import get_loader, get_train_dataset

    try:
        for member, part in _blend_members(path, split_part):
            dataset = get_train_dataset(member, split_part=part, worker_config=worker_config,
                                        batch_size=1, shuffle_buffer_size=None,
                                        max_samples_per_sequence=None, task_encoder=task_encoder,
                                        repeat=False)
            for _batch in get_loader(dataset):
                return
    except Exception as error:  # noqa: BLE001 - energon raises many kinds; report in one line
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UsageError(f"data.path {path}: cannot load split {split_part!r}: "
                         f"{type(error).__name__}: {first}") from None
    counters = task_encoder.counters()
    skipped = {k: v for k, v in sorted(counters.items()) if k.startswith("skipped_")}
    if not counters.get("samples"):
        raise UsageError(f"data.path {path}: split {split_part!r} has no samples")
    raise UsageError(f"data.path {path}: all {counters['samples']} samples are skipped by the "
                     f"budget ({', '.join(f'{k}={v}' for k, v in skipped.items())}); raise "
                     "task_encoder.seq_length / max_visual_tokens / max_num_images")


# ------------------------------------------------------------------ 3. schedule
def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR of optimizer step ``step`` (0-based): linear warmup, then cosine to ``min_lr``."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


# ------------------------------------------------------------------ 4. loss normalisation
def loss_tokens(batch: VLMBatch) -> int:
    """Supervised tokens of a batch after the model's shift (what its loss mask counts)."""
    shifted = batch.loss_mask[:, 1:] * (batch.labels[:, 1:] != IGNORE_INDEX)
    return int(shifted.sum())


def step_token_total(local_tokens: int) -> int:
    """Supervised tokens of one optimizer step over all DP replicas (CP ranks share samples)."""
    from megatron.core import parallel_state as ps

    total = torch.tensor([float(local_tokens)])
    if dist.is_initialized() and ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(total, group=ps.get_data_parallel_group())
    return int(total.item())


# ------------------------------------------------------------------ 5. metrics
class StepMeter:
    """Sums one logging window of batches (this rank), then all-reduces over DP replicas."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.stats = Counter()
        self.budget = Counter()
        self.time = self.wait = 0.0
        self.steps = 0

    def add_batch(self, batch: VLMBatch, model_cfg) -> None:
        self.stats["samples"] += sum(len(k.split(",")) for k in batch.__key__)
        self.stats["tokens"] += int(batch.attention_mask.sum())
        self.stats["loss_tokens"] += loss_tokens(batch)
        merge = model_cfg.merge_size ** 2
        self.stats["visual_tokens"] += int(batch.image_grid_thw.prod(-1).sum()) // merge
        self.stats["visual_tokens"] += int(batch.video_grid_thw.prod(-1).sum()) // merge
        self.stats["images"] += int(batch.image_grid_thw.shape[0])
        self.stats["videos"] += int(batch.video_grid_thw.shape[0])
        self.stats["flops"] += batch_flops(batch, model_cfg)
        self.budget.update(batch.budget_counters)

    def summary(self, layout: Layout) -> dict:
        """Window totals over DP replicas -> rates (per second of wall time)."""
        from megatron.core import parallel_state as ps

        keys = sorted(self.stats)
        bkeys = sorted(self.budget)
        values = torch.tensor([float(self.stats[k]) for k in keys], dtype=torch.float64)
        if layout.dp > 1:  # budget keys may differ by rank: gather them as json
            dist.all_reduce(values, group=ps.get_data_parallel_group())
            gathered = [None] * layout.dp
            dist.all_gather_object(gathered, dict(self.budget), group=ps.get_data_parallel_group())
            budget = Counter()
            for g in gathered:
                budget.update(g)
            bkeys = sorted(budget)
        else:
            budget = self.budget
        total = dict(zip(keys, values.tolist(), strict=True))
        seconds = max(self.time, 1e-9)
        out = {
            "step_time_s": self.time / max(self.steps, 1),
            "data_wait_s": self.wait / max(self.steps, 1),
            "samples_per_s": total.get("samples", 0) / seconds,
            "tokens_per_s": total.get("tokens", 0) / seconds,
            "visual_tokens_per_s": total.get("visual_tokens", 0) / seconds,
            "images_per_s": total.get("images", 0) / seconds,
            "tflops_per_s": total.get("flops", 0) / seconds / 1e12,
            "tflops_per_s_per_rank": total.get("flops", 0) / seconds / 1e12 / layout.world,
            "peak_mem_gb": peak_memory_gb(),
        }
        out["budget"] = {k: int(budget[k]) for k in bkeys}
        return out


class MetricsLogger:
    """Console + ``metrics.jsonl`` + TensorBoard (when importable) + wandb (when asked).

    A resumed run (``start_step`` > 0) appends to metrics.jsonl (``run_state.trim_metrics`` has
    dropped the records after ``start_step``) and TensorBoard purges its events after it, so
    every step is logged once. The console line shows ``step i/N``, elapsed time and the ETA of
    this process's steps.
    """

    def __init__(self, out: Path, *, enabled: bool, tensorboard: bool, wandb: bool,
                 wandb_project: str, config: dict, start_step: int, total_steps: int):
        self.enabled = enabled
        self.tb = self.wandb = None
        self.start_step, self.total_steps = start_step, total_steps
        self.started = time.perf_counter()
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        self.file = open(out / "metrics.jsonl", "a" if start_step else "w")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1)
            except ImportError:
                print("[train] TensorBoard not installed: logging to metrics.jsonl only")
        if wandb:
            try:
                import wandb as wb
                self.wandb = wb.init(project=wandb_project, config=config, dir=str(out))
            except ImportError:
                print("[train] wandb not installed: skipped")

    def _timing(self, step: int) -> str:
        from contract.console import eta, format_duration

        elapsed = time.perf_counter() - self.started
        return (f"elapsed {format_duration(elapsed)} ETA "
                f"{eta(elapsed, step - self.start_step, self.total_steps - self.start_step)}")

    def _write(self, record: dict, scalars: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        budget = record.get("budget", {})
        print(f"[train] step {record['step']}/{self.total_steps} loss {record['loss']:.4f} "
              f"lr {record['lr']:.2e} gnorm {record['grad_norm']:.3f} "
              f"step {record['step_time_s']:.2f}s wait {record['data_wait_s']:.2f}s "
              f"{record['samples_per_s']:.1f} samp/s {record['tokens_per_s']:.0f} tok/s "
              f"{record['visual_tokens_per_s']:.0f} vis/s {record['images_per_s']:.1f} img/s "
              f"{record['tflops_per_s']:.4f} TFLOP/s mem {record['peak_mem_gb']:.2f}GB "
              f"skipped {sum(v for k, v in budget.items() if k.startswith('skipped_'))} "
              f"{self._timing(record['step'])}", flush=True)
        flat = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        flat.update({f"budget/{k}": v for k, v in budget.items()})
        self._write(record, flat)

    def log_validation(self, step: int, loss: float, tokens: int, batches: int,
                       seconds: float) -> None:
        """A ``val_loss`` record (per supervised token of ``batches`` val batches)."""
        if not self.enabled:
            return
        print(f"[train] step {step}/{self.total_steps} val_loss {loss:.4f} ({batches} val "
              f"batches, {tokens} tokens, {seconds:.1f}s)", flush=True)
        self._write({"step": step, "val_loss": loss, "val_loss_tokens": tokens,
                     "val_batches": batches}, {"val_loss": loss})

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()


# ------------------------------------------------------------------ 6. checkpoints
TRAIN_STATE = "train_state.json"


def read_train_state(path: str | Path, dp: int) -> dict:
    """Read and validate a checkpoint before any heavy work: train_state.json, completion,
    the data-parallel size, and every state file (``models.run_state``: safe formats only).

    Returns:
        The train state with ``dir`` (the step folder) and ``step``.

    Raises:
        UsageError: missing, half-written or unreadable checkpoint, a foreign state file, or a
            data-parallel size that differs.
    """
    from models.run_state import (
        COMPLETE,
        check_dist_metadata,
        check_rank_states,
        resolve_checkpoint,
    )

    step_dir = resolve_checkpoint(path)
    try:
        state = json.loads((step_dir / TRAIN_STATE).read_text())
        step, saved_dp = int(state["step"]), int(state["layout"]["dp"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"checkpoint {path} is unreadable ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''})") from None
    if not (step_dir / "model_optim" / "metadata.json").is_file():
        raise UsageError(f"checkpoint {step_dir} is unreadable (no model_optim/metadata.json)")
    if not (step_dir / COMPLETE).is_file():
        raise UsageError(f"checkpoint {step_dir} is incomplete (no {COMPLETE} marker: its save "
                         "was interrupted); resume from an earlier one")
    if saved_dp != dp:
        raise UsageError(f"checkpoint {step_dir} was saved with data-parallel size {saved_dp}, "
                         f"this run has {dp}: the Energon loader state cannot be "
                         "redistributed (resume with the same DP size)")
    check_dist_metadata(step_dir / "model_optim")
    check_rank_states(step_dir)
    state["dir"] = str(step_dir)
    state["step"] = step
    return state


#: how the distributed optimizer's state is laid out in a checkpoint: reshardable over DP only
#: (resume keeps TP / PP; megatron 0.16's default format uses flattened ranges that its own
#: checkpoint validation refuses, and its fully reshardable one drops torch Adam's step)
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _torch_adams(optimizer):
    """(megatron optimizer, its torch Adam) of each (chained) optimizer that steps with torch's
    Adam / AdamW (neither TransformerEngine nor apex installed)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(getattr(opt, "optimizer", None), torch.optim.Adam):
            yield opt, opt.optimizer


def _prime_torch_adam_state(optimizer) -> None:
    """Give a fresh torch Adam its (zero) per-parameter state before a checkpoint is loaded.

    megatron's distributed optimizer reads the step count from every parameter's state while it
    builds the sharded dict to load into; torch's Adam has none before its first step (TE's
    FusedAdam keeps the step in its param groups). Loading overwrites these zeros.
    """
    for opt, adam in _torch_adams(optimizer):
        if opt.init_state_fn is None or any(len(state) for state in adam.state.values()):
            continue
        opt.init_state_fn(adam, opt.config)
        for group in adam.param_groups:
            for param in group["params"]:
                adam.state[param].setdefault("step", torch.tensor(0.0))


def _restore_torch_adam_steps(optimizer, loaded: dict) -> None:
    """Set torch Adam's per-parameter step counts to the ones the checkpoint saved.

    megatron's distributed optimizer saves the step in its param groups and, on load, sets it
    on every parameter's state, but then copies the parameter states (``dp_reshardable``), whose
    ``step`` entry is the loading optimizer's own value (a non-persistent object): the primed 0.
    Adam's bias correction would restart. The saved count is put back here.
    """
    subs = [loaded] if "optimizer" in loaded else [loaded[k] for k in sorted(loaded)]
    for (_, adam), sub in zip(_torch_adams(optimizer), subs, strict=False):
        steps = {g["step"] for g in sub.get("optimizer", {}).get("param_groups", [])
                 if g.get("step") is not None}
        if len(steps) != 1:
            continue
        step = float(steps.pop())
        for state in adam.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step)


def _sharded(model, optimizer, is_loading: bool) -> dict:
    model_sd = model.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                      metadata=OPTIMIZER_METADATA)}


def save_checkpoint(ckpt_dir: Path, step: int, *, model, optimizer, loader_states: list,
                    layout: Layout, train_state: dict, config_yaml: str, keep_last: int = 2,
                    model_files: dict[str, bytes] | None = None) -> Path:
    """Write ``ckpt_dir/step_<N>/`` (collective: every rank calls it), mark it complete, update
    ``latest`` and keep the newest ``keep_last`` complete step folders (0: all).

    ``loader_states``: this rank's Energon loader states (one per virtual DP reader), in their
    plain form (``energon_tasks.loader_state.to_plain``).
    ``model_files``: what export needs besides weights (``models.checkpoint.model_record``).
    """
    from megatron.core import dist_checkpointing

    from models.run_state import mark_complete, prune, write_rank_state

    step_dir = ckpt_dir / f"step_{step:06d}"
    if layout.rank == 0:
        if step_dir.exists():
            shutil.rmtree(step_dir)
        for sub in ("model_optim", "loader", "rng"):
            (step_dir / sub).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(model, optimizer, is_loading=False),
                            str(step_dir / "model_optim"))
    write_rank_state(step_dir, layout, loader_states)
    dist.barrier()
    if layout.rank == 0:
        record = {**train_state, "step": step,
                  "layout": {k: getattr(layout, k) for k in ("world", "tp", "pp", "cp", "dp")}}
        (step_dir / TRAIN_STATE).write_text(json.dumps(record, indent=2))
        (step_dir / "config.yaml").write_text(config_yaml)
        write_files(step_dir, model_files or {})
        mark_complete(step_dir, step)  # last: a folder without it is never resumed from
        (ckpt_dir / "latest").write_text(step_dir.name + "\n")
        prune(ckpt_dir, step, keep_last)
    dist.barrier()
    return step_dir


def load_checkpoint(resume: dict, *, model, optimizer, rng: dict | None) -> None:
    """Restore model + optimizer (+ this rank's RNG) in place; ``resume`` is
    ``read_train_state``'s result (the loader states are train.py's to restore).

    Raises:
        UsageError: the dist checkpoint does not match the model (one line).
    """
    from megatron.core import dist_checkpointing

    from models.run_state import set_rng_state

    step_dir = Path(resume["dir"])
    _prime_torch_adam_state(optimizer)
    try:
        state = dist_checkpointing.load(_sharded(model, optimizer, is_loading=True),
                                        str(step_dir / "model_optim"))
        model.load_state_dict(state["model"])
        with torch.no_grad():  # the distributed optimizer copies into views of the parameters
            optimizer.load_state_dict(state["optimizer"])
        _restore_torch_adam_steps(optimizer, state["optimizer"])
        if rng is not None:
            set_rng_state(rng)
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as error:
        raise UsageError(f"checkpoint {step_dir} cannot be loaded: {type(error).__name__}: "
                         f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}"
                         ) from None
