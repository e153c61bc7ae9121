"""Supervised fine-tuning of a VLM (Qwen-VL, Nemotron-Omni) on Energon data with megatron-core.

A recipe, top to bottom:

    python train.py configs/train_qwen_vl_mantis.yaml [key=value ...] [--resume [CKPT]]
    python train.py CONFIG ... --overwrite             # start again in an out that holds a run
    python train.py configs/train_nemotron_omni_infovqa.yaml ...
    torchrun --nproc-per-node 2 train.py CONFIG parallel.cp=2 ...
    torchrun --nproc-per-node 2 train.py CONFIG parallel.pp=2 task_encoder.fixed_length=true ...

Steps (``train()``, one function each): load the config -> resolve the run plan before any
process group (``recipes.run_plan``: every check, the run guard, tokenizer, task encoder, a first
batch, the model config with its token ids; frozen) -> start_run (``<out>/train.lock``,
distributed setup, the checksums of the checkpoint to resume, run folder,
``<out>/config.yaml`` = the config every checkpoint stores) -> build_loaders ->
build_model_and_optimizer -> restore -> announce -> train_loop (next_batches, optimizer_step,
validation_loss, checkpoint_or_stop on SIGINT / SIGTERM) -> teardown. The pieces live in
recipes/: run_config.py (the config), run_plan.py, layout.py (TP x PP x CP x EP x DP), data.py
(tokenizer and data checks), model_setup.py (the model, ``model.hf`` imports), forward.py (one
forward / optimizer step over the batch contract, 1F1B under PP, validation, non-finite steps
skipped), schedule.py (LR, loss normalisation), metrics.py, checkpointing.py (the training
checkpoint: atomic, checksummed, safe state files, retention) and run_folder.py (the run guard,
the lock, abandoned checkpoints, stop signals).
Every input problem (config, data, layout, checkpoint, an ``out`` that holds a run) is one line on
stderr and exit code 2, before the model is built (a checkpoint's checksums: after the process
group). SIGINT / SIGTERM save a checkpoint after the current step and exit 0. A failed save,
``train.max_nonfinite_steps`` non-finite steps in a row or non-finite weights: one line, exit 1,
the previous checkpoint still the newest.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch

from contract.cli import run_click
from contract.errors import UsageError
from contract.lifetime import die_with_parent
from models import cpu
from models.layers import moe_aux
from recipes.checkpointing import (
    load_checkpoint,
    read_rank_state,
    save_checkpoint,
    verified_resume,
)
from recipes.estimate import estimate as estimate_memory
from recipes.forward import MTPStep, NonFiniteGuard, optimizer_step, validation_loss
from recipes.layout import Layout, init_distributed
from recipes.loaders import PlanLog, loader_states, restore_loaders
from recipes.loaders import build_loaders as loaders_for
from recipes.metrics import MetricsLogger, StepMeter
from recipes.model_setup import (
    base_source,
    build_model,
    check_base,
    freeze,
    import_hf_weights,
    select_kernels,
    wrap_for_training,
)
from recipes.param_groups import GroupRates
from recipes.param_groups import describe as describe_groups
from recipes.param_groups import overrides as group_overrides
from recipes.resume import reconcile
from recipes.run_config import ConfigError, load_run_config, to_dict
from recipes.run_folder import SKIP_LOG, StopSignal, lock_run, prepare_run_folder
from recipes.run_plan import RunPlan, resolve_plan, save_run_tokenizer
from recipes.schedule import loss_tokens, lr_at, mtp_loss_tokens, step_token_total

# --- config ------------------------------------------------------------------------------------
#: a dotted ``key=value`` override (what ``--resume`` must not swallow as its value)
OVERRIDE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*=")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--resume", is_flag=False, flag_value="latest", default=None, metavar="[CKPT]",
              help="Continue a run: from CKPT (a step folder, a checkpoints folder or a run "
                   "folder) or, without a value, from the newest complete checkpoint of this "
                   "run (put it last, or write --resume=CKPT).")
@click.option("--overwrite", is_flag=True,
              help="Start again in an `out` that holds a run: its metrics, TensorBoard events "
                   "and checkpoints are deleted first.")
def cli(config: str, overrides: tuple[str, ...], resume: str | None, overwrite: bool) -> int:
    """Fine-tune a VLM: CONFIG (a YAML in configs/) with dotted KEY=VALUE overrides, e.g.
    train.steps=20 data.path=data/mantis/metadataset.yaml."""
    if resume and OVERRIDE.match(resume) and not Path(resume).exists():
        raise UsageError(f"--resume {resume}: that is a key=value override, read as --resume's "
                         "checkpoint because it follows --resume: put --resume last (or write "
                         "--resume=CKPT)")
    return train(config, overrides, resume, overwrite)


def main(argv=None) -> int:
    return run_click(cli, "train.py", argv, (ConfigError, UsageError))


def train(config: str, overrides: tuple[str, ...], resume_from: str | None,
          overwrite: bool) -> int:
    """The recipe: each step below is one function of this file, in this order."""
    from contract.console import KnownWarnings

    if os.environ.get("TORCHELASTIC_RUN_ID"):  # a rank of torchrun: it ends with torchrun
        die_with_parent()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    resumed = reconcile(load_run_config(config, overrides, world=world), config, overrides,
                        resume_from, overwrite, world)  # --resume: its model, changes checked
    cfg = resumed.config
    quiet = KnownWarnings(enabled=not cfg.log.all_warnings)
    plan = resolve_plan(cfg, world, resume_from, overwrite)
    if plan.finished:  # nothing to train: said before anything is built
        if os.environ.get("RANK", "0") == "0":
            print(f"[train] {plan.finished}", flush=True)
        return 0
    plan, run = start_run(plan, automatic=resume_from in (None, "latest"))
    notes = [*cfg.notes, *(f"resume: {note}" for note in resumed.notes)]
    for note in notes if run.is_logger else ():
        print(f"[train] {note}", flush=True)
    loaders = build_loaders(plan, run)
    trainee = build_model_and_optimizer(plan, run)
    start = restore(plan, run, trainee, loaders, resumed.fresh_loader)
    announce(plan, run, trainee, start)
    logger = MetricsLogger(run.out, enabled=run.is_logger, tensorboard=cfg.log.tensorboard,
                           wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project,
                           config=to_dict(plan.config), start_step=start,
                           total_steps=cfg.train.steps)
    train_loop(plan, run, trainee, loaders, logger, start)
    teardown(run, logger, quiet)
    return 0


@dataclass(frozen=True, slots=True)
class Run:
    """This process's place in the run: the run folder, the parallel layout, the stop signal."""

    out: Path
    ckpt_dir: Path
    layout: Layout
    stop: StopSignal

    @property
    def is_logger(self) -> bool:
        return self.layout.rank == 0


