"""Hugging Face <-> megatron-core checkpoints of Qwen2.5-VL / Qwen3-VL / Nemotron-Omni, and logit
verification (the family comes from config.json's ``model_type``; models/families.py).

    python -m models.convert hf-to-mcore --hf PATH_OR_ID --out DIR [--tp N] [--pp P]
                                         [--drop-unused]
    python -m models.convert mcore-to-hf --mcore DIR --out DIR [--adapter] [--overwrite] [--base]
                                         (an import or a train.py run / step folder, any
                                          TP/PP/EP; models/hf/export.py)
    python -m models.convert verify --hf PATH --mcore DIR [--tp N] [--pp P]

``hf-to-mcore`` and ``verify`` with ``N * P > 1`` start themselves under ``torch.distributed.run``
with N * P processes (each writes / loads its TP shards of its pipeline stage's layers; the
checkpoint loads at any TP / PP; every family). ``verify`` runs transformers' model
(fp32, eager attention) and ours on generated inputs (models/hf/verify_inputs.py: one image; several
images of different sizes interleaved with text; a video; Nemotron-Omni also a tiled image) and
prints JSON with the max absolute logit difference per input. Bad paths or a wrong model family:
one line on stderr, ``models.convert: error: <message>``, exit 2 (contract/cli.py); a bug is a
traceback. Each command says on stderr when it is done, and every
--progress-every seconds that it is still running when stderr is not a terminal (SLURM logs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import click
import torch

from contract.errors import UsageError
from models.checkpointing.sharding import check_hf_fit, load_hf_weights
from models.families import (
    build_model,
    hf_model_class,
)
from models.hf.export import mcore_to_hf
from models.hf.verify_inputs import hf_inputs, make_inputs

#: written last into a cached import folder (``import_hf_cached``): the import is complete
IMPORT_DONE = "import_complete.json"


# ------------------------------------------------------------------ verify: both models' logits
def hf_logits(hf_model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(**inputs).logits.float()


def pipeline_forward(model, inputs: dict) -> torch.Tensor | None:
    """One forward through the pipeline stages (PP >= 1): each stage receives the hidden states
    (L, B, H) of the previous one, runs its layers and sends them on; the last stage returns the
    model's output, the others None."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return model(**inputs)
    batch, length = inputs["input_ids"].shape
    param = next(model.parameters())
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(length, batch, model.cfg.lm.hidden_size, device=param.device,
                             dtype=model.config.pipeline_dtype)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(**inputs)
    if ps.is_pipeline_last_stage():
        return out
    dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return None


def sequence_parallel_padded(model, inputs: dict) -> tuple[dict, int]:
    """(inputs, L): under megatron's sequence parallelism (a MoE LM at TP > 1), whose shares
    split the sequence over the TP ranks, the (B, L) rows right-padded to a multiple of TP with
    a text token, positions continuing after each row's last: the causal model's logits at the
    first L positions are the unpadded ones. Unchanged otherwise."""
    from megatron.core import parallel_state as ps

    ids = inputs["input_ids"]
    length, tp = ids.shape[-1], ps.get_tensor_model_parallel_world_size()
    lm = getattr(model, "language_model", None)
    if tp == 1 or lm is None or not lm.config.sequence_parallel or length % tp == 0:
        return inputs, length
    extra = tp - length % tp
    media = {getattr(model.cfg, f"{k}_token_id", None) for k in ("image", "video")}
    filler = next(t for t in range(3) if t not in media)
    pos = inputs["position_ids"]  # (3, B, L) M-RoPE or (B, L)
    after = pos.amax(dim=-1, keepdim=True) + torch.arange(1, extra + 1, device=pos.device)
    padded = dict(inputs, input_ids=torch.cat([ids, ids.new_full((*ids.shape[:-1], extra),
                                                                 filler)], dim=-1),
                  position_ids=torch.cat([pos, after.to(pos.dtype)], dim=-1))
    return padded, length


