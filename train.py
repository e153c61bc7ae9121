"""Supervised fine-tuning of a VLM (Qwen-VL, Nemotron-Omni) on Energon data with megatron-core.

A recipe, top to bottom:

    python train.py configs/train_qwen_vl_mantis.yaml [key=value ...] [--resume [CKPT]]
    python train.py CONFIG ... --overwrite             # start again in an out that holds a run
    python train.py configs/train_nemotron_omni_infovqa.yaml ...
    torchrun --nproc-per-node 2 train.py CONFIG parallel.cp=2 ...
    torchrun --nproc-per-node 2 train.py CONFIG parallel.pp=2 task_encoder.fixed_length=true ...

Steps (``train()``, one function each): check_run -> start_run (run folder, distributed setup)
-> build_data -> build_model_and_optimizer -> restore -> announce -> train_loop (next_batches,
optimizer_step, validation_loss, checkpoint_or_stop on SIGINT / SIGTERM) -> teardown. The pieces
live in recipes/: run_config.py (the config), layout.py (TP x PP x CP x EP x DP), data.py
(tokenizer and data checks), schedule.py (LR, loss normalisation), metrics.py, checkpointing.py
(the training checkpoint, safe state files, retention) and run_folder.py (the run guard, stop
signals).
Every input problem (config, data, layout, checkpoint, an ``out`` that holds a run) is one line on
stderr and exit code 2, before the model is built. SIGINT / SIGTERM save a checkpoint after the
current step and exit 0.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from pathlib import Path

import click
import torch

from contract.batch import VLMBatch
from contract.cli import run_click
from contract.errors import UsageError
from models import cpu
from models.families import get as get_family
from recipes.checkpointing import (
    load_checkpoint,
    read_rank_state,
    read_train_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from recipes.compatibility import check_compatible
from recipes.data import check_data_path, check_split, load_run_tokenizer, probe_first_batch
from recipes.layout import check_layout, init_distributed
from recipes.metrics import MetricsLogger, StepMeter
from recipes.run_config import ConfigError, dump_yaml, load_run_config, to_dict
from recipes.run_folder import StopSignal, plan_start, prepare_run_folder
from recipes.schedule import loss_tokens, lr_at, step_token_total


# --- adapter: the model and one forward over a batch ------------------------------------------
def build_model(cfg, layout):
    """The model of ``cfg.model.family`` (vision DP over CP inside); CPU CP attention."""
    from models.families import build_model as build

    model = build(cfg.model, vision_dp_over_cp=cfg.parallel.vision_dp)
    cpu.use_cp_attention(model.language_model)
    return model


def import_hf_weights(cfg, is_logger: bool) -> str:
    """``model.hf``: the import of the HF model's weights at this run's TP / PP / EP, cached under
    ``train.hf_import_cache`` and reused by reruns (``models.convert.import_hf_cached``); logs
    which weights the run starts from. Returns the import folder (a dist checkpoint)."""
    from models.convert import import_hf_cached
    from models.hf_source import default_import_cache

    cache = Path(cfg.train.hf_import_cache or default_import_cache())
    try:
        folder, reused = import_hf_cached(cfg.model, cfg.hf, cache)
    except ValueError as error:  # bad source or weights that do not map: one line
        message = str(error)
        raise UsageError(message if message.startswith("model.hf") else
                         f"model.hf {cfg.hf}: {message}") from None
    if is_logger:
        print(f"[train] starting from the HF weights of {cfg.hf} "
              f"({'cached import' if reused else 'imported into'} {folder})", flush=True)
    return str(folder)


def forward_step(model, batch: VLMBatch, blank_media: bool):
    """Per-token loss (B, L/CP) * mask of this rank's CP share of ``batch`` (the model runs its
    share); under PP a stage before the last returns its output hidden states (L, B, H), or
    (B*L, 1, H) for a packed batch, which megatron's schedule sends on."""
    device = next(model.parameters()).device
    fields = batch.model_inputs(device)
    if blank_media:  # the vision-signal control: every pixel row at the normalised mean
        fields["pixel_values"] = torch.zeros_like(fields["pixel_values"])
        fields["pixel_values_videos"] = torch.zeros_like(fields["pixel_values_videos"])
    out = model(**fields, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen,
                sample_keys=batch.__key__)
    return out[0] if isinstance(out, tuple) else out  # (per-token loss, mask) | hidden


