"""torchrun worker for tests/models/test_vision_dp.py: vision DP over CP vs the unsharded run.

Run: torchrun --standalone --nproc-per-node 4 tests/models/vision_dp_worker.py
World 2: CP=2. World 4: CP=4, then TP2 x CP2 (megatron parallel_state over gloo). Prints one
JSON line per rank and case (also to $VISION_DP_OUT/rank<N>.jsonl when set) with the max |diff|
of outputs and encoder gradients; exits 1 on a mismatch above 1e-5.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import sys

import torch
import torch.distributed as dist

from models.vision_dp import VisionDPOverCP, allreduce_grads

D, F, H0, H, MERGE = 12, 16, 8, 10, 2
TOL = 1e-5


class TinyEncoder(torch.nn.Module):
    """Per-patch MLP (fc1 column-parallel, fc2 row-parallel under TP) + single-head attention
    within each image / temporal slice + 2x2 merge (4 consecutive rows -> one token)."""

    def __init__(self, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        full = {name: torch.randn(*shape, generator=g) * 0.3 for name, shape in [
            ("w1", (F, D)), ("b1", (F,)), ("w2", (H0, F)), ("b2", (H0,)), ("wq", (H0, H0)),
            ("wk", (H0, H0)), ("wv", (H0, H0)), ("wm", (H, 4 * H0))]}
        per = F // tp_size
        sl = slice(tp_rank * per, (tp_rank + 1) * per)
        full["w1"], full["b1"], full["w2"] = full["w1"][sl], full["b1"][sl], full["w2"][:, sl]
        for name, value in full.items():
            setattr(self, name, torch.nn.Parameter(value.contiguous()))
        self.tp_size = tp_size

    def forward(self, px: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tpl

        x = tpl.copy_to_tensor_model_parallel_region(px) if self.tp_size > 1 else px
        h = torch.nn.functional.gelu(x @ self.w1.T + self.b1) @ self.w2.T
        if self.tp_size > 1:
            h = tpl.reduce_from_tensor_model_parallel_region(h)
        h = h + self.b2
        outs, off = [], 0
        for t, gh, gw in grid.tolist():
            n = gh * gw
            for _ in range(t):
                s = h[off : off + n]
                off += n
                att = torch.softmax((s @ self.wq.T) @ (s @ self.wk.T).T / math.sqrt(H0), -1)
                s = s + att @ (s @ self.wv.T)
                outs.append(s.reshape(n // 4, 4 * H0) @ self.wm.T)
        return torch.cat(outs) if outs else h.new_zeros(0, H)


IMAGES = [(1, 4, 6), (1, 2, 2), (1, 6, 4), (1, 2, 4), (1, 4, 4), (1, 8, 2)]


def cases(cp: int) -> dict[str, list[tuple[int, int, int]]]:
    out = {f"{n}_images": IMAGES[:n] for n in sorted({0, 1, cp - 1, cp, cp + 1})}
    out["mixed"] = [(1, 8, 8), (1, 2, 2), (1, 2, 2), (1, 2, 4), (1, 4, 2), (1, 2, 2)]
    out["video_and_images"] = [(1, 2, 4), (4, 4, 4), (1, 2, 2)]
    out["one_video"] = [(2 * cp + 1, 4, 2)]
    return out


def run_case(name, grid, tp, cp_group, ref, enc, mode) -> dict:
    cp, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    g = torch.Generator().manual_seed(len(grid) * 7 + sum(t * h * w for t, h, w in grid))
    rows = sum(t * h * w for t, h, w in grid)
    px = torch.randn(rows, D, generator=g)
    grid_t = torch.tensor(grid, dtype=torch.long).reshape(-1, 3)
    targets = [torch.randn(rows // MERGE**2, H, generator=g) for _ in range(cp)]
    frozen = mode == "frozen"
    for m in (ref, enc):
        m.zero_grad(set_to_none=True)
        for p in m.parameters():
            p.requires_grad_(not frozen)

    def loss(e, r):  # what CP rank r's language-model shard computes from all embeddings
        return (torch.tanh(e) * targets[r]).sum() / max(rows // MERGE**2, 1)  # token mean

    e_ref = ref(px, grid_t)                              # unsharded, no collectives
    if not frozen and e_ref.requires_grad:
        sum(loss(e_ref, r) for r in range(cp)).backward()
    if mode == "tuple":  # e.g. Qwen3-VL main + DeepStack features: two outputs
        vdp = VisionDPOverCP(lambda p, gr: (enc(p, gr), enc(p, gr)[:, :3] * 2), trainable=True,
                             hidden_size=[H, 3], merge_size=MERGE, cp_group=cp_group)
        e, extra = vdp(px, grid_t)
        diff_extra = (extra - e_ref[:, :3] * 2).abs().max().item() if rows else 0.0
    else:
        vdp = VisionDPOverCP(enc, hidden_size=H, merge_size=MERGE, cp_group=cp_group,
                             enabled=mode != "disabled")
        e, diff_extra = vdp(px, grid_t), 0.0
    res = {"case": name, "mode": mode, "tp": tp, "cp": cp, "cp_rank": cp_rank,
           "shape": list(e.shape), "dtype": str(e.dtype),
           "fwd": max((e - e_ref).abs().max().item() if rows else 0.0, diff_extra),
           "share": [list(s) for s in (vdp.last_plan.local_grid(cp_rank) if vdp.last_plan
                                       else [])]}
    assert e.shape == (rows // MERGE**2, H) and e.dtype == torch.float32, res
    if frozen:
        assert not e.requires_grad
        res["grad"] = 0.0
        return res
    loss(e, cp_rank).backward()
    allreduce_grads(enc, cp_group)                    # what megatron DDP does over DP x CP
    gdiff = 0.0
    per = F // tp
    tp_rank = dist.get_rank() % tp                    # megatron: TP ranks are adjacent
    for pname, p in enc.named_parameters():
        gref = getattr(ref, pname).grad
        gref = torch.zeros_like(getattr(ref, pname)) if gref is None else gref
        if tp > 1 and pname in ("w1", "b1"):
            gref = gref[tp_rank * per : (tp_rank + 1) * per]
        elif tp > 1 and pname == "w2":
            gref = gref[:, tp_rank * per : (tp_rank + 1) * per]
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        gdiff = max(gdiff, (got - gref).abs().max().item())
    res["grad"] = gdiff
    return res


def main(own_group: bool = True) -> int:
    """Every case of the world's layouts; ``own_group=False``: in the process group of
    tests/models/world2_checks.py's launch (world 2), which this run leaves up."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    if own_group:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    layouts = [(1, 2)] if world == 2 else [(1, 4), (2, 2)]
    failed, lines = False, []
    for tp, cp in layouts:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        cp_group = ps.get_context_parallel_group()
        tp_rank = ps.get_tensor_model_parallel_rank()
        ref = TinyEncoder()
        enc = TinyEncoder(tp, tp_rank)
        all_cases = [(n, gr, "train") for n, gr in cases(cp).items()]
        all_cases += [("mixed", cases(cp)["mixed"], m) for m in ("frozen", "tuple", "disabled")]
        all_cases += [("0_images", [], "frozen")]
        for name, grid, mode in all_cases:
            res = run_case(name, grid, tp, cp_group, ref, enc, mode)
            ok = res["fwd"] <= TOL and res["grad"] <= TOL
            failed |= not ok
            res["ok"] = ok
            res["rank"] = dist.get_rank()
            lines.append(json.dumps(res))
            print("RESULT " + lines[-1], flush=True)
        dist.barrier()
        ps.destroy_model_parallel()
    if os.environ.get("VISION_DP_OUT"):
        out = os.path.join(os.environ["VISION_DP_OUT"], f"rank{dist.get_rank()}.jsonl")
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if own_group:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    sys.exit(main())
