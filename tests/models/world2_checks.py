"""One torchrun launch (2 gloo ranks) for every 2-process check of tests/models: TP=2 import parity
(tp2_check.py), PP=2 import parity and reshard (pp2_check.py), TP=2 and EP=2 parity of one
model (layouts_check.py), vision DP over CP2 on the tiny encoder (vision_dp_worker.py) and on the
Nemotron-Omni tower (nemotron_vision_dp_worker.py).

    torchrun --standalone --nproc-per-node 2 tests/models/world2_checks.py SPEC.json

SPEC.json: a list of {"check": "tp2" | "pp2" | "layouts" | "vision_dp" | "nemotron_vision_dp",
"out": folder, "args": [...]}. Each check runs in turn in the one process group (megatron's
parallel state torn down between them) and writes what its own launch wrote, under its ``out``,
then ``out/DONE``.
A check that raises writes ``out/FAILED.rank<N>`` (the traceback) and ends the launch (exit 1):
the other rank may be waiting in one of its collectives. The tests read the files
(tests/models/conftest.py, fixture ``world2``).
"""

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def run_check(check: str, out: Path, args: list[str]) -> None:
    if check == "tp2":
        from tests.models import tp2_check

        tp2_check.run(out, [Path(a) for a in args])
    elif check == "pp2":
        from tests.models import pp2_check

        pp2_check.run(out, Path(args[0]), Path(args[1]))
    elif check == "layouts":
        from tests.models import layouts_check

        layouts_check.run(out, Path(args[0]), Path(args[1]))
    elif check in ("vision_dp", "nemotron_vision_dp"):
        from tests.models import nemotron_vision_dp_worker, vision_dp_worker

        os.environ["VISION_DP_OUT"] = str(out)
        worker = vision_dp_worker if check == "vision_dp" else nemotron_vision_dp_worker
        worker.main(own_group=False)  # its cases' results are in the rank files
    else:
        raise ValueError(f"unknown check {check!r}")


def main() -> int:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from models.parallel import init_process_group

    init_process_group()
    for item in json.loads(Path(sys.argv[1]).read_text()):
        out = Path(item["out"])
        out.mkdir(parents=True, exist_ok=True)
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        try:
            run_check(item["check"], out, item.get("args", []))
            dist.barrier()
        except BaseException:
            (out / f"FAILED.rank{dist.get_rank()}").write_text(traceback.format_exc())
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # no teardown: the other rank may wait in a collective of this check
        if dist.get_rank() == 0:
            (out / "DONE").write_text("")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