def pipeline_step(model, batches, layout, blank_media: bool, loss_scale: float,
                  forward_only: bool = False) -> torch.Tensor:
    """Forward + backward (or only forward) of one step's micro-batches through megatron's 1F1B
    pipeline schedule (PP > 1): vision + embedding on the first stage, the loss on the last. Each
    micro-batch's backward gets ``sum(token losses) * loss_scale`` as in the PP=1 loop (the
    schedule's own division by the micro-batch count is undone). Returns the summed token loss
    (float64, (1,)) on the last stage, zero elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    shape = tuple(batches[0].input_ids.shape)  # (micro-batch size, seq_length): fixed_length
    for batch in batches:
        if tuple(batch.input_ids.shape) != shape:
            raise UsageError(f"parallel.pp > 1 needs equal micro-batches, got "
                             f"{tuple(batch.input_ids.shape)} and {shape}")
    sums = []

    def loss_func(per_token):
        token_loss = per_token.float().sum()
        sums.append(token_loss.detach().double().cpu())
        return token_loss * (loss_scale * len(batches) / layout.cp), {}  # schedule: * cp / n

    def step(data_iterator, module):
        return forward_step(module, next(data_iterator), blank_media), loss_func

    # the stages exchange (L, B, H) hidden states; packed batches run as one THD row of B*L
    rows, length = (1, shape[0] * shape[1]) if batches[0].cu_seqlens is not None else shape
    get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=length, micro_batch_size=rows,
        forward_only=forward_only)
    loss_sum = torch.zeros(1, dtype=torch.float64)
    if ps.is_pipeline_last_stage():
        for value in sums:
            loss_sum += value
    return loss_sum


def reduce_loss(loss_sum: torch.Tensor, layout) -> torch.Tensor:
    """The summed token loss over DP x CP (and from the last pipeline stage to every stage)."""
    from megatron.core import parallel_state as ps

    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    if dp_cp.size() > 1:
        torch.distributed.all_reduce(loss_sum, group=dp_cp)
    if layout.pp > 1:  # the last stage's loss to every stage (rank 0 logs)
        torch.distributed.all_reduce(loss_sum, group=ps.get_pipeline_model_parallel_group())
    return loss_sum


def validation_loss(model, cfg, encoder, layout) -> tuple[float, int, int]:
    """(loss per supervised token, tokens, batches per reader) over the first
    ``train.eval_batches`` micro-batches of each DP reader's share of the val split (the same
    batches every time); the RNG state is left as it was."""
    from megatron.core import parallel_state as ps

    from energon_tasks.loader import get_val_loader

    virtual, count = cfg.data.virtual_dp, cfg.train.eval_batches
    batches = [list(itertools.islice(get_val_loader(
        cfg.data.path, task_encoder=encoder, batch_size=cfg.train.micro_batch_size,
        dp_rank=layout.dp_rank * virtual + v, dp_size=layout.dp * virtual, num_workers=0,
        split_part=cfg.data.val_split_part), count)) for v in range(virtual)]
    shortest = torch.tensor([min(len(b) for b in batches)])
    if layout.dp > 1:  # every replica runs the same number of forwards (EP exchanges tokens)
        torch.distributed.all_reduce(shortest, op=torch.distributed.ReduceOp.MIN,
                                     group=ps.get_data_parallel_group())
    batches = [b for reader in batches for b in reader[:int(shortest)]]
    if not batches:
        return float("nan"), 0, 0
    saved = rng_state()
    model.eval()
    with torch.no_grad():
        if layout.pp > 1:
            loss_sum = pipeline_step(model, batches, layout, cfg.data.blank_media, 1.0,
                                     forward_only=True)
        else:
            loss_sum = torch.zeros(1, dtype=torch.float64)
            for batch in batches:
                loss_sum += forward_step(model, batch, cfg.data.blank_media).double().sum()
    set_rng_state(saved)
    tokens = step_token_total(sum(loss_tokens(b) for b in batches))
    return float(reduce_loss(loss_sum, layout)) / max(tokens, 1), tokens, int(shortest)


# --- config ------------------------------------------------------------------------------------
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
    return train(config, overrides, resume, overwrite)


def main(argv=None) -> int:
    return run_click(cli, "train.py", argv, (ConfigError, UsageError))


def train(config: str, overrides: tuple[str, ...], resume_from: str | None,
          overwrite: bool) -> int:
    """The recipe: each step below is one function of this file, in this order."""
    from contract.console import KnownWarnings

    cfg = load_run_config(config, overrides)
    quiet = KnownWarnings(enabled=not cfg.log.all_warnings)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_run(cfg, world)
    run = start_run(cfg, world, resume_from, overwrite)
    tokenizer, encoder, loaders = build_data(cfg, run)
    model, optimizer = build_model_and_optimizer(cfg, run, tokenizer)
    start = restore(run, model, optimizer, loaders)
    announce(cfg, run, start)
    train_loop(cfg, run, encoder, loaders, model, optimizer, start)
    teardown(run, quiet)
    return 0


class Run:
    """What the recipe's steps share: the run folder, the parallel layout, the checkpoint to
    resume (or None), the stop signal and the model files an export ships."""

    def __init__(self, cfg, layout, resume, stop):
        self.out, self.ckpt_dir = Path(cfg.out), cfg.checkpoint_dir
        self.layout, self.resume, self.stop = layout, resume, stop
        self.is_logger = layout.rank == 0
        self.model_files = None
        self.n_params = 0
        self.logger = None


def check_run(cfg, world: int) -> None:
    """Every input problem of the config, the layout and the data, before anything is built."""
    check_compatible(cfg.model, cfg.task_encoder)
    p, te_cfg = cfg.parallel, cfg.task_encoder
    family = get_family(cfg.model.family)
    problems = family.layout_problems(cfg.model, p)
    if problems:
        raise UsageError("; ".join(problems))
    if p.cp > 1 and te_cfg.packing:
        raise UsageError("parallel.cp > 1 with task_encoder.packing is not supported yet "
                         "(packed rows need a per-segment CP split)")
    if p.ep > 1:
        experts = family.num_experts(cfg.model)
        if not experts or experts % p.ep:
            raise UsageError(f"parallel.ep {p.ep} needs MoE layers whose expert count it divides "
                             f"(model.family {cfg.model.family!r} has "
                             f"{experts or 'no'} experts)")
        if cpu.ep_needs_fixed_length() and not te_cfg.fixed_length:
            raise UsageError("parallel.ep > 1 on CPU needs task_encoder.fixed_length=true (the "
                             "CPU MoE dispatcher, allgather, needs equal token counts per rank)")
    check_layout(world, p.tp, p.pp, p.cp, te_cfg.fixed_length, p.ep)
    check_data_path(cfg.data.path)
    if cfg.train.eval_interval:
        check_split(cfg.data.path, cfg.data.val_split_part, "train.eval_interval")


def start_run(cfg, world: int, resume_from: str | None, overwrite: bool) -> Run:
    """The run folder (continue it, start it again, or refuse), then the distributed setup."""
    p, out, ckpt_dir = cfg.parallel, Path(cfg.out), cfg.checkpoint_dir
    resume_from, clear = plan_start(out, ckpt_dir, resume_from, overwrite, cfg.train.auto_resume)
    resume = read_train_state(resume_from, world // (p.tp * p.pp * p.cp)) if resume_from else None
    layout = init_distributed(p.tp, p.pp, p.cp, cfg.train.seed, p.ep)
    run = Run(cfg, layout, resume, StopSignal())
    if run.is_logger:
        prepare_run_folder(out, ckpt_dir, clear, resume)
        (out / "config.yaml").write_text(dump_yaml(cfg))
        print(f"[train] resolved config: {out / 'config.yaml'}", flush=True)
    torch.distributed.barrier()
    return run


def build_data(cfg, run: Run):
    """Tokenizer, task encoder (its special tokens written into the model config) and one train
    loader per virtual DP rank; the first batch is probed before the model is built."""
    from energon_tasks import task_encoder_for
    from energon_tasks.loader import get_train_loader

    te_cfg, layout = cfg.task_encoder, run.layout
    tokenizer = load_run_tokenizer(te_cfg, run.out, builds=layout.rank == 0,
                                   wait=torch.distributed.barrier)
    probe_first_batch(cfg.data.path, cfg.data.split_part, task_encoder_for(te_cfg, tokenizer))
    encoder = task_encoder_for(te_cfg, tokenizer)
    check_compatible(cfg.model, te_cfg, tokenizer=tokenizer, encoder=encoder,
                     weights=cfg.hf and f"model.hf {cfg.hf}",
                     token_ids=("image_token_id",) if cfg.hf else ())
    cfg.model.image_token_id, cfg.model.video_token_id = encoder.image_pad, encoder.video_pad
    cfg.model.vision_start_token_id = encoder.vision_start
    cfg.model.vision_end_token_id = encoder.vision_end
    virtual = cfg.data.virtual_dp
    loaders = [get_train_loader(
        cfg.data.path, task_encoder=encoder, batch_size=cfg.train.micro_batch_size,
        dp_rank=layout.dp_rank * virtual + v, dp_size=layout.dp * virtual,
        num_workers=cfg.data.num_workers, shuffle_buffer_size=cfg.data.shuffle_buffer_size,
        max_samples_per_sequence=cfg.data.max_samples_per_sequence,
        seed_offset=cfg.data.seed_offset, split_part=cfg.data.split_part) for v in range(virtual)]
    for loader in loaders:
        run.stop.protect_workers(loader)
    return tokenizer, encoder, loaders


def build_model_and_optimizer(cfg, run: Run, tokenizer):
    """The model (from ``model.hf``, ``train.init_checkpoint`` or random init), bf16 and DDP
    wrappers, megatron's optimizer (state sharded over DP with ``train.distributed_optimizer``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from models.checkpoint import load_weights, model_record
    from models.hf_source import resolve

    t = cfg.train
    bf16 = t.precision == "bf16" or (t.precision == "auto" and cpu.bf16_by_default())
    init = t.init_checkpoint
    if cfg.hf and run.resume is None:
        init = import_hf_weights(cfg, run.is_logger)
    hf_folder = resolve(cfg.hf, weights=False) if cfg.hf else None  # the model's own files
    run.model_files = model_record(hf_folder, tokenizer) if run.is_logger else None  # for export
    model = build_model(cfg, run.layout)
    if init and run.resume is None:
        load_weights(model, init)
    if bf16:
        from megatron.core.transformer.module import Float16Module
        model.config.bf16 = True
        model.config.pipeline_dtype = torch.bfloat16  # the activations sent between PP stages
        model = Float16Module(model.config, model)
    sharded = t.distributed_optimizer
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=sharded,
                                               bucket_size=None)
    model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    run.n_params = sum(q.numel() for q in model.parameters())
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, bf16=bf16,
        params_dtype=torch.float32, use_distributed_optimizer=sharded,
        clip_grad=t.clip_grad), [model])
    return model, optimizer


