"""torchrun helper of test_qwen_vl.py: import tiny HF models sharded at TP=2, compare logits."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    import torch.distributed as dist

    from models.checkpoint import load_checkpoint
    from models.convert import hf_logits, hf_to_mcore, load_hf_model, our_logits
    from models.verify_inputs import hf_inputs, make_inputs

    out, hf_paths = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
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