def start_run(plan: RunPlan, automatic: bool) -> tuple[RunPlan, Run]:
    """The run lock, the distributed setup, the checksums of the checkpoint to resume (each rank
    a share; an automatic resume falls back to the previous intact one), then the run folder (an
    earlier run cleared or trimmed, the resolved config written, a built tokenizer saved) by
    rank 0."""
    from dataclasses import replace

    cfg, p = plan.config, plan.config.parallel
    lock_run(Path(cfg.out))
    layout = init_distributed(p.tp, p.pp, p.cp, cfg.train.seed, p.ep, p.etp)
    plan = replace(plan, resume=verified_resume(plan.resume, automatic, layout.dp))
    run = Run(Path(cfg.out), cfg.checkpoint_dir, layout, StopSignal())
    if run.is_logger:
        prepare_run_folder(run.out, run.ckpt_dir, plan.clear, plan.resume)
        (run.out / "config.yaml").write_text(plan.config_yaml)
        save_run_tokenizer(plan)
        print(f"[train] resolved config: {run.out / 'config.yaml'}", flush=True)
    torch.distributed.barrier()
    return plan, run


def build_loaders(plan: RunPlan, run: Run) -> list:
    """One train loader per virtual DP rank of this replica (``recipes.loaders``: Energon's per
    rank, or the global data plan's); skipped samples' keys go to ``<out>/skipped_samples.jsonl``
    (once per replica)."""
    return loaders_for(plan.config, plan.encoder, run.layout, run.stop, run.out / SKIP_LOG)