def restore(run: Run, model, optimizer, loaders) -> int:
    """With a checkpoint to resume: model, optimizer, RNG and loader states. Returns the step
    the loop starts at."""
    if run.resume is None:
        return 0
    from energon_tasks.loader_state import LoaderStateError, from_plain

    resume = run.resume
    plain, rng = read_rank_state(Path(resume["dir"]), run.layout)
    if len(plain) != len(loaders):
        raise UsageError(f"checkpoint {resume['dir']} holds {len(plain)} loader states per "
                         f"rank, data.virtual_dp is {len(loaders)}")
    try:
        states = [from_plain(state) for state in plain]
    except LoaderStateError as error:
        raise UsageError(f"checkpoint {resume['dir']}: loader state refused ({error})") from None
    load_checkpoint(resume, model=model.module, optimizer=optimizer, rng=rng)
    for loader, state in zip(loaders, states, strict=True):
        loader.restore_state_rank(state)
    return resume["step"]


def announce(cfg, run: Run, start: int) -> None:
    """The start line: size, layout, optimizer sharding, EP, recompute, packing, steps."""
    if not run.is_logger:
        return
    layout, p = run.layout, cfg.parallel
    print(f"[train] {run.n_params / 1e6:.2f} M params on rank 0; world {layout.world} = "
          f"tp {layout.tp} x pp {layout.pp} x cp {layout.cp} x dp {layout.dp}"
          f"{f' (ep {p.ep})' if p.ep > 1 else ''}; optimizer state "
          f"{f'sharded over dp {layout.dp}' if cfg.train.distributed_optimizer else 'replicated'}; "
          f"recompute {cfg.model.recompute}; "
          f"packing {'THD' if cfg.task_encoder.packing else 'off'}; "
          f"steps {start}..{cfg.train.steps}", flush=True)


