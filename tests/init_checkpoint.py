"""Write the random initialisation of a run config's model (built at PP=1, one process) as a
models/convert.py-style dist checkpoint: ``train.init_checkpoint`` of runs that must start from
the same weights at different pipeline layouts (megatron's random init depends on the layout).

    python tests/init_checkpoint.py CONFIG OUT [key=value ...]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv):
    from models.checkpointing.checkpoint import save_checkpoint
    from models.families import build_model
    from models.parallel import init_parallel
    from recipes.run_config import load_run_config

    config, out, overrides = argv[0], Path(argv[1]), argv[2:]
    cfg = load_run_config(config, overrides)
    init_parallel(seed=cfg.train.seed)
    save_checkpoint(build_model(cfg.model, use_te=False), cfg.model, out)


if __name__ == "__main__":  # the guard matters: dist_checkpointing spawns a Manager process
    main(sys.argv[1:])
