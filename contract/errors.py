"""The project's user-facing error types, one of each, shared by every package.

- ``ConfigError``: invalid settings (task encoder config, run config); ``problems`` lists each.
- ``UsageError``: a bad input (arguments, source, data, layout, checkpoint); the CLIs print it as
  one line and exit 2.
- ``MediaError``: a media item that cannot be used; ``reason`` is the reject reason (converters)
  or the skip counter suffix (task encoders).
"""

from __future__ import annotations

import re

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
