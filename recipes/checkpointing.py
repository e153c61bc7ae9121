"""The training checkpoint: everything a run needs to continue exactly.

This module owns what a step folder holds (its place among the others and its ``COMPLETE``
marker: ``models.checkpointing.folders``): megatron dist_checkpointing of model + (distributed)
optimizer (``save_checkpoint`` / ``load_checkpoint``, torch Adam's step counts restored),
``train_state.json`` (step, scheduler, data-parallel size: ``read_train_state``), and the per-rank
state files in safe formats only: the
Energon loader state of each DP replica as JSON (``loader/dp_NNNNN.json``, plain data from
``energon_tasks.loader_state``) and each rank's RNG state as plain tensors
(``rng/rank_NNNNN.pt``, read back by ``models.checkpointing.dist_load.load_blob``: torch's
weights-only unpickler with torch's own allowlist). The dist checkpoint is read only through
``models.checkpointing.dist_load`` (every pickle in it by a restricted unpickler).
``check_rank_states`` (every file, before any heavy work) and ``read_rank_state`` (this rank's)
refuse anything else (a pickle where a state file should be, a folder of an older format) with one
line. ``prune`` keeps the newest N complete step folders.

Integrity (the folder rules are ``models.checkpointing.folders``'): a save writes
``step_N.partial``, hashes its files (each rank a share), writes the manifest ``COMPLETE`` last and
renames the folder ``step_N``; an ``OSError`` on the way (a full disk, a file-size limit) is a
``RunFailure`` whose line names the checkpoint that stays the newest. ``read_train_state`` checks
every recorded file's size before anything is read (every rank: stat only); ``verify_checkpoint``
(collective) hashes each rank's share of the files and agrees on the first one that differs.

Raises ``contract.errors.UsageError`` (one line; train.py exits 2) for every bad checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from contract.errors import RunFailure, UsageError
from models import cpu
from models.checkpointing.checkpoint import write_files
from models.checkpointing.dist_load import check_dist_checkpoint, load_blob
from models.checkpointing.folders import (
    COMPLETE,
    PARTIAL,
    TRAIN_STATE,
    check_hashes,
    check_sizes,
    checkpoint_files,
    complete_folders,
    hash_files,
    manifest,
    newest_complete,
    partial_dir,
    point_latest,
    resolve_checkpoint,
    step_folders,
    step_name,
    write_manifest,
)
from recipes.layout import Layout


def loader_file(step_dir: Path, dp_rank: int) -> Path:
    return step_dir / "loader" / f"dp_{dp_rank:05d}.json"


def rng_file(step_dir: Path, rank: int) -> Path:
    return step_dir / "rng" / f"rank_{rank:05d}.pt"


def rng_state() -> dict:
    """This process's python / numpy / torch (/ CUDA) / megatron tracker RNG state: dicts of
    tensors, numbers and strings only (loadable with ``weights_only=True``)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": {"version": version, "state": torch.tensor(words, dtype=torch.int64),
                       "gauss": gauss},
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                      "has_gauss": has_gauss, "cached_gaussian": cached},
            "torch": torch.get_rng_state(),
            "cuda": cpu.cuda_rng_state(),
            "tracker": dict(get_cuda_rng_tracker().get_states())}


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cpu.set_cuda_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def write_rank_state(step_dir: Path, layout: Layout, loader_states: list) -> None:
    """This rank's RNG state, and (first rank of a replica) its readers' loader states."""
    if layout.first_in_replica:
        loader_file(step_dir, layout.dp_rank).write_text(json.dumps(loader_states))
    torch.save(rng_state(), rng_file(step_dir, layout.rank))


def _loader_states(path: Path, step_dir: Path) -> list:
    try:
        loader = json.loads(path.read_bytes())
        if not isinstance(loader, list):
            raise ValueError("not a list of loader states")
    except (UnicodeDecodeError, ValueError) as error:
        raise UsageError(f"checkpoint {step_dir}: {path.relative_to(step_dir)} is not a JSON "
                         f"loader state ({type(error).__name__}): refused, nothing in a "
                         "checkpoint is unpickled") from None
    return loader


def _rng_state(path: Path, step_dir: Path) -> dict:
    """Raises RefusedCheckpoint (a UsageError): not a plain tensor file."""
    return load_blob(path, f"{step_dir}: {path.relative_to(step_dir)}")


def check_rank_states(step_dir: Path) -> None:
    """Every loader and RNG state file of a step folder is of the safe formats (read, not used).

    Raises:
        UsageError: a file of another format (e.g. a pickle where a state file should be, or
            the pickled ``.pt`` loader state of an earlier version), in one line.
    """
    for path in sorted((step_dir / "loader").glob("*")):
        if path.suffix != ".json":
            raise UsageError(f"checkpoint {step_dir}: {path.relative_to(step_dir)} is not a "
                             "JSON loader state (a pickle of an earlier version?): refused, "
                             "nothing in a checkpoint is unpickled")
        _loader_states(path, step_dir)
    for path in sorted((step_dir / "rng").glob("*")):
        _rng_state(path, step_dir)


