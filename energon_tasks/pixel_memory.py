"""How a loader process gets the memory of its pixel buffers (``keep_freed_memory``).

A sample's float32 pixel rows are large: ten 650-px photos at Qwen3-VL's geometry are 100 MB
(every pixel twice: the two temporal slots of an image), a 16K-visual-token page 400 MB. glibc's
malloc serves a request above its mmap threshold (dynamic, at most 32 MB by default) with fresh
pages from the kernel, which zeroes each one at its first touch, and gives them back at ``free``:
every sample paid the zeroing and a page fault per page on top of writing its rows
(``bench/bench_patch_rows.py``: about 1 ms per 6 MB; a third of the project's CPU time on a
Mantis-like sample at Qwen3-VL's geometry).

``keep_freed_memory`` raises glibc's mmap and trim thresholds to ``KEEP_BYTES`` once per process
(loader workers are forked or spawned after the task encoder is built, so each one sets its own
on its first sample), so a freed buffer's pages stay in the process and the next sample's
buffers reuse them, already mapped. What it costs: a process keeps up to ``KEEP_BYTES`` of freed
heap instead of returning it to the kernel, i.e. its resident size stays at the peak its largest
samples reached. Elsewhere than glibc (musl, macOS) it does nothing. The task encoder calls it
before it allocates a sample's pixel rows (``VLMTaskEncoder.assemble``).
"""

from __future__ import annotations

import ctypes
import os

#: buffers up to this size come from the reused heap; also the freed heap a process may keep
KEEP_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_decided: tuple[int, bool] | None = None  # (the process, whether its allocator was set)


def keep_freed_memory() -> bool:
    """Set this process's allocator as the module docstring says (once per process); whether it
    is set (False: the C library has no ``mallopt``, e.g. not glibc)."""
    global _decided
    pid = os.getpid()
    if _decided is None or _decided[0] != pid:
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's own C library
        done = mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(
            mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))
        _decided = (pid, done)
    return _decided[1]
