"""energon_tasks.pixel_memory: a freed pixel buffer's pages are reused by the next sample's."""

import subprocess
import sys

import pytest

#: a process that fills a 96 MB float32 buffer, frees it, fills a new one, and prints the minor
#: page faults of the second fill (argv[1] == "keep": after keep_freed_memory)
SECOND_FILL_FAULTS = """
import resource, sys
import numpy as np
from energon_tasks.pixel_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for round_ in range(2):
    before = faults()
    buffer = np.empty((4096, 6144), dtype=np.float32)
    buffer.fill(1.0)
    spent = faults() - before
    del buffer
print(spent)
"""


def _second_fill_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", SECOND_FILL_FAULTS, mode], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_buffer_is_reused_without_page_faults():
    fresh, kept = _second_fill_faults("default"), _second_fill_faults("keep")
    assert fresh > 40  # glibc's default: fresh pages again (4 KB or 2 MB ones), each faulted
    assert kept < fresh / 10  # kept: the freed pages, already mapped