def read_rank_state(step_dir: Path, layout: Layout, loader: bool = True
                    ) -> tuple[list, dict | None]:
    """(loader states in their plain form, RNG state or None) of this rank; ``loader=False``:
    the checkpoint's data position is not per rank (the global data plan's, in
    train_state.json), none is read. A rank the checkpoint had no RNG state for (a resume at a
    larger DP size) keeps its own.

    Raises:
        UsageError: a missing or foreign state file, in one line.
    """
    path = loader_file(step_dir, layout.dp_rank)
    if loader and not path.is_file():
        raise UsageError(f"checkpoint {step_dir} has no {path.relative_to(step_dir)}")
    rng = rng_file(step_dir, layout.rank)
    return (_loader_states(path, step_dir) if loader else [],
            _rng_state(rng, step_dir) if rng.is_file() else None)


def prune(ckpt_dir: Path, current: int, keep: int) -> None:
    """Keep the newest ``keep`` complete step folders up to ``current`` (0: all), ``current``
    always (the one just saved and hashed: the last that passed the checks); delete older ones,
    half-written ones (and ``.partial`` leftovers of killed saves). ``.abandoned`` folders are
    left to their owner."""
    kept = 0
    for step, path in reversed(step_folders(ckpt_dir)):
        if step == current or (step < current and (path / COMPLETE).is_file()
                               and (keep == 0 or kept < keep)):
            kept += 1
            continue
        if step > current:  # a later folder: abandon_after renamed the complete ones
            continue
        shutil.rmtree(path, ignore_errors=True)
    for path in Path(ckpt_dir).glob(f"step_*{PARTIAL}"):
        shutil.rmtree(path, ignore_errors=True)


def read_train_state(path: str | Path, dp: int) -> dict:
    """Read and validate a checkpoint before any heavy work: train_state.json, completion,
    the data-parallel size, and every state file (safe formats only).

    Returns:
        The train state with ``dir`` (the step folder) and ``step``.

    Raises:
        UsageError: missing, half-written or unreadable checkpoint, a foreign state file, or a
            data-parallel size that differs.
    """
    step_dir = resolve_checkpoint(path)
    try:
        state = json.loads((step_dir / TRAIN_STATE).read_text())
        step, saved_dp = int(state["step"]), int(state["layout"]["dp"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"checkpoint {path} is unreadable ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''})") from None
    if not (step_dir / COMPLETE).is_file():
        raise UsageError(f"checkpoint {step_dir} is incomplete (no {COMPLETE} marker: its save "
                         "was interrupted); resume from an earlier one")
    problem = check_sizes(step_dir)
    if problem:
        raise UsageError(f"checkpoint {step_dir} failed its checks: {problem}")
    if not (step_dir / "model_optim" / "metadata.json").is_file():
        raise UsageError(f"checkpoint {step_dir} is unreadable (no model_optim/metadata.json)")
    if saved_dp != dp and "data_plan" not in state:  # the global plan's: any DP size
        raise UsageError(f"checkpoint {step_dir} was saved with data-parallel size {saved_dp}, "
                         f"this run has {dp}: the Energon loader state cannot be "
                         "redistributed (resume with the same DP size, or train with "
                         "data.global_plan=true, whose data position resumes at any DP size)")
    check_dist_checkpoint(step_dir / "model_optim")
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
    """Give a fresh torch Adam its (zero) per-parameter state before a checkpoint is loaded or
    saved.

    megatron's distributed optimizer reads the step count from every parameter's state while it
    builds its sharded dict (to load into, or to save); torch's Adam has none before its first
    step (TE's FusedAdam keeps the step in its param groups), e.g. when every step so far was
    skipped as non-finite. Loading overwrites these zeros; a save writes them, and the next step
    computes what it would from no state (torch's Adam starts from the same zeros, step 0).
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


def _trainable(model, model_sd: dict) -> dict:
    """The entries of ``model_sd`` whose tensor trains (a checkpoint that holds only what
    trains: adapters and unfrozen groups; the frozen base is referred to, not copied), with the
    extra state of the modules they belong to."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    kept = {name: entry for name, entry in model_sd.items()
            if isinstance(getattr(entry, "data", None), torch.Tensor)
            and id(entry.data) in trainable}
    modules = {entry.key.rsplit(".", 1)[0] for entry in kept.values()}
    return kept | {name: entry for name, entry in model_sd.items()
                   if name not in kept and not isinstance(getattr(entry, "data", None),
                                                          torch.Tensor)
                   and entry.key.rsplit(".", 1)[0] in modules}


