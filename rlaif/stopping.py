"""How a command stops on SIGINT (Ctrl-C) and SIGTERM (a pod deleted, an Airflow task stopped, `kill`).

The first signal unwinds the command (KeyboardInterrupt or Terminated) through its cleanups: a lock released, a
launcher's children stopped, a service removed, a multi-node job deleted. A second one (Ctrl-C pressed again, the
SIGTERM a launcher sends a stage that also had the terminal's SIGINT) is noted once and ignored: raised inside a
cleanup it would break it off half done, in a traceback. A third ends the process at once, for a cleanup that hangs.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

from rlaif.errors import Terminated

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOPPED_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def stopped(stop: BaseException) -> int:
    """The exit code of a command that the first signal stopped (KeyboardInterrupt or Terminated), said once: in the
    process the user started (a launcher's child, a stage or its ranks, stops quietly, as its launcher says it)."""
    interrupted = isinstance(stop, KeyboardInterrupt)
    _say("interrupted" if interrupted else "terminated")
    return STOPPED_CODES[signal.SIGINT if interrupted else signal.SIGTERM]


def _say(text: str) -> None:
    """One line on stderr that can neither fail nor re-enter a write the signal interrupted: the cleanup it runs
    beside must go on even where stderr's reader is gone (`... 2>&1 | tee log`, and tee had the Ctrl-C too)."""
    if not os.environ.get("RLAIF_ERROR_FILE"):  # a launcher's child: its launcher speaks
        with contextlib.suppress(OSError):
            os.write(2, f"{text}\n".encode())


@contextlib.contextmanager
def stop_signals(on_first=None):
    """The block runs with the stopping above (on the main thread, where handlers can be set; elsewhere as it is).
    `on_first(signum)`, where given, is what the first signal does instead of raising (a service stops serving).
    A SIGINT ignored from the start (a background job of a script) stays ignored, as Python leaves it; the handlers
    found at the start are back after the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    installed: dict[int, object] = {}

    def first(signum, frame):
        received.append(signum)
        for ours in installed:
            signal.signal(ours, later)
        if on_first is not None:
            return on_first(signum)
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated

    def later(signum, frame):
        received.append(signum)
        if len(received) == 2:
            _say(f"still stopping (cleaning up): stop it again to end it at once, its cleanup undone (a lock it "
                 f"leaves is taken over once process {os.getpid()} is gone)")
        else:
            _say("stopped before its cleanup had finished")
            os._exit(STOPPED_CODES[received[0]])

    try:
        for signum in STOP_SIGNALS:
            if signum != signal.SIGINT or signal.getsignal(signum) is not signal.SIG_IGN:
                installed[signum] = signal.signal(signum, first)
        yield
    finally:
        for signum, handler in installed.items():
            if handler is not None:  # None: a handler set from C, which Python cannot put back
                signal.signal(signum, handler)


def ignore_while_exiting() -> None:
    """For the process's last moments (its exit handlers: torch's, Ray's shutdown, a tracker's last flush), once the
    command has returned: a stop signal then would only print a traceback from inside one of them."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