def our_logits(model, inputs: dict) -> torch.Tensor | None:
    """Logits (B, L, V) of our model, float32 on the CPU (TP gathered; under sequence
    parallelism the rows padded to a multiple of TP, ``sequence_parallel_padded``); None on a
    pipeline stage other than the last. ``inputs`` (on the CPU) go to the model's device."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    device = next(model.parameters()).device
    inputs = {key: value.to(device) if isinstance(value, torch.Tensor) else value
              for key, value in inputs.items()}
    inputs, length = sequence_parallel_padded(model, inputs)
    with torch.no_grad():
        logits = pipeline_forward(model, inputs)
        if logits is None:
            return None
        if ps.get_tensor_model_parallel_world_size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
        return logits[:, :length].float().cpu()


def load_hf_model(path: Path):
    """transformers' model of the HF folder ``path`` (its safetensors only: a pickle is never
    loaded), fp32, eager attention."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    cls = hf_model_class(config.model_type)
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                               use_safetensors=True).eval()


# ------------------------------------------------------------------ commands
@contextmanager
def refused(what: str = ""):
    """The models' checks of a folder the user named (not a checkpoint, a ``model_type`` no
    family imports, weights that do not map onto the model: one-line ValueErrors) as a
    ``UsageError`` (after ``what: `` when given). Only around those reads: a ValueError
    elsewhere is a bug and stays a traceback."""
    from contract.errors import UsageError

    try:
        yield
    except ValueError as error:
        raise UsageError(f"{what}: {error}" if what else str(error)) from None


def resolve_hf(path_or_id: str) -> Path:
    from contract.errors import UsageError
    from models.hf.source import HFSourceError, resolve

    try:
        return resolve(path_or_id, weights=True)
    except HFSourceError as error:
        raise UsageError(str(error).replace("model.hf ", "--hf ", 1)) from None


def hf_to_mcore(hf: str, out: Path, tp: int, pp: int, drop_unused: bool = False) -> None:
    """``drop_unused``: leave out the weights of parts of the checkpoint the model does not have
    (Cosmos3-Omni's generator, sound and action towers; one line says what was dropped), which
    are refused otherwise."""
    from models.checkpointing.checkpoint import model_record, save_checkpoint
    from models.checkpointing.sharding import unused_hf_weights
    from models.hf.source import model_config_of, task_encoder_settings
    from models.hf.weights import weight_map
    from models.parallel import init_parallel

    folder = resolve_hf(hf)
    with refused(f"--hf {hf}"):
        cfg = model_config_of(folder)  # family first
        task_encoder_settings(folder, cfg.family)  # processor files the export ships, checked
    init_parallel(tp=tp, pp=pp)
    check_hf_fit(cfg, folder, drop_unused)  # before anything is allocated
    model = build_model(cfg, use_te=False)
    hf_config = load_hf_weights(model, cfg, folder, drop_unused)
    save_checkpoint(model, cfg, out, hf_config=hf_config, files=model_record(folder))
    unused = unused_hf_weights(cfg, weight_map(folder)) if drop_unused else {}
    if unused and int(os.environ.get("RANK", "0")) == 0:
        click.echo("[convert] hf-to-mcore: dropped (--drop-unused) " + ", ".join(
            f"{len(keys)} weights of the {part}" for part, keys in unused.items())
            + f" of {folder}: the export will not have them", err=True)


def import_hf_cached(cfg, source: str, cache_root: Path) -> tuple[Path, bool]:
    """The import of ``source``'s weights (hub id or folder) at this process's TP / PP / EP /
    expert-TP, as an import folder under ``cache_root`` named by the weights' fingerprint and the
    layout (``models.hf.source.cache_name``): written by the first run that needs it (every rank
    its part, through a local-spec model that is then freed), reused by every later one. Collective:
    every rank calls it. Returns (the folder, whether it was reused).

    Raises:
        contract.errors.UsageError: the weights do not map onto ``cfg``'s model (one line).
        models.hf.source.HFSourceError: ``source`` cannot be resolved.
    """
    import shutil

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from models.checkpointing.checkpoint import model_record, save_checkpoint
    from models.hf.source import cache_name, resolve

    folder = resolve(source, weights=True)
    layout = (ps.get_tensor_model_parallel_world_size(),
              ps.get_pipeline_model_parallel_world_size(),
              ps.get_expert_model_parallel_world_size(),
              ps.get_expert_tensor_parallel_world_size())
    mtp = "-mtp" if getattr(cfg, "train_mtp", False) else ""  # the MTP head's weights too
    target = Path(cache_root) / (cache_name(source, folder, *layout) + mtp)
    done = [(target / IMPORT_DONE).is_file()]
    dist.broadcast_object_list(done, src=0)  # one answer for every rank
    if done[0]:
        return target, True
    check_hf_fit(cfg, folder)  # before anything is allocated
    model = build_model(cfg, use_te=False)  # the mapping's keys; dist checkpoints are spec-free
    hf_config = load_hf_weights(model, cfg, folder)
    if dist.get_rank() == 0 and target.exists():  # an import that was interrupted
        shutil.rmtree(target)
    dist.barrier()
    save_checkpoint(model, cfg, target, hf_config=hf_config, files=model_record(folder))
    del model
    if dist.get_rank() == 0:
        (target / IMPORT_DONE).write_text(json.dumps({"source": source, "folder": str(folder)}))
    dist.barrier()
    return target, False


