"""A stage lock in storage: two launchers of the same stage of the same run (two `rlaif run`s, a KFP retry racing
the original pod, an Airflow backfill) would interleave writes; the second refuses instead.

`<run>/<stage>/.lock` names its holder (host, pid, token, owner) and carries a heartbeat that a thread refreshes.
It is created with the store's atomic create-if-absent (a hard link on file://, If-None-Match on S3), so of launchers
started at the same moment exactly one gets it. A lock is taken over when its holder's process is gone (same host),
its heartbeat is older than `stale_after_s` (another host: a killed pod), or it belongs to an earlier attempt of the
same orchestrator step (`RLAIF_LOCK_OWNER`, set by the KFP component and the Airflow tasks: a retry takes its own lock
back instead of refusing itself). A takeover is itself exclusive: one marker per stale token, created atomically.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from rlaif.errors import UserError
from rlaif.io import storage

LOCK = ".lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class StageLock:
    def __init__(self, stage_url: str, what: str, stale_after_s: float = 120.0, heartbeat_s: float = 20.0,
                 owner: str | None = None):
        self.url = storage.join(stage_url, LOCK)
        self.owner = owner if owner is not None else os.environ.get("RLAIF_LOCK_OWNER", "")
        self.what, self.stale_after_s, self.heartbeat_s = what, stale_after_s, heartbeat_s
        self.token = uuid.uuid4().hex
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict | None:
        """The holder's record; None when there is no lock; a one-line error when the file is not a lock record."""
        try:
            held = json.loads(storage.read_bytes(self.url))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError):
            held = None
        fields = {"token": str, "host": str, "pid": int, "started": (int, float), "heartbeat": (int, float)}
        if not isinstance(held, dict) or not all(isinstance(held.get(k), t) for k, t in fields.items()):
            raise UserError(f"lock file {self.url} is corrupt: if no launcher of this stage is running, delete it")
        return held

    def _record(self, started: float) -> bytes:
        return json.dumps({"token": self.token, "host": self.host, "pid": os.getpid(), "owner": self.owner,
                           "started": started, "heartbeat": time.time()}).encode()

    def _write(self, started: float) -> None:
        storage.write_bytes_atomic(self.url, self._record(started))

    def is_stale(self, held: dict) -> bool:
        if self.owner and held.get("owner") == self.owner:  # an earlier attempt of this same step: a retry
            return True
        if held["host"] == self.host:
            return not _pid_alive(held["pid"])
        return time.time() - held["heartbeat"] > self.stale_after_s

    def acquire(self) -> None:
        self._started = time.time()
        for _ in range(5):  # a lock released or taken over between our create and our read: try again
            if storage.create_exclusive(self.url, self._record(self._started)):
                self._thread = threading.Thread(target=self._beat, daemon=True)
                self._thread.start()
                return
            held = self._read()
            if held is None:
                continue
            if not self.is_stale(held):
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held["started"]))
                raise UserError(f"{self.what} is already running (pid {held['pid']} on {held['host']}, since {since}): "
                                f"wait for it to finish, or if that process is gone delete {self.url}")
            marker = f"{self.url}.takeover-{held['token']}"
            if not storage.create_exclusive(marker, self.token.encode()):
                raise UserError(f"{self.what} was taken over by another launcher at the same moment: this one stops")
            storage.remove(self.url)
            storage.remove(marker)
        raise UserError(f"{self.what}: its lock {self.url} keeps changing hands: another launcher is starting it")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                held = self._read()
                if held and held["token"] == self.token:
                    self._write(self._started)
            except Exception:  # storage unreachable for a while: the next beat tries again
                pass

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        try:
            held = self._read()
            if held and held["token"] == self.token:
                storage.remove(self.url)
        except Exception:  # storage unreachable: the lock stays behind, and is stale once this process has exited
            pass

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
