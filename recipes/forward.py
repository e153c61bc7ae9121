"""The training step's adapter between the batch contract and the model: one forward per
micro-batch (``forward_step``; the vision-signal control blanks the pixels), megatron's 1F1B
schedule under pipeline parallelism (``pipeline_step``), the loss summed over DP x CP
(``reduce_loss``), one optimizer step over a step's micro-batches (``optimizer_step``: the loss
normalised by the step's supervised tokens, see ``recipes.schedule``; with an MTP head
(``model.train_mtp``, ``MTPStep``) + its weight x its own per-token mean; a non-finite loss or
gradient norm skips the update and zeroes the gradients) and the validation loss
(``validation_loss``: the same batches every time, the RNG state left as it was).
"""

from __future__ import annotations

import itertools

import torch

from contract.batch import VLMBatch
from contract.errors import UsageError
from models.layers import moe_aux
from recipes.checkpointing import rng_state, set_rng_state
from recipes.schedule import loss_tokens, step_token_total


def forward_step(model, batch: VLMBatch, blank_media: bool):
    """Per-token loss (B, L/CP) * mask of this rank's CP share of ``batch`` (the model runs its
    share); under PP a stage before the last returns its output hidden states (L, B, H), or
    (B*L, 1, H) for a packed batch, which megatron's schedule sends on."""
    out = forward_outputs(model, batch, blank_media)
    return out[0] if isinstance(out, tuple) else out  # (per-token loss, mask) | hidden


def forward_outputs(model, batch: VLMBatch, blank_media: bool):
    """The model's output on ``batch``: (per-token loss * mask, mask[, the MTP head's per-token
    loss * its mask (``model.train_mtp``, while training)]) on the last stage, hidden states
    on the others."""
    device = next(model.parameters()).device
    fields = batch.model_inputs(device)
    if blank_media:  # the vision-signal control: every pixel row at the normalised mean
        fields["pixel_values"] = torch.zeros_like(fields["pixel_values"])
        fields["pixel_values_videos"] = torch.zeros_like(fields["pixel_values_videos"])
    return model(**fields, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen,
                 sample_keys=batch.__key__)


class MTPStep:
    """``model.train_mtp``: the MTP loss's weight and the step's MTP tokens over DP (its mean's
    denominator); ``optimizer_step`` adds the step's summed MTP token loss (``loss_sum``, over
    every rank: ``loss`` is its mean)."""

    def __init__(self, weight: float, tokens: int):
        self.weight, self.tokens = weight, tokens
        self.loss_sum = torch.zeros(1, dtype=torch.float64)

    @property
    def loss(self) -> float:
        return float(self.loss_sum) / max(self.tokens, 1)


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


def optimizer_step(layout, model, optimizer, batches, lr, total_tokens: int,
                   blank_media: bool = False, mtp: MTPStep | None = None):
    """Forward and backward over the step's micro-batches (1F1B schedule under PP), then the
    optimizer step (clipped to ``train.clip_grad``) unless the loss sum (over every rank) or the
    gradient norm is not finite: then no update, the gradients zeroed. Returns (the step's loss
    sum over every rank, the grad norm, whether the optimizer stepped): the same on every rank.
    ``lr``: one rate, or one per optimizer group (recipes.param_groups.GroupRates). ``mtp``
    (``model.train_mtp``, PP = 1): the objective is the LM loss + ``mtp.weight`` x the MTP
    head's loss, each a mean over its own tokens."""
    import math

    from megatron.core.distributed import finalize_model_grads

    rates = lr if isinstance(lr, (list, tuple)) else [lr] * len(optimizer.param_groups)
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scale = layout.dp * layout.cp  # DDP averages over DP x CP: undo it, we divide by tokens
    model.train()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    moe_aux.begin_step()  # the logged aux-loss term is this step's forwards' only
    if layout.pp > 1:  # megatron's 1F1B schedule; the loss sum lives on the last stage
        loss_sum = pipeline_step(model, batches, layout, blank_media,
                                 scale / max(total_tokens, 1))
    else:
        loss_sum = torch.zeros(1, dtype=torch.float64)
        moe_aux.set_backward_scale(model, len(batches), layout.cp)  # MoE: as megatron's schedule
        for batch in batches:
            out = forward_outputs(model, batch, blank_media)
            token_loss = out[0].float().sum()
            objective = token_loss * scale / max(total_tokens, 1)
            if mtp is not None:
                mtp_loss = out[2].float().sum()
                objective = objective + mtp_loss * (mtp.weight * scale / max(mtp.tokens, 1))
                mtp.loss_sum += mtp_loss.detach().double().cpu()
            objective.backward()
            loss_sum += token_loss.detach().double().cpu()
    finalize_model_grads([model])
    reduce_loss(loss_sum, layout)
    finite = math.isfinite(float(loss_sum))
    if mtp is not None:
        reduce_loss(mtp.loss_sum, layout)
        finite = finite and math.isfinite(float(mtp.loss_sum))
    stepped, grad_norm = _step_if_finite(optimizer, finite)
    if not stepped:
        model.zero_grad_buffer()
        optimizer.zero_grad()
    return loss_sum, grad_norm, stepped


