"""train.py's run plan: everything the run decides before any process group exists.

``resolve_plan`` turns the loaded run config and the command line (``--resume`` /
``--overwrite``) into a frozen ``RunPlan``, checking every input problem on the way (one line
each, before a model is built): the family's and the layout's rules, the data path and splits,
where the run starts (the run guard and the train state to resume), the tokenizer, the task
encoder and one first batch of the data (``probe_first_batch``), the tokenizer's token ids
against the model, and the model config with those token ids. Its ``config_yaml`` is the one
resolved config: written to ``<out>/config.yaml`` and stored in every checkpoint.

Every process resolves the same plan from the same inputs: the ``tokenizer: test`` tokenizer is
built in a private folder of each process (its training is deterministic) and saved into the run
folder by rank 0 (``save_run_tokenizer``), so no step before the process group needs a barrier.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.errors import UsageError
from models import cpu
from models.families import get as get_family
from recipes.checkpointing import read_train_state
from recipes.compatibility import check_compatible, hf_token_problems
from recipes.data import (
    check_data_path,
    check_split,
    load_run_tokenizer,
    probe_first_batch,
    split_samples,
)
from recipes.layout import check_layout
from recipes.memory import check_memory
from recipes.planner import te_adam_available
from recipes.run_config import RunConfig, dump_yaml
from recipes.run_folder import plan_start

TOKENIZER_FOLDER = "tokenizer"  #: the run folder's copy of a built (``test``) tokenizer


@dataclass(frozen=True, slots=True)
class RunPlan:
    """A training run, resolved: what every step of train.py reads (nothing changes it)."""

    config: RunConfig  #: the run config, the model's token ids set from the tokenizer
    config_yaml: str  #: ``dump_yaml(config)``: ``<out>/config.yaml`` = each checkpoint's copy
    world: int  #: processes of the run (torchrun's WORLD_SIZE)
    resume: dict | None  #: the train state to resume (``read_train_state``), or None
    clear: str  #: what of an earlier run the run folder drops first ("" for nothing)
    tokenizer: Any  #: the run's tokenizer (transformers); None when ``finished``
    encoder: Any  #: the run's task encoder (``VLMTaskEncoder``), counters fresh; None when done
    #: the checkpoint to resume is at ``train.steps`` already: the line saying so and how to
    #: train more ("" otherwise); nothing is built
    finished: str = ""

    @property
    def out(self) -> Path:
        return Path(self.config.out)


def resolve_plan(cfg: RunConfig, world: int, resume_from: str | None,
                 overwrite: bool) -> RunPlan:
    """The plan of a run (see the module docstring).

    Raises:
        ConfigError / UsageError: the first input problem, in one line.
    """
    check_run(cfg, world)
    p = cfg.parallel
    resume_dir, clear = plan_start(Path(cfg.out), cfg.checkpoint_dir, resume_from, overwrite,
                                   cfg.train.auto_resume)
    resume = read_train_state(resume_dir, world // (p.tp * p.pp * p.cp)) if resume_dir else None
    if resume is not None and resume["step"] >= cfg.train.steps:
        return RunPlan(config=cfg, config_yaml="", world=world, resume=resume, clear=clear,
                       tokenizer=None, encoder=None, finished=(
                           f"run {cfg.out} is finished: {resume['dir']} is step {resume['step']}"
                           f", train.steps is {cfg.train.steps}; to train more steps resume with "
                           f"a larger train.steps=<N> (the LR schedule is laid over the new "
                           "steps), or start again with --overwrite"))
    with tempfile.TemporaryDirectory() as private:
        tokenizer = load_run_tokenizer(cfg.task_encoder, Path(private))
    encoder = _probed_encoder(cfg, tokenizer)
    cfg = dataclasses.replace(cfg, model=_with_token_ids(cfg, tokenizer, encoder))
    return RunPlan(config=cfg, config_yaml=dump_yaml(cfg), world=world, resume=resume,
                   clear=clear, tokenizer=tokenizer, encoder=encoder)


def check_run(cfg: RunConfig, world: int) -> None:
    """Every input problem of the config, the layout and the data, before anything is built."""
    check_compatible(cfg.model, cfg.task_encoder)
    p, te_cfg = cfg.parallel, cfg.task_encoder
    family = get_family(cfg.model.family)
    problems = family.layout_problems(cfg.model, p)
    if problems:
        raise UsageError("; ".join(problems))
    lm_adapters = cfg.lora is not None and "language_model" in cfg.lora.parts
    if p.pp > 1 and cfg.freeze.freeze_language_model and not lm_adapters:
        raise UsageError("model.freeze_language_model with parallel.pp > 1: the pipeline stages "
                         "after the first hold only language-model layers, nothing would train "
                         "there (freeze the LM at parallel.pp=1)")
    if getattr(cfg.model, "train_mtp", False) and cfg.lora is not None:
        raise UsageError("model.train_mtp=true with model.lora: the MTP head trains in full "
                         "only (its adapters are not exported); drop one of them")
    if cfg.lora is not None and p.tp > 1 and "in_proj" in cfg.lora.target_modules:
        raise UsageError("model.lora.target_modules: in_proj (a Mamba mixer's, whose rows are "
                         "split over TP part by part) takes adapters at parallel.tp=1 only")
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
    if p.etp is not None and p.etp != p.tp and p.ep == 1:
        raise UsageError(f"parallel.etp {p.etp} other than parallel.tp {p.tp} needs "
                         "parallel.ep > 1 (megatron-core 0.16.1 sums the expert gradients over "
                         "the dense data-parallel group at ep 1, which then differs from the "
                         "experts' one)")
    check_layout(world, p.tp, p.pp, p.cp, te_cfg.fixed_length, p.ep, p.etp)
    if cfg.train.optimizer_state == "bf16" and not te_adam_available():
        raise UsageError("train.optimizer_state=bf16 needs TransformerEngine's FusedAdam "
                         "(megatron-core's precision-aware optimizer; TE >= 2.1): install it or "
                         "keep train.optimizer_state=fp32")
    check_memory(cfg, world)
    check_data_path(cfg.data.path)
    samples = split_samples(cfg.data.path, cfg.data.split_part)
    if samples is not None and cfg.train.micro_batch_size > max(samples, 1):
        raise UsageError(f"train.micro_batch_size {cfg.train.micro_batch_size} is more than the "
                         f"{samples} samples of split {cfg.data.split_part!r} of data.path "
                         f"{cfg.data.path}: a micro-batch would repeat them; lower it")
    if cfg.train.eval_interval:
        check_split(cfg.data.path, cfg.data.val_split_part, "train.eval_interval")


def save_run_tokenizer(plan: RunPlan) -> None:
    """Rank 0: a built (``test``) tokenizer saved into the run folder, so the run keeps the
    tokenizer it used (a hub / folder tokenizer is named in the config already)."""
    if plan.config.task_encoder.tokenizer == "test":
        plan.tokenizer.save_pretrained(str(plan.out / TOKENIZER_FOLDER))


def _probed_encoder(cfg: RunConfig, tokenizer):
    """The task encoder, after one batch of the data came out of it (its counters reset)."""
    from energon_tasks import task_encoder_for

    encoder = task_encoder_for(cfg.task_encoder, tokenizer)
    warning = probe_first_batch(cfg.data.path, cfg.data.split_part, encoder)
    if warning and os.environ.get("RANK", "0") == "0":
        print(f"[train] {warning}", flush=True)
    encoder.reset_counters()
    return encoder


def _with_token_ids(cfg: RunConfig, tokenizer, encoder):
    """The model config with the tokenizer's special-token ids (checked against ``model.hf``'s
    and the vocabulary)."""
    model = cfg.model
    check_compatible(model, cfg.task_encoder, tokenizer=tokenizer, encoder=encoder,
                     weights=cfg.hf and f"model.hf {cfg.hf}")
    if cfg.hf:  # its vision ids, and its bos / eos / pad ids, must be its tokenizer's
        from models.hf.source import hf_config, resolve, special_token_problems

        folder = resolve(cfg.hf, weights=False)
        problems = [*hf_token_problems(folder / "config.json", hf_config(folder), model,
                                       encoder),
                    *special_token_problems(folder, tokenizer)]
        if problems:
            raise UsageError(f"model.hf {cfg.hf}: {'; '.join(problems)}")
    return dataclasses.replace(model, image_token_id=encoder.image_pad,
                               video_token_id=encoder.video_pad,
                               vision_start_token_id=encoder.vision_start,
                               vision_end_token_id=encoder.vision_end)
