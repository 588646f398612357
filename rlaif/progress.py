"""Progress that suits where it runs: a tqdm bar on a terminal; in logs (KFP and Airflow task logs, CI, a file) one
plain line on stdout every `every_s` seconds and at the end, never carriage-return frames (stderr stays for errors)."""
from __future__ import annotations

import sys
import time


def progress(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it", disable: bool = False,
             initial: int = 0, every_s: float = 30.0):
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, disable=disable, initial=initial)
    return LogProgress(iterable, total, desc, unit, disable, initial, every_s)


class LogProgress:
    """The subset of tqdm the stages use (iterate, update, set_postfix, close), as plain log lines."""

    def __init__(self, iterable, total, desc, unit, disable, initial, every_s):
        self.iterable, self.desc, self.unit, self.disable, self.every_s = iterable, desc, unit, disable, every_s
        self.total = total if total is not None else (len(iterable) + initial if hasattr(iterable, "__len__") else None)
        self.n, self.postfix, self.start = initial, "", time.time()
        self.last = self.start
        self.closed = False

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update()
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.time() - self.last >= self.every_s:
            self._line()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line()

    def _line(self) -> None:
        self.last = time.time()
        if self.disable:
            return
        of = f"/{self.total}" if self.total else ""
        rate = self.n / max(self.last - self.start, 1e-9)
        extra = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {self.n}{of} {self.unit} "
              f"({rate:.2f} {self.unit}/s, {self.last - self.start:.0f} s{extra})",
              flush=True)