def _sharded(model, optimizer, is_loading: bool, trainable_only: bool = False) -> dict:
    model_sd = model.sharded_state_dict()
    if trainable_only:
        model_sd = _trainable(model, model_sd)
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                      metadata=OPTIMIZER_METADATA)}


def save_checkpoint(ckpt_dir: Path, step: int, *, model, optimizer, loader_states: list,
                    layout: Layout, train_state: dict, config_yaml: str, keep_last: int = 2,
                    model_files: dict[str, bytes] | None = None, base: dict | None = None
                    ) -> Path:
    """Write ``ckpt_dir/step_<N>/`` (collective: every rank calls it) atomically: into
    ``step_<N>.partial``, hashed, its manifest ``COMPLETE`` last, then renamed; point ``latest``
    at it and keep the newest ``keep_last`` complete step folders (0: all).

    ``loader_states``: this rank's Energon loader states (one per virtual DP reader), in their
    plain form (``energon_tasks.loader_state.to_plain``).
    ``model_files``: what export needs besides weights
    (``models.checkpointing.checkpoint.model_record``). ``base``: the frozen base the run started
    from (``recipes.model_setup.base_source``): the checkpoint then holds only what trains (and its
    optimizer state) and records the base.

    Raises:
        RunFailure: a write failed (a full disk, a file-size limit): the partial folder is
            removed, the newest complete checkpoint is still the newest.
    """
    from megatron.core import dist_checkpointing

    step_dir, work = ckpt_dir / step_name(step), partial_dir(ckpt_dir, step)

    def begin():
        shutil.rmtree(work, ignore_errors=True)  # a killed save's leftover
        for sub in ("model_optim", "loader", "rng"):
            (work / sub).mkdir(parents=True, exist_ok=True)

    def rank_files():
        _prime_torch_adam_state(optimizer)  # no step applied yet (all skipped): its zero state
        dist_checkpointing.save(_sharded(model, optimizer, is_loading=False,
                                         trainable_only=base is not None),
                                str(work / "model_optim"))
        write_rank_state(work, layout, loader_states)

    def run_files():
        record = {**train_state, "step": step,
                  "layout": {k: getattr(layout, k) for k in ("world", "tp", "pp", "cp", "dp")},
                  **({"base": base} if base is not None else {})}
        (work / TRAIN_STATE).write_text(json.dumps(record, indent=2))
        (work / "config.yaml").write_text(config_yaml)
        write_files(work, model_files or {})

    hashes = [None] * dist.get_world_size()

    def hash_share():
        names = checkpoint_files(work)
        share = hash_files(work, names[dist.get_rank()::dist.get_world_size()])
        dist.all_gather_object(hashes, share)  # our own {name: size, sha256}, not file bytes

    def finish():
        write_manifest(work, step, {k: v for part in hashes for k, v in part.items()})
        _replace(work, step_dir)
        point_latest(ckpt_dir, step_dir)
        prune(ckpt_dir, step, keep_last)

    first = layout.rank == 0
    _check_finite(model, step_dir)
    for action, mine in ((begin, first), (rank_files, True), (run_files, first),
                         (hash_share, True), (finish, first)):
        _together(action if mine else None, step_dir, work, first)
    return step_dir


def _check_finite(model, step_dir: Path) -> None:
    """Collective: every rank's parameters are finite, or no rank saves.

    Raises:
        RunFailure: a weight is NaN or infinite (the newest checkpoint stays the newest).
    """
    finite = all(bool(torch.isfinite(q).all()) for q in model.parameters())
    flag = torch.tensor([not finite], dtype=torch.int64, device=cpu.compute_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()):
        raise RunFailure(f"the weights are not finite: checkpoint {step_dir.name} not saved; "
                         f"{newest_complete(step_dir.parent) or 'no checkpoint'} is still the "
                         "newest")


