"""What the command-line tools print besides their results: durations, periodic progress for
logs that are not a terminal, and known third-party warnings kept off the console.

- ``format_duration``: seconds as ``H:MM:SS`` (or ``M:SS``).
- ``Progress``: one line every ``every`` seconds of long work (``[eval] 40/100 conversations,
  0:32 elapsed, ETA 0:48``) when stdout is not a TTY (SLURM logs), plus a heartbeat thread for
  work that cannot count itself (``[convert] hf-to-mcore: still running, 1:30 elapsed``).
- ``KnownWarnings``: the warnings megatron-core / torch / Energon print on every CPU or
  TE-less run (fallbacks, deprecations of their own internals) are counted instead of shown;
  ``summary()`` says how many. Every other warning is shown as usual.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings

#: Substrings of third-party warnings that say nothing actionable about a run (each seen on
#: every CPU run of train.py / eval.py / models.convert here: TE-less fallbacks of megatron-core,
#: torch deprecations of the internals megatron-core and torch DCP call).
KNOWN_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed. Falling back to Torch Norm",
    "'pin_memory' argument is set as true but no accelerator is found",
    "full scope is deprecated. Use empty cuda_graph_scope",
    "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "Please use DTensor instead and we are deprecating ShardedTensor",
    "`load_state_dict` is deprecated and will be removed in future versions",
)


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def eta(elapsed: float, done: int, total: int) -> str:
    """Time left at the mean rate so far ("?" before the first unit of work)."""
    return format_duration(elapsed / done * (total - done)) if done else "?"


class Progress:
    """Periodic one-line progress of long work, for logs that are not a terminal.

    ``update(done, total)`` prints at most every ``every`` seconds; ``heartbeat()`` starts a
    thread that prints "still running" lines until ``stop()`` (a context manager does both).
    Lines go to ``stream`` (stdout); on a TTY nothing periodic is printed unless ``always``.
    """

    def __init__(self, label: str, every: float = 30.0, *, always: bool = False, stream=None):
        self.label, self.every = label, every
        self.stream = stream or sys.stdout
        self.enabled = always or not self.stream.isatty()
        self.start = self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def update(self, done: int, total: int | None = None, unit: str = "", extra: str = "") -> None:
        now = time.monotonic()
        if not self.enabled or now - self._last < self.every:
            return
        self._last = now
        count = f"{done}/{total}" if total else f"{done}"
        left = f", ETA {eta(self.elapsed(), done, total)}" if total else ""
        print(f"[{self.label}] {count} {unit}{extra}, {format_duration(self.elapsed())} "
              f"elapsed{left}", file=self.stream, flush=True)

    def heartbeat(self, what: str) -> Progress:
        if self.enabled and self._thread is None:
            def beat():
                while not self._stop.wait(self.every):
                    print(f"[{self.label}] {what}: still running, "
                          f"{format_duration(self.elapsed())} elapsed", file=self.stream,
                          flush=True)

            self._thread = threading.Thread(target=beat, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()


class KnownWarnings:
    """Count the known third-party warnings instead of showing them (``KNOWN_WARNINGS``)."""

    def __init__(self, enabled: bool = True):
        self.count = 0
        self._show = warnings.showwarning
        if enabled:
            warnings.showwarning = self._filter

    def _filter(self, message, category, filename, lineno, file=None, line=None) -> None:
        if any(known in str(message) for known in KNOWN_WARNINGS):
            self.count += 1
            return
        self._show(message, category, filename, lineno, file, line)

    def summary(self, how_to_show: str) -> str:
        """One line: how many were hidden and how to see them ("" when none)."""
        if not self.count:
            return ""
        return (f"{self.count} known third-party warning(s) hidden (TransformerEngine / Apex "
                f"fallbacks, torch deprecations); {how_to_show} shows them")