def train_loop(cfg, run: Run, encoder, loaders, model, optimizer, start: int) -> None:
    """Steps ``start``..``train.steps``: one optimizer step each, metrics every
    ``log.interval``, validation every ``train.eval_interval``, checkpoints every
    ``checkpoint.interval`` and on a stop asked by SIGINT / SIGTERM (on any rank)."""
    t, layout = cfg.train, run.layout
    run.logger = MetricsLogger(run.out, enabled=run.is_logger, tensorboard=cfg.log.tensorboard,
                               wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project,
                               config=to_dict(cfg), start_step=start, total_steps=t.steps)
    iterators = [iter(loader) for loader in loaders]
    meter = StepMeter()
    for step in range(start, t.steps):
        step_start = time.perf_counter()
        batches, wait = next_batches(iterators, t.grad_accum)
        total_tokens = step_token_total(sum(loss_tokens(b) for b in batches))
        lr = lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps,
                   total_steps=t.steps)
        loss_sum, grad_norm = optimizer_step(cfg, layout, model, optimizer, batches, lr,
                                             total_tokens)
        meter.time += time.perf_counter() - step_start
        meter.wait += wait
        meter.steps += 1
        for batch in batches:
            meter.add_batch(batch, cfg.model)
        done = step + 1
        if done % cfg.log.interval == 0 or done == t.steps:
            run.logger.log({"step": done, "loss": float(loss_sum) / max(total_tokens, 1),
                            "lr": lr, "grad_norm": float(grad_norm or 0.0),
                            "loss_tokens": total_tokens, **meter.summary(layout)})
            meter.reset()
        if t.eval_interval and (done % t.eval_interval == 0 or done == t.steps):
            tick = time.perf_counter()
            val_loss, val_tokens, val_batches = validation_loss(model, cfg, encoder, layout)
            run.logger.log_validation(done, val_loss, val_tokens, val_batches,
                                      time.perf_counter() - tick)
        if checkpoint_or_stop(cfg, run, model, optimizer, loaders, done, lr):
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


