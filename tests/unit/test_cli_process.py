"""The `rlaif` program as a process: rlaif.cli.entry ends it without the interpreter's teardown, so what it must
still do at exit is checked here: its exit code, all of its output through a pipe, and the exit handlers."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlaif.cli import main

REPO = Path(__file__).resolve().parents[2]
BUFFERED = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # block-buffered stdout, as in a pod's log


def run_entry(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`rlaif ARGV` through entry(), after torch is loaded (as in a stage) and an exit handler is registered that
    writes a file, as Ray's shutdown or a tracker's last flush would act at exit."""
    marker = tmp_path / "exit-handler-ran"
    program = (f"import atexit, sys, torch; atexit.register(lambda: open({str(marker)!r}, 'w').write('ran')); "
               f"sys.argv = ['rlaif', *{list(argv)!r}]; from rlaif.cli import entry; entry()")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, env=BUFFERED, capture_output=True, text=True,
                          timeout=120)
    return done, marker


def test_a_command_that_succeeds_leaves_all_its_output_and_runs_the_exit_handlers(tmp_path, capsys):
    assert main(["config"]) == 0
    expected = capsys.readouterr().out
    assert len(expected) > 16384  # more than a pipe's buffer: a lost flush would cut it
    done, marker = run_entry(tmp_path, "config")
    assert done.returncode == 0 and done.stdout == expected, done.stderr[-2000:]
    assert marker.read_text() == "ran"


def test_a_user_error_keeps_exit_code_2_and_its_one_line(tmp_path):
    done, marker = run_entry(tmp_path, "run", "--config", str(tmp_path / "missing.yaml"))
    assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert marker.read_text() == "ran"


