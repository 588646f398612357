"""A stage lock in storage: two launchers of the same stage of the same run (two `rlaif run`s, a KFP retry racing
the original pod, an Airflow backfill) would interleave writes; the second refuses instead.

`<run>/<stage>/.lock` names its holder (host, pid, token) and carries a heartbeat that a thread refreshes. A lock
is stale, and taken over, when its holder's process is gone (same host) or its heartbeat is older than
`stale_after_s` (another host: a killed pod), so a kill -9 never blocks the resume.
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
    def __init__(self, stage_url: str, what: str, stale_after_s: float = 120.0, heartbeat_s: float = 20.0):
        self.url = storage.join(stage_url, LOCK)
        self.what, self.stale_after_s, self.heartbeat_s = what, stale_after_s, heartbeat_s
        self.token = uuid.uuid4().hex
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict | None:
        try:
            return json.loads(storage.read_bytes(self.url))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def _write(self, started: float) -> None:
        record = {"token": self.token, "host": self.host, "pid": os.getpid(), "started": started, "heartbeat": time.time()}
        storage.write_bytes_atomic(self.url, json.dumps(record).encode())

    def is_stale(self, held: dict) -> bool:
        if held["host"] == self.host:
            return not _pid_alive(held["pid"])
        return time.time() - held["heartbeat"] > self.stale_after_s

    def acquire(self) -> None:
        held = self._read()
        if held and not self.is_stale(held):
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held["started"]))
            raise UserError(f"{self.what} is already running (pid {held['pid']} on {held['host']}, since {since}): wait for "
                            f"it to finish, or if that process is gone delete {self.url}")
        self._write(time.time())
        if (mine := self._read()) is None or mine["token"] != self.token:  # another launcher won the race
            raise UserError(f"{self.what} was started by another launcher at the same moment: this one stops")
        self._started = mine["started"]
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

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
