"""torchrun helper of test_qwen_vl.py (2 gloo ranks, PP=2): import a tiny HF Qwen2.5-VL at PP=2
(each stage writes its layer), compare the PP=2 logits with transformers', and load a PP=1
import at PP=2: every tensor must equal the PP=2 import's."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    import torch
    import torch.distributed as dist

    from models.checkpoint import load_checkpoint
    from models.convert import hf_to_mcore, verify

    out, hf, pp1 = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    hf_to_mcore(str(hf), out / "pp2", tp=1, pp=2)
    logits = verify(hf, out / "pp2", pp=2)
    report = {"logits": {name: row["max_abs_logit_diff"] for name, row in logits.items()}}
    a, _ = load_checkpoint(out / "pp2", use_te=False)
    b, _ = load_checkpoint(pp1, use_te=False)
    sa, sb = a.state_dict(), b.state_dict()
    keys = [k for k in sa if not k.endswith("_extra_state")]
    unequal = [k for k in keys if not torch.equal(sa[k], sb[k])]
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"keys": len(keys), "unequal": unequal})
    report["pp1_at_pp2"] = rows
    if dist.get_rank() == 0:
        (out / "pp2_report.json").write_text(json.dumps(report))
    dist.barrier()


if __name__ == "__main__":
    main()
