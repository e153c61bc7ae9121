"""The project's torchrun: ``python -m recipes.launch [torchrun options] train.py CONFIG ...``.

The same launcher as ``torchrun`` (``torch.distributed.run``, every option), except how a failed
run ends: the ranks' own output says what went wrong (a user error is one line,
``contract/cli.py``; a bug is the rank's traceback), so the launcher adds neither its
``ChildFailedError`` traceback nor its per-rank failure log, and exits with the failed rank's
exit code (2 for a user error). ``OMP_NUM_THREADS`` is 1 per rank unless set, as torchrun does
(without its banner). ``make train-<family>-<dataset> NPROC=<n>`` uses it.
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as error:
        codes = [failure.exitcode for failure in error.failures.values()]
        return next((code for code in codes if code > 0), 1)  # killed peers have negative codes
    return 0


if __name__ == "__main__":
    sys.exit(main())
