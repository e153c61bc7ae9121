"""torchrun helper of the PP=2 import tests (2 gloo ranks, PP=2): import a tiny HF model (any
family) at PP=2 (each stage writes its layers), compare the PP=2 logits with transformers', and load
a PP=1 import at PP=2: every tensor must equal the PP=2 import's. ``run`` is one check of
tests/models/world2_checks.py's launch; ``check_pp2`` checks its report plus, in the calling
process at PP=1, the PP=2 import's logits and tensors."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def check_pp2(hf: Path, pp1: Path, out: Path, cases: set[str], tol: float) -> dict:
    """Assert on the torchrun run of ``run`` (2 ranks; tests/models/world2_checks.py makes it)
    on ``hf`` / its PP=1 import ``pp1`` into ``out``: both stages wrote shards, PP=2 logits
    within ``tol`` of transformers' on ``cases``, the PP=1 import equals the PP=2 one at PP=2
    (each stage) and at PP=1. Returns the torchrun report."""
    import torch

    from models.checkpointing.checkpoint import load_checkpoint
    from models.convert import verify
    from models.parallel import init_parallel

    report = json.loads((out / "pp2_report.json").read_text())
    assert {p.name.split("_")[2] for p in (out / "pp2").glob("__*_*.distcp")} == {"0", "1"}
    assert set(report["logits"]) == cases
    for name, diff in report["logits"].items():
        assert diff <= tol, (name, diff)
    for stage in report["pp1_at_pp2"]:  # each stage: every tensor equal
        assert stage["keys"] > 0 and stage["unequal"] == [], stage
    for name, row in verify(hf, out / "pp2").items():  # PP=2 import loaded at PP=1
        assert row["max_abs_logit_diff"] <= tol, (name, row)
    init_parallel()
    a, _ = load_checkpoint(out / "pp2", use_te=False)
    b, _ = load_checkpoint(pp1, use_te=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for key in sa:
        if not key.endswith("_extra_state"):
            assert torch.equal(sa[key], sb[key]), key
    return report


def main():
    run(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))


def run(out: Path, hf: Path, pp1: Path) -> None:
    """Under torchrun (2 ranks): the PP=2 import of ``hf`` and its checks against transformers
    and the PP=1 import ``pp1``, in ``out / "pp2_report.json"`` (``check_pp2`` reads it)."""
    import torch
    import torch.distributed as dist

    from models.checkpointing.checkpoint import load_checkpoint
    from models.convert import hf_to_mcore, verify

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
