"""Progress of long conversion phases: a tqdm bar on a terminal, one line every `interval`
seconds otherwise (SLURM and other batch logs, which a bar leaves empty until the end).

`phase(text)` prints one line for a step that has no count (planning, statistics, energon
prepare). Everything goes to stderr; the summary on stdout stays machine-readable.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

#: seconds between progress lines when stderr is not a terminal (`--progress-interval`)
DEFAULT_INTERVAL_S = 30.0


def phase(text: str) -> None:
    """One line for a step of the conversion."""
    print(text, file=sys.stderr, flush=True)


class Progress:
    """Counts `update(n)` towards `total`; `close()` prints the final line."""

    def __init__(self, total: int, desc: str, unit: str = "row",
                 interval: float = DEFAULT_INTERVAL_S):
        self.total, self.desc, self.unit, self.interval = total, desc, unit, interval
        self.done = 0
        self.start = self.last = time.monotonic()
        self.bar = tqdm(total=total, unit=unit, desc=desc) if sys.stderr.isatty() else None

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            phase(self._line(now))

    def _line(self, now: float) -> str:
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        eta = (f", ETA {(self.total - self.done) / rate:.0f} s"
               if rate > 0 and self.done < self.total else "")
        return (f"{self.desc}: {self.done}/{self.total} {self.unit}s{share}, "
                f"{rate:.1f} {self.unit}s/s{eta}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            phase(self._line(time.monotonic()))
