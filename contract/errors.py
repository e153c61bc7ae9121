"""The project's user-facing error types, one of each, shared by every package.

- ``ConfigError``: invalid settings (task encoder config, run config); ``problems`` lists each.
- ``UsageError``: a bad input (arguments, source, data, layout, checkpoint); the CLIs print it as
  one line and exit 2.
- ``MediaError``: a media item that cannot be used; ``reason`` is the reject reason (converters)
  or the skip counter suffix (task encoders).
- ``RunFailure``: a run stopped by its environment, neither bad input nor a bug (a full disk, a
  dead worker, a signal); the CLIs print it as one line and exit with its ``exit_code``.
  ``disk_full`` says whether an ``OSError`` is a write that failed for lack of space (a full
  disk, a quota, a file-size limit: ``FULL_DISK``), which each writer turns into one.

``contract/cli.py`` prints each as ``<prog>: error: <message>``; any other exception is a bug
and stays a traceback.
"""

from __future__ import annotations

import errno
import re

#: the errnos of a write that failed for lack of space: a full disk, a quota, a file-size limit
FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full(error: BaseException) -> bool:
    """``error`` is an ``OSError`` of a write that failed for lack of space (``FULL_DISK``)."""
    return isinstance(error, OSError) and error.errno in FULL_DISK

_ADDRESS = re.compile(r" ?<[^<>]* at 0x[0-9a-fA-F]+>")


class ConfigError(ValueError):
    """One or more settings are invalid; the message lists every problem, ``problems`` each."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = [message] if problems is None else list(problems)


class UsageError(Exception):
    """A bad input (arguments, source, data, layout, checkpoint): one line, exit code 2."""


class MediaError(Exception):
    """A media item cannot be used; ``reason`` names why (a reject reason or a skip counter)."""

    def __init__(self, reason: str, detail: str) -> None:
        detail = _ADDRESS.sub("", detail)  # object addresses would make logs / rejects unstable
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class RunFailure(Exception):
    """The run cannot go on for a reason outside its input and its code (a full disk, a dead
    worker, a signal): one line, exit code ``exit_code`` (1 unless given)."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