def _step_if_finite(optimizer, loss_finite: bool) -> tuple[bool, float | None]:
    """megatron's ``optimizer.step()`` in its parts (prepare the main grads, their norm, clip
    by that norm, step) with a stop before the update when the loss or the norm is not finite
    (the norm is a collective: every rank sees the same). Returns (stepped, grad norm)."""
    import math

    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    with torch.no_grad():
        found_inf = optimizer.prepare_grads()  # fp16 loss scaling's own check (off in bf16)
        grad_norm = float(optimizer.get_grad_norm())
        if found_inf or not loss_finite or not math.isfinite(grad_norm):
            return False, grad_norm
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
            if opt.config.clip_grad > 0.0 and params:
                clip_grad_by_total_norm_fp32(
                    params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                    use_decoupled_grad=getattr(
                        opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))
        return bool(optimizer.step_with_ready_grads()), grad_norm


class NonFiniteGuard:
    """Counts the steps ``optimizer_step`` skipped (``count``: logged as ``nonfinite_steps``) and
    stops the run after ``limit`` in a row (``train.max_nonfinite_steps``)."""

    def __init__(self, limit: int):
        self.limit, self.count, self.streak = limit, 0, 0

    def update(self, stepped: bool, done: int, batches, loss: float, grad_norm,
               ckpt_dir) -> None:
        """Raises RunFailure: the ``limit``-th non-finite step in a row, naming the step, its
        loss and grad norm, the sample keys of this rank's batches and the newest checkpoint."""
        from contract.errors import RunFailure
        from models.checkpointing.folders import newest_complete

        if stepped:
            self.streak = 0
            return
        self.count += 1
        self.streak += 1
        if self.streak < self.limit:
            return
        keys = [str(k) for batch in batches for k in _flat(batch.__key__)]
        raise RunFailure(f"step {done}: loss {loss} / grad norm {grad_norm} not finite for "
                         f"{self.streak} steps in a row (train.max_nonfinite_steps={self.limit}); "
                         f"samples of the batch: {_keys_of_every_rank(keys)}; the last checkpoint: "
                         f"{newest_complete(ckpt_dir) or 'none'} (no update was applied since "
                         "it)")


def _keys_of_every_rank(keys: list[str], shown_per_rank: int = 8) -> str:
    """The step's sample keys of every rank, for the one line rank 0 prints: ``rank R: k, k``
    per rank whose keys differ from a lower rank's (TP / CP / PP peers hold the same batch).
    Every rank calls this at the same step (the skip decision is the same on every rank); the
    keys travel as UTF-8 bytes in a tensor (gathered, never pickled)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return _shown(keys, shown_per_rank)
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    data = torch.tensor(list("\n".join(keys).encode()), dtype=torch.uint8, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device)
             for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], device=device))
    longest = int(max(sizes).item())
    gathered = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(gathered, torch.nn.functional.pad(data, (0, longest - data.numel())))
    parts, seen = [], []
    for rank, (size, blob) in enumerate(zip(sizes, gathered)):
        rank_keys = bytes(blob[:int(size.item())].tolist()).decode().split("\n")
        if rank_keys not in seen:
            seen.append(rank_keys)
            parts.append(f"rank {rank}: {_shown(rank_keys, shown_per_rank)}")
    return " | ".join(parts)


def _shown(keys: list[str], limit: int) -> str:
    return ", ".join(keys[:limit]) + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def _flat(keys):
    if isinstance(keys, (list, tuple)):
        for key in keys:
            yield from _flat(key)
    else:
        yield keys
