"""torchrun helper (2 gloo ranks, ``world2_checks.py``'s check ``layouts``): a tiny HF model's
logits and greedy tokens against transformers' at TP=2 (imported sharded, ``hf_to_mcore --tp 2``)
and at EP=2 (its TP=1 import loaded with the experts split over the two ranks)."""

import json
from pathlib import Path


def run(out: Path, hf: Path, imported: Path) -> None:
    """Writes ``out / "layouts_report.json"``: {"tp2": {input: max |logit diff|}, "ep2": ...} and
    ``out / "layouts_generate.json"``: {layout: ``tp2_check.greedy_at_tp2``'s tokens}."""
    import torch.distributed as dist

    from models.checkpointing.checkpoint import load_checkpoint
    from models.convert import hf_logits, hf_to_mcore, load_hf_model, our_logits
    from models.hf.verify_inputs import hf_inputs, make_inputs
    from models.parallel import init_parallel
    from tests.models.tp2_check import greedy_at_tp2

    hf_model = load_hf_model(hf)
    report, generated = {}, {}
    for layout in ("tp2", "ep2"):
        if layout == "tp2":
            hf_to_mcore(str(hf), out / "tp2", tp=2, pp=1)
            source = out / "tp2"
        else:
            init_parallel(ep=2)
            source = imported
        model, cfg = load_checkpoint(source, use_te=False)
        report[layout] = {
            name: (hf_logits(hf_model, hf_inputs(cfg, x)) - our_logits(model, x)).abs().max().item()
            for name, x in make_inputs(cfg).items()}
        generated[layout] = greedy_at_tp2(model, cfg, hf_model)
    if dist.get_rank() == 0:
        (out / "layouts_report.json").write_text(json.dumps(report))
        (out / "layouts_generate.json").write_text(json.dumps(generated))
    dist.barrier()
