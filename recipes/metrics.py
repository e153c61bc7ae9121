"""What a training run measures and where it goes.

This module owns ``StepMeter`` (one logging window's samples, tokens, visual tokens, FLOPs
(``models.flops.batch_flops``) and budget counters, summed over DP replicas into rates) and
``MetricsLogger`` (the console line with step i/N and ETA, metrics.jsonl, TensorBoard, wandb;
validation records).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from contract.batch import VLMBatch
from energon_tasks.budget import media_dropped
from models.cpu import peak_memory_gb
from models.flops import batch_flops
from recipes.layout import Layout
from recipes.schedule import loss_tokens


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
        # the interval's batches held no image or video, and the budget dropped some: a VLM
        # trained on text only (1), said in metrics.jsonl / TensorBoard and on the step line
        out["text_only"] = int(not total.get("images") and not total.get("videos")
                               and bool(media_dropped(out["budget"])))
        return out


class MetricsLogger:
    """Console + ``metrics.jsonl`` + TensorBoard (when importable) + wandb (when asked).

    A resumed run (``start_step`` > 0) appends to metrics.jsonl
    (``recipes.run_folder.trim_metrics`` has dropped the records after ``start_step``) and
    TensorBoard purges its events after it, so every step is logged once. The console line shows
    ``step i/N``, elapsed time and the ETA of this process's steps.
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
        """A training record: metrics.jsonl (+ TensorBoard / W&B) and the step line, whose
        ``skipped`` counts this interval's skipped samples per reason (their keys:
        ``<out>/skipped_samples.jsonl``)."""
        if not self.enabled:
            return
        budget = record.get("budget", {})
        mtp = f"mtp_loss {record['mtp_loss']:.4f} " if "mtp_loss" in record else ""
        print(f"[train] step {record['step']}/{self.total_steps} loss {record['loss']:.4f} {mtp}"
              f"lr {record['lr']:.2e} gnorm {record['grad_norm']:.3f} "
              f"step {record['step_time_s']:.2f}s wait {record['data_wait_s']:.2f}s "
              f"{record['samples_per_s']:.1f} samp/s {record['tokens_per_s']:.0f} tok/s "
              f"{record['visual_tokens_per_s']:.0f} vis/s {record['images_per_s']:.1f} img/s "
              f"{record['tflops_per_s']:.4f} TFLOP/s mem {record['peak_mem_gb']:.2f}GB "
              f"skipped {_skips(budget)}{_text_only(record)}{self._timing(record['step'])}",
              flush=True)
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


def _skips(budget: dict) -> str:
    """``N`` or ``N (reason n, ...)`` of an interval's ``skipped_<reason>`` counters, + a space."""
    counts = {k.removeprefix("skipped_"): v for k, v in sorted(budget.items())
              if k.startswith("skipped_") and v}
    total = sum(counts.values())
    reasons = ", ".join(f"{reason} {n}" for reason, n in counts.items())
    return f"{total} ({reasons}) " if total else "0 "


def _text_only(record: dict) -> str:
    """The step line's note of an interval trained on text only (``text_only``), + a space."""
    if not record.get("text_only"):
        return ""
    dropped = ", ".join(f"{k} {v}" for k, v in media_dropped(record.get("budget", {})).items())
    return f"text only (the budget dropped every image: {dropped}) "
