"""The memory estimate (recipes/memory.py) against what a real training step keeps, per family,
side by side in one run.

One process, CPU, fp32. For each family's model (its configs/<family>_tiny.yaml shapes, widened
by ``--scale``) one packed row of that family's ``verify`` inputs (images, interleaved images,
video; repeated to ``--repeat`` copies) trains one forward + backward. Measured:

- activations: the bytes of the distinct tensors autograd keeps for backward that are not
  parameters (``saved_tensors_hooks``), against the estimate's activation term for the same row
  (``seq_length`` = the row's tokens, ``max_visual_tokens`` = its visual tokens, micro-batch 1);
- weights, gradients, optimizer state: the bytes of the model's parameters, of their gradients
  after backward, and of megatron's Adam state after one step, against the estimate's terms.

    .venv/bin/python bench/bench_memory.py --out bench_out/memory
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FAMILIES = {  # family -> (tiny model YAML, shape overrides that widen it)
    "qwen2_5_vl": ("qwen2_5_vl_tiny", ["lm.hidden_size=1024", "lm.intermediate_size=2816",
                                       "lm.num_heads=16", "lm.num_kv_heads=4", "lm.head_dim=64",
                                       "lm.mrope_section=[8,12,12]", "vision.hidden_size=512",
                                       "vision.intermediate_size=1024", "vision.num_heads=8",
                                       "vision.out_hidden_size=1024"]),
    "qwen3_vl": ("qwen3_vl_tiny", []),
    "qwen3_5": ("qwen3_5_tiny", []),
    "nemotron_omni": ("nemotron_omni_tiny", []),
}


def kept_activations(model, batch: dict) -> tuple[int, torch.Tensor]:
    """(bytes of the distinct non-parameter tensors kept for backward, the loss) of one
    forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, mask = model(**batch, labels=batch["input_ids"])
    return sum(kept.values()), loss.sum() / mask.sum()


def measure(family: str, repeat: int) -> dict:
    from lookalikes.model_inputs import pack_inputs
    from models.families import build_model, config_module
    from models.hf.verify_inputs import make_inputs
    from recipes.estimate import Layout, estimate_layout, table_of
    from recipes.run_config import load_run_config

    name, shapes = FAMILIES[family]
    model_cfg = config_module(family).load_yaml(REPO / "configs" / f"{name}.yaml", shapes)
    torch.manual_seed(0)
    model = build_model(model_cfg, use_te=False).train()
    cases = list(make_inputs(model_cfg).values())
    batch = pack_inputs([cases * repeat])
    tokens = int(batch["input_ids"].numel())
    visual = sum(int((batch["input_ids"] == i).sum())
                 for i in (model_cfg.image_token_id, model_cfg.video_token_id))
    acts, loss = kept_activations(model, batch)
    loss.backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                if p.grad is not None)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    run = load_run_config(REPO / "configs" / "train_qwen_vl_mantis.yaml", [
        f"model.base=configs/{name}.yaml", *[f"model.{s}" for s in shapes],
        "train.precision=fp32", "train.micro_batch_size=1", "task_encoder.pad_to_multiple_of=1",
        f"task_encoder.seq_length={tokens}",
        f"task_encoder.max_visual_tokens={visual}", "train.distributed_optimizer=false"])
    one, = estimate_layout(table_of(model, run, local=True), run, 1, Layout.of(run), False,
                           stage=0)
    adam = 8 * weights / 4  # megatron's fp32 Adam: two fp32 moments per parameter
    return {"family": family, "tokens": tokens, "visual_tokens": visual,
            "measured": {"activations": acts, "weights": weights, "grads": grads,
                         "optimizer": adam},
            "estimate": {"activations": one.activations, "weights": one.weights,
                         "grads": one.grads, "optimizer": one.optimizer},
            "activations_ratio": one.activations / acts}


@click.command()
@click.option("--out", default="bench_out/memory", type=click.Path(path_type=Path))
@click.option("--repeat", default=4, show_default=True, help="Copies of the verify inputs.")
@click.option("--family", "families", multiple=True, default=tuple(FAMILIES))
def main(out: Path, repeat: int, families: tuple[str, ...]) -> None:
    from contract.console import KnownWarnings
    from models.parallel import init_parallel

    KnownWarnings(enabled=True)
    torch.set_num_threads(1)
    init_parallel()
    rows = [measure(family, repeat) for family in families]
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(rows, indent=1))
    print("| family | tokens (visual) | activations kept | estimate | estimate / kept | "
          "weights, grads: estimate = measured |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        m, e = r["measured"], r["estimate"]
        same = e["weights"] == m["weights"] and e["grads"] == m["grads"]
        print(f"| {r['family']} | {r['tokens']} ({r['visual_tokens']}) | "
              f"{m['activations'] / 2**20:.1f} MiB | {e['activations'] / 2**20:.1f} MiB | "
              f"{r['activations_ratio']:.2f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
