"""A stage lock in storage: two launchers of the same stage of the same run (two `rlaif run`s, a KFP retry racing
the original pod, an Airflow backfill) would interleave writes; the second refuses instead.

`<run>/<stage>/.lock` names its holder (host, pid, token, owner) and carries a heartbeat that a thread refreshes.
It is created with the store's atomic create-if-absent (a hard link on file://, If-None-Match on S3), so of launchers
started at the same moment exactly one gets it. A lock is taken over when its holder's process is gone (same host;
also when its pid names another process now, after a container restart), its heartbeat is older than
`stale_after_s` (another host: a killed pod), or, for an earlier attempt of the same orchestrator step
(`RLAIF_LOCK_OWNER`, set by the KFP component and the Airflow tasks), older than two heartbeats: a retry takes its
own lock back instead of refusing itself. A takeover is itself exclusive (a marker per stale token, created
atomically), and a launcher that died inside its takeover leaves a marker that goes stale like a lock.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from rlaif.errors import UserError
from rlaif.io import storage

LOCK = ".lock"


def _process_start(pid: int) -> str | None:
    """When the process with this pid started (clock ticks since boot, from /proc), or None where that cannot be read:
    with the pid it names one process, not whichever one has the pid after a container restart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


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
        self.pid_start = _process_start(os.getpid())  # written with each heartbeat; read once
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._markers: list[str] = []  # takeover markers this launcher created, removed when it releases

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
        return json.dumps({"token": self.token, "host": self.host, "pid": os.getpid(),
                           "pid_start": self.pid_start, "owner": self.owner, "started": started,
                           "heartbeat": time.time()}).encode()

    def _write(self, started: float) -> None:
        storage.write_bytes_atomic(self.url, self._record(started))

    def is_stale(self, held: dict) -> bool:
        """The holder is gone: on this host its process has exited (or its pid is another process's now, after a
        container restart), elsewhere its heartbeat stopped. An earlier attempt of this same orchestrator step counts
        as gone after two missed heartbeats instead of `stale_after_s` (a retry then starts at once), but never while
        its process is alive on this host."""
        if held["host"] == self.host:
            started = held.get("pid_start")
            return not _pid_alive(held["pid"]) or (started is not None and started != _process_start(held["pid"]))
        same_step = bool(self.owner) and held.get("owner") == self.owner
        return time.time() - held["heartbeat"] > (2 * self.heartbeat_s if same_step else self.stale_after_s)

    def live_holder(self) -> dict | None:
        """The record of a launcher holding this lock now; None when it is free or its holder is gone."""
        held = self._read()
        return None if held is None or self.is_stale(held) else held

    def acquire(self) -> None:
        self._started = time.time()
        try:
            self._acquire()
        except UserError:
            for marker in self._markers:
                storage.remove(marker)
            raise

    def _acquire(self) -> None:
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
            self._take_over(held)
        raise UserError(f"{self.what}: its lock {self.url} keeps changing hands: another launcher is starting it")

    def _take_over(self, stale: dict) -> None:
        """Remove a stale lock, exclusively: one marker per stale token, created atomically and kept (a launcher that
        read the same stale lock later finds it and stops); the lock is removed only if it is still that stale one."""
        marker = f"{self.url}.takeover-{stale['token']}"
        if not storage.create_exclusive(marker, self._record(self._started)):
            try:
                other = json.loads(storage.read_bytes(marker))
            except (FileNotFoundError, ValueError):
                other = None
            if other is None or not self.is_stale({**stale, **other}):
                raise UserError(f"{self.what} was taken over by another launcher at the same moment: this one stops "
                                f"(if none is running, delete {marker})")
            storage.remove(marker)  # a launcher died in its takeover: its marker is stale too
            if not storage.create_exclusive(marker, self._record(self._started)):
                raise UserError(f"{self.what} was taken over by another launcher at the same moment: this one stops")
        current = self._read()
        if current is not None and current["token"] == stale["token"]:
            storage.remove(self.url)
        self._markers.append(marker)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                held = self._read()
                if held and held["token"] == self.token:
                    self._write(self._started)
                elif held:  # taken over while this process was unresponsive: stop claiming it
                    print(f"warning: the lock of {self.what} was taken over by pid {held['pid']} on {held['host']}",
                          flush=True)
                    return
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
            for marker in self._markers:  # the stale tokens they name can no longer be read by anyone
                storage.remove(marker)
        except Exception:  # storage unreachable: the lock stays behind, and is stale once this process has exited
            pass

    def __enter__(self):
        try:
            self.acquire()
        except BaseException:  # Ctrl-C between writing the lock and entering the block: no lock left behind
            self.release()
            raise
        return self

    def __exit__(self, *exc):
        self.release()


def live_holders(run_url: str, stage_names: Iterable[str]) -> Iterator[tuple[str, dict]]:
    """What of a run live processes hold now, each with its holder, read lock by lock: the run itself (`rlaif run`,
    between its stages too) and each of its stages (a first run, or a `--rerun`, which removes the stage's output at
    its start)."""
    held = {"`rlaif run`": run_url, **{f"stage '{name}'": storage.join(run_url, name) for name in stage_names}}
    for what, url in held.items():
        if (holder := StageLock(url, what).live_holder()) is not None:
            yield what, holder
