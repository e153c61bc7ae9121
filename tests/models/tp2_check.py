"""torchrun helper of test_qwen_vl.py: import tiny HF models sharded at TP=2, compare logits."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    run(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])


def run(out: Path, hf_paths: list[Path]) -> None:
    """Under torchrun (2 ranks): each model imported at TP=2 into ``out / <model_type>``, the max
    |logit diff| per input vs transformers in ``out / "tp2_report.json"``."""
    import torch.distributed as dist

    from models.checkpoint import load_checkpoint
    from models.convert import hf_logits, hf_to_mcore, load_hf_model, our_logits
    from models.verify_inputs import hf_inputs, make_inputs

    report = {}
    for hf in hf_paths:
        family = json.loads((hf / "config.json").read_text())["model_type"]
        hf_to_mcore(str(hf), out / family, tp=2, pp=1)
        model, cfg = load_checkpoint(out / family, use_te=False)
        hf_model = load_hf_model(hf)
        report[family] = {
            name: (hf_logits(hf_model, hf_inputs(cfg, x)) - our_logits(model, x)).abs().max().item()
            for name, x in make_inputs(cfg).items()}
    if dist.get_rank() == 0:
        (out / "tp2_report.json").write_text(json.dumps(report))
    dist.barrier()


if __name__ == "__main__":
    main()
