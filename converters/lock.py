"""A lock file that works on shared filesystems (NFS, Lustre, GPFS), for runs into one `--out`.

`RunLock(path)` creates `path` with O_CREAT | O_EXCL (atomic on the shared filesystems multi-machine
runs use, where `flock` may be missing or local to one client) holding who owns it: host, pid, the
process start time, and a heartbeat that a background thread refreshes every `HEARTBEAT_S`. It is
released (the file removed) on every exit path Python sees (return, exception, SIGINT / SIGTERM
turned into exceptions); after a kill -9 or a crashed machine it stays behind and is detected as
stale: on the same host when its process is gone (pid and start time no longer match), on another
host when its heartbeat is older than `STALE_AFTER_S`. A stale lock is taken over (one line says
so); a live one refuses with one line naming its owner.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import psutil

HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0


class LockedError(Exception):
    """The lock is held by a live run; the message names it."""


def _me() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid,
            "started": psutil.Process(pid).create_time(), "token": uuid.uuid4().hex}


def _alive_here(owner: dict) -> bool:
    try:
        return abs(psutil.Process(owner["pid"]).create_time() - owner["started"]) < 1e-3
    except (psutil.Error, KeyError, TypeError):
        return False


def stale_reason(owner: dict, age_s: float) -> str | None:
    """Why a lock held by `owner` (heartbeat `age_s` seconds ago) is stale; None if it is live."""
    if not owner.get("host"):  # not written yet, or its writer died between create and write
        return "its lock file is unreadable" if age_s > HEARTBEAT_S else None
    if owner.get("host") == socket.gethostname():
        return None if _alive_here(owner) else f"process {owner.get('pid')} is gone"
    if age_s > STALE_AFTER_S:
        return f"no heartbeat from {owner.get('host')} for {age_s:.0f} s"
    return None


class RunLock:
    """`with RunLock(path, what="partition 0"):` (see the module docstring).

    Args:
        path: the lock file.
        what: what the lock protects, for messages.
        notify: called with one line when a stale lock is taken over.
    """

    def __init__(self, path: Path, what: str, notify=print):
        self.path, self.what, self.notify = Path(path), what, notify
        self.owner = _me()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write_new(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.owner))
        return True

    def _read(self) -> tuple[dict, float] | None:
        try:
            text = self.path.read_text()
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        try:
            owner = json.loads(text)
        except json.JSONDecodeError:  # being written this very moment, or its writer was killed
            owner = {}
        return (owner if isinstance(owner, dict) else {}), age

    @staticmethod
    def _read_aside(path: Path) -> dict:
        try:
            moved = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return moved if isinstance(moved, dict) else {}

    def acquire(self) -> None:
        """Raises LockedError when a live run holds the lock."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            if self._write_new():
                self._start_heartbeat()
                return
            held = self._read()
            if held is None:
                continue  # released meanwhile: try again
            owner, age = held
            reason = stale_reason(owner, age)
            if reason is None:
                raise LockedError(f"{self.what} is in use by pid {owner.get('pid')} on "
                                  f"{owner.get('host')} (lock {self.path}); wait for it or stop it")
            # take over: move the stale file aside under a unique name, check it is the one read
            aside = self.path.with_name(f"{self.path.name}.stale-{self.owner['token']}")
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                continue
            moved = self._read_aside(aside)
            if moved.get("token") != owner.get("token"):  # a live lock taken meanwhile: put back
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
                aside.unlink(missing_ok=True)
                raise LockedError(f"{self.what}: another run took the lock {self.path} at the "
                                  "same moment; try again")
            aside.unlink(missing_ok=True)
            self.notify(f"note: taking over the stale lock of {self.what} ({reason})")
        raise LockedError(f"{self.what}: could not take the lock {self.path}")

    def _start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    os.utime(self.path)
                except OSError:
                    return

        self._thread = threading.Thread(target=beat, name="lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        held = self._read()
        if held is not None and held[0].get("token") == self.owner["token"]:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