def verify(hf: Path, mcore: Path, tp: int = 1, pp: int = 1) -> dict:
    """Max abs logit difference per generated input, loading ``mcore`` at TP ``tp`` x PP ``pp``
    (under torchrun for tp * pp > 1; the last pipeline stage compares, every rank returns it).

    Raises:
        UsageError: ``hf`` is of another family than ``mcore``, holds no safetensors (a
            pickle-only folder) or weights of other shapes (one line).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from models.checkpointing.checkpoint import load_checkpoint, read_checkpoint
    from models.hf.source import model_config_of
    from models.parallel import init_parallel

    found = read_checkpoint(mcore)  # a bad folder: one line, before any process group
    with refused(f"--hf {hf}"):
        family = model_config_of(Path(hf)).family
    if family != found.model_config.family:
        raise UsageError(f"--hf {hf} is a {family} model, --mcore {mcore} a "
                         f"{found.model_config.family} checkpoint: verify compares a checkpoint "
                         "with the HF model of its own family (the one it was imported from)")
    init_parallel(tp=tp, pp=pp)
    # safetensors of the checkpoint's shapes, or one line (weights of parts the model does not
    # have, which transformers' model ignores too, are no part of the comparison)
    check_hf_fit(found.model_config, hf, drop_unused=True)
    model, cfg = load_checkpoint(mcore, use_te=False)
    last = ps.is_pipeline_last_stage()
    hf_model = load_hf_model(hf) if last else None
    report = {}
    for name, inputs in make_inputs(cfg).items():
        ours = our_logits(model, inputs)
        if last:
            diff = (hf_logits(hf_model, hf_inputs(cfg, inputs)) - ours).abs().max().item()
            report[name] = {"max_abs_logit_diff": diff,
                            "tokens": int(inputs["input_ids"].numel())}
    if pp > 1:  # the last stage's report to every rank
        shared = [report]
        dist.broadcast_object_list(shared, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        report = shared[0]
    return report


_FOLDER = click.Path(exists=True, file_okay=False, path_type=Path)


def _console_options(function):
    function = click.option("--all-warnings", is_flag=True,
                            help="Show the known third-party warnings (counted and hidden "
                                 "otherwise).")(function)
    return click.option("--progress-every", type=float, default=30.0, show_default=True,
                        help="Seconds between 'still running' lines when stderr is not a "
                             "terminal.")(function)


def _layout_options(function):
    function = click.option("--pp", default=1, show_default=True,
                            help="Pipeline-parallel size (processes: tp x pp, under "
                                 "torch.distributed.run).")(function)
    return click.option("--tp", default=1, show_default=True,
                        help="Tensor-parallel size (processes: tp x pp, under "
                             "torch.distributed.run).")(function)


def _run(command: str, args: list[str], ranks: int, work, progress_every: float,
         all_warnings: bool, wrote: str = "") -> None:
    """``work()`` in this process, or this command again under torch.distributed.run with
    ``ranks`` processes; rank 0 reports a heartbeat and the end on stderr (an error stays the
    one line ``main`` prints)."""
    from contract.console import KnownWarnings, Progress, format_duration

    if ranks > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "-m", "models.convert", command, *args, "--progress-every", str(progress_every),
               *(["--all-warnings"] if all_warnings else [])]
        raise SystemExit(subprocess.call(cmd))
    quiet = KnownWarnings(enabled=not all_warnings)
    if int(os.environ.get("RANK", "0")):
        work()
        return
    with Progress("convert", progress_every, stream=sys.stderr).heartbeat(command) as progress:
        work()
    click.echo(f"[convert] {command}: done in {format_duration(progress.elapsed())}"
               f"{'; ' + quiet.summary('--all-warnings') if quiet.count else ''}", err=True)
    if wrote:  # the last line: what was written and where
        click.echo(f"[convert] {command}: {wrote}", err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Hugging Face <-> megatron-core checkpoints of Qwen2.5-VL / Qwen3-VL / Nemotron-Omni."""