def optimizer_step(cfg, layout, model, optimizer, batches, lr: float, total_tokens: int):
    """Forward and backward over the step's micro-batches (1F1B schedule under PP), then the
    optimizer step (clipped to ``train.clip_grad``). Returns the step's loss sum (over every
    rank) and the grad norm."""
    from megatron.core.distributed import finalize_model_grads

    for group in optimizer.param_groups:
        group["lr"] = lr
    scale = layout.dp * layout.cp  # DDP averages over DP x CP: undo it, we divide by tokens
    model.train()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    if layout.pp > 1:  # megatron's 1F1B schedule; the loss sum lives on the last stage
        loss_sum = pipeline_step(model, batches, layout, cfg.data.blank_media,
                                 scale / max(total_tokens, 1))
    else:
        loss_sum = torch.zeros(1, dtype=torch.float64)
        for batch in batches:
            token_loss = forward_step(model, batch, cfg.data.blank_media).float().sum()
            (token_loss * scale / max(total_tokens, 1)).backward()
            loss_sum += token_loss.detach().double().cpu()
    finalize_model_grads([model])
    _ok, grad_norm, _zeros = optimizer.step()  # clips to train.clip_grad first
    reduce_loss(loss_sum, layout)
    return loss_sum, grad_norm


def checkpoint_or_stop(cfg, run: Run, model, optimizer, loaders, done: int, lr: float) -> bool:
    """Saves a checkpoint when one is due or a stop was asked; True when the loop must stop."""
    from energon_tasks.loader_state import to_plain

    t, every, stop_signal = cfg.train, cfg.checkpoint.interval, run.stop.agreed()
    if not ((every and done % every == 0) or (done == t.steps and cfg.checkpoint.save_final)
            or stop_signal):
        return False
    step_dir = save_checkpoint(
        run.ckpt_dir, done, model=model.module, optimizer=optimizer,
        loader_states=[to_plain(loader.save_state_rank()) for loader in loaders],
        layout=run.layout, config_yaml=dump_yaml(cfg), keep_last=t.keep_checkpoints,
        model_files=run.model_files,
        train_state={"scheduler": {"step": done, "lr": lr}, "params": run.n_params})
    if not (stop_signal and done < t.steps):
        return False
    if run.is_logger:
        print(f"[train] stopped by {signal.Signals(stop_signal).name} after step "
              f"{done}/{t.steps}: checkpoint {step_dir} (continue with --resume or "
              "train.auto_resume=true)", flush=True)
    return True


def teardown(run: Run, quiet) -> None:
    from megatron.core import parallel_state as ps

    if run.logger is not None:
        run.logger.close()
    if run.is_logger and quiet.summary("log.all_warnings=true"):
        print(f"[train] {quiet.summary('log.all_warnings=true')}", flush=True)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":  # the guard matters: dist_checkpointing spawns a Manager process
    sys.exit(main())