@dataclass(frozen=True, slots=True)
class Trainee:
    """The model being trained and what goes with it."""

    model: Any  #: DistributedDataParallel(Float16Module(model)) or DistributedDataParallel(model)
    optimizer: Any  #: megatron's (distributed) optimizer
    n_params: int  #: parameters of this rank's model (after DDP wrapping)
    n_trainable: int  #: of which train (the others are frozen: ``model.freeze_*``)
    model_files: dict | None  #: rank 0: what a checkpoint records for export (``model_record``)
    adapted: int  #: linears with a LoRA adapter (``model.peft=lora``)
    #: the frozen base the checkpoints refer to instead of holding it (None: they hold all)
    base: dict | None
    rates: GroupRates  #: each optimizer group's peak and minimum rate (recipes.param_groups)


def uses_bf16(t) -> bool:
    """``train.precision``: bf16, or auto on a GPU."""
    return t.precision == "bf16" or (t.precision == "auto" and cpu.bf16_by_default())


def build_model_and_optimizer(plan: RunPlan, run: Run) -> Trainee:
    """The kernels of each layer kind (one line each), the model (from ``model.hf``,
    ``train.init_checkpoint`` or random init; a resumed run whose checkpoints hold only what
    trains loads its base from there again, checked against the recorded one), LoRA adapters
    and frozen groups, bf16 and DDP wrappers, megatron's optimizer (state sharded over DP with
    ``train.distributed_optimizer``)."""
    from models.checkpointing.checkpoint import (
        check_fit,
        checkpoint_record,
        load_weights,
        model_record,
    )
    from models.checkpointing.folders import weights_folder
    from models.hf.source import resolve

    cfg, t = plan.config, plan.config.train
    bf16 = uses_bf16(t)
    base = base_source(cfg)
    recorded = plan.resume.get("base") if plan.resume else None
    if recorded is not None:
        check_base(recorded, cfg, plan.resume["dir"])
    load_init = plan.resume is None or recorded is not None  # else the checkpoint holds all
    init = t.init_checkpoint
    if cfg.hf and load_init:
        init = import_hf_weights(cfg, run.is_logger)
    hf_folder = resolve(cfg.hf, weights=False) if cfg.hf else None  # the model's own files
    model_files = model_record(hf_folder, plan.tokenizer) if run.is_logger else None
    if model_files is not None and init and not cfg.hf:  # the start's config, carried weights
        start = weights_folder(init)
        start = start.parent if start.name == "model_optim" else start
        model_files = {**checkpoint_record(start), **model_files}
    select_kernels(cfg.kernels, cfg.model, torch.bfloat16 if bf16 else torch.float32, run.is_logger)
    if init and load_init and not cfg.hf:  # train.init_checkpoint: its shapes before the build
        check_fit(cfg.model, weights_folder(init), init)
    model = build_model(cfg)
    if init and load_init:
        load_weights(model, weights_folder(init), init)
    _total, trainable, adapted = freeze(model, cfg)
    model, optimizer = wrap_for_training(model, t, bf16, group_overrides(cfg))
    if plan.resume is not None and recorded is None:
        base = None  # an earlier checkpoint of this run holds every weight: so do the next ones
    return Trainee(model, optimizer, sum(q.numel() for q in model.parameters()), trainable,
                   model_files, adapted, base, GroupRates.of(optimizer, cfg))


