"""The stage lock is atomic: of 16 launchers started at the same moment exactly one gets it, on file:// (processes)
and on S3 (a conditional put against moto_server); a retry of the same orchestrator step takes its own lock back; a
live holder's lock is refused; a corrupt lock file is a one-line error."""
import json
import multiprocessing
import threading
import time

import pytest

from rlaif.errors import UserError
from rlaif.io import storage
from rlaif.io.lock import StageLock


def _contend(url: str, barrier, results) -> None:
    barrier.wait()
    lock = StageLock(url, "stage")
    try:
        lock.acquire()
    except UserError:
        results.put(False)
        return
    results.put(True)
    time.sleep(2.0)  # hold it while the others try
    lock.release()


def test_sixteen_launcher_processes_exactly_one_wins(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(16), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(f"file://{tmp_path}/run/label", barrier, results)) for _ in range(16)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    won = [results.get(timeout=5) for _ in procs]
    assert won.count(True) == 1 and not (tmp_path / "run/label/.lock").exists()


def test_sixteen_launchers_on_s3_exactly_one_wins(s3_endpoint):
    endpoint, bucket = s3_endpoint
    storage.configure(endpoint)
    url = f"s3://{bucket}/locks/run{time.time_ns()}/label"
    barrier, won, hosts = threading.Barrier(16), [], []

    def contend(i):
        lock = StageLock(url, "stage")
        lock.host = f"pod-{i}"  # 16 pods: other hosts, fresh heartbeats
        barrier.wait()
        try:
            lock.acquire()
            won.append(lock)
        except UserError:
            hosts.append(i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1 and len(hosts) == 15
    won[0].release()
    assert not storage.exists(storage.join(url, ".lock"))


def _plant(tmp_path, **fields) -> str:
    url = f"file://{tmp_path}/run/ppo"
    record = {"token": "old", "host": "another-pod", "pid": 1, "owner": "", "started": time.time(),
              "heartbeat": time.time(), **fields}
    storage.write_bytes_atomic(f"{url}/.lock", json.dumps(record).encode())
    return url


def test_a_retry_of_the_same_step_takes_its_lock_back(tmp_path):
    # The first attempt's pod died 60 s ago (KFP retries after 60 s): not yet stale for others (120 s)
    url = _plant(tmp_path, owner="kfp:run-7:ppo", heartbeat=time.time() - 60)
    with pytest.raises(UserError, match="already running"):
        StageLock(url, "stage 'ppo'", owner="kfp:run-8:ppo").acquire()  # another run's step: refused
    _plant(tmp_path, owner="kfp:run-7:ppo", heartbeat=time.time() - 5)
    with pytest.raises(UserError, match="already running"):  # the same step, but its pod still beats: refused
        StageLock(url, "stage 'ppo'", owner="kfp:run-7:ppo").acquire()
    _plant(tmp_path, owner="kfp:run-7:ppo", heartbeat=time.time() - 60)
    lock = StageLock(url, "stage 'ppo'", owner="kfp:run-7:ppo")
    lock.acquire()
    assert json.loads((tmp_path / "run/ppo/.lock").read_text())["token"] == lock.token
    lock.release()
    assert not list((tmp_path / "run/ppo").iterdir())  # lock and takeover marker both gone


def test_stale_heartbeat_is_taken_over_and_corrupt_lock_refused(tmp_path):
    url = _plant(tmp_path, heartbeat=time.time() - 600)
    with StageLock(url, "stage") as lock:
        assert json.loads((tmp_path / "run/ppo/.lock").read_text())["token"] == lock.token
    (tmp_path / "run/ppo/.lock").write_bytes(b"\x00garbage")
    with pytest.raises(UserError, match="lock file .* is corrupt"):
        StageLock(url, "stage").acquire()


def test_takeover_is_exclusive_and_a_dead_taker_does_not_block(tmp_path):
    url = _plant(tmp_path, heartbeat=time.time() - 600)
    stale = json.loads((tmp_path / "run/ppo/.lock").read_text())
    first = StageLock(url, "stage")
    first.acquire()
    late = StageLock(url, "stage")  # read the same stale lock before `first` replaced it
    late._started = time.time()
    with pytest.raises(UserError, match="taken over by another launcher"):
        late._take_over(stale)
    assert json.loads((tmp_path / "run/ppo/.lock").read_text())["token"] == first.token  # untouched
    first.release()
    assert not list((tmp_path / "run/ppo").iterdir())

    url = _plant(tmp_path, heartbeat=time.time() - 600)
    marker = tmp_path / "run/ppo/.lock.takeover-old"  # a launcher killed inside its takeover (dead pid, this host)
    marker.write_text(json.dumps({"token": "t2", "host": StageLock(url, "x").host, "pid": 2**22 + 7, "owner": "",
                                  "started": time.time(), "heartbeat": time.time()}))
    with StageLock(url, "stage"):
        pass
    assert not list((tmp_path / "run/ppo").iterdir())


def test_a_lock_whose_pid_is_another_process_now_is_stale(tmp_path):
    """After a container restart the lock's pid names another live process on the same host name: the process's start
    time tells them apart (the stage was blocked for good before); a live holder with an old heartbeat (a slow store,
    a stopped terminal) keeps its lock."""
    import os

    from rlaif.io.lock import _process_start

    host, me = StageLock(f"file://{tmp_path}", "x").host, os.getpid()
    url = _plant(tmp_path, host=host, pid=me, pid_start=_process_start(me), heartbeat=time.time() - 600)
    with pytest.raises(UserError, match="already running"):
        StageLock(url, "stage").acquire()
    _plant(tmp_path, host=host, pid=me, pid_start="1", heartbeat=time.time() - 5)
    with StageLock(url, "stage") as lock:
        assert json.loads((tmp_path / "run/ppo/.lock").read_text())["token"] == lock.token
