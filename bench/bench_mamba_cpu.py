"""CPU speed of the Mamba layers' torch path (models/kernels/mamba.py under megatron's MambaMixer),
side by side with transformers' NemotronH on its own torch path, in one run.

One process, ``--threads`` intra-op threads, fp32. For each case the hybrid LM of our Nemotron-Omni
(megatron ``MambaModel``; text only) and transformers' ``NemotronHForCausalLM`` built from the same
config with the same weights (our export mapping) take turns doing forward + backward of the
next-token loss on the same random tokens (median of ``--repeats`` after one warm-up). Cases:

- ``tiny``: configs/nemotron_omni_tiny.yaml's LM ("M*M-", hidden 64, 8 Mamba heads of 8, state
  16, chunks of 8), 4 rows of 1024 tokens;
- ``d256``: 2 Mamba layers ("MM"), hidden 256, 8 heads of 64 (inner 512), 1 group, state 64,
  chunks of 128, 1 row of 1024 tokens.

Reported: tokens/s of each and ours / transformers, for the whole LM and for its first Mamba
mixer alone (megatron's ``MambaMixer`` vs transformers' ``NemotronHMamba2Mixer``, fwd+bwd of the
sum of its output on the LM's hidden size); the two losses (they differ where transformers clamps
dt at ``time_step_min``, which megatron does not: docs/nemotron.md). On a GPU the torch path is
the fallback: mamba_ssm's kernels run where they pass their check (models.kernels).

Usage: python bench/bench_mamba_cpu.py --out bench_out/mamba_cpu
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CASES = {
    "tiny": dict(overrides=[], rows=4, tokens=1024),
    "d256": dict(overrides=["lm.pattern='MM'", "lm.hidden_size=256", "lm.mamba_num_heads=8",
                            "lm.mamba_head_dim=64", "lm.ssm_state_size=64", "lm.mamba_groups=1",
                            "lm.chunk_size=128"], rows=1, tokens=1024),
}


def build_pair(overrides: list[str]):
    """(our model, transformers' NemotronHForCausalLM with the same LM weights, config)."""
    import transformers as tf

    from models.families import build_model
    from models.families.nemotron_omni.config import load_yaml, to_hf_dict
    from models.families.nemotron_omni.hf_mapping import ours_to_hf

    cfg = load_yaml(REPO / "configs" / "nemotron_omni_tiny.yaml", overrides)
    torch.manual_seed(0)
    ours = build_model(cfg, use_te=False).train()
    text = to_hf_dict(cfg)["text_config"]
    theirs = tf.NemotronHForCausalLM(tf.NemotronHConfig(**text)).train()
    hf_sd = ours_to_hf({k: v.detach() for k, v in ours.state_dict().items()
                        if not k.endswith("_extra_state")}, cfg)
    lm_sd = {k.removeprefix("language_model.").replace("backbone.", "model.", 1): v
             for k, v in hf_sd.items() if k.startswith("language_model.")}  # in-memory names
    theirs.load_state_dict(lm_sd, strict=True)
    return ours, theirs, cfg


def ours_step(model, ids: torch.Tensor) -> float:
    """Forward + backward of the mean next-token loss through our LM; -> the loss."""
    from models.multimodal import shift_labels

    target, mask = shift_labels(ids, None)
    loss = model.language_model(input_ids=ids, position_ids=None, attention_mask=None,
                                labels=target)
    loss = (loss * mask).sum() / mask.sum()
    loss.backward()
    return loss.item()


def theirs_step(model, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.item()


def ours_mixer_step(model, x: torch.Tensor) -> float:
    out = model.language_model.decoder.layers[0].mixer(x.transpose(0, 1))[0]
    out.sum().backward()
    return 0.0


def theirs_mixer_step(model, x: torch.Tensor) -> float:
    model.model.layers[0].mixer(x).sum().backward()
    return 0.0


def timed(step, model, ids) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = step(model, ids)
    return time.perf_counter() - start, loss


@click.command()
@click.option("--out", default="bench_out/mamba_cpu", type=click.Path(path_type=Path))
@click.option("--repeats", default=3, show_default=True)
@click.option("--threads", default=1, show_default=True)
def main(out: Path, repeats: int, threads: int) -> None:
    torch.set_num_threads(threads)
    from models.parallel import init_parallel

    init_parallel()
    results = {}
    for name, case in CASES.items():
        ours, theirs, cfg = build_pair(case["overrides"])
        ids = torch.randint(0, cfg.lm.vocab_size, (case["rows"], case["tokens"]),
                            generator=torch.Generator().manual_seed(0))
        hidden = torch.randn(*ids.shape, cfg.lm.hidden_size, requires_grad=True,
                             generator=torch.Generator().manual_seed(0))
        runs = (("ours", ours_step, ours, ids), ("transformers", theirs_step, theirs, ids),
                ("ours_mixer", ours_mixer_step, ours, hidden),
                ("transformers_mixer", theirs_mixer_step, theirs, hidden))
        times = {who: [] for who, *_ in runs}
        losses = {}
        for repeat in range(repeats + 1):  # the first is the warm-up; all take turns
            for who, step, model, inputs in runs:
                seconds, losses[who] = timed(step, model, inputs)
                if repeat:
                    times[who].append(seconds)
        tokens = ids.numel()
        rate = {who: tokens / statistics.median(t) for who, t in times.items()}
        del losses["ours_mixer"], losses["transformers_mixer"]
        results[name] = {"pattern": cfg.lm.pattern, "hidden": cfg.lm.hidden_size,
                         "mamba_heads": cfg.lm.mamba_num_heads,
                         "mamba_head_dim": cfg.lm.mamba_head_dim,
                         "state": cfg.lm.ssm_state_size, "groups": cfg.lm.mamba_groups,
                         "chunk": cfg.lm.chunk_size, "rows": case["rows"],
                         "tokens_per_row": case["tokens"], "tokens_per_s": rate,
                         "ours_vs_transformers": rate["ours"] / rate["transformers"],
                         "mixer_ours_vs_transformers": (rate["ours_mixer"]
                                                        / rate["transformers_mixer"]),
                         "loss": losses}
    out.mkdir(parents=True, exist_ok=True)
    (out / "mamba_cpu.json").write_text(json.dumps({"threads": threads, "repeats": repeats,
                                                    "cases": results}, indent=1))
    print(f"fwd+bwd, {threads} thread(s), median of {repeats}")
    print("| case | LM | tokens | LM tok/s ours / transformers | ratio | one mixer tok/s ours / "
          "transformers | ratio | loss ours / transformers |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        t = r["tokens_per_s"]
        print(f"| {name} | {r['pattern']}, d={r['hidden']}, {r['mamba_heads']}x"
              f"{r['mamba_head_dim']} heads, state {r['state']}, chunk {r['chunk']} | "
              f"{r['rows']}x{r['tokens_per_row']} | {t['ours']:.0f} / {t['transformers']:.0f} | "
              f"{r['ours_vs_transformers']:.2f} | {t['ours_mixer']:.0f} / "
              f"{t['transformers_mixer']:.0f} | {r['mixer_ours_vs_transformers']:.2f} | "
              f"{r['loss']['ours']:.4f} / {r['loss']['transformers']:.4f} |")


if __name__ == "__main__":
    main()
