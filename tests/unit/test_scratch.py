"""A stage's local scratch (rlaif/scratch.py): the launcher's is its processes' TMPDIR and goes after them, even
when they fail; one a killed launcher left is removed by the next launcher on the machine, and no other is; a stage
process under a launcher nests no second directory; the kernel cache stays in the machine's temp directory."""
import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest

from rlaif import scratch


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """The machine's temp directory, as a launcher started from a shell sees it."""
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.delenv(scratch.MACHINE_TMPDIR, raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_launchers_scratch_is_its_processes_tmpdir_and_goes_even_when_they_fail(machine):
    with pytest.raises(RuntimeError), scratch.for_processes("ppo", {"KEEP": "1"}) as env:
        made = env["TMPDIR"]
        assert os.path.dirname(made) == str(machine) and os.path.basename(made).startswith("rlaif-ppo-")
        assert env["KEEP"] == "1" and env[scratch.MACHINE_TMPDIR] == str(machine)
        assert os.path.dirname(env["TORCHINDUCTOR_CACHE_DIR"]) == str(machine)  # not inside the scratch
        (machine / made / "torchelastic_x").mkdir()
        raise RuntimeError("the stage failed")
    assert not os.path.exists(made)


def test_a_killed_launchers_scratch_is_removed_by_the_next_and_no_other(machine):
    def left(name: str, owner: dict | None) -> object:
        path = machine / name
        path.mkdir()
        if owner is not None:
            (path / scratch.OWNER).write_text(json.dumps(owner))
        return path

    host = socket.gethostname()
    orphan = left("rlaif-train_rm-a", {"host": host, "pid": dead_pid()})
    running = left("rlaif-ppo-b", {"host": host, "pid": os.getpid()})
    elsewhere = left("rlaif-ppo-c", {"host": host + "-other", "pid": dead_pid()})
    by_hand = left("rlaif-generate-d", None)  # a stage process's own: its process removes it
    damaged = left("rlaif-label-e", None)
    (damaged / scratch.OWNER).write_text("{not json")
    with scratch.for_processes("label", {}) as env:
        pass
    assert not orphan.exists() and not os.path.exists(env["TMPDIR"])
    assert running.exists() and elsewhere.exists() and by_hand.exists() and damaged.exists()


def test_a_stage_under_a_launcher_nests_no_second_directory(machine, monkeypatch):
    with scratch.for_processes("generate", {}) as env:
        for name in ("TMPDIR", scratch.MACHINE_TMPDIR):  # as the stage's process starts with them
            monkeypatch.setenv(name, env[name])
        monkeypatch.setattr(tempfile, "tempdir", None)
        with scratch.in_process("generate"):
            assert tempfile.gettempdir() == env["TMPDIR"]
            assert scratch.machine_temp_dir() == str(machine)
        assert sorted(os.listdir(env["TMPDIR"])) == [scratch.OWNER]


def test_a_stage_by_hand_has_its_own_scratch_and_names_the_machines_temp_directory(machine):
    with scratch.in_process("ppo"):
        inside = tempfile.gettempdir()
        assert os.path.dirname(inside) == str(machine) and scratch.machine_temp_dir() == str(machine)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(machine / "torchinductor_"))
    assert not os.path.exists(inside) and tempfile.gettempdir() == str(machine)
    assert scratch.machine_temp_dir() == str(machine)


def test_a_user_without_a_name_still_gets_a_kernel_cache(machine, monkeypatch):
    def no_name():
        raise KeyError("getpwuid(): uid not found: 1234")

    monkeypatch.setattr(scratch.getpass, "getuser", no_name)
    with scratch.for_processes("ppo", {}) as env:
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(machine / f"torchinductor_{os.getuid()}")