def restore(plan: RunPlan, run: Run, trainee: Trainee, loaders, fresh_loader: bool) -> int:
    """With a checkpoint to resume: model, optimizer, RNG and loader states (not those with
    ``fresh_loader``: another data path). Returns the step the loop starts at."""
    if plan.resume is None:
        return 0
    resume = plan.resume
    plain, rng = read_rank_state(Path(resume["dir"]), run.layout,
                                 loader="data_plan" not in resume)
    restore_loaders(plan.config, loaders, resume, plain, fresh_loader)
    load_checkpoint(resume, model=trainee.model.module, optimizer=trainee.optimizer, rng=rng)
    return resume["step"]


def announce(plan: RunPlan, run: Run, trainee: Trainee, start: int) -> None:
    """The start line: size, layout, optimizer sharding, EP, recompute, packing, steps."""
    if not run.is_logger:
        return
    cfg, layout = plan.config, run.layout
    ep = cfg.parallel.ep
    frozen, lora = cfg.freeze.frozen(), cfg.lora
    adapters = (f"; LoRA r {lora.rank} alpha {lora.alpha:g} on {trainee.adapted} linears"
                if lora else "")
    print(f"[train] {trainee.n_params / 1e6:.2f} M params on rank 0 "
          f"({trainee.n_trainable / 1e6:.2f} M trainable"
          f"{'; frozen: ' + ', '.join(frozen) if frozen else ''}{adapters}); "
          f"checkpoints hold {'what trains' if trainee.base else 'every weight'}; "
          f"world {layout.world} = "
          f"tp {layout.tp} x pp {layout.pp} x cp {layout.cp} x dp {layout.dp}"
          f"{f' (ep {ep})' if ep > 1 else ''}; optimizer state "
          f"{f'sharded over dp {layout.dp}' if cfg.train.distributed_optimizer else 'replicated'}; "
          f"recompute {cfg.model.recompute}; "
          f"packing {'THD' if cfg.task_encoder.packing else 'off'}; "
          f"steps {start}..{cfg.train.steps}", flush=True)
    print(f"[train] memory of rank 0 (estimate, recipes/memory.py): "
          f"{estimate_memory(trainee.model, cfg, layout.world, uses_bf16(cfg.train)).line()}",
          flush=True)
    print(f"[train] parameter groups (rank 0): {describe_groups(trainee.model, cfg)}", flush=True)


def train_loop(plan: RunPlan, run: Run, trainee: Trainee, loaders, logger, start: int) -> None:
    """Steps ``start``..``train.steps``: one optimizer step each, metrics every
    ``log.interval``, validation every ``train.eval_interval``, checkpoints every
    ``checkpoint.interval`` and on a stop asked by SIGINT / SIGTERM (on any rank)."""
    cfg, layout = plan.config, run.layout
    t, model = cfg.train, trainee.model
    iterators = [iter(loader) for loader in loaders]
    meter, guard = StepMeter(), NonFiniteGuard(t.max_nonfinite_steps)
    plans = PlanLog(run.out, layout, cfg.data.virtual_dp, cfg.log.sample_keys)
    trains_mtp = getattr(cfg.model, "train_mtp", False)  # the MTP head: its own loss
    for step in range(start, t.steps):
        step_start = time.perf_counter()
        batches, wait = next_batches(iterators, t.grad_accum)
        total_tokens = step_token_total(sum(loss_tokens(b) for b in batches))
        lr = lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps,
                   total_steps=t.steps)
        mtp = MTPStep(cfg.model.mtp_loss_weight, step_token_total(
            sum(mtp_loss_tokens(b) for b in batches))) if trains_mtp else None
        loss_sum, grad_norm, stepped = optimizer_step(layout, model, trainee.optimizer, batches,
                                                      trainee.rates.at(step), total_tokens,
                                                      cfg.data.blank_media, mtp)
        aux = moe_aux.step_metrics(model, len(batches))  # MoE: aux loss, expert load, drops
        meter.time += time.perf_counter() - step_start
        meter.wait += wait
        meter.steps += 1
        for batch in batches:
            meter.add_batch(batch, cfg.model)
        done = step + 1
        plans.step(done, batches)
        guard.update(stepped, done, batches, float(loss_sum) / max(total_tokens, 1), grad_norm,
                     run.ckpt_dir)
        if done % cfg.log.interval == 0 or done == t.steps:
            logger.log({"step": done, "loss": float(loss_sum) / max(total_tokens, 1),
                        "lr": lr, "grad_norm": float(grad_norm or 0.0),
                        "loss_tokens": total_tokens, "nonfinite_steps": guard.count, **aux,
                        **({"mtp_loss": mtp.loss, "mtp_loss_tokens": mtp.tokens} if mtp else {}),
                        **meter.summary(layout), **plans.summary()})
            meter.reset()
        if t.eval_interval and (done % t.eval_interval == 0 or done == t.steps):
            tick = time.perf_counter()
            val_loss, val_tokens, val_batches = validation_loss(model, cfg, plan.encoder, layout)
            logger.log_validation(done, val_loss, val_tokens, val_batches,
                                  time.perf_counter() - tick)
        if checkpoint_or_stop(plan, run, trainee, loaders, done, lr):
            break


