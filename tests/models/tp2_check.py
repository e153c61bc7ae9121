"""torchrun helper of test_qwen_vl.py: import tiny HF models sharded at TP=2, compare logits."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    run(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])


def run(out: Path, hf_paths: list[Path]) -> None:
    """Under torchrun (2 ranks): each model imported at TP=2 into ``out / <model_type>``, the max
    |logit diff| per input vs transformers in ``out / "tp2_report.json"``."""
    import torch.distributed as dist

    from models.checkpointing.checkpoint import load_checkpoint
    from models.convert import hf_logits, hf_to_mcore, load_hf_model, our_logits
    from models.hf.verify_inputs import hf_inputs, make_inputs

    report, generated = {}, {}
    for hf in hf_paths:
        family = json.loads((hf / "config.json").read_text())["model_type"]
        hf_to_mcore(str(hf), out / family, tp=2, pp=1)
        model, cfg = load_checkpoint(out / family, use_te=False)
        hf_model = load_hf_model(hf)
        report[family] = {
            name: (hf_logits(hf_model, hf_inputs(cfg, x)) - our_logits(model, x)).abs().max().item()
            for name, x in make_inputs(cfg).items()}
        if family == "qwen3_5":  # the DeltaNet gated norms' gradients (replicated over TP)
            torch.save(deltanet_norm_grads(model, cfg), out / f"norm_grads{dist.get_rank()}.pt")
        generated[family] = greedy_at_tp2(model, cfg, hf_model)
    if dist.get_rank() == 0:
        (out / "tp2_report.json").write_text(json.dumps(report))
        (out / "tp2_generate.json").write_text(json.dumps(generated))
    dist.barrier()


def greedy_at_tp2(model, cfg, hf_model) -> dict:
    """Greedy tokens of the first two verify inputs, as one left-padded batch, at TP = 2
    (megatron's decode step: the lean one is TP = 1 only) and transformers' of each alone:
    {"ours": [[...], [...]], "hf": [[...], [...]]}, or {"error": the exception's line}."""
    from models.generation.generate import GenerationStats, greedy_generate
    from tests.models.test_generate import NEVER, _cases, _hf_greedy, _prompt

    cases = _cases(cfg)[:2]
    stats = GenerationStats()
    try:
        ours = greedy_generate(model, [_prompt(c) for c in cases], eos_id=NEVER,
                               max_new_tokens=4, stats=stats)
    except Exception as error:  # noqa: BLE001 - the test reports it
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    return {"ours": ours, "hf": [_hf_greedy(hf_model, cfg, c, NEVER)[:4] for c in cases],
            "lean_decode": stats.extra.get("lean_decode")}


def deltanet_norm_grads(model, cfg) -> dict:
    """name -> the gradient of every Gated DeltaNet gated-norm weight of the summed per-token
    loss of the first verify input (labels: its tokens)."""
    from models.hf.verify_inputs import make_inputs

    x = next(iter(make_inputs(cfg).values()))
    model.zero_grad(set_to_none=True)
    loss, _mask = model(**x, labels=x["input_ids"])
    loss.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if n.endswith("self_attention.norm.weight")}


if __name__ == "__main__":
    main()