def test_python_dash_m_rlaif_and_the_console_script_go_through_entry():
    main_module = (REPO / "rlaif/__main__.py").read_text()
    assert "entry()" in main_module
    done = subprocess.run([sys.executable, "-m", "rlaif", "graph"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("generate") and "evaluate" in done.stdout
    script = Path(sys.executable).parent / "rlaif"
    assert "from rlaif.cli import entry" in script.read_text()


def test_an_output_that_cannot_be_written_ends_in_code_120_and_a_closed_one_in_the_commands_own(tmp_path):
    """As Python's own exit: a last flush that fails (a full disk: /dev/full; `graph` prints less than the buffer, so
    nothing is written before it) is not a success; a process started with stdout closed (`rlaif graph >&-`) writes
    nowhere and ends with the command's code."""
    program = "import sys; sys.argv = ['rlaif', 'graph']; from rlaif.cli import entry; entry()"
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-c", program], cwd=REPO, env=BUFFERED, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    assert done.returncode == 120 and "error: the output could not be written" in done.stderr, done.stderr[-2000:]
    closed = subprocess.run([sys.executable, "-c", program], cwd=REPO, env=BUFFERED,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60,
                            preexec_fn=lambda: os.close(1))
    assert closed.returncode == 0 and "Traceback" not in closed.stderr, closed.stderr[-2000:]


def test_work_queued_on_a_thread_pool_is_finished_before_the_process_ends(tmp_path):
    """A non-daemon thread still working at the end (a pool's queued task): the usual exit, which waits for it."""
    done_file = tmp_path / "queued-work-done"
    program = ("import sys, time; from concurrent.futures import ThreadPoolExecutor; pool = ThreadPoolExecutor(1); "
               f"pool.submit(lambda: (time.sleep(1), open({str(done_file)!r}, 'w').write('done'))); "
               "sys.argv = ['rlaif', 'graph']; from rlaif.cli import entry; entry()")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done_file.read_text() == "done", done.stderr[-2000:]


STOPPED = """
import os, signal, sys, time
from rlaif import cli

def command(args):
    print(os.getpid(), flush=True)
    try:
        os.kill(os.getpid(), signal.{first})
        time.sleep(30)
    finally:  # a cleanup (a lock's release, a service's removal) the later signals arrive in
        for again in {later}:
            os.kill(os.getpid(), getattr(signal, again))
            time.sleep(0.2)
        print("cleaned up", flush=True)

cli.COMMANDS["graph"] = command
sys.exit(cli.main(["graph"]))
"""


def stopped(first: str, later: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, str]:
    done = subprocess.run([sys.executable, "-c", STOPPED.format(first=first, later=later)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    return done, done.stdout.split("\n")[0]


@pytest.mark.parametrize("first, second, code, said", [("SIGINT", "SIGINT", 130, "interrupted"),
                                                       ("SIGTERM", "SIGTERM", 143, "terminated"),
                                                       ("SIGTERM", "SIGINT", 143, "terminated"),
                                                       ("SIGINT", "SIGTERM", 130, "interrupted")])
def test_a_second_stop_signal_does_not_break_off_the_cleanup(first, second, code, said):
    """Ctrl-C pressed again while a command cleans up after the first (or the SIGTERM a pod's deletion sends after
    it) used to raise inside the cleanup: half of it undone and a traceback."""
    done, pid = stopped(first, [second])
    assert done.returncode == code and done.stdout == f"{pid}\ncleaned up\n", done.stderr[-2000:]
    assert done.stderr.splitlines() == [
        f"still stopping (cleaning up): stop it again to end it at once, its cleanup undone (a lock it leaves is "
        f"taken over once process {pid} is gone)", said], done.stderr


def test_a_third_ends_the_process_at_once_and_a_launchers_child_stays_quiet():
    done, pid = stopped("SIGINT", ["SIGINT", "SIGTERM", "SIGINT"])
    assert done.returncode == 130 and done.stdout == f"{pid}\n", done.stderr  # its cleanup never finished
    assert done.stderr.splitlines()[-1] == "stopped before its cleanup had finished", done.stderr
    quiet, _ = stopped("SIGTERM", ["SIGINT"], env={**os.environ, "RLAIF_ERROR_FILE": "/dev/null"})
    assert quiet.returncode == 143 and quiet.stdout.endswith("cleaned up\n") and not quiet.stderr, quiet.stderr


def test_the_handlers_are_put_back_and_an_ignored_sigint_stays_ignored():
    """A background job of a script starts with SIGINT ignored; main() in a process that goes on (a test, a caller)
    leaves the handlers it found."""
    import signal

    from rlaif.errors import Terminated
    from rlaif.stopping import stop_signals

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with stop_signals():
        assert signal.getsignal(signal.SIGINT) is not before[0]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(Terminated), stop_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == before[1]
    finally:
        signal.signal(signal.SIGINT, before[0])


def test_a_stop_note_that_cannot_be_written_does_not_break_off_the_cleanup():
    """`rlaif run ... 2>&1 | tee log`: tee had the Ctrl-C too, so the note's write fails."""
    program = STOPPED.format(first="SIGINT", later=["SIGINT"]).replace(
        "    print(os.getpid(), flush=True)\n", "    print(os.getpid(), flush=True); os.close(2)\n")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.endswith("cleaned up\n"), done


@pytest.mark.parametrize("signals", [("SIGINT", "SIGINT"), ("SIGTERM", "SIGINT")])
def test_a_service_without_ray_stops_gracefully_on_two_signals(signals, tmp_path):
    """uvicorn's own handlers forced an exit on the second signal: requests in flight failed with HTTP 500, and the
    signals it re-raised into the CLI's handlers ended in ~290 lines of tracebacks and exit code 0 after a SIGTERM."""
    import json
    import signal
    import socket
    import threading
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "rlaif", "serve", "--config", "configs/tiny.yaml", "--no-ray",
                               "--set", f"serve.port={port}"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    base, deadline = f"http://127.0.0.1:{port}/v1", time.monotonic() + 120
    while True:
        assert server.poll() is None and time.monotonic() < deadline, server.communicate()
        try:
            urllib.request.urlopen(base + "/models", timeout=2).read()
            break
        except OSError:
            time.sleep(0.2)
    answers = []

    def ask():
        body = json.dumps({"model": "rlaif-policy", "prompt": ["How do tides work?"] * 8, "max_tokens": 64,
                           "seed": 1}).encode()
        request = urllib.request.Request(base + "/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answers.append(response.status)

    clients = [threading.Thread(target=ask) for _ in range(3)]
    for client in clients:
        client.start()
    time.sleep(0.05)
    for name in signals:
        server.send_signal(getattr(signal, name))
        time.sleep(0.1)
    for client in clients:
        client.join(timeout=120)
    _, err = server.communicate(timeout=120)
    assert server.returncode == 0 and answers == [200] * 3, (answers, err[-3000:])
    assert "Traceback" not in err and err.startswith("still stopping"), err[-3000:]


def test_a_stop_signal_during_the_exit_handlers_is_ignored(tmp_path):
    """After the command returned, a second Ctrl-C landed in torch's exit handlers: 'Exception ignored in atexit
    callback ... KeyboardInterrupt' and its traceback."""
    marker = tmp_path / "exit-handler-ran"
    program = ("import atexit, os, signal, sys, time\n"
               "def handler():\n"
               "    os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
               f"    open({str(marker)!r}, 'w').write('ran')\n"
               "atexit.register(handler)\n"
               "sys.argv = ['rlaif', 'graph']; from rlaif.cli import entry; entry()")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr and marker.read_text() == "ran", done.stderr[-2000:]
