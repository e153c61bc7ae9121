"""torchrun worker: vision DP over CP on the real Nemotron-Omni tower vs the unsharded tower.

Run: torchrun --standalone --nproc-per-node 2 tests/models/nemotron_vision_dp_worker.py
CP = world size. Builds the tiny NemotronOmni (configs/nemotron_omni_tiny.yaml) twice with the
same weights, vision DP over CP on and off, and encodes dynamic images, tiles and a video of
tubelets (split at frame-pair boundaries) through ``encode_visual``. Prints one JSON line per case
(also to $VISION_DP_OUT/rank<N>.jsonl) with the max |diff| of the embeddings and of the tower
gradients summed over CP; exits 1 above 1e-5.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-5
#: name -> (grid_thw rows, pixel row width): images (C*16*16) or video tubelets (2*C*16*16)
CASES = {
    "images": ([(1, 4, 6), (1, 2, 2), (1, 6, 4), (1, 8, 8), (1, 2, 4)], 768),
    "tiles": ([(3, 4, 4), (1, 2, 2)], 768),
    "video": ([(5, 4, 6)], 1536),
    "one_image": ([(1, 4, 4)], 768),
}


def grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad


def main(own_group: bool = True) -> int:
    """Every case at CP = world size; ``own_group=False``: in the process group of
    tests/models/world2_checks.py's launch, which this run leaves up."""
    sys.path.insert(0, str(REPO))
    from models.parallel import init_parallel, init_process_group

    init_process_group()  # models/cpu's accommodations, then gloo from torchrun's environment
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from models.families.nemotron_omni.config import load_yaml
    from models.families.nemotron_omni.model import NemotronOmni
    from models.vision_dp import allreduce_grads

    torch.set_num_threads(1)
    cp = dist.get_world_size()
    init_parallel(cp=cp, seed=0)
    cp_group, cp_rank = ps.get_context_parallel_group(), ps.get_context_parallel_rank()
    cfg = load_yaml(REPO / "configs" / "nemotron_omni_tiny.yaml")
    sharded = NemotronOmni(cfg, use_te=False, vision_dp_over_cp=True)
    whole = NemotronOmni(cfg, use_te=False, vision_dp_over_cp=False)
    whole.load_state_dict(sharded.state_dict())
    lines, failed = [], False
    for name, (grid, width) in CASES.items():
        g = torch.Generator().manual_seed(len(name))
        rows = sum(t * h * w for t, h, w in grid)
        pixels = torch.randn(rows, width, generator=g)
        grid_t = torch.tensor(grid, dtype=torch.long)
        tokens = rows // cfg.merge_size**2
        targets = [torch.randn(tokens, cfg.lm.hidden_size, generator=g) for _ in range(cp)]
        for model in (sharded, whole):
            model.zero_grad(set_to_none=True)

        def loss(embeds, rank, targets=targets, tokens=tokens):  # CP rank `rank`'s LM shard
            return (torch.tanh(embeds) * targets[rank]).sum() / tokens

        reference = whole.encode_visual(pixels, grid_t)
        sum(loss(reference, r) for r in range(cp)).backward()
        got = sharded.encode_visual(pixels, grid_t)
        loss(got, cp_rank).backward()
        allreduce_grads(sharded.vision, cp_group)  # what megatron DDP does over DP x CP
        wanted = dict(whole.vision.named_parameters())
        grad_diff = max((grad(p) - grad(wanted[n])).abs().max().item()
                        for n, p in sharded.vision.named_parameters())
        plan = sharded._vision_dp.last_plan
        result = {"case": name, "cp": cp, "rank": dist.get_rank(),
                  "fwd": (got - reference).abs().max().item(), "grad": grad_diff,
                  "share": plan.local_grid(cp_rank) if plan else None}
        result["ok"] = result["fwd"] <= TOL and result["grad"] <= TOL
        failed |= not result["ok"]
        lines.append(json.dumps(result))
        print("RESULT " + lines[-1], flush=True)
    if os.environ.get("VISION_DP_OUT"):
        out = Path(os.environ["VISION_DP_OUT"]) / f"rank{dist.get_rank()}.jsonl"
        out.write_text("\n".join(lines) + "\n")
    ps.destroy_model_parallel()
    if own_group:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