@cli.command("hf-to-mcore")
@click.option("--hf", required=True, help="Hugging Face model folder, or a hub id.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Output folder: the megatron dist checkpoint (+ model and HF configs).")
@click.option("--drop-unused", is_flag=True,
              help="Leave out the weights of parts of the checkpoint the model does not have "
                   "(Cosmos3-Omni's generator, sound and action towers), refused otherwise.")
@_layout_options
@_console_options
def hf_to_mcore_command(hf: str, out: Path, tp: int, pp: int, drop_unused: bool,
                        **console) -> None:
    """Import HF weights into a megatron dist checkpoint (loads at any TP / PP)."""
    _run("hf-to-mcore", ["--hf", hf, "--out", str(out), "--tp", str(tp), "--pp", str(pp),
                         *(["--drop-unused"] if drop_unused else [])],
         tp * pp, lambda: hf_to_mcore(hf, out, tp, pp, drop_unused), **console,
         wrote=f"wrote the megatron checkpoint {out} (loads at any TP / PP)")


@cli.command("mcore-to-hf")
@click.option("--mcore", required=True, type=_FOLDER, help="Megatron dist checkpoint folder.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Output folder: config.json + safetensors that transformers loads.")
@click.option("--adapter", is_flag=True,
              help="A LoRA run: write its HF PEFT folder (adapter_config.json + "
                   "adapter_model.safetensors, loaded by peft onto the base HF model) instead "
                   "of the merged model.")
@click.option("--overwrite", is_flag=True,
              help="Replace a previous export in --out (as a whole). Without it --out must be "
                   "new or empty; a folder that is not an export is never replaced.")
@click.option("--base", type=_FOLDER,
              help="Where the base of a checkpoint that holds only what trains (a LoRA run) is "
                   "now, when it moved (recognised by its content).")
@_console_options
def mcore_to_hf_command(mcore: Path, out: Path, adapter: bool, overwrite: bool,
                        base: Path | None, **console) -> None:
    """Export a megatron dist checkpoint as a Hugging Face model folder (a LoRA run's adapters
    merged into the weights, or with --adapter its PEFT folder), written into a new folder
    (models/hf/export.py): never into the checkpoint or the base it refers to."""
    wrote = (f"wrote the HF PEFT adapter folder {out} (adapter_config.json, "
             "adapter_model.safetensors)" if adapter else
             f"wrote the Hugging Face model folder {out} (config.json, model.safetensors, "
             "tokenizer with chat template, processor and generation configs)")
    _run("mcore-to-hf", [], 1, lambda: mcore_to_hf(mcore, out, adapter, overwrite, base),
         **console,
         wrote=wrote)


@cli.command("verify")
@click.option("--hf", required=True, type=_FOLDER, help="Hugging Face model folder.")
@click.option("--mcore", required=True, type=_FOLDER, help="Its megatron dist checkpoint.")
@_layout_options
@_console_options
def verify_command(hf: Path, mcore: Path, tp: int, pp: int, **console) -> None:
    """Print JSON: max |logit difference| of transformers' model and ours per generated input."""
    def work():
        report = verify(hf, mcore, tp, pp)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(report, indent=2))

    _run("verify", ["--hf", str(hf), "--mcore", str(mcore), "--tp", str(tp), "--pp", str(pp)],
         tp * pp, work, **console)


def main(argv: list[str] | None = None) -> int:
    """The command line (contract/cli.py); returns the exit code."""
    from contract.cli import run_click

    return run_click(cli, "models.convert", argv)


if __name__ == "__main__":
    sys.exit(main())
