"""What the command-line tools print besides their results: durations, progress (one style for
every command), and known third-party warnings kept off the console.

- ``format_duration``: seconds as ``H:MM:SS`` (or ``M:SS``).
- ``Progress``: progress of long work. In a log (the stream is not a terminal: SLURM and other
  batch logs, which a bar leaves empty until the end) one line every ``every`` seconds,
  ``[eval] 40/100 conversations (112 questions answered), 40%, 1.2 conversations/s, 0:32
  elapsed, ETA 0:48``, and for work counted towards a ``total`` given up front a last line at
  ``close()``; on a terminal that counted work is a tqdm bar instead. ``heartbeat()`` is for work
  that cannot count itself: ``[convert] hf-to-mcore: still running, 1:30 elapsed`` in a log.
- ``phase``: one line for a step that has no count (``planning: ...``), on stderr.
- ``KnownWarnings``: the warnings megatron-core / torch / Energon print on every CPU or
  TE-less run (fallbacks, deprecations of their own internals) are counted instead of shown;
  ``summary()`` says how many. Every other warning is shown as usual.

The converters print to stderr (their stdout is the machine-readable summary), eval.py to stdout,
``models.convert`` to stderr.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings

#: seconds between progress lines in a log (``--progress-interval``, ``--progress-every``)
DEFAULT_EVERY_S = 30.0

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
    "you have no need to set 'core_attn' to recompute",  # megatron, selective recompute
)


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def eta(elapsed: float, done: int, total: int) -> str:
    """Time left at the mean rate so far ("?" before the first unit of work)."""
    return format_duration(elapsed / done * (total - done)) if done else "?"


def phase(text: str, stream=None) -> None:
    """One line for a step of long work that has no count (stderr unless ``stream``)."""
    print(text, file=stream or sys.stderr, flush=True)


def _rate(rate: float) -> str:
    return f"{rate:.1f}" if rate >= 1 else f"{rate:.2g}"


class Progress:
    """Progress of long work under ``label``, to ``stream`` (stdout unless given).

    ``update(done, total)`` sets the count (``advance(n)`` adds to it) and prints a line at most
    every ``every`` seconds when the stream is not a terminal (or with ``always``). Given a
    ``total`` up front, the work is counted towards it: ``close()`` prints the last line (a tqdm
    bar replaces the lines on a terminal). ``heartbeat(what)`` starts a thread that prints
    "still running" lines until ``stop()`` / ``close()``; a context manager closes.
    """

    def __init__(self, label: str, every: float = DEFAULT_EVERY_S, *, total: int | None = None,
                 unit: str = "", always: bool = False, stream=None):
        self.label, self.every, self.total, self.unit = label, every, total, unit
        self.stream = stream or sys.stdout
        tty = self.stream.isatty()
        self.enabled = always or not tty
        self.done, self.extra = 0, ""
        self.start = self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar = None
        self._counted = total is not None
        if self._counted and tty and not always:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit=unit.removesuffix("s") or "it", desc=label,
                             file=self.stream)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def line(self) -> str:
        """The progress line of the count so far."""
        elapsed = self.elapsed()
        total, unit = self.total, f" {self.unit}" if self.unit else ""
        count = f"{self.done}/{total}" if total is not None else f"{self.done}"
        parts = [f"[{self.label}] {count}{unit}{self.extra}"]
        if total:
            parts.append(f"{100 * self.done / total:.0f}%")
        if elapsed > 0:
            parts.append(f"{_rate(self.done / elapsed)}{unit or ' units'}/s")
        parts.append(f"{format_duration(elapsed)} elapsed")
        if total and self.done < total:
            parts.append(f"ETA {eta(elapsed, self.done, total)}")
        return ", ".join(parts)

    def update(self, done: int, total: int | None = None, unit: str | None = None,
               extra: str = "") -> None:
        """Set the count to ``done`` (of ``total`` ``unit``, ``extra`` after them)."""
        if self._bar is not None:
            self._bar.update(done - self.done)
        self.done, self.extra = done, extra
        if total is not None:
            self.total = total
        if unit is not None:
            self.unit = unit
        now = time.monotonic()
        if self._bar is not None or not self.enabled or now - self._last < self.every:
            return
        self._last = now
        print(self.line(), file=self.stream, flush=True)

    def advance(self, n: int = 1) -> None:
        """Add ``n`` to the count."""
        self.update(self.done + n)

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
        """End the heartbeat."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """End the heartbeat; for counted work the bar, or the last line in a log."""
        self.stop()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._counted and self.enabled:
            print(self.line(), file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


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