def next_batches(iterators, grad_accum: int) -> tuple[list, float]:
    """The step's micro-batches (grad_accum from each virtual DP reader) and the seconds spent
    waiting for them."""
    batches, wait = [], 0.0
    for _ in range(grad_accum):
        for it in iterators:
            tick = time.perf_counter()
            batches.append(next(it))
            wait += time.perf_counter() - tick
    return batches, wait


def checkpoint_or_stop(plan: RunPlan, run: Run, trainee: Trainee, loaders, done: int,
                       lr: float) -> bool:
    """Saves a checkpoint when one is due or a stop was asked; True when the loop must stop."""
    cfg = plan.config
    t, every, stop_signal = cfg.train, cfg.checkpoint.interval, run.stop.agreed()
    if not ((every and done % every == 0) or (done == t.steps and cfg.checkpoint.save_final)
            or stop_signal):
        return False
    per_rank, data = loader_states(cfg, loaders)
    step_dir = save_checkpoint(
        run.ckpt_dir, done, model=trainee.model.module, optimizer=trainee.optimizer,
        loader_states=per_rank, layout=run.layout, config_yaml=plan.config_yaml,
        keep_last=t.keep_checkpoints, model_files=trainee.model_files, base=trainee.base,
        train_state={"scheduler": {"step": done, "lr": lr}, "params": trainee.n_params, **data})
    if not (stop_signal and done < t.steps):
        return False
    if run.is_logger:
        print(f"[train] stopped by {signal.Signals(stop_signal).name} after step "
              f"{done}/{t.steps}: checkpoint {step_dir} (continue with --resume or "
              "train.auto_resume=true)", flush=True)
    return True


def teardown(run: Run, logger, quiet) -> None:
    from megatron.core import parallel_state as ps

    logger.close()
    if run.is_logger and quiet.summary("log.all_warnings=true"):
        print(f"[train] {quiet.summary('log.all_warnings=true')}", flush=True)
    if run.is_logger:  # the last line: what the run wrote and where
        latest = run.ckpt_dir / "latest"
        step = run.ckpt_dir / latest.read_text().strip() if latest.is_file() else None
        saved = (f"checkpoint {step} (export: python -m models.convert mcore-to-hf --mcore "
                 f"{run.out} --out <folder>)" if step else "no checkpoint saved")
        print(f"[train] done: metrics {run.out / 'metrics.jsonl'}, {saved}", flush=True)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":  # the guard matters: dist_checkpointing spawns a Manager process
    sys.exit(main())
