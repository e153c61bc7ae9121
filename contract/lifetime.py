"""Every process of a run ends with it: a child asks the kernel for SIGKILL when its parent dies.

``die_with_parent`` is what each child of the project's commands calls first (converter workers,
train.py's loader workers, train.py's ranks under torchrun): Linux's ``PR_SET_PDEATHSIG``, so a
``kill -9`` of the parent (or of torchrun) leaves no worker behind that keeps reading, writing
shards or holding a port. A parent that died before the call (the race between ``fork`` and
``prctl``) ends the child at once. Elsewhere than Linux it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> bool:
    """SIGKILL this process when its parent dies; ``parent``: the pid it was forked from (to
    catch a parent that died already). Returns whether the kernel took the request."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        taken = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if taken and parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)  # the parent is gone already
    return taken


class WithParent:
    """A worker_init_fn (torch DataLoader) that calls ``die_with_parent`` first, then ``inner``."""

    def __init__(self, inner=None):
        self.inner, self.parent = inner, os.getpid()

    def __call__(self, worker_id: int) -> None:
        die_with_parent(self.parent)
        if self.inner is not None:
            self.inner(worker_id)
