"""The `rlaif` program as a process: rlaif.cli.entry ends it without the interpreter's teardown, so what it must
still do at exit is checked here: its exit code, all of its output through a pipe, and the exit handlers."""
import os
import subprocess
import sys
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


STOPPED_TWICE = """
import os, signal, sys, time
from rlaif import cli

def command(args):
    try:
        os.kill(os.getpid(), signal.{first})
        time.sleep(30)
    finally:  # a cleanup (a lock's release, a service's removal) the second signal arrives in
        os.kill(os.getpid(), signal.{second})
        time.sleep(0.2)
        print("cleaned up", flush=True)

cli.COMMANDS["graph"] = command
sys.exit(cli.main(["graph"]))
"""


@pytest.mark.parametrize("first, second, code, said", [("SIGINT", "SIGINT", 130, "interrupted"),
                                                       ("SIGTERM", "SIGINT", 143, "terminated"),
                                                       ("SIGINT", "SIGTERM", 130, "interrupted")])
def test_a_second_stop_signal_does_not_break_off_the_cleanup(first, second, code, said):
    """Ctrl-C pressed again while a command cleans up after the first (or the SIGTERM a pod's deletion sends after
    it) used to raise inside the cleanup: half of it undone and a traceback."""
    done = subprocess.run([sys.executable, "-c", STOPPED_TWICE.format(first=first, second=second)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == code and done.stdout == "cleaned up\n", done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stderr.splitlines() == [
        f"still stopping (cleaning up); kill -9 {done.stderr.split('kill -9 ')[1].split()[0]} ends it at once, "
        "leaving what it had started", said], done.stderr
