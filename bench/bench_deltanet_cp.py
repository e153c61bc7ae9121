"""What context parallelism costs the Gated DeltaNet layer (Qwen3.5), measured side by side in
one run: the layer at CP = 1 (the whole sequence on one rank) against its two CP = 2 paths
(models/layers/gated_deltanet.py): the heads shared over the CP ranks (two all-to-alls; the default
where the key heads split evenly) and the whole sequence gathered (the fallback).

Two ranks (this script starts itself under ``torch.distributed.run``; gloo on CPU, one intra-op
thread each, fp32), the same layer weights and the same random sequence on both. Per case, the
median of ``--repeats`` rounds (after one warm-up round; the cases take turns in each round) of
forward + backward of the sum of the layer's output:

- ``cp1``: each rank runs the layer on the whole sequence (``_mix``, no communication: what the
  one rank of a CP = 1 run does per layer);
- ``heads``: the layer under CP = 2 on this rank's zig-zag share, the heads shared;
- ``gathered``: the same with the sequence gathered (every rank runs all of it, keeps its share).

Reported per case: milliseconds of each and their ratios to ``cp1`` (0.5 would be a perfect split
of the layer's work), and the bytes a rank receives per layer and step: gathered, the forward
all-gather (CP - 1) / CP of (s, b, h) and the backward ring all-reduce 2 (CP - 1) / CP of it;
heads shared, two all-to-alls each way of (CP - 1) / CP of this rank's share of the projections
(q, k, v, z, b, a) and of the mixer's output (v wide), per token; also at the published
Qwen3.5-9B / 27B shapes for a 32K-token sequence in bf16.

Usage: python bench/bench_deltanet_cp.py --out bench_out/deltanet_cp [--tokens 4096] [--repeats 5]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: (name, hidden, key heads, value heads, head dim): a scaled Qwen3.5 DeltaNet (the 9B layer has
#: hidden 4096, 16 key / 32 value heads of 128: too slow for a CPU bench) and the tiny test layer
CASES = [("h1024", 1024, 4, 8, 128), ("h512", 512, 2, 4, 128)]
#: published shapes for the byte counts (config.json of the hub models): hidden, key heads, value
#: heads, head dim of the DeltaNet layers
PUBLISHED = {"Qwen3.5-9B": (4096, 16, 32, 128), "Qwen3.5-27B": (5120, 16, 48, 128)}


def received(tokens: int, shape: tuple[int, int, int, int], element_bytes: int,
             cp: int = 2) -> dict[str, float]:
    """Bytes a rank receives per DeltaNet layer and step under CP (see module docstring)."""
    hidden, key_heads, value_heads, dim = shape
    part = (cp - 1) / cp * tokens * element_bytes
    projections = 2 * key_heads * dim + 2 * value_heads * dim + 2 * value_heads  # q k v z b a
    return {"gathered": 3 * part * hidden,  # all-gather + ring all-reduce of (s, b, h)
            # of this rank's s / cp tokens, (cp - 1) / cp of the widths, forward and backward
            "heads": 2 * part / cp * (projections + value_heads * dim)}


def build_layer(hidden: int, key_heads: int, value_heads: int, head_dim: int):
    """A GatedDeltaNet layer of the given shape (seeded: the same weights on every rank)."""
    from models.families.qwen3_5.config import load_yaml
    from models.families.qwen3_5.model import lm_transformer_config
    from models.layers.gated_deltanet import GatedDeltaNet

    cfg = load_yaml(REPO / "configs" / "qwen3_5_tiny.yaml", [
        f"lm.hidden_size={hidden}", f"vision.out_hidden_size={hidden}",
        f"lm.linear_num_key_heads={key_heads}",
        f"lm.linear_num_value_heads={value_heads}", f"lm.linear_key_head_dim={head_dim}",
        f"lm.linear_value_head_dim={head_dim}"])
    torch.manual_seed(0)
    return GatedDeltaNet(lm_transformer_config(cfg), layer_number=1).train()


def interleaved_ms(fns: dict, repeats: int) -> dict[str, float]:
    """name -> median milliseconds of ``fn()``, the cases taking turns in each round (after one
    warm-up round), both ranks in step."""
    import torch.distributed as dist

    times = {name: [] for name in fns}
    for round_ in range(repeats + 1):
        for name, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def fwd_bwd(forward, x: torch.Tensor, layer):
    def run():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        forward(x)[0].sum().backward()
    return run


def measure(tokens: int, repeats: int) -> list[dict]:
    """Both ranks (CP = 2): every case's layer on the whole sequence, with its heads shared and
    with the sequence gathered; rank 0 returns the rows."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from models.layers.gated_deltanet import _GatherSequence, zigzag
    from models.parallel import init_parallel

    init_parallel(cp=2)
    rank, group = ps.get_context_parallel_rank(), ps.get_context_parallel_group()
    rows = []
    for name, hidden, key_heads, value_heads, head_dim in CASES:
        torch.manual_seed(1)
        whole = torch.randn(tokens, 1, hidden)
        layer = build_layer(hidden, key_heads, value_heads, head_dim)
        share = zigzag(whole, 0, 2, rank).contiguous().requires_grad_()

        def gathered(x, layer=layer):  # the fallback path of GatedDeltaNet.forward
            out, _ = layer._mix(_GatherSequence.apply(x, 2, rank, group), None, None)
            return zigzag(out, 0, 2, rank), None

        ms = interleaved_ms({
            "cp1": fwd_bwd(lambda x, layer=layer: layer._mix(x, None, None),
                           whole.clone().requires_grad_(), layer),
            "heads": fwd_bwd(layer, share, layer), "gathered": fwd_bwd(gathered, share, layer)},
            repeats)
        shape = (hidden, key_heads, value_heads, head_dim)
        rows.append({"case": name, "tokens": tokens, "hidden": hidden,
                     "heads_of_layer": f"{key_heads} key / {value_heads} value of {head_dim}",
                     **{f"{k}_ms": v for k, v in ms.items()},
                     "heads_over_cp1": ms["heads"] / ms["cp1"],
                     "gathered_over_cp1": ms["gathered"] / ms["cp1"],
                     **{f"received_mb_{k}_fp32": v / 1e6
                        for k, v in received(tokens, shape, 4).items()}})
        if dist.get_rank() == 0:
            print(f"[deltanet_cp] {name} {tokens} tokens: cp1 {ms['cp1']:.0f} ms, heads shared "
                  f"{ms['heads']:.0f} ms (x{ms['heads'] / ms['cp1']:.2f}), gathered "
                  f"{ms['gathered']:.0f} ms (x{ms['gathered'] / ms['cp1']:.2f})", flush=True)
    return rows


