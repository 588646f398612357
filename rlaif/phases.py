"""A stage's phases timed and their peak memory measured: `with phase("update", row):` puts the phase's seconds in
row["update_s"] and its own peak memory in row["update_rss_mib"] (the process's resident set, Linux) and, on a GPU,
row["update_gpu_mib"] (memory torch allocated; not its cache's reserve or the CUDA context). Phases do not nest.

A phase's own peak: Linux keeps one high-water mark of the resident set per process (VmHWM); writing 5 to
/proc/self/clear_refs sets it back to the current RSS, so the mark read at a phase's end is that phase's peak. That
same mark is what getrusage's ru_maxrss, a parent's wait4 and `/usr/bin/time -v` report: after a phase they show only
the peak since it began. peak_rss_mib() and peak_gpu_mib() count the peaks from before each restart too (a benchmark
reads the whole process's peaks from them); a library that resets torch's GPU peak itself (DeepSpeed's empty_cache)
hides what came before from both.
"""
from __future__ import annotations

import contextlib
import resource
import sys
import threading

import torch

from rlaif.distributed import clock

_peak_before_resets_mib = _gpu_peak_before_resets_mib = 0.0


def _status_mib(field: str) -> float | None:
    """A /proc/self/status memory field (VmHWM, VmRSS) in MiB; None where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024
    except (OSError, StopIteration, ValueError):
        return None


def _gpu_in_use() -> bool:
    """torch has set up a GPU in this process (its peak stats exist); checking never sets one up."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def peak_rss_mib() -> float:
    """This process's peak RSS so far, over every phase. VmHWM, not ru_maxrss: Linux carries that over from the
    parent through fork and exec (a worker would start at its launcher's RSS); ru_maxrss where there is no VmHWM."""
    mark = _status_mib("VmHWM")
    if mark is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024
    return max(mark, _peak_before_resets_mib)


def peak_gpu_mib() -> float:
    """The GPU memory torch has allocated at most in this process so far, over every phase."""
    return max(torch.cuda.max_memory_allocated() / 2**20, _gpu_peak_before_resets_mib)


def _restart_peaks() -> bool:
    """The high-water marks start again from now (RSS and the GPU's allocated memory); False where RSS's cannot."""
    global _peak_before_resets_mib, _gpu_peak_before_resets_mib
    if _gpu_in_use():
        _gpu_peak_before_resets_mib = peak_gpu_mib()
        torch.cuda.reset_peak_memory_stats()
    mark = _status_mib("VmHWM")
    if mark is None:
        return False
    _peak_before_resets_mib = max(_peak_before_resets_mib, mark)
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # 5: the peak RSS only (1-4 would walk the page tables)
    except OSError:  # a kernel or sandbox that refuses it: no phase's own RSS peak is recorded
        return False
    return True


@contextlib.contextmanager
def phase(name: str, row: dict):
    """Times the block into row[f"{name}_s"]; in the main thread also its own peak memory in MiB:
    row[f"{name}_rss_mib"] (where Linux lets the mark restart) and, on a GPU, row[f"{name}_gpu_mib"]. Another
    thread's phases (an asynchronous rollout's) are timed only; they run beside the main thread's, whose peaks then
    include theirs (both marks are the process's)."""
    main_thread = threading.current_thread() is threading.main_thread()
    restarted = main_thread and _restart_peaks()
    start = clock()
    yield
    row[f"{name}_s"] = clock() - start
    if not main_thread:
        return
    if restarted and (mark := _status_mib("VmHWM")) is not None:
        row[f"{name}_rss_mib"] = mark
    if _gpu_in_use():
        row[f"{name}_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20


RL_PHASES = ("generate", "score", "reference", "update")  # a PPO or GRPO iteration's


def phase_peaks(rows: list[dict], names: tuple[str, ...]) -> dict:
    """A stage summary's peak memory by phase over its rows (iterations), in MiB: {"phase_peak_rss_mib": {name:
    MiB}} and, where a GPU's was measured, "phase_peak_gpu_mib"; a phase never measured is left out."""
    peaks = {}
    for kind in ("rss", "gpu"):
        measured = {name: [row[f"{name}_{kind}_mib"] for row in rows if f"{name}_{kind}_mib" in row] for name in names}
        if by_phase := {name: max(values) for name, values in measured.items() if values}:
            peaks[f"phase_peak_{kind}_mib"] = by_phase
    return peaks


def process_peaks() -> dict:
    """A summary's whole-process peaks so far, in MiB (model loading and export included): "peak_rss_mib" and,
    where torch has used a GPU, "peak_gpu_mib"."""
    return {"peak_rss_mib": peak_rss_mib(), **({"peak_gpu_mib": peak_gpu_mib()} if _gpu_in_use() else {})}