def _together(action, step_dir: Path, work: Path, first: bool) -> None:
    """Run ``action`` (None: nothing on this rank), then agree over every rank whether a write
    failed anywhere: then the partial folder is removed and every rank raises RunFailure."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    failure = None
    try:
        if action is not None:
            action()
    except (OSError, RuntimeError, CheckpointException) as error:
        failure = _write_failure(error)
        if failure is None:
            if first:
                shutil.rmtree(work, ignore_errors=True)  # a bug: a traceback, no partial folder
            raise
    except Exception:
        if first:
            shutil.rmtree(work, ignore_errors=True)  # a bug: a traceback, no partial folder
        raise
    flag = torch.tensor([failure is not None], dtype=torch.int64, device=cpu.compute_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return
    if first:
        shutil.rmtree(work, ignore_errors=True)
    newest = newest_complete(step_dir.parent)
    free = shutil.disk_usage(step_dir.parent).free / 2**30
    raise RunFailure(f"saving checkpoint {step_dir.name} failed ({failure or 'on another rank'}; "
                     f"{free:.1f} GiB free there); {newest or 'no checkpoint'} is still the newest")


def _write_failure(error: BaseException) -> str | None:
    """What an exception of a save says went wrong with a write: an ``OSError`` (raised here or
    wrapped by torch's DCP writer), or a failure of DCP's writer (its workers report a full disk
    or a file-size limit as their own error); None when it is neither (a bug: it propagates)."""
    import errno
    import os

    from torch.distributed.checkpoint.api import CheckpointException

    seen, todo, writer = set(), [error], None
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            if not current.errno:
                return str(current)
            return f"{errno.errorcode.get(current.errno, '')}: {os.strerror(current.errno)}"
        if isinstance(current, CheckpointException):
            for value in current.failures.values():
                inner = value[0] if isinstance(value, tuple) else value
                writer = writer or f"the checkpoint writer failed: {_first_line(inner)}"
                todo.append(inner)
        todo += [current.__cause__, current.__context__]
    return writer


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _replace(work: Path, step_dir: Path) -> None:
    """Rename ``work`` to ``step_dir``; an existing ``step_dir`` (the same step saved again)
    is moved aside first and deleted after."""
    aside = step_dir.with_name(step_dir.name + ".replaced")
    if step_dir.exists():
        shutil.rmtree(aside, ignore_errors=True)
        step_dir.rename(aside)
    work.rename(step_dir)
    shutil.rmtree(aside, ignore_errors=True)


def verify_checkpoint(step_dir: Path) -> str | None:
    """Collective: hash this rank's share of a step folder's recorded files (every
    world-size-th one) and agree on the first that differs: its problem line, the same on
    every rank; None when every file matches."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    found = check_hashes(step_dir, (rank, world))
    names = sorted(manifest(step_dir) or {})
    first = torch.tensor([found[0] if found else len(names)], dtype=torch.int64,
                         device=cpu.compute_device())
    if world > 1:
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
    position = int(first.item())
    if position >= len(names):
        return None
    if found and found[0] == position:
        return found[1]
    again = check_hashes(step_dir, (position, len(names)))  # the finder's file, named here
    return again[1] if again else f"{names[position]}: differs (found by another rank)"


def earlier_complete(step_dir: Path) -> list[Path]:
    """The complete step folders before ``step_dir`` in its checkpoints folder, newest first."""
    step_dir = Path(step_dir)
    return [p for p in reversed(complete_folders(step_dir.parent)) if p.name < step_dir.name]


def load_checkpoint(resume: dict, *, model, optimizer, rng: dict | None) -> None:
    """Restore model + optimizer (+ this rank's RNG) in place; ``resume`` is
    ``read_train_state``'s result (the loader states are train.py's to restore).

    Raises:
        UsageError: the dist checkpoint does not match the model (one line).
    """
    from models.checkpointing import dist_load

    step_dir = Path(resume["dir"])
    partial = resume.get("base") is not None  # the base was loaded from its source already
    _prime_torch_adam_state(optimizer)
    try:
        state = dist_load.load(_sharded(model, optimizer, is_loading=True,
                                        trainable_only=partial), step_dir / "model_optim")
        model.load_state_dict(state["model"], strict=not partial)
        with torch.no_grad():  # the distributed optimizer copies into views of the parameters
            optimizer.load_state_dict(state["optimizer"])
        _restore_torch_adam_steps(optimizer, state["optimizer"])
        if rng is not None:
            set_rng_state(rng)
    except UsageError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as error:
        raise UsageError(f"checkpoint {step_dir} cannot be loaded: {type(error).__name__}: "
                         f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}"
                         ) from None


def verified_resume(resume: dict | None, automatic: bool, dp: int) -> dict | None:
    """Collective, after the process group: the checkpoint to resume (``read_train_state``'s
    result) once its files match their recorded checksums (``verify_checkpoint``: each rank hashes
    a share). An automatic resume (``--resume`` without a value, ``train.auto_resume``) falls back
    to the previous intact checkpoint and says so in one line.

    Raises:
        UsageError: a checkpoint named on the command line, or none left, fails its checks.
    """
    import os

    while resume is not None:
        problem = verify_checkpoint(Path(resume["dir"]))
        if problem is None:
            return resume
        line = f"checkpoint {resume['dir']} failed its checks: {problem}"
        earlier = [p for p in earlier_complete(Path(resume["dir"])) if check_sizes(p) is None]
        if not automatic or not earlier:
            raise UsageError(line + ("" if not automatic else
                                     "; no earlier intact checkpoint to resume from"))
        if os.environ.get("RANK", "0") == "0":
            print(f"[train] {line}: resuming from the previous intact checkpoint {earlier[0]}",
                  flush=True)
        resume = read_train_state(earlier[0], dp)
    return None