def report(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    published = {name: {k: v / 1e6 for k, v in received(32768, shape, 2).items()}
                 for name, shape in PUBLISHED.items()}
    (out / "deltanet_cp.json").write_text(json.dumps(
        {"rows": rows, "received_mb_per_layer_bf16_32k_tokens_cp2": published,
         "torch": torch.__version__, "threads_per_rank": 1}, indent=1))
    lines = ["| layer | tokens | CP=1 ms | CP=2 heads shared ms (/ CP=1) | "
             "CP=2 gathered ms (/ CP=1) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} ({r['heads_of_layer']}) | {r['tokens']} | {r['cp1_ms']:.0f} "
                     f"| {r['heads_ms']:.0f} ({r['heads_over_cp1']:.2f}) | "
                     f"{r['gathered_ms']:.0f} ({r['gathered_over_cp1']:.2f}) |")
    lines.append("")
    lines += [f"- received per DeltaNet layer and step at CP=2, 32K tokens, bf16, {name}: heads "
              f"shared {mb['heads']:.0f} MB, gathered {mb['gathered']:.0f} MB"
              for name, mb in published.items()]
    (out / "deltanet_cp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


@click.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_out/deltanet_cp"))
@click.option("--tokens", type=int, default=2048, help="sequence length (divisible by 4)")
@click.option("--repeats", type=int, default=3)
def main(out: Path, tokens: int, repeats: int) -> None:
    if "RANK" not in os.environ:  # start the 2 ranks
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", __file__, "--out", str(out), "--tokens", str(tokens),
               "--repeats", str(repeats)]
        sys.exit(subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode)
    import torch.distributed as dist

    torch.set_num_threads(1)
    rows = measure(tokens, repeats)
    if dist.get_rank() == 0:
        report(rows, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
